"""The re-entrancy fuzz of tests/test_reentrant_fuzz.py on an explicit pool.

``reclaim="explicit"`` (one scheduler replica per tensor-parallel rank): the
pool never asks a fence on its own. Memory behind fences returns only by
``retire(fence)`` (an ordered fence: everything of its stream up to it, in
record order, never asking ``query()``), by ``agree(group)`` (the call
that asks every pending fence's ``query()``; here on a single-rank gloo
group), by ``force_release`` and by ``drain`` (it asks the first pending
fence, and settles what waits behind it while they answer done; here with
``timeout=0``); ``forget_stream`` drops a stream's retired mark, refused
while a batch waits for a fence of it or an allocated row carries a use of
it not retired. So here the fences' ``query()`` calls the pool back from
inside ``agree`` and ``drain`` only, and every call is made there: frees,
admits, growths, ``retire``, ``force_release``, ``forget_stream``, ``agree``
itself (nested two deep, as the auto fuzz nests).

The model (``_Fuzz``, with the steps ``retire``, ``agree``,
``forget_stream`` and ``drain`` added) keeps, beside the auto fuzz's checks, what the
ledgers hold pending: for each row and page, the fences it still waits for,
head first, as the ledgers keep them (the order among one free's fences is
taken from the pool, once the set is checked: the newest of each stream and
every fence of unknown origin the free named, less those retired). It
predicts every change: a retire passes the heads of that stream up to the
fence, then every retired fence after them; a ``force_release`` drops its
fence, and passes it as a head; an ``agree`` releases what waited only for
fences complete or retired when it began; a ``drain`` settles, as their
head, only fences that are complete (which ones, in what order, is the
pool's choice: the model learns it from the row ledger's ``conclude``).
It cannot tell, and so reads from the ledgers (checking the rule only),
what a ``query()`` made meanwhile: a row or page freed during the
agreement (a free behind the one fence of a batch it covers joins that
batch), and one whose remaining fences were retired or forced there (the
agreement asked them before, or after). After
every call, made from a ``query()`` or not, the pending rows and pages and
what each waits for must be as the model says; a ``forget_stream`` must be
refused exactly when the model says. The rule: nothing is handed out while
a fence it waits for is neither complete (as ``agree`` saw it) nor retired
nor forced. The auto fuzz's leases, ``hold_grants`` and ``reclaim()`` (which
returns 0 on an explicit pool) run here too; a lease's exit, which frees its
rows from the lease's task between steps, is checked as a step's free is.
Its fence faults are left out (the auto fuzz makes them).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import HOW, WAIT_S, bounded, eager_tasks, start_task
from test_reentrant_fuzz import SEEDS, _Broken, _Fence, _Fuzz

from asyncpool import AsyncReqToTokenPool

Unit = tuple[str, Any]  # ("row", row) or ("page", (KV group, page id))


def _key(fence: _Fence) -> int | None:
    return getattr(fence, "stream_key", None)


class _Wait:
    """What one pending row or page waits for, head first (an object per
    free: an agreement tells by identity what waited when it began)."""

    __slots__ = ("fences",)

    def __init__(self, fences: list[_Fence]) -> None:
        self.fences = fences


class _ExplicitFuzz(_Fuzz):
    AFTER_CLOSE = (*_Fuzz.AFTER_CLOSE, "retire", "agree", "forget_stream", "drain")

    def __init__(self, seed: int, how: str, grouped: bool, group: Any) -> None:
        super().__init__(seed, how, grouped, reclaim="explicit")
        self.group = group
        self.marks: dict[int, int] = {}  # stream key -> the seq retired up to
        self.waits: dict[Unit, _Wait] = {}  # pending in the ledgers, and on what
        self.ordered: list[_Fence] = []  # every fence made on a stream
        self.agreeing: list[list[_Wait]] = []  # per agree under way: waits made meanwhile
        # drain() settles a fence by the ledgers' conclude(): which one, its own choice.
        led = self.pool._ledger
        conclude = led.conclude

        def concluding(fence: Any, error: BaseException | None) -> int:
            self.concluding(fence, error)
            return conclude(fence, error)

        led.conclude = concluding  # type: ignore[method-assign]

    def _fault(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        """Not here: a fault that ``agree`` meets quarantines what the model
        would have to predict batch by batch (the auto fuzz covers faults)."""

    def more_calls(self, inner: bool) -> list[str]:
        if inner:
            return ["retire", "agree", "forget_stream"]
        return ["retire", "retire", "agree", "agree", "forget_stream", "drain"]

    def new_fence(self) -> _Fence:
        fence = super().new_fence()
        if _key(fence) is not None:
            self.ordered.append(fence)
        return fence

    def covered(self, fence: _Fence) -> bool:
        """Whether a retire covers ``fence`` (its stream's mark)."""
        key = _key(fence)
        return key is not None and key in self.marks and fence.seq <= self.marks[key]

    def satisfied(self, fence: _Fence) -> bool:
        return fence.done or self.covered(fence)

    # ------------------------------------------------------------ the ledgers

    def pending(self) -> dict[Unit, list[Any]]:
        """What the ledgers hold pending: each row and page, with the fences
        its batch waits for, head first."""
        out: dict[Unit, list[Any]] = {}
        for batch in self.pool._ledger.pending_batches():
            for row in batch.items:
                out["row", row] = [batch.fence, *batch.rest]
        for group, kv in self.kvs.items():
            for batch in kv.ledger.pending_batches():
                fences = [batch.fence, *batch.rest]
                for part in batch.items:
                    for page in np.asarray(part).reshape(-1).tolist():
                        out["page", (group, page)] = fences
        return out

    def compare(self) -> None:
        pending = self.pending()
        if set(pending) != set(self.waits):
            raise self.broken(
                f"pending {sorted(map(str, pending))}, the model says "
                f"{sorted(map(str, self.waits))}"
            )
        for unit, wait in self.waits.items():
            got = pending[unit]
            same = len(got) == len(wait.fences)
            if not same or any(a is not b for a, b in zip(got, wait.fences, strict=True)):
                raise self.broken(f"{unit} waits for {got}, the model says {wait.fences}")

    def prune_covered(self) -> None:
        """The hand-out rule: a retired fence is waited for no more."""
        for waiting in (self.behind, self.pages_behind):
            for fences in waiting.values():
                fences[:] = [f for f in fences if not self.covered(f)]

    def walk(self, unit: Unit, fences: list[_Fence]) -> bool:
        """``unit``'s head passed: pass every retired fence after it (the
        ledger's walk); drop it if none is left. True if released."""
        while fences and self.covered(fences[0]):
            del fences[0]
        if fences:
            return False
        del self.waits[unit]
        return True

    # ------------------------------------------------------------ frees

    def lists(self) -> dict[Unit, list[_Fence]]:
        return {
            **{("row", r): fences for r, fences in self.behind.items()},
            **{("page", p): fences for p, fences in self.pages_behind.items()},
        }

    def adopting(self, call: Callable[[], None]) -> None:
        """Make ``call`` (a free of some kind, which asks nothing here), then
        check what it deferred: each unit it freed waits for the newest
        fence of each stream and every fence of unknown origin it named,
        less the retired ones (none left: free at once)."""
        before = self.lists()
        call()
        self.adopt(before)

    def exit_mark(self) -> Any:
        return self.lists()

    def exited(self, mark: Any) -> None:
        """A lease's exit freed its rows: checked as :meth:`adopting` checks
        a step's free."""
        self.adopt(mark)
        self.compare()

    def adopt(self, before: dict[Unit, list[_Fence]]) -> None:
        fresh = [(u, fences) for u, fences in self.lists().items() if before.get(u) is not fences]
        if not fresh:
            return
        pending = self.pending()
        for unit, fences in fresh:
            newest: dict[Any, _Fence] = {}
            for f in fences:
                key = _key(f)
                if key is None:
                    newest[id(f)] = f
                elif key not in newest or newest[key].seq < f.seq:
                    newest[key] = f
            expect = {id(f) for f in newest.values() if not self.covered(f)}
            if unit in self.waits:
                raise self.broken(f"{unit} freed while the model has it pending")
            got = pending.get(unit)
            if not expect:
                if got is not None:
                    raise self.broken(f"{unit} pending behind {got}: every fence retired")
                continue
            if got is None or {id(f) for f in got} != expect or len(got) != len(expect):
                raise self.broken(f"{unit} pending behind {got}, the model says {newest}")
            wait = self.waits[unit] = _Wait(list(got))
            if self.agreeing:
                self.agreeing[-1].append(wait)
        self.prune_covered()

    def _free(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        self.adopting(lambda: _Fuzz._free(self, rng, pool))

    def _kv_free(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        self.adopting(lambda: _Fuzz._kv_free(self, rng, pool))

    def _give_back(self, rng: random.Random, pool: AsyncReqToTokenPool, trim: bool) -> None:
        self.adopting(lambda: _Fuzz._give_back(self, rng, pool, trim))

    # ------------------------------------------------------------ the explicit calls

    def count_released(self, units: list[Unit]) -> tuple[int, int]:
        rows = sum(1 for kind, _ in units if kind == "row")
        return rows, len(units) - rows

    def _retire(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        if not self.ordered:
            return
        fence = rng.choice(self.ordered)
        released = self.retired(fence)
        got = pool.retire(fence)
        if got != self.count_released(released):
            raise self.broken(f"retire made {got} free, the model {released}")

    def retired(self, fence: _Fence) -> list[Unit]:
        """The model of a retire of ``fence``: what it releases."""
        key, seq = fence.stream_key, fence.seq
        self.marks[key] = max(self.marks.get(key, seq), seq)
        released: list[Unit] = []
        for unit, wait in list(self.waits.items()):
            head = wait.fences[0]
            if _key(head) == key and head.seq <= seq:
                del wait.fences[0]
                if self.walk(unit, wait.fences):
                    released.append(unit)
        self.prune_covered()
        return released

    def _drain(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        """``drain(timeout=0)``: it asks the first pending fence and settles
        what waits behind it (as a retire, for an ordered one) while they
        answer done, and times out at the first that does not. By hand, a
        task that runs at the step's end (``asyncio.timeout`` needs one)."""

        async def drain() -> None:
            with contextlib.suppress(TimeoutError):
                await pool.drain(timeout=0)

        if self.how == "eager":
            self.tasks.append(start_task(drain(), self.how))
        else:
            self.tasks.append(asyncio.ensure_future(drain()))

    def concluding(self, fence: _Fence, error: BaseException | None) -> None:
        """The row ledger's ``conclude``, as ``drain`` calls it (then each
        page ledger's): ``fence`` answered done; what waits behind it, as
        its head, settles."""
        if error is not None or not fence.done:
            raise self.broken(f"drain settled behind {fence!r}, not done ({error!r})")
        self.log.append("drain settled a fence")
        if _key(fence) is not None:
            self.retired(fence)
            return
        for unit, wait in list(self.waits.items()):
            if wait.fences[0] is fence:
                del wait.fences[0]
                self.walk(unit, wait.fences)

    def _force(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        forced = len(self.force_log)
        super()._force(rng, pool)  # asks nothing here: no call made meanwhile
        if len(self.force_log) == forced:
            return
        fence = self.force_log[-1]
        for unit, wait in list(self.waits.items()):
            head, *rest = wait.fences
            rest = [f for f in rest if f is not fence]
            if head is fence:
                wait.fences[:] = rest
                self.walk(unit, wait.fences)
            else:
                wait.fences[:] = [head, *rest]

    def _agree(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        start = dict(self.waits)
        settled = {u for u, w in start.items() if all(map(self.satisfied, w.fences))}
        made: list[_Wait] = []
        self.agreeing.append(made)
        try:
            got = pool.agree(self.group)
        finally:
            self.agreeing.pop()
        if self.agreeing:  # the agreement under way may still find them
            self.agreeing[-1].extend(made)
        during = {id(w) for w in made}
        released: list[Unit] = []
        unsure: list[Unit] = []
        for unit, wait in list(self.waits.items()):
            if start.get(unit) is wait and unit in settled:
                del self.waits[unit]
                released.append(unit)
            elif all(map(self.satisfied, wait.fences)) and (
                start.get(unit) is wait or id(wait) in during
            ):
                unsure.append(unit)  # as it was asked, before a query() or after
        if unsure:
            pending = self.pending()
            gone = [u for u in unsure if u not in pending]
            for unit in gone:
                del self.waits[unit]
            released += gone
            self.log.append(f"agree: {len(gone)} of {len(unsure)} unsure released")
        if got != self.count_released(released):
            raise self.broken(f"agree made {got} free, the model {released}")

    def _forget_stream(self, rng: random.Random, pool: AsyncReqToTokenPool) -> None:
        key = rng.choice(self.streams)
        waiting = [u for u, w in self.waits.items() if any(_key(f) == key for f in w.fences)]
        using = [
            row
            for row, uses in self.held.items()
            if any(_key(f) == key and not self.covered(f) for f in uses)
        ]
        try:
            got = pool.forget_stream(key)
        except RuntimeError as exc:
            if waiting or using:
                self.log.append("forget_stream refused")
                return
            raise self.broken(f"forget_stream refused, nothing waits: {exc}") from exc
        if waiting or using:
            raise self.broken(f"forget_stream served: {waiting} wait, {using} use the stream")
        if got != (key in self.marks):
            raise self.broken(f"forget_stream answered {got}, marks {self.marks}")
        self.marks.pop(key, None)
        for uses in self.held.values():  # every one retired: they went with the mark
            uses[:] = [f for f in uses if _key(f) != key]

    # ------------------------------------------------------------ steps

    def step(self, inner: bool) -> None:
        super().step(inner)
        self.compare()

    def call_back(self) -> None:
        """The auto fuzz's, with the model's pending rows and pages put back
        too where the call was refused (which no hold calls for here: the
        explicit pool asks nothing while it holds)."""
        saved = ([(u, w, list(w.fences)) for u, w in self.waits.items()], dict(self.marks))
        super().call_back()
        if self.log[-1].startswith("refused"):  # this call's (a deeper one's ends in ")")
            waits, self.marks = saved
            self.waits = {}
            for unit, wait, fences in waits:
                wait.fences = fences
                self.waits[unit] = wait
        self.log.append(")")


@pytest.mark.parametrize("grouped", [False, True], ids=["one kv", "kv groups"])
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("seed", SEEDS)
async def test_explicit_pool_with_fences_that_call_back_loses_and_doubles_nothing(
    seed: int, how: str, grouped: bool, group: Any
) -> None:
    async with bounded(4 * WAIT_S):
        fuzz = _ExplicitFuzz(seed, how, grouped, group)
        failure = None
        with eager_tasks(how):
            try:
                await fuzz.run()
            except _Broken as exc:
                failure = str(fuzz.failure or exc)  # the first
        if failure is not None:
            # The model's words, without the traceback: on 3.11.7 pytest failed
            # formatting some of this fuzz's tracebacks (a SystemError from its
            # ast.parse, "AST constructor recursion depth mismatch"). A _Broken
            # raised in a query() that agree() asked is taken for the fence
            # faulting (any BaseException but an interrupt is): the fuzz goes
            # on to the step's end, where the first failure is kept.
            pytest.fail(failure, pytrace=False)
