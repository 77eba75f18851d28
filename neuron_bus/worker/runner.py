"""Where a worker's backend calls run: one dedicated thread, in submission order, or — for a
decode call quicker than the hand-off to that thread and back — right on the event loop.

The thread keeps heartbeats and control requests responsive while the model computes. A call
runs inline only while the thread is idle, so calls already queued there (a snapshot export, say)
keep their order with it. A hop with one session and nothing else to do runs that session's
decode calls inline up to INLINE_ALONE_S: the hand-off to the thread and back (0.2 ms a token per
hop, scripts/token_profile) is then the largest cost of a hop after the call, and there is no
other session's work for the event loop to overlap with the call. The runner also measures what
compute costs: busy seconds per phase (Prometheus) and a 30 s window of real work from which
heartbeats report measured throughput; and it tells a call that runs far past what its positions
should take (``stuck``: a deadlocked or swapping backend) from one that is merely slow.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

INLINE_STEP_S = 0.0005  # decode calls quicker than this run on the event loop
INLINE_ALONE_S = 0.02  # ... and the decode calls of a hop's only session quicker than this
WORK_WINDOW_S = 30.0
MIN_POSITIONS_MEASURED = 8  # fewer positions of real work in the window: the self-benchmark stands
STUCK_FACTOR = 20.0  # a call is stuck past this many times what its positions take at the hop's speed ...
STUCK_AFTER_S = 60.0  # ... and past this many seconds (the default of `worker --stuck-after`)


class BackendRunner:
    def __init__(self, node_id: str, metrics):
        self.metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"backend-{node_id}")
        self._queued = 0  # calls handed to the thread and not finished yet
        self._decode_call_s = float("inf")  # how long the last decode call took
        self._window: deque[tuple[float, str, int, float]] = deque()  # (when, phase, positions, busy s)
        self._in_window: dict[str, list[float]] = {}  # phase -> [positions, busy s] over the window
        self.running: tuple[float, str, int] | None = None  # the compute call in progress: (started, phase, positions)
        self._calling_since: float | None = None  # when the backend thread's call in progress started

    async def call(self, fn, *args):
        """Run ``fn(*args)`` on the backend thread (one at a time, in submission order)."""
        self._queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._in_thread, fn, args)
        finally:
            self._queued -= 1

    def _in_thread(self, fn, args):
        self._calling_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._calling_since = None

    def in_call(self) -> str:
        """What the backend thread does now, in words (for a log line)."""
        since = self._calling_since
        return "idle" if since is None else f"in a call for {time.monotonic() - since:.1f} s"

    async def compute(self, fn, phase: str, positions: int, alone: bool = False):
        """Run one compute call ``fn()`` of ``positions`` positions, inline when it is quick enough
        (``alone``: the call is for the hop's only session)."""
        took = [0.0]

        def timed():
            t0 = time.monotonic()
            self.running = (t0, phase, positions)
            try:
                return fn()
            finally:
                self.running = None
                took[0] = time.monotonic() - t0  # the call alone, without any hand-off

        limit = INLINE_ALONE_S if alone else INLINE_STEP_S
        inline = phase == "decode" and self._decode_call_s < limit and self._queued == 0
        started = time.monotonic()
        result = timed() if inline else await self.call(timed)
        busy = took[0]
        if phase == "decode":
            self._decode_call_s = busy
        self.metrics.computed(phase, positions, busy, inline)
        self._window.append((started, phase, positions, busy))
        total = self._in_window.setdefault(phase, [0.0, 0.0])
        total[0] += positions
        total[1] += busy
        return result

    @property
    def idle(self) -> bool:
        """Nothing runs on the backend thread, nor waits to."""
        return self._queued == 0

    def measured_tps(self, phase: str, fallback: float) -> float:
        """Positions per busy second over the last 30 s of real work (capacity, not load)."""
        measured = self._measured_tps(phase)
        return fallback if measured is None else measured

    def _measured_tps(self, phase: str) -> float | None:
        now = time.monotonic()
        while self._window and now - self._window[0][0] > WORK_WINDOW_S:
            _, old_phase, old_positions, old_busy = self._window.popleft()
            total = self._in_window[old_phase]
            total[0] -= old_positions
            total[1] -= old_busy
        if not self._window:
            self._in_window.clear()  # no rounding left over from the subtractions
        positions, busy = self._in_window.get(phase, (0.0, 0.0))
        if positions < MIN_POSITIONS_MEASURED or busy <= 1e-9:
            return None
        return positions / busy

    def stuck(self, now: float, speed: dict[str, float], after_s: float = STUCK_AFTER_S) -> bool:
        """Whether the compute call in progress has run past both ``after_s`` and STUCK_FACTOR times
        what its positions take at the hop's ``speed`` (phase -> positions per second: measured_tps)."""
        running = self.running
        if running is None:
            return False
        started, phase, positions = running
        tps = speed.get(phase, 0.0)
        expected = positions / tps if tps > 0 else 0.0
        return now - started > max(after_s, STUCK_FACTOR * expected)

    def measures(self, phase: str) -> bool:
        """Whether the window holds enough real work of ``phase`` to measure (else the self-benchmark stands)."""
        return self._measured_tps(phase) is not None

    def close(self) -> bool:
        """Stop the backend thread, dropping the calls not started; returns whether it ended. False:
        a call still runs in it (a stuck backend), and nothing but the process's exit ends that."""
        ended = self._calling_since is None
        self._pool.shutdown(wait=ended, cancel_futures=True)
        return ended
