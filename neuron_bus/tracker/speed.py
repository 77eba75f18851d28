"""Measured speed: seconds per token of a node's range, the load on it, and stragglers.

A node's speed is its measured decode throughput (rolling, from heartbeats), else the
self-benchmark in its capability report, else unknown.

Stragglers. A token's time in a node is not proportional to its layer count: every call has a
fixed part (the call itself, the embedding at the head, the LM head at the tail), and with small
models it dominates (SmolLM2 on one thread: 15 layers decode at ~80 tok/s, all 30 at ~65). So a
node is not judged per layer against the group. It is compared with what its peers would take
for a range of its size: a peer's time per token as is when the peer holds at least as many
layers (more layers never cost less), scaled up by the layer ratio when it holds fewer (which
overestimates, since the fixed part is scaled too). The reference is the lower median of these
over the group's measured nodes, itself included; a node is slow when its time per token exceeds
``slow_factor`` times its reference. Equal ranges compare as they are, a node with few layers is
never slow just for its overhead, and a straggler stands out against any peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median_low

from neuron_bus.tracker.params import TrackerParams
from neuron_bus.tracker.view import NodeView

MAX_FAILURE_RATE = 0.9  # beyond this a node still costs only 10x: failures are rare, not fatal


def seconds_per_layer(view: NodeView) -> float | None:
    if not view.decode_tps or view.decode_tps <= 0 or view.n_layers <= 0:
        return None
    return 1.0 / (view.decode_tps * view.n_layers)


def reference_seconds_per_layer(views: Sequence[NodeView]) -> float | None:
    known = [s for s in map(seconds_per_layer, views) if s is not None]
    return median_low(known) if known else None


def measured_seconds_per_token(view: NodeView) -> float | None:
    if not view.decode_tps or view.decode_tps <= 0:
        return None
    return 1.0 / view.decode_tps


def reference_seconds_per_token(view: NodeView, peers: Sequence[NodeView]) -> float | None:
    """What a peer of the group would take per token for a range of ``view``'s size (see above)."""
    allowed = []
    for peer in peers:
        t = measured_seconds_per_token(peer)
        if t is not None and peer.n_layers > 0:
            allowed.append(t * max(1.0, view.n_layers / peer.n_layers))
    return median_low(allowed) if allowed else None


def slow_nodes(nodes: Sequence[NodeView], params: TrackerParams) -> set[str]:
    """Node ids of the stragglers among ``nodes`` (one numerics group, usable nodes only)."""
    return {v.node_id for v in nodes if is_slow(v, nodes, params)}


def is_slow(view: NodeView, peers: Sequence[NodeView], params: TrackerParams) -> bool:
    t = measured_seconds_per_token(view)
    if t is None:
        return False
    if all(p.node_id != view.node_id for p in peers):
        peers = [*peers, view]
    reference = reference_seconds_per_token(view, peers)
    return reference is not None and t > params.slow_factor * reference


def seconds_per_token(view: NodeView, reference: float | None, params: TrackerParams) -> float:
    """Time one decode token spends in this node's range when the node is idle.

    An unmeasured node is assumed ``unmeasured_factor`` times slower than the group reference
    (or the configured prior without one): never excluded, but not preferred over a measured
    node of reference speed.
    """
    spl = seconds_per_layer(view)
    if spl is None:
        spl = reference * params.unmeasured_factor if reference is not None else params.unknown_seconds_per_layer
    return spl * max(view.n_layers, 1)


def expected_seconds_per_token(view: NodeView, reference: float | None, params: TrackerParams) -> float:
    """Idle time per token, stretched by the sessions sharing the node and by its failures."""
    failure = min(max(view.failure_rate, 0.0), MAX_FAILURE_RATE)
    return seconds_per_token(view, reference, params) * (1 + view.load) / (1 - failure)


def seam_latency(u: NodeView, v: NodeView, params: TrackerParams) -> float:
    """One-way latency of a seam from u to v (seconds).

    Preference: a neighbour latency either node measured to the other; else, both nodes'
    round trips to the tracker halved (messages cross the server, which the tracker is
    usually next to); else the configured default.
    """
    for a, b in ((u, v), (v, u)):
        measured = a.neighbour_latency.get(b.node_id)
        if measured is not None and measured >= 0:
            return measured
    if u.rtt is not None and v.rtt is not None:
        return (u.rtt + v.rtt) / 2
    return params.default_hop_latency
