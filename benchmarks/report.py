"""Markdown and JSON output for a benchmark run."""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from .bench_scaling import HANDOUTS
from .harness import Config, Row

__all__ = [
    "PEERS_INSTALL",
    "loadavg",
    "machine_info",
    "ratio_of_medians",
    "render_markdown",
    "to_json",
]

REPO = Path(__file__).resolve().parent.parent

#: The commands ``benchmarks/install_peers.sh VENV`` runs to put SGLang's and
#: vLLM's allocators in a venv of their own (the smoke test checks that each
#: line is in the script, so the docs cannot drift from it).
PEERS_INSTALL = (
    'python3 -m venv "$VENV"',
    '"$VENV/bin/python" -m pip install --upgrade pip',
    '"$VENV/bin/python" -m pip install torch==2.13.0',
    '"$VENV/bin/python" -m pip install numpy==2.4.6 uvloop==0.23.0',
    '"$VENV/bin/python" -m pip install --no-deps sglang==0.5.23',
    '"$VENV/bin/python" -m pip install orjson psutil pybase64 requests triton packaging '
    "pillow starlette msgspec pydantic pyzmq tqdm ipython aiohttp",
    '"$VENV/bin/python" -m pip download --no-deps vllm==0.33.0 -d "$WHEELS"',
    '"$VENV/bin/python" -m zipfile -e "$WHEELS"/vllm-0.33.0-*.whl "$VENV/vllm-src"',
    '"$VENV/bin/python" -c \'import os, sys, sysconfig; open(os.path.join(sysconfig.get_paths()'
    '["purelib"], "vllm_src.pth"), "w").write(os.path.abspath(sys.argv[1]) + "\\n")\' '
    '"$VENV/vllm-src"',
    '"$VENV/bin/python" -m pip install regex cbor2 cachetools cloudpickle py-cpuinfo '
    "prometheus-client openai openai-harmony partial-json-parser transformers==5.19.0 "
    'tokenizers==0.23.2 xgrammar==0.2.8 "fastapi>=0.133.0,<0.137.0" '
    '"llguidance>=1.7.0,<1.8.0" apache-tvm-ffi==0.1.11',
)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # pragma: no cover - not Unix
        return []


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    try:
        from importlib.metadata import version

        uv = version("uvloop")
    except Exception:  # pragma: no cover - not installed
        uv = "not installed"
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = os.cpu_count() or 0
    dirty = _git("status", "--porcelain", "--", "asyncpool", "benchmarks", "scheduler_demo")
    return {
        "cpu": _cpu_model(),
        "cores_usable": affinity,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "uvloop": uv,
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(dirty),
        "loadavg_1_5_15": loadavg(),
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _num(x: float) -> str:
    if isinstance(x, float) and math.isnan(x):
        return "n/a"
    return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"


def _ratio(x: float) -> str:
    if math.isnan(x):
        return "n/a"
    if x >= 100:
        return f"{x:,.0f}x"
    if x >= 10:
        return f"{x:.1f}x"
    return f"{x:.2f}x"


def _time(ns: float) -> str:
    if math.isnan(ns):
        return "n/a"
    if ns >= 1e6:
        return f"{ns / 1e6:.3g} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.3g} µs"
    return f"{ns:.3g} ns"


def _value(v: float, unit: str) -> str:
    if unit.startswith("ns"):
        per = unit[2:]
        return _time(v) + per
    return f"{_num(v)} {unit}"


def _met(row: Row) -> str:
    met = row.met
    if met is None:
        return ""
    return "**yes**" if met else "**NO**"


def ratio_of_medians(row: Row) -> float:
    """The quotient of the two sides' own medians, oriented as ``row.ratio``
    (NaN where a median is not a positive number).

    ``row.ratio`` pairs each round's two samples (drift between rounds
    cancels); this does not, so the two can differ."""
    s, r = row.subject_value, row.reference_value
    if not (s > 0 and r > 0):  # NaN compares False too
        return float("nan")
    return r / s if row.ratio_label.startswith("speed") else s / r


def _row_line(row: Row) -> str:
    spread = ""
    if not (math.isnan(row.ratio_p25) or row.ratio_p25 == row.ratio_p75):
        spread = f" ({_ratio(row.ratio_p25)} to {_ratio(row.ratio_p75)})"
    direction = {"speed": " faster", "cost ": " cost"}.get(row.ratio_label[:5], "")
    if direction == " faster" and row.ratio < 1:
        # "0.87x faster" says nothing: the reference is faster, by 1/ratio.
        direction = f" (the reference is {_ratio(1 / row.ratio)} faster)"
    ctx = f"{_value(row.subject_value, row.unit)} vs {_value(row.reference_value, row.unit)}"
    rom = ratio_of_medians(row)
    if not math.isnan(row.ratio_p25) and not row.ratio_p25 <= rom <= row.ratio_p75:
        # The unpaired figure disagrees with the paired one: say so on the row.
        ctx += f" (their ratio, {_ratio(rom)}, lies outside the rounds' IQR)"
    if row.note and not row.note.startswith("sweep:"):
        ctx += f"; {row.note}"
    return (
        f"| {row.bench} | {row.loop} | {row.subject} vs {row.reference} | "
        f"{_ratio(row.ratio)}{direction}{spread} | {row.target or ''} | {_met(row)} | {ctx} |"
    )


_HEADER = (
    "| Benchmark | Loop | Subject vs reference | Ratio: median of rounds (IQR) | Target "
    "| Met | Medians and notes, for context |\n"
    "| --- | --- | --- | --- | --- | --- | --- |"
)


def _sweep_table(rows: list[Row], tag: str, title: str, col: str) -> list[str]:
    """One line per subject, one column per loop: the ratio to the base."""
    chosen = [r for r in rows if r.note == tag]
    if not chosen:
        return []
    loops = sorted({r.loop for r in chosen})
    by: dict[tuple[str, str], Row] = {(r.subject, r.loop): r for r in chosen}
    subjects: list[str] = []
    for r in chosen:
        if r.subject not in subjects:
            subjects.append(r.subject)
    refs = {r.reference for r in chosen}
    ref = chosen[0].reference if len(refs) == 1 else "per line, as the title says"
    out = [f"**{title}** (reference: {ref})", ""]
    out.append(f"| {col} | " + " | ".join(f"{lp}: ratio | {lp}: median" for lp in loops) + " |")
    out.append("| --- |" + " --- | --- |" * len(loops))
    for s in subjects:
        cells = []
        for lp in loops:
            cell = by.get((s, lp))
            cells.append(
                "n/a | n/a"
                if cell is None
                else f"{_ratio(cell.ratio)} | {_value(cell.subject_value, cell.unit)}"
            )
        out.append(f"| {s} | " + " | ".join(cells) + " |")
    out.append("")
    return out


_PAGES_BENCH = re.compile(r"KV pages alloc\((\d+)\)\+free$")  # bench_pages.bench_name


def _pages_table(rows: list[Row]) -> list[str]:
    """Every page allocator's median cycle at each ``n``, from the pages rows."""
    cells: dict[str, dict[int, float]] = {}
    for r in rows:
        m = _PAGES_BENCH.match(r.bench)
        if m is None:
            continue
        n = int(m.group(1))
        cells.setdefault(r.subject, {})[n] = r.subject_value
        cells.setdefault(r.reference, {})[n] = r.reference_value
    if not cells:
        return []
    counts = sorted({n for by_n in cells.values() for n in by_n})
    out = [
        "## KV page allocators",
        "",
        "Median time of one `alloc(n)` + `free` cycle (per page in brackets), all "
        "allocators interleaved in one run; the ratios are in the tables above.",
        "",
        "| Allocator | " + " | ".join(f"n = {n}" for n in counts) + " |",
        "| --- |" + " --- |" * len(counts),
    ]
    for name, by_n in cells.items():
        out.append(
            f"| {name} | "
            + " | ".join(
                "n/a" if n not in by_n else f"{_time(by_n[n])} ({_time(by_n[n] / n)}/page)"
                for n in counts
            )
            + " |"
        )
    out.append("")
    return out


def render_markdown(
    rows: list[Row],
    *,
    command: str,
    cfg: Config,
    machine: dict[str, Any],
    memory: list[dict[str, float]],
    unavailable: dict[str, str],
    elapsed_s: float,
    source: str | None = None,
) -> str:
    m = machine
    lines = [
        "# asyncpool benchmarks",
        "",
        "Generated by the command below; do not edit by hand.",
        "",
        "```",
        command,
        "```",
        "",
        *(
            [
                f"Every sample of this run is in `{source}`; `python -m benchmarks --from-json "
                f"{source}` re-renders this page.",
                "",
            ]
            if source
            else []
        ),
        f"- Machine: {m['cpu']}, {m['cores_usable']} usable cores, {m['platform']}",
        f"- Python {m['python']} ({m['implementation']}), torch {m['torch']} "
        f"({m['torch_threads']} threads), uvloop {m['uvloop']}",
        f"- Commit {m['git_commit'] or 'unknown'}"
        + (" with uncommitted changes" if m["git_dirty"] else "")
        + f", {m['date_utc']}; preset `{cfg.name}`, {cfg.rounds} interleaved rounds per "
        f"comparison, {cfg.clock} clock, run took {elapsed_s:.0f} s",
        f"- Load average (1, 5, 15 min) before / after the run: "
        f"{m.get('loadavg_before', [])} / {m.get('loadavg_1_5_15', [])}",
        "",
        "Every figure is a ratio measured in one process, subject and reference interleaved "
        "(order rotated each round) on the same event loop; the ratio is the median of the "
        "per-round ratios, with its interquartile range, and targets are judged on it. "
        "The times in the last column are each side's own median over the rounds, so their "
        "quotient (the ratio of medians, unpaired) can differ from it; a row says so where "
        "that quotient lies outside the interquartile range. Absolute times are context only: "
        "they move with the machine, the ratios much less.",
        "",
    ]
    if cfg.name == "smoke":
        lines += [
            "**Smoke preset: a handful of operations per sample; these figures mean nothing.**",
            "",
        ]
    lines += [
        "## Targets",
        "",
        _HEADER,
    ]
    targeted = [r for r in rows if r.target is not None]
    lines += [_row_line(r) for r in targeted]
    met = sum(1 for r in targeted if r.met)
    lines += ["", f"{met} of {len(targeted)} targets met.", ""]
    for name, why in unavailable.items():
        lines.append(f"- **{name}: not available** ({why})")
    if unavailable:
        lines.append("")

    lines += ["## Other comparisons", "", _HEADER]
    lines += [_row_line(r) for r in rows if r.target is None and not r.note.startswith("sweep:")]
    lines.append("")

    lines += _pages_table(rows)

    sweeps = [
        ("sweep:idle", "reclaim() with nothing completed, vs pending fences", "pending fences"),
        (
            "sweep:head",
            "reclaim() of the oldest completed fence, vs pending fences",
            "pending fences",
        ),
        (
            "sweep:pool",
            "asyncpool alloc(1)+free vs pool size (cost ratio; below 1 at large "
            "sizes because the bulk row reset is amortised over more cycles)",
            "size",
        ),
        (
            "sweep:seed",
            "asyncpool speed-up over the seed-style pool of the same size; the "
            "median column is asyncpool's cycle",
            "size",
        ),
        (
            "sweep:used",
            "an overlap engine's cycle (alloc(1), record_use with a completed "
            "fence, free: the checked path) vs pool size (cost ratio; flat is the goal)",
            "size",
        ),
    ]
    sweep_lines: list[str] = []
    for tag, title, col in sweeps:
        sweep_lines += _sweep_table(rows, tag, title, col)
    if sweep_lines:
        lines += ["## Sweeps", "", *sweep_lines]

    if memory:
        lines += [
            "## Memory",
            "",
            f"Tables at max_context_len={cfg.scaling_context_len} (they scale with it); "
            "bookkeeping is Python objects after every asyncpool row was handed out "
            f"{HANDOUTS} times in batches (rows handed out together share one generation "
            "tag), then, for the worst case, once more each on its own (each row keeps a "
            "tag of its own, an int object past 256); the seed-style pool's once; "
            "tracemalloc. Reproduce: `python -m benchmarks --only scaling`.",
            "",
            "| size | asyncpool tables | asyncpool bookkeeping, batches | per row "
            "| asyncpool, each row its own tag | per row "
            "| seed-style bookkeeping | per row |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for mem in memory:
            s = mem["size"]
            ab, nb = mem["asyncpool_bookkeeping_bytes"], mem["seed-style_bookkeeping_bytes"]
            sb = mem.get("asyncpool_singly_bookkeeping_bytes", float("nan"))
            lines.append(
                f"| {int(s):,} | {mem['asyncpool_table_bytes'] / 2**20:.2f} MiB "
                f"| {ab / 1024:,.1f} KiB | {ab / s:.0f} B "
                f"| {sb / 1024:,.1f} KiB | {sb / s:.0f} B "
                f"| {nb / 1024:,.1f} KiB | {nb / s:.0f} B |"
            )
        lines.append("")

    lines += [
        "## Method",
        "",
        "- Timer: "
        + (
            "`time.perf_counter_ns` (wall time)"
            if cfg.clock == "wall"
            else "`time.thread_time_ns` (`--clock cpu`: the benchmarking thread's CPU time, "
            "so time the thread spent descheduled on a loaded machine is not counted; "
            "wake-up latency, the head-reclaim sweep, the demo and agree still use wall time)"
        )
        + "; each sample batches enough operations to take "
        f"about {cfg.sample_s * 1e3:g} ms (calibrated, which also warms up), so timer and "
        "loop overhead is amortised. The garbage collector is off while a micro-benchmark "
        "sample runs and collects between samples (as `timeit` does); it stays on for the "
        "contended run.",
        "- Loops: each benchmark runs on a fresh `asyncio.new_event_loop()` and a fresh "
        "`uvloop.new_event_loop()` via `loop.run_until_complete`.",
        "- Seed-style pool: `benchmarks/naive_pool.py`, the seed's algorithm (list free "
        "list sliced on every alloc, list-indexed zeroing on alloc, per-row zeroing on "
        "free). It is called without `await` (it has no async API), which only favours it.",
        "- Uncontended: `rows = await pool.alloc(1); pool.free(rows)` vs "
        "`await sem.acquire(); sem.release()` in one coroutine loop.",
        "- Contended: tasks each doing `alloc(1)`, `await asyncio.sleep(0)`, `free` a few "
        "times, gathered; same with `asyncio.Semaphore`; time per grant.",
        "- Admission: `g = await pool.admit(pages=16); pool.free([g.row])` on a pool with "
        "`kv=` vs, side by side, `alloc(1)` + `free` on a rows-only pool plus `alloc(16)` + "
        "`free` on a bare `KVPagePool`; contended, 1,000 tasks each admitting 1 row + 16 "
        "pages on 64 rows / 512 pages (admit, `sleep(0)`, free, a few times) vs the same "
        "tasks on `asyncio.Semaphore(64)`; time per grant.",
        f'- KV groups: `admit({{"full": {cfg.admit_pages}, "swa": '
        f'{cfg.groups_window_pages}, "mamba": 1}})` + `free` on a pool with three groups vs, '
        "side by side, `alloc(1)` + `free` on a rows-only pool plus `alloc` + `free` on "
        "three bare `KVPagePool`s, and vs the single-kv admission and one- and two-group ones; a "
        f'grouped decode step of {cfg.groups_batch_rows} rows, `extend_rows(rows, {{"full": 1, '
        '"swa": 1})` vs one `extend_rows(rows, 1, group=...)` a group (the rows trimmed '
        "back, untimed, every 16 steps); a sliding window's step, `drop_pages(rows, below, "
        'group="swa")` of one page a row behind the step\'s open fence vs `trim_pages` of '
        "one page a row (`benchmarks/bench_groups.py`).",
        "- Fenced: frees behind still-open host fences (a gate holds the stream), then the "
        "stream runs past them and `reclaim()` + one loop turn return the rows.",
        "- Wake-up: the stream's worker stamps the time just before it reaches the fence; "
        "the waiter stamps when it resumes. The floor is a bare future resolved with "
        "`call_soon_threadsafe` from the same fence's done-callback.",
        "- Metrics: after 10^4 queued allocs and 10^4 fence batches (full sample windows, "
        "histograms of 10^4), `prometheus_client.generate_latest` of a registry holding one "
        "`PoolCollector`; its target is absolute (under 1 ms per scrape), shown as the ratio "
        "to a constant 1 ms.",
        f"- KV pages: `pages = alloc(n); free(pages)` for n in {list(cfg.pages_counts)}, on a "
        f"{cfg.pages_num_pages:,}-page pool (page 0 reserved) of which half was allocated at "
        f"setup and stays held, {cfg.pages_page_size} token slots a page. Synchronous, so it "
        "runs once (loop column `sync`). Contenders, interleaved in one run: asyncpool's "
        "`KVPagePool` (freeing the tensor `alloc` returned; for context also freeing a copy, "
        "the fully checked path, the clone included); the seed-style allocator of "
        "`benchmarks/naive_pages.py` (a torch "
        "free-list tensor sliced on alloc, `torch.cat` on free, as SGLang's allocator does; "
        "page ids in and out, so it skips SGLang's `torch.unique`); SGLang's "
        "`PagedTokenToKVPoolAllocator` on CPU (`alloc(n * page_size)` token slots, "
        "`need_sort=False`), given back by `free_segment(slots, start_pos=0)`, its engine's "
        "path for a finished request, where the targets are, and, for context, by "
        "`free(slots)` (`torch.unique` of the pages inside), and the same allocator built "
        "with `need_sort=True` (what SGLang's engine picks in disaggregated prefill or decode "
        "mode: `free` stages pages in a list, `alloc` merges and sorts them when short), "
        "context only; vLLM's `BlockPool` with prefix "
        "caching off (`get_new_blocks(n)` + `free_blocks`), where the vLLM targets are: "
        "`KVPagePool` has no prefix cache, so this is vLLM doing the same work, in its faster "
        "setting. vLLM's engine default is prefix caching on (`enable_prefix_caching`, "
        "generative models), where `get_new_blocks` also checks every block it hands out "
        "for a cached prefix to evict; measured for context (`enable_caching=True`) on "
        "blocks never hashed, the least that setting costs. vLLM's side returns "
        "`KVCacheBlock` objects; the block ids its engine reads from them are not timed "
        "(favours vLLM).",
        f"- Decode step: {cfg.decode_requests} running requests whose stored lengths are drawn "
        f"(seeded) in [{cfg.decode_lens[0]}, {cfg.decode_lens[1]}), each growing a token a "
        f"step, on a {cfg.decode_num_pages:,}-page pool of {cfg.decode_page_size} slots a page; "
        f"batches of {cfg.decode_batch_steps} steps from the starting lengths, pages given "
        "back between batches, only the step calls timed, each step checked to hand out "
        "exactly the pages the lengths call for. Synchronous (loop column `sync`). Pages for "
        "the requests crossing a page boundary (the list computed untimed, alike): asyncpool's "
        "`extend_rows(crossing_rows, 1)` vs vLLM's `BlockPool.get_new_blocks(1)` per crossing "
        "request (without `KVCacheManager`'s bookkeeping, which favours vLLM) and vs its "
        "engine path, `KVCacheManager.allocate_slots(request, 1)` for every request (which "
        "finds the crossing ones itself, favouring asyncpool), both with prefix caching off "
        "(favours vLLM, as above); for context also `KVCacheManager` in vLLM's default "
        "setting (prefix caching on: sha256 block hashes computed untimed as tokens are "
        "appended, each block cached as it fills, cached blocks evicted when handed out "
        "again). Every request's new-token slot "
        "(SGLang's `out_cache_loc`): asyncpool's `extend_rows` inside the torch an engine "
        "would run on CPU vs SGLang's `alloc_decode(seq_lens, seq_lens_cpu, last_loc)` "
        "(`benchmarks/bench_decode.py` says exactly what each side does).",
        "- Peers: SGLang and vLLM are measured only where they import, and are never "
        "installed in the project's venv (CI does not depend on them). "
        "`bash benchmarks/install_peers.sh VENV` puts them in a venv of their own; "
        "`VENV/bin/python -m benchmarks`, run from the repo root, then measures everything "
        "with the peers' rows (`--only pages,decode` for those alone: a subset leaves this "
        "page as it is). The "
        "script's install commands are these (`$WHEELS` is a temporary folder; it also clears "
        "`$VENV/vllm-src` before unpacking and ends by importing both peers); vLLM is its "
        "0.33.0 wheel's own source on `sys.path`, nothing stubbed. Pinned: torch, SGLang, "
        "vLLM, numpy and uvloop (what a timed call runs or the loop it runs on); left "
        "unpinned: the packages the peers only import (triton among them: no Triton kernel "
        "runs on CPU):",
        "",
        "```bash",
        *PEERS_INSTALL,
        "```",
        "- Agree (tensor parallel): two processes over gloo (CPU), each with explicit "
        "row and page pools holding k pending transfer batches per ledger; back-to-back "
        "`agree()` calls after a barrier (lockstep), beside a bare one-int64 `all_reduce` and "
        "the demo's default step (about 6 ms). Loop column `-`: no event loop involved.",
        "",
    ]
    return "\n".join(lines)


def to_json(
    rows: list[Row],
    *,
    command: str,
    cfg: Config,
    machine: dict[str, Any],
    memory: list[dict[str, float]],
    unavailable: dict[str, str],
    extra: dict[str, Any],
    elapsed_s: float,
    benchmarks: list[str] | None = None,
    argv: list[str] | None = None,
) -> dict[str, Any]:
    from dataclasses import asdict

    return {
        "command": command,
        # which benchmarks ran: --from-json writes the default report only for all
        **({} if benchmarks is None else {"benchmarks": benchmarks}),
        # the arguments the run was given (what ``command`` shows), not the
        # process's: main(argv) may be called from another program
        "argv": sys.argv if argv is None else [sys.argv[0], *argv],
        "config": asdict(cfg),
        "machine": machine,
        "elapsed_s": elapsed_s,
        "rows": [r.to_json() for r in rows],
        "memory": memory,
        "unavailable": unavailable,
        "extra": extra,
        "targets_met": sum(1 for r in rows if r.met),
        "targets_total": sum(1 for r in rows if r.target is not None),
    }
