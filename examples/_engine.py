"""The engine plumbing that several examples share; not an example itself.

``paged_admission.py``, ``weight_update.py``, ``router_drain.py``,
``n_samples.py``, ``radix_cache.py``, ``preempt_retry.py``,
``lora_slots.py``, ``disagg_transfer.py``, ``hybrid_prefix.py``,
``disagg_decode.py`` and ``pd_router.py`` each run a stand-in for a
model's forward over a paged KV cache: :class:`PagedEngine` is what they
have in common, the KV cache and its check, the streams, the gated host
step, the kernel, the copy of a finished request's KV and row to the host
and the weight update's overwrite of the KV cache. :class:`DecodeEngine`
adds the prefill and step of requests whose position ``p`` holds
``req.value(p)`` (a :class:`Decoder`), one token a step:
``weight_update.py`` and ``router_drain.py`` run it as it is,
``paged_admission.py``'s ``Engine`` subclasses it. The other examples'
``Engine`` subclasses :class:`PagedEngine` and keeps what is its own: the
tensors its prefill, steps and copies are built from (``write_prompt``,
``launch_step``, ``copy_out``), extra streams. :func:`run_loop` runs a
program on ``--loop``'s choice, asyncio or uvloop: every example but
``sync_dropin.py`` (synchronous) takes it, ``overlap_step.py``,
``speculative_decode.py`` and ``hybrid_admission.py`` only it from here.
:func:`make_requests` is the prompts of ``radix_cache.py`` and
``hybrid_prefix.py``, down a seeded tree of token blocks.

The examples import this module by name (``from _engine import ...``): run
as scripts (``python examples/x.py``, from any directory), their own folder
is first on ``sys.path`` (not under ``python -P`` or ``-I``, which leave it
off); the tests load it beside them (``tests/helpers.py``,
``load_example``). It is not installed: the examples run from a checkout.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import random
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

import torch

from asyncpool import AsyncReqToTokenPool, HostStream, ReqToTokenPoolInfo

Kernel = Callable[..., None]


T = TypeVar("T")
R = TypeVar("R")

# A position's KV marker in ``make_requests``: a hash of its prefix, modulo this prime.
HASH_MOD = 2**31 - 1


def run_loop(main: Coroutine[Any, Any, T], loop: str) -> T:
    """Run ``main`` to completion on a new event loop and return its result:
    ``loop`` is ``--loop``'s choice, ``"asyncio"`` or ``"uvloop"``."""
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)


def make_requests(
    args: argparse.Namespace,
    rng: random.Random,
    max_len: int,
    request: Callable[[int, list[int], int, list[int]], R],
) -> list[R]:
    """Prompts down a seeded tree of token blocks, then a tail of their own
    (``radix_cache.py``, ``hybrid_prefix.py``): ``args.requests`` of them,
    each ``request(id, tokens, output_len, marks)``.

    The tree has ``args.branch`` branches a level, at most ``args.depth``
    levels, a block of one or two pages (``args.page_size``) a node; a
    prompt's own tail is 1 to ``args.tail`` tokens, its output 2 to
    ``args.max_output``. ``marks`` holds each position's KV marker (prompt,
    then output and one more: the step in flight at the end), a hash of
    every token up to it modulo :data:`HASH_MOD`, plus 1 (never 0). Tokens
    of different requests' tails and outputs differ (``max_len`` apart).
    The same ``rng`` state gives the same requests and leaves ``rng`` in
    the same state.
    """
    ps = args.page_size
    blocks: dict[tuple[int, ...], list[int]] = {}  # path of branch choices -> its tokens

    def block(path: tuple[int, ...]) -> list[int]:
        if path not in blocks:
            blocks[path] = [rng.randrange(1, 50_000) for _ in range(ps * rng.randint(1, 2))]
        return blocks[path]

    requests = []
    for i in range(args.requests):
        path: tuple[int, ...] = ()
        tokens: list[int] = []
        for _ in range(rng.randint(0, args.depth)):
            path += (rng.randrange(args.branch),)
            tokens += block(path)
        tokens += [100_000 + i * max_len + t for t in range(rng.randint(1, args.tail))]
        output_len = rng.randint(2, args.max_output)
        seq = tokens + [200_000 + i * max_len + t for t in range(output_len + 1)]
        marks, h = [], 0
        for tok in seq:  # a position's KV depends on every token up to it
            h = (h * 1_000_003 + tok) % HASH_MOD
            marks.append(h + 1)
        requests.append(request(i, tokens, output_len, marks))
    return requests


def step(
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    verified_lens: torch.Tensor,
    bad_reads: torch.Tensor,
    rows: torch.Tensor,
    pos: torch.Tensor,
    slots: torch.Tensor,
    values: torch.Tensor,
    sums: torch.Tensor,
) -> None:
    """One step of the batch ``rows``: each reads its context (positions
    ``0..pos-1``) through its row, counts a read in ``bad_reads`` unless the
    context sums to ``sums``, then writes ``values`` into its next KV slot
    ``slots``, that slot into its row at ``pos``, and its verified length."""
    # Attention: the KV of positions 0..pos-1, read through the row.
    context = kv_cache[req_to_token[rows].long()]
    before = torch.arange(context.shape[1], device=pos.device) < pos[:, None]
    bad_reads += (torch.where(before, context, 0).sum(1) != sums).sum()
    kv_cache[slots] = values
    req_to_token[rows, pos] = slots.to(req_to_token.dtype)
    verified_lens[rows] = (pos + 1).to(verified_lens.dtype)


def prefill(
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    verified_lens: torch.Tensor,
    bad_reads: torch.Tensor,
    slots: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """The prefill step's write, a kernel for :meth:`PagedEngine.launch_kernel` with
    no reads (``disagg_transfer.py``, ``pd_router.py``): each request's KV
    into its pages' slots."""
    kv_cache[slots] = values


def _host_step(kernel: Kernel, delay_s: float, gate: threading.Event, *args: torch.Tensor) -> None:
    time.sleep(delay_s)  # the forward's compute, on the stream's worker
    gate.wait()  # and no sooner than the scheduler has planned the next step
    kernel(*args)


class PagedEngine:
    """A paged KV cache and the streams a step runs on (HostStreams or CUDA).

    ``kv_cache`` holds one int64 value a slot (``num_pages * page_size``
    slots; page 0 is the pool's padding); ``bad_reads`` counts the (step,
    request) pairs whose step read a context that was not theirs. On CUDA
    (``device.type == "cuda"``) the streams are CUDA streams and a step is a
    ``torch.cuda._sleep`` of about ``forward_ms`` and the kernel on ``forward``;
    otherwise they are :class:`~asyncpool.HostStream` workers, each kept to
    one torch thread, and a step sleeps ``forward_ms`` on the worker.

    A host step is *gated*: it reads and writes only once the scheduler
    calls :meth:`planned`, which it does when it has planned the next step
    (admitted its requests and written their prompts, from its own thread).
    A step in flight so always reads after the writes of the requests
    admitted meanwhile, the latest the overlap allows: memory handed to a
    new request while a step still uses it is caught every time, not by
    timing. (On CUDA the prompts are written on the forward stream, whose
    order puts the old step first: docs/cuda.md.)
    """

    def __init__(
        self, device: torch.device, num_pages: int, page_size: int, forward_ms: float
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.page_size = page_size
        self.forward_s = forward_ms / 1e3
        # The engine's KV cache, one value a slot; page 0 is the pool's padding.
        self.kv_cache = torch.zeros(num_pages * page_size, dtype=torch.int64, device=device)
        # (step, request) pairs whose step read a context that was not theirs.
        self.bad_reads = torch.zeros((), dtype=torch.int64, device=device)
        # Host streams: the steps launched and not yet let through (see planned).
        self.gates: list[threading.Event] = []
        self.streams: list[Any] = []  # every stream made by new_stream, forward first
        self.forward: Any = self.new_stream("forward")

    def new_stream(self, name: str) -> Any:
        """A stream of this engine's kind, closed with it by :meth:`close`.

        A CUDA stream waits for the current stream first: the zero fills of
        the tensors made so far are queued there, which a side stream does
        not wait for by itself. A host stream's worker keeps torch to one
        thread (torch's intra-op threads are per thread).
        """
        stream: Any
        if self.cuda:
            stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            stream = self.host_stream(name)
            stream.launch(torch.set_num_threads, 1)
        self.streams.append(stream)
        return stream

    def host_stream(self, name: str) -> HostStream:
        """The worker of host stream ``name`` (a test may hand out its own)."""
        return HostStream(name)

    def write(
        self,
        pool: AsyncReqToTokenPool,
        row: int,
        slots: torch.Tensor,
        values: torch.Tensor,
        lo: int,
    ) -> None:
        """Prefill ``row``: its slots of positions ``0..len(slots)-1`` (its
        lengths too) and the KV ``values`` of the positions from ``lo`` on
        (those before are cached, someone else's). On CUDA on the forward
        stream; on host streams from the calling thread, outside the
        forward's order (so a step still reading these slots is caught)."""
        n = len(slots)
        info = ReqToTokenPoolInfo(n, n, slots.to(torch.int32))
        if self.cuda:
            with torch.cuda.stream(self.forward):
                self.kv_cache[slots[lo:].to(self.device)] = values.to(self.device)
                pool.set_req_pool_info(row, info)
        else:
            self.kv_cache[slots[lo:]] = values
            pool.set_req_pool_info(row, info)

    def launch_kernel(
        self, pool: AsyncReqToTokenPool, *tensors: torch.Tensor, kernel: Kernel = step
    ) -> None:
        """Launch a step on the forward stream: ``kernel(kv_cache,
        req_to_token, verified_lens, bad_reads, *tensors)`` (host tensors,
        moved to the device on CUDA), after ``forward_ms``; on host streams
        gated until the next :meth:`planned`."""
        args = (self.kv_cache, pool.req_to_token, pool.verified_lens, self.bad_reads)
        if self.cuda:
            with torch.cuda.stream(self.forward):
                moved = (t.to(self.device) for t in tensors)
                torch.cuda._sleep(int(self.forward_s * 1.5e9))  # type: ignore[no-untyped-call]
                kernel(*args, *moved)
        else:
            gate = threading.Event()
            self.gates.append(gate)
            self.forward.launch(_host_step, kernel, self.forward_s, gate, *args, *tensors)

    def copy_to_host(
        self,
        stream: Any,
        pool: AsyncReqToTokenPool,
        row: int,
        slots: torch.Tensor,
        out: list[Any],
    ) -> None:
        """Copy the KV of ``slots`` (host tensor) and ``row``'s first
        ``len(slots)`` entries to the host on ``stream`` (one made by
        :meth:`new_stream`): ``out`` gets the pair ``(kv, row)``, pinned
        tensors filled once the stream gets there on CUDA, host copies
        appended by the worker on host streams. A free behind the copy
        waits for it with ``after=stream``."""
        n = len(slots)
        entries = pool.req_to_token[row, :n]
        if self.cuda:
            kv_host = torch.empty(n, dtype=torch.int64, pin_memory=True)
            row_host = torch.empty(n, dtype=entries.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                kv_host.copy_(self.kv_cache[slots.to(self.device)], non_blocking=True)
                row_host.copy_(entries, non_blocking=True)
            out.append((kv_host, row_host))
        else:
            kv_cache = self.kv_cache
            stream.launch(lambda: out.append((kv_cache[slots], entries.clone())))

    def update_weights(self) -> None:
        """New weights: the released KV memory comes back holding nothing of
        what it held (garbage here: a request kept without a recompute
        reads it). On CUDA on the forward stream; on host streams from the
        calling thread, once every step is done (the caller drained)."""
        if self.cuda:
            with torch.cuda.stream(self.forward):
                self.kv_cache.fill_(-7)
        else:  # the drain waited for every step: nothing runs on the worker
            self.kv_cache.fill_(-7)

    def planned(self) -> None:
        """The scheduler has planned the next step (admitted its requests and
        written their prompts): the host steps launched so far may read and
        write now."""
        for gate in self.gates:
            gate.set()
        self.gates.clear()

    def synchronize(self) -> None:
        """Let every step run and wait for every stream."""
        self.planned()
        for stream in self.streams:
            stream.synchronize()

    def close(self) -> int:
        """:meth:`synchronize`, then stop the host streams' workers; the
        corrupted reads counted (``bad_reads``, every step done). A step
        that raised on a host worker raises here (``FenceError``), the
        workers stopped all the same."""
        try:
            self.synchronize()
        finally:
            if not self.cuda:
                for stream in self.streams:
                    stream.close()
        return int(self.bad_reads)


class Decoder(Protocol):
    """A request as :class:`DecodeEngine` reads it: the KV of its position
    ``p`` is ``value(p)``, in the slot ``slot(p, page_size)`` of its pages."""

    row: int  # its row of req_to_token
    prompt_len: int
    launched: int  # output tokens whose step has been launched

    @property
    def length(self) -> int:
        """The positions whose KV is computed (its prompt and processed tokens)."""
        ...

    def value(self, pos: int) -> int: ...

    def slot(self, pos: int, page_size: int) -> int: ...


class DecodeEngine(PagedEngine):
    """A :class:`PagedEngine` whose requests (:class:`Decoder`) each decode
    one token a step, the KV of their position ``p`` being ``req.value(p)``:
    the context a step reads must sum to ``value(0) + ... + value(p-1)``."""

    def write_prompt(self, pool: AsyncReqToTokenPool, req: Decoder, cached: int = 0) -> None:
        """Prefill (or recompute): the row's slots of positions
        ``0..length-1`` (the cached ones included) and the KV of the
        positions from ``cached`` on (those before are cached, someone
        else's)."""
        n = req.length
        slots = torch.tensor([req.slot(p, self.page_size) for p in range(n)])
        values = torch.tensor([req.value(p) for p in range(cached, n)])
        self.write(pool, req.row, slots, values, cached)

    def launch_step(self, pool: AsyncReqToTokenPool, batch: Sequence[Decoder]) -> None:
        """The forward of one step: each request reads its context through
        its row, then writes its next KV slot and row entry."""
        ps = self.page_size
        pos_list = [r.prompt_len + r.launched for r in batch]
        rows = torch.tensor([r.row for r in batch])
        pos = torch.tensor(pos_list)
        slots = torch.tensor([r.slot(p, ps) for r, p in zip(batch, pos_list, strict=True)])
        values = torch.tensor([r.value(p) for r, p in zip(batch, pos_list, strict=True)])
        sums = torch.tensor(
            [sum(map(r.value, range(p))) for r, p in zip(batch, pos_list, strict=True)]
        )
        self.launch_kernel(pool, rows, pos, slots, values, sums)


class DueThread:
    """A thread that runs each scheduled action at its time: the clock of
    the transfer engines (``disagg_transfer.py``, ``disagg_decode.py``,
    ``pd_router.py``).

    ``at(when, action)``, called holding ``cond``, schedules ``action()``
    for ``time.monotonic()`` reading ``when`` (actions due at once run in
    the order they were scheduled). The thread runs each action holding
    ``cond``, so an action may schedule more and settle what other threads
    wait for under the same lock; on CUDA it runs on a stream of its own,
    made waiting for the default stream (the KV cache's zero fill).
    ``close()`` lets every scheduled action run at its time, then ends the
    thread (joined for 30 s at most).
    """

    def __init__(self, device: torch.device, name: str = "transfer-engine") -> None:
        self.device = device
        self.cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Schedule ``action`` for ``when`` (the caller holds ``cond``)."""
        heapq.heappush(self._heap, (when, next(self._seq), action))
        self.cond.notify_all()  # the thread, whoever else waits on the lock

    def close(self) -> None:
        with self.cond:
            self._closing = True
            self.cond.notify_all()
        self._thread.join(30)

    def _run(self) -> None:
        if self.device.type == "cuda":  # a stream of its own, not a forward's
            stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.default_stream(self.device))
            torch.cuda.set_stream(stream)
        with self.cond:
            while self._heap or not self._closing:
                wait = self._heap[0][0] - time.monotonic() if self._heap else None
                if wait is None or wait > 0:
                    self.cond.wait(wait)
                    continue
                heapq.heappop(self._heap)[2]()
