"""``free(row)`` with a bare int: the form the seed's callers use.

SGLang frees a finished request with ``req_to_token_pool.free(req.req_pool_idx)``,
an int. The one-row fast paths of ``free`` (rows only, one page pool, KV
groups) took only ``[row]``, so the int form went the general way (the
ledger's row parsing and checks, about 2.5x the cost). Both forms take the
fast path now, leave the pool in the same state and refuse the same input.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import bounded, grouped_pool, pool_snapshot

from asyncpool import AsyncReqToTokenPool, DoubleFreeError, InvalidSlotError, KVPagePool


def _pools() -> dict[str, Any]:
    return {
        "rows": lambda: AsyncReqToTokenPool(5, 8),
        "kv": lambda: AsyncReqToTokenPool(5, 8, kv=KVPagePool(9, 4)),
        "groups": lambda: grouped_pool(),
    }


async def _one_row(pool: AsyncReqToTokenPool, kind: str) -> int:
    if kind == "rows":
        return (await pool.alloc(1))[0]
    if kind == "kv":
        return (await pool.admit(pages=2)).row
    return (await pool.admit(pages={"swa": 2, "full": 1})).row


@pytest.mark.parametrize("kind", ["rows", "kv", "groups"])
async def test_a_bare_int_is_freed_on_the_fast_path(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with bounded():
        by_list, by_int = _pools()[kind](), _pools()[kind]()
        by_list.free([await _one_row(by_list, kind)])  # the list form: the reference
        row = await _one_row(by_int, kind)

        def general_path(*args: Any) -> Any:
            raise AssertionError("free(row) took the general path")

        monkeypatch.setattr(by_int._ledger, "as_rows", general_path)
        assert by_int.free(row) == 1
        monkeypatch.undo()
        assert pool_snapshot(by_int) == pool_snapshot(by_list)
        by_int.check_invariants()
        assert by_int.stats().allocated == 0
        await by_int.close()
        await by_list.close()


@pytest.mark.parametrize("kind", ["rows", "kv", "groups"])
async def test_a_bare_int_is_refused_as_the_list_form_is(kind: str) -> None:
    async with bounded():
        pool = _pools()[kind]()
        row = await _one_row(pool, kind)
        pool.free(row)
        before = pool_snapshot(pool)
        with pytest.raises(DoubleFreeError):
            pool.free(row)
        with pytest.raises(InvalidSlotError):
            pool.free(0)
        with pytest.raises(InvalidSlotError):
            pool.free(True)  # type: ignore[arg-type]
        with pytest.raises(InvalidSlotError):
            pool.free(99)
        assert pool_snapshot(pool) == before
        pool.check_invariants()
        await pool.close()
