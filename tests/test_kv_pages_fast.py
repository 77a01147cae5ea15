"""KVPagePool's fast paths (issue 9, "Speed") against its checked path.

``alloc(1)`` inlines ``take(1)``; ``take`` marks up to a few pages with a
Python step each; ``free`` of a tensor skips :meth:`PageLedger.prepare`: one
page is checked and freed inline, up to ``_TINY`` pages of an int64 tensor in
one Python pass (:meth:`PageLedger._free_now_small`), more through the
vectorised check on the tensor's zero-copy numpy view. Each must leave the
ledger exactly as the checked path does, and refuse exactly what it refuses,
with the same error, changing nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from helpers import FakeStream
from test_kv_pages import snapshot

from asyncpool import DoubleFreeError, InvalidSlotError, KVPagePool, PoolError
from asyncpool.kv_pages import _HANDED_SLACK, _TINY, PageLedger

# ---------------------------------------------------------------- equivalence


def _reference_alloc(led: PageLedger, n: int) -> list[int] | None:
    pages = led.take(n)
    return None if pages is None else pages.tolist()


def _reference_free(led: PageLedger, pages: list[int]) -> int:
    ids, owned = led.prepare(list(pages))
    return led.free_prepared(ids, owned)


FORMS: list[tuple[str, Callable[[list[int]], Any]]] = [
    ("int64 tensor", lambda p: torch.tensor(p, dtype=torch.int64)),
    ("int32 tensor", lambda p: torch.tensor(p, dtype=torch.int32)),
    ("list", list),
    ("ndarray", lambda p: np.array(p, dtype=np.int64)),
    ("strided tensor", lambda p: torch.tensor(p, dtype=torch.int64).repeat_interleave(2)[::2]),
]


@pytest.mark.parametrize("seed", range(6))
def test_fast_paths_leave_the_ledger_as_the_checked_path_does(seed):
    rng = random.Random(seed)
    fast = KVPagePool(97, 4)
    slow = KVPagePool(97, 4)
    held: list[list[int]] = []
    for _ in range(300):
        if held and (rng.random() < 0.5 or fast.available_size() < 40):
            pages = held.pop(rng.randrange(len(held)))
            form = FORMS[rng.randrange(len(FORMS))][1]
            assert fast.free(form(pages)) == _reference_free(slow.ledger, pages) == len(pages)
        else:
            n = rng.choice([1, 1, 2, 3, 7, 8, 9, 15, 16, 17, 30])
            got = fast.alloc(n)
            want = _reference_alloc(slow.ledger, n)
            assert got is not None and want is not None
            assert got.dtype == torch.int64 and got.shape == (n,)
            assert got.tolist() == want
            held.append(want)
        assert snapshot(fast) == snapshot(slow)


def test_one_page_alloc_wraps_the_ring_and_tracks_the_peak():
    kv = KVPagePool(4, 1)  # capacity 3
    seen = []
    for _ in range(7):
        page = kv.alloc(1)
        assert page is not None
        seen.append(int(page))
        kv.free(page)
        kv.check_invariants()
    assert seen == [1, 2, 3, 1, 2, 3, 1]
    assert kv.stats().peak_allocated == 1
    held = [kv.alloc(1) for _ in range(3)]
    assert kv.stats().peak_allocated == 3 and kv.alloc(1) is None
    assert all(p is not None for p in held)


def test_one_page_alloc_reclaims_before_answering_none():
    kv = KVPagePool(3, 1)
    fs = FakeStream()
    a = kv.alloc(2)
    kv.free(a, fence=fs.record())
    assert kv.alloc(1) is None
    fs.complete()
    page = kv.alloc(1)
    assert page is not None and page.tolist() == [1]
    kv.check_invariants()


@pytest.mark.parametrize("n", [1, 5, _TINY, _TINY + 1, 40])
def test_free_of_an_int64_tensor_skips_prepare(n, monkeypatch):
    """The fast paths are taken: with prepare broken, freeing what alloc
    handed out still works (and the pool stays consistent)."""
    kv = KVPagePool(64, 4)
    pages = kv.alloc(n)

    def broken(*args: object, **kwargs: object) -> None:
        raise AssertionError("the checked path was taken")

    monkeypatch.setattr(kv.ledger, "prepare", broken)
    assert kv.free(pages) == n
    kv.check_invariants()
    assert kv.available_size() == 63


def test_one_page_alloc_does_not_call_take(monkeypatch):
    kv = KVPagePool(8, 4)

    def broken(n: int) -> None:
        raise AssertionError("take was called")

    monkeypatch.setattr(kv.ledger, "take", broken)
    page = kv.alloc(1)
    assert page is not None and page.tolist() == [1]
    kv.check_invariants()


# ---------------------------------------------------------------- bad input, every path

# 64 pages: 1..20 "good" (allocated, kept), 21..49 allocated, 50 free,
# 51..52 pending behind a fence, 53 quarantined, 54..63 never allocated.
BAD_IDS: list[tuple[str, list[int]]] = [
    ("page 0", [0]),
    ("negative", [-1]),
    ("negative wraps to an allocated page", [5 - 64]),
    ("most negative", [-(2**63)]),
    ("out of range", [64]),
    ("huge", [2**40]),
    ("int64 max", [2**63 - 1]),
    ("already free", [50]),
    ("pending", [51]),
    ("quarantined", [53]),
    ("never allocated", [60]),
    ("duplicate, adjacent", [7, 7]),
    ("duplicate, far apart", [3, 4, 5, 6, 3]),
    ("duplicate at the end of many", [*range(1, 17), 16]),
]
PLACES = ["alone", "first", "middle", "last"]


def _state_for_bad_ids() -> tuple[KVPagePool, FakeStream]:
    kv = KVPagePool(64, 4)
    assert kv.alloc(53) is not None  # 1..53
    fs = FakeStream()
    kv.free([50])
    kv.free([51, 52], fence=fs.record())
    bad = FakeStream()
    f = bad.record()
    bad.fault()
    kv.free([53], fence=f)
    assert kv.ledger.state_of(50) == "free"
    assert kv.ledger.state_of(51) == "pending"
    assert kv.ledger.state_of(53) == "quarantined"
    assert kv.ledger.state_of(60) == "free"
    return kv, fs


def _place(bad: list[int], place: str) -> list[int]:
    good = [21, 22, 23]
    return {
        "alone": bad,
        "first": [*bad, *good],
        "middle": [good[0], *bad, *good[1:]],
        "last": [*good, *bad],
    }[place]


def _forms(ids: list[int]) -> list[tuple[str, Any]]:
    """``ids`` in every form, each reaching a different path of free."""
    out: list[tuple[str, Any]] = [("list", list(ids))]
    if all(-(2**63) <= i < 2**63 for i in ids):
        t = torch.tensor(ids, dtype=torch.int64)
        out.append(("int64 tensor", t))  # one page inline / _free_now_small
        out.append(("ndarray", t.numpy().copy()))
        # Past _TINY ids: the vectorised check on the tensor's numpy view.
        # The padding (24..) comes after, so the first bad id stays first.
        pad = list(range(24, 24 + _TINY + 1))
        if not set(pad) & set(ids):
            out.append(("long int64 tensor", torch.tensor([*ids, *pad], dtype=torch.int64)))
    return out


def _expected(kv: KVPagePool, arg: Any) -> tuple[type[BaseException], str]:
    """What the checked path (prepare) raises for ``arg``, as a list of ints."""
    ids = arg.tolist() if hasattr(arg, "tolist") else list(arg)
    with pytest.raises(PoolError) as ei:
        kv.ledger.prepare(ids)
    return type(ei.value), str(ei.value)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("bad", [pytest.param(b, id=d) for d, b in BAD_IDS])
def test_every_path_refuses_bad_ids_as_the_checked_path_and_changes_nothing(bad, place):
    kv, _ = _state_for_bad_ids()
    ids = _place(bad, place)
    before = snapshot(kv)
    for form, arg in _forms(ids):
        kind, message = _expected(kv, arg)
        with pytest.raises(kind) as ei:
            kv.free(arg)
        assert str(ei.value) == message, form
        assert isinstance(ei.value, ValueError)
        assert snapshot(kv) == before, form
    # Still serving: the good pages free through the fast paths.
    assert kv.free(torch.tensor([21])) == 1
    assert kv.free(torch.tensor([22, 23])) == 2
    kv.check_invariants()


def test_double_free_through_each_fast_path_is_a_double_free_error():
    kv = KVPagePool(64, 4)
    for n in (1, 5, _TINY + 4):
        pages = kv.alloc(n)
        assert pages is not None
        assert kv.free(pages) == n
        before = snapshot(kv)
        with pytest.raises(DoubleFreeError):
            kv.free(pages)
        assert snapshot(kv) == before


class _Sub(torch.Tensor):
    pass


ODD_TENSORS: list[tuple[str, Callable[[], torch.Tensor], type[BaseException] | None]] = [
    # (description, tensor, error or None when it frees page 21 (and 22))
    ("bool, one element", lambda: torch.tensor([True]), InvalidSlotError),
    ("bool, three elements", lambda: torch.tensor([True, False, True]), InvalidSlotError),
    ("float, one element", lambda: torch.tensor([21.0]), InvalidSlotError),
    ("float, two elements", lambda: torch.tensor([21.0, 22.0]), InvalidSlotError),
    ("complex, one element", lambda: torch.tensor([21 + 0j]), InvalidSlotError),
    ("2-D (1, 1)", lambda: torch.tensor([[21]]), InvalidSlotError),
    ("2-D (2, 1)", lambda: torch.tensor([[21], [22]]), InvalidSlotError),
    ("2-D (1, 2)", lambda: torch.tensor([[21, 22]]), InvalidSlotError),
    ("2-D (0, 3)", lambda: torch.zeros(0, 3, dtype=torch.int64), InvalidSlotError),
    ("2-D (2, 0)", lambda: torch.zeros(2, 0, dtype=torch.int64), InvalidSlotError),
    ("2-D, many", lambda: torch.arange(21, 21 + 2 * _TINY).reshape(2, _TINY), InvalidSlotError),
    ("uint64 past 2**63", lambda: torch.tensor([2**63], dtype=torch.uint64), InvalidSlotError),
    ("0-d int64", lambda: torch.tensor(21), None),
    ("uint8, one element", lambda: torch.tensor([21], dtype=torch.uint8), None),
    ("int16, two elements", lambda: torch.tensor([21, 22], dtype=torch.int16), None),
    ("a tensor subclass", lambda: torch.tensor([21, 22]).as_subclass(_Sub), None),
    ("non-contiguous, long", lambda: torch.arange(1, 1 + 2 * _TINY + 2)[::2], None),
]


@pytest.mark.parametrize("build, error", [pytest.param(b, e, id=d) for d, b, e in ODD_TENSORS])
def test_odd_tensors_go_the_checked_way(build, error):
    kv, _ = _state_for_bad_ids()
    arg = build()
    before = snapshot(kv)
    if error is not None:
        with pytest.raises(error):
            kv.free(arg)
        assert snapshot(kv) == before
        return
    want = sorted(int(p) for p in np.asarray(arg).reshape(-1).tolist())
    assert kv.free(arg) == len(want)
    assert {kv.ledger.state_of(p) for p in want} == {"free"}
    kv.check_invariants()


def test_free_now_small_puts_back_its_marks_on_a_late_bad_id():
    kv, _ = _state_for_bad_ids()
    led = kv.ledger
    before = snapshot(kv)
    assert led._free_now_small([21, 22, 23, 50]) is False  # 50 is already free
    assert led._free_now_small([21, 22, 21]) is False  # a duplicate
    assert led._free_now_small([21, 22, 64]) is False  # past the end
    assert led._free_now_small([21, [22]]) is False  # from a 2-D tensor
    assert snapshot(kv) == before
    assert led._free_now_small([21, 22, 23]) is True
    kv.check_invariants()


def test_free_now_small_wraps_the_ring():
    kv = KVPagePool(9, 1)  # capacity 8
    a = kv.alloc(6)
    b = kv.alloc(2)
    assert a is not None and b is not None
    assert kv.free(a[:3]) == 3  # tail wraps from 0
    assert kv.free(b) == 2
    assert kv.ledger._free_now_small(a[3:].tolist()) is True
    kv.check_invariants()
    assert kv.alloc(8) is not None and kv.available_size() == 0


# ---------------------------------------------------------------- handed-out tensors
# A host pool remembers each tensor of 2+ pages it handed out; freeing that
# very tensor, unchanged, only checks that its pages are still ALLOCATED.


def _break_checks(monkeypatch: pytest.MonkeyPatch, led: PageLedger) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise AssertionError("a check the handed-out path skips was run")

    for name in ("prepare", "_free_now_small", "_checked"):
        monkeypatch.setattr(led, name, broken)


@pytest.mark.parametrize("n", [2, _TINY, _TINY + 1, 200])
def test_freeing_a_handed_out_tensor_skips_every_id_check(n, monkeypatch):
    kv = KVPagePool(256, 4)
    pages = kv.alloc(n)
    assert pages is not None
    _break_checks(monkeypatch, kv.ledger)
    assert kv.free(pages) == n
    monkeypatch.undo()
    kv.check_invariants()
    assert kv.available_size() == 255 and not kv._handed


@pytest.mark.parametrize("n", [2, _TINY, _TINY + 1, 40])
def test_a_handed_out_tensor_freed_in_another_form_first_is_a_double_free(n):
    kv = KVPagePool(64, 4)
    pages = kv.alloc(n)
    assert pages is not None
    assert kv.free(pages.clone()) == n  # another tensor: the entry stays
    before = snapshot(kv)
    with pytest.raises(DoubleFreeError, match=f"double free: page {int(pages[0])} "):
        kv.free(pages)
    assert snapshot(kv) == before


def test_a_handed_out_tensor_freed_twice_is_a_double_free():
    kv = KVPagePool(64, 4)
    pages = kv.alloc(5)
    assert pages is not None and kv.free(pages) == 5
    before = snapshot(kv)
    with pytest.raises(DoubleFreeError):
        kv.free(pages)
    assert snapshot(kv) == before


def test_a_handed_out_tensor_written_into_goes_the_checked_way():
    kv = KVPagePool(64, 4)
    pages = kv.alloc(6)
    other = kv.alloc(2)
    assert pages is not None and other is not None
    pages[1] = pages[0]  # a duplicate: distinctness is no longer given
    before = snapshot(kv)
    with pytest.raises(InvalidSlotError, match="appears more than once"):
        kv.free(pages)
    assert snapshot(kv) == before
    # Rewritten to other allocated pages: it frees exactly those.
    pages[:] = torch.tensor([*range(1, 5), *other.tolist()])
    assert kv.free(pages) == 6
    assert [kv.ledger.state_of(p) for p in (1, 4, 5, 6, 7, 8)] == [
        "free",
        "free",
        "allocated",
        "allocated",
        "free",
        "free",
    ]
    kv.check_invariants()


@pytest.mark.parametrize(
    "view, error, freed",
    [
        (lambda t: t.view(2, 4), InvalidSlotError, 0),  # 2-D: refused as ever
        (lambda t: t.view(torch.float64), InvalidSlotError, 0),  # same bytes, a float dtype
        (lambda t: t[:3], None, 3),  # same address, fewer pages
        (lambda t: t.view(-1), None, 8),  # a view of all of it
    ],
    ids=["2-D view", "float view", "prefix slice", "whole view"],
)
def test_views_of_a_handed_out_tensor_free_as_any_tensor_would(view, error, freed):
    kv = KVPagePool(64, 4)
    pages = kv.alloc(8)
    assert pages is not None
    arg = view(pages)
    before = snapshot(kv)
    if error is not None:
        with pytest.raises(error):
            kv.free(arg)
        assert snapshot(kv) == before
    else:
        assert kv.free(arg) == freed
        assert kv.allocated_size() == 8 - freed
    kv.check_invariants()


@pytest.mark.parametrize("n", [2, 2000])
def test_handed_out_tensors_freed_in_other_forms_are_forgotten_in_bulk(n):
    # The usual engine habit: the ids are copied out and freed from the
    # copy, leaving every entry behind. What is remembered is bounded in
    # pages, not in entries (2,000-page tensors would otherwise pile up).
    kv = KVPagePool(4097, 4)
    most = 0
    for _ in range(60):
        held = [kv.alloc(n) for _ in range(max(1, 40 // n))]
        for pages in held:
            assert pages is not None
            kv.free(pages.tolist())  # the entry stays behind
        remembered = sum(entry[2].shape[0] for entry in kv._handed.values())
        assert remembered == kv._handed_pages
        most = max(most, remembered)
    # Never more than the pages allocated at a trim plus twice the slack.
    assert most <= max(n, 40) + 2 * _HANDED_SLACK
    # A forgotten tensor still frees, the checked way.
    pages = kv.alloc(3)
    kv._handed.clear()
    assert pages is not None and kv.free(pages) == 3
    kv.check_invariants()


def test_only_the_very_tensor_handed_out_is_trusted(monkeypatch):
    kv = KVPagePool(64, 4)
    pages = kv.alloc(8)
    assert pages is not None
    _break_checks(monkeypatch, kv.ledger)
    # Another object over the same memory (a view of all of it) is not
    # trusted: it takes the checked path, here broken on purpose.
    with pytest.raises(AssertionError, match="a check the handed-out path skips"):
        kv.free(pages.view(-1))
    monkeypatch.undo()
    assert kv.free(pages.view(-1)) == 8
    kv.check_invariants()


def test_a_tensor_given_other_data_is_not_trusted():
    # ``t.data = ...`` keeps the object (and its id) but not its memory.
    kv = KVPagePool(64, 4)
    pages = kv.alloc(4)
    other = kv.alloc(4)
    assert pages is not None and other is not None
    pages.data = other.clone()
    assert kv.free(pages) == 4  # frees what it holds now: other's pages
    assert [kv.ledger.state_of(p) for p in (1, 5)] == ["allocated", "free"]
    kv.check_invariants()


def test_a_negative_view_is_refused_with_a_typed_error():
    kv = KVPagePool(64, 4)
    for n in (1, 4, _TINY + 4):
        pages = kv.alloc(n)
        assert pages is not None
        before = snapshot(kv)
        with pytest.raises(InvalidSlotError, match="out of range"):
            kv.free(torch._neg_view(pages))
        assert snapshot(kv) == before
        assert kv.free(pages) == n


@pytest.mark.parametrize("how", ["data", "set_neg"])
def test_the_handed_out_tensor_made_a_negative_view_is_refused(how):
    """Its memory, address, strides and bytes are unchanged, but it reads
    other ids (``-p``): the trusted path must not free what it held (a
    review found it freed pages 1-4 for a tensor reading [-1, -2, -3, -4])."""
    kv = KVPagePool(64, 4)
    for n in (1, 4, _TINY + 4):
        pages = kv.alloc(n)
        assert pages is not None
        before = snapshot(kv)
        if how == "data":
            pages.data = torch._neg_view(pages)
        else:
            torch._C._set_neg(pages, True)
        with pytest.raises(InvalidSlotError, match="out of range"):
            kv.free(pages)
        assert snapshot(kv) == before
        assert kv.free(pages.resolve_neg().neg()) == n


def test_a_fenced_free_of_a_handed_out_tensor_forgets_it():
    kv = KVPagePool(64, 4)
    fs = FakeStream()
    pages = kv.alloc(4)
    assert pages is not None
    kv.free(pages, fence=fs.record())
    assert not kv._handed
    with pytest.raises(DoubleFreeError):
        kv.free(pages)
    fs.complete()
    assert kv.reclaim() == 4
    kv.check_invariants()


def test_clear_forgets_handed_out_tensors():
    kv = KVPagePool(64, 4)
    pages = kv.alloc(4)
    assert pages is not None
    kv.clear()
    assert not kv._handed
    with pytest.raises(DoubleFreeError):
        kv.free(pages)


# A pool that remembers its tensors against one that forgets them before
# every free: whatever the caller does to them (writes through the tensor,
# views, copies, other forms), both answer and end the same.
_FREE_FORMS: list[Callable[[torch.Tensor], Any]] = [
    lambda t: t,
    lambda t: t,
    lambda t: t[: max(2, t.numel() // 2)],
    lambda t: t[1:],
    lambda t: t.tolist(),
    lambda t: t.numpy(),
    lambda t: t.view(-1),
    lambda t: t.clone(),
    lambda t: t.flip(0),
    lambda t: t.to(torch.int32),
    lambda t: t.view(1, -1),
]


def _outcome(kv: KVPagePool, arg: Any) -> tuple[str, Any]:
    try:
        return "ok", kv.free(arg)
    except PoolError as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("seed", range(30))
def test_remembering_handed_out_tensors_changes_no_answer(seed):
    rng = random.Random(seed)
    remembers, forgets = KVPagePool(33, 4), KVPagePool(33, 4)
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(300):
        if rng.random() < 0.35 or not held:
            n = rng.randint(2, 12)
            a, b = remembers.alloc(n), forgets.alloc(n)
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert a.tolist() == b.tolist()
                held.append((a, b))
            continue
        a, b = rng.choice(held)
        if rng.random() < 0.15:  # a write through the tensor, against the contract
            i = rng.randrange(a.numel())
            value = rng.choice([0, -1, 40, 10**6, int(a[(i + 1) % a.numel()]), rng.randint(1, 32)])
            a[i] = b[i] = value
            continue
        form = rng.choice(_FREE_FORMS)
        forgets._handed.clear()
        assert _outcome(remembers, form(a)) == _outcome(forgets, form(b))
        assert snapshot(remembers) == snapshot(forgets)
        if rng.random() < 0.3:
            held = [h for h in held if h[0] is not a]
        if rng.random() < 0.02:
            remembers.clear()
            forgets.clear()
            held.clear()


@pytest.mark.parametrize(
    "build",
    [
        lambda: torch.tensor([1], device="meta"),
        lambda: torch.tensor([1, 2], device="meta"),
        lambda: torch.arange(1, 20, device="meta"),
        lambda: torch.tensor([1, 2]).to_sparse(),
        lambda: torch.arange(1, 20).to_sparse(),
    ],
    ids=["meta 1", "meta 2", "meta 19", "sparse 2", "sparse 19"],
)
def test_tensors_without_data_are_refused_with_a_typed_error(build):
    from asyncpool import ReqToTokenPool

    kv = KVPagePool(64, 4)
    assert kv.alloc(30) is not None
    before = snapshot(kv)
    with pytest.raises(InvalidSlotError, match="with data"):
        kv.free(build())
    assert snapshot(kv) == before
    pool = ReqToTokenPool(64, 4)
    assert pool.alloc(30) is not None
    with pytest.raises(InvalidSlotError, match="with data"):
        pool.free(build())
    assert pool.stats().allocated == 30
    pool.check_invariants()
