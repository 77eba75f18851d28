"""A session's life on one hop: open, resume onto a repaired route, close.

The engine checks each request and records the session (engine.py); this module does the rest:
the backend's cache work on the backend thread (allocate, import a snapshot, truncate, free),
the route's consumers (bound with its first session, unbound with its last once the outbox has
acknowledged its inputs: deliveries.py), the ledger entry at
close, and the gauges.

Prefix reuse (neuron_bus/prefix.py): a session that ends keeps the KV of its prompt's prefix in
the hop's prefix cache (exported after cutting the session back to it); a session opened with a
prefix attaches it (imports that state) instead of allocating an empty cache, and its prompt then
arrives from the end of the prefix.
"""

from __future__ import annotations

import logging
import time

from neuron_bus import messages as M
from neuron_bus.errors import NeuronBusError
from neuron_bus.prefix import PrefixCache
from neuron_bus.trust import sealing
from neuron_bus.worker.snapshots import object_name
from workers.errors import BadInput, Reason

log = logging.getLogger("neuron_bus.worker")


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
    def __init__(
        self,
        engine,
        runner,
        consumers,
        deliveries,
        snapshots,
        trail,
        node_telemetry,
        metrics,
        prefix_cache: PrefixCache | None = None,
        idle_timeout_s: float = 0.0,
    ):
        self.prefix_cache = prefix_cache  # None: no prefix reuse on this hop
        self.idle_timeout_s = idle_timeout_s  # the worker's reaper frees a session idle this long (announced)
        self.engine = engine
        self.runner = runner
        self.consumers = consumers
        self.deliveries = deliveries  # what the outbox still sends for each session
        self.snapshots = snapshots
        self.trail = trail
        self.node_telemetry = node_telemetry
        self.metrics = metrics

    @property
    def backend(self):
        return self.engine.backend

    async def open(self, req: M.SessionOpen) -> M.SessionOpened:
        hop = self.engine.check_open(req)
        prefix, cache_bytes = await self._attach(req)
        self.engine.add(req, prefix.positions if prefix else 0)
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
            prefix=prefix,
            idle_timeout_s=self.idle_timeout_s,
        )

    def _keys(self, req: M.SessionOpen, blocks: list[str]) -> list[str]:
        """Cache keys of prefix blocks: a hop's state is its model revision's, layer range's and cache
        ABI's; and a prefix is reused by the client (owner) whose session left it only, so that nobody
        learns from an attach or a refusal whether another client's prompt began so."""
        hop = req.route.hops[req.hop_index]
        scope = f"{req.owner}/{req.route.model_revision}/{hop.layer_start}-{hop.layer_end}/{hop.cache_abi}/"
        return [scope + h for h in blocks]

    async def _attach(self, req: M.SessionOpen) -> tuple[M.PrefixReuse | None, int]:
        """Open the session's cache, from the prefix cache when the head chose a prefix (or is asked
        to choose one); a hop asked for a prefix it does not hold refuses (prefix_missing)."""
        cache, want = self.prefix_cache, req.prefix
        if req.reuse_prefix and cache is not None:
            hit = cache.longest(self._keys(req, req.prefix_blocks))
            if hit is not None:
                positions = hit[0]
                want = M.PrefixReuse(positions=positions, block_hash=req.prefix_blocks[positions // M.PREFIX_BLOCK - 1])
        if want is None:
            return None, await self.runner.call(self.backend.open_session, req.session_id, req.n_ctx)
        blob = cache.get(self._keys(req, [want.block_hash])[0], want.positions) if cache is not None else None
        if blob is None:
            self.metrics.prefix_lookups.labels("missing").inc()
            raise NeuronBusError(
                Reason.PREFIX_MISSING,
                f"{self.engine.node_id} holds no KV for the prompt prefix {want.block_hash[:12]} of {want.positions} "
                "positions (never kept or evicted); open the route without prefix reuse",
            )
        try:
            await self.runner.call(self.backend.import_state, req.session_id, req.n_ctx, want.positions, blob)
        except BadInput as exc:
            # llama.cpp takes a sequence's state only into a context laid out as the one it left (a
            # lane of as many streams: a session of another size class lands elsewhere)
            self.metrics.prefix_lookups.labels("unattachable").inc()
            if req.prefix is None:  # the head chose it: it opens the session without reuse instead
                return None, await self.runner.call(self.backend.open_session, req.session_id, req.n_ctx)
            raise NeuronBusError(
                Reason.PREFIX_MISSING,
                f"{self.engine.node_id} cannot attach the prompt prefix {want.block_hash[:12]} here ({exc}); "
                "open the route without prefix reuse",
            ) from None
        self.metrics.prefix_lookups.labels("attached").inc()
        self.metrics.prefill_reused.inc(want.positions)
        return want, self.backend.cache_bytes(req.session_id)

    async def _keep_prefix(self, s, keep: list[str]) -> None:
        """Keep the ended session's KV under its block hashes: those of its prompt and generated
        tokens the client names at close (``keep``, when they extend the prompt's), else the
        prompt's; as many blocks as this hop holds tokens the tail chose for."""
        cache, blocks = self.prefix_cache, s.open.prefix_blocks
        n = len(blocks)
        if keep and keep[:n] == blocks and all(len(h) == 32 for h in keep[n:]):
            blocks = keep
        blocks = blocks[: s.verified // M.PREFIX_BLOCK]  # not a speculative step's drafts
        if cache is None or not blocks:
            return
        keys = self._keys(s.open, blocks)
        if cache.holds(keys):
            cache.get(keys[-1], len(keys) * M.PREFIX_BLOCK)  # recently used
            return
        # a recurrent state cannot be cut back to the prefix; a no-op hop has no state to export
        if not (self.backend.capability.supports_truncate and self.backend.can_export):
            return
        blob = await self.runner.call(self._prefix_state, s.session_id, len(blocks) * M.PREFIX_BLOCK)
        if cache.put(keys, blob):
            self.metrics.prefix_lookups.labels("kept").inc()
        self.metrics.prefix_cache_bytes.set(cache.nbytes)

    def _prefix_state(self, session_id: str, positions: int) -> bytes:
        """Backend thread: the session cut back to its first ``positions`` positions, exported."""
        self.backend.truncate(session_id, positions)
        return self.backend.export_state(session_id)

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
        if old is not None:
            await self._release_route(o.session_id, old.route.route_id)
        self.update_gauges()
        return M.SessionResumed(
            session_id=o.session_id,
            route_id=o.route.route_id,
            node_id=self.engine.node_id,
            hop_index=o.hop_index,
            position=position,
            snapshot=snapshot,
            idle_timeout_s=self.idle_timeout_s,
        )

    async def close(self, session_id: str, failed: bool = False, keep: list[str] | None = None) -> int:
        """Free the session's cache here (its prefix kept first, see `_keep_prefix`); returns the
        bytes freed (0 for an unknown session)."""
        s = self.engine.sessions.pop(session_id)
        if s is None:
            return 0
        self.node_telemetry.session_ended(failed)
        self.snapshots.forget(session_id)
        freed = self.backend.cache_bytes(session_id)
        if not failed:
            try:
                await self._keep_prefix(s, keep or [])
            except Exception as exc:  # keeping a prefix is an optimisation: the session closes regardless
                self.metrics.prefix_lookups.labels("keep_failed").inc()
                log.warning("%s: keeping session %s's prefix failed: %s", self.engine.node_id, session_id, exc)
        await self.runner.call(self.backend.close_session, session_id)
        await self.trail.close(s.open)
        await self._release_route(session_id, s.route.route_id)
        self.update_gauges()
        return freed

    async def _release_route(self, session_id: str, route_id: str) -> None:
        """The route's consumers go with its last session here (a session that left it: closed, or
        moved to a repaired route), once that session's inputs are acknowledged; they stay when a
        session on the route was opened meanwhile (control requests run concurrently)."""

        def in_use() -> bool:
            return route_id in self.engine.sessions.routes()

        if in_use():
            return
        await self.deliveries.settled(session_id)  # inputs left unacknowledged would outlive the consumer
        await self.consumers.unbind(route_id, unless=in_use)

    def update_gauges(self) -> None:
        sessions = list(self.engine.sessions)
        self.metrics.sessions_active.set(len(sessions))
        self.metrics.cache_bytes.set(sum(self.backend.cache_bytes(s.session_id) for s in sessions))
        reserved, budget = self.backend.kv_positions()
        self.metrics.kv_positions.labels("reserved").set(reserved)
        self.metrics.kv_positions.labels("budget").set(budget)

    def report(self, rejected: dict[str, int], redelivered_copies: int) -> M.SessionsReport:
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
            redelivered_copies=redelivered_copies,
        )
