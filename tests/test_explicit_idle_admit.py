"""An explicit pool reclaims only in ``retire``/``agree``: an ``await
admit`` queued while no step runs (what it waits for is behind a transfer)
is granted by the idle loop's ``agree``, never by the fence alone
(docs/tp.md, *An idle engine*). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
from typing import Any

from helpers import EventFence, bounded, spin

from asyncpool import AsyncReqToTokenPool, KVPagePool


async def test_an_idle_explicit_pool_grants_a_queued_admit_only_at_agree(group: Any) -> None:
    pool = AsyncReqToTokenPool(3, 16, kv=KVPagePool(9, 4, reclaim="explicit"), reclaim="explicit")
    try:
        held = []
        while (grant := pool.try_admit(pages=2)) is not None:
            held.append(grant)
        transfer = EventFence()  # a transfer handle
        transfer.set()  # landed already
        pool.free([held[0].row], fence=transfer)  # aborted mid-transfer (landed since)
        waiter = asyncio.create_task(pool.admit(pages=2))
        await spin(20)
        # Idle: no retire, no agree. The fence is done but never asked.
        assert not waiter.done() and transfer.queries == 0 and pool.waiting() == 1
        async with bounded():
            while pool.waiting():  # docs/tp.md's idle loop, one rank
                pool.agree(group)
                await asyncio.sleep(0)
            got = await waiter
        assert got.row == held[0].row and len(got.pages) == 2
        pool.free([got.row, *(g.row for g in held[1:])])
        pool.check_invariants()
    finally:
        await pool.close()
