"""The cheapest ring over a set of candidate nodes: the planner's search.

A ring is hop 0 (layer 0) .. hop k-1 (the last layer), contiguous, and the tail sends back to
the head. Its cost is the sum of its hops' expected seconds per token and of all its seams, the
tail-to-head seam included. A seam costs half of each end's round trip (speed.half_seam) unless
a latency was measured between the two (speed.measured_seam). Each node sits on exactly two
seams of its ring (a single node closes the ring on itself), so without measurements a ring
costs the sum of its nodes' ring weights (index.ring_weight: seconds per token + both half
seams), and a measured seam adds its difference to the estimate (``delta``, + or -) on top.

The search is a shortest path over layer boundaries (a DAG: every range moves forward), node by
node in order of their first layer; for each node it takes the cheapest chain ending where the
node starts, except through a predecessor with a measured seam to it, which is costed with its
delta. A node's chain does not depend on which head it started from, so one pass covers every
head, except heads with a measured seam to some tail (the closing seam depends on the pair):
each of those gets a pass of its own.

Cost, with c candidates, e measured seams among them and h heads with a measured closing seam:
O((1 + h) (c log c + e)). Ties break on the hops' node ids (deterministic), as before.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from neuron_bus.tracker import speed
from neuron_bus.tracker.index import ring_weight
from neuron_bus.tracker.params import TrackerParams
from neuron_bus.tracker.view import NodeView

Chain = tuple[float, tuple[NodeView, ...]]
# within the search a chain is (key, total, hops); key = (total rounded to 1e-12, the hops' ids):
# the order of chains, equal costs broken on node ids (deterministic)
_Ranked = tuple[tuple[float, tuple[str, ...]], float, tuple[NodeView, ...]]


def cheapest_ring(nodes: Sequence[NodeView], n: int, refs: speed.References, params: TrackerParams) -> Chain | None:
    """Minimum expected seconds per token over rings 0 -> n (see the module docstring);
    ``refs``: the group's references for unmeasured nodes (speed.References)."""
    by_id = {v.node_id: v for v in nodes}
    weight = {i: ring_weight(v, refs, params) for i, v in by_id.items()}
    half = {i: speed.half_seam(v, params, refs.rtt) for i, v in by_id.items()}
    into: dict[str, dict[str, float]] = defaultdict(dict)  # v -> {u: delta of the measured seam u -> v}
    closing: dict[str, dict[str, float]] = defaultdict(dict)  # head -> {tail: delta of the seam tail -> head}
    for v in by_id.values():
        for other in v.neighbour_latency:
            u = by_id.get(other)
            if u is None:
                continue
            for a, b in ((u, v), (v, u)):  # a seam a -> b
                if a.layer_end == b.layer_start or (a.layer_end == n and b.layer_start == 0):
                    measured = speed.measured_seam(a, b)
                    assert measured is not None, "v measured u (latencies on the wire are non-negative)"
                    d = measured - half[a.node_id] - half[b.node_id]
                    if a.layer_end == b.layer_start:
                        into[b.node_id][a.node_id] = d
                    if a.layer_end == n and b.layer_start == 0:
                        closing[b.node_id][a.node_id] = d
    ordered = sorted(by_id.values(), key=lambda v: (v.layer_start, v.node_id))
    heads = [v for v in ordered if v.layer_start == 0]
    plain = {h.node_id for h in heads if h.node_id not in closing}
    best: _Ranked | None = None
    passes: list[tuple[set[str], dict[str, float]]] = [(plain, {})] if plain else []  # (heads, closing deltas)
    passes += [({h}, closing[h]) for h in sorted(closing) if h in by_id and by_id[h].layer_start == 0]
    for sources, close in passes:
        for tail_id, (_, total, hops) in _chains(ordered, sources, weight, into).items():
            if hops[-1].layer_end != n:
                continue
            total += close.get(tail_id, 0.0)
            candidate = ((round(total, 12), tuple(h.node_id for h in hops)), total, hops)
            if best is None or candidate[0] < best[0]:
                best = candidate
    return None if best is None else (best[1], best[2])


def _chains(
    ordered: Sequence[NodeView], sources: set[str], weight: dict[str, float], into: dict[str, dict[str, float]]
) -> dict[str, _Ranked]:
    """The cheapest chain from any of ``sources`` to every node reachable from them."""
    chain: dict[str, _Ranked] = {}
    ends: dict[int, list[str]] = defaultdict(list)  # boundary -> nodes whose chain ends there
    ranked: dict[int, list[str]] = {}  # the same, ranked by chain cost (built on first use)
    none: dict[str, float] = {}
    for v in ordered:
        vid = v.node_id
        start = v.layer_start
        if start == 0:
            if vid not in sources:
                continue
            w = weight[vid]
            chain[vid] = ((round(w, 12), (vid,)), w, (v,))
        else:
            order = ranked.get(start)
            if order is None:
                order = ranked[start] = sorted(ends[start], key=lambda u: chain[u][0])
            measured = into.get(vid, none)
            w = weight[vid]
            best: _Ranked | None = None
            for u in order:  # the cheapest predecessor whose seam to v is not measured
                if u not in measured:
                    (_, ids), total, hops = chain[u]
                    total += w
                    best = ((round(total, 12), (*ids, vid)), total, (*hops, v))
                    break
            for u, delta in measured.items():
                c = chain.get(u)
                if c is not None and c[2][-1].layer_end == start:
                    (_, ids), total, hops = c
                    total += delta + w
                    option = ((round(total, 12), (*ids, vid)), total, (*hops, v))
                    if best is None or option[0] < best[0]:
                        best = option
            if best is None:
                continue
            chain[vid] = best
        ends[v.layer_end].append(vid)
    return chain
