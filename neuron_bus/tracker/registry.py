"""The node table: capability reports and heartbeats, with expiry.

Liveness is judged on the tracker's clock (when a heartbeat arrived), never on the node's
timestamps. A heartbeat from a node whose report the tracker has not seen yet (a tracker
restart, a lost announcement) is kept, and ``needs_report`` tells the service to read the
node's report from the ``neuron-nodes`` KV bucket. The table is pure state: no NATS here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from neuron_bus.messages import CapabilityReport, NodeHeartbeat, RouteAssignment
from neuron_bus.tracker.params import TrackerParams
from neuron_bus.tracker.view import NodeView


@dataclass
class _Entry:
    caps: CapabilityReport | None = None
    heartbeat: NodeHeartbeat | None = None
    last_seen: float | None = None  # tracker clock, when the last heartbeat arrived
    added: float | None = None  # tracker clock, when the report arrived (live or read from KV)
    rtt: float | None = None
    assigned: deque[float] = field(default_factory=deque)
    was_alive: bool = False


class Registry:
    def __init__(self, params: TrackerParams = TrackerParams()):
        self.params = params
        self._nodes: dict[str, _Entry] = {}

    # -- updates ------------------------------------------------------------------------------

    def apply_report(self, caps: CapabilityReport, now: float | None = None) -> None:
        entry = self._nodes.setdefault(caps.node_id, _Entry())
        entry.caps = caps
        if entry.added is None:
            entry.added = now

    def apply_heartbeat(self, hb: NodeHeartbeat, now: float) -> None:
        entry = self._nodes.setdefault(hb.node_id, _Entry())
        entry.heartbeat = hb
        entry.last_seen = now

    def record_rtt(self, node_id: str, rtt: float | None) -> None:
        if node_id in self._nodes:
            self._nodes[node_id].rtt = rtt

    def record_assignment(self, route: RouteAssignment, now: float) -> None:
        for hop in route.hops:
            if hop.node_id in self._nodes:
                self._nodes[hop.node_id].assigned.append(now)

    # -- queries ------------------------------------------------------------------------------

    def alive(self, node_id: str, now: float) -> bool:
        entry = self._nodes.get(node_id)
        return entry is not None and entry.last_seen is not None and now - entry.last_seen <= self.params.expiry

    def needs_report(self, node_id: str) -> bool:
        """Heartbeating, but no capability report (or one the heartbeat contradicts)."""
        entry = self._nodes.get(node_id)
        return entry is not None and entry.heartbeat is not None and not _consistent(entry)

    def live_ids(self, now: float) -> list[str]:
        return sorted(n for n in self._nodes if self.alive(n, now))

    def sweep(self, now: float) -> tuple[list[str], list[str]]:
        """Note liveness changes; forget nodes dead for ``forget_after``.

        A report never followed by a heartbeat counts from when it arrived: the KV bucket keeps
        every node that ever announced itself, and a restarted tracker reads them all.

        Returns (node ids that came alive, node ids that expired) since the last sweep.
        """
        joined, expired = [], []
        for node_id, entry in list(self._nodes.items()):
            alive = self.alive(node_id, now)
            if alive and not entry.was_alive:
                joined.append(node_id)
            elif not alive and entry.was_alive:
                expired.append(node_id)
            entry.was_alive = alive
            seen = entry.last_seen if entry.last_seen is not None else entry.added
            if not alive and seen is not None and now - seen > self.params.forget_after:
                del self._nodes[node_id]
            while entry.assigned and now - entry.assigned[0] > self.params.assignment_window:
                entry.assigned.popleft()
        return sorted(joined), sorted(expired)

    def views(self, now: float) -> list[NodeView]:
        """A snapshot of every node with a capability report, for the planner and coverage."""
        out = []
        for node_id in sorted(self._nodes):
            entry = self._nodes[node_id]
            if entry.caps is None:
                continue
            hb = entry.heartbeat if _consistent(entry) else None
            caps = entry.caps
            out.append(
                NodeView(
                    caps=caps,
                    alive=self.alive(node_id, now),
                    status=hb.status if hb else "unknown",
                    seconds_since_heartbeat=None if entry.last_seen is None else now - entry.last_seen,
                    decode_tps=_measured(hb.decode_tokens_per_second if hb else 0.0, caps.decode_tokens_per_second),
                    prefill_tps=_measured(hb.prefill_tokens_per_second if hb else 0.0, caps.prefill_tokens_per_second),
                    sessions_active=hb.sessions_active if hb else 0,
                    recently_assigned=self._pending_assignments(entry, now),
                    queue_depth=hb.queue_depth if hb else 0,
                    failure_rate=hb.route_failure_rate if hb else 0.0,
                    rtt=entry.rtt,
                    neighbour_latency={k: v / 1000.0 for k, v in hb.neighbour_latency_ms.items()} if hb else {},
                    consistent=entry.heartbeat is None or hb is not None,
                )
            )
        return out

    def _pending_assignments(self, entry: _Entry, now: float) -> int:
        """Recent assignments no heartbeat could have reported yet (see TrackerParams)."""
        reported_before = entry.last_seen - self.params.assignment_grace if entry.last_seen is not None else None
        return sum(
            1
            for t in entry.assigned
            if now - t <= self.params.assignment_window and (reported_before is None or t > reported_before)
        )


def _consistent(entry: _Entry) -> bool:
    """The heartbeat describes the node the report describes (same range and cache ABI)."""
    caps, hb = entry.caps, entry.heartbeat
    if caps is None:
        return False
    if hb is None:
        return True
    return (hb.layer_start, hb.layer_end, hb.cache_abi) == (caps.layer_start, caps.layer_end, caps.cache_abi)


def _measured(rolling: float, benchmark: float) -> float | None:
    if rolling and rolling > 0:
        return rolling
    if benchmark and benchmark > 0:
        return benchmark
    return None
