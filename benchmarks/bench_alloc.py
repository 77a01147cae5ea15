"""Issue 6, parts 1 and 2: the cost of one grant, alone and contended.

* Uncontended: ``rows = await pool.alloc(1); pool.free(rows)`` in one
  coroutine loop, against ``await sem.acquire(); sem.release()`` and against
  the seed-style pool's ``alloc(1)``/``free`` (called directly: it has no
  async API, so it is spared the ``await``, which only favours it).
* Batched: ``alloc(64)`` + ``free``, per row, against the seed-style pool
  and (context only) 64 Semaphore acquires followed by 64 releases.
* Contended: 1000 tasks on 64 rows, each doing ``alloc(1)``, one
  ``await asyncio.sleep(0)`` while holding, ``free``, a few times; against
  the same tasks on ``asyncio.Semaphore(64)``. Figure: time per grant,
  task creation and the gather included on both sides.
"""

from __future__ import annotations

import asyncio

from .harness import (
    Config,
    Row,
    Target,
    clock_of,
    compare,
    gathered,
    interleave,
    loop_name,
    pool_cycles,
    pool_worker,
    seed_cycles,
    semaphore_worker,
)
from .naive_pool import NaiveReqToTokenPool

__all__ = ["bench_batched", "bench_contended", "bench_uncontended"]

UNCONTENDED_VS_SEED = Target(">=", 45.0)
UNCONTENDED_VS_SEM = Target("<=", 1.5)
BATCHED_VS_SEED = Target(">=", 50.0)
CONTENDED_VS_SEM = Target("<=", 1.25)


async def bench_uncontended(cfg: Config) -> list[Row]:
    """``await alloc(1)`` + ``free``: vs the seed-style pool and Semaphore."""
    from asyncpool import AsyncReqToTokenPool

    loop = loop_name()
    now = clock_of(cfg)
    pool = AsyncReqToTokenPool(cfg.size, cfg.max_context_len, device="cpu")
    naive = NaiveReqToTokenPool(cfg.size, cfg.max_context_len)
    sem = asyncio.Semaphore(cfg.size - 1)

    pool_sample = pool_cycles(pool, 1, now)

    async def sem_sample(n: int) -> int:
        acquire, release = sem.acquire, sem.release
        t0 = now()
        for _ in range(n):
            await acquire()
            release()
        return now() - t0

    naive_sample = seed_cycles(naive, 1, now)

    try:
        per_op = await interleave(
            {"asyncpool": pool_sample, "Semaphore": sem_sample, "seed-style": naive_sample},
            rounds=cfg.rounds,
            target_s=cfg.sample_s,
        )
    finally:
        await pool.close()
    bench = "uncontended alloc(1)+free"
    return [
        compare(
            per_op,
            bench=bench,
            loop=loop,
            subject="asyncpool",
            reference="seed-style",
            unit="ns/cycle",
            speedup=True,
            target=UNCONTENDED_VS_SEED,
        ),
        compare(
            per_op,
            bench=bench,
            loop=loop,
            subject="asyncpool",
            reference="Semaphore",
            unit="ns/cycle",
            speedup=False,
            target=UNCONTENDED_VS_SEM,
            reference_label="asyncio.Semaphore acquire+release",
        ),
    ]


async def bench_batched(cfg: Config) -> list[Row]:
    """``await alloc(k)`` + ``free``, per row (k = ``cfg.batch_k``, 64)."""
    from asyncpool import AsyncReqToTokenPool

    loop = loop_name()
    now = clock_of(cfg)
    k = cfg.batch_k
    pool = AsyncReqToTokenPool(cfg.size, cfg.max_context_len, device="cpu")
    naive = NaiveReqToTokenPool(cfg.size, cfg.max_context_len)
    sem = asyncio.Semaphore(cfg.size - 1)
    steps = range(k)

    pool_sample = pool_cycles(pool, k, now)

    async def sem_sample(n: int) -> int:
        acquire, release = sem.acquire, sem.release
        t0 = now()
        for _ in range(n):
            for _ in steps:
                await acquire()
            for _ in steps:
                release()
        return now() - t0

    naive_sample = seed_cycles(naive, k, now)

    try:
        per_op = await interleave(
            {"asyncpool": pool_sample, "Semaphore": sem_sample, "seed-style": naive_sample},
            rounds=cfg.rounds,
            target_s=cfg.sample_s,
            ops_per_call={"asyncpool": k, "Semaphore": k, "seed-style": k},
            start=4,
        )
    finally:
        await pool.close()
    bench = f"alloc({k})+free, per row"
    return [
        compare(
            per_op,
            bench=bench,
            loop=loop,
            subject="asyncpool",
            reference="seed-style",
            unit="ns/row",
            speedup=True,
            target=BATCHED_VS_SEED,
        ),
        compare(
            per_op,
            bench=bench,
            loop=loop,
            subject="asyncpool",
            reference="Semaphore",
            unit="ns/row",
            speedup=False,
            reference_label=f"Semaphore: {k} acquires + {k} releases",
            note="context only: a Semaphore cannot grant k at once",
        ),
    ]


async def bench_contended(cfg: Config) -> list[Row]:
    """1000 tasks on 64 rows, per grant, against ``asyncio.Semaphore(64)``."""
    from asyncpool import AsyncReqToTokenPool

    loop = loop_name()
    now = clock_of(cfg)
    tasks, rounds = cfg.contended_tasks, cfg.contended_rounds
    # +1: slot 0 is reserved padding, so 65 rows give 64 grantable ones.
    pool = AsyncReqToTokenPool(cfg.contended_rows + 1, cfg.max_context_len, device="cpu")
    sem = asyncio.Semaphore(cfg.contended_rows)
    pool_sample = gathered(pool_worker(pool, rounds), tasks, now)
    sem_sample = gathered(semaphore_worker(sem, rounds), tasks, now)

    try:
        per_op = await interleave(
            {"asyncpool": pool_sample, "Semaphore": sem_sample},
            rounds=cfg.rounds,
            target_s=cfg.sample_s * 5,
            ops_per_call={"asyncpool": tasks * rounds, "Semaphore": tasks * rounds},
            start=1,
            disable_gc=False,
        )
        stats = pool.stats()
        assert stats.allocated == 0, stats
    finally:
        await pool.close()
    return [
        compare(
            per_op,
            bench=f"contended: {tasks} tasks on {cfg.contended_rows} rows",
            loop=loop,
            subject="asyncpool",
            reference="Semaphore",
            unit="ns/grant",
            speedup=False,
            target=CONTENDED_VS_SEM,
            reference_label=f"asyncio.Semaphore({cfg.contended_rows})",
            note=f"each task: {rounds}x (acquire, sleep(0), release); gc on",
        ),
    ]
