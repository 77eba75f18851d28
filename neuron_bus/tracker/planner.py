"""Route planning: from a route request and the usable nodes to a plan, or every reason there is none.

A route is a ring: hop 0 .. hop k-1 run contiguous layer ranges covering [0, n) exactly once,
and in decode the tail sends the sampled token back to hop 0. The expected time per token of a
route is the sum of its hops' expected seconds per token (measured speed stretched by load and
failures, see speed.py) plus every seam's latency, the tail-to-head seam included. ring.py finds
the cheapest one: a shortest path over layer boundaries.

Nodes that may not share a route with others are split first into numerics groups (model,
revision, backend, cache ABI, layer count); each group is planned on its own and the cheapest
complete route wins. Within a group, slow nodes (speed.py) are left out whenever the rest still
chains from 0 to n; only when they are needed are they used.

Only a few replicas of each layer range can be on the cheapest route: the search runs over the
``route_candidates`` lightest replicas of every range (index.py: ring weight order), not over the
group. That is exact when no more replicas than that serve a range, or when the seams of the
replicas left out are not measured pairwise (their order then cannot change); otherwise a
lighter replica's measured seam could be missed (the simulator measures what it costs).

Two entry points, one search:
- ``plan_indexed`` (the tracker): over the live index. Per request O(c (k + s) log m) to read
  the candidates (c ranges of m replicas, k candidates each, s skipped), then ring.py's
  O((1 + h) (ck log ck + e)); independent of the number of nodes beyond the log. It returns None
  when it finds no route; the tracker then asks ``plan_route`` why.
- ``plan_route`` (pure, any node views): the request's filters over every node, each with its
  reason, then the same search over a throwaway index: O(n log n). The path of rejections and of
  the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from neuron_bus.messages import RouteAssignment, RouteHop, RouteRejection, RouteRequest, protocol_mismatch
from neuron_bus.routes import TRUSTED_TIERS, hop_subject
from neuron_bus.tracker import layers, speed
from neuron_bus.tracker.index import GroupIndex, RangeClass, RouteIndex, ring_weight
from neuron_bus.tracker.params import TrackerParams
from neuron_bus.tracker.ring import Chain, cheapest_ring
from neuron_bus.tracker.view import NodeView, Numerics


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
    if mismatch := protocol_mismatch("this tracker", "the node", v.caps.protocol):
        return mismatch
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

    index = RouteIndex.of(live, params)
    plans: list[Plan] = []
    reasons: list[str] = []
    for group in index.groups_of(m):
        others = [v for v in live if v.numerics != group.numerics]
        result = plan_group(group, params, others=others)
        if isinstance(result, Plan):
            plans.append(result)
        else:
            reasons += result.reasons
    if plans:
        return _cheapest(plans)
    return Rejection(tuple(reasons))


def plan_indexed(
    req: RouteRequest, index: RouteIndex, params: TrackerParams, keep: Callable[[NodeView], bool]
) -> Plan | None:
    """The cheapest route over the live index, or None (then ``plan_route`` says why).

    ``keep``: the caller's test of a node for this request (alive now, not flagged); the
    request's pins pick the groups, its policy the trust tiers, its wire dtype the nodes.
    """
    pins = (req.model_revision, req.backend_id, req.cache_abi)
    groups = [
        g
        for g in index.groups_of(req.model_preset)
        if all(want is None or want == got for want, got in zip(pins, (g.numerics[1], g.numerics[2], g.numerics[3])))
    ]
    dtype = req.wire_dtype

    def eligible(v: NodeView) -> bool:
        return dtype in v.caps.wire_dtypes and keep(v)

    trusted_only = req.policy != "public"
    plans = [
        p for g in groups if isinstance(p := plan_group(g, params, eligible, trusted_only, chainable_only=True), Plan)
    ]
    return _cheapest(plans) if plans else None


def _cheapest(plans: Sequence[Plan]) -> Plan:
    return min(plans, key=lambda p: (p.seconds_per_token, [h.node_id for h in p.hops]))


def _everyone(view: NodeView) -> bool:
    return True


def plan_group(
    group: GroupIndex,
    params: TrackerParams,
    keep: Callable[[NodeView], bool] = _everyone,
    trusted_only: bool = False,
    others: Sequence[NodeView] = (),
    chainable_only: bool = False,
) -> Plan | Rejection:
    """Plan within one numerics group (every node may share a route with every other).

    ``others``: the request's eligible nodes of other groups; when there are any, reasons say
    which group they are about, and a gap names the nodes of other groups that serve its layers.
    ``chainable_only``: read only the ranges that can chain at all (a route is then found as
    before, but a rejection's reasons would not name every gap: plan_route reads them all).
    """
    numerics = group.numerics
    n = numerics.n_layers_total
    group_speed = group.speed()
    refs = group_speed.references

    def slow(v: NodeView) -> bool:
        return group_speed.is_slow(v, params)

    def weigh(v: NodeView) -> float:
        return ring_weight(v, refs, params)

    classes = group.chainable() if chainable_only else group.classes.values()
    lightest, fast = _candidates(classes, params.route_candidates, keep, trusted_only, slow, weigh)
    ranges = {(v.layer_start, v.layer_end) for v in lightest.values()}
    gaps = layers.uncovered_runs(ranges, n)
    qualifier = _group_qualifier(numerics) if others else ""
    if gaps:
        return Rejection(
            tuple(
                f"coverage gap at layers {layers.spell(a, b)}{qualifier}{_served_elsewhere(a, b, numerics, others)}"
                for a, b in gaps
            )
        )
    best = _cheapest_without_stragglers_first(fast, {**lightest, **fast}, n, refs, params)
    if best is None:
        return _no_chain(ranges, n, qualifier)
    cost, hops = best
    return Plan(hops, cost, numerics, tuple(h.node_id for h in hops if slow(h)))


def _candidates(
    classes: Iterable[RangeClass],
    k: int,
    keep: Callable[[NodeView], bool],
    trusted_only: bool,
    slow: Callable[[NodeView], bool],
    weigh: Callable[[NodeView], float],
) -> tuple[dict[str, NodeView], dict[str, NodeView]]:
    """The route candidates of every range class, by node id: (the ``k`` lightest of each, the
    ``k`` lightest of each that are not stragglers)."""
    lightest: dict[str, NodeView] = {}
    fast: dict[str, NodeView] = {}
    for cls in classes:
        top, top_fast = cls.best(k, keep, trusted_only, slow, weigh)
        lightest.update((v.node_id, v) for v in top)
        fast.update((v.node_id, v) for v in top_fast)
    return lightest, fast


def _group_qualifier(numerics: Numerics) -> str:
    """Which group a reason is about (when the request had nodes in other groups too)."""
    n = numerics
    return f" among nodes with cache ABI {n.cache_abi} (backend {n.backend_id}, revision {n.model_revision})"


def _cheapest_without_stragglers_first(
    fast: dict[str, NodeView], everyone: dict[str, NodeView], n: int, refs: speed.References, params: TrackerParams
) -> Chain | None:
    """The cheapest ring of the candidates that are not stragglers when those chain (only tried
    when there are stragglers among ``everyone``), else the cheapest of them all."""
    best = None
    if len(fast) < len(everyone):
        best = cheapest_ring(list(fast.values()), n, refs, params)
    if best is None:
        best = cheapest_ring(list(everyone.values()), n, refs, params)
    return best


def _no_chain(ranges: set[tuple[int, int]], n: int, qualifier: str) -> Rejection:
    """Every layer is served, but no chain of ranges runs from layer 0 to ``n``: where they stop."""
    reach = layers.reachable_from_start(ranges)
    stuck = sorted(b for b in reach if b < n)
    return Rejection(
        (
            f"no chain of node ranges covers layers {layers.spell(0, n)}: chains from layer 0 end "
            f"before layer(s) {', '.join(map(str, stuck))}, where no node starts{qualifier}",
        )
    )


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


# -- messages ---------------------------------------------------------------------------------


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
