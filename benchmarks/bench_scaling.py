"""Issue 6, part 4: cost and memory as the pool grows from 256 to 65,536 rows.

Cost: the uncontended ``await alloc(1)`` + ``free`` cycle at every size,
all sizes and both pools interleaved round by round; ratios against the
smallest size (flat is the goal) and against the seed-style pool of the same
size (whose free-list slice is O(size)). Beside it, an overlap engine's
cycle, where every row has a recorded use: ``alloc(1)``, ``record_use``
with a completed fence, ``free([row])`` (the checked path, not the fast
one), against the same at the smallest size (flat is the goal: it cost
O(free rows) before the fast pass's undo learnt where it stopped).

Memory: the tables (every tensor the pool exposes, exact ``nbytes``) and
the Python bookkeeping (``tracemalloc``: objects allocated by constructing
the pool and handing every row out ``HANDOUTS`` times). Twice for asyncpool:
with rows handed out all at once (one hand-out stores one shared
generation tag), and then, the worst case, with every row handed out on its
own after the pool's hand-out count passed 256, so each row keeps a tag
that is an int object of its own. The seed-style pool, which keeps no
counters, hands out once; torch's tensor storage is not allocated through
Python and so is not counted twice. Tables use a
short ``max_context_len`` here so 65,536 rows fit a laptop; they grow as
``size * max_context_len * 4`` bytes in any case.
"""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

from .harness import (
    Config,
    Row,
    Sampler,
    clock_of,
    compare,
    interleave,
    loop_name,
    pool_cycles,
    seed_cycles,
)
from .naive_pool import NaiveReqToTokenPool

__all__ = ["HANDOUTS", "TABLE_ATTRS", "bench_scaling", "measure_memory"]

# Every asyncpool row is handed out this many times before memory is read:
# the figure is the steady state of a long-running pool, not a fresh one's.
HANDOUTS = 257

TABLE_ATTRS = ("req_to_token", "verified_lens", "alloced_lens", "alloced_lens_cpu")


def table_bytes(pool: object) -> int:
    total = 0
    for name in TABLE_ATTRS:
        t = getattr(pool, name, None)
        if t is not None:
            total += t.numel() * t.element_size()
    return total


async def _cycle_all(pool: Any, is_async: bool, singly: bool = False) -> None:
    cap = pool.available_size()
    for _ in range(HANDOUTS if is_async else 1):
        rows = (await pool.alloc(cap)) if is_async else pool.alloc(cap)
        pool.free(rows)
    if singly:
        # The hand-out count is past 256 now: each row handed out on its own
        # keeps a tag that no other row shares (the worst case).
        held = [r for _ in range(cap) for r in await pool.alloc(1)]
        pool.free(held)


async def measure_memory(size: int, max_context_len: int) -> dict[str, float]:
    """Bytes of tables and of Python bookkeeping, asyncpool vs seed-style."""
    from asyncpool import AsyncReqToTokenPool

    out: dict[str, float] = {"size": size}

    def fresh_async() -> AsyncReqToTokenPool:
        return AsyncReqToTokenPool(size, max_context_len, device="cpu")

    for label, factory, is_async, singly in (
        ("asyncpool", fresh_async, True, False),
        ("asyncpool_singly", fresh_async, True, True),
        ("seed-style", lambda: NaiveReqToTokenPool(size, max_context_len), False, False),
    ):
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            pool = factory()
            await _cycle_all(pool, is_async, singly)
            gc.collect()
            current, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        out[f"{label}_table_bytes"] = table_bytes(pool)
        out[f"{label}_bookkeeping_bytes"] = current - base
        out[f"{label}_bookkeeping_peak_bytes"] = peak - base
        if isinstance(pool, AsyncReqToTokenPool):
            await pool.close()
        del pool
    return out


async def bench_scaling(
    cfg: Config, *, memory: bool = True
) -> tuple[list[Row], list[dict[str, float]]]:
    """Cycle cost per size (ratios) and memory per size (bytes)."""
    from asyncpool import AsyncReqToTokenPool, HostStream

    loop = loop_name()
    now = clock_of(cfg)
    sizes = cfg.scaling_sizes
    ctx = cfg.scaling_context_len
    pools = {s: AsyncReqToTokenPool(s, ctx, device="cpu") for s in sizes}
    naives = {s: NaiveReqToTokenPool(s, ctx) for s in sizes}
    used = {s: AsyncReqToTokenPool(s, ctx, device="cpu") for s in sizes}
    stream = HostStream(name="bench-scaling")
    done = stream.record()  # an idle stream's fence: complete at once

    def used_cycles(pool: AsyncReqToTokenPool) -> Sampler:
        async def sample(n: int) -> int:
            alloc, record_use, free = pool.alloc, pool.record_use, pool.free
            t0 = now()
            for _ in range(n):
                rows = await alloc(1)
                record_use(rows, done)
                free(rows)
            return now() - t0

        return sample

    samplers = {}
    for s in sizes:
        samplers[f"pool {s}"] = pool_cycles(pools[s], 1, now)
        samplers[f"seed {s}"] = seed_cycles(naives[s], 1, now)
        samplers[f"used {s}"] = used_cycles(used[s])
    try:
        per_op = await interleave(samplers, rounds=cfg.rounds, target_s=cfg.sample_s / 2)
    finally:
        for p in (*pools.values(), *used.values()):
            await p.close()
        stream.close()
    rows: list[Row] = []
    lo = sizes[0]
    for s in sizes:
        if s != lo:
            rows.append(
                compare(
                    per_op,
                    bench="scaling: alloc(1)+free vs pool size",
                    loop=loop,
                    subject=f"pool {s}",
                    reference=f"pool {lo}",
                    unit="ns/cycle",
                    speedup=False,
                    subject_label=f"asyncpool, {s} rows",
                    reference_label=f"asyncpool, {lo} rows",
                    note="sweep:pool",
                )
            )
        rows.append(
            compare(
                per_op,
                bench="scaling: alloc(1)+free vs pool size",
                loop=loop,
                subject=f"pool {s}",
                reference=f"seed {s}",
                unit="ns/cycle",
                speedup=True,
                subject_label=f"asyncpool, {s} rows",
                reference_label=f"seed-style, {s} rows",
                note="sweep:seed",
            )
        )
        if s != lo:
            rows.append(
                compare(
                    per_op,
                    bench="scaling: alloc(1)+record_use+free vs pool size",
                    loop=loop,
                    subject=f"used {s}",
                    reference=f"used {lo}",
                    unit="ns/cycle",
                    speedup=False,
                    subject_label=f"asyncpool, {s} rows, rows with a recorded use",
                    reference_label=f"the same, {lo} rows",
                    note="sweep:used",
                )
            )
    mem: list[dict[str, float]] = []
    if memory:
        for s in sizes:
            mem.append(await measure_memory(s, ctx))
    return rows, mem
