"""The meter's arithmetic (trust/meter.py), without a bus: what a route member is paid for what the
swarm observed, and which self-reports are flagged."""

from __future__ import annotations

import uuid

import pytest

from neuron_bus import messages as M
from neuron_bus.trust.meter import Evidence, layer_work, meter_session, reconcile
from tests.test_planner import report as capability

REV = "rev1"


def report(node: str, a: int, b: int, per_layer: float = 1.0, total: int = 4) -> M.CapabilityReport:
    return capability(
        node, a, b, n=total, model="m", model_revision=REV, active_parameters_per_layer=[per_layer] * (b - a)
    )


def route(route_id: str = "r1", nodes=("n0", "n1")) -> M.RouteAssignment:
    ranges = [(0, 2), (2, 4)]
    hops = [
        M.RouteHop(node_id=n, layer_start=a, layer_end=b, subject="", backend_id="llama-cpp", cache_abi="abi")
        for n, (a, b) in zip(nodes, ranges)
    ]
    return M.RouteAssignment(route_id=route_id, model_preset="m", model_revision=REV, n_layers_total=4, hops=hops)


def deltas(session: str, n: int, finished: bool = True) -> list[M.TokenDelta]:
    return [
        M.TokenDelta(session_id=session, index=i, token_id=i, text="x", finished=finished and i == n - 1)
        for i in range(n)
    ]


def validation(session: str, prompt: int, out: int, route_id: str = "r1", nodes=("n0", "n1")) -> M.ValidationEvent:
    members = [
        M.RouteMember(node_id=h.node_id, layer_start=h.layer_start, layer_end=h.layer_end, backend_id="", cache_abi="")
        for h in route(route_id, nodes).hops
    ]
    return M.ValidationEvent(
        event_id="e",
        session_id=session,
        route_id=route_id,
        model_preset="m",
        model_revision=REV,
        route=members,
        prompt_sha256="",
        prompt_tokens=list(range(prompt)),
        output_tokens=list(range(out)),
        sampling=M.SamplingParams(),
    )


def claim(node: str, session: str, prefill: int, decode: int, work: float = 2.0, a: int = 0, b: int = 2):
    return M.LedgerEntry(
        entry_id=uuid.uuid4().hex,
        node_id=node,
        kind="inference",
        ts=0.0,
        session_id=session,
        layer_start=a,
        layer_end=b,
        owned_layer_work=work,
        prefill_tokens=prefill,
        decode_tokens=decode,
    )


WORK = layer_work([report("n0", 0, 2), report("n1", 2, 4, 1.5)])


def finished_session(s: str = "s1") -> M.SessionMeter:
    ev = Evidence(s, route(), validation(s, 10, 8), None, deltas(s, 8), WORK)
    return meter_session(ev)


def test_a_finished_session_pays_every_hop_the_prompt_and_the_tokens_fed_back():
    m = finished_session()
    assert m.status == "finished" and m.prompt_tokens == 10 and m.delivered_tokens == 8
    assert [(w.node_id, w.prefill_tokens, w.decode_tokens, w.owned_layer_work) for w in m.members] == [
        ("n0", 10, 7, 2.0),
        ("n1", 10, 7, 3.0),
    ]
    assert m.members[0].reward_weight == pytest.approx(2.0 * 17)


def test_an_honest_claim_is_paid_and_not_flagged_an_inflated_one_is_flagged_and_paid_the_meter():
    m = finished_session()
    rows = reconcile(
        [claim("n0", "s1", 10, 7), claim("n1", "s1", 20, 14, work=3.0, a=2, b=4)],
        [m],
    )
    assert not rows["n0"].flagged and rows["n0"].inference_weight == pytest.approx(34.0)
    n1 = rows["n1"]
    assert n1.flagged and n1.inference_weight == pytest.approx(3.0 * 17)
    assert n1.claimed_weight == pytest.approx(3.0 * 34) and (n1.claimed_prefill_tokens, n1.claimed_decode_tokens) == (
        20,
        14,
    )
    assert "20 prefill positions claimed, 10 metered" in n1.flags[0]["reason"]


def test_claims_of_more_work_per_token_another_range_or_a_session_not_served_are_flagged():
    m = finished_session()
    rows = reconcile(
        [claim("n0", "s1", 10, 7, work=4.0), claim("n1", "s1", 10, 7, work=3.0, a=0, b=4), claim("n9", "s1", 1, 0)],
        [m],
    )
    assert "weights per token" in rows["n0"].flags[0]["reason"]
    assert "the route gave it others" in rows["n1"].flags[0]["reason"]
    assert rows["n9"].flagged and rows["n9"].inference_weight == 0 and "did not serve" in rows["n9"].flags[0]["reason"]


def test_a_cancelled_session_allows_the_step_in_flight_and_pays_what_was_delivered():
    s = "s2"
    tel = M.GenerationTelemetry(session_id=s, route_id="r1", model_preset="m", phase="decode", prefill_tokens_total=10)
    m = meter_session(Evidence(s, route(), None, tel, deltas(s, 5, finished=False), WORK))
    assert m.status == "unfinished" and m.members[0].decode_tokens == 4 and m.members[0].max_decode_tokens == 5
    rows = reconcile([claim("n0", s, 10, 5), claim("n0", s, 10, 5)], [m])  # a duplicate claim earns nothing more
    assert not rows["n0"].flagged and rows["n0"].inference_weight == pytest.approx(2.0 * 14)


def test_delivered_tokens_are_the_contiguous_indices_and_forged_ones_count_nothing():
    s = "s3"
    forged = [M.TokenDelta(session_id=s, index=10**6, token_id=1, text="")]
    m = meter_session(Evidence(s, route(), validation(s, 4, 3), None, deltas(s, 3) + forged, WORK))
    assert m.delivered_tokens == 3 and m.members[0].decode_tokens == 2


def test_a_route_the_tracker_never_assigned_is_unmetered_and_its_claims_are_not_paid():
    s = "s4"
    m = meter_session(Evidence(s, None, validation(s, 4, 3, route_id="forged"), None, deltas(s, 3), WORK))
    assert m.status == "unmetered" and not m.members
    rows = reconcile([claim("n0", s, 4, 2)], [m])
    assert rows["n0"].inference_weight == 0 and rows["n0"].unmetered_sessions == [s]
    assert reconcile([claim("n0", "later", 4, 2)], [])["n0"].pending_sessions == ["later"]


def test_a_repaired_range_is_bounded_each_node_paid_its_claim_up_to_the_range():
    s = "s5"
    ev = Evidence(s, route(), validation(s, 10, 8, route_id="r1-r1", nodes=("n0", "n2")), None, deltas(s, 8), WORK)
    m = meter_session(ev)
    assert m.status == "repaired"
    assert [(w.node_id, w.exact) for w in m.members] == [("n0", True), ("n1", False), ("n2", False)]
    rows = reconcile(
        [claim("n0", s, 14, 7), claim("n1", s, 10, 3, work=3.0, a=2, b=4), claim("n2", s, 4, 4, work=3.0, a=2, b=4)],
        [m],
    )
    assert not any(r.flagged for r in rows.values())  # the survivor's replay is within its bound
    assert rows["n0"].inference_weight == pytest.approx(2.0 * 17)
    assert rows["n1"].inference_weight == pytest.approx(3.0 * 13) and rows["n2"].inference_weight == pytest.approx(24)


def test_layer_work_is_the_median_of_the_reports_so_one_node_cannot_raise_it_alone():
    work = layer_work([report("a", 0, 4, 1.0), report("b", 0, 4, 1.0), report("liar", 0, 2, 50.0)])
    assert work[REV] == [1.0, 1.0, 1.0, 1.0]
