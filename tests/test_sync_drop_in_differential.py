"""``ReqToTokenPool`` against the seed's pool, call for call.

The seed (tokenspeed's ``ReqToTokenPool``, README: *the seed*) is not part
of a checkout of this repository, so its observable behaviour is kept here
as a small reference model, :class:`SeedModel`, written from reading it: a
FIFO free list of rows ``1..size - 1``; ``alloc(n)`` takes the ``n`` oldest
rows and zeroes their three lengths, or answers ``None`` when fewer are
free; ``free`` appends rows (an int or a sequence) in the order given and
zeroes their lengths; ``write`` is ``req_to_token[indices] = values``;
``set_req_pool_info`` writes the two lengths, the host copy of
``alloced_len`` and the row's first ``alloced_len`` slots; ``clear``
restores the fresh free list and zeroes every length. ``req_to_token`` is
never zeroed after construction.

Seeded random sequences of calls the seed accepts (every ``alloc`` count
in ``1..capacity``, frees of allocated rows as an int, a list, a tuple or
the very list ``alloc`` returned, ``write`` in each indexing form torch
takes, ``set_req_pool_info`` with the seed's dataclass or asyncpool's and
integer scalars of any kind, engine-side writes into the length tensors,
``clear``) drive the model and the pool together; after every call the
return values, ``available_size()``, the whole of ``req_to_token`` and the
lengths of row 0 and of every allocated row must agree. A freed row's
lengths are left out on purpose: the seed zeroes them at ``free``,
asyncpool in a burst before the row is handed out again (docs/api.md,
*Deliberate differences*, "resets").

Where the seed's file is next to the checkout (``../shared/seed``, or the
file ``ASYNCPOOL_SEED_FILE`` names), the model is checked against it,
lengths of freed rows included; without it that test is skipped with the
reason shown, and the comparison with the pool still runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import random
import sys
import types
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    MemorySaverError,
    ReqToTokenPool,
    ReqToTokenPoolInfo,
)

LENS = ("verified_lens", "alloced_lens", "alloced_lens_cpu")
#: The seed's file: next to the checkout, or where ASYNCPOOL_SEED_FILE says.
SEED_FILE = Path(
    os.environ.get("ASYNCPOOL_SEED_FILE")
    or Path(__file__).resolve().parents[2] / "shared" / "seed" / "req_to_token_pool.py"
)


@dataclasses.dataclass
class SeedInfo:  # the seed's ReqToTokenPoolInfo, as an engine defines it
    verified_len: int
    alloced_len: int
    alloced_slots: torch.Tensor


class SeedModel:
    """What the seed's pool does, observably (see the module docstring)."""

    def __init__(self, size: int, max_context_len: int) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = "cpu"
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32)
        self.verified_lens = torch.zeros(size, dtype=torch.int32)
        self.alloced_lens = torch.zeros(size, dtype=torch.int32)
        self.alloced_lens_cpu = torch.zeros(size, dtype=torch.int32)
        self._free: deque[int] = deque(range(1, size))

    def _zero(self, rows: list[int]) -> None:
        for name in LENS:
            getattr(self, name)[rows] = 0

    def alloc(self, need_size: int) -> list[int] | None:
        if need_size > len(self._free):
            return None
        rows = [self._free.popleft() for _ in range(need_size)]
        self._zero(rows)
        return rows

    def free(self, free_index: int | list[int]) -> None:
        rows = [free_index] if isinstance(free_index, int) else list(free_index)
        self._free.extend(rows)
        self._zero(rows)

    def available_size(self) -> int:
        return len(self._free)

    def write(self, indices: Any, values: Any) -> None:
        self.req_to_token[indices] = values

    def set_req_pool_info(self, req_pool_idx: Any, metadata: Any) -> None:
        self.verified_lens[req_pool_idx] = metadata.verified_len
        self.alloced_lens[req_pool_idx] = metadata.alloced_len
        self.alloced_lens_cpu[req_pool_idx] = metadata.alloced_len
        self.req_to_token[req_pool_idx, : metadata.alloced_len] = metadata.alloced_slots

    def clear(self) -> None:
        self._free = deque(range(1, self.size))
        self._zero(list(range(self.size)))


def assert_same(ref: Any, pool: Any, allocated: set[int], *, every_row: bool, what: object) -> None:
    assert pool.available_size() == ref.available_size(), what
    assert (pool.size, pool.max_context_len, pool.device) == (
        ref.size,
        ref.max_context_len,
        ref.device,
    ), what
    assert torch.equal(pool.req_to_token, ref.req_to_token), what
    rows = list(range(ref.size)) if every_row else sorted(allocated | {0})
    for name in LENS:
        a, b = getattr(pool, name), getattr(ref, name)
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), (what, name)
        assert a[rows].tolist() == b[rows].tolist(), (what, name, rows)
    if hasattr(pool, "check_invariants"):
        pool.check_invariants()


def _values(rng: random.Random, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    dtype = dtype or rng.choice([torch.int32, torch.int64])
    return torch.randint(0, 10_000, shape, dtype=dtype)


def _write_args(rng: random.Random, size: int, length: int) -> tuple[Any, Any]:
    """One ``write(indices, values)`` in one of the forms engines use: any
    row (row 0 and free rows too: ``write`` is unchecked in both)."""
    row = rng.randrange(size)
    rows = list(dict.fromkeys(rng.randrange(size) for _ in range(rng.randint(1, 3))))
    lo = rng.randrange(length)
    hi = rng.randint(lo, length)
    # index_put (advanced indexing) needs the table's dtype; basic indexing casts.
    i32 = torch.int32
    form = rng.randrange(9)
    if form == 0:
        return row, _values(rng, length)
    if form == 1:
        return row, rng.randrange(10_000)
    if form == 2:
        return (row, slice(lo, hi)), _values(rng, hi - lo)
    if form == 3:
        return (row, rng.randrange(length)), rng.randrange(10_000)
    if form == 4:
        return torch.tensor(rows), _values(rng, len(rows), length, dtype=i32)
    if form == 5:
        index = torch.tensor(rows, dtype=rng.choice([torch.int32, torch.int64]))
        return (index, slice(lo, hi)), _values(rng, len(rows), hi - lo, dtype=i32)
    if form == 6:  # pool.req_to_token[rows, :n] = ..., rows a list from alloc
        return (rows, slice(lo, hi)), _values(rng, len(rows), hi - lo, dtype=i32)
    if form == 7:
        cols = torch.tensor([rng.randrange(length) for _ in rows])
        return (torch.tensor(rows), cols), _values(rng, len(rows), dtype=i32)
    return torch.rand(size, length) < 0.2, rng.randrange(10_000)


def drive(ref: Any, pool: Any, rng: random.Random, steps: int, *, every_row: bool = False) -> None:
    """``steps`` seed-valid calls on both; compare after each."""
    cap = ref.size - 1
    allocated: set[int] = set()
    handed: list[list[int]] = []  # lists alloc returned, freed as they are
    length = ref.max_context_len
    assert_same(ref, pool, allocated, every_row=True, what="fresh")
    for step in range(steps):
        op = rng.choice("aaaaffffwwwiiilsc")
        what = (step, op)
        if op == "a":
            n = rng.randint(1, cap)
            got, want = pool.alloc(n), ref.alloc(n)
            assert got == want, what
            if got is not None:
                assert type(got) is list and all(type(r) is int for r in got), what
                allocated.update(got)
                handed.append(got)
        elif op == "f" and allocated:
            whole = [rows for rows in handed if allocated.issuperset(rows)]
            form = rng.randrange(4)
            rows: Any
            if form == 0 and whole:
                rows = rng.choice(whole)  # the list object alloc returned
            else:
                rows = rng.sample(sorted(allocated), rng.randint(1, len(allocated)))
                rows = rows[0] if form == 1 else tuple(rows) if form == 2 else rows
            ref.free(rows)
            pool.free(rows)
            allocated -= {rows} if isinstance(rows, int) else set(rows)
        elif op == "w":
            indices, values = _write_args(rng, ref.size, length)
            try:
                ref.write(indices, values)
            except RuntimeError as exc:  # torch refused it: so does the pool
                with pytest.raises(type(exc)):
                    pool.write(indices, values)
            else:
                pool.write(indices, values)
        elif op == "i" and allocated:
            row = rng.choice(sorted(allocated))
            alloced = rng.randint(0, length)
            verified = rng.randint(0, alloced)
            as_int = rng.choice(AS_INT)
            slots = _values(rng, alloced)
            if not alloced and rng.random() < 0.3:
                slots = torch.tensor([])  # float32: what torch.tensor(no_slots) makes
            info_cls: Callable[..., Any] = rng.choice([SeedInfo, ReqToTokenPoolInfo])
            info = info_cls(as_int(verified), as_int(alloced), slots)
            index = rng.choice([row, np.int64(row), torch.tensor(row, dtype=torch.int32)])
            ref.set_req_pool_info(index, info)
            pool.set_req_pool_info(index, info)
        elif op == "l" and allocated:
            # The engine's own writes into the length tensors, allocated rows.
            rows = rng.sample(sorted(allocated), rng.randint(1, len(allocated)))
            value = rng.randrange(length + 1)
            for p in (ref, pool):
                p.verified_lens[rows] = value
                p.alloced_lens[rows] += 1
                p.alloced_lens_cpu[rows] += 1
        elif op == "s":
            assert pool.available_size() == ref.available_size(), what
        elif op == "c":
            ref.clear()
            pool.clear()
            allocated.clear()
            handed.clear()
            assert_same(ref, pool, allocated, every_row=True, what=what)
        assert_same(ref, pool, allocated, every_row=every_row, what=what)


#: The integer scalars an engine passes as lengths: all taken, as by the seed.
AS_INT: list[Callable[[int], Any]] = [int, np.int64, np.int32, torch.tensor]
SHAPES = [(2, 1), (3, 2), (5, 7), (9, 1), (17, 32), (40, 7), (130, 3)]


@pytest.mark.parametrize("seed", range(48))
def test_the_pool_answers_as_the_seed_does(seed: int) -> None:
    rng = random.Random(seed)
    size, length = SHAPES[seed % len(SHAPES)]
    pool = ReqToTokenPool(size, length, "cpu", False)  # the seed's positional call
    drive(SeedModel(size, length), pool, rng, steps=150)


def test_keyword_names_are_the_seeds() -> None:
    pool = ReqToTokenPool(size=5, max_context_len=4, device="cpu", enable_memory_saver=False)
    rows = pool.alloc(need_size=2)
    assert rows == [1, 2]
    pool.write(indices=(rows, slice(0, 2)), values=torch.ones(2, 2, dtype=torch.int32))
    info = SeedInfo(1, 2, torch.tensor([7, 8]))
    pool.set_req_pool_info(req_pool_idx=rows[0], metadata=info)  # type: ignore[arg-type]
    pool.free(free_index=rows)
    assert pool.available_size() == 4
    assert pool.req_to_token[1].tolist() == [7, 8, 0, 0]


@pytest.mark.parametrize("pool_cls", [ReqToTokenPool, AsyncReqToTokenPool])
def test_an_empty_float_tensor_is_no_slots(pool_cls: type) -> None:
    # torch.tensor([]) is float32: an engine that builds alloced_slots from a
    # request's empty slot list passes that with alloced_len=0. The seed
    # writes it (nothing to write); free() and the page pool already read
    # an empty tensor of any dtype as no ids. It was refused as "not a 1-D
    # integer tensor".
    pool = pool_cls(4, 8)
    row = 1
    if pool_cls is ReqToTokenPool:
        assert pool.alloc(1) == [row]
    else:
        assert pool.try_alloc(1) == [row]
    pool.set_req_pool_info(row, ReqToTokenPoolInfo(2, 3, torch.tensor([5, 6, 7])))
    pool.set_req_pool_info(row, SeedInfo(0, 0, torch.tensor([])))
    assert [int(getattr(pool, name)[row]) for name in LENS] == [0, 0, 0]
    assert pool.req_to_token[row, :3].tolist() == [5, 6, 7]  # untouched, as in the seed


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((1, 8, "cpu", False), CapacityError),  # the seed: a pool with no row to hand out
        ((0, 8, "cpu", False), CapacityError),
        ((4, 0, "cpu", False), ValueError),  # the seed: rows that hold no token
        ((4, 8, "cpu", True), MemorySaverError),  # the saver pauses CUDA memory only
    ],
)
def test_constructor_calls_the_seed_takes_and_the_readme_says_are_refused(
    args: tuple[Any, ...], error: type[Exception]
) -> None:
    with pytest.raises(error):
        ReqToTokenPool(*args)


# ------------------------------------------------- the model against the seed


@contextlib.contextmanager
def _seed_module() -> Iterator[types.ModuleType]:
    """The seed's module, with small stand-ins for the two tokenspeed helpers
    it imports (a logger and a memory-saver adapter whose region does
    nothing) and ``pin_memory`` dropped where torch has no accelerator."""
    names = (
        "tokenspeed",
        "tokenspeed.runtime",
        "tokenspeed.runtime.utils",
        "tokenspeed.runtime.utils.torch_memory_saver_adapter",
    )
    stubs = {name: types.ModuleType(name) for name in names}

    class TorchMemorySaverAdapter:
        @staticmethod
        def create(enable: bool) -> TorchMemorySaverAdapter:
            return TorchMemorySaverAdapter()

        @contextlib.contextmanager
        def region(self, tag: str, enable_cpu_backup: bool = False) -> Iterator[None]:
            yield

    stubs["tokenspeed.runtime.utils"].get_colorful_logger = logging.getLogger  # type: ignore[attr-defined]
    stubs[names[-1]].TorchMemorySaverAdapter = TorchMemorySaverAdapter  # type: ignore[attr-defined]
    spec = importlib.util.spec_from_file_location("_seed_req_to_token_pool", SEED_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    stubs[spec.name] = module  # @dataclass looks its module up there
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        spec.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    zeros: Callable[..., torch.Tensor] = torch.zeros

    def host_zeros(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return zeros(*args, pin_memory=pin_memory and torch.cuda.is_available(), **kwargs)

    module.torch = types.SimpleNamespace(  # type: ignore[attr-defined]
        zeros=host_zeros, int32=torch.int32, Tensor=torch.Tensor
    )
    yield module


@pytest.mark.skipif(
    not SEED_FILE.is_file(),
    reason=f"the seed is not next to this checkout ({SEED_FILE}): the model stands in for it",
)
@pytest.mark.parametrize("seed", range(12))
def test_the_model_is_the_seed(seed: int) -> None:
    with _seed_module() as module:
        size, length = SHAPES[seed % len(SHAPES)]
        real = module.ReqToTokenPool(size, length, "cpu", False)
        drive(SeedModel(size, length), real, random.Random(seed), steps=150, every_row=True)
