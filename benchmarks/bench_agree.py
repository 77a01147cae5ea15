"""Issue 12: what ``agree(group)`` costs a tensor-parallel scheduler per step.

Two processes (``torch.multiprocessing`` spawn, gloo over a ``file://``
rendezvous in a temporary directory, CPU tensors), each with an explicit
``ReqToTokenPool`` and ``KVPagePool`` holding ``k`` pending batches behind
transfer fences (fences of unknown origin, one row and four pages each, so
the agreement tensor carries ``2k`` batches). Timed on each rank: ``n``
back-to-back ``agree`` calls over both ledgers (one collective each when
``2k <= WIDTH`` = 64, two for k = 48), after a barrier, so the ranks run in lockstep and the
figure is the agreement itself, not one rank waiting for a slower one.
Nothing is released (the transfers never complete), so every call sees the
same ``k``.

References: a bare ``all_reduce`` of one int64 with MIN over the same group
(the floor of any agreement), and the scheduler demo's step time (about
6 ms per step with its default settings: ``forward_ms`` 2.5 + ``sched_ms``
2.5 + per-token costs), as the fraction of a step agreement takes.
Rounds interleave the variants, rotating their order; the figures are
medians of per-round values on rank 0.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from .harness import Config, Row, median, quantiles

__all__ = ["DEMO_STEP_MS", "PENDING", "bench_agree"]

#: The scheduler demo's step time with its default settings (milliseconds).
DEMO_STEP_MS = 6.0
#: pending batches per ledger in each variant
PENDING = (0, 4, 32, 48)


class _Never:
    """A transfer handle that never completes (a fence of unknown origin)."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:  # pragma: no cover - never called by agree
        raise RuntimeError("never")


def _calls(cfg: Config) -> int:
    return 5 if cfg.name == "smoke" else 200


def _rank(rank: int, world: int, init: str, out: str, rounds: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    from asyncpool import KVPagePool, ReqToTokenPool
    from asyncpool.agreement import agree

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        group = dist.group.WORLD
        variants: dict[str, Any] = {}
        for k in PENDING:
            rows = ReqToTokenPool(k + 2, 4, reclaim="explicit")
            kv = KVPagePool(4 * k + 2, 4, reclaim="explicit")
            for _ in range(k):
                t = _Never()
                row = rows.alloc(1)
                pages = kv.alloc(4)
                assert row is not None and pages is not None
                rows.free(row, fence=t)
                kv.free(pages, fence=t)
            variants[f"agree k={k}"] = [rows._ledger, kv.ledger]
        one = torch.zeros(1, dtype=torch.int64)
        names = [*variants, "bare all_reduce"]
        samples: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                dist.barrier(group)
                t0 = time.perf_counter_ns()
                if name == "bare all_reduce":
                    for _ in range(calls):
                        dist.all_reduce(one, op=dist.ReduceOp.MIN, group=group)
                else:
                    ledgers = variants[name]
                    for _ in range(calls):
                        agree(group, ledgers)
                samples[name].append((time.perf_counter_ns() - t0) / calls / 1e3)
        if rank == 0:
            Path(out).write_text(json.dumps(samples), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def bench_agree(cfg: Config, world: int = 2) -> tuple[list[Row], dict[str, Any]]:
    """Spawn ``world`` ranks, measure, return rows (per-call microseconds)."""
    from torch.multiprocessing.spawn import spawn

    calls = _calls(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "agree.json")
        args = (world, os.path.join(tmp, "init"), out, cfg.rounds, calls)
        spawn(_rank, args=args, nprocs=world, join=True)  # type: ignore[no-untyped-call]
        samples: dict[str, list[float]] = json.loads(Path(out).read_text(encoding="utf-8"))
    bare = samples["bare all_reduce"]
    step_us = DEMO_STEP_MS * 1e3
    rows: list[Row] = []
    for k in PENDING:
        name = f"agree k={k}"
        xs = samples[name]
        per_round = [x / step_us for x in xs]
        p25, p75 = quantiles(per_round)
        rows.append(
            Row(
                bench="agree",
                loop="-",
                subject=f"agree() per step, gloo {world} ranks, {k} pending batches per ledger",
                reference=f"demo step ({DEMO_STEP_MS:g} ms)",
                subject_value=median(xs),
                reference_value=step_us,
                unit="us",
                ratio=median(per_round),
                ratio_label="agree / step",
                ratio_p25=p25,
                ratio_p75=p75,
                note=f"{calls} calls per sample",
                samples={"agree_us": xs},
            )
        )
        vs_bare = [x / b for x, b in zip(xs, bare, strict=True)]
        p25, p75 = quantiles(vs_bare)
        rows.append(
            Row(
                bench="agree",
                loop="-",
                subject=f"agree() {k} pending batches per ledger",
                reference="bare all_reduce of one int64",
                subject_value=median(xs),
                reference_value=median(bare),
                unit="us",
                ratio=median(vs_bare),
                ratio_label="agree / bare",
                ratio_p25=p25,
                ratio_p75=p75,
                samples={"agree_us": xs, "bare_us": bare},
            )
        )
    info = {
        "world": world,
        "calls_per_sample": calls,
        "samples_us": samples,
        "demo_step_ms": DEMO_STEP_MS,
    }
    return rows, info
