"""The tracker's off-loop threads: results and errors come back, and on Linux the work runs at the
lowest CPU priority while the event loop's thread keeps its own."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from neuron_bus.tracker.offloop import NICE, OffLoop


def _priority() -> tuple[int, int]:
    """(this thread's native id, its nice value)."""
    tid = threading.get_native_id()
    return tid, os.getpriority(os.PRIO_PROCESS, tid)


def _fail() -> None:
    raise ValueError("built badly")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")
def test_work_runs_at_the_lowest_priority_and_the_loop_keeps_its_own():
    async def main():
        offloop = OffLoop()
        try:
            loop_tid, loop_nice = _priority()
            tid, nice = await offloop.run(_priority)
            return loop_tid, loop_nice, tid, nice, _priority()[1]
        finally:
            offloop.shutdown()

    loop_tid, loop_nice, tid, nice, loop_nice_after = asyncio.run(main())
    assert tid != loop_tid
    assert nice == max(NICE, loop_nice)
    assert loop_nice_after == loop_nice


def test_results_and_errors_come_back():
    async def main():
        offloop = OffLoop()
        try:
            assert await offloop.run(sum, [1, 2, 3]) == 6
            with pytest.raises(ValueError, match="built badly"):
                await offloop.run(_fail)
        finally:
            offloop.shutdown()

    asyncio.run(main())
