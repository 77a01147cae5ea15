"""Bad input found by a trial: each case gets a clear, typed error naming the
value and the rule, and leaves the pool (or stream) exactly as it was.

Pins: ``HostStream.launch``/``wait`` refuse what is not callable; 0-d meta
tensors and raising ``__index__`` give the typed error of any bad row id,
count or page id; unsigned slot tensors in ``set_req_pool_info``; ``after=``
objects that are not streams; the meta device, oversized sizes, unparsable
devices and a non-bool ``enable_memory_saver`` in the constructors; empty
float/bool tensors as rows or pages; mappings as rows; ``priority=`` and
``max_waiters=`` of any integer type but bool; the strict ``query()`` answer
rule of ``is_done``; and ``force_release``'s log line.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
from helpers import WAIT_S

from asyncpool import HostStream


# ---------------------------------------------------------------- 1. HostStream


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda s: s.launch(None), id="launch-None"),
        pytest.param(lambda s: s.launch(42, 1), id="launch-int"),
        pytest.param(lambda s: s.wait(5), id="wait-int"),
        pytest.param(
            lambda s: s.wait(types.SimpleNamespace(synchronize=3)), id="wait-non-callable"
        ),
    ],
)
def test_stream_refuses_what_it_cannot_call(call: Any) -> None:
    with HostStream() as stream:
        before = (stream._queued, stream._done, stream._seq)
        with pytest.raises(TypeError, match=r"callable.*got (None|42|5|namespace)"):
            call(stream)
        assert (stream._queued, stream._done, stream._seq) == before
        # Not faulted: later work runs and later fences complete.
        ran: list[int] = []
        stream.launch(ran.append, 1)
        fence = stream.record()
        assert fence.wait(WAIT_S)
        assert stream.error is None and ran == [1]
