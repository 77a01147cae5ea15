"""Review of the decode-growth fast path, ``check_allocated`` and the new
benchmarks: the findings' regression tests (SGLang's decode side on a CUDA
host, the Semaphore's remove counted once in ``grant_parts``), and
differential guards of ``extend_rows(rows, 1)`` and ``check_allocated``
against the code they replaced."""

from __future__ import annotations

import asyncio
import collections
import random
import types
from typing import Any

import numpy as np
import pytest
import torch
from helpers import FakeStream, ledger_snapshot

from asyncpool import AsyncReqToTokenPool, InvalidSlotError, KVPagePool
from asyncpool.ledger import SlotLedger
from asyncpool.row_pages import RowPages
from benchmarks import bench_decode as decode_mod
from benchmarks import grant_parts
from benchmarks.harness import PRESETS

SMOKE = PRESETS["smoke"]


# ---------------------------------------------------------------- bench_decode: SGLang


class _SglangLike:
    """SGLang's ``PagedTokenToKVPoolAllocator`` as far as the decode bench uses
    it. SGLang sets ``use_triton_kernels`` from the platform (True on any CUDA
    host), not from the allocator's device; its Triton kernel cannot read CPU
    tensors, so on a CUDA host ``alloc_decode`` of this CPU pool fails."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.free_pages = torch.arange(1, num_pages, dtype=torch.int64)
        self.use_triton_kernels = True  # what SGLang picks on a CUDA host

    def alloc(self, need_size: int) -> torch.Tensor | None:
        n = need_size // self.page_size
        if n > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return (out[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        if self.use_triton_kernels and not seq_lens.is_cuda:
            raise RuntimeError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
        need = (seq_lens_cpu - 1) % self.page_size == 0
        k = int(need.sum())
        if k > len(self.free_pages):
            return None
        out = last_loc + 1
        out[need] = self.free_pages[:k] * self.page_size
        self.free_pages = self.free_pages[k:]
        return out

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        self.free_pages = torch.cat((page_ids, self.free_pages))

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size


async def test_decode_sglang_side_runs_sglangs_torch_path_on_a_cuda_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The docstring says the SGLang side runs SGLang's torch path on CPU; on
    # a host where SGLang detects CUDA it took the Triton kernel instead,
    # which cannot read the CPU tensors: the decode bench raised mid-run.
    monkeypatch.setattr(decode_mod, "_sglang_pool", _SglangLike)
    sc = decode_mod.Scenario.of(SMOKE)
    side = decode_mod.SglangSlots(sc)
    held = side.available()
    elapsed = await side.sampler(sc, lambda: 0)(2)  # two batches, every step checked
    assert elapsed == 0 and side.available() == held


# ---------------------------------------------------------------- grant_parts: Semaphore


class _CountingDeque(collections.deque):  # type: ignore[type-arg]
    removals = 0

    def popleft(self) -> Any:
        _CountingDeque.removals += 1
        return super().popleft()

    def remove(self, value: Any) -> None:
        _CountingDeque.removals += 1
        super().remove(value)


async def test_grant_parts_semaphore_release_does_not_count_the_acquires_remove(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A Semaphore grant removes its waiter once, in the resumed acquire
    # (`self._waiters.remove(fut)`), which the wait side's hand-driven
    # acquire runs and times. The release side also timed a popleft per
    # release ("the resumed acquire's remove"): counted twice in "a grant,
    # both sides" (about 25 ns of the Semaphore's ~0.9 us).
    monkeypatch.setattr(grant_parts, "collections", types.SimpleNamespace(deque=_CountingDeque))
    _CountingDeque.removals = 0
    best = await grant_parts._free_side(grant_parts.FREE_PARTS[-1], 50, 2)
    assert best > 0
    assert _CountingDeque.removals == 0


# ---------------------------------------------------------------- guards: extend_rows(rows, 1)


def _old_extend_rows(self: RowPages, rows: Any, k: int) -> Any:
    """``RowPages.extend_rows`` at bd0215d: ``_append`` per row, whatever k."""
    arr = self._take_reclaiming(len(rows) * k, rows)
    if arr is None:
        return None
    for i, row in enumerate(rows):
        self._append(row, arr[i * k : i * k + k])
    return self.out(arr.reshape(len(rows), k))


def _outcome(f: Any) -> Any:
    try:
        got = f()
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc))
    if isinstance(got, torch.Tensor):
        return ("tensor", tuple(got.shape), got.tolist())
    if hasattr(got, "row"):
        return ("grant", got.row, got.pages.tolist())
    return ("value", got)


def _observed(pool: AsyncReqToTokenPool) -> Any:
    try:
        pool.check_invariants()
        inv = "ok"
    except Exception as exc:  # a record written into may fail them, on both sides
        inv = repr(exc)
    st = pool.stats()
    rp = pool._pages
    assert rp is not None
    return (
        inv,
        (
            st.free,
            st.allocated,
            st.pending,
            st.pages_free,
            st.pages_allocated,
            st.pages_pending,
            st.frees,
            st.allocs,
        ),
        [None if a is None else a.tolist() for a in rp.owned],
        [None if s is None else (type(s).__name__, bytes(s)) for s in rp.sealed],
        bytes(rp.ledger._state),
    )


def _rows_as(rng: random.Random, rows: list[Any]) -> Any:
    if not all(type(r) is int for r in rows):
        return rows
    form = rng.randrange(5)
    if form == 1:
        return tuple(rows)
    if form == 2:
        return np.array(rows, dtype=np.int64)
    if form == 3:
        return torch.tensor(rows, dtype=torch.int64)
    if form == 4:
        return [np.int64(r) for r in rows]
    return rows


async def _differential(seed: int, steps: int = 250) -> None:
    pools = [AsyncReqToTokenPool(7, 64, kv=KVPagePool(41, 4)) for _ in range(2)]
    rp = pools[1]._pages
    assert rp is not None
    rp.extend_rows = _old_extend_rows.__get__(rp, RowPages)  # type: ignore[method-assign]
    streams = [FakeStream(), FakeStream()]
    held: list[list[Any]] = [[], []]
    detached: list[list[torch.Tensor]] = [[], []]
    rng = random.Random(seed)
    ops = [
        "admit",
        "ext1",
        "extk",
        "extend",
        "pages_of",
        "write",
        "restore",
        "detach",
        "kvfree",
        "free",
        "fenced",
        "complete",
        "use",
        "cancel",
    ]
    for step in range(steps):
        op = rng.choices(ops, weights=[8, 14, 4, 3, 3, 2, 2, 2, 2, 5, 3, 3, 2, 4])[0]
        draw = rng.random()
        seen = []
        for i, pool in enumerate(pools):
            r = random.Random(draw)
            alloc = list(pool._ledger.allocated_rows())
            kv = pool.kv
            assert kv is not None
            got: Any = ("skip",)
            if op == "admit":
                k = r.randrange(4)
                got = _outcome(lambda: pool.try_admit(k))  # noqa: B023
            elif op in ("ext1", "extk"):
                k = 1 if op == "ext1" else r.randrange(1, 4)
                rows: list[Any] = r.sample(alloc, r.randrange(len(alloc) + 1))
                x = r.random()
                if x < 0.05 and rows:
                    rows.append(rows[0])  # a duplicate
                elif x < 0.08:
                    rows.append(0)
                elif x < 0.11:
                    rows.append(9)  # out of range
                elif x < 0.14:
                    rows.append(r.randrange(1, 7))  # maybe free
                elif x < 0.16:
                    rows.append(True)
                arg = _rows_as(r, rows)
                got = _outcome(lambda: pool.extend_rows(arg, k))  # noqa: B023
            elif op == "extend" and alloc:
                row, k = r.choice(alloc), r.randrange(1, 4)
                got = _outcome(lambda: pool.extend(row, k))  # noqa: B023
            elif op == "pages_of" and alloc:
                t = pool.pages_of(r.choice(alloc))
                held[i].append((t, t.clone()))
                got = ("tensor", t.tolist())
            elif op in ("write", "restore"):
                cands = [h for h in held[i] if h[0].numel()]
                if cands:
                    t, orig = cands[r.randrange(len(cands))]
                    if op == "write":
                        t[r.randrange(t.numel())] = r.choice([0, 1, 2, 99, -1])
                    else:
                        t.copy_(orig)
                    got = (op,)
            elif op == "detach" and alloc:
                got = _outcome(lambda: pool.detach_pages(r.choice(alloc)))  # noqa: B023
                if got[0] == "tensor":
                    detached[i].append(torch.tensor(got[2], dtype=torch.int64))
            elif op == "kvfree" and detached[i]:
                pages = detached[i].pop(r.randrange(len(detached[i])))
                got = _outcome(lambda: kv.free(pages))  # noqa: B023
            elif op in ("free", "fenced"):
                rows = r.sample(alloc, r.randrange(len(alloc) + 1))
                if r.random() < 0.1 and rows:
                    rows.append(rows[0])
                fence = streams[i].record() if op == "fenced" else None
                got = _outcome(lambda: pool.free(rows, fence))  # noqa: B023
            elif op == "use":
                rows = r.sample(alloc, r.randrange(len(alloc) + 1))
                fence = streams[i].record()
                got = _outcome(lambda: pool.record_use(rows, fence))  # noqa: B023
            elif op == "complete":
                streams[i].complete()
                got = _outcome(pool.reclaim)
            elif op == "cancel" and alloc and not pool.available_size():
                # Queued, granted by a free, cancelled before it resumed: give_back.
                task = asyncio.ensure_future(pool.admit(pages=r.randrange(4)))
                await asyncio.sleep(0)
                freed = _outcome(lambda: pool.free([r.choice(alloc)]))  # noqa: B023
                task.cancel()
                try:
                    await task
                    got = ("granted",)
                except asyncio.CancelledError:
                    got = ("cancelled", freed)
            seen.append((got, _observed(pool)))
        assert seen[0] == seen[1], (seed, step, op)
    for pool in pools:
        await pool.close()


@pytest.mark.parametrize("seed", range(6))
async def test_decode_fast_path_matches_the_old_per_row_append(seed: int) -> None:
    await _differential(seed)


# ---------------------------------------------------------------- guards: check_allocated


def test_check_allocated_matches_marking_and_unmarking() -> None:
    def old(led: SlotLedger, rows: Any) -> None:
        led._mark_allocated(rows, "freed")
        led._unmark(rows)

    def outcome(f: Any) -> Any:
        try:
            f()
        except Exception as exc:
            return type(exc).__name__, str(exc)
        return None

    for seed in range(400):
        rng = random.Random(seed)
        size = rng.randrange(2, 10)
        led = SlotLedger(size)
        stream = FakeStream()
        rows = list(led.take(rng.randrange(size)) or [])
        for row in list(rows):
            x = rng.random()
            if x < 0.2:
                led.free([row])
                rows.remove(row)
            elif x < 0.35:
                led.free([row], stream.record())
                rows.remove(row)
            elif x < 0.5:
                led.record_use([row], stream.record())
        pick = [*rows, 0, -1, size, True, False, 1.0, np.int64(1), "1", None, *range(size)]
        for _ in range(20):
            q: Any = [rng.choice(pick) for _ in range(rng.randrange(6))]
            if rng.random() < 0.5:
                q = tuple(q)
            before = ledger_snapshot(led)
            new = outcome(lambda: led.check_allocated(q, "freed"))  # noqa: B023
            assert ledger_snapshot(led) == before
            assert new == outcome(lambda: old(led, q)), (seed, q)  # noqa: B023
            assert ledger_snapshot(led) == before


# ------------------------------------------------ check_invariants, written records


@pytest.mark.parametrize("written", ["another row's page", "an id out of range"])
def test_check_invariants_reads_the_seal_not_a_record_the_caller_wrote_into(written: str) -> None:
    # Writing into a row's record breaks the contract, and the row's free
    # refuses it; the pool's own state (seal and ledger) is intact, so
    # check_invariants passes, and once the record is restored, free works.
    pool = AsyncReqToTokenPool(4, 64, kv=KVPagePool(16, 4))
    a = pool.try_admit(pages=2)
    b = pool.try_admit(pages=2)
    assert a is not None and b is not None
    pool.extend_rows([a.row], 1)  # a grown record (a buffer) as well
    record = pool.pages_of(a.row)
    kept = int(record[0])
    record[0] = int(b.pages[0]) if written == "another row's page" else 10**9
    pool.check_invariants()
    with pytest.raises(InvalidSlotError):
        pool.free([a.row])
    pool.check_invariants()
    record[0] = kept
    pool.free([a.row, b.row])
    pool.check_invariants()
    assert pool.kv.available_size() == 15
