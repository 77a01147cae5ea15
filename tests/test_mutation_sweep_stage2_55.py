"""Gaps found by a hand-made mutation sweep of the last session's code
(c6ee1bc..a7a2b12), the parts the sweep of c6ee1bc..00ee8e9
(``test_mutation_sweep_stage2_54.py``) had not seen, and a second pass
over those it had: the batched give-back's fast paths
(``RowPages._group_many`` past ``_JOINED_CHECK`` rows, the inline cut of a
trim, ``_check_below``), ``_page_counts``, ``forget_stream`` on every pool
and ledger (``waits_on_stream``, ``stream_uses``), the ``unfittable``
counts, ``PoolCollector``'s lock, the agreement's thread-local buffers,
the page ring built from numpy's bytes and external CUDA streams keyed by
wrapper.

76 mutants, each run against the test files that exercise its code
(pytest -x, a 60 s timeout a test): 59 killed, 12 equivalent, 5 gaps (the
tests below; each fails on its mutant and passes on the code). No library
defect.

=====  ==========================================================  ===========
id     mutant (file: change)                                       verdict
=====  ==========================================================  ===========
P1     page_args: a bool taken as one count                        killed
P2     page_args: one negative count not refused                   killed
P3     page_args: one count for n - 1 rows                         killed
P4     page_args: a tuple not taken by the list fast path          equivalent
P5     page_args: a 1-D array not taken by the array fast path     equivalent
P6     page_args: the int-only type check skipped                  killed
P7     page_args: a least count of -1 passes                       killed
P8     page_args: the least negative count named, not the first    killed
P9     page_args: the caller's list kept                           killed
P10    page_args: fewer counts than rows pass                      killed
P11    page_args: a bool array's elements read                     GAP
P12    page_args: bool in _INT_ONLY                                killed
R1     row_pages: ``>= _JOINED_CHECK``                             equivalent
R2     row_pages: ``_JOINED_CHECK = 0`` (every batch joined)       equivalent
R3     _group_many: keep less the dropped places not floored at 0  killed
R4     _group_many: a trim ignores the dropped places              killed
R5     _group_many: a row with nothing past keep picked            killed
R6     _group_many: a drop ignores the dropped places              killed
R7     _group_many: a row with nothing below picked                killed
R8     _group_many: a free picks rows without pages                GAP
R9     _group_many: the joined seal check skipped                  killed
R10    _group_many: one group whatever the uses                    killed
R11    _group_many: the part not copied                            equivalent
R12    _group_many: row starts off by a row                        killed
R13    _group_many: the cut's first place left out                 killed
R14    _group_many: the cut takes one place past                   killed
R15    _group_many: mixed uses give back whole records             killed
R16    prepare_free: one part trusted as one row's                 killed
R17    prepare_free: only a group's first part                     killed
R18    free: a trim keeping 1 page frees the row                   killed
R19    free: a trim keeps the growth buffer                        killed
R20    free: the bytearray seal cut one page long                  killed
R21    free: the bytes seal not cut                                killed
R22    free: a trim to 0 keeps the growth buffer                   killed
R23    _group_many: a trim gives back from place 0                 killed
R24    _group_many: a drop picks rows without pages                equivalent
G1     _check_below: below 0 checked too                           equivalent
G2     _check_below: dropped places not counted                    killed
G3     _check_below: one position short                            killed
D1     waits_on_stream: whether some wait, not how many            killed
D2     waits_on_stream: its own queue's rest walked too            equivalent
D3     waits_on_stream: the unordered batches not walked           equivalent
D4     waits_on_stream: the fences the walk passed asked too       GAP
D5     waits_on_stream: only the fence after the head asked        GAP
D6     Deferrals.forget_stream: True with no mark                  killed
L1     stream_uses: no shortcut for no uses                        equivalent
L2     stream_uses: the retire's own seq not covered               killed
L3     stream_uses: open rows counted as 1                         GAP
L4     SlotLedger.forget_stream: covered uses kept                 killed
L5     stream_uses: no cache per tuple of uses                     equivalent
A1     forget_stream: a bool key taken                             killed
A2     forget_stream: open uses not refused                        killed
A3     forget_stream: ``forgot or ...`` (later ledgers kept)       killed
A4     forget_stream: an auto pool not refused                     killed
A5     _all_reduce_min: one buffer key whatever the length         killed
A6     agreement: one buffer dict for every thread                 killed
K1     PageLedger: the ring built in reverse                       killed
K2     PageLedger: the ring from page 0                            killed
K3     KVPagePool.forget_stream: no checks                         killed
S1     ReqToTokenPool.forget_stream: no checks                     killed
E1     _external_key: the seq kept after the wrapper dies          killed
E2     _external_key: the callback pops whatever entry             equivalent
E3     _external_key: every external wrapper one key               killed
W1     unfit: the priority's count not incremented                 killed
W2     WaiterQueues.wait: a shed waiter's error not counted        killed
W3     _count_oversized_groups: a negative count goes on           killed
W4     _count_oversized_groups: a bad count goes on                killed
W5     admit: a shed waiter's error not counted                    killed
W6     alloc: a shed waiter's error not counted                    killed
W7     figures: a priority's unfittable read as rejections         killed
W8     admit: too many pages not counted                           killed
C1     PoolCollector: a plain Lock                                 killed
C2     PoolCollector.add: the name not checked under the lock      killed
C3     collect: the live pools' last values forgotten              killed
C4     alloc_unfittable exports rejections                         killed
C5     priority_unfittable exports rejections                      killed
=====  ==========================================================  ===========

Equivalent: P4/P5 (the value falls through to ``as_index``, which refuses
a tuple and an array of one or more dimensions, and the branch after takes
it the same way); R1/R2 (the threshold only picks the path: both give the
same answers, as the differential tests show); R11 (a read-only view of
immutable bytes: the ledger only reads the ids it holds); R24 and G1
(``_check_below`` bounds ``below`` by a row's positions: a row without a
record has ``below <= holes``, and 0 never exceeds them); D2/D3
(``newest_per_stream`` keeps one fence a stream, ordered ones first: a
batch's rest never names its head's stream, and an unordered head's rest
names no stream); L1/L5 (shortcuts: the same answer); E2 (as the sweep of
c6ee1bc..00ee8e9 found: the callback runs before the wrapper's id can be
reused).

The gaps: a bool tensor or array of counts refused as an array, before its
elements are read (P11); a batch free of more than ``_JOINED_CHECK`` rows
some of which hold no pages in the group (R8); ``forget_stream`` of a
stream the batch walked past (allowed) and of one it waits for last in
line, two fences after its head (refused) (D4, D5); the refusal for
recorded uses counting every row (L3).

No GPU here. Async tests run on asyncio and uvloop (conftest); every wait
is bounded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import EventFence, FakeStream, grouped_pool, kv_group, page_ids

from asyncpool import CapacityError, KVPagePool, ReqToTokenPool
from asyncpool.page_args import _page_counts
from asyncpool.row_pages import _JOINED_CHECK

# -- _page_counts -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (torch.tensor([True, False, True]), "1-D torch.bool Tensor"),
        (np.array([True, False, True]), "1-D bool ndarray"),
    ],
)
def test_a_bool_array_of_counts_is_refused_as_an_array(value: object, match: str) -> None:
    """Counts in a bool tensor or array are refused for what they are (an
    array of the wrong dtype, named), before their elements are read (the
    mutant read them and named the first ``True`` as a bool)."""
    with pytest.raises(CapacityError, match=match):
        _page_counts(value, 3, "keep")


# -- the batched give-back --------------------------------------------------------


@pytest.mark.parametrize("n", [3, _JOINED_CHECK + 4])
@pytest.mark.parametrize("fenced", [False, True], ids=["at once", "behind a fence"])
def test_a_batch_free_of_rows_some_without_pages_gives_back_the_others(
    n: int, fenced: bool
) -> None:
    """A step's batch frees rows that hold pages beside rows that hold
    none (admitted with none in the group): the rows with none are left
    out of the group's give-back, however many rows (the mutant joined
    every row's record, and a row without one raised ``TypeError`` past
    ``_JOINED_CHECK`` rows)."""
    pool = grouped_pool(rows=n, swa=2 * n, full=8)
    rows = []
    for i in range(n):
        g = pool.try_admit({"swa": 2 if i % 2 else 0, "full": 0})
        assert g is not None
        rows.append(g.row)
    swa = kv_group(pool, "swa")
    held = sum(len(page_ids(pool.pages_of(r, group="swa"))) for r in rows)
    assert held == 2 * (n // 2)
    free = swa.available_size()
    fence = EventFence()
    if fenced:
        pool.free(rows, fence=fence)
        assert swa.available_size() == free
        fence.set()
    else:
        pool.free(rows)
    swa.reclaim()
    assert swa.available_size() == free + held
    pool.check_invariants()


# -- forget_stream ----------------------------------------------------------------


def test_forget_stream_asks_what_a_batch_still_waits_for_not_what_it_passed() -> None:
    """A free behind four streams' fences, walked fence by fence as each is
    retired: a stream whose fence the batch has passed is no longer waited
    for and is forgotten, while one it still waits for after its head,
    last in line as well as next, is refused, on both kinds of ledger,
    nothing changed (one mutant asked the fences the walk passed too, one
    only the next one after the head)."""
    rows = ReqToTokenPool(8, 4, reclaim="explicit")
    kv = KVPagePool(16, 4, reclaim="explicit")
    streams = [FakeStream() for _ in range(4)]
    fences = [s.record() for s in streams]
    row, page = rows.alloc(1), kv.alloc(1)
    assert row is not None and page is not None
    rows.free(row, fence=fences)
    kv.free(page, fence=fences)
    for owner in (rows, kv):
        assert owner.retire(fences[3]) == 0  # last in line: marked only
        with pytest.raises(RuntimeError, match="1 batch"):
            owner.forget_stream(streams[3].key)
        assert owner.retire(fences[0]) == 0 and owner.retire(fences[1]) == 0
        assert owner.pending_size() == 1  # now behind the third
        assert owner.forget_stream(streams[0].key) is True
        assert owner.forget_stream(streams[1].key) is True  # passed: not waited for
        with pytest.raises(RuntimeError, match="1 batch"):
            owner.forget_stream(streams[3].key)
        assert owner._ledger._retired == {streams[3].key: fences[3].seq}
        assert owner.retire(fences[2]) == 1 and owner.pending_size() == 0


def test_forget_stream_counts_every_row_with_a_use_not_retired() -> None:
    """The refusal for recorded uses not yet retired says how many
    allocated rows carry one (the mutant said 1 however many)."""
    rows = ReqToTokenPool(8, 4, reclaim="explicit")
    stream = FakeStream()
    rows.retire(stream.record())
    taken = rows.alloc(3)
    assert taken is not None
    rows.record_use(taken[:2], stream.record())
    rows.record_use(taken[2], stream.record())
    marks = dict(rows._ledger._retired)
    with pytest.raises(RuntimeError, match="3 allocated row"):
        rows.forget_stream(stream.key)
    assert rows._ledger._retired == marks
