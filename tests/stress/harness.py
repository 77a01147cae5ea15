"""What the stress tests in this folder share: random fences and the phased driver.

Both stress tests (rows in ``test_async_stress.py``, admissions with KV pages
in ``test_admit_stress.py``) drive one pool from many tasks while a clock task
launches gates on ``HostStream``s and opens them, and fences of unknown
origin, at random moments, so fences complete out of order across streams.
Each test keeps its own shadow model, workers, constants and assertions; this
module holds the machinery that is the same in both:

* :class:`ManualFence`: a fence of unknown origin (no ``stream_key``) that
  completes on ``set()``;
* :class:`ShadowBase`: the base of each test's shadow model: the streams and
  their gates, the open manual fences, op counting and failure collection,
  the fences recorded on rows, the wait conditions a freed row or page is
  checked against when it is granted again, and the periodic
  ``check_invariants()``;
* :func:`clock`: the task that launches gates and opens gates and manual
  fences;
* :func:`run_phases`: runs the workers phase by phase under a time budget,
  then opens every fence, drains, checks, and closes pool and streams;
* :func:`loop_id` / :func:`show`: the summary line's loop name, and printing
  it past pytest's capture.

Imported as the top-level module ``harness``: pytest puts this folder (it has
no ``__init__.py``) on ``sys.path``, as it puts ``tests/`` for ``helpers``.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from asyncpool import AsyncReqToTokenPool, HostStream, PoolStats

# A wait condition of a freed row or page: ("fence", fence) until fence.query()
# is true, or ("gate", s, k) until stream s has run past its gate k.
Cond = tuple[Any, ...]
PhaseT = TypeVar("PhaseT")


class ManualFence:
    """A fence of unknown origin (no ``stream_key``): the pool polls it in full.

    It completes on :meth:`set`. ``sync_timeout`` bounds :meth:`synchronize`
    (``None``: wait until set).
    """

    __slots__ = ("_ev", "_sync_timeout")

    def __init__(self, sync_timeout: float | None = None) -> None:
        self._ev = threading.Event()
        self._sync_timeout = sync_timeout

    def query(self) -> bool:
        return self._ev.is_set()

    def synchronize(self) -> None:
        self._ev.wait(self._sync_timeout)

    def set(self) -> None:
        self._ev.set()


def _gate(ev: threading.Event, passed: list[int], s: int, k: int) -> None:
    """Stream work: block until ``ev`` is set, then record that stream ``s`` passed gate ``k``."""
    ev.wait()
    passed[s] = k


class ShadowBase:
    """The shared half of a stress test's shadow model.

    Holds the pool, the streams and their gates (gate ``k`` on stream ``s``
    sets ``passed[s] = k`` once it has run; ``current[s]`` is a fence recorded
    after the latest gate), the manual fences still open, and the run's
    counters. Subclasses track owners and implement :meth:`cross_check`.
    """

    def __init__(
        self,
        pool: AsyncReqToTokenPool,
        streams: list[HostStream],
        *,
        seed: int,
        target: int,
        check_every: int,
        max_open_gates: int,
        max_manual: int,
        manual_share: float,
        sync_timeout: float | None = None,
    ) -> None:
        self.pool = pool
        self.streams = streams
        self.seed = seed
        self.check_every = check_every
        self.max_open_gates = max_open_gates  # per stream
        self.max_manual = max_manual  # open manual fences at once
        self.manual_share = manual_share  # of pick_fence's fences
        self.sync_timeout = sync_timeout
        # stream gates
        self.launched = [0] * len(streams)
        self.passed = [0] * len(streams)
        self.current: list[Any] = [None] * len(streams)
        self.open_gates: list[list[threading.Event]] = [[] for _ in streams]
        # row -> fences recorded on it since its grant (the subclass starts each list)
        self.uses: dict[int, list[Any]] = {}
        # manual fences
        self.manual_open: list[ManualFence] = []
        self.manual_done = ManualFence(sync_timeout)
        self.manual_done.set()
        # counters
        self.ops = 0
        self.counts: dict[str, int] = {}
        self.tasks_created = 0
        self.failures: list[str] = []
        self.stop = False  # workers finish their phase
        self.done = False  # the clock stops
        self.target = target  # stop once ops reaches this
        self.checks = 0

    # ------------------------------------------------------------ bookkeeping

    def count(self, what: str) -> None:
        """Count one pool operation; stop at the target, check every ``check_every``."""
        self.ops += 1
        self.counts[what] = self.counts.get(what, 0) + 1
        if self.ops >= self.target:
            self.stop = True
        if self.ops % self.check_every == 0:
            self.check()

    def note(self, what: str) -> None:
        """Count an outcome (a hit, a timeout seen) that is not an operation of its own."""
        self.counts[what] = self.counts.get(what, 0) + 1

    def fail(self, msg: str) -> None:
        """Record a shadow-model failure (the first 50) and stop the workers."""
        if len(self.failures) < 50:
            self.failures.append(msg)
        self.stop = True

    def conds(self, fences: list[Any], after: int | None) -> list[Cond]:
        """The wait conditions of a free behind ``fences`` and ``after=streams[after]``."""
        out: list[Cond] = [("fence", f) for f in fences]
        if after is not None:
            out.append(("gate", after, self.launched[after]))
        return out

    def record_use(self, rows: list[int], fence: Any) -> None:
        """Count and make ``pool.record_use(rows, fence)``; note the fence on each row."""
        self.count("record_use")
        self.pool.record_use(rows, fence)
        for r in rows:
            self.uses[r].append(fence)

    def row_conds(self, row: int, fence: Any, after: int | None) -> list[Cond]:
        """The conditions of ``row`` freed behind ``fence`` and ``after``, and its uses.

        Forgets the row's recorded uses (it is no longer held).
        """
        fences = self.uses.pop(row, [])
        if fence is not None:
            fences = [*fences, fence]
        return self.conds(fences, after)

    def check_conds(self, what: str, tok: int, conds: Sequence[Cond]) -> None:
        """Fail unless every condition ``what`` was freed behind has been met at its grant."""
        for cond in conds:
            if cond[0] == "fence":
                if not cond[1].query():
                    self.fail(f"{what} granted to {tok} while its fence {cond[1]!r} is open")
            else:
                _, s, k = cond
                if self.passed[s] < k:
                    self.fail(
                        f"{what} granted to {tok} before stream {s} ran past gate {k} "
                        f"(passed {self.passed[s]}): freed with after=stream"
                    )

    def check(self) -> None:
        """Run ``check_invariants()``, then the subclass's :meth:`cross_check`."""
        self.checks += 1
        try:
            self.pool.check_invariants()
        except AssertionError as exc:
            self.fail(f"check_invariants after {self.ops} ops: {exc}")
            return
        self.cross_check(self.pool.stats())

    def cross_check(self, st: PoolStats) -> None:
        """Compare the shadow's owners with the pool's stats and ledgers."""
        raise NotImplementedError

    # ------------------------------------------------------------ fences

    def new_gate(self, rng: random.Random) -> None:
        """Launch a gate on a random stream (unless it has too many open) and record after it."""
        s = rng.randrange(len(self.streams))
        if len(self.open_gates[s]) >= self.max_open_gates:
            return
        ev = threading.Event()
        k = self.launched[s] + 1
        self.streams[s].launch(_gate, ev, self.passed, s, k)
        self.launched[s] = k
        self.current[s] = self.streams[s].record()
        self.open_gates[s].append(ev)

    def open_random_gate(self, rng: random.Random) -> None:
        """Open a random open gate of a random stream (out of launch order)."""
        gates = self.open_gates[rng.randrange(len(self.streams))]
        if gates:
            i = rng.randrange(len(gates))
            gates[i], gates[-1] = gates[-1], gates[i]
            gates.pop().set()

    def pick_fence(self, rng: random.Random) -> Any:
        """A fence to free or record behind: a manual one, or a stream's latest."""
        if rng.random() < self.manual_share:
            if self.manual_open and rng.random() < 0.7:
                return rng.choice(self.manual_open)
            return self.manual_done
        f = self.current[rng.randrange(len(self.streams))]
        return f if f is not None else self.manual_done

    def open_everything(self) -> None:
        """Open every gate and manual fence, so all deferred memory can come back."""
        for gates in self.open_gates:
            for ev in gates:
                ev.set()
            gates.clear()
        for mf in self.manual_open:
            mf.set()
        self.manual_open.clear()


async def clock(h: ShadowBase) -> None:
    """Launch gates and open them (and manual fences) at random moments until ``h.done``."""
    rng = random.Random(h.seed)
    while not h.done:
        for _ in range(4):
            if rng.random() < 0.4:
                h.new_gate(rng)
            if rng.random() < 0.55:
                h.open_random_gate(rng)
            if rng.random() < 0.03 and len(h.manual_open) < h.max_manual:
                h.manual_open.append(ManualFence(h.sync_timeout))
            if h.manual_open and rng.random() < 0.03:
                h.manual_open.pop(rng.randrange(len(h.manual_open))).set()
        if h.stop:
            h.open_random_gate(rng)  # wind down faster
        await asyncio.sleep(0)


@dataclass
class PhaseRun:
    """What :func:`run_phases` saw.

    ``errors``: what worker tasks raised; ``hung``: a phase overran the budget
    (its workers were cancelled); ``stats``: ``pool.stats()`` after the drain
    and the final check; ``leftover``: with ``take_rows_back``, the rows one
    ``try_alloc(capacity)`` got after that (``None`` if it failed or hung).
    """

    errors: list[BaseException]
    hung: bool
    stats: PoolStats
    leftover: list[int] | None


#: Seconds a phase may go without a pool operation counted or noted, and
#: may take to wind down once its workers were told to stop, before it
#: counts as hung (a lost wake-up: workers wait for a grant that never
#: comes). A healthy phase counts an operation every few microseconds and
#: winds down in milliseconds; a slow machine stretches the phase, not these.
STALL_S = 20.0


def _progress(h: ShadowBase) -> tuple[int, int]:
    return h.ops, sum(h.counts.values())


async def _finished_or_stalled(h: ShadowBase, phase: asyncio.Future[Any], budget_s: float) -> bool:
    """Wait for ``phase``: True once it finished, False if it overran
    ``budget_s``, counted nothing for :data:`STALL_S`, or did not wind down
    within :data:`STALL_S` of ``h.stop`` (a watchdog, looking once a second;
    not what the workers synchronise on)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    last, since = _progress(h), start
    stopped_at: float | None = None
    while True:
        done, _ = await asyncio.wait({phase}, timeout=1.0)
        if done:
            return True
        now = loop.time()
        seen = _progress(h)
        if seen != last:
            last, since = seen, now
        if h.stop and stopped_at is None:
            stopped_at = now
        if now - since > STALL_S or (stopped_at is not None and now - stopped_at > STALL_S):
            h.fail(f"no progress for {STALL_S:.0f} s (a lost wake-up?): {h.pool!r}")
            return False
        if now - start > budget_s:
            return False


async def run_phases(
    h: ShadowBase,
    phases: Sequence[PhaseT],
    *,
    begin: Callable[[PhaseT], int],
    worker: Callable[[int, PhaseT], Coroutine[Any, Any, None]],
    budget_s: float,
    take_rows_back: bool = False,
) -> PhaseRun:
    """Run the workers phase by phase with the clock, then settle and close everything.

    For each phase (none after a failure): ``begin(phase)`` sets the shadow
    up (its target) and returns how many workers to start; workers
    ``worker(wid, phase)`` run with ids unique across phases until they stop.
    A phase that overruns ``budget_s``, counts nothing for ``STALL_S`` or
    takes longer than that to wind down once told to stop (a lost wake-up:
    workers wait for a grant that never comes) counts as hung: its workers
    are cancelled and no later phase runs. Then the clock stops, every fence
    is opened, ``pool.drain()`` must finish within 30 s, and
    :meth:`ShadowBase.check` runs once more. Whatever happens, the pool and
    ``h.streams`` are closed.
    """
    pool = h.pool
    clock_task = asyncio.create_task(clock(h))
    h.tasks_created += 1
    results: list[BaseException | None] = []
    hung = False
    try:
        wid = 0
        for phase in phases:
            if h.failures:
                break
            h.stop = False
            nworkers = begin(phase)
            workers = [asyncio.create_task(worker(wid + i, phase)) for i in range(nworkers)]
            wid += nworkers
            h.tasks_created += nworkers
            phase_done = asyncio.gather(*workers, return_exceptions=True)
            if await _finished_or_stalled(h, phase_done, budget_s):
                results += phase_done.result()
            else:
                hung = True
                for t in workers:
                    t.cancel()
                await asyncio.gather(phase_done, return_exceptions=True)
                break
        errors = [r for r in results if isinstance(r, BaseException)]
        h.done = True
        await clock_task
        h.open_everything()
        async with asyncio.timeout(30):
            await pool.drain()
        h.check()
        st = pool.stats()
        leftover = pool.try_alloc(pool.capacity) if take_rows_back and not hung else None
        if leftover is not None:
            pool.free(leftover)
    finally:
        h.done = True
        h.open_everything()
        if not clock_task.done():
            clock_task.cancel()
            await asyncio.gather(clock_task, return_exceptions=True)
        await pool.close()
        for s in h.streams:
            s.close()
    return PhaseRun(errors, hung, st, leftover)


def loop_id(request: pytest.FixtureRequest) -> str:
    """The event loop a parametrized test runs on ("asyncio", "uvloop"), for its summary."""
    return request.node.callspec.id if hasattr(request.node, "callspec") else "?"


def show(capsys: pytest.CaptureFixture[str], summary: str) -> None:
    """Print a test's summary line past pytest's output capture."""
    with capsys.disabled():
        print("\n" + summary)
