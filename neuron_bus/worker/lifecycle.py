"""A session's life on one hop: open, resume onto a repaired route, close.

The engine checks each request and records the session (engine.py); this module does the rest:
the backend's cache work on the backend thread (allocate, import a snapshot, truncate, free),
the route's consumers (bound with its first session, unbound with its last), the ledger entry at
close, and the gauges.
"""

from __future__ import annotations

import time

from neuron_bus import messages as M
from neuron_bus.errors import NeuronBusError
from neuron_bus.trust import sealing
from neuron_bus.worker.snapshots import object_name
from workers.errors import Reason


def unseal(meta: M.SnapshotMeta, blob: bytes, open_: M.SessionOpen) -> bytes:
    """A snapshot's state, checked against the session's key for this hop (refused when it does not
    match, or when an authenticated session finds an unprotected snapshot)."""
    if not open_.input_key:
        return blob
    try:
        return sealing.open_snapshot(meta, blob, open_.input_key)
    except ValueError as exc:
        raise NeuronBusError(Reason.NO_SNAPSHOT, str(exc)) from None


class SessionLifecycle:
    def __init__(self, engine, runner, consumers, snapshots, trail, node_telemetry, metrics):
        self.engine = engine
        self.runner = runner
        self.consumers = consumers
        self.snapshots = snapshots
        self.trail = trail
        self.node_telemetry = node_telemetry
        self.metrics = metrics

    @property
    def backend(self):
        return self.engine.backend

    async def open(self, req: M.SessionOpen) -> M.SessionOpened:
        hop = self.engine.check_open(req)
        cache_bytes = await self.runner.call(self.backend.open_session, req.session_id, req.n_ctx)
        self.engine.add(req)
        await self.consumers.bind(req.route, req.hop_index)
        self.update_gauges()
        return M.SessionOpened(
            session_id=req.session_id,
            route_id=req.route.route_id,
            node_id=self.engine.node_id,
            hop_index=req.hop_index,
            layer_start=hop.layer_start,
            layer_end=hop.layer_end,
            cache_bytes=cache_bytes,
        )

    async def resume(self, req: M.SessionResume) -> M.SessionResumed:
        """Route repair: move a session onto a new route at a snapshot position (see SessionResume)."""
        o = req.open
        old = self.engine.check_resume(req)
        snapshot = None
        if req.restore:
            meta, blob = await self.snapshots.find(o.session_id, req.position)
            blob = unseal(meta, blob, o)
            await self.runner.call(self.backend.import_state, o.session_id, o.n_ctx, meta.position, blob)
            position, snapshot = meta.position, object_name(meta)
        else:
            await self.runner.call(self.backend.truncate, o.session_id, req.position)
            position = req.position
        self.engine.add_resumed(req, position)
        await self.consumers.bind(o.route, o.hop_index)
        if old is not None and old.route.route_id not in self.engine.sessions.routes():
            await self.consumers.unbind(old.route.route_id)
        self.update_gauges()
        return M.SessionResumed(
            session_id=o.session_id,
            route_id=o.route.route_id,
            node_id=self.engine.node_id,
            hop_index=o.hop_index,
            position=position,
            snapshot=snapshot,
        )

    async def close(self, session_id: str, failed: bool = False) -> int:
        """Free the session's cache here; returns the bytes freed (0 for an unknown session)."""
        s = self.engine.sessions.pop(session_id)
        if s is None:
            return 0
        self.node_telemetry.session_ended(failed)
        self.snapshots.forget(session_id)
        freed = await self.runner.call(self.backend.cache_bytes, session_id)
        await self.runner.call(self.backend.close_session, session_id)
        await self.trail.close(s.open)
        if s.route.route_id not in self.engine.sessions.routes():
            await self.consumers.unbind(s.route.route_id)
        self.update_gauges()
        return freed

    def update_gauges(self) -> None:
        sessions = list(self.engine.sessions)
        self.metrics.sessions_active.set(len(sessions))
        self.metrics.cache_bytes.set(sum(self.backend.cache_bytes(s.session_id) for s in sessions))
        reserved, budget = self.backend.kv_positions()
        self.metrics.kv_positions.labels("reserved").set(reserved)
        self.metrics.kv_positions.labels("budget").set(budget)

    def report(self, rejected: dict[str, int]) -> M.SessionsReport:
        """What `neuron-bus sessions NODE` shows: every open session with its position and cache."""
        now = time.monotonic()
        infos = [
            M.SessionInfo(
                session_id=s.session_id,
                route_id=s.route.route_id,
                hop_index=s.hop_index,
                position=s.position,
                cache_bytes=self.backend.cache_bytes(s.session_id),
                idle_seconds=round(now - s.last_used, 3),
            )
            for s in self.engine.sessions
        ]
        return M.SessionsReport(
            node_id=self.engine.node_id,
            sessions=infos,
            cache_bytes_total=sum(i.cache_bytes for i in infos),
            backend_forward_calls=self.backend.forward_calls,
            rejected=dict(rejected),
            snapshots_written=self.snapshots.written,
            snapshot_failures=dict(self.snapshots.failures),
        )
