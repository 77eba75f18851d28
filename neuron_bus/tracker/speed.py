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

Cost: per-node functions are O(1). GroupSpeed holds a group's references: O(m) to build from m
nodes plus O(m) per distinct range size among them (its members' references, computed up front);
then O(1) per member judged, and for a node outside the group O(m log m) once per size, O(log m)
after; a straggler set over a whole group is O(m s) for s sizes (it was O(m^2), comparing every
node with every peer).

Seams are separable: a seam costs half of each end's round trip (half_seam) unless a neighbour
latency was measured for that pair, so the planner can put each node's share on the node itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median_low
from typing import NamedTuple

import numpy as np

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


class References(NamedTuple):
    """What an unmeasured node of a group is compared with: the group's lower-median seconds per
    layer and round trip (None when no node of the group measured one)."""

    per_layer: float | None = None
    rtt: float | None = None


class GroupSpeed:
    """The straggler references of one numerics group, for every range size at once.

    Built from the group's usable nodes in O(m) plus O(m) per range size among them (their
    references, so that a judgement is a lookup); a node outside the group (its own time joins
    the peers, as the rule says) costs O(m log m) the first time its size is asked for (m:
    measured nodes) and O(log m) after.
    """

    def __init__(self, views: Sequence[NodeView]):
        measured = [
            (t, v.n_layers) for v in views if (t := measured_seconds_per_token(v)) is not None and v.n_layers > 0
        ]
        self._t = np.fromiter((t for t, _ in measured), dtype=np.float64, count=len(measured))
        self._layers = np.fromiter((k for _, k in measured), dtype=np.float64, count=len(measured))
        per_layer = [s for s in map(seconds_per_layer, views) if s is not None]
        rtts = [v.rtt for v in views if v.rtt is not None]
        self.references = References(median_low(per_layer) if per_layer else None, median_low(rtts) if rtts else None)
        self._allowed: dict[int, np.ndarray] = {}
        self.members = {v.node_id for v in views}
        # every member's size up front (O(m) each): a map built in a forked child finds them here
        self._member_reference: dict[int, float | None] = {
            k: self._lower_median(k) for k in {v.n_layers for v in views if v.n_layers > 0}
        }

    def _member(self, k: int) -> float | None:
        """A member's reference for k layers (computed up front for the members' own sizes)."""
        if k not in self._member_reference:
            self._member_reference[k] = self._lower_median(k)
        return self._member_reference[k]

    def _lower_median(self, k: int) -> float | None:
        """The lower median of what the measured members would take per token for k layers."""
        if not len(self._t):
            return None
        allowed = self._t * np.maximum(1.0, k / self._layers)
        j = (len(allowed) - 1) // 2
        return float(np.partition(allowed, j)[j])

    def _sorted_allowed(self, k: int) -> np.ndarray:
        got = self._allowed.get(k)
        if got is None:
            got = np.sort(self._t * np.maximum(1.0, k / self._layers))
            self._allowed[k] = got
        return got

    def reference_seconds_per_token(self, view: NodeView) -> float | None:
        """What a peer would take per token for a range of ``view``'s size (the module docstring)."""
        k = view.n_layers
        own = measured_seconds_per_token(view)
        if view.node_id in self.members or own is None or k <= 0:
            return self._member(k)
        allowed = self._sorted_allowed(k)
        # the view is not one of the peers: its own time (as is, same size) joins them
        j, p = len(allowed) // 2, int(np.searchsorted(allowed, own, side="right"))
        return float(allowed[j] if j < p else own if j == p else allowed[j - 1])

    def slow_threshold(self, n_layers: int, slow_factor: float) -> float | None:
        """Seconds per token beyond which a member of the group with ``n_layers`` is slow."""
        reference = self._member(n_layers)
        return None if reference is None else slow_factor * reference

    def is_slow(self, view: NodeView, params: TrackerParams) -> bool:
        t = measured_seconds_per_token(view)
        if t is None:
            return False
        if view.node_id in self.members:  # the usual case: one comparison with its size's threshold
            threshold = self.slow_threshold(view.n_layers, params.slow_factor)
            return threshold is not None and t > threshold
        reference = self.reference_seconds_per_token(view)
        return reference is not None and t > params.slow_factor * reference


def slow_nodes(nodes: Sequence[NodeView], params: TrackerParams) -> set[str]:
    """Node ids of the stragglers among ``nodes`` (one numerics group, usable nodes only)."""
    group = GroupSpeed(nodes)
    return {v.node_id for v in nodes if group.is_slow(v, params)}


def is_slow(view: NodeView, peers: Sequence[NodeView], params: TrackerParams) -> bool:
    return GroupSpeed(peers).is_slow(view, params)


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


def half_seam(view: NodeView, params: TrackerParams, rtt_reference: float | None = None) -> float:
    """A node's share of each seam it sits on: half its round trip to the server (messages cross
    the server): the figure the node reports while the tracker's pings agree with it, else the
    pings' own (registry._round_trip). A node without either is assumed
    ``unmeasured_factor`` times the group's reference round trip (never preferred over a measured
    node for being unmeasured), or the default seam without any measurement."""
    if view.rtt is not None:
        return view.rtt / 2
    if rtt_reference is not None:
        return rtt_reference * params.unmeasured_factor / 2
    return params.default_hop_latency / 2


def measured_seam(u: NodeView, v: NodeView) -> float | None:
    """A neighbour latency either node measured to the other (seconds), if any."""
    for a, b in ((u, v), (v, u)):
        measured = a.neighbour_latency.get(b.node_id)
        if measured is not None and measured >= 0:
            return measured
    return None


def seam_latency(u: NodeView, v: NodeView, params: TrackerParams, rtt_reference: float | None = None) -> float:
    """One-way latency of a seam from u to v (seconds).

    Preference: a neighbour latency either node measured to the other; else each node's half
    seam (half_seam) added up: both round trips halved when both are measured, the default when
    nothing is.
    """
    measured = measured_seam(u, v)
    if measured is not None:
        return measured
    return half_seam(u, params, rtt_reference) + half_seam(v, params, rtt_reference)
