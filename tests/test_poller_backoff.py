"""The poller's sleeps between passes, read off its condition variable.

The poller of fences of unknown origin sleeps between passes with a
backoff (``_POLL_MIN_S`` doubling to ``_POLL_MAX_S``), starts it again
after a pass that saw a fence complete and when a new fence is handed over
(without sleeping first), and sleeps at least a pass's own cost over
``_POLL_MAX_DUTY`` so it stays under ~5 % of a core. Wall-clock tests can
only bound these loosely; here a condition variable that records each
timeout it is asked to wait (and waits none of it) replaces the watcher's,
the pass cost comes from a stand-in clock, and the fences complete at a
given query: the sleeps are then one exact sequence. A mutation sweep left
these rules pinned by nothing (docs/changes.md, "After b1b24d6").
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import pytest

import asyncpool.watcher as watcher_module
from asyncpool.watcher import FenceWatcher

_US = 1e-6
#: The backoff from one fresh start: 50 µs doubling to the 1 ms cap.
_RAMP = [50 * _US, 100 * _US, 200 * _US, 400 * _US, 800 * _US, 1e-3, 1e-3, 1e-3]
_LINGER = watcher_module._STREAM_LINGER_S


class _RecordingCondition(threading.Condition):
    """A condition that records each wait's timeout and waits none of it."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lock)
        self.timeouts: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        return super().wait(0)


class _CountedFence:
    """Not done until its ``done_at``-th query; runs ``on_query`` at each."""

    def __init__(self, done_at: int, on_query: Callable[[int], None] | None = None) -> None:
        self.queries = 0
        self._done_at = done_at
        self._on_query = on_query

    def query(self) -> bool:
        self.queries += 1
        if self._on_query is not None:
            self._on_query(self.queries)
        return self.queries >= self._done_at

    def synchronize(self) -> None:  # pragma: no cover - the poller only queries
        raise AssertionError("the poller must not synchronize")


def _recording_watcher() -> tuple[FenceWatcher, _RecordingCondition, list[int]]:
    fired: list[int] = []
    w = FenceWatcher(lambda: fired.append(1), name="test-poller-backoff")
    cond = _RecordingCondition(w._lock)
    w._poll_cond = cond  # before the first watch: the poller reads it at its start
    return w, cond, fired


def _run_to_idle(w: FenceWatcher, first: _CountedFence) -> None:
    """Hand ``first`` over and wait for the poller to end, idle (bounded)."""
    w.watch(first)
    thread = w._thread
    assert thread is not None
    thread.join(10.0)
    assert not thread.is_alive(), "the poller did not end once idle"


@pytest.fixture
def free_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pass costs nothing on the poller's clock."""
    monkeypatch.setattr(watcher_module, "_perf_counter", lambda: 0.0)


@pytest.mark.usefixtures("free_passes")
def test_backoff_doubles_to_its_cap_and_starts_again_after_a_completion() -> None:
    """Sleeps double from 50 µs to 1 ms while nothing completes; the pass
    that sees a fence complete starts the backoff again (the sleep before
    the poller's idle wait is 50 µs, not 1 ms)."""
    w, cond, fired = _recording_watcher()
    fence = _CountedFence(done_at=9)
    _run_to_idle(w, fence)
    assert fence.queries == 9
    assert fired == [1]
    assert cond.timeouts == pytest.approx([*_RAMP, 50 * _US, _LINGER])


@pytest.mark.usefixtures("free_passes")
def test_a_fence_handed_over_mid_backoff_starts_it_again_without_sleeping() -> None:
    """A watch() during the backoff skips the sleep the pass had earned
    (1 ms) and starts the backoff again from 50 µs."""
    w, cond, fired = _recording_watcher()
    second = _CountedFence(done_at=3)

    def hand_over_second(query: int) -> None:
        if query == 9:  # the poller queries outside its lock
            w.watch(second)

    first = _CountedFence(done_at=12, on_query=hand_over_second)
    _run_to_idle(w, first)
    assert (first.queries, second.queries) == (12, 3)
    assert fired == [1]  # both completed in one pass: one notify
    # Passes 2-9 sleep the ramp; pass 10 (after the watch) sleeps nothing;
    # passes 11 and 12 sleep 50 and 100 µs; both complete in pass 12.
    assert cond.timeouts == pytest.approx([*_RAMP, 50 * _US, 100 * _US, 50 * _US, _LINGER])


def test_a_costly_pass_sleeps_twenty_times_its_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """The duty cap: a pass that took 10 ms sleeps 200 ms (10 ms / 5 %)
    whatever the backoff says, before and after a completion alike."""
    ticks = itertools.count()
    # Each pass reads the clock twice (its start and its cost): 10 ms apart.
    monkeypatch.setattr(watcher_module, "_perf_counter", lambda: next(ticks) * 10e-3)
    w, cond, fired = _recording_watcher()
    fence = _CountedFence(done_at=4)
    _run_to_idle(w, fence)
    assert fired == [1]
    assert cond.timeouts == pytest.approx([0.2, 0.2, 0.2, 0.2, _LINGER])
