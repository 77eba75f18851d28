"""The coverage map: per model group and layer, live replicas, measured capacity and status.

Status of a layer (only usable nodes count: alive, ready, consistent):
- ``gap``: no replica.
- ``under-provisioned``: covered, but one failure or one straggler away from unusable; any of
  * fewer replicas than ``min_replicas`` (default 2: a single replica is a single point of failure),
  * every replica is slow (speed.is_slow: ``slow_factor`` times its peers' time per token),
  * measured capacity (sum of the replicas' decode tok/s) under ``min_capacity_tokens_per_second``
    (checked only when every replica has a measured throughput).
- ``covered``: otherwise.

The rebalancing hint names the half-open range a joining node should take: the largest gap if
any, else the under-provisioned run with the least capacity, else the run with the least
capacity; widened to boundaries where routes can actually join it (a chain from layer 0 ends at
its start, and a chain to the last layer starts at its end), so the new node is routable.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from neuron_bus.artifacts import cuts
from neuron_bus.messages import CoverageReport, LayerCoverage, ModelCoverage, RebalanceHint, TrackedNode
from neuron_bus.tracker import layers, speed
from neuron_bus.tracker.params import TrackerParams
from neuron_bus.tracker.view import NodeView, Numerics


def coverage_report(
    views: Sequence[NodeView], now: float, params: TrackerParams = TrackerParams(), model_preset: str | None = None
) -> CoverageReport:
    chosen = [v for v in views if model_preset is None or v.caps.model_preset == model_preset]
    groups: dict[Numerics, list[NodeView]] = defaultdict(list)
    for v in chosen:
        groups[v.numerics].append(v)
    speeds = {k: speed.GroupSpeed([v for v in vs if v.usable]) for k, vs in groups.items()}
    return CoverageReport(
        generated_at=now,
        expiry_seconds=params.expiry,
        min_replicas=params.min_replicas,
        min_capacity_tokens_per_second=params.min_capacity_tokens_per_second,
        slow_factor=params.slow_factor,
        models=[model_coverage(numerics, groups[numerics], speeds[numerics], params) for numerics in sorted(groups)],
        nodes=tracked_nodes(chosen, speeds, params),
    )


def model_coverage(
    numerics: Numerics, nodes: Sequence[NodeView], group_speed: speed.GroupSpeed, params: TrackerParams
) -> ModelCoverage:
    n = numerics.n_layers_total
    by_range: dict[tuple[int, int], list[NodeView]] = defaultdict(list)
    for v in nodes:
        if v.usable:
            by_range[(v.layer_start, v.layer_end)].append(v)
    slow = {v.node_id for vs in by_range.values() for v in vs if group_speed.is_slow(v, params)}
    layer_rows = [
        row for a, b, replicas in segments(by_range, n) for row in layer_coverage(a, replicas, slow, params, rows=b - a)
    ]
    return ModelCoverage(
        model_preset=numerics.model_preset,
        model_revision=numerics.model_revision,
        backend_id=numerics.backend_id,
        cache_abi=numerics.cache_abi,
        n_layers_total=n,
        layers=layer_rows,
        nodes_live=sorted(v.node_id for v in nodes if v.alive),
        nodes_expired=sorted(v.node_id for v in nodes if not v.alive),
        hint=rebalance_hint(layer_rows, list(by_range), n, model_layer_kinds(nodes)),
    )


def segments(by_range: dict[tuple[int, int], list[NodeView]], n: int):
    """Maximal runs [a, b) of layers served by the same ranges, with their replicas:
    O(r log r) for r ranges, plus the replicas once per run."""
    cuts = sorted({0, n, *(x for r in by_range for x in r if 0 <= x <= n)})
    for a, b in zip(cuts, cuts[1:]):
        replicas = [v for (s, e), vs in by_range.items() if s <= a and b <= e for v in vs]
        yield a, b, replicas


def layer_coverage(
    layer: int, replicas: Sequence[NodeView], slow: set[str], params: TrackerParams, rows: int = 1
) -> list[LayerCoverage]:
    """The rows of ``rows`` consecutive layers from ``layer`` that ``replicas`` all serve (one list of
    replica ids shared by every row)."""
    capacity = sum(v.decode_tps or 0.0 for v in replicas)
    reasons = []
    if replicas and len(replicas) < params.min_replicas:
        reasons.append("single replica" if len(replicas) == 1 else f"{len(replicas)} replicas < {params.min_replicas}")
    if replicas and all(v.node_id in slow for v in replicas):
        reasons.append(f"only slow replicas (>{params.slow_factor:g}x the group's time per token for as many layers)")
    measured = all(v.decode_tps for v in replicas)
    if replicas and measured and capacity < params.min_capacity_tokens_per_second:
        reasons.append(f"capacity {capacity:.1f} tok/s < {params.min_capacity_tokens_per_second:g}")
    status = "gap" if not replicas else "under-provisioned" if reasons else "covered"
    ids = sorted(v.node_id for v in replicas)
    return [
        LayerCoverage(
            layer=i,
            status=status,
            replicas=ids,
            capacity_tokens_per_second=round(capacity, 3),
            reasons=reasons,
        )
        for i in range(layer, layer + rows)
    ]


def spans(rows: Sequence[LayerCoverage]) -> list[tuple[int, int, LayerCoverage]]:
    """Consecutive layers with the same status, replicas and reasons, as (start, end, first row)."""
    out: list[tuple[int, int, LayerCoverage]] = []
    for row in rows:
        same = out and out[-1][1] == row.layer and _signature(out[-1][2]) == _signature(row)
        if same:
            out[-1] = (out[-1][0], row.layer + 1, out[-1][2])
        else:
            out.append((row.layer, row.layer + 1, row))
    return out


def _signature(row: LayerCoverage):
    return (row.status, tuple(row.replicas), tuple(row.reasons), row.capacity_tokens_per_second)


def model_layer_kinds(nodes: Sequence[NodeView]) -> list[str]:
    """The model's per-layer kinds, as its nodes report them ([] when none does)."""
    return next((list(v.caps.layer_kinds) for v in nodes if v.caps.layer_kinds), [])


def rebalance_hint(
    rows: Sequence[LayerCoverage], ranges: Sequence[tuple[int, int]], n: int, kinds: Sequence[str] = ()
) -> RebalanceHint | None:
    if n <= 0 or not rows:
        return None
    runs = [(a, b, row) for a, b, row in spans(rows)]
    gaps = [r for r in runs if r[2].status == "gap"]
    weak = [r for r in runs if r[2].status == "under-provisioned"]
    if gaps:
        a, b, _ = max(gaps, key=lambda r: (r[1] - r[0], -r[0]))
        why = f"coverage gap: no live node serves layers {layers.spell(a, b)}"
    else:
        pool = weak or runs
        a, b, row = min(pool, key=lambda r: (r[2].capacity_tokens_per_second, len(r[2].replicas), r[0]))
        label = "under-provisioned" if weak else "least capacity"
        detail = "; ".join(row.reasons) or f"{len(row.replicas)} replicas"
        why = f"{label}: layers {layers.spell(a, b)} ({detail}; {row.capacity_tokens_per_second:.1f} tok/s)"
    starts = sorted((x for x in layers.reachable_from_start(ranges) if x <= a), reverse=True)
    ends = sorted(y for y in layers.reaching_end(ranges, n) if y >= b)
    start, end = starts[0], ends[0]
    if (start, end) != (a, b):
        why += f"; widened to {layers.spell(start, end)} so routes can chain through it"
    if not cuts.loadable(kinds, start, end):  # the smallest chaining range llama.cpp can load
        problem = cuts.cut_problem(kinds, start, end)
        fits = [(s, e) for s in starts for e in ends if cuts.loadable(kinds, s, e)]
        if not fits:
            return None
        start, end = min(fits, key=lambda r: (r[1] - r[0], r[0]))
        why += f"; widened to {layers.spell(start, end)} because {problem}"
    return RebalanceHint(layer_start=start, layer_end=end, reason=why)


def tracked_nodes(
    views: Sequence[NodeView], speeds: dict[Numerics, speed.GroupSpeed], params: TrackerParams
) -> list[TrackedNode]:
    return [
        TrackedNode(
            node_id=v.node_id,
            model_preset=v.caps.model_preset,
            layer_start=v.layer_start,
            layer_end=v.layer_end,
            backend_id=v.caps.backend_id,
            cache_abi=v.caps.cache_abi,
            alive=v.alive,
            status=v.status if v.alive else "expired",
            seconds_since_heartbeat=None if v.seconds_since_heartbeat is None else round(v.seconds_since_heartbeat, 3),
            decode_tokens_per_second=v.decode_tps,
            prefill_tokens_per_second=v.prefill_tps,
            sessions_active=v.sessions_active,
            recently_assigned=v.recently_assigned,
            queue_depth=v.queue_depth,
            route_failure_rate=v.failure_rate,
            rtt_ms=None if v.rtt is None else round(v.rtt * 1000, 3),
            slow=speeds[v.numerics].is_slow(v, params),
            trust_tier=v.caps.trust_tier,
            flagged=v.flagged,
        )
        for v in sorted(views, key=lambda v: (v.caps.model_preset, v.layer_start, v.node_id))
    ]
