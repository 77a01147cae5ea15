"""``KVPagePool.free`` of more ids than the pool has pages is refused with
the typed error for its first bad id, reading no more than ``capacity + 1``
of them, and changes nothing.

More than ``capacity`` ids can never be distinct pages in range, but free
converted the whole input first: a zero-stride ``expand`` or
``np.broadcast_to`` of 2**40 ids (a view of one element) was copied to an
8 TiB int64 array and ``range(1, 2**40)`` listed, each raising a raw
``MemoryError`` where the docstring promises ``InvalidSlotError`` for
duplicates and ids out of range.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from asyncpool import DoubleFreeError, InvalidSlotError, KVPagePool

HUGE = 2**40
DUP = "page 3 appears more than once"

CASES: list[tuple[str, Callable[[], Any], str]] = [
    ("expanded tensor", lambda: torch.tensor([3]).expand(HUGE), DUP),
    ("broadcast array", lambda: np.broadcast_to(np.int64(3), (HUGE,)), DUP),
    ("expanded int32 tensor", lambda: torch.tensor([3], dtype=torch.int32).expand(HUGE), DUP),
    ("expanded float tensor", lambda: torch.tensor([1.5]).expand(HUGE), "must be integers"),
    ("range", lambda: range(1, HUGE), "page 6 was never allocated"),
    ("range past int64", lambda: range(1, 2**70), "page 6 was never allocated"),
    ("generator", lambda: (3 for _ in range(HUGE)), DUP),
]


@pytest.mark.parametrize(("make", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_more_ids_than_pages_is_refused_typed_and_uncopied(make: Any, match: str) -> None:
    kv = KVPagePool(16, 2)
    pages = kv.alloc(5)  # pages 1..5
    assert pages is not None
    before = kv.ledger.states()
    with pytest.raises(InvalidSlotError, match=match):
        kv.free(make())
    assert (kv.ledger.states() == before).all()
    kv.check_invariants()
    assert kv.free(pages) == 5


def test_the_error_is_the_one_for_the_first_bad_id() -> None:
    # As for any other call: the first bad id, in the call's order, names
    # the error, also when the input is longer than the pool.
    kv = KVPagePool(8, 2)
    pages = kv.alloc(7)
    assert pages is not None
    kv.free(pages[:1])  # page 1 free now
    long = torch.cat([pages[1:], torch.tensor([1]), torch.arange(2, 100)])
    with pytest.raises(DoubleFreeError, match="page 1 is already free"):
        kv.free(long)
    with pytest.raises(DoubleFreeError, match="page 1 is already free"):
        kv.free(long.numpy())
    with pytest.raises(DoubleFreeError, match="page 1 is already free"):
        kv.free(long.tolist())
    with pytest.raises(DoubleFreeError, match="page 1 is already free"):
        kv.free(iter(long.tolist()))
    kv.check_invariants()
    assert kv.allocated_size() == 6
