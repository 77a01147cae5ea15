"""Run every async test on both the stock asyncio loop and uvloop."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

# CUDA tests hold a "step in flight" with a spinning kernel, then launch its
# late write and check that the fence is still open. Under CUDA's lazy module
# loading (torch's default) the first launch of a kernel may synchronise the
# whole context, which ends the spin early: on an H200 eight such tests saw
# their fence complete before the check. Load every kernel when the context
# starts instead (read then; torch sets LAZY only when the variable is unset).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import pytest
import torch
import torch.distributed as dist
import uvloop
from helpers import Streams, eager_factory_refused
from hypothesis import settings

# The property tests draw the same examples on every run, so a CI run cannot
# fail by the luck of the draw: one that fails, fails every time and can be
# rerun. HYPOTHESIS_PROFILE=explore draws fresh examples (and keeps failing
# ones in .hypothesis/) for hunting beyond the fixed set.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# ASYNCPOOL_TEST_EAGER=1 (Python 3.12+, opt-in, never in CI): every test loop
# runs with asyncio.eager_task_factory, as engines that turn it on for speed
# do, so create_task() runs its coroutine up to its first suspension inside
# the caller. Unset (or empty, or 0), nothing changes. Loops a test makes
# itself (asyncio.run, a thread's own loop) keep the lazy default, and so do
# tests marked lazy_tasks (each says what it assumes: a task created, then a
# check made before it ran; an assumption of the test, not of the pool). A
# loop that cannot run the factory at all (uvloop on Python 3.13.0) keeps the
# lazy default too, as the run's header says.
_EAGER = os.environ.get("ASYNCPOOL_TEST_EAGER", "") not in ("", "0")


_LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
# The loops that run the eager factory under ASYNCPOOL_TEST_EAGER=1, and why
# the others keep the lazy default (filled by pytest_configure).
_EAGER_LOOPS: set[str] = set()
_LAZY_WHY: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    if not _EAGER:
        return
    if not hasattr(asyncio, "eager_task_factory"):
        raise pytest.UsageError(
            "ASYNCPOOL_TEST_EAGER is set, but asyncio.eager_task_factory needs Python 3.12+ "
            f"(this is {sys.version.split()[0]}): unset it, or run the suite on 3.12+"
        )
    for name, new_loop in _LOOPS.items():
        why = _eager_refused(new_loop)
        if why is None:
            _EAGER_LOOPS.add(name)
        else:
            _LAZY_WHY[name] = why
    if not _EAGER_LOOPS:
        raise pytest.UsageError(f"ASYNCPOOL_TEST_EAGER is set, but no loop runs it: {_LAZY_WHY}")


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not _EAGER:
        return []
    lines = [f"ASYNCPOOL_TEST_EAGER: the eager task factory on {sorted(_EAGER_LOOPS)}"]
    lines += [f"  {name} keeps the lazy default: {why}" for name, why in _LAZY_WHY.items()]
    return lines


def _eager_refused(new_loop: Callable[[], asyncio.AbstractEventLoop]) -> str | None:
    """Why a loop of ``new_loop`` cannot run ``asyncio.eager_task_factory``
    at all, or None. uvloop 0.22+ passes ``eager_start=`` to a task factory,
    which the factory takes only from Python 3.14: on 3.13.0 every
    ``create_task`` raised ``TypeError`` (tests/helpers.eager_tasks skips
    its cases there alike)."""
    loop = new_loop()
    try:
        loop.set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined,unused-ignore]
        return eager_factory_refused(loop)
    finally:
        loop.close()


def _with_eager_tasks(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> Callable[[], asyncio.AbstractEventLoop]:
    def make() -> asyncio.AbstractEventLoop:
        loop = new_loop()
        loop.set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined,unused-ignore]
        return loop

    return make


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if _EAGER and item.get_closest_marker("lazy_tasks") is None:
        return {
            name: _with_eager_tasks(new) if name in _EAGER_LOOPS else new
            for name, new in _LOOPS.items()
        }
    return dict(_LOOPS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        # CUDA tests pay the context's start-up (seconds, once): a wider bound
        # than the suite's default (pyproject: a hang fails in 60 s).
        for item in items:
            if item.get_closest_marker("cuda") is not None and not item.get_closest_marker(
                "timeout"
            ):
                item.add_marker(pytest.mark.timeout(180))
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _trace_function_put_back() -> Iterator[None]:
    """Every test leaves the trace function it found. A coverage run's is
    one: a test that set its own and then ``sys.settrace(None)`` ended the
    measurement of every later test in the session, silently (half the
    suite measured as unrun). Checked only where one is set."""
    before = sys.gettrace()
    yield
    if before is not None:
        assert sys.gettrace() is before, "the test did not put back the trace function it found"


@pytest.fixture(autouse=True)
def _asyncpool_logger_put_back() -> Iterator[None]:
    """Every test leaves the ``asyncpool`` logger as it found it (level,
    propagation, disabled). Programs whose summary counts what the pool logs
    set it to CRITICAL in their ``main()`` (``disagg_transfer``,
    ``disagg_decode``, ``pd_router``); a test that ran one in-process left
    every later test's warnings unlogged, and a test waiting for a warning
    failed far from the cause (twice in one session). Put back here, not
    asserted: running such a ``main()`` is a fair test."""
    logger = logging.getLogger("asyncpool")
    before = (logger.level, logger.propagate, logger.disabled)
    yield
    logger.setLevel(before[0])
    logger.propagate, logger.disabled = before[1], before[2]


@pytest.fixture
def kit() -> Iterator[Streams]:
    """HostStreams and gates that the test opens and closes at teardown."""
    with Streams() as k:
        yield k


@pytest.fixture
def without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda.is_available()`` answers False for one test, so the
    CPU-only refusals are tested on a GPU machine too (rather than skipped)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def quiet_asyncpool_logs() -> Iterator[None]:
    """The ``asyncpool`` logger at CRITICAL for one test, then as it was.

    For the stateful machines, whose thousands of injected fence faults log
    at ERROR. Never set at import: that silenced the logger for every test
    collected after, and a test waiting for a warning waited in vain.
    """
    logger = logging.getLogger("asyncpool")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@pytest.fixture(scope="module")
def group() -> Iterator[Any]:
    """A single-rank gloo process group (the default group), for ``agree()``
    tests run in this process; one per test module."""
    if dist.is_initialized():  # pragma: no cover - another module left one
        pytest.skip("a default process group already exists in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1
        )
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()
