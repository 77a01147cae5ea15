"""Argument checks on alloc's fast path, and a lease whose stream closed."""

from __future__ import annotations

import asyncio

import pytest
from helpers import bounded

from asyncpool import AsyncReqToTokenPool, HostStream


@pytest.mark.parametrize(
    ("kwargs", "exc", "culprit"),
    [
        ({"timeout": -1}, ValueError, "-1"),
        ({"timeout": "1"}, ValueError, "'1'"),
        ({"timeout": float("nan")}, ValueError, "nan"),
        ({"priority": 1.5}, TypeError, "1.5"),
        ({"priority": None}, TypeError, "None"),
    ],
)
async def test_bad_wait_args_fail_even_when_rows_are_free(
    kwargs: dict[str, object], exc: type[Exception], culprit: str
) -> None:
    pool = AsyncReqToTokenPool(5, 4)
    before = pool.stats()
    with pytest.raises(exc, match=culprit):
        async with bounded():
            await pool.alloc(1, **kwargs)  # type: ignore[arg-type]
    assert pool.stats() == before
    pool.check_invariants()
    async with bounded():
        await pool.close()


async def test_lease_exit_with_a_closed_stream_raises_but_never_leaks() -> None:
    pool = AsyncReqToTokenPool(5, 4)
    stream = HostStream()
    with pytest.raises(RuntimeError, match="closed"):
        async with bounded(), pool.lease(2, after=stream) as rows:
            assert len(rows) == 2
            stream.close()
    assert pool.available_size() == 4
    assert pool.stats().allocated == 0
    pool.check_invariants()
    async with asyncio.timeout(5):
        assert sorted(await pool.alloc(4)) == [1, 2, 3, 4]
    async with bounded():
        await pool.close()


@pytest.mark.parametrize("body_frees", [False, True])
async def test_lease_exit_with_a_closed_stream_says_what_it_freed(body_frees: bool) -> None:
    """The closed stream's error says "nothing was freed" (true of that
    call); the lease then frees its rows behind their recorded uses, so its
    error says so and names them, and the rows the body freed itself (whose
    DoubleFreeError it replaces). Found by a review: a caller believing the
    message and freeing them again got a DoubleFreeError."""
    pool = AsyncReqToTokenPool(5, 4)
    stream = HostStream()
    with pytest.raises(RuntimeError) as info:
        async with bounded(), pool.lease(2, after=stream) as rows:
            held = list(rows)
            if body_frees:
                pool.free(rows[:1])
            stream.close()
    message = str(info.value)
    assert "closed" in message and "the lease freed its rows" in message
    assert str(held[1:] if body_frees else held) in message
    assert (f"lease rows {held[:1]} were freed inside the lease body" in message) is body_frees
    assert pool.stats().allocated == 0 and pool.available_size() == 4
    pool.check_invariants()
    await pool.close()


async def test_a_lease_entered_again_while_it_holds_rows_is_refused() -> None:
    """Its exit frees one grant: a second, overwriting the first, was lost
    for good (found by a review). One use after another still works."""
    pool = AsyncReqToTokenPool(5, 4)
    lease = pool.lease(1)
    async with bounded():
        async with lease:
            with pytest.raises(RuntimeError, match="entered already"):
                async with lease:
                    pass  # never runs
            assert pool.stats().allocated == 1
        assert pool.stats().allocated == 0
        async with lease as again:
            assert len(again) == 1
        assert pool.stats().allocated == 0
    pool.check_invariants()
    await pool.close()


async def test_one_lease_entered_by_two_tasks_at_once_is_refused_to_the_second() -> None:
    """The first task's entry awaits its rows; the second's, meanwhile, is
    refused at once (a review found both entering, the second's grant
    overwriting the first's, which was leaked, and the first's exit freeing
    the second task's row under it)."""
    pool = AsyncReqToTokenPool(3, 4)  # two rows
    held = await pool.alloc(1)
    lease = pool.lease(2)  # waits until `held` is freed
    entered = asyncio.Event()

    async def first() -> list[int]:
        async with lease as rows:
            entered.set()
            return list(rows)

    task = asyncio.ensure_future(first())
    await asyncio.sleep(0)  # the first entry is queued for its rows
    with pytest.raises(RuntimeError, match="entered already"):
        async with bounded(), lease:  # bounded: a second entry would wait
            pass  # never runs
    pool.free(held)
    async with bounded():
        assert sorted(await task) == [1, 2]
    assert pool.stats().allocated == 0 and pool.available_size() == 2
    pool.check_invariants()
    await pool.close()


@pytest.mark.parametrize("after", [object(), "forward", 0])
async def test_a_lease_after_no_stream_is_refused_before_it_allocates(after: object) -> None:
    """``lease(n, after=x)`` with no fence recordable on ``x`` raises at the
    call, allocating nothing. Checked only at exit, the body ran and the
    rows went back behind their recorded uses alone, unfenced by the work
    ``after=`` was given for (found by a newcomer trial)."""
    pool = AsyncReqToTokenPool(5, 4)
    before = pool.stats()
    with pytest.raises(TypeError, match=r"after= must be a HostStream or a CUDA stream"):
        pool.lease(2, after=after)
    assert pool.stats() == before
    pool.check_invariants()
    async with bounded():
        await pool.close()


@pytest.mark.parametrize("change", ["pop", "overwrite", "clear"])
async def test_lease_frees_the_rows_it_granted_whatever_the_body_does_to_its_list(
    change: str,
) -> None:
    pool = AsyncReqToTokenPool(5, 4)
    other = await pool.alloc(1)  # another request's row
    async with bounded(), pool.lease(2) as rows:
        granted = list(rows)
        if change == "pop":
            rows.pop()
        elif change == "overwrite":
            rows[0] = other[0]
        else:
            rows.clear()
    assert all(pool._ledger.state_of(r) == "free" for r in granted)
    assert pool._ledger.state_of(other[0]) == "allocated"
    assert pool.stats().allocated == 1
    pool.free(other)
    pool.check_invariants()
    async with bounded():
        await pool.close()
