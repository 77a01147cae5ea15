"""Replicas driven by the same calls stay identical in explicit mode, whatever
their fences' timing; in auto mode they do not (the control).

Single process, fast: two (row pool, page pool) replicas, each on its own
FakeStream and its own transfer handles. Replica 0's fences complete as soon
as they are recorded, replica 1's lag several steps behind. The agreement is
simulated in-process with the ledgers' own agreement_flags/apply_agreement
(the MIN the all-reduce computes); tests/test_tp.py does it over gloo.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from helpers import FakeStream

from asyncpool import KVPagePool, ReqToTokenPool
from asyncpool.deferral import Deferrals


class Handle:
    """A transfer handle (no stream_key) the test completes by hand."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:  # pragma: no cover - never waited for here
        raise AssertionError("not waited for in this test")


def agree_in_process(replicas: list[list[Deferrals[Any]]]) -> None:
    """What agreement.agree does across ranks, reduced in-process: per
    batch ``done`` by MIN, ``overdue`` and ``faulted`` by MAX."""
    views = [[led.pending_batches() for led in leds] for leds in replicas]
    shapes = {tuple(len(v) for v in view) for view in views}
    assert len(shapes) == 1, f"replicas hold different batches: {shapes}"
    caches: list[dict[int, Any]] = [{} for _ in replicas]
    flags = [
        [led.agreement_flags(b, cache, None, 0.0) for led, b in zip(leds, view, strict=True)]
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


def run(reclaim: str, seed: int, steps: int = 400) -> list[list[tuple[Any, ...]]]:
    """Drive two replicas with one seeded op sequence; return each one's grants."""
    rng = random.Random(seed)
    lag = (0, 3)  # replica r's fences complete `lag[r]` steps after they are recorded
    pools = [(ReqToTokenPool(17, 4, reclaim=reclaim), KVPagePool(65, 4, reclaim=reclaim))
             for _ in lag]
    streams = [FakeStream() for _ in lag]
    grants: list[list[tuple[Any, ...]]] = [[] for _ in lag]
    live: list[tuple[list[int], list[list[int]], int]] = []  # rows, pages per replica, transfer
    transfers: list[list[Handle]] = [[] for _ in lag]
    prev: list[Any] = [None for _ in lag]
    for step in range(steps):
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
            if all(g[0] is not None and g[1] is not None for g in got) and len(
                {repr(g) for g in got}
            ) == 1:
                live.append((got[0][0], [g[1] for g in got], -1))
        elif op < 0.8 and live:
            rows_, pages_, _ = live.pop(rng.randrange(len(live)))
            behind_transfer = rng.random() < 0.4
            for r, (rows, kv) in enumerate(pools):
                if behind_transfer:
                    h = Handle()
                    transfers[r].append(h)
                    rows.free(rows_, fence=h)
                    kv.free(pages_[r], fence=h)
                else:
                    f = streams[r].record()
                    rows.record_use(rows_, f)
                    rows.free(rows_)
                    kv.free(pages_[r], fence=f)
        # the stream and the transfers advance, at each replica's own pace
        for r, s in enumerate(streams):
            s.complete(max(0, s.seq - lag[r]))
            for h in transfers[r][: max(0, len(transfers[r]) - lag[r])]:
                h.done = True
        if reclaim == "explicit":
            for r, (rows, kv) in enumerate(pools):
                if prev[r] is not None:
                    # The scheduler processed that step: wait for it, retire it.
                    streams[r].complete(prev[r].seq)
                    rows.retire(prev[r])
                    kv.retire(prev[r])
            agree_in_process([[rows._ledger, kv.ledger] for rows, kv in pools])
        for r in range(len(pools)):
            prev[r] = streams[r].record()
            grants[r].append(("state", step, state(*pools[r])))
    for rows, kv in pools:
        rows.check_invariants()
        kv.check_invariants()
    return grants


@pytest.mark.parametrize("seed", range(5))
def test_explicit_replicas_grant_identically(seed: int) -> None:
    a, b = run("explicit", seed)
    assert a == b


def test_auto_replicas_diverge() -> None:
    """The control: the same calls with reclaim="auto" give different grants."""
    diverged = 0
    for seed in range(5):
        a, b = run("auto", seed)
        diverged += a != b
    assert diverged == 5
