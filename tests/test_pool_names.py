"""``name=`` on the three pools: checked, shown in ``repr()``, on every line.

An engine runs several pools in one process (a row pool and its page pool;
a hybrid-attention model's two page pools, sliding-window and full; prefill
and decode). Without names, a warning about a faulted or overdue fence
could not say which pool it was about. Here two pools of a kind, named
differently, meet each log site that a CPU reaches, and each line must
start with its own pool's name (``pool 'alpha': ...``) and be recorded
against the function that logged it; a pool without a name logs exactly
what it logged before; a bad name is refused before anything is built; the
hot paths never read the name; and ``PoolCollector`` labels a named pool
with its name when given none.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvloop
from helpers import WAIT_S, EventFence, FakeFence, FakeStream, Streams, bounded, spin

import asyncpool.agreement as agreement
from asyncpool import AsyncReqToTokenPool, KVPagePool, ReqToTokenPool
from asyncpool.naming import LOG_FIELD, MAX_NAME_LEN, NamedLog, check_name
from asyncpool.watcher import FenceWatcher

NAMES = ("alpha", "beta")


def prefix(name: str) -> str:
    return f"pool {name!r}: "


class Lines(logging.Handler):
    """Every record of the ``asyncpool`` logger (DEBUG and up) while the
    block runs; :meth:`wait_for` awaits ``count`` lines containing a text
    (records may come from a watcher thread: the event is set on the loop)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._lock = threading.Lock()
        # (text, count, event, its loop, the loop's thread)
        self._waits: list[tuple[str, int, asyncio.Event, asyncio.AbstractEventLoop, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock:
            self.records.append(record)
            waits = list(self._waits)
        for text, count, event, loop, thread in waits:
            if len(self.having(text)) >= count:
                if thread == threading.get_ident():
                    event.set()
                else:
                    loop.call_soon_threadsafe(event.set)

    def having(self, text: str) -> list[logging.LogRecord]:
        with self._lock:
            return [r for r in self.records if text in r.getMessage()]

    def messages(self) -> list[str]:
        with self._lock:
            return [r.getMessage() for r in self.records]

    def clear(self) -> None:
        with self._lock:
            self.records.clear()

    async def wait_for(self, text: str, count: int = 1) -> list[logging.LogRecord]:
        event = asyncio.Event()
        with self._lock:
            self._waits.append(
                (text, count, event, asyncio.get_running_loop(), threading.get_ident())
            )
        if len(self.having(text)) < count:
            async with bounded():
                await event.wait()
        return self.having(text)


@pytest.fixture
def lines() -> Iterator[Lines]:
    handler = Lines()
    log = logging.getLogger("asyncpool")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def assert_named(records: list[logging.LogRecord], name: str, func: str | None = None) -> None:
    """Every record starts with ``name``'s prefix and carries the name as
    its ``asyncpool_pool`` attribute, for handlers that write fields (and,
    given ``func``, was logged by that function: the record names the
    caller, not the log)."""
    assert records, "no line was logged"
    for r in records:
        assert r.getMessage().startswith(prefix(name)), r.getMessage()
        assert getattr(r, LOG_FIELD, None) == name, (r.__dict__.get(LOG_FIELD), r.getMessage())
        if func is not None:
            assert r.funcName == func, (r.funcName, r.getMessage())


def faulted() -> EventFence:
    fence = EventFence()
    fence.error = RuntimeError("illegal memory access (simulated)")
    fence.set()
    return fence


# ------------------------------------------------------------ the name itself

POOLS: dict[str, Callable[..., Any]] = {
    "AsyncReqToTokenPool": lambda **kw: AsyncReqToTokenPool(4, 8, **kw),
    "ReqToTokenPool": lambda **kw: ReqToTokenPool(4, 8, **kw),
    "KVPagePool": lambda **kw: KVPagePool(9, 4, **kw),
}

BAD_NAMES: list[tuple[object, type[Exception], str]] = [
    (1, TypeError, "must be None or a str, got int"),
    (b"decode", TypeError, "got bytes"),
    (["decode"], TypeError, "got list"),
    ("", ValueError, "must not be empty"),
    ("decode\nWARNING asyncpool: forged", ValueError, "printable"),
    ("decode\r", ValueError, "printable"),
    ("de\tcode", ValueError, "printable"),
    ("\x1b[31mred", ValueError, "printable"),  # a terminal escape
    ("a\u2028b", ValueError, "printable"),  # Unicode line separator
    ("\u202eedoced", ValueError, "printable"),  # a bidirectional override
    ("a\x00b", ValueError, "printable"),
    ("x" * (MAX_NAME_LEN + 1), ValueError, f"at most {MAX_NAME_LEN} characters"),
]


@pytest.mark.parametrize("kind", POOLS)
@pytest.mark.parametrize(("bad", "error", "match"), BAD_NAMES)
def test_a_bad_name_is_refused_before_anything_is_built(
    kind: str, bad: object, error: type[Exception], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def built(*args: object, **kwargs: object) -> None:
        raise AssertionError("built before the name was checked")

    monkeypatch.setattr("asyncpool.base.TokenTables", built)
    monkeypatch.setattr("asyncpool.kv_pages.PageLedger", built)
    with pytest.raises(error, match=match):
        POOLS[kind](name=bad)


@pytest.mark.parametrize("reclaim", ["auto", "explicit"])
def test_a_bad_name_leaves_the_kv_pool_unadopted(reclaim: str) -> None:
    kv = KVPagePool(9, 4)
    with pytest.raises(ValueError, match="printable"):
        AsyncReqToTokenPool(4, 8, kv=kv, reclaim=reclaim, name="a\nb")
    assert kv.ledger._on_pending is None and not kv.ledger.explicit
    pool = AsyncReqToTokenPool(4, 8, kv=kv, reclaim=reclaim, name="ok")  # still free to adopt
    assert pool.kv is kv


class Label(str):
    """A str subclass whose own methods must never reach a log line."""

    def __repr__(self) -> str:
        raise AssertionError("the subclass's __repr__ ran")

    def __str__(self) -> str:
        raise AssertionError("the subclass's __str__ ran")


@pytest.mark.parametrize("kind", POOLS)
@pytest.mark.parametrize(
    "good", ["decode", "d", "x" * MAX_NAME_LEN, "décodé 0", "50%s 'x' \"y\" [z]", Label("swa")]
)
def test_a_good_name_is_kept_as_a_plain_str_and_read_only(kind: str, good: str) -> None:
    pool = POOLS[kind](name=good)
    assert pool.name == str.__str__(good) and type(pool.name) is str
    with pytest.raises(AttributeError):
        pool.name = "other"
    assert POOLS[kind]().name is None
    assert check_name(None) is None


@pytest.mark.parametrize("kind", POOLS)
def test_repr_shows_the_name_and_is_unchanged_without_one(kind: str) -> None:
    named, plain = POOLS[kind](name="swa"), POOLS[kind]()
    head = f"<{kind} "
    assert repr(plain).startswith(head) and "'" not in repr(plain)
    assert repr(named) == repr(plain).replace(head, f"{head}'swa' ", 1)
    tricky = POOLS[kind](name="it's")
    assert repr(tricky).startswith(f'<{kind} "it\'s" ')


# ------------------------------------------------------------ faults and quarantine


def test_fault_lines_of_two_sync_pools_name_their_own(lines: Lines) -> None:
    for name in NAMES:
        pool = ReqToTokenPool(8, 8, name=name)
        bad = faulted()
        # The error, then a warning for the first later quarantine, then
        # DEBUG with a running count.
        for _ in range(3):
            pool.free(pool.alloc(1), fence=bad)
    assert all(r.name == "asyncpool.deferral" for r in lines.records)
    for name in NAMES:
        mine = [r for r in lines.records if r.getMessage().startswith(prefix(name))]
        assert [r.levelno for r in mine] == [logging.ERROR, logging.WARNING, logging.DEBUG]
        assert_named(mine, name, "_report_fault")
        assert "quarantined rows [" in mine[0].getMessage()
        assert "(2 since its error)" in mine[2].getMessage()


def test_fault_lines_of_two_page_pools_name_their_own(lines: Lines) -> None:
    pools = {name: KVPagePool(17, 4, name=name) for name in ("swa", "full")}
    for kv in pools.values():
        bad = faulted()
        for _ in range(3):
            kv.free(kv.alloc(2), fence=bad)
    for name in pools:
        mine = [r for r in lines.records if r.getMessage().startswith(prefix(name))]
        assert [r.levelno for r in mine] == [logging.ERROR, logging.WARNING, logging.DEBUG]
        assert_named(mine, name, "_report_fault")
        assert "quarantined pages" in mine[0].getMessage()
    assert len(lines.records) == 6


async def test_fault_lines_of_two_async_pools_and_their_page_pools(lines: Lines) -> None:
    """A row pool's row faults under its name; its ``kv=`` page pool's page
    faults under the page pool's own."""
    pools = [
        AsyncReqToTokenPool(8, 8, kv=KVPagePool(33, 4, name=f"{name}-kv"), name=name)
        for name in NAMES
    ]
    for pool in pools:
        bad = faulted()
        for _ in range(3):
            async with bounded():
                grant = await pool.admit(pages=2)
            pool.free([grant.row], fence=bad)
    for name in NAMES:
        rows = [r for r in lines.records if r.getMessage().startswith(prefix(name))]
        pages = [r for r in lines.records if r.getMessage().startswith(prefix(f"{name}-kv"))]
        assert [r.levelno for r in rows] == [logging.ERROR, logging.WARNING, logging.DEBUG]
        assert [r.levelno for r in pages] == [logging.ERROR, logging.WARNING, logging.DEBUG]
        assert all("rows" in r.getMessage() for r in rows)
        assert all("pages" in r.getMessage() for r in pages)
        assert_named(rows, name, "_report_fault")
        assert_named(pages, f"{name}-kv", "_report_fault")
    assert len(lines.records) == 12
    for pool in pools:
        await pool.close()


async def test_an_unnamed_kv_page_pool_logs_its_faults_under_its_named_pool(lines: Lines) -> None:
    """A server with several models, each a named pool with an unnamed
    ``kv=``: a page fault says which model's pages it quarantined (it was
    an unnamed line, the same for every model), as an unnamed group's does
    ('decode/swa'); the page pool itself stays unnamed, and an unnamed
    pool's unnamed ``kv=`` logs as before."""
    kvs = [KVPagePool(33, 4) for _ in NAMES]
    pools = [
        AsyncReqToTokenPool(8, 8, kv=kv, name=name) for kv, name in zip(kvs, NAMES, strict=True)
    ]
    plain = AsyncReqToTokenPool(8, 8, kv=KVPagePool(33, 4))
    for pool in [*pools, plain]:
        async with bounded():
            grant = await pool.admit(pages=2)
        pool.free([grant.row], fence=faulted())
    for name in NAMES:
        mine = [r for r in lines.records if r.getMessage().startswith(prefix(name))]
        assert_named(mine, name, "_report_fault")
        assert sum("quarantined rows" in r.getMessage() for r in mine) == 1
        assert sum("quarantined pages" in r.getMessage() for r in mine) == 1
    unnamed = [r for r in lines.records if not r.getMessage().startswith("pool ")]
    assert len(unnamed) == 2  # the unnamed pool's row and page lines, as before
    assert all(not hasattr(r, LOG_FIELD) for r in unnamed)
    assert len(lines.records) == 6
    assert [kv.name for kv in kvs] == [None, None]
    assert repr(kvs[0]).startswith("<KVPagePool num_pages=")
    for pool in [*pools, plain]:
        await pool.close()


async def test_a_fault_the_watcher_sees_is_logged_under_the_pool(
    lines: Lines, kit: Streams
) -> None:
    """A fence of unknown origin that faults in the watcher's poller: the
    poller's DEBUG line (its thread) and the ledger's error, both named."""
    pools = [AsyncReqToTokenPool(4, 8, name=name) for name in NAMES]
    fences = []
    for pool in pools:
        async with bounded():
            rows = await pool.alloc(1)
        fence = kit.event_fence()
        pool.free(rows, fence=fence)  # pending: watched by the poller
        fences.append(fence)
    for fence in fences:
        fence.error = RuntimeError("transfer failed")
        fence.set()
    await lines.wait_for("faulted; quarantined", 2)
    for pool, fence in zip(pools, fences, strict=True):
        name = pool.name
        assert name is not None
        mine = [r for r in lines.records if repr(fence) in r.getMessage()]
        watcher = [r for r in mine if r.name == "asyncpool.watcher"]
        error = [r for r in mine if r.name == "asyncpool.deferral"]
        assert len(error) == 1 and watcher
        assert_named(watcher, name, "_poll")
        assert_named(error, name, "_report_fault")
        await pool.close()


async def test_a_watcher_notify_that_raises_is_logged_under_its_pool(lines: Lines) -> None:
    seen = threading.Event()

    def notify() -> None:
        seen.set()
        raise RuntimeError("notify broke")

    watcher = FenceWatcher(notify, pool_name="alpha")
    fence = EventFence()
    fence.set()
    try:
        watcher.watch(fence)
        async with bounded():
            await asyncio.to_thread(seen.wait, WAIT_S)
        records = await lines.wait_for("notify failed")
    finally:
        watcher.stop()
        watcher.join(WAIT_S)
    assert_named(records, "alpha", "_fire")
    assert records[0].exc_info is not None


# ------------------------------------------------------------ overdue fences


async def test_overdue_lines_of_two_pools_name_their_own(lines: Lines, kit: Streams) -> None:
    """The pool's overdue check (a tiny ``fence_timeout``) logs each stuck
    fence under the pool that holds it; a page pool's pages are held by its
    row pool, whose check logs them."""
    pools = [
        AsyncReqToTokenPool(4, 8, kv=KVPagePool(9, 4, name="pages"), fence_timeout=0.01, name=n)
        for n in NAMES
    ]
    fences = []
    for pool in pools:
        async with bounded():
            grant = await pool.admit(pages=2)
        fence = kit.event_fence()
        pool.free([grant.row], fence=fence)
        fences.append(fence)
    overdue = await lines.wait_for("is overdue", 2)
    for pool, fence in zip(pools, fences, strict=True):
        assert pool.name is not None
        mine = [r for r in overdue if repr(fence) in r.getMessage()]
        assert len(mine) == 1 and "holding 1 row and 2 pages" in mine[0].getMessage()
        assert_named(mine, pool.name, "check")
        fence.set()
        async with bounded():
            await pool.drain()
        await pool.close()
    assert not any(m.startswith(prefix("pages")) for m in lines.messages())


def _overdue_on_another_rank(real: Callable[..., Any]) -> Callable[..., Any]:
    """The all-reduce with every batch marked overdue, as if another rank's
    ``fence_timeout`` had passed (as tests/test_explicit.py does)."""
    nh = len(agreement._HEADER) * agreement.SLOTS

    def reduce(values: list[int], g: Any, dev: Any, **kw: Any) -> Any:
        out = real(values, g, dev, **kw)
        for i in range(2 * nh + 1, len(out) - 1, 3):  # [done, -overdue, -faulted] each
            out[i] = -1
        return out

    return reduce


def test_agreed_overdue_lines_name_their_pool(group: Any, lines: Lines) -> None:
    """``agree()`` logs what the ranks agreed is overdue under the pool
    that called it: the async pool by its own ``fence_timeout``, the sync
    pool and a bare page pool by another rank's."""
    fences: dict[str, EventFence] = {}
    for name in NAMES:
        pool = AsyncReqToTokenPool(4, 8, fence_timeout=1e-9, reclaim="explicit", name=name)
        rows = pool.try_alloc(1)
        assert rows is not None
        fences[name] = fence = EventFence()
        pool.free(rows, fence=fence)
        assert pool.agree(group) == (0, 0)
        fence.set()
        assert pool.agree(group) == (1, 0)
    for name, fence in fences.items():
        mine = [r for r in lines.records if repr(fence) in r.getMessage()]
        assert len(mine) == 1 and "not done on at least one rank" in mine[0].getMessage()
        assert_named(mine, name, "agree")


def test_agreed_overdue_lines_of_a_sync_and_a_page_pool(
    group: Any, lines: Lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        agreement, "_all_reduce_min", _overdue_on_another_rank(agreement._all_reduce_min)
    )
    sync = ReqToTokenPool(4, 8, reclaim="explicit", name="rows")
    kv = KVPagePool(9, 4, reclaim="explicit", name="pages")
    rows, pages = sync.alloc(1), kv.alloc(2)
    assert rows is not None and pages is not None
    row_fence, page_fence = EventFence(), EventFence()
    sync.free(rows, fence=row_fence)
    kv.free(pages, fence=page_fence)
    assert sync.agree(group) == 0 and kv.agree(group) == 0
    assert_named([r for r in lines.records if repr(row_fence) in r.getMessage()], "rows", "agree")
    assert_named([r for r in lines.records if repr(page_fence) in r.getMessage()], "pages", "agree")


async def test_each_pools_watcher_threads_carry_its_name() -> None:
    """Every pool runs its own poller for fences of unknown origin: in a
    process with several, a thread dump named them all alike. A named
    pool's threads now carry its name; an unnamed pool's keep the old one."""
    pools = [AsyncReqToTokenPool(4, 8, name=name) for name in NAMES]
    plain = AsyncReqToTokenPool(4, 8)
    transfer = EventFence()  # one handle that every pool waits on
    before = set(threading.enumerate())
    for pool in [*pools, plain]:
        async with bounded():
            rows = await pool.alloc(1)
        pool.free(rows, fence=transfer)
    started = sorted(t.name for t in set(threading.enumerate()) - before)
    assert started == sorted(
        [*(f"asyncpool-fence-watcher {name!r}" for name in NAMES), "asyncpool-fence-watcher"]
    )
    transfer.set()
    for pool in [*pools, plain]:
        async with bounded():
            await pool.drain()
        await pool.close()


# ------------------------------------------------------------ force_release


async def test_force_release_lines_of_two_async_pools(lines: Lines, kit: Streams) -> None:
    """Each of the four outcomes: memory returned, still held by another
    fence, only recorded uses dropped, nothing at all."""
    for name in NAMES:
        pool = AsyncReqToTokenPool(8, 8, kv=KVPagePool(9, 4), name=name)
        stream = FakeStream()
        stuck, used, unknown = stream.record(), stream.record(), stream.record()
        transfer = kit.event_fence()
        async with bounded():
            a = await pool.admit(pages=1)
            b = await pool.admit(pages=1)
            c = await pool.alloc(1)
        pool.free([a.row], fence=stuck)
        pool.free([b.row], fence=[stuck, transfer])
        pool.record_use(c, used)
        lines.clear()
        assert pool.force_release(stuck) == (1, 1)  # a's; b's still wait for the transfer
        assert pool.force_release(used) == (0, 0)  # c's recorded use dropped
        assert pool.force_release(unknown) == (0, 0)
        messages = lines.messages()
        assert len(messages) == 3
        assert "1 row and 1 page returned" in messages[0]
        assert "dropped it from the recorded uses of 1 allocated row" in messages[1]
        assert "holds no row and no page of this pool (never given" in messages[2]
        assert_named(lines.records, name, "force_release")
        lines.clear()
        # Held by another fence too: released from this one only.
        assert pool.force_release(transfer) == (1, 1)
        lines.clear()
        async with bounded():
            d = await pool.admit(pages=1)
        step = stream.record()
        pool.free([d.row], fence=[step, kit.event_fence()])
        assert pool.force_release(step) == (0, 0)
        assert "still wait for other fences" in lines.messages()[0]
        assert_named(lines.records, name, "force_release")
        await pool.close()
        lines.clear()


def test_force_release_lines_of_two_sync_pools(lines: Lines) -> None:
    for name in NAMES:
        pool = ReqToTokenPool(8, 8, name=name)
        stream = FakeStream()
        stuck, unknown, used = stream.record(), stream.record(), stream.record()
        rows = pool.alloc(2)
        assert rows is not None
        pool.free(rows[:1], fence=stuck)
        pool.free(rows[1:], fence=[stuck, EventFence()])
        held = pool.alloc(1)
        assert held is not None
        pool.record_use(held, used)
        lines.clear()
        assert pool.force_release(stuck) == 1
        assert pool.force_release(stuck) == 0  # the other batch: still behind the EventFence
        assert pool.force_release(unknown) == 0
        assert pool.force_release(used) == 0
        messages = lines.messages()
        assert "1 row returned to circulation" in messages[0]
        assert "no row was pending behind this fence" in messages[1]
        assert "no row was pending behind this fence" in messages[2]
        assert messages[3].endswith("; 1 allocated row forgets its use of it")
        assert_named(lines.records, name, "log_force_release")


def test_force_release_lines_of_two_bare_page_pools(lines: Lines) -> None:
    for name in ("swa", "full"):
        kv = KVPagePool(9, 4, name=name)
        stuck, other = FakeStream().record(), EventFence()
        pages = kv.alloc(3)
        more = kv.alloc(1)
        assert pages is not None and more is not None
        kv.free(pages, fence=stuck)
        kv.free(more, fence=[stuck, other])
        lines.clear()
        assert kv.force_release(stuck) == 3
        assert kv.force_release(EventFence()) == 0
        messages = lines.messages()
        assert "3 pages returned to circulation" in messages[0]
        assert "no page was pending" in messages[1]
        assert_named(lines.records, name, "log_force_release")


# ------------------------------------------------------------ leases and the lifecycle


async def _lease_that_frees_a_row_then_waits(pool: AsyncReqToTokenPool) -> None:
    async with pool.lease(2) as rows:
        pool.free([rows[0]])
        await asyncio.Event().wait()  # cancelled here


async def test_lease_exit_lines_of_two_pools(lines: Lines) -> None:
    for name in NAMES:
        pool = AsyncReqToTokenPool(4, 8, name=name)
        task = asyncio.ensure_future(_lease_that_frees_a_row_then_waits(pool))
        await spin()
        task.cancel()
        async with bounded():
            with pytest.raises(asyncio.CancelledError):
                await task
        mine = lines.having("lease exit while CancelledError")
        assert len(mine) == 1
        assert_named(mine, name, "__aexit__")
        lines.clear()


async def test_close_release_and_resume_lines_of_two_pools(lines: Lines) -> None:
    for name in NAMES:
        pool = AsyncReqToTokenPool(4, 8, name=name)
        async with bounded():
            await pool.release_memory()
            await pool.resume_memory()
            await pool.close()
        messages = lines.messages()
        assert messages[0].startswith(f"{prefix(name)}released the kv_cache region of ")
        assert messages[1].startswith(f"{prefix(name)}resumed the kv_cache region of ")
        assert messages[2].startswith(f"{prefix(name)}closed ")
        assert [r.funcName for r in lines.records] == ["release_memory", "resume_memory", "close"]
        assert [r.levelno for r in lines.records] == [logging.INFO, logging.INFO, logging.DEBUG]
        assert_named(lines.records, name)
        lines.clear()


async def test_grant_hold_lines_of_two_pools(lines: Lines) -> None:
    """A hold kept past ``warn_after`` warns, and one collected while held
    logs an error: both under the pool it holds."""
    for name in NAMES:
        async with bounded(), AsyncReqToTokenPool(3, 8, name=name) as pool:
            hold = pool.hold_grants(warn_after=0.001)
            warned = await lines.wait_for("hold_grants() hold")
            assert_named(warned, name, "_warn_if_held")
            hold.release()
            pool.hold_grants(warn_after=None)  # dropped at once, held
            gc.collect()
            collected = lines.having("collected while held")
            assert len(collected) == 1 and collected[0].levelno == logging.ERROR
            assert_named(collected, name, "__del__")
        lines.clear()


async def test_a_failed_batched_reset_is_logged_under_its_pool(
    lines: Lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in NAMES:
        async with AsyncReqToTokenPool(3, 8, name=name) as pool:
            async with bounded():
                rows = await pool.alloc(2)
            waiter = asyncio.ensure_future(pool.alloc(1))
            await spin()

            def fail(rows: list[int]) -> None:
                raise RuntimeError("reset failed")

            monkeypatch.setattr(pool._tables, "reset_rows", fail)
            pool.free(rows[:1])  # granted to the waiter, its reset queued
            async with bounded():
                got = await waiter
            mine = lines.having("zeroing them one by one")
            assert len(mine) == 1 and mine[0].exc_info is not None
            assert_named(mine, name, "_flush_resets")
            pool.free(got + rows[1:])
        lines.clear()


@pytest.mark.parametrize(
    "factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_waiters_dropped_with_their_loop_are_logged_under_the_pool(
    factory: Callable[[], asyncio.AbstractEventLoop], lines: Lines
) -> None:
    for name in NAMES:
        pool = AsyncReqToTokenPool(3, 8, name=name)
        abandoned: list[asyncio.Future[Any]] = []

        async def setup(
            pool: AsyncReqToTokenPool = pool, abandoned: list[asyncio.Future[Any]] = abandoned
        ) -> None:
            await pool.alloc(2)
            abandoned.append(asyncio.ensure_future(pool.alloc(1)))  # queued
            await asyncio.sleep(0)

        loop = factory()
        loop.run_until_complete(setup())
        loop.close()  # the waiter's task is abandoned, still queued
        assert pool.waiting() == 1

        async def next_loop(pool: AsyncReqToTokenPool = pool) -> None:
            assert pool.try_alloc(1) is None  # both rows held; the dead waiter dropped
            assert pool.waiting() == 0

        loop = factory()
        loop.run_until_complete(next_loop())
        loop.close()
        mine = lines.having("was closed with 1 waiter queued")
        assert len(mine) == 1
        assert_named(mine, name, "_drop_stale_waiters")
        abandoned.clear()
        gc.collect()  # the abandoned task goes now, not in a later test
        lines.clear()


# ------------------------------------------------------------ no name: as before


async def test_without_a_name_the_lines_are_as_before(lines: Lines, kit: Streams) -> None:
    """Records of unnamed pools carry no name and no extra argument: the
    same format strings and arguments as before names existed."""
    sync = ReqToTokenPool(8, 8)
    stuck = FakeStream().record()
    sync.force_release(stuck)
    kv = KVPagePool(9, 4)
    pages = kv.alloc(2)
    assert pages is not None
    bad = faulted()
    kv.free(pages, fence=bad)
    pool = AsyncReqToTokenPool(4, 8, fence_timeout=0.01)
    async with bounded():
        rows = await pool.alloc(1)
    fence = kit.event_fence()
    pool.free(rows, fence=fence)
    await lines.wait_for("is overdue")
    pool.force_release(fence)
    await pool.close()
    messages = lines.messages()
    assert messages == [
        f"force_release({stuck!r}): no row was pending behind this fence (never given to "
        "this pool, already completed and reclaimed, or released before)",
        f"fence {bad!r} faulted; quarantined pages [{', '.join(map(str, pages.tolist()))}]: "
        "illegal memory access (simulated)",
        f"fence {fence!r} is overdue: pending for more than 0.01 s (fence_timeout), holding "
        "1 row; the memory stays held (its work may still write or read it); call "
        "force_release(fence) only if that work is known to be dead",
        f"force_release({fence!r}): 1 row and 0 pages returned to circulation without the "
        "fence completing",
        f"closed {pool!r}",
    ]
    assert [r.args[0] for r in lines.records[:2]] == [stuck, bad]  # no name argument first
    assert not any(r.msg.startswith("pool %r: ") for r in lines.records)
    assert not any(hasattr(r, LOG_FIELD) for r in lines.records)  # no name field either


def test_the_name_field_is_what_a_json_handler_reads(lines: Lines) -> None:
    """The field is named so that it clashes with no ``LogRecord``
    attribute, a JSON formatter writes it as it is, and a caller's own
    ``extra`` keeps its fields beside it."""
    assert LOG_FIELD == "asyncpool_pool"
    assert LOG_FIELD not in logging.makeLogRecord({}).__dict__
    kv = KVPagePool(9, 4, name="swa")
    kv.force_release(EventFence())
    [record] = lines.records
    assert_named([record], "swa", "log_force_release")

    class Json(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return json.dumps(
                {"msg": record.getMessage(), "pool": getattr(record, LOG_FIELD, None)}
            )

    assert json.loads(Json().format(record))["pool"] == "swa"
    lines.clear()
    log = NamedLog(logging.getLogger("asyncpool.deferral"), "full")
    log.warning("with %s", "extra", extra={"request_id": 7})
    [record] = lines.records
    assert_named([record], "full")
    assert record.__dict__["request_id"] == 7


# ------------------------------------------------------------ cost


def test_a_line_whose_level_is_off_formats_nothing(
    lines: Lines, quiet_asyncpool_logs: None
) -> None:
    """Lazy %-formatting kept: with the level off, no argument of a named
    pool's line is formatted (nor any message string built)."""
    formatted: list[int] = []

    class Loud(FakeFence):
        def __repr__(self) -> str:
            formatted.append(1)
            return "<Loud>"

    stream = FakeStream()
    fence = Loud(stream, 1)
    pool = ReqToTokenPool(8, 8, name="quiet")
    rows = pool.alloc(2)
    assert rows is not None
    pool.free(rows, fence=fence)
    assert pool.force_release(fence) == 2
    assert pool.force_release(fence) == 0
    kv = KVPagePool(9, 4, name="quiet")
    kv.force_release(fence)
    assert formatted == [] and lines.records == []
    log = NamedLog(logging.getLogger("asyncpool.deferral"), "quiet")
    log.debug("%r", fence)
    log.exception("%r", fence)
    assert formatted == [] and lines.records == []


class Unreadable:
    """Stands in for a name or a log: any attribute read fails the test."""

    def __getattr__(self, attr: str) -> Any:
        raise AssertionError(f"a hot path read the name ({attr})")

    def __repr__(self) -> str:
        raise AssertionError("a hot path read the name (repr)")


async def test_the_hot_paths_never_read_the_name() -> None:
    """``alloc``/``free``/``admit``/``kv.alloc``/``kv.free`` run with the
    name and the named logs made unreadable: none of them reads either."""
    pool = AsyncReqToTokenPool(8, 8, name="decode")
    paged = AsyncReqToTokenPool(8, 8, kv=KVPagePool(33, 4, name="swa"), name="paged")
    kv = KVPagePool(33, 4, name="bare")
    for owner in (pool, paged, kv):
        owner._name = Unreadable()  # type: ignore[assignment]
    for led in (pool._ledger, paged._ledger, paged.kv.ledger, kv.ledger):  # type: ignore[union-attr]
        led.log = Unreadable()  # type: ignore[assignment]
    async with bounded():
        for _ in range(3):
            pool.free(await pool.alloc(1))
            pool.free(await pool.alloc(2))
            grant = await paged.admit(pages=3)
            paged.free([grant.row])
            rows = await paged.alloc(1)
            paged.free(rows)
            pages = kv.alloc(16)
            assert pages is not None
            kv.free(pages)
            one = kv.alloc(1)
            assert one is not None
            kv.free(one)
    for owner in (pool, paged, kv):
        owner._name = "back"  # type: ignore[assignment]
    for led in (pool._ledger, paged._ledger, paged.kv.ledger, kv.ledger):  # type: ignore[union-attr]
        led.set_log_name("back")
    pool.check_invariants()
    paged.check_invariants()


# ------------------------------------------------------------ metrics


def test_the_collector_labels_a_named_pool_with_its_name(lines: Lines) -> None:
    pytest.importorskip("prometheus_client")
    from asyncpool.metrics import PoolCollector

    decode = AsyncReqToTokenPool(4, 8, name="decode")
    prefill = ReqToTokenPool(4, 8, name="prefill")
    plain = ReqToTokenPool(4, 8)
    collector = PoolCollector(decode)
    collector.add(prefill)
    collector.add(plain)  # no name: "default", as before
    assert collector.names == ("decode", "prefill", "default")
    with pytest.raises(ValueError, match="named 'default'; name this pool"):
        collector.add(ReqToTokenPool(4, 8))
    other = PoolCollector(decode, name="d")  # a name given wins
    other.add(prefill, "p")
    assert other.names == ("d", "p")
    assert PoolCollector(plain).names == ("default",)
    assert PoolCollector(plain, name="default").names == ("default",)  # the old signature

    def broken(*, summaries: bool = True) -> Any:
        raise RuntimeError("stats broke")

    prefill.stats = broken  # type: ignore[method-assign]
    families = list(collector.collect())
    assert families
    [warning] = lines.having("left out of this scrape")
    assert warning.getMessage().startswith("pool 'prefill' left out of this scrape")


def test_the_left_out_warning_carries_the_pools_own_name(lines: Lines) -> None:
    """The collector's "left out of this scrape" warning carries the pool's
    own name as the ``asyncpool_pool`` attribute, as every line a named pool
    logs (under a label of its own too: the field is the pool's name, the
    message the label); a pool without a name's carries none. It carried
    none for any pool."""
    pytest.importorskip("prometheus_client")
    from asyncpool.metrics import PoolCollector

    def broken(*, summaries: bool = True) -> Any:
        raise RuntimeError("stats broke")

    def wrong(*, summaries: bool = True) -> Any:
        return "not stats"

    decode = AsyncReqToTokenPool(4, 8, name="decode")
    prefill = ReqToTokenPool(4, 8, name="prefill")
    plain = ReqToTokenPool(4, 8)
    decode.stats = broken  # type: ignore[method-assign]
    prefill.stats = wrong  # type: ignore[method-assign]
    plain.stats = broken  # type: ignore[method-assign]
    collector = PoolCollector(decode)
    collector.add(prefill, name="p")  # labelled otherwise
    collector.add(plain)

    class TornDown:
        """A stand-in whose name cannot be read either: still logged."""

        @property
        def name(self) -> str:
            raise RuntimeError("torn down")

        stats = staticmethod(broken)

    collector.add(TornDown(), name="torn")
    list(collector.collect())
    out = {r.args[0]: r for r in lines.having("left out of this scrape")}  # by label
    assert set(out) == {"decode", "p", "default", "torn"}
    assert not hasattr(out["torn"], LOG_FIELD)
    assert getattr(out["decode"], LOG_FIELD) == "decode"
    assert getattr(out["p"], LOG_FIELD) == "prefill"
    assert out["p"].getMessage().startswith("pool 'p' left out of this scrape: stats() gave str")
    assert not hasattr(out["default"], LOG_FIELD)
    assert all(r.levelno == logging.WARNING for r in out.values())


@pytest.mark.parametrize("pool_name", [None, "decode"])
async def test_fault_lines_of_unnamed_kv_groups_name_their_group(
    lines: Lines, pool_name: str | None
) -> None:
    """A fault behind a row's pages in two unnamed KV groups logs a line per
    group, each under the group's name (after the pool's, if it has one),
    so an operator can tell the groups apart; a group whose page pool has
    a name of its own keeps it."""
    pool = AsyncReqToTokenPool(
        4,
        8,
        kv={"swa": KVPagePool(9, 4), "full": KVPagePool(9, 4), "mamba": KVPagePool(5, 1, name="m")},
        name=pool_name,
    )
    async with bounded():
        grant = await pool.admit({"swa": 1, "full": 2, "mamba": 1})
    pool.free([grant.row], fence=faulted())
    labels = {
        "swa": "swa" if pool_name is None else "decode/swa",
        "full": "full" if pool_name is None else "decode/full",
        "mamba": "m",
    }
    for label in labels.values():
        group_lines = [r for r in lines.records if r.getMessage().startswith(prefix(label))]
        assert [r.levelno for r in group_lines] == [logging.ERROR]
        assert "pages" in group_lines[0].getMessage()
        assert_named(group_lines, label, "_report_fault")
    assert pool.stats().page_fence_errors == 1
    await pool.close()


async def test_a_wrong_thread_error_names_the_pool() -> None:
    # Two named pools, each served on its own thread: the error says which
    # pool a foreign thread called, as every line the pool logs does (a
    # trial's on-call harness read "AsyncReqToTokenPool is bound to ...").
    pool = AsyncReqToTokenPool(5, 8, name="prefill")
    bare = AsyncReqToTokenPool(5, 8)
    assert pool.try_alloc(1) is not None and bare.try_alloc(1) is not None  # binds both here
    errors: list[BaseException] = []

    def foreign() -> None:
        for p in (pool, bare):
            try:
                p.try_alloc(1)
            except BaseException as exc:  # recorded for the asserts
                errors.append(exc)

    thread = threading.Thread(target=foreign, name="scrape-thread")
    thread.start()
    thread.join(WAIT_S)
    assert len(errors) == 2
    named, unnamed = (str(e) for e in errors)
    assert named.startswith("AsyncReqToTokenPool 'prefill' is bound to thread")
    assert "'scrape-thread'" in named
    assert unnamed.startswith("AsyncReqToTokenPool is bound to thread")
    assert (pool.stats().allocated, bare.stats().allocated) == (1, 1)  # nothing changed
    await pool.close()
    await bare.close()
