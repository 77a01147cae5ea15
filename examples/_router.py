"""The router plumbing that two examples share; not an example itself.

``router_drain.py`` (decode replicas) and ``pd_router.py`` (prefill
replicas whose transfers may be in flight) both run docs/api.md's *A router
over data-parallel replicas*: replicas, each a scheduler on a thread and
event loop of its own with a pool of its own, under a router on the main
thread's loop. The router hands each request to the serving replica with
the most room; at every eighth of the run it drains a replica for a weight
update (it serves again after) or replaces it (its loop ends and a new
replica starts under its label), in turn; the requests a drain hands back
are routed again elsewhere.

:class:`Replica` is a replica's side of that: the inbox and its wake-up,
the router's commands, the thread and loop, the room the router reads, the
queued admissions and their hand-back at a drain. :class:`Router` is the
router's: the routing, the drains and replacements, the tally of what each
request went through, the replicas' ends. What differs stays in each
program: the scheduler (``Replica._serve``), the drain itself
(``Replica._drain``, which uses the pieces here), which replica is drained
(``Router.to_drain``), the collector, the transfers, what the run checks.

The examples import this module by name (``from _router import ...``), as
they do ``_engine``; the tests load it beside them (``tests/helpers.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from asyncpool import AsyncReqToTokenPool, Grant

from _engine import run_loop

UPDATE, REPLACE, STOP = "update", "replace", "stop"


class Routed(Protocol):
    """A request as the router tracks it."""

    id: int
    where: object  # "new", "router", the Replica that holds it, or "finished"
    routes: int  # times routed
    finishes: int  # times finished: 1 at the end of a clean run


@dataclass(eq=False)
class Figures:
    """What a replica counted; read by the router once its thread ended."""

    drains: int = 0  # for updates and replacements (not the run's last)
    dirty_drains: int = 0  # drains that left memory behind
    error: BaseException | None = None


Req = TypeVar("Req", bound=Routed)
Fig = TypeVar("Fig", bound=Figures)
Rep = TypeVar("Rep", bound="Replica[Any, Any]")


class Replica(Generic[Req, Fig]):
    """One replica: a scheduler on a thread and loop of its own.

    The router's side (its thread) reads :meth:`room`, calls :meth:`hand`
    and :meth:`command`, and reads ``serving`` (its own flag) and ``pool``
    (set once ``ready``). Everything else is the replica's own thread's:
    ``_serve`` builds the pool, passes it to :meth:`started`, and runs the
    scheduler, which queues what its inbox brings with :meth:`admit`, takes
    the grants with :meth:`granted`, a command with :meth:`obey` (which runs
    ``_drain``), and waits with :meth:`idle`. A subclass writes ``_serve``
    and ``_drain``.
    """

    def __init__(
        self,
        label: str,
        args: argparse.Namespace,
        router: Router[Req, Any, Fig],
        figures: Fig,
        per_request: int,
    ) -> None:
        self.label, self.args, self.router, self.figures = label, args, router, figures
        self.per_request = per_request  # pages of the largest request: room's unit
        self.inbox: collections.deque[Req] = collections.deque()  # the router appends
        self.serving = False  # the router's: routes to it only while True
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pool: AsyncReqToTokenPool | None = None
        self.admitting: dict[asyncio.Task[Grant], Req] = {}  # queued admissions
        self._command: tuple[str, Callable[[], None]] | None = None
        self._wake: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._main, name=f"replica-{label}", daemon=True)

    # -- the router's side (any thread) ----------------------------------

    def room(self) -> int:
        """The recipe's counts, read from the router's thread: the requests
        it could take now (rows and pages free or pending: pending ones are
        freed behind fences, soon free), less those queued or on their way."""
        pool = self.pool
        assert pool is not None and pool.kv is not None
        rows = pool.available_size() + pool.pending_size()
        pages = pool.kv.available_size() + pool.kv.pending_size()
        return min(rows, pages // self.per_request) - pool.waiting() - len(self.inbox)

    def hand(self, req: Req) -> None:
        self.inbox.append(req)
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._poke)

    def command(self, kind: str, done: Callable[[], None]) -> None:
        """Drain (then serve again after an update; else end): ``done`` runs
        on the router's loop when the drain is over."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._set_command, kind, done)

    # -- the replica's thread --------------------------------------------

    def _poke(self) -> None:
        assert self._wake is not None
        self._wake.set()

    def _set_command(self, kind: str, done: Callable[[], None]) -> None:
        self._command = (kind, done)
        self._poke()

    def _main(self) -> None:
        try:
            run_loop(self._run(), self.args.loop)
        except BaseException as exc:  # reported by the router, which exits 1
            self.figures.error = exc
            if not self.ready.done():
                self.ready.set_exception(exc)
            self.router.call(self.router.replica_failed, self)

    async def _run(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        await self._serve()

    async def _serve(self) -> None:
        """Build the pool, :meth:`started`, schedule until a command ends it."""
        raise NotImplementedError

    async def _drain(self, kind: str) -> None:
        """docs/api.md's drain of this replica (the router stopped routing
        here already), then the weight update or the end."""
        raise NotImplementedError

    def started(self, pool: AsyncReqToTokenPool) -> None:
        """The pool is this thread's and loop's from now on; the router may
        route here (call it once the scheduler's state is built)."""
        pool.bind()
        self.pool = pool
        self.ready.set_result(None)

    async def idle(self) -> None:
        """Wait for a request, a grant or a command, unless one is here."""
        assert self._wake is not None
        self._wake.clear()
        if self.inbox or self._command is not None or any(t.done() for t in self.admitting):
            return
        await self._wake.wait()

    def admit(self, req: Req, pages: int) -> None:
        """Queue ``req``'s admission (``pool.admit(pages=...)`` in a task of
        its own); :meth:`granted` hands it over once granted."""
        assert self.pool is not None
        task = asyncio.ensure_future(self.pool.admit(pages=pages))
        task.add_done_callback(lambda _: self._poke())
        self.admitting[task] = req

    def granted(self) -> list[tuple[Req, Grant]]:
        """The queued admissions granted since the last call."""
        return [(self.admitting.pop(t), t.result()) for t in list(self.admitting) if t.done()]

    async def obey(self) -> str | None:
        """The router's command, if one came: ``_drain``, then tell the
        router. Its kind (after ``UPDATE`` the replica serves on; after
        another it ends), or None."""
        if self._command is None:
            return None
        kind, done = self._command
        self._command = None
        await self._drain(kind)
        self.router.call(done)
        return kind

    def take_queued(self) -> tuple[list[asyncio.Task[Grant]], list[Req]]:
        """At a drain: the queued admissions' tasks, and every request not
        running yet (queued, or still in the inbox); both emptied."""
        tasks = list(self.admitting)
        queued = [self.admitting[t] for t in tasks] + list(self.inbox)
        self.admitting.clear()
        self.inbox.clear()
        return tasks, queued

    async def hand_back_admissions(self, tasks: list[asyncio.Task[Grant]]) -> None:
        """Cancel the queued admissions and await them: one granted at
        hand-over whose task had not resumed gives its row and pages back;
        one that already returned its grant gives them back here, at once
        (nothing ran on them)."""
        assert self.pool is not None
        for task in tasks:
            task.cancel()
        async with asyncio.timeout(10):
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, Grant):
                self.pool.free(outcome.row)


class Router(Generic[Req, Rep, Fig]):
    """The main thread's loop: routes requests, drains and replaces replicas.

    A subclass makes its replicas (:meth:`new_replica`) and picks the one
    to drain (:meth:`to_drain`); the replicas report through :meth:`call`
    (:meth:`finished`, :meth:`requeue`, :meth:`replica_failed`).
    """

    def __init__(
        self, args: argparse.Namespace, loop: asyncio.AbstractEventLoop, requests: list[Req]
    ) -> None:
        self.args, self.loop, self.requests = args, loop, requests
        self.queue: collections.deque[Req] = collections.deque()  # handed back
        self.spawned = self.finished_count = self.requeued = self.routes = 0
        self.ends: collections.Counter[str] = collections.Counter()  # how requests finished
        self.changed = asyncio.Event()
        self.replicas: list[Rep] = []
        self.retired: list[Fig] = []  # the figures of the replicas that ended
        self.updates = self.replacements = 0
        self.failures: list[str] = []

    def call(self, fn: Callable[..., None], *args: Any) -> None:
        """From a replica's thread: run ``fn(*args)`` on the router's loop."""
        self.loop.call_soon_threadsafe(fn, *args)

    # -- called on the router's loop ---------------------------------------

    def finished(self, replica: Rep, req: Req, how: str = "finished") -> None:
        if req.where is not replica:
            self.failures.append(f"request {req.id} finished on {replica.label} unexpectedly")
        req.finishes += 1
        req.where = "finished"
        self.finished_count += 1
        self.ends[how] += 1
        self.changed.set()

    def requeue(self, replica: Rep, reqs: list[Req]) -> None:
        for req in reqs:
            if req.where is not replica:
                self.failures.append(f"request {req.id} handed back by {replica.label}")
            req.where = "router"
            self.queue.append(req)
        self.requeued += len(reqs)
        self.changed.set()

    def replica_failed(self, replica: Rep) -> None:
        self.failures.append(f"replica {replica.label}: {replica.figures.error!r}")
        self.changed.set()

    # -- the router's work --------------------------------------------------

    def new_replica(self, label: str) -> Rep:
        raise NotImplementedError

    def to_drain(self) -> int:
        """The index of the replica to drain next."""
        raise NotImplementedError

    async def start(self, label: str) -> Rep:
        replica = self.new_replica(label)
        replica.thread.start()
        async with asyncio.timeout(10):
            await asyncio.wrap_future(replica.ready)
        replica.serving = True
        return replica

    def pick(self) -> Rep | None:
        """The serving replica with the most room (the first of equals)."""
        serving = [r for r in self.replicas if r.serving]
        return max(serving, key=lambda r: r.room()) if serving else None

    def route(self, req: Req, replica: Rep) -> None:
        if req.where not in ("new", "router"):
            self.failures.append(f"request {req.id} routed again while held")
        req.where = replica
        req.routes += 1
        self.routes += 1
        replica.hand(req)

    async def stop_replica(self, replica: Rep, kind: str) -> None:
        """Drain ``replica`` (it serves again after an update; else it ends)."""
        replica.serving = False  # stop routing to it first
        drained: asyncio.Future[None] = self.loop.create_future()

        def done() -> None:
            if not drained.done():
                drained.set_result(None)

        replica.command(kind, done)
        async with asyncio.timeout(20):
            await drained
        if kind == UPDATE:
            replica.serving = True
            return
        async with asyncio.timeout(10):
            await asyncio.to_thread(replica.thread.join)
        self.retired.append(replica.figures)

    async def cycle(self, index: int, kind: str) -> None:
        """A weight update of ``replicas[index]``, or its replacement."""
        replica = self.replicas[index]
        await self.stop_replica(replica, kind)
        if kind == REPLACE:
            self.replicas[index] = await self.start(replica.label)
            self.replacements += 1
        else:
            self.updates += 1
        self.changed.set()

    async def run(self) -> None:
        args = self.args
        cap = 2 * args.rows * args.replicas  # requests out at once: admissions queue
        for i in range(args.replicas):
            self.replicas.append(await self.start(f"r{i}"))
        events = 0  # drains and replacements started
        cycling: asyncio.Task[None] | None = None
        while self.finished_count < len(self.requests):
            if self.failures:
                raise RuntimeError(self.failures[0])
            self.changed.clear()
            due = (events + 1) * len(self.requests) // 8
            if events < 7 and self.finished_count >= due and (cycling is None or cycling.done()):
                if cycling is not None:
                    await cycling  # (its errors)
                kind = UPDATE if events % 2 == 0 else REPLACE
                cycling = asyncio.ensure_future(self.cycle(self.to_drain(), kind))
                events += 1
            while self.queue or (
                self.spawned < len(self.requests) and self.spawned - self.finished_count < cap
            ):
                replica = self.pick()
                if replica is None:
                    break  # (every replica draining: routed when one serves)
                if self.queue:
                    req = self.queue.popleft()
                else:
                    req = self.requests[self.spawned]
                    self.spawned += 1
                self.route(req, replica)
            await self.changed.wait()
        if cycling is not None:
            await cycling
        for replica in self.replicas:
            await self.stop_replica(replica, STOP)

    async def run_bounded(self, seconds: float = 60) -> None:
        """:meth:`run` within ``seconds``; whatever its end, :meth:`shutdown`.
        An exception of it (its timeout included) is recorded in
        ``failures``, so the program reports it and exits 1."""
        try:
            async with asyncio.timeout(seconds):
                await self.run()
        except Exception as exc:
            self.failures.append(f"the router: {exc!r}")
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """After :meth:`run`, whatever its end: the threads still running
        (on an error) are told to stop and joined."""
        for replica in self.replicas:
            if replica.thread.is_alive():
                if replica.loop is not None:
                    try:
                        replica.command(STOP, lambda: None)
                    except RuntimeError:
                        pass  # its loop closed meanwhile: the thread is ending
                replica.thread.join(10)

    def figures(self) -> list[Fig]:
        """Every replica's figures, the ended ones' and the serving ones'."""
        ended = {id(f) for f in self.retired}
        return self.retired + [r.figures for r in self.replicas if id(r.figures) not in ended]
