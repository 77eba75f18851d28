"""Route repair picks a replacement the route's policy admits and audits have not flagged."""

from __future__ import annotations

from neuron_bus import messages as M
from neuron_bus.repair import pick_replacement

ABI, REV = "abi-1", "rev-1"


def node(node_id: str, tier: str = "untrusted", flagged: bool = False, start: int = 15) -> M.TrackedNode:
    return M.TrackedNode(
        node_id=node_id,
        model_preset="m",
        layer_start=start,
        layer_end=30,
        backend_id="llama-cpp",
        cache_abi=ABI,
        alive=True,
        status="ready",
        trust_tier=tier,
        flagged=flagged,
    )


def report(nodes: list[M.TrackedNode]) -> M.CoverageReport:
    group = M.ModelCoverage(
        model_preset="m",
        model_revision=REV,
        backend_id="llama-cpp",
        cache_abi=ABI,
        n_layers_total=30,
        layers=[],
        nodes_live=[n.node_id for n in nodes],
    )
    return M.CoverageReport(
        generated_at=0.0,
        expiry_seconds=5.0,
        min_replicas=2,
        min_capacity_tokens_per_second=2.0,
        slow_factor=3.0,
        models=[group],
        nodes=nodes,
    )


def route(policy: str) -> M.RouteAssignment:
    hops = [
        M.RouteHop(
            node_id="head",
            layer_start=0,
            layer_end=15,
            subject="",
            backend_id="llama-cpp",
            cache_abi=ABI,
            trust_tier="trusted",
        ),
        M.RouteHop(
            node_id="dead",
            layer_start=15,
            layer_end=30,
            subject="",
            backend_id="llama-cpp",
            cache_abi=ABI,
            trust_tier="trusted",
        ),
    ]
    return M.RouteAssignment(
        route_id="r", model_preset="m", model_revision=REV, n_layers_total=30, hops=hops, policy=policy
    )


def test_private_route_is_never_repaired_onto_an_untrusted_or_flagged_node():
    r = route("private")
    rep = report(
        [node("untrusted"), node("flagged", "trusted", flagged=True), node("other-range", "trusted", start=10)]
    )
    assert pick_replacement(rep, r, r.hops[1], {"dead"}) is None
    rep = report([node("untrusted"), node("good", "trusted")])
    assert pick_replacement(rep, r, r.hops[1], {"dead"}).node_id == "good"


def test_public_route_takes_any_unflagged_node():
    r = route("public")
    rep = report([node("flagged", flagged=True), node("any")])
    assert pick_replacement(rep, r, r.hops[1], {"dead"}).node_id == "any"


def test_a_suspect_replaces_a_dead_hop_only_when_no_other_node_can():
    r = route("public")
    rep = report([node("a-suspect"), node("b-fine")])
    assert pick_replacement(rep, r, r.hops[1], {"dead"}, {"a-suspect"}).node_id == "b-fine"
    assert pick_replacement(rep, r, r.hops[1], {"dead"}).node_id == "a-suspect"  # first by id otherwise
    rep = report([node("a-suspect")])
    assert pick_replacement(rep, r, r.hops[1], {"dead"}, {"a-suspect"}).node_id == "a-suspect"
