"""Replicas driven by the same calls stay identical in explicit mode, whatever
their fences' timing; in auto mode they do not (the control).

Single process, fast: two (row pool, page pool) replicas, each on its own
FakeStream and its own transfer handles. Replica 0's fences complete as soon
as they are recorded, replica 1's lag several steps behind. The agreement is
simulated in-process with the ledgers' own agreement_flags/apply_agreement
(done by MIN, overdue and faulted by MAX, as the all-reduce computes);
tests/test_tp.py does it over gloo.

With ``faults=True`` a transfer also gets an outcome per replica: it may fail
(``query()`` raises) on one replica only while it completes, or never
completes, on the other; fail on both; or stick on one replica only (never
complete there), be agreed overdue (a fake clock, one unit per step) and be
force-released on both replicas at the same step. After every agreement the
replicas must match each other and the agreed rule: faulted anywhere ->
quarantined on both, else done everywhere -> released, else pending, and
agreed overdue once pending ``OVERDUE`` steps. The control for that rule:
reduced all by MIN (as before cc55e24), a transfer failed on one replica only
stays pending on both for ever (test_one_replica_fault_under_each_reduction),
and the driver's checks fail.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from helpers import FakeStream

from asyncpool import KVPagePool, ReqToTokenPool
from asyncpool.deferral import Deferrals

OVERDUE = 6.0  # overdue_after for the agreement, in steps of the fake clock


class Handle:
    """A transfer handle (no stream_key) the test completes by hand.

    ``outcome`` is what :meth:`finish` makes of it when the transfer ends on
    this replica: ``"ok"`` (query() answers True from then on), ``"fail"``
    (query() raises) or ``"stuck"`` (query() answers False for ever);
    ``"fail now"`` raises from the start (before any agreement sees it).
    """

    def __init__(self, outcome: str = "ok") -> None:
        self.outcome = outcome
        self.done = False
        self.failed = outcome == "fail now"

    def finish(self) -> None:
        if self.outcome == "ok":
            self.done = True
        elif self.outcome.startswith("fail"):
            self.failed = True

    def query(self) -> bool:
        if self.failed:
            raise RuntimeError("transfer failed")
        return self.done

    def synchronize(self) -> None:  # pragma: no cover - never waited for here
        raise AssertionError("not waited for in this test")


@dataclass
class Transfer:
    """One free behind a transfer on every replica: a handle each, the ids, when."""

    handles: list[Handle]
    rows: list[int]
    pages: list[list[int]]  # per replica
    t0: float

    def ids(self, r: int) -> tuple[list[int], list[int]]:
        return self.rows, self.pages[r]


def agree_in_process(
    replicas: list[list[Deferrals[Any]]], overdue_after: float | None = None, now: float = 0.0
) -> None:
    """What agreement.agree does across ranks, reduced in-process: per
    batch ``done`` by MIN, ``overdue`` and ``faulted`` by MAX."""
    views = [[led.pending_batches() for led in leds] for leds in replicas]
    shapes = {tuple(tuple(b.did for b in v) for v in view) for view in views}
    assert len(shapes) == 1, f"replicas hold different batches: {shapes}"
    caches: list[dict[int, Any]] = [{} for _ in replicas]
    flags = [
        [
            led.agreement_flags(b, cache, overdue_after, now)
            for led, b in zip(leds, view, strict=True)
        ]
        for leds, view, cache in zip(replicas, views, caches, strict=True)
    ]
    for j in range(len(replicas[0])):
        agreed = [
            (min if i % 3 == 0 else max)(col)
            for i, col in enumerate(zip(*(f[j] for f in flags), strict=True))
        ]
        for leds, view, cache in zip(replicas, views, caches, strict=True):
            leds[j].apply_agreement(view[j], agreed, cache)


def state(rows: ReqToTokenPool, kv: KVPagePool) -> tuple[Any, ...]:
    led, pled = rows._ledger, kv.ledger
    ring = [int(pled._ring[(pled._head + i) % pled.capacity]) for i in range(pled.free_count)]
    return (list(led._free), led.pending, ring, pled.pending)


def outcomes(rng: random.Random) -> list[str]:
    """What a new transfer does on each replica (``faults=True``)."""
    x = rng.random()
    if x < 0.16:
        pair = ["fail", "ok"]  # fails on one replica, completes (maybe later) on the other
    elif x < 0.22:
        pair = ["fail", "stuck"]  # fails on one, never completes on the other
    elif x < 0.26:
        pair = ["fail", "fail"]  # seen failed on one replica first (the other lags)
    elif x < 0.32:
        pair = ["fail now", "fail now"]  # seen failed on both at one agreement
    elif x < 0.46:
        pair = ["stuck", "ok"]  # sticks on one replica only
    else:
        pair = ["ok", "ok"]
    if rng.random() < 0.5:
        pair.reverse()
    return pair


def batch_of(led: Deferrals[Any], fence: object) -> Any:
    (batch,) = [b for b in led.pending_batches() if b.fence is fence]
    return batch


def check_agreed(
    pools: list[tuple[ReqToTokenPool, KVPagePool]],
    open_: list[Transfer],
    quarantined: list[Transfer],
    now: float,
    seen: Counter[str],
) -> None:
    """Just after an agreement: the replicas match each other and the agreed
    rule for every transfer still in ``open_``. Moves the ones it settled out
    of ``open_`` (into ``quarantined`` if they faulted on some replica)."""
    leds = [(rows._ledger, kv.ledger) for rows, kv in pools]
    for j in range(2):
        assert len({led[j].quarantined for led in leds}) == 1, "quarantined counts differ"
        assert len({led[j].pending for led in leds}) == 1, "pending counts differ"
        overdue = {frozenset(led[j].agreed_overdue) for led in leds}
        assert len(overdue) == 1, f"agreed-overdue deferral ids differ: {overdue}"
        seen["agreements with a batch agreed overdue"] += bool(leds[0][j].agreed_overdue)
    for rows, kv in pools:
        rows.check_invariants()
        kv.check_invariants()
    still: list[Transfer] = []
    for t in open_:
        failed = sum(h.failed for h in t.handles)
        done = all(h.done for h in t.handles)
        want = "quarantined" if failed else "free" if done else "pending"
        for r, (led, pled) in enumerate(leds):
            got = ({led.state_of(row) for row in t.rows}, {pled.state_of(p) for p in t.pages[r]})
            assert got == ({want}, {want}), (r, [h.outcome for h in t.handles], got, want)
            if want == "pending":
                late = now - t.t0 >= OVERDUE
                for ledger in (led, pled):
                    agreed = batch_of(ledger, t.handles[r]).did in ledger.agreed_overdue
                    assert agreed == late, (r, [h.outcome for h in t.handles], now - t.t0)
        if failed:
            quarantined.append(t)
            other = "done" if any(h.done for h in t.handles) else "pending"
            seen["failed on both" if failed == 2 else f"failed on one, {other} on the other"] += 1
        elif done:
            seen["released"] += 1
        else:
            still.append(t)
    open_[:] = still


def conserved(
    rows: ReqToTokenPool,
    kv: KVPagePool,
    held: list[tuple[list[int], list[int]]],
    open_: list[tuple[list[int], list[int]]],
    quarantined: list[tuple[list[int], list[int]]],
) -> None:
    """Every row and page is free, pending, quarantined or held, and the counts match."""
    ledgers: tuple[Any, Any] = (rows._ledger, kv.ledger)
    for j, led in enumerate(ledgers):
        by_state: dict[str, set[int]] = {}
        for i in range(1, led.capacity + 1):
            by_state.setdefault(led.state_of(i), set()).add(i)
        assert set(by_state) <= {"free", "pending", "quarantined", "allocated"}, by_state
        held_ids = {i for ids in held for i in ids[j]}
        assert by_state.get("allocated", set()) == held_ids
        assert by_state.get("quarantined", set()) == {i for ids in quarantined for i in ids[j]}
        assert {i for ids in open_ for i in ids[j]} <= by_state.get("pending", set())
        assert len(by_state.get("free", ())) == led.free_count
        assert len(by_state.get("pending", ())) == led.pending
        assert len(by_state.get("quarantined", ())) == led.quarantined
        assert led.free_count + led.pending + led.quarantined + len(held_ids) == led.capacity


def run(
    reclaim: str,
    seed: int,
    steps: int = 400,
    *,
    faults: bool = False,
    seen: Counter[str] | None = None,
) -> list[list[tuple[Any, ...]]]:
    """Drive two replicas with one seeded op sequence; return each one's grants."""
    rng = random.Random(seed)
    lag = (0, 3)  # replica r's fences complete `lag[r]` steps after they are recorded
    # Transfers that fail quarantine their rows for good: more of them with faults.
    rows_n, pages_n = (49, 193) if faults else (17, 65)
    pools = [
        (ReqToTokenPool(rows_n, 4, reclaim=reclaim), KVPagePool(pages_n, 4, reclaim=reclaim))
        for _ in lag
    ]
    clock = [0.0]  # a fake clock, one unit per step: when a batch was deferred

    def now() -> float:
        return clock[0]

    for rows, kv in pools:
        rows._ledger._clock = kv.ledger._clock = now
    streams = [FakeStream() for _ in lag]
    grants: list[list[tuple[Any, ...]]] = [[] for _ in lag]
    live: list[tuple[list[int], list[list[int]], int]] = []  # rows, pages per replica, transfer
    transfers: list[list[Handle]] = [[] for _ in lag]
    open_: list[Transfer] = []  # freed behind transfers, not yet released or quarantined
    quarantined: list[Transfer] = []
    seen = Counter() if seen is None else seen
    prev: list[Any] = [None for _ in lag]
    checked = 0  # grants compared so far (explicit mode)
    for step in range(steps):
        clock[0] = float(step)
        op = rng.random()
        if op < 0.45:
            n = rng.randint(1, 8)
            got = []
            for r, (rows, kv) in enumerate(pools):
                row = rows.alloc(1)
                pages = kv.alloc(n) if row is not None else None
                if row is not None and pages is None:
                    rows.free(row)
                got.append((row, None if pages is None else pages.tolist()))
                grants[r].append(("admit", step, got[-1]))
            if (
                all(g[0] is not None and g[1] is not None for g in got)
                and len({repr(g) for g in got}) == 1
            ):
                live.append((got[0][0], [g[1] for g in got], -1))
        elif op < 0.8 and live:
            rows_, pages_, _ = live.pop(rng.randrange(len(live)))
            behind_transfer = rng.random() < 0.4
            handles = [Handle(o) for o in (outcomes(rng) if faults else ["ok"] * len(lag))]
            for r, (rows, kv) in enumerate(pools):
                if behind_transfer:
                    h = handles[r]
                    transfers[r].append(h)
                    rows.free(rows_, fence=h)
                    kv.free(pages_[r], fence=h)
                else:
                    f = streams[r].record()
                    rows.record_use(rows_, f)
                    rows.free(rows_)
                    kv.free(pages_[r], fence=f)
            if behind_transfer:
                open_.append(Transfer(handles, rows_, pages_, clock[0]))
        elif faults and op > 0.9 and reclaim == "explicit":
            # The operator force-releases a transfer stuck on one replica, on
            # both replicas at the same step, once it was agreed overdue.
            stuck = [
                t
                for t in open_
                if sorted(h.outcome for h in t.handles) == ["ok", "stuck"]
                and clock[0] - 1 - t.t0 >= OVERDUE
            ]
            if stuck:
                t = stuck[rng.randrange(len(stuck))]
                leds: list[tuple[Any, Any]] = [(rows._ledger, kv.ledger) for rows, kv in pools]
                dids = [
                    [batch_of(led, h).did for led in pair]
                    for pair, h in zip(leds, t.handles, strict=True)
                ]
                for pair, ds in zip(leds, dids, strict=True):  # agreed overdue, on both
                    assert all(d in led.agreed_overdue for led, d in zip(pair, ds, strict=True))
                freed = [
                    (led.force_release(h), pled.force_release(h))
                    for (led, pled), h in zip(leds, t.handles, strict=True)
                ]
                assert freed == [(len(t.rows), len(t.pages[0]))] * len(lag), freed
                for r, (pair, ds) in enumerate(zip(leds, dids, strict=True)):  # and no longer
                    assert not any(d in led.agreed_overdue for led, d in zip(pair, ds, strict=True))
                    assert {pair[0].state_of(i) for i in t.rows} == {"free"}
                    assert {pair[1].state_of(p) for p in t.pages[r]} == {"free"}
                open_.remove(t)
                seen["force-released"] += 1
        # the stream and the transfers advance, at each replica's own pace
        for r, s in enumerate(streams):
            s.complete(max(0, s.seq - lag[r]))
            for h in transfers[r][: max(0, len(transfers[r]) - lag[r])]:
                h.finish()
        if reclaim == "explicit":
            for r, (rows, kv) in enumerate(pools):
                if prev[r] is not None:
                    # The scheduler processed that step: wait for it, retire it.
                    streams[r].complete(prev[r].seq)
                    rows.retire(prev[r])
                    kv.retire(prev[r])
            agree_in_process([[rows._ledger, kv.ledger] for rows, kv in pools], OVERDUE, clock[0])
            check_agreed(pools, open_, quarantined, clock[0], seen)
        for r in range(len(pools)):
            prev[r] = streams[r].record()
            grants[r].append(("state", step, state(*pools[r])))
        if reclaim == "explicit":  # this step's grants and state (earlier ones were checked)
            assert grants[0][checked:] == grants[1][checked:], f"replicas diverged at step {step}"
            checked = len(grants[0])
    for r, (rows, kv) in enumerate(pools):
        rows.check_invariants()
        kv.check_invariants()
        if reclaim == "explicit":
            conserved(
                rows,
                kv,
                [(rows_, pages_[r]) for rows_, pages_, _ in live],
                [t.ids(r) for t in open_],
                [t.ids(r) for t in quarantined],
            )
    return grants


@pytest.mark.parametrize("seed", range(5))
def test_explicit_replicas_grant_identically(seed: int) -> None:
    a, b = run("explicit", seed)
    assert a == b


@pytest.mark.parametrize("seed", range(5))
def test_explicit_replicas_agree_on_failed_and_stuck_transfers(seed: int) -> None:
    """Transfers that fail or stick on one replica only (or fail on both) are
    quarantined, agreed overdue and force-released identically on both."""
    seen: Counter[str] = Counter()
    a, b = run("explicit", seed, faults=True, seen=seen)
    assert a == b
    for what in (
        "failed on one, done on the other",
        "failed on one, pending on the other",
        "failed on both",
        "agreements with a batch agreed overdue",
        "force-released",
        "released",
    ):
        assert seen[what], (what, seen)


def test_auto_replicas_diverge() -> None:
    """The control: the same calls with reclaim="auto" give different grants."""
    diverged = 0
    for seed in range(5):
        a, b = run("auto", seed)
        diverged += a != b
    assert diverged == 5


@pytest.mark.parametrize(
    ("reduce", "held"), [((min, min, min), True), ((min, max, max), False)], ids=["min", "max"]
)
def test_one_replica_fault_under_each_reduction(reduce: tuple[Any, ...], held: bool) -> None:
    """The control for the rule: reduced all by MIN (before cc55e24), a
    transfer that failed on one replica only, done on the other, stays
    pending on both for ever, unreported; and one stuck on one replica only
    is never agreed overdue. Reduced as agree() does (overdue and faulted by
    MAX) the first is quarantined on both and the second agreed overdue."""
    pools = [
        (ReqToTokenPool(5, 4, reclaim="explicit"), KVPagePool(9, 4, reclaim="explicit"))
        for _ in range(2)
    ]
    failing = [Handle("fail"), Handle("ok")]
    stuck = [Handle("ok"), Handle("stuck")]
    for (rows, kv), f, s in zip(pools, failing, stuck, strict=True):
        rows._ledger._clock = kv.ledger._clock = lambda: 0.0  # deferred at time 0
        for h in (f, s):
            row = rows.alloc(1)
            assert row is not None
            rows.free(row, fence=h)
            kv.free(kv.alloc(2), fence=h)
            h.finish()
    for round_ in range(3):  # as many agreements as you like: MIN never settles it
        for j in range(2):
            leds: list[Deferrals[Any]] = [(rows._ledger, kv.ledger)[j] for rows, kv in pools]
            views = [led.pending_batches() for led in leds]
            caches: list[dict[int, Any]] = [{}, {}]
            flags = [
                led.agreement_flags(v, c, OVERDUE, OVERDUE)
                for led, v, c in zip(leds, views, caches, strict=True)
            ]
            # [done, overdue, faulted] of the failing, then the stuck batch
            # (not done where it failed: overdue there too); under MAX the
            # failing one is gone after the first agreement
            if held or round_ == 0:
                assert flags == [[0, 1, 1, 1, 0, 0], [1, 0, 0, 0, 1, 0]]
            else:
                assert flags == [[1, 0, 0], [0, 1, 0]]
            agreed = [reduce[i % 3](col) for i, col in enumerate(zip(*flags, strict=True))]
            for led, v, c in zip(leds, views, caches, strict=True):
                led.apply_agreement(v, agreed, c)
    for rows, kv in pools:
        rows.check_invariants()
        kv.check_invariants()
        for led, n in ((rows._ledger, 1), (kv.ledger, 2)):
            if held:  # both batches pending: the failure hidden, nothing overdue
                assert (led.pending, led.quarantined, led.agreed_overdue) == (2 * n, 0, set())
            else:  # the failed batch quarantined, the stuck one agreed overdue
                assert (led.pending, led.quarantined) == (n, n)
                assert led.agreed_overdue == {batch_of(led, led.pending_batches()[0].fence).did}
