"""The pool across process boundaries: fork, spawn's pickling, copies.

The rule (:mod:`asyncpool.forks`): build the pool, and its streams, in the
process that uses it, after the fork. A pool built before ``os.fork()``
refuses every checked call in the child with :class:`WrongProcessError`
(a :class:`WrongThreadError`) instead of hanging on a fence nobody watches
or handing rows to waiters of the parent's loop; a :class:`HostStream` made
before refuses new work there, and its fences still pending fault instead
of never completing; a fence watcher starts new threads at its next watch
and no lock a parent thread held at the fork stays held. Pickling or
copying a pool, a page pool, a stream or a host fence is a ``TypeError``
that names the rule. The parent is untouched throughout.

Each child runs a function that answers a verdict string through a pipe
and leaves with ``os._exit``; the parent waits a bounded time, kills a
child that hangs and fails with "hung": a hang is a finding, not a stuck
suite. Forking a process with threads warns on 3.12+ (a
``DeprecationWarning``, an error under the suite's ``-W error``): the
forks here are what the test is about, so that warning is silenced around
them only.
"""

from __future__ import annotations

import asyncio
import copy
import multiprocessing
import os
import pickle
import select
import threading
import traceback
import warnings
from collections.abc import Callable

import pytest
from helpers import WAIT_S, EventFence

from asyncpool import (
    AsyncReqToTokenPool,
    FenceError,
    HostStream,
    KVPagePool,
    ReqToTokenPool,
    WrongProcessError,
    WrongThreadError,
    wait_fence,
)
from asyncpool.fence_wait import _LoopWaits
from asyncpool.watcher import FenceWatcher

CHILD_S = 20.0  # bound on a child's whole run (2 busy cores: generous)


def _fork() -> int:
    with warnings.catch_warnings():
        # 3.12+: "This process is multi-threaded, use of fork() may lead to
        # deadlocks in the child" -- exactly what these tests look at.
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def in_child(fn: Callable[[], str], timeout: float = CHILD_S) -> str:
    """Run ``fn`` in a forked child; its verdict, or ``"hung"`` / the error."""
    r, w = os.pipe()
    pid = _fork()
    if pid == 0:  # the child: never return into pytest
        code = 0
        try:
            os.close(r)
            try:
                verdict = fn()
            except BaseException as exc:
                verdict = "raised " + "".join(traceback.format_exception_only(exc)).strip()
            os.write(w, verdict.encode()[:60000])
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], timeout)
        if not ready:
            os.kill(pid, 9)
            return "hung"
        chunks = []
        while chunk := os.read(r, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode()
    finally:
        os.close(r)
        os.waitpid(pid, 0)


def refused(call: Callable[[], object]) -> str:
    """``"refused"`` if ``call()`` raises WrongProcessError (a WrongThreadError
    naming the rule), else what happened."""
    try:
        result = call()
    except WrongProcessError as exc:
        if isinstance(exc, WrongThreadError) and "after the fork" in str(exc):
            return "refused"
        return f"unclear: {exc}"
    except BaseException as exc:
        return f"raised {type(exc).__name__}: {exc}"
    return f"answered {result!r}"


def run_child_loop(coro_fn: Callable[[], object]) -> str:
    """In the child: run ``coro_fn()`` on a new (stock asyncio) loop, bounded."""

    async def main() -> object:
        async with asyncio.timeout(WAIT_S):
            return await coro_fn()  # type: ignore[misc]

    try:
        return f"answered {asyncio.run(main(), debug=False)!r}"
    except WrongProcessError:
        return "refused"
    except TimeoutError:
        return "timed out"


async def test_a_pool_used_before_the_fork_refuses_in_the_child() -> None:
    # Bound, a fence of unknown origin pending (the poller runs), a waiter
    # queued, then a fork from inside the running loop: every call in the
    # child is refused, none hangs, none grants the parent's waiter; the
    # counts still read the child's copy. The parent goes on as before.
    pool = AsyncReqToTokenPool(8, 16, "cpu")
    fence = EventFence()
    held = await pool.alloc(4)
    pool.free(held[:2], fence=fence)
    waiter = asyncio.create_task(pool.alloc(6))
    await asyncio.sleep(0)
    assert pool.waiting() == 1

    def child() -> str:
        fence.set()  # the child's copy completes: nobody there may use it
        checks = {
            "try_alloc": refused(lambda: pool.try_alloc(1)),
            "free": refused(lambda: pool.free(held[2])),
            "free_list": refused(lambda: pool.free([held[3]])),
            "reclaim": refused(pool.reclaim),
            "bind": refused(pool.bind),
            "alloc_threadsafe": refused(lambda: pool.alloc_threadsafe(1)),
            "check_invariants": refused(pool.check_invariants),
            "alloc": run_child_loop(lambda: pool.alloc(1)),
            "alloc_more": run_child_loop(lambda: pool.alloc(6)),
            "close": run_child_loop(pool.close),
        }
        checks["available"] = str(pool.available_size())
        return repr(checks)

    verdict = in_child(child)
    assert verdict == repr(
        {
            "try_alloc": "refused",
            "free": "refused",
            "free_list": "refused",
            "reclaim": "refused",
            "bind": "refused",
            "alloc_threadsafe": "refused",
            "check_invariants": "refused",
            "alloc": "refused",
            "alloc_more": "refused",
            "close": "refused",
            "available": "3",
        }
    ), verdict
    # The parent's pool: its fence completes, its waiter is granted.
    pool.free(held[2:])
    fence.set()
    async with asyncio.timeout(WAIT_S):
        rows = await waiter
    assert len(rows) == 6
    pool.free(rows)
    pool.check_invariants()
    await pool.close()


async def test_the_unchecked_fast_paths_refuse_in_the_child_too() -> None:
    # Forked while the two unchecked paths are open (bound, nobody queued,
    # not in debug mode): they skip the thread check, so the child must
    # find them closed, not take a row unchecked.
    pool = AsyncReqToTokenPool(8, 16, "cpu")
    held = await pool.alloc(1)
    pool.free(await pool.alloc(1))
    if not asyncio.get_running_loop().get_debug():
        assert pool._fast  # open at the fork: what this test is about

    def child() -> str:
        return "; ".join(
            [run_child_loop(lambda: pool.alloc(1)), refused(lambda: pool.free(held[0]))]
        )

    assert in_child(child) == "refused; refused"
    pool.free(held)
    pool.check_invariants()


def test_an_unbound_pool_built_before_the_fork_refuses_too() -> None:
    # Built (and warmed outside any loop) in the parent, never bound: the
    # rule is where it was built, not whether a thread started yet. The
    # child builds its own, after the fork, and that one serves.
    pool = AsyncReqToTokenPool(4, 16, "cpu")
    pool.free(pool.try_alloc(1) or [])

    def child() -> str:
        old = refused(lambda: pool.try_alloc(1))
        fresh = AsyncReqToTokenPool(4, 16, "cpu")

        async def use() -> list[int]:
            with HostStream("child") as stream:
                rows = await fresh.alloc(3)
                stream.launch(lambda: None)
                fresh.free(rows, after=stream)
                return await fresh.alloc(3)

        return f"{old}; {run_child_loop(use)}"

    assert in_child(child) == "refused; answered [1, 2, 3]"
    assert sorted(pool.try_alloc(3) or []) == [1, 2, 3]  # the parent's is untouched


def test_a_page_pool_of_a_pool_refuses_in_the_child() -> None:
    kv = KVPagePool(16, 4, "cpu")
    pool = AsyncReqToTokenPool(4, 16, "cpu", kv=kv)
    grant = asyncio.run(pool.admit(pages=3))

    def child() -> str:
        return "; ".join(
            [
                refused(lambda: kv.alloc(1)),
                refused(lambda: kv.free(grant.pages)),
                refused(lambda: pool.try_admit(pages=1)),
            ]
        )

    assert in_child(child) == "refused; refused; refused"
    pool.free([grant.row])
    pool.check_invariants()


def test_a_host_stream_made_before_the_fork_refuses_and_its_pending_fences_fault() -> None:
    gate = threading.Event()
    stream = HostStream("fwd")
    try:
        stream.launch(gate.wait, WAIT_S)  # the worker is busy at the fork
        pending = stream.record()

        def child() -> str:
            try:
                waited = f"wait answered {pending.wait(WAIT_S)}"
            except FenceError as exc:
                waited = "faulted" if "forked child" in str(exc.__cause__) else f"? {exc}"
            answers = [waited]
            for name, call in [
                ("launch", lambda: stream.launch(print)),
                ("record", stream.record),
                ("synchronize", stream.synchronize),
            ]:
                try:
                    call()
                    answers.append(f"{name} answered")
                except RuntimeError as exc:
                    ok = "forked child" in str(exc) and "after the fork" in str(exc)
                    answers.append(f"{name} refused" if ok else f"{name}: {exc}")
            stream.close()  # returns: there is no worker to join
            return "; ".join(answers)

        assert in_child(child) == ("faulted; launch refused; record refused; synchronize refused")
        gate.set()  # the parent's stream and fence are untouched
        assert pending.wait(WAIT_S) is True
        stream.synchronize()
    finally:
        gate.set()
        stream.close()


def _hold(lock: threading.Lock) -> tuple[threading.Event, threading.Thread]:
    """A thread that holds ``lock`` until the event is set (as a worker or
    a poller may at the moment another thread forks)."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait(WAIT_S * 4)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert taken.wait(WAIT_S)
    return release, thread


def test_a_stream_lock_held_by_a_parent_thread_at_the_fork_does_not_deadlock() -> None:
    stream = HostStream("held")
    release, thread = _hold(stream._lock)
    try:

        def child() -> str:
            try:
                stream.record()
            except RuntimeError as exc:
                return "refused" if "forked child" in str(exc) else str(exc)
            return "recorded"

        assert in_child(child) == "refused"
    finally:
        release.set()
        thread.join(WAIT_S)
        stream.close()


def test_a_watcher_forked_with_its_poller_running_starts_a_new_one() -> None:
    # The poller watches a fence that never completes in the parent; in the
    # child it does not exist: without a new one, a fence watched there is
    # never asked, and a lock the poller held stays held.
    notified = threading.Event()
    watcher = FenceWatcher(notified.set, name="test-fork-watcher")
    stuck = EventFence()
    watcher.watch(stuck)
    assert watcher.running
    release, thread = _hold(watcher._lock)
    try:

        def child() -> str:
            release.set()  # the child's copy of the event: the lock stays held
            done = EventFence()
            done.set()
            watcher.watch(done)
            answer = "notified" if notified.wait(WAIT_S) else "never notified"
            watcher.stop()
            return f"{answer}, joined {watcher.join(WAIT_S)}"

        assert in_child(child) == "notified, joined True"
    finally:
        release.set()
        thread.join(WAIT_S)
        watcher.stop()
        assert watcher.join(WAIT_S)
    assert not notified.is_set()  # the parent's fence never completed


def test_wait_fence_in_a_child_forked_while_the_registry_lock_was_held() -> None:
    release, thread = _hold(_LoopWaits._registry_lock)
    try:

        def child() -> str:
            fence = EventFence()
            threading.Timer(0.05, fence.set).start()
            return run_child_loop(lambda: wait_fence(fence))

        assert in_child(child) == "answered None"
    finally:
        release.set()
        thread.join(WAIT_S)


def _report_try_alloc(
    pool: AsyncReqToTokenPool, conn: multiprocessing.connection.Connection
) -> None:
    # multiprocessing's "fork" start method: a target that uses a pool built
    # in the parent (an engine that built it before starting its workers).
    try:
        pool.try_alloc(1)
        conn.send("answered")
    except WrongProcessError:
        conn.send("refused")
    finally:
        conn.close()


def test_multiprocessing_fork_start_method_refuses_a_pool_built_before() -> None:
    ctx = multiprocessing.get_context("fork")
    pool = AsyncReqToTokenPool(4, 16, "cpu")
    parent_end, child_end = ctx.Pipe(duplex=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        proc = ctx.Process(target=_report_try_alloc, args=(pool, child_end))
        proc.start()
    try:
        child_end.close()
        assert parent_end.poll(CHILD_S), "the child sent no verdict"
        assert parent_end.recv() == "refused"
    finally:
        proc.join(CHILD_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
        parent_end.close()
    assert proc.exitcode == 0
    assert pool.try_alloc(1) == [1]


@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy"])
def test_pickle_and_copy_of_a_live_object_say_the_rule(how: str) -> None:
    kv = KVPagePool(16, 4, "cpu")
    with HostStream("pickled") as stream:
        fence = stream.record()
    objects: list[tuple[str, object]] = [
        ("AsyncReqToTokenPool", AsyncReqToTokenPool(4, 16, "cpu")),
        ("AsyncReqToTokenPool", AsyncReqToTokenPool(4, 16, "cpu", kv=kv)),
        ("KVPagePool", kv),
        ("KVPagePool", KVPagePool(8, 4, "cpu")),
        ("ReqToTokenPool", ReqToTokenPool(4, 16, "cpu")),
        ("HostStream", stream),
        ("HostFence", fence),
    ]
    op: Callable[[object], object] = {
        "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
        "copy": copy.copy,
        "deepcopy": copy.deepcopy,
    }[how]
    for name, obj in objects:
        with pytest.raises(TypeError, match=f"^{name} cannot be pickled or copied") as info:
            op(obj)
        assert "in the process that uses it" in str(info.value)


def test_values_still_pickle_and_copy() -> None:
    kv = KVPagePool(16, 4, "cpu")
    pool = AsyncReqToTokenPool(4, 16, "cpu", kv=kv)
    grant = asyncio.run(pool.admit(pages=2))
    stats = pool.stats()
    for op in (lambda v: pickle.loads(pickle.dumps(v)), copy.copy, copy.deepcopy):
        row, pages = op(grant)
        assert row == grant.row and pages.tolist() == grant.pages.tolist()
        assert op(stats) == stats


def test_a_grandchild_names_the_process_that_built_the_pool() -> None:
    pool = AsyncReqToTokenPool(4, 16, "cpu")
    stream = HostStream("built-here")
    builder = os.getpid()

    def grandchild() -> str:
        answers = []
        for call in (lambda: pool.try_alloc(1), stream.record):
            try:
                call()
                answers.append("answered")
            except RuntimeError as exc:  # WrongProcessError is one too
                answers.append("builder" if f"process {builder} " in str(exc) else str(exc))
        return "; ".join(answers)

    try:
        assert in_child(lambda: in_child(grandchild)) == "builder; builder"
    finally:
        stream.close()
