"""A fuzz of fences whose ``query()`` calls the pool back, against a model.

The pool asks fences (code not its own) in the middle of its own calls: as a
free defers, as a reclaim walks, as a growth or an admission reclaims, as a
``record_use`` prunes. A transfer handle's ``query()`` may call the pool back
there (directly, or through a task that ``asyncio.eager_task_factory`` runs
at once). Each seed runs a pool with a ``KVPagePool`` (and again one with
two KV groups, calls naming one group or all at once) through random calls
(``try_alloc``, ``try_admit``, ``admit`` waiters, fenced frees with one or
several fences, ``record_use``, ``extend``/``extend_rows``/``extend_fitting``,
``detach_pages`` and ``kv.free``, ``trim_pages``, ``drop_pages``, cancels,
fences completing), with fences of unknown origin and of two streams whose
``query()`` makes such calls itself, nested two deep. After every step:
every ledger's invariants, no row or page handed out twice or owned twice,
nothing handed out while a fence it waits for is open; at the end, every
row and page back. A call refused because the call that asked the
``query()`` holds what it names (docs/api.md: *An eager task factory*)
changes nothing, and the model keeps it so.

``force_release`` of a pending fence, from a step or from a ``query()``: the
operator's verdict holds from the call on (memory it frees may be handed out
by calls its ``query()`` calls make before it returns), so the model drops
the fence from what waits before the call; a stream's older fences go with
it where the forced one is waited behind them. After every step no ledger
may still hold anything behind a forced fence, unless a call under way names
it (that call may defer behind it again, and the fence then completes as
any other).

The pool's explicit ``reclaim()`` (and a page pool's), leases,
``hold_grants()`` and its releases, each as a step and from a ``query()``.
A lease is a task in ``async with pool.lease(n)``, held until the model
ends it (or cancels the task); its rows are the model's as any other (a
step may grow, trim, record a use on, or now and then free one), and its
exit frees the rest behind their recorded uses, a call under way: one
that the body freed it must name in a ``DoubleFreeError`` (noted on the
``CancelledError`` of a cancelled task) and not free again. While a hold
is held no queued waiter is granted a row (``stats().allocs`` less the
rows of the calls that never queued), and ``try_alloc``/``try_admit``
answer None and ``alloc``/``admit`` queue (a hold taken from a
``query()`` they asked counts too). Between steps, with no hold held and
no cancel on its way to a task, the queue's head does not fit what is
free: whatever made memory free (a hold's release, a reclaim, a free, a
lease's exit) ran the grant loop.

Fences that fault: now and then (at most twice a run) a fence of unknown
origin fails, as a transfer whose peer died: its ``query()`` (after the
call it may make first) and ``synchronize()`` raise. What waits behind it
is quarantined for good, so the model keeps the fence open for ever: a row
or page handed out behind it fails the run; a request that quarantine
makes unfittable raises ``CapacityError`` (accepted only while something
is quarantined); at the end every row and page is back or quarantined.

Before the holds (and the re-entrant grant loop and reclaim before them),
most seeds of this fuzz failed; see docs/changes.md (trialReenter, and
"What a call changes is held while it asks fences"; reForce, for
``force_release``). The extension with reclaim, leases and holds found
``try_alloc``/``try_admit`` (and ``alloc``/``admit`` served at once)
taking, after their reclaim, what belonged to a call queued from a
``query()`` it asked, and leaving the rest granted to nobody
(tests/test_eager_tasks.py; docs/changes.md, fzMore).
Each fence calls back at most twice, as a transfer handle's completion does
once: a model whose fences call back at every ask, dozens pending, keeps the
grant loop re-running as long as each pass returns memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
from helpers import HOW, WAIT_S, bounded, eager_tasks, start_task

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    DoubleFreeError,
    GrantHold,
    InvalidSlotError,
    KVPagePool,
    PoolClosedError,
    new_stream_key,
)

Page = tuple[str | None, int]  # (KV group, page id): group None on a pool with one KVPagePool

ROWS, PAGES = 6, 14
GROUPS = ("full", "swa")  # a grouped pool's KV groups, PAGES pages each
STEPS = 300
SEEDS = range(24)
_NEST = 2  # calls made from a query(), nested at most this deep
_CALLS_A_FENCE = 2
_HOLDS = 2  # hold_grants() holds held at once, at most
# The steps still made once the pool is closed (a hold is allowed there,
# holding nothing).
_AFTER_CLOSE = ("free", "kv_free", "complete", "force", "lease_end", "hold", "release")


class _Broken(BaseException):
    """The model found the pool wrong. Not an ``Exception``: raised inside a
    ``query()``, the pool must not take it for the fence faulting."""


class _Fence:
    """A fence done when the model completes it; its ``query()`` on the
    loop's thread may run one of the model's calls first."""

    def __init__(self, fuzz: _Fuzz, key: int | None = None, seq: int = 0) -> None:
        self.fuzz = fuzz
        self.done = False
        self.landed = threading.Event()
        self.calls = 0
        self.faulted = False
        if key is not None:
            self.stream_key, self.seq = key, seq

    def query(self) -> bool:
        fuzz = self.fuzz
        if (
            threading.get_ident() == fuzz.loop_thread
            and fuzz.depth < _NEST
            and self.calls < _CALLS_A_FENCE
            and fuzz.rng.random() < fuzz.p_call_back
        ):
            self.calls += 1
            fuzz.call_back()
        if self.faulted:
            raise RuntimeError("the transfer failed")
        return self.done

    def synchronize(self) -> None:
        self.landed.wait(WAIT_S)
        if self.faulted:
            raise RuntimeError("the transfer failed")

    def complete(self) -> None:
        self.done = True
        self.landed.set()


class _Lease:
    """One ``async with pool.lease(n)`` of the model: held until ``gate`` is
    set (or its task cancelled)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.rows: list[int] = []  # granted
        self.freed: list[int] = []  # freed by a step inside the body
        self.exiting = 0  # how many rows its exit gives back
        self.task: asyncio.Future[Any] | None = None


class _Fuzz:
    #: The steps still made once the pool is closed (a subclass adds its own).
    AFTER_CLOSE: tuple[str, ...] = _AFTER_CLOSE

    def __init__(self, seed: int, how: str, grouped: bool = False, reclaim: str = "auto") -> None:
        self.rng = random.Random(seed)
        self.how = how
        self.grouped = grouped
        self.p_call_back = self.rng.choice([0.2, 0.5, 0.9])
        self.loop_thread = threading.get_ident()
        self.depth = 0
        # A page is (group, id): group None on a pool with one KVPagePool.
        self.kvs = (
            {g: KVPagePool(PAGES, 2) for g in GROUPS} if grouped else {None: KVPagePool(PAGES, 2)}
        )
        self.pool = AsyncReqToTokenPool(
            ROWS, 8, kv=self.kvs if grouped else self.kvs[None], reclaim=reclaim
        )
        self.held: dict[int, list[_Fence]] = {}  # row -> the fences of its recorded uses
        self.behind: dict[int, list[_Fence]] = {}  # row -> fences it was freed behind
        self.pages_behind: dict[Page, list[_Fence]] = {}
        self.detached: list[tuple[list[Page], list[_Fence]]] = []  # pages, their row's uses
        self.fences: list[_Fence] = []  # not yet complete
        self.forced: list[_Fence] = []  # force-released, never to complete (until the end)
        self.force_log: list[_Fence] = []  # every fence forced, in order
        self.inflight: list[list[_Fence]] = []  # the fences of the calls under way
        self.freeing: list[tuple[int, int]] = []  # rows frees under way give back, their tags
        self.tasks: list[asyncio.Future[Any]] = []
        self.streams = [new_stream_key() for _ in range(2)]
        self.seqs = {key: itertools.count(1) for key in self.streams}
        self.closed = False
        self.log: list[str] = []
        self.failure: _Broken | None = None  # the first, wherever it was raised
        self.leases: list[_Lease] = []  # not yet told to end
        self.leased: dict[int, _Lease] = {}  # row -> the live lease that holds it
        self.holds: list[GrantHold] = []  # hold_grants() holds the model holds
        # Rows handed out by calls that never queued (try_*, an alloc or
        # admit served at once): stats().allocs less these counts the rows
        # granted to waiters, which must not grow while a hold is held.
        self.direct_rows = 0
        self.grant_mark = 0  # that count when the hold began (or lower since)
        self.starting: set[object] = set()  # tokens of the tasks being started
        self.faulted: list[_Fence] = []  # failed: never to complete

    # ------------------------------------------------------------ fences

    def new_fence(self) -> _Fence:
        if self.rng.random() < 0.5:
            fence = _Fence(self)
        else:
            key = self.rng.choice(self.streams)
            fence = _Fence(self, key, next(self.seqs[key]))
        self.fences.append(fence)
        return fence

    def fence_arg(self) -> tuple[Any, list[_Fence]]:
        """A call's ``fence=``: none, one, or a list (an older one too, at times)."""
        r = self.rng.random()
        if r < 0.2:
            return None, []
        if r < 0.6:
            fence = self.new_fence()
            return fence, [fence]
        fences = [self.new_fence() for _ in range(self.rng.randint(2, 3))]
        if self.rng.random() < 0.3:
            fences.append(self.rng.choice(self.fences))
        return fences, list(fences)

    def complete_one(self) -> None:
        fence = self.fences.pop(self.rng.randrange(len(self.fences)))
        fence.complete()
        key = getattr(fence, "stream_key", None)
        if key is not None:  # a stream's fences complete in order
            for other in list(self.fences):
                if getattr(other, "stream_key", None) == key and other.seq < fence.seq:
                    other.complete()
                    self.fences.remove(other)

    # ------------------------------------------------------------ checks

    def broken(self, what: str) -> _Broken:
        error = _Broken(f"{what}; last calls {self.log[-10:]}")
        if self.failure is None:
            self.failure = error
        return error

    def got_row(self, row: int, pages: list[Page]) -> None:
        if row in self.held:
            raise self.broken(f"row {row} handed out twice")
        if any(not f.done for f in self.behind.pop(row, [])):
            raise self.broken(f"row {row} handed out while a fence it was freed behind is open")
        self.held[row] = []
        self.got_pages(pages)

    def got_pages(self, pages: list[Page]) -> None:
        if len(set(pages)) != len(pages):
            raise self.broken(f"a page handed out twice in one call: {pages}")
        for page in pages:
            if any(not f.done for f in self.pages_behind.pop(page, [])):
                raise self.broken(f"page {page} handed out while a fence it waits for is open")

    def check(self) -> None:
        try:
            self.pool.check_invariants()
            for kv in self.kvs.values():
                kv.check_invariants()
        except AssertionError as exc:
            raise self.broken(f"invariant: {exc}") from None
        ledgers = [("row", self.pool._ledger), *(("page", kv.ledger) for kv in self.kvs.values())]
        for fence in self.forced:
            for unit, ledger in ledgers:
                if ledger.holds(fence):
                    raise self.broken(f"a {unit} still held behind a force-released fence")
        owner: dict[Page, object] = {}
        for row in self.held:
            for page in self.live_pages(row):
                if page in owner:
                    raise self.broken(f"page {page} owned by {owner[page]} and row {row}")
                owner[page] = row
        for pages, _ in self.detached:
            for page in pages:
                if page in owner:
                    raise self.broken(f"page {page} owned by {owner[page]} and a prefix cache")
                owner[page] = "a prefix cache"
        self.check_holds()
        self.check_no_lost_grant()

    def available(self) -> list[int]:
        """Free rows, then free pages by group."""
        return [self.pool.available_size(), *(kv.available_size() for kv in self.kvs.values())]

    def quarantined(self) -> list[int]:
        """Quarantined rows, then quarantined pages by group."""
        kvs = self.kvs.values()
        return [self.pool.quarantined_size(), *(kv.quarantined_size() for kv in kvs)]

    def unfittable(self, exc: CapacityError, where: str) -> None:
        """A request refused as one that can never fit: only quarantine (a
        faulted fence's) makes one of the model's requests so."""
        if not any(self.quarantined()):
            raise self.broken(f"CapacityError without quarantine ({where}): {exc}") from exc
        self.log.append(f"{where} unfittable")

    def waiter_grants(self) -> int:
        return self.pool.stats(summaries=False).allocs - self.direct_rows

    def check_holds(self) -> None:
        """The pool counts the holds the model holds, and while any is held
        no queued waiter was granted a row (a count that may step down: a
        granted waiter cancelled gives its rows back)."""
        if self.pool.grant_holds != len(self.holds):
            raise self.broken(f"{self.pool.grant_holds} holds counted, {len(self.holds)} held")
        if self.holds:
            now = self.waiter_grants()
            if now > self.grant_mark:
                raise self.broken(f"{now - self.grant_mark} rows granted to waiters while held")
            self.grant_mark = now

    def check_no_lost_grant(self) -> None:
        """Between steps, with nothing holding the grant loop and no cancel
        on its way to a task, the queue's head does not fit what is free:
        whatever made memory free ran the grant loop (a hold's release, a
        reclaim, a free, a lease's exit)."""
        pool = self.pool
        if self.holds or self.closed:
            return
        if any(not t.done() and getattr(t, "cancelling", lambda: 0)() for t in self.tasks):
            return  # its waiter leaves the queue, and runs the loop, when the task unwinds
        head = pool.queue_head()
        if head is None or head.rows > pool.available_size():
            return
        wants = {None: head.pages} if isinstance(head.pages, int) else dict(head.pages)
        if all(k <= self.kvs[g].available_size() for g, k in wants.items()):
            raise self.broken(f"the queue's head {head} fits what is free, and waits")

    def live_pages(self, row: int) -> list[Page]:
        return [(g, p) for g in self.kvs for p in self.positions(row, g) if p]  # 0: dropped

    def positions(self, row: int, group: str | None) -> list[int]:
        return self.pool.pages_of(row, group=group).tolist()  # type: ignore[no-any-return]

    def pages(self, got: Any, group: str | None = None) -> list[Page]:
        """What a call handed out (a tensor of ``group``'s pages, or a dict
        of each group's) as pages."""
        if isinstance(got, dict):
            return [(g, p) for g, t in got.items() for p in t.reshape(-1).tolist()]
        return [(group, p) for p in got.reshape(-1).tolist()]

    def count(self, n: int) -> Any:
        """A page count for every group: ``n`` on a pool with one
        KVPagePool, ``{group: n or fewer}`` on a grouped one."""
        return {g: self.rng.randint(0, n) for g in GROUPS} if self.grouped else n

    def one_group(self) -> str | None:
        return self.rng.choice(GROUPS) if self.grouped else None

    def still_owned(self, rows: list[int], pages: list[Page]) -> list[Page]:
        """``pages`` a growth of ``rows`` handed out, less those the growth's
        trailing grant loop gave back (a ``query()`` there freed, trimmed or
        dropped them): those went with their row, behind its fences."""
        owned = {p for row in rows if row in self.held for p in self.live_pages(row)}
        return [p for p in pages if p in owned]

    # ------------------------------------------------------------ calls

    def call_back(self) -> None:
        """A call made from a ``query()``. Refused because the call that
        asked holds what it names: nothing changed, so the model is put
        back as it was before the call."""
        saved = (
            {r: list(u) for r, u in self.held.items()},
            {r: list(f) for r, f in self.behind.items()},
            {p: list(f) for p, f in self.pages_behind.items()},
            [(pages, list(uses)) for pages, uses in self.detached],
            dict(self.leased),
        )
        forced_before = len(self.force_log)
        self.depth += 1
        try:
            if self.freeing and self.rng.random() < 0.3:
                self.name_a_row_being_freed()
                return
            self.step(inner=True)
            self.check_holds()
        except _Broken:
            raise
        except CapacityError as exc:
            self.unfittable(exc, "inner")
        except Exception as exc:
            if "under way" not in str(exc):
                raise self.broken(f"a call from a query() raised {exc!r}") from exc
            self.log.append(f"refused: {type(exc).__name__}")
            self.held, self.behind, self.pages_behind, self.detached, self.leased = saved
            for fence in self.force_log[forced_before:]:  # made from its query(): they stand
                self.forget(fence)
        finally:
            self.depth -= 1

    def name_a_row_being_freed(self) -> None:
        """From a ``query()``: a call naming a row that a free under way
        gives back, which the model no longer lists (so no step picks it).
        Unless the row was handed out again since (its generation tag
        moved: the free's trailing grant loop, or a take made here), the
        call must be refused: the free holds the row while it asks, and
        the row is not allocated once freed."""
        row, tag = self.rng.choice(self.freeing)
        if self.pool.generation(row) != tag:
            return
        pool = self.pool
        calls: dict[str, Callable[[], object]] = {
            "free": lambda: pool.free([row]),
            "extend": lambda: pool.extend(row, 1, group=self.one_group()),
            "detach": lambda: pool.detach_pages(row, group=self.one_group()),
            "record_use": lambda: pool.record_use([row], []),
        }
        name = self.rng.choice(list(calls))
        self.log.append(f"in {name} of a row being freed")
        try:
            calls[name]()
        except (InvalidSlotError, DoubleFreeError):
            return
        raise self.broken(f"{name} of row {row}, which a free under way gives back, was served")

    def step(self, inner: bool) -> None:
        rng, pool = self.rng, self.pool
        calls = ["try_alloc", "try_admit", "admit", "free", "free", "record_use", "extend"]
        calls += ["extend_rows", "extend_fitting", "detach", "kv_free", "trim", "drop", "force"]
        calls += ["reclaim", "lease", "lease_end", "hold", "release", "release"]
        if not inner:
            calls += ["complete", "complete", "cancel", "fault"]
        elif rng.random() < 0.02:
            calls.append("close")
        calls += self.more_calls(inner)
        name = rng.choice(calls)
        self.log.append(("in " if inner else "") + name)
        if self.closed and name not in self.AFTER_CLOSE:
            return
        getattr(self, "_" + name)(rng, pool)

    def more_calls(self, inner: bool) -> list[str]:
        """A subclass's own steps (each ``_name(rng, pool)``): none here."""
        return []

    def _try_alloc(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        held = bool(self.holds)
        rows = pool.try_alloc(rng.randint(1, 2)) or []
        if rows and (held or self.holds):  # held before it, or from a query() it asked
            raise self.broken("try_alloc served while a hold_grants() hold is held")
        self.direct_rows += len(rows)
        for row in rows:
            self.got_row(row, [])

    def _try_admit(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        held = bool(self.holds)
        grant = pool.try_admit(pages=self.count(rng.randint(0, 3)))
        if grant is not None:
            if held or self.holds:
                raise self.broken("try_admit served while a hold_grants() hold is held")
            self.direct_rows += 1
            self.got_row(grant.row, self.pages(grant.pages))

    def start(self, coro: Callable[[object], Coroutine[Any, Any, None]]) -> asyncio.Future[Any]:
        """A task of ``coro(token)``, started as the eager factory starts
        one: ``token`` is in ``self.starting`` until it is started, so the
        task's code sees whether it is still running inside its start (a
        call that never queued)."""
        token = object()
        self.starting.add(token)
        try:
            task = start_task(coro(token), self.how)
        finally:
            self.starting.discard(token)
        self.tasks.append(task)
        return task

    def served_at_once(self, call: str, held: bool, rows: int) -> None:
        """An ``alloc`` or ``admit`` served without queueing: never while a
        hold is held (taken before it, or from a ``query()`` it asked)."""
        if held or self.holds:
            raise self.broken(f"{call} served at once while a hold_grants() hold is held")
        self.direct_rows += rows

    def _admit(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        n = self.count(rng.randint(0, 2))

        async def admit(token: object) -> None:
            held = bool(self.holds)
            try:
                grant = await pool.admit(pages=n)
            except (asyncio.CancelledError, PoolClosedError):
                return
            except CapacityError as exc:
                self.unfittable(exc, "admit")
                return
            if token in self.starting:  # served at once, not queued
                self.served_at_once("admit", held, 1)
            self.got_row(grant.row, self.pages(grant.pages))

        self.start(admit)

    # ------------------------------------------------------------ leases

    def _lease(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        """A task that holds ``pool.lease(n)`` until the model ends it. Its
        rows are the model's as any other (a step may grow, trim, record a
        use on, or now and then free one); the exit frees the rest behind
        their recorded uses, and raises ``DoubleFreeError`` for those the
        body freed (a cancellation goes on, carrying it as a note)."""
        lease = _Lease()
        n = rng.randint(1, 2)

        async def hold(token: object) -> None:
            exiting = False
            held = bool(self.holds)
            try:
                try:
                    async with pool.lease(n) as rows:
                        if token in self.starting:  # served at once, not queued
                            self.served_at_once("lease", held, len(rows))
                        lease.rows = list(rows)
                        for row in rows:
                            self.got_row(row, [])
                            self.leased[row] = lease
                        try:
                            await lease.gate.wait()
                        finally:
                            mark = self.exit_mark()
                            self.lease_exit(lease)
                            exiting = True
                finally:
                    if exiting:  # the exit's free has returned
                        self.inflight.pop()
                        del self.freeing[len(self.freeing) - lease.exiting :]
                        self.exited(mark)
            except DoubleFreeError as exc:
                if not lease.freed or any(str(row) not in str(exc) for row in lease.freed):
                    error = self.broken(f"lease exit raised {exc!r}; the body freed {lease.freed}")
                    raise error from exc
                return
            except asyncio.CancelledError as exc:
                notes = getattr(exc, "__notes__", [])
                if lease.freed and not any("lease exit" in note for note in notes):
                    error = self.broken("a cancelled lease's exit did not note the rows freed")
                    raise error from exc
                return
            except PoolClosedError:
                return
            except CapacityError as exc:
                self.unfittable(exc, "lease")
                return
            except Exception as exc:
                raise self.broken(f"a lease task raised {exc!r}") from exc
            if lease.freed:
                raise self.broken(f"lease exit raised nothing; the body freed {lease.freed}")

        lease.task = self.start(hold)
        self.leases.append(lease)

    def lease_exit(self, lease: _Lease) -> None:
        """The lease's rows it still holds go, behind their recorded uses:
        the exit frees them next. Until that free returns it is under way,
        naming those uses, and gives those rows back."""
        waits: list[_Fence] = []
        freeing: list[tuple[int, int]] = []
        for row in lease.rows:
            if self.leased.get(row) is lease:
                del self.leased[row]
                uses = self.held.pop(row)
                self.behind[row] = list(uses)
                for page in self.live_pages(row):
                    self.pages_behind[page] = list(uses)
                waits += uses
                freeing.append((row, self.pool.generation(row)))
        lease.exiting = len(freeing)
        self.freeing += freeing
        self.inflight.append(waits)

    def exit_mark(self) -> Any:
        """Before a lease's exit frees its rows: what a subclass keeps to
        check that free by, once made (:meth:`exited`). Nothing here."""
        return None

    def exited(self, mark: Any) -> None:
        """A lease's exit has freed its rows (``mark``: :meth:`exit_mark`'s)."""

    def _lease_end(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        if not self.leases:
            return
        lease = self.leases.pop(rng.randrange(len(self.leases)))
        assert lease.task is not None
        if rng.random() < 0.5:
            lease.gate.set()  # the body returns at the loop's next turn
        else:
            lease.task.cancel()

    # ------------------------------------------------------------ holds, reclaim

    def _hold(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        if len(self.holds) >= _HOLDS:
            return
        if not self.holds:
            self.grant_mark = self.waiter_grants()
        self.holds.append(pool.hold_grants())

    def _release(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        """Release a hold (now and then twice: a no-op), or every hold at
        once; the last one runs the grant loop, which
        :meth:`check_no_lost_grant` checks after the step."""
        if not self.holds:
            return
        if rng.random() < 0.2:
            holds, self.holds = self.holds, []
            ended = pool.release_grant_holds()
            if ended != len(holds) or any(hold.held for hold in holds):
                raise self.broken(f"release_grant_holds() ended {ended} of {len(holds)}")
            if rng.random() < 0.5:
                holds[0].release()  # ended already: nothing
            if not self.depth:
                self.check_no_lost_grant()
            return
        hold = self.holds.pop(rng.randrange(len(self.holds)))
        hold.release()
        if rng.random() < 0.2:
            hold.release()
        if not self.depth:  # granted by the call, not by a wake-up to come
            self.check_no_lost_grant()

    def _reclaim(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        if rng.random() < 0.7:
            pool.reclaim()
        else:  # the pages alone: the pool's waiters are granted too
            self.kvs[self.one_group()].reclaim()
        if not self.depth:  # granted by the call, not by a wake-up to come
            self.check_no_lost_grant()

    def _cancel(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        live = [t for t in self.tasks if not t.done()]
        if live:
            rng.choice(live).cancel()

    def _complete(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        if self.fences:
            self.complete_one()

    def _fault(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        """A pending fence of unknown origin fails (at most two a run): it
        never completes, and what waits behind it must stay quarantined."""
        plain = [f for f in self.fences if getattr(f, "stream_key", None) is None]
        if not plain or len(self.faulted) >= 2:
            return
        fence = rng.choice(plain)
        self.fences.remove(fence)
        self.faulted.append(fence)
        fence.faulted = True
        fence.landed.set()

    def _force(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        if not self.fences:
            return
        fence = rng.choice(self.fences)
        self.force_log.append(fence)
        self.forget(fence)
        if not any(fence in fences for fences in self.inflight):
            self.fences.remove(fence)  # never named again: nothing may wait for it now
            self.forced.append(fence)
        pool.force_release(fence)

    def forget(self, fence: _Fence) -> None:
        """What waits for ``fence`` waits no more (a stream's older fences
        with it, where they are waited together); a row's recorded use of
        it is forgotten (with the stream's older uses, which the row's
        record had dropped for it)."""
        key = getattr(fence, "stream_key", None)

        def gone(other: _Fence, waits: list[_Fence]) -> bool:
            if other is fence:
                return True
            if key is None or getattr(other, "stream_key", None) != key:
                return False
            return other.seq < fence.seq and fence in waits

        for waiting in (self.behind, self.pages_behind):
            for unit, waits in waiting.items():
                waiting[unit] = [f for f in waits if not gone(f, waits)]
        for uses in [*self.held.values(), *(uses for _, uses in self.detached)]:
            uses[:] = [f for f in uses if not gone(f, uses)]  # the row kept the newest

    @contextlib.contextmanager
    def under_way(self, fences: list[_Fence]) -> Iterator[None]:
        self.inflight.append(fences)
        try:
            yield
        finally:
            self.inflight.pop()

    def _close(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        self.closed = True
        self.tasks.append(start_task(pool.close(), self.how))

    def _free(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        mine = [row for row in self.held if row not in self.leased]
        if rng.random() < 0.2:  # a lease's row now and then
            mine = list(self.held)
        if not mine:
            return
        row = rng.choice(mine)
        pages = self.live_pages(row)
        arg, fences = self.fence_arg()
        waits = fences + self.held.pop(row)
        self.behind[row] = list(waits)
        for page in pages:
            self.pages_behind[page] = list(waits)
        self.freeing.append((row, pool.generation(row)))
        try:
            with self.under_way(waits):
                pool.free([row], arg)
        finally:
            self.freeing.pop()
        lease = self.leased.pop(row, None)
        if lease is not None:  # freed in its body: its exit frees it no more
            lease.freed.append(row)

    def _record_use(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        if self.held:
            row = rng.choice(list(self.held))
            fence = self.new_fence()
            with self.under_way([fence]):
                pool.record_use([row], fence)
            self.held[row].append(fence)

    def _extend(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        if self.held:
            row = rng.choice(list(self.held))
            group = self.one_group()
            if self.grouped and rng.random() < 0.5:  # every group at once
                new: Any = pool.extend(row, self.count(2))
            else:
                new = pool.extend(row, rng.randint(1, 2), group=group)
            if new is not None:
                self.got_pages(self.still_owned([row], self.pages(new, group)))

    def _extend_rows(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        self._grow(rng, pool, fitting=False)

    def _extend_fitting(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        self._grow(rng, pool, fitting=True)

    def _grow(self, rng: random.Random, pool: AsyncReqToTokenPool, fitting: bool) -> None:
        if not self.held:
            return
        rows = rng.sample(sorted(self.held), rng.randint(1, min(3, len(self.held))))
        group = self.one_group()
        k: Any = rng.randint(1, 2)
        if self.grouped and rng.random() < 0.5:  # every group at once
            k, group = {g: rng.randint(0, 2) for g in GROUPS}, None
        new: Any
        if fitting:
            new = pool.extend_fitting(rows, k, group=group)[1]
        else:
            new = pool.extend_rows(rows, k, group=group)
        if new is not None:
            self.got_pages(self.still_owned(rows, self.pages(new, group)))

    def _detach(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        if self.held:
            row = rng.choice(list(self.held))
            group = self.one_group()
            pages = self.pages(pool.detach_pages(row, host=True, group=group), group)
            if pages:  # their later free waits for the row's steps too
                self.detached.append((pages, list(self.held[row])))

    def _kv_free(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        if not self.detached:
            return
        pages, uses = self.detached.pop(rng.randrange(len(self.detached)))
        arg, fences = self.fence_arg()
        arg = [*([] if arg is None else arg if isinstance(arg, list) else [arg]), *uses]
        for page in pages:
            self.pages_behind[page] = fences + uses
        [group] = {g for g, _ in pages}  # detached from one group
        with self.under_way(fences + uses):
            self.kvs[group].free([p for _, p in pages], fence=arg or None)

    def _trim(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        self._give_back(rng, pool, trim=True)

    def _drop(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        self._give_back(rng, pool, trim=False)

    def _give_back(self, rng: random.Random, pool: AsyncReqToTokenPool, trim: bool) -> None:
        if not self.held:
            return
        row = rng.choice(list(self.held))
        every = self.grouped and rng.random() < 0.5  # every group at once: {group: at}
        counts: dict[str | None, int] = {}
        for group in GROUPS if every else [self.one_group()]:
            positions = self.positions(row, group)
            if not positions:
                continue
            at = rng.randrange(len(positions)) if trim else rng.randint(0, len(positions))
            counts[group] = at
        if not counts:
            return
        arg, fences = self.fence_arg()
        for group, at in counts.items():
            positions = self.positions(row, group)
            for page in positions[at:] if trim else positions[:at]:
                if page:
                    self.pages_behind[group, page] = fences + self.held[row]
        give_back = pool.trim_pages if trim else pool.drop_pages
        with self.under_way(fences + self.held[row]):
            if every:
                give_back([row], counts, arg)  # type: ignore[arg-type]
            else:
                [(group, at)] = counts.items()
                give_back([row], at, arg, group=group)

    # ------------------------------------------------------------ a run

    async def run(self) -> None:
        pool = self.pool
        for _ in range(STEPS):
            try:
                self.step(inner=False)
            except _Broken:
                raise
            except CapacityError as exc:
                self.unfittable(exc, "outer")
            except Exception as exc:  # a refusal made to the outer call: none expected
                raise self.broken(f"{type(exc).__name__}: {exc}") from exc
            for _ in range(self.rng.randint(0, 2)):
                await asyncio.sleep(0)  # the granted waiters' tasks run
            if self.failure is not None:  # in a waiter's task
                raise self.failure
            self.check()
            if self.closed and self.rng.random() < 0.1:
                break
        # Wind down: every fence done, every waiter gone, everything back.
        self.p_call_back = 0.0
        for fence in self.fences + self.forced:
            fence.complete()
        holds, self.holds = self.holds, []
        for hold in holds:
            hold.release()
        for task in self.tasks:
            task.cancel()
        results = await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.failure is not None:
            raise self.failure
        for result in results:
            if isinstance(result, Exception):
                raise self.broken(f"a task raised {result!r}")
        await pool.drain(timeout=WAIT_S)
        self.check()
        for row in list(self.held):
            del self.held[row]
            pool.free([row])
        for pages, _ in self.detached:
            [group] = {g for g, _ in pages}
            self.kvs[group].free([p for _, p in pages])
        self.detached = []
        await pool.drain(timeout=WAIT_S)
        self.check()
        stats = pool.stats()
        left = (stats.allocated, stats.pending)
        left += tuple(
            n for kv in self.kvs.values() for n in (kv.allocated_size(), kv.pending_size())
        )
        if any(left):
            raise self.broken(f"left allocated or pending (rows, then pages by group): {left}")
        # Behind a faulted fence: quarantined for good.
        back = tuple(n + q for n, q in zip(self.available(), self.quarantined(), strict=True))
        if not self.closed and back != (ROWS - 1, *(PAGES - 1 for _ in self.kvs)):
            raise self.broken(f"not all back: {back[0]} rows, pages by group {back[1:]}")
        await pool.close()


@pytest.mark.parametrize("grouped", [False, True], ids=["one kv", "kv groups"])
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("seed", SEEDS)
async def test_fences_that_call_the_pool_back_lose_and_double_nothing(
    seed: int, how: str, grouped: bool
) -> None:
    async with bounded(4 * WAIT_S):
        fuzz = _Fuzz(seed, how, grouped)
        with eager_tasks(how):
            await fuzz.run()
