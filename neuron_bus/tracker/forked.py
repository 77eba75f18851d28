"""Work the tracker does on a copy-on-write snapshot of itself: a child process forked for one
job, which returns bytes (a coverage map, encoded) and exits. Redis saves its snapshots the same way.

Why a process and not a thread (offloop.py). A coverage map of 10,000 nodes is 0.13-0.2 s of
CPU. In a thread, even at nice 19, that CPU runs under the interpreter lock: every time the event
loop's thread leaves it (a socket read, a wait for the next message) the build takes it, and the
loop waits up to a switch interval to get it back, several times per route request. Routes asked
during a build took 25-133 ms where the others took 5-10 (docs/tracker-scale.md). A forked child
has its own interpreter and lock; it reads the table as it was at the fork (no copy taken on the
loop) and runs at nice 19 on whatever core is free. The loop pays the fork (2-3 ms for 100 MB of
memory, mostly page tables) and the pages it writes while the child lives (each copied once).

The child runs nothing but ``func``: signals back to their defaults (a Ctrl-C of the process group
or a SIGTERM ends it), the garbage collector off (collecting would copy every page of the heap),
an alarm after ``timeout`` seconds, no exit handlers (``os._exit``). It writes one status byte and
the result (or the error's traceback) to a pipe that the parent drains in a thread, then reaps the
child; a child that dies, overruns or is cancelled is killed and reaped: never a zombie.

Linux only (``available``): elsewhere the tracker builds in its threads. The child's CPU is the
tracker's too: it counts in the process's children times once reaped (``resource.RUSAGE_CHILDREN``,
psutil's ``children_user``), where scripts/swarm_sim reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import signal
import sys
import traceback
from collections.abc import Callable

from neuron_bus.gctune import freeze_before_fork

NICE = 19  # as the threads' (offloop.NICE): the child takes what the event loop and the server leave
OK, FAILED = b"\x00", b"\x01"
CHUNK = 1 << 20


class ForkedError(RuntimeError):
    """The child failed: its exception, its signal or its exit status."""


def available() -> bool:
    """Linux: a fork without exec is fragile on macOS (system frameworks; multiprocessing spawns
    there since Python 3.8) and missing on Windows; there the tracker builds in its threads."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


async def run(func: Callable[[], bytes], timeout: float = 60.0, freeze: bool = False) -> bytes:
    """``func()`` in a child forked from this process (the state as it is now), awaited.
    ``freeze``: freeze what is alive first (gctune.freeze_before_fork), for a process that
    collects its frozen objects itself."""
    r, w = os.pipe()
    if freeze:
        freeze_before_fork()
    try:
        pid = os.fork()
    except BaseException:
        os.close(r)
        os.close(w)
        raise
    if pid == 0:  # the child: never returns
        os.close(r)
        _child(func, w, timeout)
    os.close(w)
    try:
        data, status = await asyncio.to_thread(_drain, r, pid)
    except BaseException:  # cancelled (the tracker stops) or the drain failed: end the child
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        raise
    return _result(data, status, timeout)


def _child(func: Callable[[], bytes], w: int, timeout: float) -> None:
    code = 0
    try:
        try:
            gc.disable()
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
                signal.signal(sig, signal.SIG_DFL)
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(-1)  # the parent's event loop owns the other end
            with contextlib.suppress(OSError):
                os.nice(NICE)
            signal.alarm(max(1, math.ceil(timeout)))
            out = OK + func()
        except BaseException:
            out, code = FAILED + traceback.format_exc().encode(), 1
        view = memoryview(out)
        while view:
            view = view[os.write(w, view) :]
    finally:
        os._exit(code)


def _drain(r: int, pid: int) -> tuple[bytes, int]:
    """Everything the child writes, then its wait status (blocking: run in a thread)."""
    chunks = []
    try:
        while chunk := os.read(r, CHUNK):
            chunks.append(chunk)
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    return b"".join(chunks), status


def _result(data: bytes, status: int, timeout: float) -> bytes:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        why = f" (over its {timeout:g} s)" if sig == signal.SIGALRM else ""
        raise ForkedError(f"the build process was killed by {signal.Signals(sig).name}{why}")
    if data[:1] == FAILED:
        raise ForkedError("the build process failed:\n" + data[1:].decode(errors="replace"))
    if data[:1] != OK or os.WEXITSTATUS(status) != 0:
        raise ForkedError(f"the build process exited with status {os.WEXITSTATUS(status)} and no result")
    return data[1:]
