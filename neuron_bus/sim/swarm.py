"""The simulated swarm's ground truth: nodes, their ranges, speeds, latencies, churn and sessions.

Pure and deterministic from a seed: the node pool (which plays the nodes on the bus) and the
orchestrator (which asks for routes and judges them) build the same swarm from the same
``SwarmSpec`` without talking to each other.

Ranges. Nodes hold a contiguous range sized by their memory: 5, 8, 10, 16, 20, 40 or all 80
layers of an 80-layer model, starting on multiples of their size (the splits operators and the
tracker's rebalancing hint produce: ranges meet at common seams), plus a three-way split
(0-29 | 30-54 | 55-79) whose seams meet few others, and a small share of ranges at arbitrary
places that rarely chain. About 50 distinct ranges, tens to hundreds of replicas each.

Speed. A node's time per token is a fixed part (the call, embedding or head) plus its layers
times a per-layer time drawn log-normally around 0.5 ms (hardware varies); 3% of the nodes are
stragglers, ten times slower. Heartbeats report the true throughput while a node is idle (its
self-benchmark) and, while it has sessions, a rolling measurement that drifts within 3% of it.

Latency. Every node sits in a region at a round trip from the bus (5 to 150 ms, with jitter);
a seam between two nodes costs half of each one's round trip (the planner's own model, see
tracker/speed.py), which is also what nodes report as latency to their route neighbours.

Churn. Over a run, fractions of the swarm per minute join (from a reserve of nodes generated
with the rest), leave (one last heartbeat saying ``draining``, then silence) or die (silence,
pings unanswered). Event times are drawn uniformly over the run.

Sessions. Every route the tracker assigns opens a session on each of its hops for a duration
drawn from the route id (so both sides agree): the load the next routes should see.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

from neuron_bus.messages import TrustTier

MODEL = "sim-80"
REVISION = "sim-r1"
BACKEND = "sim"
CACHE_ABI = "sim-kv-v1"
N_LAYERS = 80

# (layers per node, relative share of nodes)
SIZES = ((5, 0.08), (8, 0.1), (10, 0.2), (16, 0.17), (20, 0.2), (40, 0.12), (80, 0.03))
THREE_WAY = ((0, 30), (30, 55), (55, 80))
THREE_WAY_SHARE = 0.07
ODD_SHARE = 0.01  # ranges at arbitrary places
REGION_RTT_S = (0.005, 0.02, 0.04, 0.08, 0.15)
REGION_SHARE = (0.3, 0.3, 0.2, 0.15, 0.05)
STRAGGLER_SHARE = 0.03
TRUSTED_SHARE = 0.2
FIXED_S = 0.002  # per-token overhead of a call
PER_LAYER_S = 0.0005
SESSION_S = (15.0, 90.0)  # a chat of a few hundred tokens at tens of tokens per second


@dataclass(frozen=True)
class Churn:
    """Fractions of the initial swarm per minute."""

    joins: float = 0.0
    leaves: float = 0.0
    deaths: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> Churn:
        """``"0.02"`` (each kind at that rate) or ``"joins=0.02,leaves=0.01,deaths=0.01"``."""
        spec = spec.strip()
        if not spec:
            return cls()
        if "=" not in spec:
            rate = float(spec)
            return cls(rate, rate, rate)
        fields_ = {}
        for part in spec.split(","):
            key, _, value = part.partition("=")
            key = key.strip()
            if key not in ("joins", "leaves", "deaths"):
                raise ValueError(f"churn: unknown kind {key!r} (joins, leaves, deaths)")
            fields_[key] = float(value)
        return cls(**fields_)


@dataclass(frozen=True)
class SwarmSpec:
    nodes: int
    seed: int = 1
    duration: float = 30.0  # seconds of churn after the start of the run
    churn: Churn = Churn()


@dataclass
class SimNode:
    node_id: str
    layer_start: int
    layer_end: int
    decode_tps: float  # true throughput of its whole range (tokens/s)
    rtt: float  # true round trip to the bus, seconds
    trust_tier: TrustTier = "untrusted"
    failure_rate: float = 0.0
    join_at: float = 0.0  # seconds after the run's start (0: there from the beginning)
    leave_at: float | None = None
    leave_kind: str | None = None  # "leave" (announces draining) or "die" (silent)
    phase: float = 0.0  # heartbeat phase within the interval, [0, 1)
    noise_seed: int = field(default=0, repr=False)

    @property
    def n_layers(self) -> int:
        return self.layer_end - self.layer_start

    def alive_at(self, t: float) -> bool:
        return self.join_at <= t and (self.leave_at is None or t < self.leave_at)


def _pick(rng: random.Random, weighted):
    x, acc = rng.random() * sum(w for _, w in weighted), 0.0
    for value, w in weighted:
        acc += w
        if x < acc:
            return value
    return weighted[-1][0]


def _range(rng: random.Random) -> tuple[int, int]:
    roll = rng.random()
    if roll < ODD_SHARE:
        size = rng.randint(3, 30)
        start = rng.randint(1, N_LAYERS - size)
        return start, start + size
    if roll < ODD_SHARE + THREE_WAY_SHARE:
        return rng.choice(THREE_WAY)
    size = _pick(rng, SIZES)
    start = size * rng.randrange(N_LAYERS // size)
    return start, start + size


def _node(rng: random.Random, index: int) -> SimNode:
    a, b = _range(rng)
    per_layer = PER_LAYER_S * rng.lognormvariate(0.0, 0.5)
    if rng.random() < STRAGGLER_SHARE:
        per_layer *= 10
    region = _pick(rng, list(zip(range(len(REGION_RTT_S)), REGION_SHARE)))
    rtt = REGION_RTT_S[region] * rng.uniform(0.8, 1.25)
    return SimNode(
        node_id=f"sim-{index:05d}",
        layer_start=a,
        layer_end=b,
        decode_tps=1.0 / (FIXED_S + per_layer * (b - a)),
        rtt=rtt,
        trust_tier="trusted" if rng.random() < TRUSTED_SHARE else "untrusted",
        failure_rate=0.05 if rng.random() < 0.05 else 0.0,
        phase=rng.random(),
        noise_seed=rng.getrandbits(32),
    )


def generate(spec: SwarmSpec) -> list[SimNode]:
    """The initial nodes, then the reserve that joins during the run; leave and death times set."""
    rng = random.Random(spec.seed)
    minutes = spec.duration / 60.0
    n_join = round(spec.nodes * spec.churn.joins * minutes)
    nodes = [_node(rng, i) for i in range(spec.nodes + n_join)]
    for node in nodes[spec.nodes :]:
        node.join_at = rng.uniform(0.0, spec.duration)
    for kind, rate in (("leave", spec.churn.leaves), ("die", spec.churn.deaths)):
        count = round(spec.nodes * rate * minutes)
        candidates = [n for n in nodes[: spec.nodes] if n.leave_at is None]
        for node in rng.sample(candidates, min(count, len(candidates))):
            node.leave_at = rng.uniform(0.0, spec.duration)
            node.leave_kind = kind
    return nodes


def session_seconds(route_id: str) -> float:
    """How long the session opened on a route lasts (both sides derive it from the id)."""
    h = int.from_bytes(hashlib.sha256(route_id.encode()).digest()[:8], "big") / 2**64
    lo, hi = SESSION_S
    return lo + (hi - lo) * h


class Sessions:
    """Sessions open per node: every assigned route opens one on each hop for session_seconds."""

    def __init__(self):
        self._ends: dict[str, list[float]] = {}

    def open(self, route_id: str, node_ids, now: float) -> None:
        end = now + session_seconds(route_id)
        for node_id in node_ids:
            self._ends.setdefault(node_id, []).append(end)

    def active(self, node_id: str, now: float) -> int:
        ends = self._ends.get(node_id)
        if not ends:
            return 0
        ends[:] = [e for e in ends if e > now]
        return len(ends)

    def snapshot(self, now: float) -> dict[str, int]:
        """node id -> sessions open at ``now`` (nodes with none are left out)."""
        out = {}
        for node_id in list(self._ends):
            k = self.active(node_id, now)
            if k:
                out[node_id] = k
        return out
