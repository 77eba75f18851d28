"""The worker's shell: binds the bus to the engine and does all of the worker's I/O.

- Announces its capability report (KV ``neuron-nodes`` and ``neuron.node.<id>.caps``) and sends
  heartbeats (heartbeat.py); answers control requests (control.py, lifecycle.py).
- For every route it serves, consumes the hop's prefill and decode subjects (consumers.py) and
  feeds the engine (engine.py): decode steps of different sessions in waves (waves.py), prefill
  chunks one at a time. Each batch: admit → compute (runner.py: the backend thread, or inline) →
  advance; then the outcomes are published, and each input is acknowledged only once the next
  hop's stream accepted its output (backpressure), after any snapshot due at that position.
- Sends what the outcomes ask for and acknowledges inputs (outbox.py); reaps idle sessions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from neuron_bus import codec
from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.prefix import PrefixCache
from neuron_bus.tasks import cancel_and_wait
from neuron_bus.timing import HEARTBEAT_INTERVAL_S
from neuron_bus.topology import DEFAULT_PREFILL_WINDOW, identity_of
from neuron_bus.worker.audit_trail import AuditTrail
from neuron_bus.worker.consumers import RouteConsumers
from neuron_bus.worker.control import ControlPlane
from neuron_bus.worker.deliveries import Deliveries
from neuron_bus.worker.engine import EngineOptions, Failed, Gone, HopEngine, Incoming, Output
from neuron_bus.worker.heartbeat import Heartbeat
from neuron_bus.worker.holds import Holds
from neuron_bus.worker.lifecycle import SessionLifecycle
from neuron_bus.worker.metrics import WorkerMetrics
from neuron_bus.worker.mover import Mover, Reload
from neuron_bus.worker.node_telemetry import NodeTelemetry
from neuron_bus.worker.outbox import Outbox
from neuron_bus.worker.runner import STUCK_AFTER_S, BackendRunner
from neuron_bus.worker.snapshots import SnapshotStore
from neuron_bus.worker.waves import DecodeWaves, next_prefill
from workers.errors import Reason

log = logging.getLogger("neuron_bus.worker")

DEFAULT_PREFIX_CACHE = 512 << 20  # bytes of prompt-prefix KV a worker keeps for sessions to come
STOP_BACKEND_GRACE_S = 10.0  # a stopping worker waits this long for the backend to free its sessions


@dataclass
class WorkerOptions:
    heartbeat_interval: float = HEARTBEAT_INTERVAL_S
    idle_timeout: float = 300.0
    stuck_after: float = STUCK_AFTER_S  # runner.stuck: a backend call this long overdue marks the node stuck
    max_decode_batch: int = 8
    batch_wait_ms: float = 10.0  # how long hop 0 may hold a decode step for other sessions' steps
    decode_ack_pending: int = 256
    # prefill chunks in flight per route and hop, over its sessions. Each session's subject holds at
    # most its window (DEFAULT_PREFILL_WINDOW), delivered or not, so this bounds no memory the
    # windows do not: it lets the hop see every waiting session's chunks and take them in the
    # sessions' turn (waves.next_prefill). With 16 (4 sessions' windows) the server handed out the
    # chunks in publish order, which interleaves the sessions, and the hop could only share each
    # batch among them all. With one, each chunk held the route for its compute plus three link
    # crossings (forward acknowledged, ack, next delivery).
    prefill_ack_pending: int = 64 * DEFAULT_PREFILL_WINDOW
    max_body: int = codec.DEFAULT_MAX_BODY
    slow_ms: float = 0.0  # add this much delay per backend call (fault injection for tests)
    snapshot_every: int = 0  # write a KV snapshot whenever a decoding session crosses a multiple of this
    snapshot_url: str | None = None  # the cache server holding neuron-snapshots (None: the bus)
    owned_layer_work: float = 0.0  # millions of weights multiplied per token (artifacts/work.py): the ledger's unit
    fault: str | None = None  # fault injection for trust tests: "perturb", "inflate-ledger" (trust/fault.py)
    require_keys: bool | None = False  # refuse sessions without link keys (`worker --session-keys`; None: auto)
    adaptive_drafts: bool = True  # `worker --draft-policy`: adaptive, or every draft found (False)
    prefix_cache_bytes: int = (
        DEFAULT_PREFIX_CACHE  # `worker --prefix-cache`: finished sessions' prompt prefixes (0: off)
    )

    def engine(self) -> EngineOptions:
        return EngineOptions(
            max_body=self.max_body,
            slow_ms=self.slow_ms,
            snapshot_every=self.snapshot_every,
            fault=self.fault,
            require_keys=bool(self.require_keys),
            adaptive_drafts=self.adaptive_drafts,
        )


class WorkerService:
    def __init__(
        self,
        nc: NATS,
        backend,
        tokenizer,
        report: M.CapabilityReport,
        options: WorkerOptions | None = None,
        reload: Reload | None = None,
    ):
        self.nc, self.js = nc, nc.jetstream()
        self.report, self.node_id = report, report.node_id
        self.opts = options or WorkerOptions()
        self.metrics = WorkerMetrics(self.node_id)
        self.trail = AuditTrail(self.js, report, self.opts.owned_layer_work, self.opts.fault)
        self.engine = HopEngine(self.node_id, report.cache_abi, backend, tokenizer, self.trail, self.opts.engine())
        self.runner = BackendRunner(self.node_id, self.metrics)
        self.queues: dict[str, deque[Incoming]] = {"decode": deque(), "prefill": deque()}
        self._work = asyncio.Event()
        self.waves = DecodeWaves(self.queues["decode"], self._work, self.opts.max_decode_batch, self.opts.batch_wait_ms)
        identity = identity_of(nc)
        self.holds = Holds()  # what the consumers delivered and the worker has not settled
        self.consumers = RouteConsumers(
            self.js,
            self._queue,
            self.opts.decode_ack_pending,
            self.opts.prefill_ack_pending,
            self.holds,
            secret=identity.secret if identity is not None else None,
        )
        self.node_telemetry = NodeTelemetry(self.node_id)
        self.snapshots = SnapshotStore(nc, report, self.metrics, url=self.opts.snapshot_url)
        prefixes = PrefixCache(self.opts.prefix_cache_bytes) if self.opts.prefix_cache_bytes > 0 else None
        deliveries = Deliveries()
        self.lifecycle = SessionLifecycle(
            self.engine, self.runner, self.consumers, deliveries, self.snapshots, self.trail, self.node_telemetry,
            self.metrics, prefixes, idle_timeout_s=self.opts.idle_timeout,
        )  # fmt: skip
        self.mover = Mover(self, reload)
        self.control = ControlPlane(self.node_id, self.lifecycle, tokenizer, self.metrics, self.mover)
        self.heartbeat = Heartbeat(nc, report, self.engine, self.runner, self.node_telemetry, self.opts.stuck_after)
        self.outbox = Outbox(
            nc, self.engine, self.runner, self.lifecycle, deliveries, self.snapshots, self.trail, self.metrics
        )
        self._loops: list[asyncio.Task] = []
        self._control_sub: Subscription | None = None
        self._move_sub: Subscription | None = None

    @property
    def sessions(self):
        return self.engine.sessions

    # ------------------------------------------------------------------ lifecycle

    async def announce(self) -> None:
        """The capability report, for the tracker: in KV ``neuron-nodes`` and on the caps subject."""
        kv = await self.js.key_value(S.KV_NODES)
        await kv.put(self.node_id, M.encode(self.report))
        await self.nc.publish(S.node_caps(self.node_id), M.encode(self.report))

    def take_range(self, backend, tokenizer, report: M.CapabilityReport, owned_layer_work: float) -> None:
        """Serve another range (a move, once drained): every part of the shell takes the new backend and report."""
        self.report = report
        self.engine.backend, self.engine.tokenizer, self.engine.cache_abi = backend, tokenizer, report.cache_abi
        self.control.tokenizer = tokenizer
        self.trail.report, self.trail.owned_layer_work = report, owned_layer_work
        self.snapshots.report = report
        if self.lifecycle.prefix_cache is not None:  # the old range's states are of no use now
            self.lifecycle.prefix_cache.clear()
        self.heartbeat.report = report

    async def start(self) -> None:
        await self.announce()
        self._control_sub = await self.nc.subscribe(S.node_control(self.node_id), cb=self.control.on_message)
        self._move_sub = await self.nc.subscribe(S.node_move(self.node_id), cb=self.control.on_move)
        await self.snapshots.start()
        self._loops = [
            asyncio.create_task(self._process_loop(), name="process"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._reap_loop(), name="reaper"),
            asyncio.create_task(self.holds.keep_alive(), name="keep-alive"),
        ]
        await self.heartbeat.send(self.queue_depth)

    async def stop(self, backend_grace_s: float = STOP_BACKEND_GRACE_S) -> bool:
        """Stop serving: the bus first, then the sessions' caches, freed on the backend thread within
        ``backend_grace_s`` (a stuck call would hold them for good). Returns whether the backend
        thread ended; False: a call still runs in it, which only the process's exit ends."""
        await cancel_and_wait(*self._loops)
        for sub in (self._control_sub, self._move_sub):
            if sub is not None:
                await sub.unsubscribe()
        await self.control.stop()
        await self.consumers.unbind_all()
        try:
            await asyncio.wait_for(self._close_sessions(), backend_grace_s)
        except TimeoutError:
            log.warning("%s: the backend did not free the sessions within %g s (%s)", self.engine.node_id,
                        backend_grace_s, self.runner.in_call())  # fmt: skip
        await self.snapshots.stop()
        await self.heartbeat.stop()
        await self.mover.stop()
        await self.outbox.stop()
        return self.runner.close()

    async def _close_sessions(self) -> None:
        for s in list(self.sessions):
            await self.lifecycle.close(s.session_id)

    @property
    def queue_depth(self) -> int:
        return sum(len(q) for q in self.queues.values())

    # ------------------------------------------------------------------ data plane

    def _queue(self, phase: str, msg: Incoming) -> None:
        self.queues[phase].append(msg)
        if phase == "decode":
            self.waves.returned(msg, time.monotonic())
        self._work.set()

    async def _process_loop(self) -> None:
        decode, prefill = self.queues["decode"], self.queues["prefill"]
        turn = "decode"
        while True:
            await self._work.wait()
            self._work.clear()
            while decode or prefill:
                try:  # decode waves and prefill chunks take turns: running sessions never starve a new one
                    if decode and (turn == "decode" or not prefill):
                        turn = "prefill"
                        await self._process(await self.waves.next(self.sessions, self.engine.backend), "decode")
                    else:
                        turn = "decode"
                        await self._process(next_prefill(prefill, self.sessions.turn, self.sessions.left), "prefill")
                except asyncio.CancelledError:
                    raise
                except Exception:  # never let one message kill the loop
                    log.exception("worker %s: unexpected error while processing", self.node_id)

    async def _process(self, batch: list[Incoming], phase: str) -> None:
        started = time.monotonic()  # a wave's cost to the ring: admission, compute and sending, not the call alone
        step = self.metrics.step
        if batch:
            step(phase, "wait", max(0.0, started - min(m.arrived for m in batch)))
        for m in batch:
            self.metrics.seam(phase, "in", len(m.data))
        steps, rejected = self.engine.admit(batch, phase)
        for r in rejected:
            self.outbox.reject(r)
        admitted = time.monotonic()
        step(phase, "admit", admitted - started)
        if not steps:
            return
        positions = sum(st.positions for st in steps)
        alone = len(self.sessions) == 1  # then this is its only step: a batch holds one step per session
        results = await self.runner.compute(lambda: self.engine.compute(steps, phase), phase, positions, alone)
        computed = time.monotonic()
        step(phase, "compute", computed - admitted)
        outcomes = self.engine.advance(steps, results)
        for o in outcomes:
            if isinstance(o, Gone):
                await o.step.handle.ack()
            elif isinstance(o, Failed):
                await self.outbox.failed(o)
        advanced = time.monotonic()
        step(phase, "advance", advanced - computed)
        await self.outbox.send([o for o in outcomes if isinstance(o, Output)])
        done = time.monotonic()
        step(phase, "send", done - advanced)
        if phase == "decode":
            self.waves.ran([st.session for st in steps], positions, done - started, done)

    # ------------------------------------------------------------------ heartbeats, reaping

    async def _heartbeat_loop(self) -> None:
        while True:
            await self.heartbeat.next_beat(self.opts.heartbeat_interval)
            try:
                await self.heartbeat.send(self.queue_depth)
            except Exception:
                log.warning("worker %s: heartbeat failed", self.node_id, exc_info=True)

    async def _reap_loop(self) -> None:
        timeout = self.opts.idle_timeout
        while True:
            await asyncio.sleep(min(10.0, max(0.5, timeout / 4)))
            now = time.monotonic()
            for s in list(self.sessions):
                if now - s.last_used > timeout:
                    await self.outbox.fail(
                        s, Reason.IDLE_TIMEOUT, f"session idle for more than {timeout:.0f}s; cache freed"
                    )
