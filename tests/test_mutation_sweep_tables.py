"""Gaps found by a mechanical mutation sweep of ``tables.py``.

Each test pins one behaviour that an ``ast``-generated mutant broke while
every test file that exercises the module still passed:

* ``max_context_len`` is accepted up to ``2**31 - 1`` inclusive (the
  mutants moved ``MAX_CONTEXT_LEN`` to ``2**31 - 2`` or ``2**30 - 1``, or
  refused the bound itself), checked with the allocation stubbed out (the
  real tables would be 8 GiB a row);
* ``max_context_len=1`` is accepted: a one-token context is a pool (the
  mutants refused 1 with the ``ValueError`` for non-positive lengths);
* on the host, ``alloced_lens`` and ``alloced_lens_cpu`` are distinct
  tensors, as the seed's are: an engine that writes one directly does not
  change the other (the mutants made them views of the same row);
* ``check_row`` takes row 0 (``generation(np.int64(0))`` answers, and
  ``set_req_pool_info(0, ...)`` says the row is reserved padding, not out
  of range) and refuses row ``size`` with :class:`InvalidSlotError` (the
  mutants refused 0, or let ``size`` through to an ``IndexError``);
* ``alloced_slots`` holding ``-1`` is refused, writing nothing (the mutant
  let ``-1`` through to ``req_to_token``: a token slot id no KV page has);
* a ``uint64`` slot past ``2**63 - 1`` next to a slot ``0`` is reported
  with its own value (the mutants counted the ``0`` among the values that
  wrapped negative and reported ``2**64``, a value the tensor does not hold);
* ``alloced_len=-1`` is reported as a bad ``alloced_len`` (the mutant let
  it through to the ``verified_len`` check, whose message blames the wrong
  field).

CUDA (marked ``cuda``: skipped here, not yet run on a GPU): ``reset_rows_each``,
``reset_where`` and ``reset_rows_from_1`` on a CUDA table zero the device
lengths and the pinned host copy of exactly the rows named (CUDA-only
mutants dropped the host copy's zeroing, or zeroed the wrong rows).

Bug fix (not a mutant): ``alloced_slots`` of a quantized dtype passed every
check, then the copy into ``req_to_token`` raised a ``RuntimeError`` after the
row's lengths were written (the README promises ``InvalidSlotError``, nothing
written); a sub-byte dtype (``int4``, ``bits8``) raised ``NotImplementedError``.
Both are now refused with the other non-integer dtypes; the eight integer
dtypes, signed and unsigned, are all still taken.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from asyncpool import InvalidSlotError, ReqToTokenPool, ReqToTokenPoolInfo
from asyncpool import tables as tables_mod
from asyncpool.tables import TokenTables


def info(verified: int, alloced: int, start: int = 10) -> ReqToTokenPoolInfo:
    return ReqToTokenPoolInfo(
        verified, alloced, torch.arange(start, start + alloced, dtype=torch.int32)
    )


def test_max_context_len_is_accepted_up_to_2_31_minus_1(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tables_mod.MAX_CONTEXT_LEN == 2**31 - 1
    monkeypatch.setattr(TokenTables, "_allocate", lambda self: None)
    t = TokenTables(2, 2**31 - 1)
    assert t.max_context_len == 2**31 - 1
    with pytest.raises(ValueError, match=r"at most 2\*\*31 - 1"):
        TokenTables(2, 2**31)


def test_a_one_token_context_is_a_pool() -> None:
    pool = ReqToTokenPool(3, 1)
    (row,) = pool.alloc(1) or []
    pool.set_req_pool_info(row, info(1, 1, start=7))
    assert pool.req_to_token[row].tolist() == [7]
    assert (int(pool.verified_lens[row]), int(pool.alloced_lens[row])) == (1, 1)


def test_alloced_lens_and_its_host_copy_are_distinct_tensors() -> None:
    pool = ReqToTokenPool(4, 8)
    (row,) = pool.alloc(1) or []
    pool.set_req_pool_info(row, info(2, 3))
    # An engine writes the device tensor in its forward step...
    pool.alloced_lens[row] = 5
    assert int(pool.alloced_lens_cpu[row]) == 3
    # ...and the host copy from the scheduler, each on its own.
    pool.alloced_lens_cpu[row] = 6
    assert int(pool.alloced_lens[row]) == 5
    assert int(pool.verified_lens[row]) == 2
    for a, b in [
        (pool.verified_lens, pool.alloced_lens),
        (pool.verified_lens, pool.alloced_lens_cpu),
        (pool.alloced_lens, pool.alloced_lens_cpu),
    ]:
        assert a.data_ptr() != b.data_ptr()


def test_check_row_takes_row_0_and_refuses_row_size() -> None:
    pool = ReqToTokenPool(4, 8)
    t = pool._tables
    assert t.check_row(np.int64(0)) == 0
    assert t.check_row(torch.tensor(3)) == 3
    assert pool.generation(np.int64(0)) == 0
    with pytest.raises(InvalidSlotError, match="reserved padding"):
        pool.set_req_pool_info(0, info(1, 1))
    for bad in (4, np.int64(4), torch.tensor(4), -1):
        with pytest.raises(InvalidSlotError, match="out of range"):
            t.check_row(bad)
    with pytest.raises(InvalidSlotError):
        pool.generation(np.int64(4))
    with pytest.raises(InvalidSlotError):
        pool.set_req_pool_info(4, info(1, 1))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_slot_id_of_minus_1_is_refused_writing_nothing(dtype: torch.dtype) -> None:
    pool = ReqToTokenPool(4, 8)
    (row,) = pool.alloc(1) or []
    slots = torch.tensor([3, -1, 4], dtype=dtype)
    with pytest.raises(InvalidSlotError, match="holds -1"):
        pool.set_req_pool_info(row, ReqToTokenPoolInfo(1, 3, slots))
    assert not pool.req_to_token[row].any()
    assert (int(pool.verified_lens[row]), int(pool.alloced_lens[row])) == (0, 0)


def test_a_negative_alloced_len_is_reported_as_such() -> None:
    pool = ReqToTokenPool(4, 8)
    (row,) = pool.alloc(1) or []
    bad = ReqToTokenPoolInfo(0, -1, torch.zeros(0, dtype=torch.int32))
    with pytest.raises(InvalidSlotError, match=r"alloced_len -1 for row"):
        pool.set_req_pool_info(row, bad)


def test_a_uint64_slot_past_int64_is_reported_as_itself_next_to_a_zero() -> None:
    pool = ReqToTokenPool(4, 8)
    (row,) = pool.alloc(1) or []
    value = 2**63 + 5
    slots = torch.tensor([0, value, 0], dtype=torch.uint64)
    with pytest.raises(InvalidSlotError, match=rf"holds {value}, outside"):
        pool.set_req_pool_info(row, ReqToTokenPoolInfo(1, 3, slots))
    assert not pool.req_to_token[row].any()


# ------------------------------------------------- CUDA (not run without a GPU)


@pytest.mark.cuda
@pytest.mark.parametrize("reset", ["each", "where", "from_1"])
def test_every_cuda_reset_path_zeroes_the_device_lengths_and_the_host_copy(reset: str) -> None:
    """The three reset paths no other CUDA test takes (``reset_rows`` and
    ``reset_all`` have theirs): the device lengths, zeroed on the tables'
    stream, and the pinned host copy, zeroed at once, of exactly the rows
    named (row 0, the padding, included only where named)."""
    stream = torch.cuda.Stream()
    t = TokenTables(6, 8, device="cuda", stream=stream)
    slots = torch.arange(2, dtype=torch.int32, device="cuda")
    for r in range(6):
        t.set_req_pool_info(r, ReqToTokenPoolInfo(1, 2, slots))
    torch.cuda.synchronize()
    zeroed = {2, 4}
    if reset == "each":
        t.reset_rows_each([2, 4])
    elif reset == "where":
        mask = torch.zeros(6, dtype=torch.bool)
        mask[[2, 4]] = True
        t.reset_where(mask)
    else:
        t.reset_rows_from_1()
        zeroed = {1, 2, 3, 4, 5}
    assert t.alloced_lens_cpu.tolist() == [0 if r in zeroed else 2 for r in range(6)]
    stream.synchronize()
    torch.cuda.synchronize()
    assert t.verified_lens.tolist() == [0 if r in zeroed else 1 for r in range(6)]
    assert t.alloced_lens.tolist() == [0 if r in zeroed else 2 for r in range(6)]


# ---------------------------------------------------------------- bug fix


_QUANTIZED = (torch.qint8, torch.quint8, torch.qint32)


def _slots_of(dtype: torch.dtype) -> torch.Tensor:
    """Three slots of ``dtype``: quantized, or sub-byte (no data ops at all)."""
    if dtype in _QUANTIZED:
        with warnings.catch_warnings():  # quantized tensors are deprecated in torch
            warnings.simplefilter("ignore")
            return torch.quantize_per_tensor(torch.tensor([1.0, 2.0, 3.0]), 1.0, 0, dtype)
    return torch.empty(3, dtype=dtype)


@pytest.mark.parametrize("dtype", [*_QUANTIZED, torch.int4, torch.uint4, torch.bits8], ids=str)
def test_slots_of_a_dtype_req_to_token_cannot_take_are_refused_writing_nothing(
    dtype: torch.dtype,
) -> None:
    pool = ReqToTokenPool(4, 8)
    (row,) = pool.alloc(1) or []
    pool.set_req_pool_info(row, info(1, 2, start=20))
    before = (pool.verified_lens.tolist(), pool.alloced_lens.tolist(), pool.req_to_token.tolist())
    with pytest.raises(InvalidSlotError, match="1-D integer tensor"):
        pool.set_req_pool_info(row, ReqToTokenPoolInfo(1, 3, _slots_of(dtype)))
    after = (pool.verified_lens.tolist(), pool.alloced_lens.tolist(), pool.req_to_token.tolist())
    assert after == before
    assert pool.alloced_lens_cpu.tolist() == pool.alloced_lens.tolist()


@pytest.mark.parametrize(
    "dtype",
    [
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    ],
    ids=str,
)
def test_slots_of_every_integer_dtype_are_taken(dtype: torch.dtype) -> None:
    pool = ReqToTokenPool(4, 8)
    (row,) = pool.alloc(1) or []
    pool.set_req_pool_info(row, ReqToTokenPoolInfo(2, 3, torch.tensor([7, 0, 120], dtype=dtype)))
    assert pool.req_to_token[row, :4].tolist() == [7, 0, 120, 0]
    assert (int(pool.verified_lens[row]), int(pool.alloced_lens_cpu[row])) == (2, 3)
