"""Prompt KV arriving by transfer, as on a disaggregated decode engine.

A prefill engine elsewhere computed the prompt's KV; the decode engine (this
demo) admits the request with its pages and the KV lands in them later. A
transfer takes about ``transfer_ms``: a quarter of it a fixed latency, the
rest in proportion to its KV (``transfer_ms / 4`` plus ``3/4 * transfer_ms``
times its prompt's length over the workload's mean; so a short prompt's
transfer can overtake a long one started earlier, as transfers from several
prefill peers do). When it is
due, its write runs on the transfer stream (a second :class:`HostStream`, a
second ``torch.cuda.Stream`` with ``--device cuda``): ``kv[slot] = value``
for every prompt token, straight into the pages, as an RDMA write does.

The handle, :class:`Transfer`, is the transfer's fence: ``query()`` /
``synchronize()`` answer "has it landed?", so the scheduler joins the
request to the batch once it has, and an abort frees the request's pages
behind it (``pool.free(rows, fence=transfer)``). To the pool it is a fence
of unknown origin. Freed without it (``--unsafe``), the pages go to new
owners while the write is still on its way, and it lands in their KV.

Thread rules: :class:`TransferEngine` is driven from the event loop's
thread; a :class:`Transfer`'s ``query``/``synchronize``/``add_done_callback``
are thread-safe (the pool's watcher thread synchronizes it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from asyncpool import HostStream, record_fence

__all__ = ["Transfer", "TransferEngine"]

logger = logging.getLogger(__name__)


class Transfer:
    """One prompt's KV on its way; a fence that completes when it has landed."""

    __slots__ = (
        "_callbacks",
        "_fence",
        "_launched",
        "_lock",
        "due",
        "duration_s",
        "held",
        "is_due",
        "rid",
        "slots",
        "timer",
        "values",
    )

    def __init__(self, rid: int, slots: torch.Tensor, values: torch.Tensor, duration_s: float):
        self.rid = rid
        self.slots = slots
        self.values = values
        self.duration_s = duration_s
        self.due = 0.0
        self.is_due = False
        self.held = False
        self.timer: asyncio.TimerHandle | None = None
        self._fence: Any = None
        self._launched = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], object]] | None = []

    def __repr__(self) -> str:
        state = "landed" if self.query() else "launched" if self.launched else "in flight"
        return f"<Transfer rid={self.rid} {state}>"

    @property
    def launched(self) -> bool:
        """Its write has been queued on the transfer stream."""
        return self._launched.is_set()

    def query(self) -> bool:
        """True once the KV has landed; never blocks; raises if the stream faulted."""
        fence = self._fence
        return fence is not None and bool(fence.query())

    def synchronize(self) -> None:
        """Block until the KV has landed."""
        self._launched.wait()
        self._fence.synchronize()

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once landed: on the stream's thread, or now if it has."""
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn()

    def _land(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            try:
                fn()
            except Exception:  # pragma: no cover - callbacks are ours and tiny
                logger.exception("transfer done-callback %r raised", fn)

    def _set_fence(self, fence: Any) -> None:
        self._fence = fence
        self._launched.set()


class TransferEngine:
    """Starts transfers, lands them when due on the transfer stream."""

    def __init__(self, device: str, transfer_ms: float, mean_tokens: float) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.base_s = transfer_ms / 4e3
        self.per_token_s = transfer_ms * 0.75e-3 / max(mean_tokens, 1.0)
        self.stream: Any
        if self.is_cuda:
            self.stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        else:
            self.stream = HostStream("transfer")
            self.stream.launch(torch.set_num_threads, 1)
        self.kv: torch.Tensor | None = None
        self._live: set[Transfer] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.started = 0

    def attach(self, kv: torch.Tensor) -> None:
        self.kv = kv

    def duration(self, tokens: int) -> float:
        return self.base_s + self.per_token_s * tokens

    def start(self, rid: int, slots: torch.Tensor, values: torch.Tensor) -> Transfer:
        """Start moving ``values`` into KV ``slots``; it lands after its duration."""
        loop = self._loop = asyncio.get_running_loop()
        t = Transfer(rid, slots, values, self.duration(slots.numel()))
        t.due = loop.time() + t.duration_s
        t.timer = loop.call_at(t.due, self._due, t)
        self._live.add(t)
        self.started += 1
        return t

    def hold(self, t: Transfer) -> bool:
        """Keep ``t`` from landing until :meth:`release`; False if it already launched."""
        if t.launched:
            return False
        t.held = True
        return True

    def release(self, t: Transfer) -> None:
        """Let a held transfer land (at once, if it is already due)."""
        t.held = False
        if t.is_due and not t.launched:
            self._launch(t)

    def _due(self, t: Transfer) -> None:
        t.timer = None
        t.is_due = True
        if not t.held:
            self._launch(t)

    def _launch(self, t: Transfer) -> None:
        kv = self.kv
        assert kv is not None
        self._live.discard(t)
        if self.is_cuda:
            with torch.cuda.stream(self.stream):
                slots = t.slots.pin_memory().to(self.device, non_blocking=True)
                values = t.values.pin_memory().to(self.device, non_blocking=True)
                kv.index_put_((slots,), values)
            fence = record_fence(self.stream)
            t._set_fence(fence)
            loop = self._loop
            assert loop is not None
            fut = loop.run_in_executor(None, fence.synchronize)
            fut.add_done_callback(lambda _f: t._land())
            return
        self.stream.launch(kv.index_put_, (t.slots,), t.values)
        fence = self.stream.record()
        t._set_fence(fence)
        fence.add_done_callback(t._land)

    def flush(self) -> None:
        """Land every transfer not landed yet, now (on the way out: nothing may
        stay in flight once the run ends)."""
        for t in list(self._live):
            if t.timer is not None:
                t.timer.cancel()
                t.timer = None
            t.is_due = True
            self.release(t)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        if self.is_cuda:
            self.stream.synchronize()
        else:
            self.stream.close()
