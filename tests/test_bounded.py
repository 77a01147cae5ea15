"""The suite's bound on awaits that could hang (``helpers.bounded``)."""

from __future__ import annotations

import asyncio

import pytest
from helpers import bounded


async def test_a_hang_fails_in_time_with_a_message() -> None:
    never = asyncio.Event()
    with pytest.raises(AssertionError, match=r"not done within 0.05 s: a lost wake-up"):
        async with bounded(0.05):
            await never.wait()


async def test_a_timeout_of_the_code_under_test_passes_through() -> None:
    with pytest.raises(TimeoutError) as ei:
        async with bounded():
            async with asyncio.timeout(0):
                await asyncio.Event().wait()
    assert not isinstance(ei.value, AssertionError)
