"""Decision quality: a route's cost on the simulator's ground truth, against the best route there is.

Both are costed with the planner's own model (tracker/speed.py): each hop's expected seconds per
token (true throughput, stretched by the sessions truly open on it and its failure rate) plus
every seam of the ring, tail to head included, at half of each end's true round trip.

With every round trip known and no pairwise measurement overriding it, a ring's seams add up to
exactly the sum of its nodes' round trips (each node sits on two seams, at half its round trip on
each; a single node closes the ring on itself). The best ring is then a shortest path over layer
boundaries with node weights ``seconds per token + rtt``: an exact optimum computed here
independently of the planner's own search (which this checks). The optimum is the one the planner
may choose: stragglers left out when the rest chains, as the planner does (``ratio_any`` counts
them in too).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from neuron_bus.messages import RouteAssignment, RoutePolicy, RouteRequest
from neuron_bus.routes import TRUSTED_TIERS
from neuron_bus.sim import swarm
from neuron_bus.sim.pool import capability
from neuron_bus.tracker import speed
from neuron_bus.tracker.params import TrackerParams
from neuron_bus.tracker.planner import Plan, plan_route
from neuron_bus.tracker.view import NodeView


def truth_view(node: swarm.SimNode, sessions: int) -> NodeView:
    return NodeView(
        caps=capability(node),
        decode_tps=node.decode_tps,
        prefill_tps=node.decode_tps * 10,
        sessions_active=sessions,
        failure_rate=node.failure_rate,
        rtt=node.rtt,
    )


def ring_cost(hops: Sequence[NodeView], params: TrackerParams) -> float:
    """Expected seconds per token of a ring of measured nodes (speed.py's model)."""
    total = sum(speed.expected_seconds_per_token(v, None, params) for v in hops)
    return total + sum(speed.seam_latency(hops[i], hops[(i + 1) % len(hops)], params) for i in range(len(hops)))


def best_ring(views: Iterable[NodeView], n: int, params: TrackerParams) -> tuple[float, list[str]] | None:
    """The cheapest complete ring over ``views`` (all with measured throughput and rtt)."""
    by_start: dict[int, list[tuple[float, NodeView]]] = {}
    for v in views:
        assert v.rtt is not None, f"{v.node_id}: best_ring needs every round trip"
        weight = speed.expected_seconds_per_token(v, None, params) + v.rtt
        by_start.setdefault(v.layer_start, []).append((weight, v))
    dist: dict[int, tuple[float, list[str]]] = {0: (0.0, [])}
    for b in range(n):
        if b not in dist or b not in by_start:
            continue
        base, path = dist[b]
        for weight, v in by_start[b]:
            cand = (base + weight, [*path, v.node_id])
            old = dist.get(v.layer_end)
            if old is None or cand[0] < old[0]:
                dist[v.layer_end] = cand
    return dist.get(n)


def best_allowed(views: Sequence[NodeView], params: TrackerParams) -> tuple[float, list[str]] | None:
    """The best ring the planner may choose: stragglers (speed.py) left out whenever the rest
    still chains, as the planner does (a straggler's speed is not one to plan on)."""
    group = speed.GroupSpeed(views)
    fast = [v for v in views if not group.is_slow(v, params)]
    return best_ring(fast, swarm.N_LAYERS, params) or best_ring(views, swarm.N_LAYERS, params)


def search_ratio(views: Sequence[NodeView], policy: RoutePolicy, params: TrackerParams) -> float | None:
    """The planner's own search (planner.plan_route) on the ground truth, against the optimum:
    1.0 when the search loses nothing; what remains of a route's ratio is what the tracker did
    not know (round trips measured through queues, load a heartbeat behind, throughput noise)."""
    best = best_allowed(views, params)
    req = RouteRequest(request_id="judge", model_preset=swarm.MODEL, policy=policy)
    plan = plan_route(req, views, params)
    if best is None or not isinstance(plan, Plan):
        return None
    return ring_cost(plan.hops, params) / best[0]


class Judge:
    """Ground truth at the time of a request, for one route."""

    def __init__(self, nodes: Sequence[swarm.SimNode], params: TrackerParams):
        self.nodes = {n.node_id: n for n in nodes}
        self.params = params

    def eligible(self, t: float, sessions: dict[str, int], policy: RoutePolicy) -> list[NodeView]:
        """The nodes alive at run time ``t`` that ``policy`` admits, as they truly are."""
        return [
            truth_view(n, sessions.get(n.node_id, 0))
            for n in self.nodes.values()
            if n.alive_at(t) and (policy == "public" or n.trust_tier in TRUSTED_TIERS)
        ]

    def judge(
        self, route: RouteAssignment, t: float, sessions: dict[str, int], policy: RoutePolicy = "public"
    ) -> dict[str, float] | None:
        """{"cost", "best", "ratio", "ratio_any"} for ``route`` requested at run time ``t`` against the
        best the planner may choose (``ratio_any``: the best with stragglers too); None without a ring."""
        eligible = self.eligible(t, sessions, policy)
        best = best_allowed(eligible, self.params)
        if best is None:
            return None
        anything = best_ring(eligible, swarm.N_LAYERS, self.params)
        assert anything is not None, "best_allowed found a ring among these nodes"
        hops = [truth_view(self.nodes[h.node_id], sessions.get(h.node_id, 0)) for h in route.hops]
        cost = ring_cost(hops, self.params)
        return {"cost": cost, "best": best[0], "ratio": cost / best[0], "ratio_any": cost / anything[0]}
