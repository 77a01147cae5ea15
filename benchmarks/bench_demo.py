"""Issues 6 and 10: the scheduler demo's throughput, as ratios.

Four demo configurations (KV pages, prompt KV by transfer, client aborts)
run back to back, their order rotated each round, on one event loop: overlap
(fenced, atomic admission: the default), sync (fenced), overlap ``--unsafe``
(no fences, the seed's behaviour) and overlap with row-first admission. Per
round: overlap/sync tokens/s (what overlap scheduling buys), fenced/unsafe
tokens/s (what the fences cost) and atomic/row-first tokens/s (what
admitting a row with its pages buys; the rows' utilization of both is in the
row's note and samples). The demo runs in-process through ``scheduler_demo.run_demo``
on each loop kind; if only its command line exists, it runs as a subprocess
(``--json``) on the loop the CLI chooses; if neither, the benchmark reports
"not available".
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .harness import Config, Row, Target, median, quantiles, run_on

__all__ = ["DEMO_RUNS", "bench_demo", "demo_available"]

OVERLAP_VS_SYNC = Target(">=", 1.6)
FENCED_VS_UNSAFE = Target(">=", 0.97)
ATOMIC_VS_ROW_FIRST = Target(">=", 1.0)

#: name -> DemoConfig overrides
DEMO_RUNS: dict[str, dict[str, Any]] = {
    "overlap": {"mode": "overlap", "unsafe": False, "admission": "atomic"},
    "sync": {"mode": "sync", "unsafe": False, "admission": "atomic"},
    "unsafe": {"mode": "overlap", "unsafe": True, "admission": "atomic"},
    "row-first": {"mode": "overlap", "unsafe": False, "admission": "row-first"},
}

REPO = Path(__file__).resolve().parent.parent


def demo_available() -> str | None:
    """``"api"``, ``"cli"``, or None when there is no scheduler_demo."""
    try:
        import scheduler_demo
    except ImportError:
        return None
    if hasattr(scheduler_demo, "run_demo") and hasattr(scheduler_demo, "DemoConfig"):
        return "api"
    if (Path(scheduler_demo.__file__).parent / "__main__.py").exists():
        return "cli"
    return None


def _overrides(cfg: Config) -> dict[str, Any]:
    return {"num_requests": cfg.demo_requests, "progress": False, "timeout_s": cfg.demo_timeout_s}


def _run_api(loop: str, overrides: dict[str, Any]) -> dict[str, Any]:
    from scheduler_demo import DemoConfig, run_demo

    known = {f.name for f in dataclasses.fields(DemoConfig)}
    demo_cfg = DemoConfig(**{k: v for k, v in overrides.items() if k in known})
    report = run_on(loop, lambda: run_demo(demo_cfg))
    return {
        "tokens_per_s": float(report.tokens_per_s),
        "corruptions": int(report.corruptions),
        "kv_corruptions": int(getattr(report, "kv_corruptions", 0)),
        "row_utilization": float(getattr(report, "row_utilization", 0.0)),
        "completed": int(report.completed),
        "requests": int(report.requests),
    }


def _run_cli(overrides: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "demo.json"
        argv = [
            sys.executable,
            "-m",
            "scheduler_demo",
            "--json",
            str(out),
            "--no-progress",
            "--mode",
            str(overrides["mode"]),
            "-n",
            str(overrides["num_requests"]),
        ]
        if overrides.get("unsafe"):
            argv.append("--unsafe")
        if overrides.get("admission"):
            argv += ["--admission", str(overrides["admission"])]
        proc = subprocess.run(
            argv,
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
            timeout=(overrides.get("timeout_s") or 600) + 60,
        )
        if not out.exists():
            raise RuntimeError(f"scheduler_demo exited {proc.returncode}: {proc.stderr[-2000:]}")
        data = json.loads(out.read_text(encoding="utf-8"))
    keys = (
        "tokens_per_s",
        "corruptions",
        "kv_corruptions",
        "row_utilization",
        "completed",
        "requests",
    )
    return {k: data.get(k, 0) for k in keys}


def _row(
    bench: str,
    loop: str,
    subject: str,
    reference: str,
    runs: dict[str, list[dict[str, Any]]],
    target: Target,
    note: str,
) -> Row:
    s = [r["tokens_per_s"] for r in runs[subject]]
    r = [r["tokens_per_s"] for r in runs[reference]]
    ratios = [a / b if b else float("nan") for a, b in zip(s, r, strict=True)]
    p25, p75 = quantiles(ratios)
    return Row(
        bench=bench,
        loop=loop,
        subject=subject,
        reference=reference,
        subject_value=median(s),
        reference_value=median(r),
        unit="tok/s",
        ratio=median(ratios),
        ratio_label="throughput (subject/ref)",
        ratio_p25=p25,
        ratio_p75=p75,
        target=target,
        note=note,
        samples={subject: s, reference: r, "ratios": ratios},
    )


def bench_demo(cfg: Config, loops: list[str]) -> tuple[list[Row], dict[str, Any]]:
    """Run the demo ``cfg.demo_repeats`` rounds per loop; rows and raw runs.

    Synchronous: each run gets its own fresh loop (``run_demo`` in-process),
    so this cannot be awaited from inside a running loop.
    """
    how = demo_available()
    if how is None:
        return [], {"unavailable": "scheduler_demo is not importable"}
    info: dict[str, Any] = {"how": how, "requests": cfg.demo_requests, "runs": {}}
    rows: list[Row] = []
    loop_kinds = loops if how == "api" else ["uvloop (CLI)"]
    names = list(DEMO_RUNS)
    for loop in loop_kinds:
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for rnd in range(cfg.demo_repeats):
            k = rnd % len(names)
            for name in names[k:] + names[:k]:
                overrides = {**_overrides(cfg), **DEMO_RUNS[name]}
                try:
                    res = _run_api(loop, overrides) if how == "api" else _run_cli(overrides)
                except Exception as exc:  # report, do not crash the other benchmarks
                    return rows, {**info, "unavailable": f"scheduler_demo failed: {exc!r}"}
                runs[name].append(res)
        info["runs"][loop] = runs
        corr = {n: median([float(r["corruptions"]) for r in runs[n]]) for n in names}
        kv = {n: median([float(r["kv_corruptions"]) for r in runs[n]]) for n in names}
        note = (
            f"{cfg.demo_requests} requests x {cfg.demo_repeats} rounds; median corruptions "
            f"rows/KV: overlap {corr['overlap']:g}/{kv['overlap']:g}, sync "
            f"{corr['sync']:g}/{kv['sync']:g}, unsafe {corr['unsafe']:g}/{kv['unsafe']:g}, "
            f"row-first {corr['row-first']:g}/{kv['row-first']:g}"
        )
        rows.append(
            _row(
                "demo tokens/s: overlap vs sync (fenced)",
                loop,
                "overlap",
                "sync",
                runs,
                OVERLAP_VS_SYNC,
                note,
            )
        )
        rows.append(
            _row(
                "demo tokens/s: fenced vs --unsafe (overlap)",
                loop,
                "overlap",
                "unsafe",
                runs,
                FENCED_VS_UNSAFE,
                note,
            )
        )
        util = {n: [float(r["row_utilization"]) for r in runs[n]] for n in ("overlap", "row-first")}
        util_note = (
            f"{cfg.demo_requests} requests x {cfg.demo_repeats} rounds; row utilization "
            "(requests running / rows allocated, read at the same iterations), "
            f"median: atomic {median(util['overlap']):.2f}, "
            f"row-first {median(util['row-first']):.2f}"
        )
        row = _row(
            "demo tokens/s: atomic vs row-first admission (overlap)",
            loop,
            "overlap",
            "row-first",
            runs,
            ATOMIC_VS_ROW_FIRST,
            util_note,
        )
        row.samples["row_utilization_atomic"] = util["overlap"]
        row.samples["row_utilization_row_first"] = util["row-first"]
        rows.append(row)
    return rows, info
