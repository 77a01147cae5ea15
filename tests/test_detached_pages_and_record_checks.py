"""Detached pages and record checks, after the record learnt to grow (a review).

A detached tensor is the caller's own, exact-size array: it pins neither the
row's doubling buffer nor the batch array of ``extend_rows`` (which the
caller also holds), and ``check_invariants`` sees a row whose seal is lost
or does not match its record's length.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from asyncpool import AsyncReqToTokenPool, KVPagePool


def make(rows: int = 4, pages: int = 4096) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(rows + 1, 64, kv=KVPagePool(pages + 1, 1))


@pytest.mark.parametrize("admitted", [1, 1000])
async def test_a_detached_grown_record_does_not_pin_the_doubling_buffer(admitted):
    async with make() as pool:
        grant = await pool.admit(pages=admitted)
        assert pool.extend(grant.row, 1) is not None
        rp = pool._pages
        assert rp is not None
        buf = rp.grown[grant.row]
        assert buf is not None and len(buf) > admitted + 1  # room to grow
        gone = weakref.ref(buf)
        del buf
        detached = pool.detach_pages(grant.row)
        gc.collect()
        assert gone() is None, "the detached tensor keeps the row's whole buffer alive"
        assert detached.tolist() == grant.pages.tolist() + detached.tolist()[admitted:]
        kv = pool.kv
        assert kv is not None
        assert kv.free(detached) == admitted + 1  # still the trusted tensor
        pool.free(grant.row)
        pool.check_invariants()


async def test_a_detached_line_of_extend_rows_is_not_a_view_of_the_batch():
    async with make() as pool:
        rows = [(await pool.admit(pages=0)).row for _ in range(3)]
        batch = pool.extend_rows(rows, 4)
        assert batch is not None
        detached = pool.detach_pages(rows[1])
        assert detached.tolist() == batch[1].tolist()
        assert not np.shares_memory(detached.numpy(), batch.numpy())
        batch_base = pool._pages.owned[rows[0]].base  # type: ignore[union-attr]
        gone = weakref.ref(batch_base)
        del batch_base
        for row in (rows[0], rows[2]):
            pool.detach_pages(row)  # kept: nothing else holds the batch array
        del batch
        gc.collect()
        assert gone() is None, "a detached tensor keeps the whole batch array alive"
        kv = pool.kv
        assert kv is not None
        assert kv.free(detached) == 4
        pool.free(rows)
        pool.check_invariants()


@pytest.mark.parametrize("corrupt", ["lost", "short", "long"])
async def test_check_invariants_sees_a_seal_lost_or_of_another_length(corrupt):
    async with make() as pool:
        grant = await pool.admit(pages=3)
        assert pool.extend(grant.row, 2) is not None
        rp = pool._pages
        assert rp is not None
        pool.check_invariants()
        seal = rp.sealed[grant.row]
        assert seal is not None
        rp.sealed[grant.row] = {
            "lost": None,
            "short": bytes(seal[:-8]),
            "long": bytes(seal) + bytes(8),
        }[corrupt]
        with pytest.raises(AssertionError, match="seal"):
            pool.check_invariants()
        rp.sealed[grant.row] = seal
        pool.check_invariants()
        pool.free(grant.row)
