"""TokenTables and the memory-saver adapter: writes, validation, resets, and
the CPU refusal of ``enable_memory_saver=True``."""

from __future__ import annotations

import pytest
import torch
from helpers import gpu_busy

from asyncpool import (
    AsyncReqToTokenPool,
    HostStream,
    MemorySaverError,
    ReqToTokenPool,
    ReqToTokenPoolInfo,
    record_fence,
)
from asyncpool.tables import MemorySaverAdapter, TokenTables

no_cuda = pytest.mark.usefixtures("without_cuda")  # the CPU-only refusals, on any machine


def info(verified: int, alloced: int, start: int = 10) -> ReqToTokenPoolInfo:
    return ReqToTokenPoolInfo(
        verified, alloced, torch.arange(start, start + alloced, dtype=torch.int32)
    )


def test_tables_shapes_and_zero_start():
    t = TokenTables(5, 8)
    assert t.req_to_token.shape == (5, 8) and t.req_to_token.dtype == torch.int32
    for x in (t.verified_lens, t.alloced_lens, t.alloced_lens_cpu):
        assert x.shape == (5,) and x.dtype == torch.int32
        assert not x.any()
    assert not t.req_to_token.any()
    assert t.nbytes() == 5 * 8 * 4 + 3 * 5 * 4


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8", None])
def test_max_context_len_must_be_positive_int(bad):
    with pytest.raises(ValueError):
        TokenTables(5, bad)


def test_set_req_pool_info_writes_lengths_and_leading_slots():
    t = TokenTables(4, 8)
    t.req_to_token[2].fill_(-7)
    t.set_req_pool_info(2, info(2, 5))
    assert int(t.verified_lens[2]) == 2
    assert int(t.alloced_lens[2]) == 5
    assert int(t.alloced_lens_cpu[2]) == 5
    assert t.req_to_token[2].tolist() == [10, 11, 12, 13, 14, -7, -7, -7]
    # Other rows untouched.
    assert not t.verified_lens[[0, 1, 3]].any()
    assert not t.req_to_token[[0, 1, 3]].any()


@pytest.mark.parametrize("cls", [ReqToTokenPool, AsyncReqToTokenPool])
def test_set_req_pool_info_takes_slots_from_req_to_token_itself(cls):
    """A row's own slots shifted (dropping a prefix): the source overlaps
    the destination, which torch refuses to copy; the pool copies from a
    clone. Found by a review: the lengths were written, then the copy raised
    torch's RuntimeError."""
    pool = cls(4, 8)
    row = pool.try_alloc(1)[0] if cls is AsyncReqToTokenPool else pool.alloc(1)[0]
    pool.set_req_pool_info(row, info(4, 5))  # slots 10..14
    pool.set_req_pool_info(row, ReqToTokenPoolInfo(1, 3, pool.req_to_token[row, 1:4]))
    assert pool.req_to_token[row, :5].tolist() == [11, 12, 13, 13, 14]
    assert (int(pool.verified_lens[row]), int(pool.alloced_lens[row])) == (1, 3)
    assert int(pool.alloced_lens_cpu[row]) == 3


def test_set_req_pool_info_writes_no_length_when_the_slot_copy_raises(monkeypatch):
    """The slots are copied before the lengths are written: a copy that
    raises leaves the row as it was."""
    import asyncpool.tables as tables

    t = TokenTables(4, 8)
    t.set_req_pool_info(1, info(4, 5))
    before = (t.req_to_token.clone(), t.verified_lens.clone(), t.alloced_lens.clone())
    monkeypatch.setattr(tables, "_shares_storage", lambda a, b: False)  # no clone
    with pytest.raises(RuntimeError):
        t.set_req_pool_info(1, ReqToTokenPoolInfo(1, 3, t.req_to_token[1, 1:4]))
    assert torch.equal(t.req_to_token, before[0])
    assert torch.equal(t.verified_lens, before[1]) and torch.equal(t.alloced_lens, before[2])
    assert int(t.alloced_lens_cpu[1]) == 5


def test_set_req_pool_info_full_context_is_allowed():
    t = TokenTables(3, 4)
    t.set_req_pool_info(1, info(4, 4))
    assert t.req_to_token[1].tolist() == [10, 11, 12, 13]


@pytest.mark.parametrize(
    "bad",
    [
        ReqToTokenPoolInfo(1, 9, torch.arange(9, dtype=torch.int32)),  # past max_context_len
        ReqToTokenPoolInfo(0, -1, torch.arange(0, dtype=torch.int32)),
        ReqToTokenPoolInfo(3, 2, torch.arange(2, dtype=torch.int32)),  # verified > alloced
        ReqToTokenPoolInfo(-1, 2, torch.arange(2, dtype=torch.int32)),
        ReqToTokenPoolInfo(1, 3, torch.arange(2, dtype=torch.int32)),  # slot count mismatch
    ],
    ids=["past-max", "neg-alloced", "verified-gt-alloced", "neg-verified", "slot-count"],
)
def test_set_req_pool_info_rejects_bad_metadata_without_writing(bad):
    t = TokenTables(4, 8)
    with pytest.raises(ValueError):
        t.set_req_pool_info(1, bad)
    assert not t.verified_lens.any() and not t.alloced_lens.any()
    assert not t.alloced_lens_cpu.any() and not t.req_to_token.any()


def test_pool_set_req_pool_info_past_max_context_len_raises():
    pool = ReqToTokenPool(4, 8, "cpu", False)
    [row] = pool.alloc(1)
    with pytest.raises(ValueError):
        pool.set_req_pool_info(row, info(1, 9))
    assert int(pool.alloced_lens[row]) == 0
    pool.set_req_pool_info(row, info(1, 8))
    assert int(pool.alloced_lens[row]) == 8


def test_write_is_the_seed_raw_write():
    pool = ReqToTokenPool(4, 8, "cpu", False)
    pool.write((1, slice(0, 3)), torch.tensor([7, 8, 9], dtype=torch.int32))
    assert pool.req_to_token[1, :4].tolist() == [7, 8, 9, 0]
    pool.write(torch.tensor([2, 3]), torch.full((2, 8), 4, dtype=torch.int32))
    assert pool.req_to_token[2:].eq(4).all()
    pool.write((torch.tensor([1]), torch.tensor([5])), torch.tensor([42], dtype=torch.int32))
    assert int(pool.req_to_token[1, 5]) == 42
    assert int(pool.req_to_token[0].abs().sum()) == 0


def test_reset_rows_zeroes_only_those_rows_lengths():
    t = TokenTables(6, 4)
    for r in range(1, 6):
        t.set_req_pool_info(r, info(1, 2))
    t.reset_rows([2, 4])
    for r in range(1, 6):
        want = 0 if r in (2, 4) else 1
        assert int(t.verified_lens[r]) == want
        assert int(t.alloced_lens[r]) == 2 * want
        assert int(t.alloced_lens_cpu[r]) == 2 * want
    # Token slots are not part of the reset (the seed does not clear them).
    assert t.req_to_token[2, :2].tolist() == [10, 11]


def test_reset_all_and_zero_tokens():
    t = TokenTables(4, 4)
    for r in range(1, 4):
        t.set_req_pool_info(r, info(1, 3))
    t.reset_all()
    assert not t.verified_lens.any() and not t.alloced_lens.any()
    assert not t.alloced_lens_cpu.any()
    assert t.req_to_token.any()
    t.zero_tokens()
    assert not t.req_to_token.any()


def test_pool_tensor_attributes_are_the_tables():
    pool = ReqToTokenPool(4, 4, "cpu", False)
    tables = pool._tables
    assert pool.req_to_token is tables.req_to_token
    assert pool.verified_lens is tables.verified_lens
    assert pool.alloced_lens is tables.alloced_lens
    assert pool.alloced_lens_cpu is tables.alloced_lens_cpu


# ---------------------------------------------------------------- memory saver


def test_memory_saver_disabled_is_a_noop():
    m = MemorySaverAdapter.create(False)
    assert not m.enabled
    with m.region("kv_cache"):
        x = torch.zeros(3)
    m.pause("kv_cache")
    m.resume("kv_cache")
    assert x.shape == (3,)


@no_cuda
def test_memory_saver_enabled_on_cpu_raises():
    with pytest.raises(MemorySaverError, match="CUDA"):
        MemorySaverAdapter.create(True)
    assert issubclass(MemorySaverError, RuntimeError)


@no_cuda
def test_pools_refuse_memory_saver_without_cuda():
    with pytest.raises(MemorySaverError):
        TokenTables(4, 4, enable_memory_saver=True)
    with pytest.raises(MemorySaverError):
        ReqToTokenPool(4, 4, "cpu", True)
    with pytest.raises(MemorySaverError):
        AsyncReqToTokenPool(4, 4, enable_memory_saver=True)


def test_memory_saver_with_tables_off_cuda_is_refused_on_a_cuda_machine(monkeypatch):
    # On a GPU machine device="cpu" with the saver passed: nothing it could
    # pause, and the saver's process-wide hook mode was set for nothing.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    created = []
    monkeypatch.setattr(MemorySaverAdapter, "create", classmethod(lambda cls, e: created.append(e)))
    for make in (
        lambda: TokenTables(4, 4, "cpu", True),
        lambda: ReqToTokenPool(4, 4, "cpu", True),
        lambda: AsyncReqToTokenPool(4, 4, device="cpu", enable_memory_saver=True),
    ):
        with pytest.raises(MemorySaverError, match="needs device='cuda'"):
            make()
    assert created == []


# ---------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_tables_on_cuda_device():
    stream = torch.cuda.Stream()
    t = TokenTables(6, 8, device="cuda", stream=stream)
    assert t.req_to_token.is_cuda and t.verified_lens.is_cuda and t.alloced_lens.is_cuda
    assert not t.alloced_lens_cpu.is_cuda and t.alloced_lens_cpu.is_pinned()
    slots = torch.arange(5, dtype=torch.int32, device="cuda")
    t.set_req_pool_info(2, ReqToTokenPoolInfo(3, 5, slots))
    t.set_req_pool_info(4, ReqToTokenPoolInfo(1, 2, slots[:2]))
    torch.cuda.synchronize()  # the writes ran on the current stream, resets on `stream`
    t.reset_rows([2])
    stream.synchronize()
    torch.cuda.synchronize()
    assert t.verified_lens.tolist() == [0, 0, 0, 0, 1, 0]
    assert t.alloced_lens.tolist() == [0, 0, 0, 0, 2, 0]
    assert t.alloced_lens_cpu.tolist() == [0, 0, 0, 0, 2, 0]
    t.reset_all()
    stream.synchronize()
    assert not t.alloced_lens.any() and not t.alloced_lens_cpu.any()


@pytest.mark.cuda
def test_sync_pool_on_cuda_defers_free_behind_cuda_fence():
    stream = torch.cuda.Stream()
    pool = ReqToTokenPool(4, 8, "cuda", False, stream=stream)
    rows = pool.alloc(3)
    with torch.cuda.stream(stream):
        gpu_busy(300)
        pool.verified_lens[rows[0] : rows[0] + 1].fill_(7)  # the late write of a step in flight
    f = record_fence(stream)
    pool.record_use(rows, f)
    assert pool.free(rows[:1]) == 0
    assert pool.alloc(1) is None
    f.synchronize()
    assert pool.alloc(1) == rows[:1]
    stream.synchronize()
    torch.cuda.synchronize()
    assert int(pool.verified_lens[rows[0]]) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("stream", ["forward", 7, "a HostStream", "a device-generic torch.Stream"])
def test_a_cuda_pool_refuses_a_stream_that_is_not_a_cuda_stream(stream):
    # It was ignored: resets went to whatever stream was current.
    with HostStream() as host:
        value = {
            "a HostStream": host,
            "a device-generic torch.Stream": torch.Stream(device="cuda"),
        }.get(stream, stream)
        for make in (
            lambda: TokenTables(4, 4, "cuda", stream=value),
            lambda: ReqToTokenPool(4, 4, "cuda", stream=value),
            lambda: AsyncReqToTokenPool(4, 4, device="cuda", stream=value),
        ):
            with pytest.raises(TypeError, match=r"must be a torch\.cuda\.Stream"):
                make()


@pytest.mark.cuda
def test_memory_saver_enabled_on_cuda_creates_region():
    # torch-memory-saver is a dependency (no importorskip). Its region may
    # need a set-up this machine lacks (its LD_PRELOAD hook): a skip, saying
    # so. An error of ours in calling it (a wrong argument, a missing
    # attribute) fails the test rather than hide behind that skip.
    try:
        pool = ReqToTokenPool(4, 8, "cuda", True)
    except MemorySaverError as exc:  # pragma: no cover - needs LD_PRELOAD setup
        if isinstance(exc.__cause__, (TypeError, AttributeError)):
            raise
        pytest.skip(f"torch-memory-saver's region needs a set-up missing here: {exc}")
    assert pool._tables.memory_saver.enabled
    assert pool.req_to_token.is_cuda


def test_host_stream_is_not_a_cuda_stream_for_tables():
    # A HostStream given as the pool's stream on CPU is accepted and unused.
    with HostStream() as s:
        t = TokenTables(3, 2, stream=s)
        t.reset_rows([1])
        assert t._cuda_stream is None


@pytest.mark.parametrize("bad", ["x", 0, object()])
def test_a_stream_that_is_no_stream_is_refused_off_cuda(bad: object) -> None:
    """Off CUDA the pool's ``stream=`` is unused, but a typo there would
    surface only on a GPU: anything but a HostStream, a torch stream or None
    is a ``TypeError`` at construction, on every pool that takes one."""
    for make in (
        lambda: TokenTables(3, 2, stream=bad),
        lambda: ReqToTokenPool(3, 2, stream=bad),
        lambda: AsyncReqToTokenPool(3, 2, stream=bad),
    ):
        with pytest.raises(TypeError, match=r"stream= must be the forward stream"):
            make()
