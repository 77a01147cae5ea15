"""conftest's ``_asyncpool_logger_put_back``: a test that leaves the
``asyncpool`` logger silenced (as an example's ``main()`` run in-process
does) does not silence the tests after it.

The two tests run in file order (the suite has no random-order plugin): the
first silences the logger and leaves it so, the second checks that a
warning is logged again. Without the fixture the second fails.
"""

from __future__ import annotations

import logging

import pytest


def test_a_test_that_silences_the_library_logger_and_leaves_it_so() -> None:
    logger = logging.getLogger("asyncpool")
    logger.setLevel(logging.CRITICAL)
    logger.propagate = False
    assert not logger.isEnabledFor(logging.WARNING)


def test_the_next_test_sees_the_library_warn_again(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("asyncpool.pool")
    with caplog.at_level(logging.WARNING):
        logger.warning("seen")
    assert [r.getMessage() for r in caplog.records] == ["seen"]
