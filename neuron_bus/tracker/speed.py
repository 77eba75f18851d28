"""Measured speed: seconds per token of a node's range, the load on it, and stragglers.

A node's speed is its measured decode throughput (rolling, from heartbeats), else the
self-benchmark in its capability report, else unknown. Nodes hold ranges of different sizes, so
they are compared per layer: seconds per layer per token. The reference of a group is the lower
median of its measured nodes; a node is slow when it is ``slow_factor`` times the reference.
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


def is_slow(view: NodeView, reference: float | None, params: TrackerParams) -> bool:
    spl = seconds_per_layer(view)
    return spl is not None and reference is not None and spl > params.slow_factor * reference


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
