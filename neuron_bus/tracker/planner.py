"""Route planning: pure functions from a route request and node views to a plan or reasons.

A route is a ring: hop 0 .. hop k-1 run contiguous layer ranges covering [0, n) exactly once,
and in decode the tail sends the sampled token back to hop 0. The expected time per token of a
route is the sum of its hops' expected seconds per token (measured speed stretched by load and
failures, see speed.py) plus every seam's latency, the tail-to-head seam included. The planner
minimises it with a shortest path over layer boundaries (a DAG: every range moves forward), run
once per candidate head so the ring-closing seam is exact.

Nodes that may not share a route with others are split first into numerics groups (model,
revision, backend, cache ABI, layer count); each group is planned on its own and the cheapest
complete route wins. Within a group, slow nodes (speed.is_slow) are left out whenever the rest
still chains from 0 to n; only when they are needed are they used.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from neuron_bus import subjects as S
from neuron_bus.messages import RouteAssignment, RouteHop, RouteRejection, RouteRequest
from neuron_bus.tracker import layers, speed
from neuron_bus.tracker.params import TrackerParams
from neuron_bus.tracker.view import NodeView, Numerics

TRUSTED_TIERS = ("trusted", "paid-trusted")


@dataclass(frozen=True)
class Plan:
    hops: tuple[NodeView, ...]
    seconds_per_token: float
    numerics: Numerics
    slow_used: tuple[str, ...] = ()  # slow nodes on the route because nothing could replace them


@dataclass(frozen=True)
class Rejection:
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class _Filter:
    keep: Callable[[NodeView], bool]
    reason: Callable[[Sequence[NodeView]], str]  # why nothing passed, given what was left


def _filters(req: RouteRequest) -> list[_Filter]:
    m = req.model_preset

    def pin(label: str, want: str | None, get: Callable[[NodeView], str]) -> list[_Filter]:
        if want is None:
            return []
        return [
            _Filter(
                keep=lambda v: get(v) == want,
                reason=lambda left: (
                    f"no live node of model {m} with {label} {want} "
                    f"(available: {', '.join(sorted({get(v) for v in left}))})"
                ),
            )
        ]

    out = [
        *pin("model revision", req.model_revision, lambda v: v.caps.model_revision),
        *pin("backend", req.backend_id, lambda v: v.caps.backend_id),
        *pin("cache ABI", req.cache_abi, lambda v: v.caps.cache_abi),
    ]
    if req.policy != "public":
        out.append(
            _Filter(
                keep=lambda v: v.caps.trust_tier in TRUSTED_TIERS,
                reason=lambda left: (
                    f"no live node of model {m} with trust tier trusted or paid-trusted (policy {req.policy})"
                ),
            )
        )
    out += [
        _Filter(
            keep=lambda v: not v.flagged,
            reason=lambda left: (
                f"every live node of model {m} left is flagged by audits "
                f"({', '.join(v.node_id for v in left)}): replays of their routes disagreed with the reference"
            ),
        ),
        _Filter(
            keep=lambda v: req.wire_dtype in v.caps.wire_dtypes,
            reason=lambda left: f"no live node of model {m} supports wire dtype {req.wire_dtype}",
        ),
        _Filter(
            keep=lambda v: v.usable,
            reason=lambda left: (
                f"no live node of model {m} is ready to serve "
                f"({', '.join(f'{v.node_id}: {_unusable(v)}' for v in left)})"
            ),
        ),
    ]
    return out


def _unusable(v: NodeView) -> str:
    if not v.consistent:
        return "heartbeat contradicts its capability report"
    if not v.valid_range:
        return f"invalid layer range {v.layer_start}-{v.layer_end} of {v.caps.n_layers_total}"
    if not (v.caps.supports_prefill and v.caps.supports_decode_step):
        return "no prefill or decode step support"
    return f"status {v.status}"


def plan_route(
    req: RouteRequest, views: Sequence[NodeView], params: TrackerParams = TrackerParams()
) -> Plan | Rejection:
    """The cheapest complete route for ``req``, or every reason there is none."""
    m = req.model_preset
    model_nodes = [v for v in views if v.caps.model_preset == m]
    live = [v for v in model_nodes if v.alive]
    if not live:
        expired = f" ({len(model_nodes)} expired: {', '.join(v.node_id for v in model_nodes)})" if model_nodes else ""
        return Rejection((f"no live node serves model {m}{expired}",))
    for f in _filters(req):
        kept = [v for v in live if f.keep(v)]
        if not kept:
            return Rejection((f.reason(live),))
        live = kept

    groups: dict[Numerics, list[NodeView]] = defaultdict(list)
    for v in live:
        groups[v.numerics].append(v)
    plans: list[Plan] = []
    reasons: list[str] = []
    for numerics in sorted(groups):
        others = [v for v in live if v.numerics != numerics]
        result = plan_group(groups[numerics], numerics, params, others)
        if isinstance(result, Plan):
            plans.append(result)
        else:
            reasons += result.reasons
    if plans:
        return min(plans, key=lambda p: (p.seconds_per_token, [h.node_id for h in p.hops]))
    return Rejection(tuple(reasons))


def plan_group(
    nodes: Sequence[NodeView], numerics: Numerics, params: TrackerParams, others: Sequence[NodeView] = ()
) -> Plan | Rejection:
    """Plan within one numerics group (every node may share a route with every other).

    ``others``: the request's eligible nodes of other groups; when there are any, reasons say
    which group they are about, and a gap names the nodes of other groups that serve its layers.
    """
    n = numerics.n_layers_total
    ranges = [(v.layer_start, v.layer_end) for v in nodes]
    gaps = layers.uncovered_runs(ranges, n)
    qualifier = (
        f" among nodes with cache ABI {numerics.cache_abi} (backend {numerics.backend_id}, revision {numerics.model_revision})"
        if others
        else ""
    )
    if gaps:
        return Rejection(
            tuple(
                f"coverage gap at layers {layers.spell(a, b)}{qualifier}{_served_elsewhere(a, b, numerics, others)}"
                for a, b in gaps
            )
        )
    reference = speed.reference_seconds_per_layer(nodes)
    slow = speed.slow_nodes(nodes, params)
    best = None
    if slow:
        best = cheapest_ring([v for v in nodes if v.node_id not in slow], n, reference, params)
    if best is None:
        best = cheapest_ring(nodes, n, reference, params)
    if best is None:
        reach = layers.reachable_from_start(ranges)
        stuck = sorted(b for b in reach if b < n)
        return Rejection(
            (
                f"no chain of node ranges covers layers {layers.spell(0, n)}: chains from layer 0 end "
                f"before layer(s) {', '.join(map(str, stuck))}, where no node starts{qualifier}",
            )
        )
    cost, hops = best
    return Plan(hops, cost, numerics, tuple(h.node_id for h in hops if h.node_id in slow))


def _served_elsewhere(a: int, b: int, numerics: Numerics, others: Sequence[NodeView]) -> str:
    """ "; layers a-b are served only by nodes that cannot share a route with this group: ..." or ""."""
    serving = sorted(
        (v for v in others if v.layer_start < b and a < v.layer_end), key=lambda v: (v.layer_start, v.node_id)
    )
    if not serving:
        return ""
    listed = ", ".join(
        f"{v.node_id} (layers {layers.spell(v.layer_start, v.layer_end)}, {_difference(v.numerics, numerics)})"
        for v in serving
    )
    return f"; layers {layers.spell(a, b)} are served only by nodes that cannot share a route with these: {listed}"


def _difference(mine: Numerics, theirs: Numerics) -> str:
    labels = ("model", "model revision", "backend", "cache ABI", "layer count")
    return ", ".join(f"{label} {x}" for label, x, y in zip(labels, mine, theirs) if x != y)


def cheapest_ring(
    nodes: Sequence[NodeView], n: int, reference: float | None, params: TrackerParams
) -> tuple[float, tuple[NodeView, ...]] | None:
    """Minimum expected seconds per token over chains 0 -> n, the tail->head seam included.

    Shortest path on a DAG: nodes sorted by layer_start; each node's best chain ends with the
    cheapest predecessor ending where it starts. Ties break on node ids (deterministic).
    """
    cost = {v.node_id: speed.expected_seconds_per_token(v, reference, params) for v in nodes}
    ordered = sorted(nodes, key=lambda v: (v.layer_start, v.node_id))
    ends_at: dict[int, list[NodeView]] = defaultdict(list)
    for v in ordered:
        ends_at[v.layer_end].append(v)
    best = None
    for head in (v for v in ordered if v.layer_start == 0):
        chain: dict[str, tuple[float, tuple[NodeView, ...]]] = {head.node_id: (cost[head.node_id], (head,))}
        for v in ordered:
            if v.layer_start == 0:
                continue
            options = [
                (chain[u.node_id][0] + speed.seam_latency(u, v, params) + cost[v.node_id], chain[u.node_id][1] + (v,))
                for u in ends_at[v.layer_start]
                if u.node_id in chain
            ]
            if options:
                chain[v.node_id] = min(options, key=_key)
        for tail in ends_at[n]:
            if tail.node_id in chain:
                total, hops = chain[tail.node_id]
                candidate = (total + speed.seam_latency(tail, head, params), hops)
                if best is None or _key(candidate) < _key(best):
                    best = candidate
    return best


def _key(option: tuple[float, tuple[NodeView, ...]]):
    return (round(option[0], 12), [h.node_id for h in option[1]])


# -- messages ---------------------------------------------------------------------------------


def hop_subject(route_id: str, index: int, node_id: str) -> str:
    """The base subject of a hop, keyed by the node serving it; workers append ``.prefill`` /
    ``.decode`` (subjects.hop_input)."""
    return S.hop_base(node_id, route_id, index)


def to_assignment(plan: Plan, req: RouteRequest, route_id: str, now: float) -> RouteAssignment:
    return RouteAssignment(
        route_id=route_id,
        model_preset=plan.numerics.model_preset,
        model_revision=plan.numerics.model_revision,
        n_layers_total=plan.numerics.n_layers_total,
        hops=[
            RouteHop(
                node_id=h.node_id,
                layer_start=h.layer_start,
                layer_end=h.layer_end,
                subject=hop_subject(route_id, i, h.node_id),
                backend_id=h.caps.backend_id,
                cache_abi=h.caps.cache_abi,
                trust_tier=h.caps.trust_tier,
            )
            for i, h in enumerate(plan.hops)
        ],
        wire_dtype=req.wire_dtype,
        encoding=req.encoding,
        created_at=now,
        policy=req.policy,
    )


def to_rejection(rejection: Rejection, req: RouteRequest) -> RouteRejection:
    return RouteRejection(request_id=req.request_id, reasons=list(rejection.reasons))
