"""The model's forward step, run on a stream as a real engine's forward is.

On CPU the stream is an :class:`asyncpool.HostStream`: one worker thread that
runs launched work in order. A step there does real torch compute (a matmul
whose size follows the batch's token count, calibrated to ``forward_ms`` +
``forward_us_per_token`` per token; torch releases the GIL, so it truly
overlaps the scheduler) and then writes the batch's rows of the pool's tables,
as a forward's kernels do:

* the write positions come from the *device* ``verified_lens[row]`` (where
  this request's KV continues), so a stale length shifts every later write;
* ``req_to_token[row, pos:pos+k] = new slots``; ``verified_lens[row] += k``;
* ``kv[req_to_token[row, pos]] = value(request, pos)`` for each token whose
  KV the step computes, through the row, as attention kernels write K/V;
* finally it reads back ``verified_lens[rows]``, every entry of every row of
  the batch, and the KV at every slot those requests own (the step's
  "outputs", copied back as an engine copies its sampled tokens back), for the
  scheduler to verify.

With ``--device cuda`` the same ops run on a ``torch.cuda.Stream``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import asyncpool
from asyncpool import HostStream, record_fence

from .hybrid import SwaStep

__all__ = ["Forward", "Step", "wait_fence"]

logger = logging.getLogger(__name__)

# Seconds per matmul row, per (device, hidden size): measured once per process.
_calibrations: dict[tuple[str, int], float] = {}

# How long a gated step waits for the scheduler before it gives up and runs
# anyway (only reached if the scheduler died without opening its gates).
_GATE_TIMEOUT_S = 30.0


class Step:
    """One batch: host-built inputs, the fence, and (once done) the outputs.

    ``entries`` holds, per row of the batch and in the same order,
    ``(request, epoch, expected_len)`` for the scheduler's bookkeeping. The
    host arrays (numpy, int64) describe what the step writes and what it reads
    back for verification:

    * ``row_idx``, ``offs``, ``slots``: per new ``req_to_token`` entry, its row,
      its offset past the row's device ``verified_lens`` and the KV slot it
      lists; ``n_new`` entries per row;
    * ``kv_idx``, ``kv_vals``: which of those entries get a KV value written
      (through the row: ``kv[req_to_token[row, col]] = value``), and the value;
    * ``v_rows``, ``v_cols``, ``v_slots``, ``v_vals``: every token of every
      request of the batch, with the slot its row must list and the value its
      KV slot must hold once the step has run.

    ``swa`` (a hybrid model, :mod:`scheduler_demo.hybrid`): the KV the step
    writes in the sliding-window group and the window it reads back there
    (``out_swa``); None without one.
    """

    __slots__ = (
        "entries",
        "exp_lens",
        "fence",
        "gate",
        "inputs",
        "kv_idx",
        "kv_tokens",
        "kv_vals",
        "n_new",
        "offs",
        "out_kv",
        "out_lens",
        "out_row",
        "out_swa",
        "row_idx",
        "rows",
        "slots",
        "step_id",
        "swa",
        "tokens",
        "v_cols",
        "v_rows",
        "v_slots",
        "v_vals",
    )

    def __init__(
        self,
        step_id: int,
        entries: list[tuple[Any, int, int]],
        rows: list[int],
        n_new: list[int],
        row_idx: np.ndarray,
        offs: np.ndarray,
        slots: np.ndarray,
        kv_idx: np.ndarray,
        kv_vals: np.ndarray,
        verify: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        gate: threading.Event | None = None,
        swa: SwaStep | None = None,
    ) -> None:
        self.step_id = step_id
        self.entries = entries
        self.rows = rows
        self.n_new = n_new
        self.exp_lens = [e[2] for e in entries]
        self.row_idx = row_idx
        self.offs = offs
        self.slots = slots
        self.tokens = len(offs)
        self.kv_idx = kv_idx
        self.kv_vals = kv_vals
        self.kv_tokens = len(kv_idx)
        self.v_rows, self.v_cols, self.v_slots, self.v_vals = verify
        self.gate = gate
        self.swa = swa
        self.out_swa: torch.Tensor | None = None
        self.fence: Any = None
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.out_lens: torch.Tensor | None = None
        self.out_row: torch.Tensor | None = None
        self.out_kv: torch.Tensor | None = None

    def open_gate(self) -> None:
        if self.gate is not None:
            self.gate.set()


class Forward:
    """Owns the forward stream and launches steps on it."""

    def __init__(
        self,
        device: str = "cpu",
        forward_ms: float = 2.5,
        forward_us_per_token: float = 3.0,
    ) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.base_s = forward_ms / 1e3
        self.per_token_s = forward_us_per_token / 1e6
        self.stream: Any
        if self.is_cuda:
            self.stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
            hidden, max_rows = 4096, 16384
        else:
            self.stream = HostStream("forward")
            # One intra-op thread on the worker: the scheduler owns the other
            # core. (The OpenMP thread count is per thread, so set it there.)
            self.stream.launch(torch.set_num_threads, 1)
            hidden, max_rows = 256, 4096
        # The values do not matter, only that they are ordinary floats.
        self._x = torch.randn(max_rows, hidden, device=self.device)
        self._w = torch.randn(hidden, hidden, device=self.device) / hidden**0.5
        self._y = torch.empty(max_rows, hidden, device=self.device)
        self._s_per_row = 0.0
        self.req_to_token: torch.Tensor | None = None
        self.verified_lens: torch.Tensor | None = None
        self.kv: torch.Tensor | None = None
        self._max_col = 0
        self._ncols = 0
        self._busy_s = 0.0  # time spent in steps (the worker's; CUDA: folded events)
        # CUDA: a timing event pair around each step not yet folded into _busy_s.
        self._step_events: list[tuple[Any, Any]] = []
        # Set when the run is given up (--timeout): the steps still queued or
        # running skip the rest of their matmuls, so closing the stream does
        # not wait out steps nobody will read.
        self._abandoned = threading.Event()

    # -- setup ---------------------------------------------------------------

    def attach(
        self, req_to_token: torch.Tensor, verified_lens: torch.Tensor, kv: torch.Tensor
    ) -> None:
        """Point the forward at the pool's tables and the KV tensor."""
        self.req_to_token = req_to_token
        self.verified_lens = verified_lens
        self.kv = kv
        self._max_col = req_to_token.shape[1] - 1
        self._ncols = req_to_token.shape[1]

    def calibrate(self) -> float:
        """Measure the matmul's seconds per row on the stream; blocks ~0.05 s.

        Once per process and device: every run in a process (the compare
        tool's overlap, sync and unsafe runs) then does exactly the same
        compute per token, whatever the machine was doing at the time.
        """
        key = (str(self.device), self._w.shape[0])
        cached = _calibrations.get(key)
        if cached is not None:
            self._s_per_row = cached
            return cached
        rows = min(1024, self._x.shape[0])
        result: list[float] = []

        def measure() -> None:
            sync = torch.cuda.current_stream(self.device).synchronize if self.is_cuda else None
            for _ in range(3):
                torch.mm(self._x[:rows], self._w, out=self._y[:rows])
            # The best of many short rounds: the speed of an unloaded core (a
            # busy neighbour during calibration would otherwise shrink every
            # step of the run).
            best = float("inf")
            for _ in range(16):
                if sync is not None:
                    sync()
                t0 = time.perf_counter()
                for _ in range(2):
                    torch.mm(self._x[:rows], self._w, out=self._y[:rows])
                if sync is not None:
                    sync()
                best = min(best, (time.perf_counter() - t0) / (2 * rows))
            result.append(best)

        if self.is_cuda:
            with torch.cuda.stream(self.stream):
                measure()
        else:
            self.stream.launch(measure)
            self.stream.synchronize()
        self._s_per_row = _calibrations[key] = max(result[0], 1e-12)
        logger.debug("forward matmul: %.3f us per row", self._s_per_row * 1e6)
        return self._s_per_row

    def step_seconds(self, tokens: int) -> float:
        """The forward time a step of ``tokens`` tokens is sized to."""
        return self.base_s + self.per_token_s * tokens

    # -- launching -----------------------------------------------------------

    @property
    def busy_s(self) -> float:
        """Seconds the forward stream has spent in steps so far.

        On the host stream, the worker's wall time inside steps; on CUDA, the
        sum of each step's timing events (read after the stream has synchronized,
        so call it between runs, not per step).
        """
        if not self.is_cuda:
            return self._busy_s
        if self._step_events:
            self._step_events[-1][1].synchronize()
        self._fold_step_events()
        return self._busy_s

    def _fold_step_events(self) -> None:
        """Add the steps whose timing events have completed to ``_busy_s``
        (they complete in order, on one stream): the list stays short."""
        events = self._step_events
        done = 0
        while done < len(events) and events[done][1].query():
            start, end = events[done]
            self._busy_s += start.elapsed_time(end) / 1e3
            done += 1
        del events[:done]

    def launch(self, step: Step) -> Any:
        """Queue ``step`` on the stream; return the fence recorded right after it."""
        if self.is_cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            with torch.cuda.stream(self.stream):
                step.inputs = self._inputs(step)
                start.record(self.stream)
                self._run(step)
                end.record(self.stream)
            self._step_events.append((start, end))
            if len(self._step_events) > 64:
                self._fold_step_events()
        else:
            step.inputs = self._inputs(step)
            self.stream.launch(self._run_timed, step)
        step.fence = record_fence(self.stream)
        return step.fence

    def _inputs(self, step: Step) -> tuple[torch.Tensor, ...]:
        i64 = torch.int64
        host: tuple[torch.Tensor, ...] = (
            torch.tensor(step.rows, dtype=i64),
            torch.tensor(step.n_new, dtype=torch.int32),
            torch.from_numpy(step.row_idx),
            torch.from_numpy(step.offs),
            torch.from_numpy(step.slots.astype(np.int32)),
            torch.from_numpy(step.kv_idx),
            torch.from_numpy(step.kv_vals),
            torch.from_numpy(step.v_rows * self._ncols + step.v_cols),
            torch.from_numpy(step.v_slots),
        )
        if step.swa is not None:
            w_slots, w_vals, v_slots, _, _ = step.swa
            host += tuple(torch.from_numpy(a) for a in (w_slots, w_vals, v_slots))
        if not self.is_cuda:
            return host
        # Pinned and non-blocking: a pageable copy would synchronize the
        # stream and serialize the overlap. The caching host allocator keeps
        # each pinned buffer alive until its copy has run.
        return tuple(t.pin_memory().to(self.device, non_blocking=True) for t in host)

    def _run_timed(self, step: Step) -> None:
        t0 = time.perf_counter()
        self._run(step)
        self._busy_s += time.perf_counter() - t0

    def _run(self, step: Step) -> None:
        # 1. The model: compute sized by the tokens whose KV the step computes.
        self._compute(self.step_seconds(step.kv_tokens))
        if step.gate is not None:
            if self.is_cuda:
                raise RuntimeError("gate is only supported on the host stream")
            if not step.gate.wait(_GATE_TIMEOUT_S):
                logger.error("step %d: gate not opened in %ss", step.step_id, _GATE_TIMEOUT_S)
        # 2. The table writes of the batch's rows, positions from the device.
        r2t, vl, kv = self.req_to_token, self.verified_lens, self.kv
        assert r2t is not None and vl is not None and kv is not None
        rows, n_new, row_idx, offs, slots, kv_idx, kv_vals, v_flat, v_slots = step.inputs[:9]
        pos = vl.index_select(0, rows)
        cols = pos.repeat_interleave(n_new, output_size=step.tokens) + offs
        cols.clamp_(max=self._max_col)  # a corrupted length must not fault the stream
        r2t.index_put_((row_idx, cols), slots)
        vl.index_add_(0, rows, n_new)
        # 3. The new tokens' KV, through the row (as attention kernels write K/V).
        kv_slots = r2t[row_idx[kv_idx], cols[kv_idx]].long()
        kv.index_put_((kv_slots,), kv_vals)
        if step.swa is not None:  # the sliding-window layers' KV, in their own pages
            swa_w_slots, swa_w_vals, swa_v_slots = step.inputs[9:]
            kv.index_put_((swa_w_slots,), swa_w_vals)
            out_swa = kv.index_select(0, swa_v_slots)
            step.out_swa = _to_host(out_swa) if self.is_cuda else out_swa
        # 4. The outputs the host verifies: every token of every request.
        out_lens = vl.index_select(0, rows)
        out_row = r2t.view(-1).index_select(0, v_flat)
        out_kv = kv.index_select(0, v_slots)
        if self.is_cuda:
            step.out_lens = _to_host(out_lens)
            step.out_row = _to_host(out_row)
            step.out_kv = _to_host(out_kv)
        else:
            step.out_lens, step.out_row, step.out_kv = out_lens, out_row, out_kv

    def abandon(self) -> None:
        """The run is over unfinished: cut short the compute of every step
        queued or running (their table writes still run, in order)."""
        self._abandoned.set()

    def _compute(self, seconds: float) -> None:
        rows = round(seconds / self._s_per_row) if self._s_per_row else 0
        cap = self._x.shape[0]
        while rows > 0 and not self._abandoned.is_set():
            m = min(rows, cap)
            torch.mm(self._x[:m], self._w, out=self._y[:m])
            rows -= m

    # -- reading rows --------------------------------------------------------

    def snapshot(
        self, row: int, length: int, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Copies of ``req_to_token[row, :length]`` and ``kv[slots]``, and the
        fence to free the row behind (None when there is nothing to wait for).

        On CPU they are taken now (the caller has waited for the step that
        wrote them). On CUDA they are queued on the forward stream, so no
        later step can rewrite what they read; but a transfer on another
        stream can, once the row's pages are free again: the read is a use of
        the memory like any write, so free the row behind the fence recorded
        after it. The tensors are filled once it has completed (read them
        after :meth:`synchronize`).
        """
        r2t, kv = self.req_to_token, self.kv
        assert r2t is not None and kv is not None
        if self.is_cuda:
            with torch.cuda.stream(self.stream):
                idx = slots.pin_memory().to(self.device, non_blocking=True)
                found = _to_host(r2t[row, :length]), _to_host(kv[idx])
            return (*found, record_fence(self.stream))
        return r2t[row, :length].clone(), kv[slots], None

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        if self.is_cuda:
            self.stream.synchronize()
        else:
            self.stream.close()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


async def wait_fence(fence: Any) -> None:
    """Await a fence without blocking the loop; raises if its stream faulted.

    The demo's transfers and host fences call back into the loop when they
    complete (``add_done_callback``); any other fence (a CUDA event) goes to
    :func:`asyncpool.wait_fence`, whose daemon threads watch it.
    """
    if fence.query():
        return
    add_done_callback = getattr(fence, "add_done_callback", None)
    if add_done_callback is None:
        await asyncpool.wait_fence(fence)
        return
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    add_done_callback(lambda: loop.call_soon_threadsafe(wake))
    await fut
    fence.query()  # re-raise a fault


def fill_gates(steps: Sequence[Step | None]) -> None:
    """Open the gates of ``steps`` (used on the way out, so no worker hangs)."""
    for step in steps:
        if step is not None:
            step.open_gate()
