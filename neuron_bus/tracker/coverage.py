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

Cost, n nodes in r ranges over L layers: O(n log n + r log r + L + output). Nodes are grouped by
range once; layers served by the same ranges (runs between range boundaries) share one row
computation and one sorted replica list; stragglers are judged against per-size references
(speed.GroupSpeed, O(log m) each). It was O(n^2) (every node against every peer) plus O(L n).
The output itself is O(n + L x replicas per layer): the tracker builds it off its event loop
(service.py) and asks can leave the lists out (CoverageRequest.nodes, .replicas).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import msgspec

from neuron_bus.artifacts import cuts
from neuron_bus.messages import CoverageReport, CoverageStatus, LayerCoverage, ModelCoverage, RebalanceHint, TrackedNode
from neuron_bus.tracker import layers, speed
from neuron_bus.tracker.index import GroupIndex, RangeClass, RouteIndex
from neuron_bus.tracker.params import TrackerParams
from neuron_bus.tracker.view import NodeView, Numerics


def coverage_report(
    views: Sequence[NodeView],
    now: float,
    params: TrackerParams = TrackerParams(),
    model_preset: str | None = None,
    nodes: bool = True,
    replicas: bool = True,
) -> CoverageReport:
    """The map of ``views`` (``nodes``/``replicas`` false: without the node list / replica ids)."""
    chosen = [v for v in views if model_preset is None or v.caps.model_preset == model_preset]
    index = RouteIndex.of(chosen, params)
    slow = stragglers(index, chosen, params)
    return assemble(
        index,
        [(v, v.alive) for v in chosen],
        slow,
        lambda: tracked_nodes(chosen, slow),
        now,
        params,
        model_preset,
        nodes,
        replicas,
    )


def group_speeds(index: RouteIndex, numerics: Iterable[Numerics]) -> dict[Numerics, speed.GroupSpeed]:
    """Every group's straggler references (a group without usable nodes has none)."""
    empty = None
    out = {}
    for k in numerics:
        group = index.groups.get(k)
        if group is not None:
            out[k] = group.speed()
        else:
            out[k] = empty = empty or speed.GroupSpeed([])
    return out


def stragglers(index: RouteIndex, views: Sequence[NodeView], params: TrackerParams) -> set[str]:
    """The slow nodes among ``views``, each judged once for the whole map against its group's
    references in ``index``: its node entry and the rows of its layers read the same verdict
    (O(1) a node, speed.GroupSpeed)."""
    speeds = group_speeds(index, {v.numerics for v in views})
    return {v.node_id for v in views if speeds[v.numerics].is_slow(v, params)}


def assemble(
    index: RouteIndex,
    everyone: Iterable[tuple[NodeView, bool]],
    slow: Container[str],
    tracked: Callable[[], list[TrackedNode]],
    now: float,
    params: TrackerParams,
    model_preset: str | None,
    nodes: bool,
    replicas: bool,
) -> CoverageReport:
    """The report from the index (usable nodes, by group and range), every node known with
    whether it is alive, the stragglers among them, and the node list (built only if ``nodes``)."""
    live: dict[Numerics, list[str]] = defaultdict(list)
    dead: dict[Numerics, list[str]] = defaultdict(list)
    kinds: dict[Numerics, list[str]] = {}
    for v, alive in everyone:
        if model_preset is not None and v.caps.model_preset != model_preset:
            continue
        k = v.numerics
        (live if alive else dead)[k].append(v.node_id)
        if k not in kinds or (not kinds[k] and v.caps.layer_kinds):
            kinds[k] = list(v.caps.layer_kinds)
    return CoverageReport(
        generated_at=now,
        expiry_seconds=params.expiry,
        min_replicas=params.min_replicas,
        min_capacity_tokens_per_second=params.min_capacity_tokens_per_second,
        slow_factor=params.slow_factor,
        models=[
            model_coverage(k, index.groups.get(k), sorted(live[k]), sorted(dead[k]), kinds[k], slow, params, replicas)
            for k in sorted(kinds)
        ],
        nodes=tracked() if nodes else [],
    )


def model_coverage(
    numerics: Numerics,
    group: GroupIndex | None,
    nodes_live: list[str],
    nodes_expired: list[str],
    kinds: list[str],
    slow: Container[str],
    params: TrackerParams,
    replicas: bool = True,
) -> ModelCoverage:
    n = numerics.n_layers_total
    classes = dict(group.classes) if group is not None else {}
    sums = {r: _RangeSums.of(c, slow) for r, c in classes.items()}
    layer_rows = [
        row
        for a, b, serving in segments(classes, n)
        for row in layer_coverage(a, serving, [sums[(c.start, c.end)] for c in serving], params, rows=b - a)
    ]
    hint = rebalance_hint(layer_rows, list(classes), n, kinds)
    if not replicas:
        layer_rows = [msgspec.structs.replace(row, replicas=[]) for row in layer_rows]
    return ModelCoverage(
        model_preset=numerics.model_preset,
        model_revision=numerics.model_revision,
        backend_id=numerics.backend_id,
        cache_abi=numerics.cache_abi,
        n_layers_total=n,
        layers=layer_rows,
        nodes_live=nodes_live,
        nodes_expired=nodes_expired,
        hint=hint,
    )


def segments(classes: dict[tuple[int, int], RangeClass], n: int):
    """Maximal runs [a, b) of layers served by the same ranges, with those ranges:
    O(r log r) for r ranges, plus r per run."""
    cuts = sorted({0, n, *(x for r in classes for x in r if 0 <= x <= n)})
    for a, b in zip(cuts, cuts[1:]):
        yield a, b, [c for (s, e), c in classes.items() if s <= a and b <= e]


@dataclass(frozen=True)
class _RangeSums:
    """What a layer row needs of one range's replicas, summed once per report."""

    replicas: int
    capacity: float
    slow: int
    unmeasured: int

    @classmethod
    def of(cls, c: RangeClass, slow: Container[str]) -> _RangeSums:
        views = [e.view for e in c.nodes.values()]
        return cls(
            replicas=len(views),
            capacity=sum(v.decode_tps or 0.0 for v in views),
            slow=sum(node_id in slow for node_id in c.nodes),
            unmeasured=sum(not v.decode_tps for v in views),
        )


def layer_coverage(
    layer: int, serving: Sequence[RangeClass], sums: Sequence[_RangeSums], params: TrackerParams, rows: int = 1
) -> list[LayerCoverage]:
    """The rows of ``rows`` consecutive layers from ``layer`` that the ranges ``serving`` all
    cover (one list of replica ids, merged from the ranges' sorted ids, shared by every row)."""
    replicas = sum(x.replicas for x in sums)
    capacity = sum(x.capacity for x in sums)
    reasons = []
    if replicas and replicas < params.min_replicas:
        reasons.append("single replica" if replicas == 1 else f"{replicas} replicas < {params.min_replicas}")
    if replicas and all(x.slow == x.replicas for x in sums):
        reasons.append(f"only slow replicas (>{params.slow_factor:g}x the group's time per token for as many layers)")
    measured = not any(x.unmeasured for x in sums)
    if replicas and measured and capacity < params.min_capacity_tokens_per_second:
        reasons.append(f"capacity {capacity:.1f} tok/s < {params.min_capacity_tokens_per_second:g}")
    status: CoverageStatus = "gap" if not replicas else "under-provisioned" if reasons else "covered"
    listed = sorted(chain.from_iterable(c.sorted_ids() for c in serving))  # sorted runs: a merge
    return [
        LayerCoverage(
            layer=i,
            status=status,
            replicas=listed,
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


def tracked_nodes(views: Sequence[NodeView], slow: Container[str]) -> list[TrackedNode]:
    return [
        tracked_node(v, v.node_id in slow)
        for v in sorted(views, key=lambda v: (v.caps.model_preset, v.layer_start, v.node_id))
    ]


def tracked_node(v: NodeView, slow: bool) -> TrackedNode:
    return TrackedNode(
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
        memory_pressure=v.memory_pressure,
        rtt_ms=None if v.rtt is None else round(v.rtt * 1000, 3),
        slow=slow,
        trust_tier=v.caps.trust_tier,
        flagged=v.flagged,
        protocol=v.caps.protocol,
    )
