"""A worker's heartbeat: what it tells the tracker every interval on ``neuron.node.<id>.heartbeat``.

Every interval, and sooner when a session opened or closed (``next_beat``; no sooner than
``HEARTBEAT_SOON_S`` after the last beat): the tracker routes on the load it last heard of, and a
node whose session ended would otherwise look busy until its next beat.

Its range and cache ABI, status (ready, draining, or stuck: a backend call far overdue, see
runner.py), load (sessions, queued messages), measured throughput (runner.py:
positions per busy second over the last 30 s of real work, or the self-benchmark before there
is any), memory pressure, route failure rate, the latency to its neighbours on its routes and its
round trip to its server (node_telemetry.py; the pings run beside the heartbeats, never in their
way).

A self-benchmark is a few calls: taken while the machine was busy (other workers loading their
models at the same moment, say) it can be several times too slow, and a node the planner then
passes over never does the real work that would correct it. So an idle node takes it again,
every ``REBENCH_IDLE_S`` while it stays idle, on the backend thread (real work that arrives waits
for one benchmark at most) and reports the new figure.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import psutil

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.tasks import Background
from neuron_bus.timing import HEARTBEAT_INTERVAL_S, HEARTBEAT_SOON_S
from neuron_bus.worker.node_telemetry import neighbours
from neuron_bus.worker.runner import STUCK_AFTER_S

log = logging.getLogger(__name__)

REBENCH_IDLE_S = 60.0  # an idle node's self-benchmark older than this is taken again
PROBE_EVERY_S = HEARTBEAT_INTERVAL_S / 2  # a beat starts a round of pings no sooner than this after the last


class Heartbeat:
    def __init__(
        self, nc, report: M.CapabilityReport, engine, runner, node_telemetry, stuck_after_s: float = STUCK_AFTER_S
    ):
        self.nc = nc
        self.stuck_after_s = stuck_after_s  # runner.stuck: the backend call in progress is far overdue
        self.report = report
        self.engine = engine
        self.runner = runner
        self.node_telemetry = node_telemetry
        self.seq = 0
        self._probes = Background()
        self._rebench = Background()
        self.benchmarked_at = time.monotonic()  # the backend measured itself as it started
        self.sent_at: float | None = None  # monotonic time of the last beat
        self.probed_at = float("-inf")  # monotonic time the last round of pings started
        self._sessions_changed = asyncio.Event()
        engine.sessions.on_change = self._sessions_changed.set

    async def next_beat(self, interval: float) -> None:
        """Until the next beat is due: ``interval`` after the last, or once the sessions changed
        since it, but no sooner than ``HEARTBEAT_SOON_S`` after it."""
        last = self.sent_at if self.sent_at is not None else time.monotonic()
        try:
            await asyncio.wait_for(self._sessions_changed.wait(), max(0.0, last + interval - time.monotonic()))
        except TimeoutError:
            return
        await asyncio.sleep(max(0.0, last + HEARTBEAT_SOON_S - time.monotonic()))

    def build(self, queue_depth: int) -> M.NodeHeartbeat:
        self.seq += 1
        r, sessions = self.report, len(self.engine.sessions)
        speed = {  # positions per second: measured over real work, else the self-benchmark's
            "prefill": self.runner.measured_tps("prefill", r.prefill_tokens_per_second),
            "decode": self.runner.measured_tps("decode", r.decode_tokens_per_second),
        }
        return M.NodeHeartbeat(
            node_id=r.node_id,
            seq=self.seq,
            ts=time.time(),
            layer_start=r.layer_start,
            layer_end=r.layer_end,
            cache_abi=r.cache_abi,
            sessions_active=sessions,
            queue_depth=queue_depth,
            prefill_tokens_per_second=speed["prefill"],
            decode_tokens_per_second=speed["decode"],
            memory_pressure=psutil.virtual_memory().percent / 100.0,
            neighbour_latency_ms=dict(self.node_telemetry.latency_ms),
            route_failure_rate=self.node_telemetry.failure_rate(),
            status=self.status(speed),
            server_rtt_ms=self.node_telemetry.server_rtt_ms,
        )

    def status(self, speed: dict[str, float]) -> M.NodeStatus:
        """draining (moving to other layers), stuck (a backend call far overdue at this ``speed``:
        runner.stuck; ready again once it returns), or ready. The engine learns whether it is stuck
        here too: it refuses session opens until the next beat finds it not."""
        e = self.engine
        e.stuck = self.runner.stuck(time.monotonic(), speed, self.stuck_after_s)
        self.runner.metrics.stuck.set(int(e.stuck))
        if e.draining:
            return "draining"
        return "stuck" if e.stuck else "ready"

    async def send(self, queue_depth: int) -> None:
        now = self.sent_at = time.monotonic()
        self._sessions_changed.clear()  # what changed before this beat is in it
        await self.nc.publish(S.node_heartbeat(self.report.node_id), M.encode(self.build(queue_depth)))
        # one round of pings at a time, at the regular beats' pace (not at every session change)
        if not self._probes and now - self.probed_at >= PROBE_EVERY_S:
            self.probed_at = now
            routes = list({s.route.route_id: s.route for s in self.engine.sessions}.values())
            self._probes.spawn(self._probe(neighbours(self.report.node_id, routes)))
        if queue_depth == 0 and not self._rebench and self.rebench_due(time.monotonic()):
            self._rebench.spawn(self.benchmark_again())

    async def _probe(self, neighbour_ids: set[str]) -> None:
        await self.node_telemetry.measure_server_rtt(self.nc)
        await self.node_telemetry.refresh_latency(self.nc, neighbour_ids)

    def rebench_due(self, now: float) -> bool:
        """Idle (no session, nothing on the backend thread, no real decode work in the window) since
        the last self-benchmark, which is older than ``REBENCH_IDLE_S``."""
        e = self.engine
        return (
            now - self.benchmarked_at > REBENCH_IDLE_S
            and not e.sessions
            and not e.draining
            and self.runner.idle
            and not self.runner.measures("decode")
        )

    async def benchmark_again(self) -> None:
        report = self.report
        self.benchmarked_at = time.monotonic()  # also when it fails: not retried at once
        try:
            prefill, decode = await self.runner.call(self.engine.benchmark)
        except Exception:
            log.warning("worker %s: self-benchmark failed", report.node_id, exc_info=True)
            return
        if self.report is report:  # still the same range (a move brings its own benchmark)
            self.report = msgspec.structs.replace(
                report, prefill_tokens_per_second=prefill, decode_tokens_per_second=decode
            )

    async def stop(self) -> None:
        await self._probes.cancel_all()
        await self._rebench.cancel_all()
