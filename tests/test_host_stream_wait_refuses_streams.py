"""``HostStream.wait`` takes a fence, never a stream (as every ``fence=`` does).

A stream passed to ``wait`` used to be accepted (it has ``synchronize()``):
the waiting stream then ran ``other.synchronize()`` when the wait came up,
which waits until ``other`` is idle *then*, not for the work queued on it at
the call; ``s.wait(s)`` stopped ``s`` for ever (its worker waited for
itself) and two streams waiting for each other deadlocked. A copy stream of
a two-tier KV cache that waits for the forward is the natural place to
write ``copy.wait(forward)``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from asyncpool import HostStream, record_fence
from tests.helpers import WAIT_S


class TorchLikeStream:
    """A device stream as torch's stream API shapes it (query, synchronize,
    wait_stream, record_event), without a device."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait_stream(self, other: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> None:
        return None


def _state(stream: HostStream) -> tuple[int, int, int]:
    return (stream._queued, stream._done, stream._seq)


@pytest.mark.parametrize("which", ["itself", "another", "torch-like", "torch.Stream"])
def test_wait_refuses_a_stream_and_queues_nothing(which: str) -> None:
    with HostStream(name="copy") as copy, HostStream(name="fwd") as fwd:
        other: Any = {
            "itself": copy,
            "another": fwd,
            "torch-like": TorchLikeStream(),
            "torch.Stream": torch.Stream(device="cpu"),
        }[which]
        before = _state(copy)
        with pytest.raises(TypeError, match=r"a stream, not a fence.*record_fence\(stream\)"):
            copy.wait(other)
        assert _state(copy) == before
        # Not faulted and not stuck: later work runs and its fence completes.
        ran: list[int] = []
        copy.launch(ran.append, 1)
        assert copy.record().wait(WAIT_S)
        assert copy.error is None and ran == [1]


def test_wait_for_a_recorded_fence_orders_the_streams() -> None:
    gate = threading.Event()
    order: list[str] = []
    with HostStream(name="copy") as copy, HostStream(name="fwd") as fwd:
        fwd.launch(gate.wait, WAIT_S)
        fwd.launch(order.append, "fwd")
        copy.wait(record_fence(fwd))
        copy.launch(order.append, "copy")
        done = copy.record()
        assert not done.wait(0.05)  # held behind the forward's work
        gate.set()
        assert done.wait(WAIT_S)
        assert order == ["fwd", "copy"]
