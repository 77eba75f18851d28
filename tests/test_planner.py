"""Route planning and the coverage map: pure functions over node views, no NATS."""

from __future__ import annotations

import pytest

from neuron_bus import messages
from neuron_bus.tracker import layers
from neuron_bus.tracker.coverage import coverage_report, spans
from neuron_bus.tracker.params import TrackerParams
from neuron_bus.tracker.planner import Plan, Rejection, plan_route, to_assignment, to_rejection
from neuron_bus.tracker.view import NodeView

N = 30
P = TrackerParams()


def report(
    node_id: str, a: int, b: int, *, tps: float = 50.0, n: int = N, model: str = "smollm2-135m", **kw
) -> messages.CapabilityReport:
    """A capability report for ``node_id`` serving layers [a, b) at ``tps`` decode tok/s."""
    fields = dict(
        node_id=node_id,
        model_preset=model,
        model_revision="r1",
        artifact_id="art-1",
        backend_id="llama-cpp",
        layer_start=a,
        layer_end=b,
        n_layers_total=n,
        hidden_size=576,
        model_arch="llama",
        supported_runtime="llama.cpp",
        supports_prefill=True,
        supports_decode_step=True,
        supports_layer_range=True,
        supports_partial_artifacts=True,
        cache_abi="llama-kv-f16-v1",
        cache_bytes_per_token_estimate=1000,
        prefill_tokens_per_second=tps * 10,
        decode_tokens_per_second=tps,
        active_memory_floor=1 << 20,
    )
    fields.update(kw)
    return messages.CapabilityReport(**fields)


def node(node_id: str, a: int, b: int, *, tps: float = 50.0, alive: bool = True, sessions: int = 0, **kw) -> NodeView:
    view_kw = {
        k: kw.pop(k) for k in list(kw) if k in ("status", "recently_assigned", "queue_depth", "failure_rate", "rtt")
    }
    return NodeView(
        caps=report(node_id, a, b, tps=tps, **kw), alive=alive, decode_tps=tps, sessions_active=sessions, **view_kw
    )


def request(**kw) -> messages.RouteRequest:
    return messages.RouteRequest(request_id="req-1", model_preset="smollm2-135m", **kw)


def route_of(result) -> list[tuple[str, int, int]]:
    assert isinstance(result, Plan), result
    return [(h.node_id, h.layer_start, h.layer_end) for h in result.hops]


def rows_for(report_: messages.CoverageReport, first: int, last: int):
    (group,) = report_.models
    return group.layers[first : last + 1]


# -- shortest path ----------------------------------------------------------------------------


def test_cheapest_complete_chain_wins_over_fewer_or_more_hops():
    views = [
        node("whole", 0, 30, tps=10),  # 100 ms/token
        node("head", 0, 15, tps=100),  # 10 ms
        node("tail", 15, 30, tps=100),  # 10 ms
        node("mid-a", 15, 20, tps=40),
        node("mid-b", 20, 30, tps=40),
    ]
    assert route_of(plan_route(request(), views)) == [("head", 0, 15), ("tail", 15, 30)]


def test_seam_latency_counts_including_the_ring_back_to_the_head():
    # Two 1-ms hops need two seams; one 2.5 ms node needs one seam back to itself.
    slow_seams = TrackerParams(default_hop_latency=0.002)
    views = [node("whole", 0, 30, tps=400), node("head", 0, 15, tps=1000), node("tail", 15, 30, tps=1000)]
    assert route_of(plan_route(request(), views, slow_seams)) == [("whole", 0, 30)]
    fast_seams = TrackerParams(default_hop_latency=0.0001)
    assert route_of(plan_route(request(), views, fast_seams)) == [("head", 0, 15), ("tail", 15, 30)]


def test_measured_neighbour_latency_beats_the_default():
    far = NodeView(caps=report("tail-far", 15, 30), decode_tps=50.0, neighbour_latency={"head": 0.2})
    near = NodeView(caps=report("tail-near", 15, 30), decode_tps=40.0, neighbour_latency={"head": 0.0001})
    views = [node("head", 0, 15), far, near]
    assert route_of(plan_route(request(), views)) == [("head", 0, 15), ("tail-near", 15, 30)]


def test_assignment_hops_are_ordered_contiguous_and_name_their_subjects():
    views = [node("a", 0, 10), node("b", 10, 20), node("c", 20, 30, trust_tier="trusted")]
    req = request(wire_dtype="bf16")
    a = to_assignment(plan_route(req, views), req, "r0ute", 123.0)
    assert [h.subject for h in a.hops] == [f"neuron.act.{h.node_id}.r0ute.{i}" for i, h in enumerate(a.hops)]
    assert [(h.layer_start, h.layer_end) for h in a.hops] == [(0, 10), (10, 20), (20, 30)]
    assert a.hops[2].trust_tier == "trusted" and a.wire_dtype == "bf16" and a.n_layers_total == N
    assert (a.model_revision, a.hops[0].backend_id, a.hops[0].cache_abi) == ("r1", "llama-cpp", "llama-kv-f16-v1")
    decoded = messages.decode(messages.encode(a), messages.RouteReply)
    assert decoded == a


# -- stragglers -------------------------------------------------------------------------------


def test_slow_replica_is_avoided_when_a_faster_one_covers_its_layers():
    views = [node("head", 0, 15), node("fast", 15, 30, tps=50), node("slow", 15, 30, tps=2)]
    for _ in range(5):
        assert route_of(plan_route(request(), views))[1][0] == "fast"
    # Even when the fast replica is loaded, the slow node stays off new routes.
    busy = [node("head", 0, 15), node("fast", 15, 30, tps=50, sessions=8), node("slow", 15, 30, tps=2)]
    assert route_of(plan_route(request(), busy))[1][0] == "fast"


def test_slow_node_is_avoided_even_when_the_alternative_is_split_differently():
    views = [node("head", 0, 10), node("slow", 10, 30, tps=1), node("m", 10, 20), node("t", 20, 30)]
    assert route_of(plan_route(request(), views)) == [("head", 0, 10), ("m", 10, 20), ("t", 20, 30)]


def test_only_replica_is_used_even_when_slow_and_the_map_marks_it_under_provisioned():
    views = [node("h1", 0, 15), node("h2", 0, 15), node("slow", 15, 30, tps=2)]
    result = plan_route(request(), views)
    assert route_of(result)[1] == ("slow", 15, 30)
    assert result.slow_used == ("slow",)
    cov = coverage_report(views, 0.0, P)
    for row in rows_for(cov, 15, 29):
        assert row.status == "under-provisioned"
        assert row.replicas == ["slow"]
        assert "single replica" in row.reasons and any("slow" in r for r in row.reasons)
    assert {r.status for r in rows_for(cov, 0, 14)} == {"covered"}
    assert [n.node_id for n in cov.nodes if n.slow] == ["slow"]


def test_failure_rate_and_queue_depth_make_a_node_more_expensive():
    views = [node("flaky", 0, 30, failure_rate=0.5), node("steady", 0, 30, tps=40)]
    assert route_of(plan_route(request(), views))[0][0] == "steady"
    views = [node("queued", 0, 30, queue_depth=3), node("idle", 0, 30, tps=40)]
    assert route_of(plan_route(request(), views))[0][0] == "idle"


def test_unmeasured_node_is_usable_and_neither_preferred_nor_excluded():
    unknown = NodeView(caps=report("fresh", 15, 30, tps=0.0), decode_tps=None)
    assert route_of(plan_route(request(), [node("head", 0, 15), unknown]))[1][0] == "fresh"
    both = [node("head", 0, 15), unknown, node("known", 15, 30)]
    assert route_of(plan_route(request(), both))[1][0] == "known"  # measured at reference speed
    straggler = [node("head", 0, 15), unknown, node("known", 15, 30, tps=5)]
    assert route_of(plan_route(request(), straggler))[1][0] == "fresh"  # measured slow loses


# -- spreading --------------------------------------------------------------------------------


def test_concurrent_sessions_spread_over_replicas_by_recent_assignments():
    counts = {"a": 0, "b": 0}
    for _ in range(16):
        views = [node(n, 0, 30, recently_assigned=counts[n]) for n in counts]
        counts[route_of(plan_route(request(), views))[0][0]] += 1
    assert counts == {"a": 8, "b": 8}


def test_reported_sessions_count_as_load():
    views = [node("a", 0, 30, sessions=3), node("b", 0, 30, tps=30)]
    assert route_of(plan_route(request(), views))[0][0] == "b"


# -- exclusions and reasons -------------------------------------------------------------------


def test_gap_reason_spells_layers_inclusively():
    views = [node("a", 0, 10), node("c", 20, 30)]
    assert plan_route(request(), views) == Rejection(("coverage gap at layers 10-19",))
    assert plan_route(request(), [node("a", 0, 29)]) == Rejection(("coverage gap at layers 29",))


def test_dead_nodes_are_excluded_and_turn_into_gaps():
    views = [node("a", 0, 15), node("b", 15, 30, alive=False)]
    assert plan_route(request(), views) == Rejection(("coverage gap at layers 15-29",))
    assert plan_route(request(), [node("b", 15, 30, alive=False)]) == Rejection(
        ("no live node serves model smollm2-135m (1 expired: b)",)
    )
    assert plan_route(request(), []) == Rejection(("no live node serves model smollm2-135m",))
    cov = coverage_report(views, 0.0, P)
    assert {r.status for r in rows_for(cov, 15, 29)} == {"gap"}
    assert cov.models[0].nodes_expired == ["b"]


def test_other_cache_abi_never_joins_a_route_and_the_request_is_rejected_with_the_reason():
    views = [
        node("a", 0, 15),
        node("b", 15, 30, cache_abi="llama-kv-q8-v2"),
        node("a2", 0, 15, cache_abi="llama-kv-q8-v2"),
    ]
    result = plan_route(request(), views)
    assert isinstance(result, Plan) and {h.caps.cache_abi for h in result.hops} == {"llama-kv-q8-v2"}
    # Without a2, nothing with one ABI covers everything: one reason per ABI group.
    result = plan_route(request(), views[:2])
    assert isinstance(result, Rejection)
    assert "coverage gap at layers 15-29 among nodes with cache ABI llama-kv-f16-v1" in result.reasons[0]
    assert "coverage gap at layers 0-14 among nodes with cache ABI llama-kv-q8-v2" in result.reasons[1]
    pinned = plan_route(request(cache_abi="llama-kv-f16-v1"), views)
    assert pinned == Rejection(("coverage gap at layers 15-29",))
    missing = plan_route(request(cache_abi="z"), views)
    assert missing == Rejection(
        ("no live node of model smollm2-135m with cache ABI z (available: llama-kv-f16-v1, llama-kv-q8-v2)",)
    )


@pytest.mark.parametrize(
    "pin, value, expected",
    [
        ("model_revision", "r9", "with model revision r9 (available: r1, r2)"),
        ("backend_id", "torch", "with backend torch (available: llama-cpp)"),
    ],
)
def test_pins_exclude_and_explain(pin, value, expected):
    views = [node("a", 0, 30), node("b", 0, 30, model_revision="r2")]
    result = plan_route(request(**{pin: value}), views)
    assert isinstance(result, Rejection) and expected in result.reasons[0]
    assert route_of(plan_route(request(model_revision="r2"), views)) == [("b", 0, 30)]


def test_revisions_never_mix_on_one_route():
    views = [node("a", 0, 15), node("b", 15, 30, model_revision="r2")]
    result = plan_route(request(), views)
    assert isinstance(result, Rejection) and len(result.reasons) == 2


def test_policy_filter_uses_only_trusted_tiers():
    views = [node("pub", 0, 30, tps=500), node("trusted", 0, 30, trust_tier="trusted")]
    assert route_of(plan_route(request(), views))[0][0] == "pub"
    assert route_of(plan_route(request(policy="private"), views))[0][0] == "trusted"
    paid = [node("pub", 0, 30), node("paid", 0, 30, trust_tier="paid-trusted")]
    assert route_of(plan_route(request(policy="paid-trusted"), paid))[0][0] == "paid"
    rejected = plan_route(request(policy="private"), [node("pub", 0, 30)])
    assert rejected == Rejection(
        ("no live node of model smollm2-135m with trust tier trusted or paid-trusted (policy private)",)
    )


def test_wire_dtype_and_readiness_filters_explain():
    views = [node("a", 0, 30, wire_dtypes=["f32"])]
    assert plan_route(request(wire_dtype="bf16"), views) == Rejection(
        ("no live node of model smollm2-135m supports wire dtype bf16",)
    )
    draining = [node("a", 0, 30, status="draining")]
    result = plan_route(request(), draining)
    assert isinstance(result, Rejection) and "a: status draining" in result.reasons[0]


def test_a_node_of_another_protocol_is_never_routed_and_the_map_says_which_it_speaks():
    newer = messages.PROTOCOL + 1
    views = [node("old", 0, 30, tps=500), node("new", 0, 30, protocol=newer)]
    assert not views[1].usable and route_of(plan_route(request(), views)) == [("old", 0, 30)]
    result = plan_route(request(), views[1:])
    assert isinstance(result, Rejection)
    assert f"new: this tracker speaks protocol {messages.PROTOCOL}, the node {newer}" in result.reasons[0]
    cov = coverage_report(views[1:], 0.0, P)
    assert {r.status for r in rows_for(cov, 0, 29)} == {"gap"}
    assert [(n.node_id, n.protocol) for n in coverage_report(views, 0.0, P).nodes] == [
        ("new", newer), ("old", messages.PROTOCOL)
    ]  # fmt: skip


def test_misaligned_ranges_cover_every_layer_but_do_not_chain():
    views = [node("a", 0, 10), node("b", 5, 30)]
    result = plan_route(request(), views)
    assert isinstance(result, Rejection)
    assert "no chain of node ranges covers layers 0-29" in result.reasons[0] and "10" in result.reasons[0]
    assert to_rejection(result, request()).request_id == "req-1"


def test_other_models_are_ignored():
    views = [node("other", 0, 30, model="gemma3-270m")]
    assert plan_route(request(), views) == Rejection(("no live node serves model smollm2-135m",))


# -- coverage map -----------------------------------------------------------------------------


def test_coverage_statuses_and_capacity():
    views = [
        node("a", 0, 10, tps=20),
        node("a2", 0, 10, tps=30),
        node("b", 10, 20),
        node("c", 20, 30, tps=1, alive=False),
    ]
    cov = coverage_report(views, 0.0, P)
    (group,) = cov.models
    assert [(a, b, r.status) for a, b, r in spans(group.layers)] == [
        (0, 10, "covered"),
        (10, 20, "under-provisioned"),
        (20, 30, "gap"),
    ]
    assert group.layers[0].capacity_tokens_per_second == 50.0 and group.layers[0].replicas == ["a", "a2"]
    assert group.layers[25].replicas == [] and group.nodes_live == ["a", "a2", "b"]
    assert group.hint.layer_start == 20 and group.hint.layer_end == 30 and "gap" in group.hint.reason


def test_low_capacity_is_under_provisioned_even_with_replicas():
    views = [node("a", 0, 30, tps=0.5), node("b", 0, 30, tps=1.0)]
    cov = coverage_report(views, 0.0, P)
    assert {r.status for r in cov.models[0].layers} == {"under-provisioned"}
    assert "capacity 1.5 tok/s < 2" in cov.models[0].layers[0].reasons


def test_rebalance_hint_points_at_the_bottleneck_and_stays_routable():
    views = [node("h1", 0, 10), node("h2", 0, 10), node("m", 10, 20, tps=20), node("t1", 20, 30), node("t2", 20, 30)]
    hint = coverage_report(views, 0.0, P).models[0].hint
    assert (hint.layer_start, hint.layer_end) == (10, 20) and "single replica" in hint.reason
    # A gap whose edges no chain reaches is widened to boundaries where routes can join.
    views = [node("h", 0, 10), node("x", 5, 12), node("t", 20, 30)]
    hint = coverage_report(views, 0.0, P).models[0].hint
    assert (hint.layer_start, hint.layer_end) == (10, 20)


def test_rebalance_hint_never_names_a_range_llama_cpp_cannot_load():
    """Gemma 3's last layer is global attention: a slice of it alone aborts llama.cpp (artifacts/cuts.py)."""
    kinds = (["swa"] * 5 + ["attention"]) * 3
    views = [node("h", 0, 17, model="gemma3-270m", n=18, layer_kinds=kinds)]
    hint = coverage_report(views, 0.0, P).models[0].hint
    assert (hint.layer_start, hint.layer_end) == (0, 18)  # the smallest range that chains and loads
    assert "full-attention" in hint.reason
    views.append(node("t", 16, 18, model="gemma3-270m", n=18, layer_kinds=kinds))
    hint = coverage_report(views, 0.0, P).models[0].hint
    assert (hint.layer_start, hint.layer_end) != (17, 18)


def test_coverage_groups_by_numerics_and_filters_by_model():
    views = [node("a", 0, 30), node("b", 0, 30, cache_abi="other"), node("g", 0, 18, model="gemma3-270m", n=18)]
    cov = coverage_report(views, 0.0, P)
    assert [(g.model_preset, g.cache_abi) for g in cov.models] == [
        ("gemma3-270m", "llama-kv-f16-v1"),
        ("smollm2-135m", "llama-kv-f16-v1"),
        ("smollm2-135m", "other"),
    ]
    only = coverage_report(views, 0.0, P, model_preset="gemma3-270m")
    assert [g.model_preset for g in only.models] == ["gemma3-270m"] and [n.node_id for n in only.nodes] == ["g"]
    assert messages.decode(messages.encode(cov), messages.CoverageReport) == cov


def test_layer_helpers():
    assert layers.spell(15, 30) == "15-29" and layers.spell(3, 4) == "3"
    assert layers.uncovered_runs([(0, 5), (8, 10)], 12) == [(5, 8), (10, 12)]
    assert layers.reachable_from_start([(0, 5), (5, 9), (3, 12)]) == {0, 5, 9}
    assert layers.reaching_end([(0, 5), (5, 12), (3, 9)], 12) == {12, 5, 0}


def test_registry_expires_forgets_and_ignores_contradicting_heartbeats():
    from neuron_bus.tracker.registry import Registry

    reg = Registry(TrackerParams(expiry=5.0, forget_after=60.0, assignment_window=30.0))
    caps = report("a", 0, 30)
    hb = messages.NodeHeartbeat(
        node_id="a", seq=1, ts=0.0, layer_start=0, layer_end=30, cache_abi=caps.cache_abi, decode_tokens_per_second=80.0
    )
    reg.apply_heartbeat(hb, now=100.0)  # before its report: kept, and the report is wanted
    assert reg.needs_report("a") and reg.views(100.0) == []
    reg.apply_report(caps)
    assert not reg.needs_report("a")
    (view,) = reg.views(101.0)
    assert view.alive and view.decode_tps == 80.0 and view.usable
    assert reg.sweep(101.0) == (["a"], [])
    assert reg.sweep(106.0) == ([], ["a"]) and not reg.views(106.0)[0].alive
    # A heartbeat for another range: the report is stale, the node unusable until re-read.
    reg.apply_heartbeat(msgspec_replace(hb, layer_end=20), now=107.0)
    assert reg.needs_report("a") and not reg.views(107.0)[0].usable
    route = to_assignment(plan_route(request(), [node("a", 0, 30)]), request(), "r", 0.0)
    reg.record_assignment(route, now=107.0)
    assert reg.views(108.0)[0].recently_assigned == 1
    reg.sweep(138.0)
    assert reg.views(138.0)[0].recently_assigned == 0
    reg.sweep(200.0)
    assert reg.views(200.0) == []  # silent for longer than forget_after


def msgspec_replace(struct, **changes):
    import msgspec

    return msgspec.structs.replace(struct, **changes)
