"""What KV groups (a hybrid model's pools) cost: grouped admission and growth.

``--only groups``. A pool with KV groups, as a model with full-attention,
sliding-window and Mamba layers needs it: ``kv={"full": KVPagePool(...),
"swa": KVPagePool(...), "mamba": KVPagePool(rows + 1, 1)}`` (16 token
slots a page in both attention groups; the preset's sizes).

* Uncontended admission: ``g = await pool.admit({"full": 16, "swa": 4,
  "mamba": 1}); pool.free([g.row])`` against, side by side, the same work
  done apart by hand (``alloc(1)`` + ``free`` on a rows-only pool plus
  ``alloc(16)``, ``alloc(4)`` and ``alloc(1)`` + ``free`` on three bare
  ``KVPagePool`` s), and against the single-kv ``admit(pages=16)`` + free
  (the ``admit`` benchmark's subject); for context, one row a step from
  one kv to three groups: ``admit({"full": 16})`` on a pool of that one
  group against ``admit(pages=16)`` (the grouped path itself, the same
  pages), ``admit({"full": 16, "swa": 4})`` against it (the swa group),
  and the three groups against the two (the mamba group).
  Target: within 1.5x of the work apart, the single-kv admission's target
  (all or nothing across groups may cost little more than doing it apart).
* Context: a grouped decode step's growth, 32 rows (``groups_batch_rows``)
  each one page in both attention groups:
  ``pool.extend_rows(rows, {"full": 1, "swa": 1})`` against
  ``extend_rows(rows, 1, group="full")`` then ``extend_rows(rows, 1,
  group="swa")``; per row. The rows are admitted once; every 16 steps they
  are trimmed back (``trim_pages``, untimed, no fence) to their admitted
  pages, which keeps their growth buffers: the steady state of a long decode,
  no first-growth copy in the figures.
* Context: a sliding window's step, 32 rows each giving back the one page
  that slid out of the window behind the step still in flight (a host
  stream held by a gate, the step's fence recorded as the rows' use):
  ``pool.drop_pages(rows, below, group="swa")`` against
  ``pool.trim_pages(rows, 4, group="swa")``, the same pages' worth given
  back from the other end; per row, only the drop or the trim timed (each
  step grows every row a swa page first, untimed; rows admitted afresh
  every 16 steps, untimed).
* Context: a speculative step's block table, 32 rows of ``admit_pages``
  to ``admit_pages + 15`` full-attention pages:
  ``table, counts = pool.pages_of_rows(rows, group="full")`` against
  ``pool.pages_of(row, group="full")`` per row, padded into a table by
  ``torch.nn.utils.rnn.pad_sequence`` with the counts as a tensor (the
  same two tensors); per row.
* Context: a speculative step's rollback on a hybrid model, 32 rows each
  giving back the pages of its rejected drafts in both attention groups
  (1 to 3 pages a row, no fence: free at once): ``pool.trim_pages(rows,
  {"full": keeps, "swa": keeps})`` against ``trim_pages(rows, keeps,
  group="full")`` then ``(..., group="swa")``; per row, only the trim timed
  (each step's draft growth, ``extend_rows(rows, {"full": drafts, "swa":
  drafts})``, untimed).
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .harness import Config, Row, Sampler, Target, clock_of, compare, interleave, loop_name

if TYPE_CHECKING:
    from asyncpool import AsyncReqToTokenPool

__all__ = ["GROUPED_ADMIT_VS_APART", "bench_groups"]

#: the single-kv admission's target (``bench_admit.ADMIT_VS_APART``), for groups
GROUPED_ADMIT_VS_APART = Target("<=", 1.5)

#: decode steps per admitted (or trimmed back) batch of rows
STEPS = 16
PAGE_SIZE = 16


async def bench_groups(cfg: Config) -> list[Row]:
    """Grouped admission against its parts, then grouped growth and drops."""
    rows = await _admit(cfg)
    rows += await _growth(cfg)
    rows += await _window(cfg)
    rows += await _block_table(cfg)
    rows += await _rollback(cfg)
    return rows


def _admit_sampler(
    admit: Callable[[Any], Awaitable[Any]],
    free: Callable[[list[int]], object],
    counts: Any,
    now: Callable[[], int],
) -> Sampler:
    async def sample(n: int) -> int:
        t0 = now()
        for _ in range(n):
            g = await admit(counts)
            free([g.row])
        return now() - t0

    return sample


async def _admit(cfg: Config) -> list[Row]:
    from asyncpool import AsyncReqToTokenPool, KVPagePool

    loop = loop_name()
    now = clock_of(cfg)
    k, w, size = cfg.admit_pages, cfg.groups_window_pages, cfg.size
    num = cfg.admit_num_pages

    def groups(*names: str) -> dict[str, KVPagePool]:
        made = {
            "full": KVPagePool(num, PAGE_SIZE, name="full"),
            "swa": KVPagePool(num, PAGE_SIZE, name="swa"),
            "mamba": KVPagePool(size, 1, name="mamba"),  # a state slot a row
        }
        return {n: made[n] for n in names}

    three = {"full": k, "swa": w, "mamba": 1}
    two = {"full": k, "swa": w}
    one = {"full": k}
    pool3 = AsyncReqToTokenPool(size, cfg.max_context_len, kv=groups("full", "swa", "mamba"))
    pool2 = AsyncReqToTokenPool(size, cfg.max_context_len, kv=groups("full", "swa"))
    pool1g = AsyncReqToTokenPool(size, cfg.max_context_len, kv=groups("full"))
    pool1 = AsyncReqToTokenPool(size, cfg.max_context_len, kv=KVPagePool(num, PAGE_SIZE))
    rows_pool = AsyncReqToTokenPool(size, cfg.max_context_len)
    bare = groups("full", "swa", "mamba")

    async def apart_sample(n: int) -> int:
        alloc, free = rows_pool.alloc, rows_pool.free
        f_alloc, f_free = bare["full"].alloc, bare["full"].free
        s_alloc, s_free = bare["swa"].alloc, bare["swa"].free
        m_alloc, m_free = bare["mamba"].alloc, bare["mamba"].free
        t0 = now()
        for _ in range(n):
            rows = await alloc(1)
            full, swa, state = f_alloc(k), s_alloc(w), m_alloc(1)
            # Sized so alloc never returns None: no check in the timed loop.
            f_free(full)  # type: ignore[arg-type]
            s_free(swa)  # type: ignore[arg-type]
            m_free(state)  # type: ignore[arg-type]
            free(rows)
        return now() - t0

    try:
        per_op = await interleave(
            {
                "three groups": _admit_sampler(pool3.admit, pool3.free, three, now),
                "two groups": _admit_sampler(pool2.admit, pool2.free, two, now),
                "one group": _admit_sampler(pool1g.admit, pool1g.free, one, now),
                "single kv": _admit_sampler(pool1.admit, pool1.free, k, now),
                "apart": apart_sample,
            },
            rounds=cfg.rounds,
            target_s=cfg.sample_s,
        )
        for p in (pool3, pool2, pool1g, pool1):
            st = p.stats()
            assert st.allocated == 0 and st.pages_allocated == 0, st
    finally:
        for p in (pool3, pool2, pool1g, pool1, rows_pool):
            await p.close()
    bench = f"uncontended grouped admit(full={k}, swa={w}, mamba=1)+free"
    label3 = f'admit({{"full": {k}, "swa": {w}, "mamba": 1}}) + free'
    return [
        compare(
            per_op,
            bench=bench,
            loop=loop,
            subject="three groups",
            reference="apart",
            unit="ns/cycle",
            speedup=False,
            target=GROUPED_ADMIT_VS_APART,
            subject_label=label3,
            reference_label=f"alloc(1)+free (rows pool) + alloc({k}), alloc({w}), "
            "alloc(1)+free (3 bare KVPagePools)",
        ),
        compare(
            per_op,
            bench=bench,
            loop=loop,
            subject="three groups",
            reference="single kv",
            unit="ns/cycle",
            speedup=False,
            subject_label=label3,
            reference_label=f"admit(pages={k}) + free (one kv)",
            note="context: a hybrid model's admission against a dense model's",
        ),
        compare(
            per_op,
            bench=bench,
            loop=loop,
            subject="one group",
            reference="single kv",
            unit="ns/cycle",
            speedup=False,
            subject_label=f'admit({{"full": {k}}}) + free (one group)',
            reference_label=f"admit(pages={k}) + free (one kv)",
            note="context: the grouped path itself, the same pages",
        ),
        compare(
            per_op,
            bench=bench,
            loop=loop,
            subject="two groups",
            reference="one group",
            unit="ns/cycle",
            speedup=False,
            subject_label=f'admit({{"full": {k}, "swa": {w}}}) + free',
            reference_label=f'admit({{"full": {k}}}) + free (one group)',
            note="context: what the swa group adds",
        ),
        compare(
            per_op,
            bench=bench,
            loop=loop,
            subject="three groups",
            reference="two groups",
            unit="ns/cycle",
            speedup=False,
            subject_label=label3,
            reference_label=f'admit({{"full": {k}, "swa": {w}}}) + free',
            note="context: what the mamba group adds",
        ),
    ]


def _batch_pool(batch: int, full: int, swa: int) -> AsyncReqToTokenPool:
    """A pool of ``batch`` rows with a full, a swa (``full`` and ``swa``
    pages) and a Mamba group (a state slot a row), for the step benches."""
    from asyncpool import AsyncReqToTokenPool, KVPagePool

    return AsyncReqToTokenPool(
        batch + 1,
        16,
        kv={
            "full": KVPagePool(full + 1, PAGE_SIZE, name="full"),
            "swa": KVPagePool(swa + 1, PAGE_SIZE, name="swa"),
            "mamba": KVPagePool(batch + 1, 1, name="mamba"),
        },
    )


async def _growth(cfg: Config) -> list[Row]:

    loop = loop_name()
    now = clock_of(cfg)
    k, w, batch = cfg.admit_pages, cfg.groups_window_pages, cfg.groups_batch_rows
    pool = _batch_pool(batch, batch * (k + STEPS), batch * (w + STEPS))
    rows = []
    for _ in range(batch):
        grant = pool.try_admit({"full": k, "swa": w, "mamba": 1})
        assert grant is not None
        rows.append(grant.row)
    both = {"full": 1, "swa": 1}

    def steps(grouped: bool) -> Sampler:
        async def sample(n: int) -> int:
            # n decode steps (of `batch` rows each: ops_per_call), at most
            # STEPS before the rows are trimmed back to what they were
            # admitted with (untimed; their growth buffers stay).
            elapsed = done = 0
            extend_rows, trim = pool.extend_rows, pool.trim_pages
            while done < n:
                c = min(STEPS, n - done)
                t0 = now()
                for _ in range(c):
                    if grouped:
                        extend_rows(rows, both)
                    else:
                        extend_rows(rows, 1, group="full")
                        extend_rows(rows, 1, group="swa")
                elapsed += now() - t0
                trim(rows, k, group="full")
                trim(rows, w, group="swa")
                done += c
            return elapsed

        return sample

    try:
        per_op = await interleave(
            {"grouped": steps(True), "per group": steps(False)},
            rounds=cfg.rounds,
            target_s=cfg.sample_s,
            ops_per_call={"grouped": batch, "per group": batch},
        )
        # Every step grew every row (a None would have been a short pool).
        st = pool.stats()
        assert st.growth_refusals == 0 and st.pages_allocated == batch * (k + w + 1), st
    finally:
        await pool.close()
    return [
        compare(
            per_op,
            bench=f"grouped decode step: {batch} rows grow 1 page in full and swa each",
            loop=loop,
            subject="grouped",
            reference="per group",
            unit="ns/row",
            speedup=True,
            subject_label=f'extend_rows(rows, {{"full": 1, "swa": 1}}), {batch} rows',
            reference_label=f'extend_rows(rows, 1, group="full") + (..., group="swa"), '
            f"{batch} rows",
            note="context: all or nothing across the groups in one call",
        ),
    ]


async def _window(cfg: Config) -> list[Row]:
    from asyncpool import HostStream

    loop = loop_name()
    now = clock_of(cfg)
    k, w, batch = cfg.admit_pages, cfg.groups_window_pages, cfg.groups_batch_rows
    pool = _batch_pool(batch, batch * k, batch * (w + STEPS + 1))
    stream = HostStream(name="bench-window")
    counts = {"full": k, "swa": w, "mamba": 1}

    def window_steps(drop: bool) -> Sampler:
        async def sample(n: int) -> int:
            # n window steps (of `batch` rows each: ops_per_call), at most
            # STEPS on one batch of freshly admitted rows. Each step grows
            # every row a swa page, then gives one back behind the step's
            # open fence: the oldest (drop) or the newest (trim); only that
            # call is timed.
            elapsed = done = 0
            admit, free, extend_rows = pool.try_admit, pool.free, pool.extend_rows
            drop_pages, trim = pool.drop_pages, pool.trim_pages
            while done < n:
                c = min(STEPS, n - done)
                rows = []
                for _ in range(batch):
                    grant = admit(counts)
                    assert grant is not None
                    rows.append(grant.row)
                for j in range(c):
                    assert extend_rows(rows, 1, group="swa") is not None
                    gate = threading.Event()
                    stream.launch(gate.wait)
                    pool.record_use(rows, stream.record())
                    t0 = now()
                    if drop:
                        drop_pages(rows, j + 1, group="swa")
                    else:
                        trim(rows, w, group="swa")
                    elapsed += now() - t0
                    gate.set()
                    stream.synchronize()
                    pool.reclaim()
                free(rows)
                done += c
            return elapsed

        return sample

    try:
        per_op = await interleave(
            {"drop": window_steps(True), "trim": window_steps(False)},
            rounds=cfg.rounds,
            target_s=cfg.sample_s,
            ops_per_call={"drop": batch, "trim": batch},
        )
        pool.reclaim()
        st = pool.stats()
        assert st.allocated == 0 and st.pages_allocated == 0 and st.pages_pending == 0, st
    finally:
        await pool.close()
        stream.close()
    return [
        compare(
            per_op,
            bench=f"sliding window step: {batch} rows give back the page that slid out",
            loop=loop,
            subject="drop",
            reference="trim",
            unit="ns/row",
            speedup=False,
            subject_label=f'drop_pages(rows, below, group="swa"), {batch} rows, 1 page each',
            reference_label=f'trim_pages(rows, {w}, group="swa"), {batch} rows, 1 page each',
            note="context: behind the step's open fence; only the give-back timed",
        ),
    ]


async def _block_table(cfg: Config) -> list[Row]:
    import torch

    loop = loop_name()
    now = clock_of(cfg)
    k, w, batch = cfg.admit_pages, cfg.groups_window_pages, cfg.groups_batch_rows
    pool = _batch_pool(batch, batch * (k + STEPS), batch * w)
    rows = []
    for i in range(batch):
        grant = pool.try_admit({"full": k + i % STEPS, "swa": w, "mamba": 1})
        assert grant is not None
        rows.append(grant.row)
    pad = torch.nn.utils.rnn.pad_sequence

    def tables(batched: bool) -> Sampler:
        async def sample(n: int) -> int:
            pages_of, pages_of_rows = pool.pages_of, pool.pages_of_rows
            t0 = now()
            for _ in range(n):
                if batched:
                    pages_of_rows(rows, group="full")  # (table, counts)
                else:
                    each = [pages_of(row, group="full") for row in rows]
                    pad(each, batch_first=True)  # the table
                    torch.tensor([len(t) for t in each], dtype=torch.int64)  # the counts
            return now() - t0

        return sample

    try:
        one, _ = pool.pages_of_rows(rows, group="full")
        each = [pool.pages_of(row, group="full") for row in rows]
        assert torch.equal(one, pad(each, batch_first=True))  # the same table
        per_op = await interleave(
            {"batched": tables(True), "per row": tables(False)},
            rounds=cfg.rounds,
            target_s=cfg.sample_s,
            ops_per_call={"batched": batch, "per row": batch},
        )
    finally:
        await pool.close()
    return [
        compare(
            per_op,
            bench=f"block table: {batch} rows of {k} to {k + STEPS - 1} pages",
            loop=loop,
            subject="batched",
            reference="per row",
            unit="ns/row",
            speedup=True,
            subject_label=f'pages_of_rows(rows, group="full"), {batch} rows',
            reference_label=f'pages_of(row, group="full") per row + pad_sequence, {batch} rows',
            note="context: the (table, counts) of a step in one call",
        ),
    ]


async def _rollback(cfg: Config) -> list[Row]:
    loop = loop_name()
    now = clock_of(cfg)
    k, w, batch = cfg.admit_pages, cfg.groups_window_pages, cfg.groups_batch_rows
    pool = _batch_pool(batch, batch * (k + 4), batch * (w + 4))
    rows = []
    for _ in range(batch):
        grant = pool.try_admit({"full": k, "swa": w, "mamba": 1})
        assert grant is not None
        rows.append(grant.row)
    drafts = [1 + i % 3 for i in range(batch)]  # rejected drafts' pages a row
    grow = {"full": drafts, "swa": drafts}
    keeps = {"full": [k] * batch, "swa": [w] * batch}

    def rollbacks(grouped: bool) -> Sampler:
        async def sample(n: int) -> int:
            elapsed = 0
            extend_rows, trim = pool.extend_rows, pool.trim_pages
            for _ in range(n):
                assert extend_rows(rows, grow) is not None
                t0 = now()
                if grouped:
                    trim(rows, keeps)
                else:
                    trim(rows, keeps["full"], group="full")
                    trim(rows, keeps["swa"], group="swa")
                elapsed += now() - t0
            return elapsed

        return sample

    try:
        per_op = await interleave(
            {"grouped": rollbacks(True), "per group": rollbacks(False)},
            rounds=cfg.rounds,
            target_s=cfg.sample_s,
            ops_per_call={"grouped": batch, "per group": batch},
        )
        st = pool.stats()
        assert st.growth_refusals == 0 and st.pages_allocated == batch * (k + w + 1), st
    finally:
        await pool.close()
    return [
        compare(
            per_op,
            bench=f"speculative rollback: {batch} rows trim 1-3 draft pages in full and swa each",
            loop=loop,
            subject="grouped",
            reference="per group",
            unit="ns/row",
            speedup=True,
            subject_label=f'trim_pages(rows, {{"full": keeps, "swa": keeps}}), {batch} rows',
            reference_label=f'trim_pages(rows, keeps, group="full") + (..., group="swa"), '
            f"{batch} rows",
            note="context: every group checked before any changes; only the trim timed",
        ),
    ]
