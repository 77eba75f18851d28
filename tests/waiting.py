"""Polling a condition in tests, with a deadline and a message naming what was awaited."""

from __future__ import annotations

import time


def wait_for(probe, timeout: float, what: str, every: float = 1.0):
    """Poll ``probe`` until it returns something truthy (returned); fail naming ``what`` and its
    last value after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} ({timeout:.0f}s; last: {last!r})")
        time.sleep(every)
