"""NodeView: what the pure planner and coverage functions know about one node."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from neuron_bus.messages import PROTOCOL, CapabilityReport


class Numerics(NamedTuple):
    """Nodes may share a route only when all of these agree."""

    model_preset: str
    model_revision: str
    backend_id: str
    cache_abi: str
    n_layers_total: int


@dataclass(frozen=True)
class NodeView:
    caps: CapabilityReport
    alive: bool = True
    status: str = "ready"  # heartbeat status; "unknown" before the first heartbeat
    seconds_since_heartbeat: float | None = None
    decode_tps: float | None = None  # measured (heartbeat), else self-benchmark, else None
    prefill_tps: float | None = None
    sessions_active: int = 0
    recently_assigned: int = 0
    queue_depth: int = 0
    failure_rate: float = 0.0
    memory_pressure: float = 0.0  # share of the machine's memory in use (last heartbeat): for people, not routes
    rtt: float | None = None  # tracker <-> node round trip over the bus, seconds
    neighbour_latency: dict[str, float] = field(default_factory=dict)  # node_id -> seconds
    consistent: bool = True  # the heartbeat agrees with the capability report
    flagged: bool = False  # replays of its routes disagreed with the reference (KV neuron-flags): never routed

    @property
    def node_id(self) -> str:
        return self.caps.node_id

    @property
    def layer_start(self) -> int:
        return self.caps.layer_start

    @property
    def layer_end(self) -> int:
        return self.caps.layer_end

    @property
    def n_layers(self) -> int:
        return self.caps.layer_end - self.caps.layer_start

    @cached_property
    def numerics(self) -> Numerics:
        c = self.caps
        return Numerics(c.model_preset, c.model_revision, c.backend_id, c.cache_abi, c.n_layers_total)

    @property
    def valid_range(self) -> bool:
        c = self.caps
        return 0 <= c.layer_start < c.layer_end <= c.n_layers_total

    @property
    def usable(self) -> bool:
        """Alive, ready, consistent, of this tracker's protocol, and able to run prefill and decode
        steps of its range."""
        c = self.caps
        return (
            self.alive
            and self.status == "ready"
            and c.protocol == PROTOCOL
            and self.consistent
            and self.valid_range
            and c.supports_prefill
            and c.supports_decode_step
        )

    @property
    def load(self) -> int:
        """Sessions competing for this node: reported ones, plus recent assignments not yet
        reported, plus queued work."""
        return self.sessions_active + self.recently_assigned + self.queue_depth
