"""What a worker measures about itself for its heartbeats, beyond throughput.

- route failure rate: the share of this node's recent sessions that ended in an error;
- latency to neighbours: round trips over the bus to the nodes next to it on its routes
  (neuron_bus/ping.py: a `Ping` on their control subject, answered by their `Pong`), halved,
  refreshed every few seconds;
- round trip to its own NATS server: the protocol's PING/PONG with every heartbeat
  (ping.server_round_trip: not a flush, whose timeout over a held link leaves the connection
  deaf), the least of the last few (queues only ever lengthen one). The tracker plans on it
  while its own sampled pings agree.
"""

from __future__ import annotations

import time
from collections import deque

from neuron_bus import messages as M
from neuron_bus.ping import ping_many, server_round_trip

PING_EVERY_S = 5.0
PING_TIMEOUT_S = 1.0
OUTCOMES_KEPT = 50
SERVER_RTT_SAMPLES = 8


class NodeTelemetry:
    def __init__(self, node_id: str):
        self.node_id = node_id
        self._outcomes: deque[bool] = deque(maxlen=OUTCOMES_KEPT)  # True = the session failed
        self.latency_ms: dict[str, float] = {}
        self._pinged_at = 0.0
        self._server_rtts: deque[float] = deque(maxlen=SERVER_RTT_SAMPLES)

    @property
    def server_rtt_ms(self) -> float | None:
        return round(min(self._server_rtts) * 1000, 3) if self._server_rtts else None

    async def measure_server_rtt(self, nc) -> None:
        rtt = await server_round_trip(nc, PING_TIMEOUT_S)
        if rtt is not None:  # no figure this time (a held or cut link): the last ones stand
            self._server_rtts.append(rtt)

    def session_ended(self, failed: bool) -> None:
        self._outcomes.append(failed)

    def failure_rate(self) -> float:
        return sum(self._outcomes) / len(self._outcomes) if self._outcomes else 0.0

    async def refresh_latency(self, nc, neighbours: set[str]) -> None:
        """Ping the neighbours (at most every PING_EVERY_S); forget nodes no longer next to us."""
        self.latency_ms = {n: ms for n, ms in self.latency_ms.items() if n in neighbours}
        if not neighbours or time.monotonic() - self._pinged_at < PING_EVERY_S:
            return
        self._pinged_at = time.monotonic()
        for node, rtt in (await ping_many(nc, neighbours, PING_TIMEOUT_S)).items():
            if rtt is not None:  # gone, busy or not a node: no figure this time
                self.latency_ms[node] = round(rtt * 1000 / 2, 3)


def neighbours(node_id: str, routes: list[M.RouteAssignment]) -> set[str]:
    """Nodes adjacent to ``node_id`` on these routes (the ring closes tail -> head)."""
    out: set[str] = set()
    for route in routes:
        ids = [h.node_id for h in route.hops]
        for i, n in enumerate(ids):
            if n == node_id:
                out.update({ids[i - 1], ids[(i + 1) % len(ids)]})
    out.discard(node_id)
    return out
