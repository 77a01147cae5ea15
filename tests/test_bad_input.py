"""Bad input: every bad call of the sync and async APIs, in one table.

Each case runs against a pool in a known state (capacity 8; rows 1-3
allocated, row 4 pending behind an open fence, row 5 allocated once and now
free, rows 6-8 never allocated) and asserts three things: the exact error
type, a message that names the culprit (the bad value, row or thread), and a
pool exactly as before (stats, every row's state and generation, the free
queue's order, the tables) whose invariants still hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    DoubleFreeError,
    InvalidSlotError,
    KVPagePool,
    PoolClosedError,
    PoolError,
    PoolStats,
    PriorityStats,
    ReqToTokenPool,
    ReqToTokenPoolInfo,
    WrongThreadError,
)
from asyncpool import HostStream as _HostStream
from asyncpool.stats import FrozenDict

SIZE = 9  # capacity 8
MAX_CONTEXT = 16
HELD = [1, 2, 3]
PENDING_ROW = 4
FREED_ROW = 5
NEVER = 7


@dataclass
class Ctx:
    pool: Any
    fence: Any  # an open HostFence
    stream: Any  # its HostStream: has synchronize() but no query(), so not a fence


@dataclass
class Case:
    id: str
    kind: str  # "sync", "async", "closed" (async pool after close()), "thread"
    call: Callable[[Ctx], Any]
    exc: type[BaseException]
    culprit: str | None  # None: the calling thread's ident


def info(verified: int, alloced: int, slots: int | None = None) -> ReqToTokenPoolInfo:
    n = alloced if slots is None else slots
    return ReqToTokenPoolInfo(verified, alloced, torch.arange(1, n + 1, dtype=torch.int32))


async def _lease(pool: AsyncReqToTokenPool, n: Any) -> None:
    async with pool.lease(n):
        raise AssertionError("a bad lease was granted")


def _sizes(kind: str) -> list[Case]:
    bad = [
        ("zero", 0, "0"),
        ("negative", -1, "-1"),
        ("float", 1.0, "1.0"),
        ("bool", True, "True"),
        ("none", None, "None"),
        ("over-capacity", SIZE, str(SIZE)),
        ("huge", 10**12, str(10**12)),
    ]
    cases = [
        Case(f"{kind}-alloc-{name}", kind, lambda c, n=n: c.pool.alloc(n), CapacityError, culprit)
        for name, n, culprit in bad
    ]
    if kind == "async":
        cases += [
            Case(
                f"async-try_alloc-{name}",
                kind,
                lambda c, n=n: c.pool.try_alloc(n),
                CapacityError,
                culprit,
            )
            for name, n, culprit in bad
        ]
        cases += [
            Case("async-lease-zero", kind, lambda c: _lease(c.pool, 0), CapacityError, "0"),
            Case("async-lease-float", kind, lambda c: _lease(c.pool, 2.5), CapacityError, "2.5"),
            Case("async-lease-over", kind, lambda c: _lease(c.pool, SIZE), CapacityError, "9"),
        ]
    return cases


def _rows(kind: str) -> list[Case]:
    return [
        Case(f"{kind}-free-row-0", kind, lambda c: c.pool.free([0]), InvalidSlotError, "0"),
        Case(f"{kind}-free-negative", kind, lambda c: c.pool.free([-1]), InvalidSlotError, "-1"),
        Case(
            f"{kind}-free-out-of-range",
            kind,
            lambda c: c.pool.free([SIZE]),
            InvalidSlotError,
            str(SIZE),
        ),
        Case(
            f"{kind}-free-far-out",
            kind,
            lambda c: c.pool.free([2**40]),
            InvalidSlotError,
            str(2**40),
        ),
        Case(f"{kind}-free-str-id", kind, lambda c: c.pool.free(["1"]), InvalidSlotError, "'1'"),
        Case(f"{kind}-free-float-id", kind, lambda c: c.pool.free([1.0]), InvalidSlotError, "1.0"),
        Case(f"{kind}-free-bool-id", kind, lambda c: c.pool.free([True]), InvalidSlotError, "True"),
        Case(f"{kind}-free-not-rows", kind, lambda c: c.pool.free("abc"), InvalidSlotError, "str"),
        Case(
            f"{kind}-free-never-allocated",
            kind,
            lambda c: c.pool.free([NEVER]),
            InvalidSlotError,
            str(NEVER),
        ),
        Case(
            f"{kind}-free-pending",
            kind,
            lambda c: c.pool.free([PENDING_ROW]),
            DoubleFreeError,
            str(PENDING_ROW),
        ),
        Case(
            f"{kind}-free-pending-int",
            kind,
            lambda c: c.pool.free(PENDING_ROW),
            DoubleFreeError,
            str(PENDING_ROW),
        ),
        Case(
            f"{kind}-free-already-free",
            kind,
            lambda c: c.pool.free([FREED_ROW]),
            DoubleFreeError,
            str(FREED_ROW),
        ),
        Case(
            f"{kind}-free-duplicate",
            kind,
            lambda c: c.pool.free([2, 1, 2]),
            InvalidSlotError,
            "row 2 appears twice in this call",
        ),
        Case(
            f"{kind}-free-numpy-float",
            kind,
            lambda c: c.pool.free(np.float64(1.5)),
            InvalidSlotError,
            "1.5",
        ),
        Case(
            f"{kind}-free-bool-tensor",
            kind,
            lambda c: c.pool.free(torch.tensor([True])),
            InvalidSlotError,
            "True",
        ),
        Case(
            f"{kind}-free-2d-tensor",
            kind,
            lambda c: c.pool.free(torch.tensor([[1, 2]])),
            InvalidSlotError,
            "2-D",
        ),
        Case(
            f"{kind}-free-after-str",
            kind,
            lambda c: c.pool.free([1], after="x"),
            TypeError,
            "after=",
        ),
        Case(
            f"{kind}-free-positional-non-fence",
            kind,
            lambda c: c.pool.free([1], "nope"),
            TypeError,
            "'nope'",
        ),
        # the good rows before the bad one must stay allocated (atomicity)
        Case(
            f"{kind}-free-good-then-row-0",
            kind,
            lambda c: c.pool.free([1, 2, 0]),
            InvalidSlotError,
            "0",
        ),
        Case(
            f"{kind}-free-good-then-pending",
            kind,
            lambda c: c.pool.free([1, 3, PENDING_ROW]),
            DoubleFreeError,
            str(PENDING_ROW),
        ),
        Case(
            f"{kind}-free-good-then-past-the-end",
            kind,
            lambda c: c.pool.free([1, 2, SIZE]),
            InvalidSlotError,
            str(SIZE),
        ),
        Case(
            f"{kind}-free-good-then-far-out",
            kind,
            lambda c: c.pool.free([1, 2, 2**70]),
            InvalidSlotError,
            str(2**70),
        ),
        Case(
            f"{kind}-free-good-then-negative",
            kind,
            lambda c: c.pool.free([1, 2, -2]),
            InvalidSlotError,
            "-2",
        ),
        Case(
            f"{kind}-free-good-then-float",
            kind,
            lambda c: c.pool.free([1, 2, 3.0]),
            InvalidSlotError,
            "3.0",
        ),
        Case(
            f"{kind}-free-good-then-bool",
            kind,
            lambda c: c.pool.free([2, True]),
            InvalidSlotError,
            "True",
        ),
        Case(
            f"{kind}-free-good-then-already-free",
            kind,
            lambda c: c.pool.free([1, 2, FREED_ROW]),
            DoubleFreeError,
            str(FREED_ROW),
        ),
        Case(
            f"{kind}-free-good-then-never",
            kind,
            lambda c: c.pool.free(iter([3, 2, 8])),
            InvalidSlotError,
            "8",
        ),
        # non-fences
        Case(
            f"{kind}-free-fence-object",
            kind,
            lambda c: c.pool.free([1], fence=object()),
            TypeError,
            "object",
        ),
        Case(f"{kind}-free-fence-int", kind, lambda c: c.pool.free([1], fence=42), TypeError, "42"),
        Case(
            f"{kind}-free-fence-str",
            kind,
            lambda c: c.pool.free([1], fence="done"),
            TypeError,
            "'done'",
        ),
        Case(
            f"{kind}-free-fence-stream",
            kind,
            lambda c: c.pool.free([1], fence=c.stream),
            TypeError,
            "HostStream",
        ),
        Case(
            f"{kind}-free-after-int", kind, lambda c: c.pool.free([1], after=42), TypeError, "int"
        ),
        Case(
            f"{kind}-free-after-ok-fence-bad",
            kind,
            lambda c: c.pool.free([1], after=None, fence=3.5),
            TypeError,
            "3.5",
        ),
        Case(
            f"{kind}-record_use-non-fence",
            kind,
            lambda c: c.pool.record_use([1], "nope"),
            TypeError,
            "'nope'",
        ),
        Case(
            f"{kind}-record_use-never",
            kind,
            lambda c: c.pool.record_use([NEVER], c.fence),
            InvalidSlotError,
            str(NEVER),
        ),
        Case(
            f"{kind}-record_use-pending",
            kind,
            lambda c: c.pool.record_use([1, PENDING_ROW], c.fence),
            InvalidSlotError,
            str(PENDING_ROW),
        ),
        Case(
            f"{kind}-record_use-row-0",
            kind,
            lambda c: c.pool.record_use([2, 0], c.fence),
            InvalidSlotError,
            "0",
        ),
        # set_req_pool_info
        Case(
            f"{kind}-set_info-past-max-context",
            kind,
            lambda c: c.pool.set_req_pool_info(1, info(4, MAX_CONTEXT + 1)),
            InvalidSlotError,
            str(MAX_CONTEXT + 1),
        ),
        Case(
            f"{kind}-set_info-verified-over-alloced",
            kind,
            lambda c: c.pool.set_req_pool_info(1, info(7, 5)),
            InvalidSlotError,
            "7",
        ),
        Case(
            f"{kind}-set_info-slots-mismatch",
            kind,
            lambda c: c.pool.set_req_pool_info(2, info(2, 4, slots=3)),
            InvalidSlotError,
            "3",
        ),
        # ... each refused before anything is written (a 2-D tensor of
        # alloced_len entries used to set the lengths, then fail the copy).
        Case(
            f"{kind}-set_info-slots-2d",
            kind,
            lambda c: c.pool.set_req_pool_info(
                2, ReqToTokenPoolInfo(2, 6, torch.ones(2, 3, dtype=torch.int32))
            ),
            InvalidSlotError,
            "1-D integer tensor",
        ),
        Case(
            f"{kind}-set_info-slots-list",
            kind,
            lambda c: c.pool.set_req_pool_info(2, ReqToTokenPoolInfo(1, 2, [1, 2])),  # type: ignore[arg-type]
            InvalidSlotError,
            "list",
        ),
        Case(
            f"{kind}-set_info-slots-float",
            kind,
            lambda c: c.pool.set_req_pool_info(2, ReqToTokenPoolInfo(1, 2, torch.ones(2))),
            InvalidSlotError,
            "torch.float32",
        ),
        Case(
            f"{kind}-set_info-slots-meta",
            kind,
            lambda c: c.pool.set_req_pool_info(
                2, ReqToTokenPoolInfo(1, 2, torch.ones(2, dtype=torch.int32, device="meta"))
            ),
            InvalidSlotError,
            "meta",
        ),
        Case(
            f"{kind}-set_info-len-str",
            kind,
            lambda c: c.pool.set_req_pool_info(2, ReqToTokenPoolInfo(1, "2", torch.ones(2))),  # type: ignore[arg-type]
            InvalidSlotError,
            "alloced_len",
        ),
        Case(
            f"{kind}-set_info-len-bool",
            kind,
            lambda c: c.pool.set_req_pool_info(
                2, ReqToTokenPoolInfo(True, 1, torch.ones(1, dtype=torch.int32))
            ),
            InvalidSlotError,
            "verified_len",
        ),
        Case(
            f"{kind}-set_info-not-info",
            kind,
            lambda c: c.pool.set_req_pool_info(2, (1, 2, torch.ones(2))),  # type: ignore[arg-type]
            InvalidSlotError,
            "tuple",
        ),
        Case(
            f"{kind}-set_info-slot-negative",
            kind,
            lambda c: c.pool.set_req_pool_info(2, ReqToTokenPoolInfo(1, 2, torch.tensor([3, -5]))),
            InvalidSlotError,
            "-5",
        ),
        Case(
            f"{kind}-set_info-slot-past-int32",
            kind,
            lambda c: c.pool.set_req_pool_info(
                2, ReqToTokenPoolInfo(1, 2, torch.tensor([2**40, 3]))
            ),
            InvalidSlotError,
            str(2**40),
        ),
        Case(
            f"{kind}-set_info-never-allocated",
            kind,
            lambda c: c.pool.set_req_pool_info(NEVER, info(1, 2)),
            InvalidSlotError,
            str(NEVER),
        ),
        Case(
            f"{kind}-set_info-row-0",
            kind,
            lambda c: c.pool.set_req_pool_info(0, info(1, 2)),
            InvalidSlotError,
            "0",
        ),
        Case(
            f"{kind}-set_info-out-of-range",
            kind,
            lambda c: c.pool.set_req_pool_info(SIZE, info(1, 2)),
            InvalidSlotError,
            str(SIZE),
        ),
    ]


CASES: list[Case] = [
    *_sizes("sync"),
    *_sizes("async"),
    *_rows("sync"),
    *_rows("async"),
    # after close(): allocation refuses (free stays allowed, tested elsewhere)
    Case("closed-alloc", "closed", lambda c: c.pool.alloc(1), PoolClosedError, "closed"),
    Case("closed-alloc-needs-wait", "closed", lambda c: c.pool.alloc(8), PoolClosedError, "closed"),
    Case("closed-try_alloc", "closed", lambda c: c.pool.try_alloc(1), PoolClosedError, "closed"),
    Case("closed-lease", "closed", lambda c: _lease(c.pool, 1), PoolClosedError, "closed"),
    Case("closed-bad-size-first", "closed", lambda c: c.pool.alloc(0), CapacityError, "0"),
    # from another thread than the pool's
    Case("thread-alloc", "thread", lambda c: c.pool.alloc(1), WrongThreadError, None),
    Case("thread-try_alloc", "thread", lambda c: c.pool.try_alloc(1), WrongThreadError, None),
    Case("thread-free", "thread", lambda c: c.pool.free([1]), WrongThreadError, None),
    Case(
        "thread-record_use",
        "thread",
        lambda c: c.pool.record_use([1], c.fence),
        WrongThreadError,
        None,
    ),
    Case("thread-reclaim", "thread", lambda c: c.pool.reclaim(), WrongThreadError, None),
    Case("thread-close", "thread", lambda c: c.pool.close(), WrongThreadError, None),
]


def snapshot(pool: Any) -> tuple[Any, ...]:
    led = pool._ledger
    return (
        pool.stats(),
        [led.state_of(r) for r in range(1, SIZE)],
        [led.generation(r) for r in range(1, SIZE)],
        list(led._free),
        pool.verified_lens.clone(),
        pool.alloced_lens.clone(),
        pool.alloced_lens_cpu.clone(),
        pool.req_to_token.clone(),
    )


def assert_same(before: tuple[Any, ...], after: tuple[Any, ...]) -> None:
    names = ("stats", "states", "generations", "free queue")
    for name, a, b in zip(names, before[:4], after[:4], strict=True):
        assert a == b, f"{name} changed:\n  before {a}\n  after  {b}"
    for a, b in zip(before[4:], after[4:], strict=True):
        assert torch.equal(a, b), "a table changed"


#: Calls refused for asking more rows than the pool has: nothing changes but
#: the count of calls that can never be served (stats().unfittable, and at
#: their priority, 0), which counts exactly them.
UNFITTABLE = frozenset({"async-alloc-over-capacity", "async-alloc-huge", "async-lease-over"})


def _counted_unfittable(stats: PoolStats) -> PoolStats:
    """``stats`` with one more unfittable call, at priority 0."""
    assert not stats.by_priority  # these pools never queued
    return dataclasses.replace(
        stats,
        unfittable=stats.unfittable + 1,
        by_priority=FrozenDict({0: PriorityStats(unfittable=1)}),
    )


def _run_in_thread(fn: Callable[[], Any]) -> tuple[int, BaseException | None]:
    box: dict[str, Any] = {}

    def run() -> None:
        box["ident"] = threading.get_ident()
        try:
            res = fn()
            if inspect.iscoroutine(res):
                asyncio.run(res)
        except BaseException as exc:
            box["exc"] = exc

    t = threading.Thread(target=run, name="bad-input-intruder")
    t.start()
    t.join(10)
    assert not t.is_alive()
    return box["ident"], box.get("exc")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_bad_call(case: Case) -> None:
    stream = _HostStream("bad-input")
    gate = threading.Event()
    pool: Any
    if case.kind == "sync":
        pool = ReqToTokenPool(SIZE, MAX_CONTEXT)
        rows = pool.alloc(5)
    else:
        if case.kind == "thread":
            # Every call from a foreign thread is refused in asyncio's debug
            # mode; outside it the unchecked fast paths complete instead
            # (tests/test_thread_fast_paths.py).
            asyncio.get_running_loop().set_debug(True)
        pool = AsyncReqToTokenPool(SIZE, MAX_CONTEXT)
        rows = await pool.alloc(5)
    try:
        assert rows == [1, 2, 3, 4, 5]
        stream.launch(gate.wait)
        fence = stream.record()
        pool.free([PENDING_ROW], fence=fence)
        pool.free([FREED_ROW])
        pool.set_req_pool_info(1, info(3, 6))
        pool.verified_lens[2] = 11
        if case.kind == "closed":
            await pool.close()
        ctx = Ctx(pool, fence, stream)
        pool.check_invariants()
        before = snapshot(pool)

        if case.kind == "thread":
            ident, exc = _run_in_thread(lambda: case.call(ctx))
            assert exc is not None, "the call from another thread did not raise"
            culprit = str(ident)
        else:
            culprit = case.culprit or ""
            try:
                res = case.call(ctx)
                if inspect.isawaitable(res):
                    async with asyncio.timeout(5):
                        await res
            except BaseException as e:
                exc = e
            else:
                exc = None
            assert exc is not None, f"{case.id}: no error raised"

        assert type(exc) is case.exc, f"{case.id}: got {type(exc).__name__}: {exc}"
        msg = str(exc)
        assert re.search(rf"(?<![\w.]){re.escape(culprit)}(?![\w])", msg), (
            f"{case.id}: the message does not name {culprit!r}: {msg!r}"
        )
        pool.check_invariants()
        if case.id in UNFITTABLE:
            before = (_counted_unfittable(before[0]), *before[1:])
        assert_same(before, snapshot(pool))
        # and the pool still serves
        if case.kind != "closed":
            got = pool.try_alloc(1) if case.kind != "sync" else pool.alloc(1)
            assert got is not None
    finally:
        gate.set()
        if case.kind != "sync":
            await pool.close()
        stream.close()


def test_error_families() -> None:
    """What a caller reaching for the builtin exception would catch."""
    assert issubclass(CapacityError, ValueError) and issubclass(CapacityError, PoolError)
    assert issubclass(InvalidSlotError, ValueError) and issubclass(InvalidSlotError, PoolError)
    assert issubclass(DoubleFreeError, InvalidSlotError)
    assert issubclass(PoolClosedError, RuntimeError) and issubclass(PoolClosedError, PoolError)
    assert issubclass(WrongThreadError, RuntimeError) and issubclass(WrongThreadError, PoolError)


def test_table_is_large_enough() -> None:
    assert len(CASES) >= 15
    kinds = {c.kind for c in CASES}
    assert kinds == {"sync", "async", "closed", "thread"}


@pytest.mark.parametrize(
    ("num_pages", "says"),
    [(9.0, "got 9.0 of type float"), ("9", "got '9' of type str"), (1, "got 1")],
)
def test_a_page_pool_of_a_bad_page_count_names_the_rule_and_the_type(
    num_pages: Any, says: str
) -> None:
    """``KVPagePool(9.0, 4)`` said "needs num_pages >= 2, got 9.0", which 9.0
    is: the message states the rule (an int >= 2) and, for a non-int, the type."""
    with pytest.raises(CapacityError, match=r"num_pages must be an int >= 2") as info:
        KVPagePool(num_pages, 4)
    assert str(info.value).endswith(says)


async def test_detaching_the_pages_of_a_row_not_allocated_says_detach() -> None:
    """``detach_pages`` of a free row names what was refused (it borrowed
    ``pages_of``'s "cannot be asked for its pages"), and changes nothing."""
    pool = AsyncReqToTokenPool(5, 64, kv=KVPagePool(17, 4))
    never = r"row 3 was never allocated and cannot be detached from its pages"
    with pytest.raises(InvalidSlotError, match=never):
        pool.detach_pages(3)
    grant = pool.try_admit(pages=2)
    assert grant is not None
    pool.free(grant.row)
    freed = rf"row {grant.row} is already free .*detached from its pages"
    with pytest.raises(InvalidSlotError, match=freed):
        pool.detach_pages(grant.row)
    assert pool.kv is not None and pool.kv.available_size() == 16
    pool.check_invariants()


def test_a_page_free_after_no_stream_says_after_and_changes_nothing() -> None:
    """``kv.free(pages, after=x)`` with no fence recordable on ``x`` raises
    the pool's ``after=`` message before anything changes (it named
    ``record_fence()``, a function the caller never called); the same
    tensor then frees normally."""
    kv = KVPagePool(9, 2)
    pages = kv.alloc(3)
    before = kv.stats()
    with pytest.raises(TypeError, match=r"^after= must be a HostStream or a CUDA stream"):
        kv.free(pages, after=object())
    assert kv.stats() == before
    kv.check_invariants()
    assert kv.free(pages) == 3
    kv.check_invariants()
