"""The pool's tensors, the memory-saver region, and vectorised row resets.

Knows nothing of waiting or fences. ``verified_lens`` and ``alloced_lens``
are views into one ``[2, size]`` device tensor (and, on CPU, ``alloced_lens_cpu``
is a third row of the same buffer), so zeroing a batch of rows is a single
indexed op: one torch call per about ``capacity`` frees, not per free.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, SupportsIndex

import torch

from .errors import DeviceError, InvalidSlotError, MemorySaverError
from .fences import HostStream
from .ledger import INTEGER_DTYPE_NAMES, as_index, describe, index_or_error, integral

# What a pool off CUDA accepts as stream= (and ignores: its resets run at
# once): the code an engine shares between CPU and GPU passes its forward
# stream either way.
_STREAMS: tuple[type, ...] = (
    HostStream,
    torch.cuda.Stream,
    getattr(torch, "Stream", torch.cuda.Stream),
)

__all__ = [
    "MemorySaverAdapter",
    "PoolInfo",
    "ReqToTokenPoolInfo",
    "TokenTables",
    "check_device",
    "host_to_device",
]

logger: logging.Logger = logging.getLogger(__name__)

KV_CACHE_TAG = "kv_cache"


@dataclass
class ReqToTokenPoolInfo:
    """A row's lengths and token slots, as set after a chunked prefill."""

    verified_len: int
    alloced_len: int
    alloced_slots: torch.Tensor


class PoolInfo(Protocol):
    """What ``set_req_pool_info`` reads: a :class:`ReqToTokenPoolInfo` or an
    engine's own object with the same three fields (the seed's dataclass).
    Read-only members, so a frozen dataclass or a ``NamedTuple`` fits, and
    lengths may be any integer type (numpy and torch integers are read as
    ints)."""

    @property
    def verified_len(self) -> SupportsIndex: ...

    @property
    def alloced_len(self) -> SupportsIndex: ...

    @property
    def alloced_slots(self) -> torch.Tensor: ...


_INFO_FIELDS = ("verified_len", "alloced_len", "alloced_slots")

#: The dtypes ids may have (``alloced_slots``, page ids in a tensor): every
#: integer dtype torch can copy into ``req_to_token`` and read back. Not bool,
#: floats or complex (not ids), nor the quantized and sub-byte dtypes
#: (``qint8``, ``int4``, ``bits8``): their copy and their ``tolist()`` raise,
#: and a check that let them through wrote a row's lengths first. The eight
#: of ``ledger.INTEGER_DTYPE_NAMES`` (int8..int64, uint8..uint64), one list.
ID_DTYPES = frozenset(getattr(torch, name[len("torch.") :]) for name in INTEGER_DTYPE_NAMES)

#: The largest ``max_context_len``: ``verified_lens`` and ``alloced_lens``
#: hold lengths up to it in int32.
MAX_CONTEXT_LEN = 2**31 - 1


def check_device(device: object) -> torch.device:
    """``device`` as a ``torch.device`` a pool can hold memory on, or
    :class:`DeviceError`: for a value torch cannot parse (``"10"``, ``-1``,
    ``None``), an index without an accelerator (``0`` without CUDA), the
    ``meta`` device (its tensors hold no data: every id handed out there
    could never be read back, so never freed), and CUDA where
    ``torch.cuda.is_available()`` is False."""
    try:
        dev: torch.device = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DeviceError(
            f"device={device!r:.80} is not a device torch can use: {reason}"
        ) from None
    if dev.type == "meta":
        raise DeviceError(
            f"device={device!r} holds no data: ids handed out on the meta device "
            "could never be read back or freed; use device='cpu' or 'cuda'"
        )
    if dev.type not in ("cpu", "cuda"):
        # torch parses every device type it knows of ("mps", "xla", "xpu",
        # "hpu", ...), built in or not: one this build or machine lacks
        # fails only at the first tensor made there, with whatever its
        # backend raises (NotImplementedError, AssertionError,
        # ModuleNotFoundError), an alloc at a time for a page pool. Make
        # the two tensors a pool makes there (an empty one, a copy) now.
        try:
            torch.empty(0, dtype=torch.int64, device=dev)
            torch.empty(0, dtype=torch.int64).to(dev)
        except Exception as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DeviceError(
                f"device={device!r:.80} is not a device torch can use here: {reason}"
            ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(
            f"device={device!r} needs CUDA, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); use device='cpu' on this machine"
        )
    if dev.type == "cuda" and dev.index is None:
        # Where torch puts a tensor made with device="cuda": the current
        # device, now. Kept unresolved, every later copy (a reset's index,
        # a grant's pages) and every current_stream(device) would follow
        # the device current at *that* call, on whatever thread makes it:
        # an index on cuda:0 for tables on cuda:1, or a reset-ordering
        # wait made on the wrong device's stream.
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of the host tensor ``host`` on ``device``, queued on the current
    stream without blocking the calling thread.

    On CUDA the data is staged in a pinned buffer of the pool's own first. A
    copy from pageable memory synchronises: a blocking ``.to(device)`` waits
    for everything on the current stream, and a ``non_blocking`` one may wait
    for it in the driver. The current stream may be the forward stream with a
    step in flight (the pool's resets run on ``stream=``), so either would end
    the overlap. The staging copy is made at once, so the caller may reuse
    ``host`` (a pinned buffer of its own included) as soon as this returns;
    the caching host allocator keeps the staging block until the copy has run.
    Off CUDA, ``host.to(device)`` (``host`` itself on the CPU).
    """
    if device.type != "cuda":
        return host.to(device)
    return _staged(host, host.dtype).to(device, non_blocking=True)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage."""
    try:
        return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    except RuntimeError:  # no storage to compare (checked by the caller first)
        return False


def _staged(host: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A pinned copy of ``host`` (of ``dtype``, contiguous) that nobody else holds."""
    staged = torch.empty(host.shape, dtype=dtype, pin_memory=True)
    staged.copy_(host)
    return staged


def _length(value: object, name: str, row: int) -> int:
    """A length from ``ReqToTokenPoolInfo`` as an int (integer scalars
    accepted, bools and floats refused with :class:`InvalidSlotError`)."""
    return index_or_error(value, f"{name} for row {row} must be an integer")


def _unsigned_range(slots: torch.Tensor) -> tuple[int, int]:
    """``(min, max)`` of a host tensor of a dtype torch has no min/max for
    (uint16, uint32, uint64), read through an int64 copy. uint64 values past
    ``2**63 - 1`` wrap negative there: the max is then read back as unsigned."""
    wide = slots.to(torch.int64)
    low, high = int(wide.min()), int(wide.max())
    if low < 0:  # uint64 past int64: the largest such value is the max
        return 0, int(wide[wide < 0].max()) + 2**64
    return low, high


_exit_guard_registered = False


def _let_the_saver_free_its_region_at_exit(saver: Any) -> None:
    """Register, once per process, :func:`_mark_main_thread_in_region` at exit.

    In torch hook mode torch-memory-saver's free hook refuses a free made
    outside one of its regions, and refuses by calling C ``exit(1)``. Its
    memory pools live as long as the process, so that free happens once, at
    interpreter shutdown, when the pools are destroyed on the main thread:
    outside any region. A process that used ``enable_memory_saver=True`` would
    print "only support interesting region" and exit with status 1 after a
    clean run. Every pointer that hook sees is the saver's own (its pluggable
    allocator serves only its pools), so the refusal guards nothing there.
    """
    global _exit_guard_registered
    if not _exit_guard_registered:
        atexit.register(_mark_main_thread_in_region, saver)
        _exit_guard_registered = True


def _mark_main_thread_in_region(saver: Any) -> None:
    """At exit: mark this (the main) thread as inside a region, so the
    shutdown frees of the saver's pools pass its check. Only its torch-hook
    allocator reads the mark; it no longer matters once the process exits."""
    try:
        impl = saver._impl
        if impl is None or impl._hook_mode != "torch":
            return  # never initialised, or its preload hooks (which check nothing here)
        impl._binary_wrapper.cdll.tms_set_interesting_region(True)
    except Exception as exc:  # a saver never initialised, or another version
        logger.debug("torch_memory_saver exit guard not applied: %r", exc)


class MemorySaverAdapter:
    """torch-memory-saver when enabled and CUDA is present; a no-op otherwise.

    ``MemorySaverAdapter.create(enable=True)`` on a machine without CUDA
    raises :class:`MemorySaverError`: its regions need CUDA, and silently
    ignoring an explicit request would hide a misconfiguration.
    """

    def __init__(self, saver: Any | None) -> None:
        self._saver = saver

    @classmethod
    def create(cls, enable: bool) -> MemorySaverAdapter:
        if not enable:
            return cls(None)
        if not torch.cuda.is_available():
            raise MemorySaverError(
                "enable_memory_saver=True needs CUDA: torch-memory-saver regions "
                "pause device memory, and this machine has no CUDA device"
            )
        try:
            from torch_memory_saver import torch_memory_saver
        except ImportError as exc:  # pragma: no cover - a declared dependency
            raise MemorySaverError("enable_memory_saver=True needs torch-memory-saver") from exc
        if "torch_memory_saver" not in os.environ.get("LD_PRELOAD", ""):
            # Without its LD_PRELOAD hook the saver must use torch's pluggable
            # allocator; this can be set only before its first region.
            try:
                torch_memory_saver.hook_mode = "torch"
            except Exception:  # already initialised in some mode: keep it
                logger.debug("torch_memory_saver already initialised; keeping its hook mode")
            _let_the_saver_free_its_region_at_exit(torch_memory_saver)
        return cls(torch_memory_saver)

    @property
    def enabled(self) -> bool:
        return self._saver is not None

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        if self._saver is None:
            yield
            return
        try:
            region = self._saver.region(tag=tag, enable_cpu_backup=False)
            region.__enter__()
        except Exception as exc:
            raise MemorySaverError(
                f"torch-memory-saver could not open its region: {exc!r}"
            ) from exc
        try:
            yield
        finally:
            region.__exit__(None, None, None)

    def pause(self, tag: str) -> None:
        if self._saver is not None:
            self._saver.pause(tag)

    def resume(self, tag: str) -> None:
        if self._saver is not None:
            self._saver.resume(tag)


class TokenTables:
    """``req_to_token``, ``verified_lens``, ``alloced_lens``, ``alloced_lens_cpu``.

    On CUDA, resets are launched on ``stream`` (the pool's stream) when one is
    given, else on the current stream, so they are ordered before any later
    forward on that stream that reads the rows. On CPU they run at once.
    """

    def __init__(
        self,
        size: int,
        max_context_len: SupportsIndex,
        device: str | torch.device = "cpu",
        enable_memory_saver: bool = False,
        stream: Any | None = None,
    ) -> None:
        max_context_len = integral(max_context_len)  # type: ignore[assignment]
        if max_context_len.__class__ is not int or max_context_len < 1:
            raise ValueError(
                f"max_context_len must be a positive int, got {describe(max_context_len)}"
            )
        if max_context_len > MAX_CONTEXT_LEN:
            raise ValueError(
                f"max_context_len must be at most 2**31 - 1 (lengths are held in int32 "
                f"tensors), got {max_context_len!r}"
            )
        if enable_memory_saver.__class__ is not bool:
            raise TypeError(
                f"enable_memory_saver must be a bool, got {describe(enable_memory_saver, 80)} of "
                f"type {type(enable_memory_saver).__name__}"
            )
        self.size: int = size
        self.max_context_len: int = max_context_len
        self.device: torch.device = check_device(device)
        if enable_memory_saver and self.device.type != "cuda" and torch.cuda.is_available():
            # Without CUDA, create() below says so; with it, tables on another
            # device are not in any region the saver pauses (and create()
            # would set the saver's process-wide hook mode for nothing).
            raise MemorySaverError(
                f"enable_memory_saver=True needs device='cuda': torch-memory-saver "
                f"pauses CUDA memory, and these tables are on device={device!r}"
            )
        self._on_cuda = self.device.type == "cuda"
        if self._on_cuda and stream is not None and not isinstance(stream, torch.cuda.Stream):
            # Silently ignored, resets would go to whatever stream is current.
            raise TypeError(
                f"stream= on a CUDA pool must be a torch.cuda.Stream (the forward "
                f"stream, say) or None, got {stream!r} of type {type(stream).__name__}"
            )
        if not self._on_cuda and stream is not None and not isinstance(stream, _STREAMS):
            # Unused off CUDA, but a typo here would surface only on a GPU.
            raise TypeError(
                f"stream= must be the forward stream (a HostStream or a torch stream) or "
                f"None, got {stream!r} of type {type(stream).__name__}"
            )
        if self._on_cuda and isinstance(stream, torch.cuda.Stream) and stream.device != self.device:
            # Resets would run under that stream's context, but on the
            # tables' device they go to its current stream instead (a
            # kernel runs on its tensors' device), unordered with `stream`,
            # and the wait set_req_pool_info makes is on the wrong device.
            raise DeviceError(
                f"stream= is on {stream.device}, but the tables are on {self.device}: "
                "pass the forward stream of the pool's own device"
            )
        self.memory_saver: MemorySaverAdapter = MemorySaverAdapter.create(enable_memory_saver)
        on_cuda_stream = self._on_cuda and isinstance(stream, torch.cuda.Stream)
        self._cuda_stream = stream if on_cuda_stream else None
        # The one event _after_resets records on the pool's stream, made at
        # its first use and re-recorded at each: a wait_event reads the
        # event's last record when it is queued, so an earlier wait keeps
        # its point however often the event is recorded again.
        self._resets_queued: torch.cuda.Event | None = None
        self._allocate()

    def _allocate(self) -> None:
        size, device = self.size, self.device
        # Tag as "kv_cache": this per-token page state is invalid once KV is
        # discarded, so it is released and restored with the KV cache.
        with self.memory_saver.region(KV_CACHE_TAG):
            self.req_to_token: torch.Tensor = torch.zeros(
                (size, self.max_context_len), dtype=torch.int32, device=device
            )
            rows = 2 if self._on_cuda else 3
            self._lens = torch.zeros((rows, size), dtype=torch.int32, device=device)
        # verified_lens: valid KV length per request (where this step writes);
        # alloced_lens: allocated KV length, may exceed verified_lens.
        self.verified_lens: torch.Tensor = self._lens[0]
        self.alloced_lens: torch.Tensor = self._lens[1]
        if self._on_cuda:
            self.alloced_lens_cpu: torch.Tensor = torch.zeros(
                size, dtype=torch.int32, pin_memory=True
            )
        else:
            self.alloced_lens_cpu = self._lens[2]
        if self._cuda_stream is not None:
            # The zero fills above were queued on the current stream; the
            # pool's stream (the forward stream) runs resets and the first
            # forward, and does not wait for another stream by itself.
            self._cuda_stream.wait_stream(torch.cuda.current_stream(device))

    # ------------------------------------------------------------------ writes

    def check_row(self, row: object) -> int:
        """``row`` as a Python int (integer scalars and 0-d tensors accepted)."""
        try:
            index = as_index(row)
        except TypeError:
            raise InvalidSlotError(
                f"a row id must be an integer, got {describe(row)} of type {type(row).__name__}"
            ) from None
        if not 0 <= index < self.size:
            raise InvalidSlotError(f"row {index} is out of range 0..{self.size - 1}")
        return index

    def set_req_pool_info(self, row: int, info: PoolInfo) -> None:
        """Write a row's lengths and its first ``alloced_len`` token slots.

        ``info`` is a :class:`ReqToTokenPoolInfo` or any object with its
        three fields (the seed's dataclass). Everything is checked before the
        first write: metadata without those fields, lengths that are not integers in
        range, and ``alloced_slots`` that is not a 1-D integer tensor of
        ``alloced_len`` entries on a real device (any integer dtype, unsigned
        ones included, not quantized or sub-byte ones; on the host: of slot
        ids ``>= 0`` that fit ``req_to_token``'s dtype) raise
        :class:`InvalidSlotError` (a ``ValueError``), writing nothing. An
        empty 1-D tensor of any dtype (``torch.tensor([])`` is float32) is
        no slots.
        """
        if not isinstance(info, ReqToTokenPoolInfo) and not all(
            hasattr(info, field) for field in _INFO_FIELDS
        ):
            # An engine's own ReqToTokenPoolInfo (the seed's dataclass, same
            # fields) is taken as it is: a drop-in swaps the pool, not that.
            raise InvalidSlotError(
                f"metadata for row {row} must have verified_len, alloced_len and "
                f"alloced_slots (asyncpool.ReqToTokenPoolInfo or the seed's dataclass), "
                f"got {type(info).__name__} ({type(info).__module__}.{type(info).__qualname__})"
            )
        alloced = _length(info.alloced_len, "alloced_len", row)
        verified = _length(info.verified_len, "verified_len", row)
        if not 0 <= alloced <= self.max_context_len:
            raise InvalidSlotError(
                f"alloced_len {alloced} for row {row} is outside "
                f"0..max_context_len ({self.max_context_len})"
            )
        if not 0 <= verified <= alloced:
            raise InvalidSlotError(
                f"verified_len {verified} for row {row} is outside 0..alloced_len ({alloced})"
            )
        slots = info.alloced_slots
        if not isinstance(slots, torch.Tensor):
            raise InvalidSlotError(
                f"alloced_slots for row {row} must be a 1-D integer tensor, "
                f"got {type(slots).__name__}"
            )
        if slots.dim() == 1 and not slots.numel() and slots.layout is torch.strided:
            # No slots, of any dtype: torch.tensor([]) is float32 (what an
            # engine makes of an empty slot list), and free() and the page
            # pool read an empty tensor of any dtype as no ids; the seed
            # writes it. Nothing is copied from it below.
            pass
        elif (
            slots.dim() > 1
            or slots.dtype not in ID_DTYPES
            or slots.is_meta
            or slots.layout is not torch.strided
        ):
            raise InvalidSlotError(
                f"alloced_slots for row {row} must be a 1-D integer tensor with data, got "
                f"shape {tuple(slots.shape)}, dtype {slots.dtype}, device {slots.device}, "
                f"layout {slots.layout}"
            )
        if slots.numel() != alloced:
            raise InvalidSlotError(
                f"alloced_slots has {slots.numel()} entries for row {row}, "
                f"expected alloced_len={alloced}"
            )
        if alloced and slots.device.type == "cpu":
            # Token slot ids are >= 0 and must fit the table's dtype (a larger
            # int64 would wrap silently). Host tensors only: on a device the
            # check would wait for the stream.
            try:
                low, high = int(slots.min()), int(slots.max())
            except (NotImplementedError, RuntimeError):  # uint16/32/64: no min/max
                low, high = _unsigned_range(slots)
            limit = torch.iinfo(self.req_to_token.dtype).max
            if low < 0 or high > limit:
                bad = low if low < 0 else high
                raise InvalidSlotError(
                    f"alloced_slots for row {row} holds {bad}, outside the token slot "
                    f"ids 0..{limit} that req_to_token ({self.req_to_token.dtype}) can hold"
                )
        self._after_resets()
        # The slots first, from a copy when they lie in req_to_token itself
        # (a row's own slots shifted, say: torch refuses a copy between
        # overlapping places), so that nothing is written if the copy fails.
        if (
            alloced
            and slots.device == self.req_to_token.device
            and _shares_storage(slots, self.req_to_token)
        ):
            slots = slots.clone()
        if not self._on_cuda:
            if alloced:
                self.req_to_token[row, :alloced] = slots
            self.verified_lens[row] = verified
            self.alloced_lens[row] = alloced
            self.alloced_lens_cpu[row] = alloced
            return
        # On CUDA, ``t[row] = value`` from a host scalar is a blocking copy
        # (it waits for the whole current stream, the forward step in flight
        # included), and so is a copy from pageable memory: fill_ a view (a
        # kernel that takes the value as its argument) and stage host slots
        # in a pinned buffer of our own (the caller may reuse theirs at
        # once), staged before anything is written. Everything is queued on
        # the current stream.
        dst = self.req_to_token[row, :alloced]
        if alloced and slots.device.type == "cpu":
            slots = _staged(slots.reshape(-1).expand(alloced), dst.dtype)
        if alloced:
            dst.copy_(slots, non_blocking=True)
        self.verified_lens[row : row + 1].fill_(verified)
        self.alloced_lens[row : row + 1].fill_(alloced)
        self.alloced_lens_cpu[row] = alloced

    def write(self, indices: Any, values: Any) -> None:
        """``req_to_token[indices] = values`` (the seed's raw write), a
        tensor of values cast to the table's dtype first: a slice write
        casts by itself, but an index write (tensors as ``indices``) refused
        the int64 slot ids that page ids give (torch: "Index put requires
        the source and destination dtypes match"). Unchecked otherwise, as
        the seed: a value past int32 wraps, as a slice write's does."""
        self._after_resets()
        table = self.req_to_token
        if isinstance(values, torch.Tensor) and values.dtype != table.dtype:
            values = values.to(table.dtype)
        table[indices] = values

    def _after_resets(self) -> None:
        # Resets (and resume's zeroing) are queued on the pool's stream; a
        # write from another stream must not run before them, or the late
        # reset clobbers the new owner's lengths. One event of the tables',
        # recorded again at each call: current.wait_stream(stream) would
        # create a CUDA event per call (torch's record_event() makes a new
        # one), a driver create and destroy per set_req_pool_info.
        stream = self._cuda_stream
        if stream is not None:
            current = torch.cuda.current_stream(self.device)
            if current != stream:
                event = self._resets_queued
                if event is None:
                    event = self._resets_queued = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                current.wait_event(event)

    # ------------------------------------------------------------------ resets

    def reset_rows(self, rows: list[int]) -> None:
        """Zero the lengths of ``rows`` with one vectorised op (two on CUDA)."""
        # array -> frombuffer is a C copy and a zero-copy view: about 3x
        # cheaper than torch.tensor(list) for a few hundred rows.
        index_cpu = torch.frombuffer(array.array("q", rows), dtype=torch.int64)
        if not self._on_cuda:
            self._lens.index_fill_(1, index_cpu, 0)
            return
        self.alloced_lens_cpu.index_fill_(0, index_cpu, 0)
        with self._stream_context():
            index = host_to_device(index_cpu, self.device)
            self._lens.index_fill_(1, index, 0)

    def reset_rows_each(self, rows: list[int]) -> None:
        """:meth:`reset_rows` a row at a time, through views of the tables.

        Builds no index tensor, so it needs no new device memory: the
        fallback when the batched op raised (a CUDA out-of-memory error
        while it copied its index to the device). One small op per row.
        """
        lens = self._lens
        with self._stream_context():
            for row in rows:
                lens[:, row].zero_()
        if self._on_cuda:
            cpu = self.alloced_lens_cpu
            for row in rows:
                cpu[row] = 0

    def reset_where(self, mask: torch.Tensor) -> None:
        """Zero the lengths of every row where the bool ``mask`` is True."""
        if not self._on_cuda:
            self._lens.masked_fill_(mask, 0)
            return
        self.alloced_lens_cpu.masked_fill_(mask, 0)
        with self._stream_context():
            self._lens.masked_fill_(host_to_device(mask, self.device), 0)

    def reset_rows_from_1(self) -> None:
        """Zero the lengths of every row but the padding row 0: one op on CPU.

        For a bulk reset while every row is free: no index or mask to build
        (a mask over the state bytes costs several torch ops).
        """
        with self._stream_context():
            self._lens[:, 1:].zero_()
        if self._on_cuda:
            self.alloced_lens_cpu[1:].zero_()

    def reset_all(self) -> None:
        """Zero every length (``clear()`` and ``resume_memory()``)."""
        with self._stream_context():
            self._lens.zero_()
        if self._on_cuda:
            self.alloced_lens_cpu.zero_()

    def zero_tokens(self) -> None:
        with self._stream_context():
            self.req_to_token.zero_()

    def _stream_context(self) -> contextlib.AbstractContextManager[Any]:
        if self._cuda_stream is not None:
            return torch.cuda.stream(self._cuda_stream)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ memory

    def pause(self) -> None:
        """Release the ``kv_cache`` region's memory (no-op without the saver).

        On CUDA the tables' device is synchronised first: a row reset the
        pool launched (on its stream, or the current one) may still be
        queued, and torch-memory-saver unmaps the region without waiting
        for the kernels that write it.
        """
        if self._on_cuda and self.memory_saver.enabled:
            torch.cuda.synchronize(self.device)
        self.memory_saver.pause(KV_CACHE_TAG)

    def resume(self) -> None:
        """Restore the region's memory and zero it (its content is gone)."""
        self.memory_saver.resume(KV_CACHE_TAG)
        self.reset_all()
        self.zero_tokens()

    def nbytes(self) -> int:
        return (
            self.req_to_token.numel() * 4
            + self._lens.numel() * 4
            + (self.alloced_lens_cpu.numel() * 4 if self._on_cuda else 0)
        )
