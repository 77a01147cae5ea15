"""Issue 13: what atomic admission costs.

* Uncontended: ``g = await pool.admit(pages=16); pool.free([g.row])`` on a
  pool with ``kv=``, against the same work done apart, side by side:
  ``rows = await rows_pool.alloc(1); rows_pool.free(rows)`` on a rows-only
  pool plus ``pages = kv.alloc(16); kv.free(pages)`` on a bare
  ``KVPagePool``. Atomicity may cost little (target: within 1.5x).
* Contended: 1,000 tasks each admitting one row and 16 pages on a pool of 64
  rows and 512 pages (``admit``, one ``sleep(0)`` while holding, ``free``, a
  few times), against the same tasks on ``asyncio.Semaphore(64)``, the
  contended figure of the existing suite. Figure: time per grant, task
  creation and the gather included on both sides (target: within 1.5x).
* Context: ``alloc(1)`` + ``free`` on a pool *with* ``kv`` (its free
  takes the page-aware path) against a rows-only pool; the rows-only figure
  itself is the ``uncontended`` benchmark's, unchanged by admission.
* Context: decode growth, ``pool.extend(row, 1)`` on a row whose record
  lists 16,384 pages against one listing 16 (a page per decode step at
  ``page_size=1``, a 16K-token request). Amortised O(1): about 1x. It was
  O(n) (the record copied per extend) before the record grew in a buffer.
* Context: a decode step's growth of 256 rows by one page each,
  ``pool.extend_rows(rows, 1)`` against ``pool.extend(row, 1)`` per row;
  per row. And ``pool.extend_fitting(rows, 1)`` (every row fits) against
  ``extend_rows``: what the prefix count costs over all or nothing.
* Context: speculative decoding's rollback, 256 rows each giving back the
  2 pages past its first 8 behind the step still in flight (a host stream
  held by a gate, the step's fence recorded as the rows' use):
  ``pool.trim_pages(rows, 8)`` against ``pool.trim_pages(row, 8)`` per row;
  per row, only the trims timed.
"""

from __future__ import annotations

import asyncio
import threading

from .harness import (
    Config,
    Row,
    Sampler,
    Target,
    clock_of,
    compare,
    gathered,
    interleave,
    loop_name,
    pool_cycles,
    semaphore_worker,
)

__all__ = ["bench_admit"]

ADMIT_VS_APART = Target("<=", 1.5)
CONTENDED_ADMIT_VS_SEM = Target("<=", 1.5)


async def bench_admit(cfg: Config) -> list[Row]:
    from asyncpool import AsyncReqToTokenPool, KVPagePool

    loop = loop_name()
    now = clock_of(cfg)
    k = cfg.admit_pages
    # Uncontended: one pool with kv, one rows-only pool and one bare page pool.
    admit_pool = AsyncReqToTokenPool(
        cfg.size, cfg.max_context_len, kv=KVPagePool(cfg.admit_num_pages, 16)
    )
    rows_pool = AsyncReqToTokenPool(cfg.size, cfg.max_context_len)
    bare_kv = KVPagePool(cfg.admit_num_pages, 16)

    async def admit_sample(n: int) -> int:
        admit, free = admit_pool.admit, admit_pool.free
        t0 = now()
        for _ in range(n):
            g = await admit(k)
            free([g.row])
        return now() - t0

    async def apart_sample(n: int) -> int:
        alloc, free = rows_pool.alloc, rows_pool.free
        kv_alloc, kv_free = bare_kv.alloc, bare_kv.free
        t0 = now()
        for _ in range(n):
            rows = await alloc(1)
            pages = kv_alloc(k)
            # Sized so alloc never returns None: no check in the timed loop.
            kv_free(pages)  # type: ignore[arg-type]
            free(rows)
        return now() - t0

    kv_rows_sample = pool_cycles(admit_pool, 1, now)
    rows_sample = pool_cycles(rows_pool, 1, now)
    try:
        per_op = await interleave(
            {
                "admit": admit_sample,
                "apart": apart_sample,
                "alloc(1), kv pool": kv_rows_sample,
                "alloc(1), rows-only pool": rows_sample,
            },
            rounds=cfg.rounds,
            target_s=cfg.sample_s,
        )
    finally:
        await admit_pool.close()
        await rows_pool.close()
    rows = [
        compare(
            per_op,
            bench=f"uncontended admit(pages={k})+free",
            loop=loop,
            subject="admit",
            reference="apart",
            unit="ns/cycle",
            speedup=False,
            target=ADMIT_VS_APART,
            subject_label=f"admit(pages={k}) + free",
            reference_label=f"alloc(1)+free (rows pool) + alloc({k})+free (bare KVPagePool)",
        ),
        compare(
            per_op,
            bench="uncontended alloc(1)+free, pool with kv",
            loop=loop,
            subject="alloc(1), kv pool",
            reference="alloc(1), rows-only pool",
            unit="ns/cycle",
            speedup=False,
            note="context: with kv, free() takes the page-aware path",
        ),
    ]
    rows += await _extend(cfg)
    rows += await _trim(cfg)
    rows += await _contended(cfg)
    return rows


async def _trim(cfg: Config) -> list[Row]:
    from asyncpool import AsyncReqToTokenPool, HostStream, KVPagePool

    loop = loop_name()
    now = clock_of(cfg)
    batch, keep, draft = cfg.extend_batch_rows, 8, 2
    pool = AsyncReqToTokenPool(batch + 1, 16, kv=KVPagePool(batch * (keep + draft) + 1, 16))
    stream = HostStream(name="bench-trim")
    rows = []
    for _ in range(batch):
        grant = pool.try_admit(pages=keep)
        assert grant is not None
        rows.append(grant.row)

    def rollbacks(batched: bool) -> Sampler:
        async def sample(n: int) -> int:
            # n row trims (ops_per_call: `batch` a step): each step grows
            # every row by `draft` pages, then gives them back behind the
            # step's open fence; only the trims are timed.
            elapsed = done = 0
            trim = pool.trim_pages
            while done < n:
                assert pool.extend_rows(rows, draft) is not None
                gate = threading.Event()
                stream.launch(gate.wait)
                pool.record_use(rows, stream.record())
                t0 = now()
                if batched:
                    trim(rows, keep)
                else:
                    for row in rows:
                        trim(row, keep)
                elapsed += now() - t0
                gate.set()
                stream.synchronize()
                pool.reclaim()
                done += 1
            return elapsed

        return sample

    try:
        per_op = await interleave(
            {"one call": rollbacks(True), "per row": rollbacks(False)},
            rounds=cfg.rounds,
            target_s=cfg.sample_s,
            ops_per_call={"one call": batch, "per row": batch},
        )
    finally:
        await pool.close()
        stream.close()
    return [
        compare(
            per_op,
            bench=f"speculative rollback: {batch} rows give back {draft} pages each",
            loop=loop,
            subject="one call",
            reference="per row",
            unit="ns/row",
            speedup=True,
            subject_label=f"trim_pages(rows, {keep}), {batch} rows",
            reference_label=f"trim_pages(row, {keep}) for each of {batch} rows",
            note="context: behind the step's open fence; one check and one deferral for the batch",
        ),
    ]


async def _extend(cfg: Config) -> list[Row]:
    from asyncpool import AsyncReqToTokenPool, KVPagePool

    loop = loop_name()
    now = clock_of(cfg)
    long, short, chunk = cfg.extend_record_pages, cfg.admit_pages, cfg.extend_chunk
    pool = AsyncReqToTokenPool(2, 16, kv=KVPagePool(long + chunk + 1, 1))

    def extends_at(record: int) -> Sampler:
        async def sample(n: int) -> int:
            # A record of `record` pages grows by `chunk` pages at most, then
            # is freed; only the extends are timed.
            elapsed = done = 0
            extend, admit, free = pool.extend, pool.try_admit, pool.free
            while done < n:
                c = min(chunk, n - done)
                grant = admit(pages=record)
                assert grant is not None
                row = grant.row
                t0 = now()
                for _ in range(c):
                    extend(row, 1)
                elapsed += now() - t0
                free([row])
                done += c
            return elapsed

        return sample

    # A decode step: every row of the batch grows one page, `steps` steps
    # per batch of freshly admitted rows.
    batch, steps = cfg.extend_batch_rows, 16
    batch_pool = AsyncReqToTokenPool(batch + 1, 16, kv=KVPagePool(batch * (steps + 1) + 1, 1))

    def decode_steps(how: str) -> Sampler:
        async def sample(n: int) -> int:
            # n decode steps (of `batch` row-extends each: ops_per_call), at
            # most `steps` on one batch of freshly admitted rows.
            elapsed = done = 0
            admit, free = batch_pool.try_admit, batch_pool.free
            extend, extend_rows = batch_pool.extend, batch_pool.extend_rows
            extend_fitting = batch_pool.extend_fitting
            while done < n:
                c = min(steps, n - done)
                rows = []
                for _ in range(batch):
                    grant = admit(pages=1)
                    assert grant is not None
                    rows.append(grant.row)
                t0 = now()
                for _ in range(c):
                    if how == "rows":
                        extend_rows(rows, 1)
                    elif how == "fitting":
                        extend_fitting(rows, 1)
                    else:
                        for row in rows:
                            extend(row, 1)
                elapsed += now() - t0
                free(rows)
                done += c
            return elapsed

        return sample

    try:
        per_op = await interleave(
            {
                "long": extends_at(long),
                "short": extends_at(short),
                "extend_rows": decode_steps("rows"),
                "extend_fitting": decode_steps("fitting"),
                "extend each": decode_steps("each"),
            },
            rounds=cfg.rounds,
            target_s=cfg.sample_s,
            ops_per_call={"extend_rows": batch, "extend_fitting": batch, "extend each": batch},
        )
    finally:
        await pool.close()
        await batch_pool.close()
    return [
        compare(
            per_op,
            bench=f"decode step: {batch} rows grow 1 page each",
            loop=loop,
            subject="extend_rows",
            reference="extend each",
            unit="ns/row",
            speedup=True,
            subject_label=f"extend_rows(rows, 1), {batch} rows",
            reference_label=f"extend(row, 1) for each of {batch} rows",
            note="context: one take and one tensor for the batch",
        ),
        compare(
            per_op,
            bench=f"decode step: {batch} rows grow 1 page each, as far as pages go",
            loop=loop,
            subject="extend_fitting",
            reference="extend_rows",
            unit="ns/row",
            speedup=False,
            subject_label=f"extend_fitting(rows, 1), {batch} rows (all fit)",
            reference_label=f"extend_rows(rows, 1), {batch} rows",
            note="context: the prefix count costs little over all or nothing",
        ),
        compare(
            per_op,
            bench="decode growth: extend(row, 1)",
            loop=loop,
            subject="long",
            reference="short",
            unit="ns/extend",
            speedup=False,
            subject_label=f"extend(row, 1), record of {long:,} pages",
            reference_label=f"extend(row, 1), record of {short} pages",
            note="context: amortised O(1) (the record grows in a doubling buffer)",
        ),
    ]


async def _contended(cfg: Config) -> list[Row]:
    from asyncpool import AsyncReqToTokenPool, KVPagePool

    loop = loop_name()
    now = clock_of(cfg)
    tasks, rounds = cfg.contended_tasks, cfg.contended_rounds
    k = cfg.admit_pages
    pool = AsyncReqToTokenPool(
        cfg.contended_rows + 1,
        cfg.max_context_len,
        kv=KVPagePool(cfg.contended_pages + 1, 16),
    )
    sem = asyncio.Semaphore(cfg.contended_rows)
    # The same page work without atomic admission: as many holders as the
    # pages allow, each taking and freeing its pages on a bare KVPagePool.
    holders = max(1, min(cfg.contended_rows, cfg.contended_pages // k))
    sem_kv = asyncio.Semaphore(holders)
    bare_kv = KVPagePool(cfg.contended_pages + 1, 16)
    sleep = asyncio.sleep

    async def admit_worker() -> None:
        admit, free = pool.admit, pool.free
        for _ in range(rounds):
            g = await admit(k)
            await sleep(0)
            free([g.row])

    async def sem_kv_worker() -> None:
        acquire, release = sem_kv.acquire, sem_kv.release
        kv_alloc, kv_free = bare_kv.alloc, bare_kv.free
        for _ in range(rounds):
            await acquire()
            pages = kv_alloc(k)
            await sleep(0)
            kv_free(pages)  # type: ignore[arg-type]  # sized: never None (as above)
            release()

    sem_kv_sample = gathered(sem_kv_worker, tasks, now)
    pool_sample = gathered(admit_worker, tasks, now)
    sem_sample = gathered(semaphore_worker(sem, rounds), tasks, now)

    try:
        per_op = await interleave(
            {"asyncpool": pool_sample, "Semaphore": sem_sample, "Semaphore+kv": sem_kv_sample},
            rounds=cfg.rounds,
            target_s=cfg.sample_s * 5,
            ops_per_call={
                "asyncpool": tasks * rounds,
                "Semaphore": tasks * rounds,
                "Semaphore+kv": tasks * rounds,
            },
            start=1,
            disable_gc=False,
        )
        st = pool.stats()
        assert st.allocated == 0 and st.pages_allocated == 0, st
    finally:
        await pool.close()
    return [
        compare(
            per_op,
            bench=f"contended admit: {tasks} tasks, 1 row + {k} pages each, on "
            f"{cfg.contended_rows} rows / {cfg.contended_pages} pages",
            loop=loop,
            subject="asyncpool",
            reference="Semaphore",
            unit="ns/grant",
            speedup=False,
            target=CONTENDED_ADMIT_VS_SEM,
            subject_label=f"admit(pages={k})",
            reference_label=f"asyncio.Semaphore({cfg.contended_rows})",
            note=f"each task: {rounds}x (admit, sleep(0), free); gc on",
        ),
        compare(
            per_op,
            bench=f"contended admit: {tasks} tasks, 1 row + {k} pages each, on "
            f"{cfg.contended_rows} rows / {cfg.contended_pages} pages",
            loop=loop,
            subject="asyncpool",
            reference="Semaphore+kv",
            unit="ns/grant",
            speedup=False,
            subject_label=f"admit(pages={k})",
            reference_label=f"asyncio.Semaphore({holders}) + bare KVPagePool alloc({k})+free",
            note="context: the same page work, without atomic admission",
        ),
    ]
