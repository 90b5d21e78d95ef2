"""Waiting for a state in tests: poll a condition with a generous bound, never sleep a fixed time and hope.

The bound is how long the test may wait before it fails, not how long the state is expected to take: keep it
at least 10x the expected time (a loaded 2-core CI machine is slow), so only a real hang fails the test. These
helpers are where the tests' polling sleeps live (``tests/unit/test_no_bare_sleeps.py`` holds the rule).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], object], timeout: float, interval: float = 0.01) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds (checked every ``interval``)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return bool(condition())  # a last look: the state may have come while this thread was not scheduled
        time.sleep(interval)
    return True


def poll(condition: Callable[[], object], timeout: float, message: str = "timed out", interval: float = 0.01) -> None:
    """Wait until ``condition()`` is true; fail the test with ``message`` if it is not within ``timeout`` s."""
    assert wait_for(condition, timeout, interval), message
