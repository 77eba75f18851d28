"""Work the tracker does off its event loop in threads (speed references, and the coverage maps
of a swarm too small for a forked child: forked.py), at the lowest CPU priority the operating
system gives a thread.

A coverage map of 10,000 nodes takes 0.1-0.2 s of CPU in a worker thread every time a client's
poll finds the last one too old. At normal priority that thread takes a core from the event loop
(route answers, heartbeats) and, on a machine the tracker shares, from the nats-server whose
JetStream answers every route's record: routes asked during a build waited 25-133 ms for their KV
create and stream publish, and they made the simulator's route p99 (docs/tracker-scale.md,
2026-12-05). At nice 19 the scheduler runs the build in what the loop and its neighbours leave;
the map is as fresh as before (its build's wall time barely moves), and the loop still takes the
interpreter lock back every ``sys.getswitchinterval()``. That lock still cost routes during a
build (route p99 85-139 ms at 10,000 nodes), so large maps are built in a forked child now.

Linux only: there ``setpriority(PRIO_PROCESS, tid)`` lowers one thread. Elsewhere the threads keep
the process's priority (lowering it would lower the event loop's too).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

NICE = 19  # the lowest priority: the build gets what nobody else wants
THREADS = 2  # one coverage build per kind of request at a time, and a speed reference beside it


def _lower_priority() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except OSError as exc:  # a sandbox may forbid it: the work still runs, at normal priority
        log.debug("could not lower a worker thread's priority: %s", exc)


class OffLoop:
    """A small pool of low-priority threads; ``run`` awaits ``func(*args)`` in one of them."""

    def __init__(self, threads: int = THREADS) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tracker-offloop", initializer=_lower_priority)

    async def run(self, func: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, func, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
