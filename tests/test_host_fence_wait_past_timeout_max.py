"""``HostFence.wait(timeout)`` with a timeout past what a thread can wait
(``inf``, ``1e300``, a huge int) waits for ever, as ``None`` does: before,
``threading.Event.wait`` raised ``OverflowError`` ("timestamp out of range
for platform time_t") at once, although the fence was still open and the
call is documented as :meth:`synchronize` with a timeout."""

from __future__ import annotations

import threading

import pytest
from helpers import WAIT_S

from asyncpool import HostStream


@pytest.mark.parametrize("timeout", [float("inf"), 1e300, 10**30], ids=repr)
def test_a_timeout_past_timeout_max_waits_until_the_fence_completes(timeout: object) -> None:
    gate = threading.Event()
    result: list[object] = []
    with HostStream() as stream:
        try:
            stream.launch(gate.wait)
            fence = stream.record()

            def waiter() -> None:
                try:
                    result.append(fence.wait(timeout))  # type: ignore[arg-type]
                except BaseException as exc:
                    result.append(exc)

            thread = threading.Thread(target=waiter, daemon=True)
            thread.start()
            thread.join(0.05)
            assert result == []  # still waiting: the fence is open
        finally:
            gate.set()  # the stream closes whatever happened
        thread.join(WAIT_S)
    assert result == [True]


def test_a_finite_timeout_still_runs_out() -> None:
    gate = threading.Event()
    with HostStream() as stream:
        stream.launch(gate.wait)
        fence = stream.record()
        assert fence.wait(0.01) is False
        gate.set()
        assert fence.wait(WAIT_S) is True
