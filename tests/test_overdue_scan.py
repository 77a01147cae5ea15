"""The overdue scan reads the same figures as a plain walk of every batch.

``OverdueFences.scan`` finds the late batches with one C-speed ``min`` per
queue and walks the batches only when some fence is overdue (it is what
``stats()`` runs on a pool with ``fence_timeout``, and what the pool's own
overdue check runs). These tests pin it to the definition, a plain walk of
every pending batch in deferral order, on random pending states: two
ledgers (rows and pages) sharing one clock, ordered fences of two streams
and fences of unknown origin (the side list), batches behind several
fences, reclaims, and the clock moved onto the exact cutoff.
"""

from __future__ import annotations

from typing import Any

from helpers import EventFence, FakeStream, ManualClock
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncpool.deferral import Deferrals
from asyncpool.kv_pages import PageLedger
from asyncpool.ledger import SlotLedger
from asyncpool.overdue import OverdueFences

TIMEOUT = 10.0


def walk_every_batch(
    ledgers: list[Deferrals[Any]], now: float, *, agreed: bool
) -> tuple[dict[int, tuple[Any, dict[str, int]]], float | None]:
    """The definition: overdue fences (a batch waiting for one as its head
    fence is late), all each holds per unit, and when the next turns late."""
    cutoff = now - TIMEOUT
    batches = [(led, b) for led in ledgers for b in led.pending_batches()]
    overdue: dict[int, tuple[Any, dict[str, int]]] = {}
    for led, b in batches:
        if (b.did in led.agreed_overdue) if agreed else b.t0 <= cutoff:
            overdue.setdefault(id(b.fence), (b.fence, {}))
    next_t0 = None
    for led, b in batches:
        entry = overdue.get(id(b.fence))
        if entry is not None:
            entry[1][led.unit] = entry[1].get(led.unit, 0) + b.n
        elif next_t0 is None or b.t0 < next_t0:
            next_t0 = b.t0
    return overdue, None if next_t0 is None else max(0.0, next_t0 + TIMEOUT - now)


def _same(got: Any, want: Any) -> bool:
    (g_over, g_due), (w_over, w_due) = got, want
    return (
        g_due == w_due
        and g_over.keys() == w_over.keys()
        and all(g_over[k][0] is w_over[k][0] and g_over[k][1] == w_over[k][1] for k in w_over)
    )


step = st.one_of(
    # (what, ledger, fence source, second fence source, amount)
    st.tuples(
        st.just("free"),
        st.sampled_from(["rows", "pages"]),
        st.sampled_from(["a", "b", "event", "old"]),
        st.sampled_from([None, "a", "b", "event"]),
        st.integers(1, 3),
    ),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 4.0, TIMEOUT])),
    st.tuples(st.just("complete"), st.sampled_from(["a", "b", "event"])),
    st.tuples(st.just("mark"), st.integers(0, 40)),
)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(step, max_size=40))
def test_scan_matches_a_walk_of_every_batch(steps: list[tuple[Any, ...]]) -> None:
    clock = ManualClock()
    rows_led = SlotLedger(64, clock=clock)
    pages_led = PageLedger(64, clock=clock)
    ledgers: list[Deferrals[Any]] = [rows_led, pages_led]
    overdue = OverdueFences(TIMEOUT, ledgers, clock=clock)
    streams = {"a": FakeStream(), "b": FakeStream()}
    events: list[EventFence] = []
    old: list[Any] = []  # fences recorded earlier, freed behind later

    def fence_of(source: str) -> Any:
        if source == "event":
            events.append(EventFence())
            return events[-1]
        if source == "old" and old:
            return old[0]
        fence = streams["a" if source == "old" else source].record()
        old.append(fence)
        return fence

    for what, *args in steps:
        if what == "free":
            unit, first, second, n = args
            fences = [fence_of(first)] + ([] if second is None else [fence_of(second)])
            if unit == "rows":
                rows = rows_led.take(n)
                if rows is None:
                    continue
                for extra in fences[1:]:
                    rows_led.record_use(rows, extra)
                rows_led.free(rows, fences[0])
            else:
                pages = pages_led.take(n)
                if pages is None:
                    continue
                pages_led.free(pages, fences)
        elif what == "tick":
            clock.now += args[0]
        elif what == "complete":
            source = args[0]
            if source == "event":
                if events:
                    events.pop(0).set()
            else:
                streams[source].complete(streams[source].done + 1)
            rows_led.reclaim()
            pages_led.reclaim()
        else:  # an agreement's marks: some deferral ids, pending or not
            for led in ledgers:
                led.agreed_overdue = {d for d in range(args[0]) if d % 3 == 0}
        for agreed in (False, True):
            got = overdue.scan(agreed=agreed)
            want = walk_every_batch(ledgers, clock.now, agreed=agreed)
            assert _same(got, want), (agreed, got, want)


def test_a_late_batch_behind_a_younger_one_in_its_queue_is_found() -> None:
    """In a stream's queue batches sit in record order, not age order: a free
    behind an old fence of the stream lands ahead of a younger batch, so the
    late batch need not be the queue's first or last."""
    clock = ManualClock()
    led = SlotLedger(8, clock=clock)
    overdue = OverdueFences(TIMEOUT, [led], clock=clock)
    stream = FakeStream()
    early, late = stream.record(), stream.record()
    rows = led.take(3)
    assert rows is not None
    led.free(rows[:1], late)  # t0 = 0, second in record order
    clock.now = 5.0
    led.free(rows[1:], early)  # t0 = 5, first in record order
    assert [b.t0 for b in led.batch_groups()[0]] == [5.0, 0.0]
    clock.now = TIMEOUT  # exactly the timeout after the first free
    found, due = overdue.scan()
    assert list(found.values()) == [(late, {"rows": 1})]
    assert due == 5.0
