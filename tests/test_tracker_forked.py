"""The tracker's forked builds (tracker/forked.py): the child sees the state at the fork, runs at
the lowest priority, and its result, its exception, its death by a signal or its overrun come back
as bytes or as a clear error; a cancelled build leaves no process behind."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
import weakref

import pytest

from neuron_bus.gctune import collect_frozen_too
from neuron_bus.tracker import forked

pytestmark = [
    pytest.mark.skipif(not forked.available(), reason="forked builds are Linux's"),
    pytest.mark.timeout(60),
]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_child_sees_the_state_at_the_fork_and_returns_bytes():
    table = {"nodes": list(range(100_000))}

    async def main():
        build = forked.run(lambda: f"{sum(table['nodes'])} {os.getpid()} {os.nice(0)}".encode())
        task = asyncio.ensure_future(build)
        await asyncio.sleep(0)  # forked by now: a change here is not the child's
        table["nodes"].append(10**9)
        return await task

    total, pid, nice = (int(x) for x in asyncio.run(main()).split())
    assert total == sum(range(100_000))
    assert pid != os.getpid()
    assert nice == max(forked.NICE, os.nice(0))


def test_a_large_result_comes_back_whole():
    blob = os.urandom(3 * forked.CHUNK + 12345)
    assert asyncio.run(forked.run(lambda: blob)) == blob


def _fail() -> bytes:
    raise ValueError("built badly")


def test_the_childs_exception_comes_back_with_its_traceback():
    with pytest.raises(forked.ForkedError, match=r"(?s)the build process failed.*ValueError: built badly"):
        asyncio.run(forked.run(_fail))


def _killed() -> bytes:
    os.kill(os.getpid(), signal.SIGKILL)
    return b""


def test_a_child_killed_by_a_signal_is_an_error_naming_it():
    with pytest.raises(forked.ForkedError, match="killed by SIGKILL"):
        asyncio.run(forked.run(_killed))


def _exits() -> bytes:
    os._exit(3)


def test_a_child_that_exits_without_a_result_is_an_error():
    with pytest.raises(forked.ForkedError, match="exited with status 3 and no result"):
        asyncio.run(forked.run(_exits))


def _sleeps() -> bytes:
    time.sleep(30)
    return b"late"


def test_a_child_over_its_time_is_killed():
    t0 = time.monotonic()
    with pytest.raises(forked.ForkedError, match=r"killed by SIGALRM \(over its 1 s\)"):
        asyncio.run(forked.run(_sleeps, timeout=1))
    assert time.monotonic() - t0 < 10


async def _sleeping_child(act) -> None:
    """Start a build that sleeps, then ``await act(pid, task)`` with its child's pid."""
    r, w = os.pipe()

    def report_and_sleep() -> bytes:
        os.write(w, str(os.getpid()).encode())
        return _sleeps()

    try:
        task = asyncio.ensure_future(forked.run(report_and_sleep))
        await act(int(await asyncio.to_thread(os.read, r, 32)), task)
    finally:
        os.close(r)
        os.close(w)


def test_a_cancelled_build_kills_and_reaps_its_child():
    pids: list[int] = []

    async def cancel(pid, task):
        pids.append(pid)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(_sleeping_child(cancel))
    assert _gone(pids[0])  # killed, and reaped: no zombie left (a zombie still answers kill 0)


def test_a_sigterm_to_the_child_ends_it_whatever_the_parent_handles():
    # the parent's event loop handles SIGTERM (the tracker's CLI does): the child must not inherit that
    async def terminate(pid, task):
        os.kill(pid, signal.SIGTERM)
        with pytest.raises(forked.ForkedError, match="killed by SIGTERM"):
            await task

    async def main():
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: None)
        await _sleeping_child(terminate)

    asyncio.run(main())


class _Cyclic:
    def __init__(self) -> None:
        self.me = self


def test_a_freezing_fork_keeps_old_objects_from_collections_until_collect_frozen_too():
    gc.unfreeze()
    try:
        cyclic = _Cyclic()
        alive = weakref.ref(cyclic)
        assert asyncio.run(forked.run(lambda: b"ok", freeze=True)) == b"ok"
        assert gc.get_freeze_count() > 0
        del cyclic
        gc.collect()
        assert alive() is not None  # frozen at the fork: no collection of the young or the old sees it
        collect_frozen_too()
        assert alive() is None  # garbage once the collector looks at it
        assert gc.get_freeze_count() > 0  # the survivors are frozen again
    finally:
        gc.unfreeze()
