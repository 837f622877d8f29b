"""The one wait helper of every benchmark: a condition polled until a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T | None], timeout: float, what: str, *, interval: float = 0.1
) -> T:
    """Poll ``condition`` until it returns something truthy and return that; TimeoutError
    naming ``what`` after ``timeout`` seconds. The condition may raise to give up early
    (a child that exited, a pod crash-looping)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)  # the polling interval, not synchronisation
