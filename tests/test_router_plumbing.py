"""examples/_router.py's own rules, apart from the two programs that use it
(tests/test_examples.py runs those whole)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from typing import Any

import pytest
from helpers import load_example


class _LoopClosingMeanwhile:
    """A replica's loop that is still open when asked, and closed by the
    time a callback is handed to it: the window between ``is_closed()`` and
    ``call_soon_threadsafe`` that a replica ending on its own can hit. The
    replica's thread ends as the loop closes."""

    def __init__(self, ending: threading.Event) -> None:
        self.ending = ending
        self.calls = 0

    def is_closed(self) -> bool:
        return False

    def call_soon_threadsafe(self, *args: Any) -> None:
        self.calls += 1
        self.ending.set()
        raise RuntimeError("Event loop is closed")


def test_shutdown_survives_a_replica_loop_that_closes_as_it_is_told_to_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    load_example("pd_router", monkeypatch)
    plumbing = sys.modules["_router"]  # the copy pd_router imported
    router = plumbing.Router(argparse.Namespace(), asyncio.new_event_loop(), [])
    try:
        replica = plumbing.Replica("r0", argparse.Namespace(), router, plumbing.Figures(), 1)
        ending = threading.Event()
        replica.thread = threading.Thread(target=ending.wait, args=(10,), name="replica-r0")
        replica.thread.start()
        replica.loop = loop = _LoopClosingMeanwhile(ending)
        router.replicas.append(replica)
        router.shutdown()  # raised RuntimeError before: the check, then the call
        assert loop.calls == 1
        assert not replica.thread.is_alive()
    finally:
        router.loop.close()


@pytest.mark.parametrize("how", ["raises", "times out"])
async def test_run_bounded_records_the_routers_error_and_shuts_down(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_example("router_drain", monkeypatch)
    plumbing = sys.modules["_router"]
    shut: list[int] = []

    class Failing(plumbing.Router):  # type: ignore[misc,name-defined]
        async def run(self) -> None:
            if how == "raises":
                raise ValueError("lost")
            await asyncio.Event().wait()  # never set: the bound ends it

        def shutdown(self) -> None:
            shut.append(1)

    router = Failing(argparse.Namespace(), asyncio.get_running_loop(), [])
    async with asyncio.timeout(10):
        await router.run_bounded(0.05)
    expected = "ValueError('lost')" if how == "raises" else "TimeoutError()"
    assert router.failures == [f"the router: {expected}"]
    assert shut == [1]
