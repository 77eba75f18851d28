"""The planner at scale, without a bus: the ring search against brute force, the per-range index,
the incremental registry and the ping sampler."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys

import msgspec
import pytest

from neuron_bus import messages
from neuron_bus.tracker import coverage, speed
from neuron_bus.tracker.index import RouteIndex, ring_weight
from neuron_bus.tracker.latency import PingSampler
from neuron_bus.tracker.params import TrackerParams
from neuron_bus.tracker.planner import Plan, plan_indexed, plan_route
from neuron_bus.tracker.registry import Registry
from neuron_bus.tracker.ring import cheapest_ring
from neuron_bus.tracker.view import NodeView
from tests.sessions import one_hop_route
from tests.test_planner import report, request

P = TrackerParams()
SEAMS = (0, 4, 6, 10, 12)  # a small model's common boundaries
N = 12


def brute_force(views: list[NodeView], n: int, refs: speed.References, params: TrackerParams) -> float | None:
    """The cheapest ring by enumeration: every chain of ranges from 0 to n, costed seam by seam."""
    best = None

    def walk(chain: list[NodeView], at: int):
        nonlocal best
        if at == n:
            cost = sum(speed.expected_seconds_per_token(v, refs.per_layer, params) for v in chain)
            cost += sum(
                speed.seam_latency(chain[i], chain[(i + 1) % len(chain)], params, refs.rtt) for i in range(len(chain))
            )
            best = cost if best is None else min(best, cost)
            return
        for v in views:
            if v.layer_start == at:
                walk([*chain, v], v.layer_end)

    walk([], 0)
    return best


def random_swarm(rng: random.Random, size: int, *, measured_seams: bool, all_rtts: bool) -> list[NodeView]:
    views = []
    for i in range(size):
        a, b = sorted(rng.sample(SEAMS, 2))
        views.append(
            NodeView(
                caps=report(f"n{i:02d}", a, b, n=N, trust_tier=rng.choice(["untrusted", "trusted"])),
                decode_tps=rng.choice([None, rng.uniform(5, 200)]),
                sessions_active=rng.randrange(4),
                failure_rate=rng.choice([0.0, 0.0, 0.2]),
                rtt=rng.uniform(0.001, 0.1) if all_rtts or rng.random() < 0.6 else None,
            )
        )
    if measured_seams:  # some pairs measured each other (route neighbours)
        for v in views:
            for u in rng.sample(views, min(3, len(views))):
                if u is not v and rng.random() < 0.5:
                    v.neighbour_latency[u.node_id] = rng.uniform(0.0, 0.08)
    return views


@pytest.mark.parametrize("seed", range(150))
def test_the_ring_search_finds_the_brute_force_optimum(seed):
    """Any mix of measured and guessed round trips and pairwise measurements, heads that measured
    their tails: the one-pass search with per-head passes is exact over the nodes it is given."""
    rng = random.Random(seed)
    views = random_swarm(rng, rng.randrange(2, 11), measured_seams=True, all_rtts=False)
    refs = speed.GroupSpeed(views).references
    expected = brute_force(views, N, refs, P)
    got = cheapest_ring(views, N, refs, P)
    if expected is None:
        assert got is None
        return
    cost, hops = got
    assert cost == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert [h.layer_start for h in hops][0] == 0 and hops[-1].layer_end == N
    assert all(x.layer_end == y.layer_start for x, y in itertools.pairwise(hops))
    assert brute_force(list(hops), N, refs, P) == pytest.approx(cost, rel=1e-9)  # the cost is the hops' cost


@pytest.mark.parametrize("seed", range(40))
def test_reading_only_the_lightest_replicas_loses_nothing_without_pairwise_measurements(seed):
    """Dozens of replicas per range, every round trip measured, no neighbour latencies: the
    planner reads three replicas per range (TrackerParams.route_candidates) and still finds the
    brute-force optimum over all of them (without stragglers to leave out)."""
    rng = random.Random(1000 + seed)
    views = [
        NodeView(
            caps=report(f"n{i:03d}", *pair, n=N),
            decode_tps=rng.uniform(40, 60),
            sessions_active=rng.randrange(3),
            rtt=rng.uniform(0.001, 0.05),
        )
        for i, pair in enumerate(rng.choice([(0, 6), (6, 12), (0, 12), (0, 4), (4, 12)]) for _ in range(60))
    ]
    plan = plan_route(request(), views, P)
    refs = speed.GroupSpeed(views).references
    assert isinstance(plan, Plan)
    assert plan.seconds_per_token == pytest.approx(brute_force(views, N, refs, P), rel=1e-9)


def test_the_live_index_plans_what_the_pure_planner_plans_and_follows_updates():
    rng = random.Random(7)
    views = random_swarm(rng, 40, measured_seams=False, all_rtts=True)
    index = RouteIndex.of(views, P)
    for policy in ("public", "private"):
        req = request(policy=policy)
        fast = plan_indexed(req, index, P, lambda v: True)
        pure = plan_route(req, views, P)
        if isinstance(pure, Plan):
            assert [h.node_id for h in fast.hops] == [h.node_id for h in pure.hops]
        else:
            assert fast is None
    # a node on the route gets loaded: the next route avoids it if an equal replica is free
    plan = plan_indexed(request(), index, P, lambda v: True)
    chosen = plan.hops[0]
    index.update(NodeView(caps=chosen.caps, decode_tps=chosen.decode_tps, sessions_active=50, rtt=chosen.rtt))
    again = plan_indexed(request(), index, P, lambda v: True)
    assert chosen.node_id not in [h.node_id for h in again.hops]
    index.discard(again.hops[0].node_id)
    assert again.hops[0].node_id not in [h.node_id for h in plan_indexed(request(), index, P, lambda v: True).hops]


def test_range_heaps_skip_stale_entries_stay_bounded_and_ignore_noise():
    index = RouteIndex(P)
    caps = report("a", 0, 30)
    for i in range(1000):  # a heartbeat a second for a quarter of an hour, throughput moving
        index.update(NodeView(caps=caps, decode_tps=50.0 + (i % 7), rtt=0.01))
    (group,) = index.groups.values()
    (cls,) = group.classes.values()
    assert sum(len(h) for h in cls._heaps.values()) <= 2 * len(cls.nodes) + 16  # rebuilt, not grown
    top, _ = cls.best(3, lambda v: True, False, lambda v: False)
    assert [v.node_id for v in top] == ["a"] and top[0].decode_tps == 50.0 + 999 % 7
    before = sum(len(h) for h in cls._heaps.values())
    index.update(NodeView(caps=caps, decode_tps=(50.0 + 999 % 7) * 1.005, rtt=0.01))  # within 1%: no push
    assert sum(len(h) for h in cls._heaps.values()) == before
    assert index.view("a").decode_tps == pytest.approx((50.0 + 999 % 7) * 1.005)


def test_ring_weight_is_the_nodes_share_of_the_ring():
    v = NodeView(caps=report("a", 0, 30), decode_tps=50.0, rtt=0.04, sessions_active=1)
    refs = speed.References()
    assert ring_weight(v, refs, P) == pytest.approx(2 / 50.0 + 0.04)
    assert cheapest_ring([v], 30, refs, P)[0] == pytest.approx(2 / 50.0 + 0.04)  # one seam: back to itself


def test_an_unmeasured_round_trip_is_never_preferred_to_the_median():
    measured = [NodeView(caps=report(f"m{i}", 0, 30), decode_tps=50.0, rtt=0.02 + i * 0.01) for i in range(3)]
    fresh = NodeView(caps=report("fresh", 0, 30), decode_tps=50.0)
    refs = speed.GroupSpeed([*measured, fresh]).references
    assert refs.rtt == 0.03
    assert speed.half_seam(fresh, P, refs.rtt) == pytest.approx(0.03 * P.unmeasured_factor / 2)
    assert route_ids(plan_route(request(), [*measured, fresh], P)) == ["m0"]


def route_ids(plan) -> list[str]:
    assert isinstance(plan, Plan), plan
    return [h.node_id for h in plan.hops]


def heartbeat(node_id: str, a: int, b: int, seq: int = 1, **kw) -> messages.NodeHeartbeat:
    return messages.NodeHeartbeat(
        node_id=node_id, seq=seq, ts=float(seq), layer_start=a, layer_end=b, cache_abi="llama-kv-f16-v1", **kw
    )


def test_registry_keeps_the_index_exact_through_heartbeats_expiry_and_assignments():
    reg = Registry(TrackerParams(expiry=5.0, forget_after=60.0))
    for name in ("a", "b"):
        reg.apply_report(report(name, 0, 30), now=0.0)
        reg.apply_heartbeat(heartbeat(name, 0, 30, decode_tokens_per_second=50.0), now=1.0)
    assert len(reg.index) == 2
    reg.apply_heartbeat(heartbeat("a", 0, 30, decode_tokens_per_second=50.2), now=2.0)  # noise: not refiled
    assert reg.index.view("a").decode_tps == 50.0 and reg.alive("a", 2.0)
    reg.apply_heartbeat(heartbeat("a", 0, 30, decode_tokens_per_second=50.2, sessions_active=2), now=3.0)
    assert reg.index.view("a").sessions_active == 2
    reg.expire(6.5)  # b's last heartbeat was at 1.0
    assert reg.index.view("b") is None and reg.index.view("a") is not None
    assert reg.sweep(6.5) == (["a", "b"], ["b"])
    route = one_hop_route("a")
    reg.record_assignment(route, now=7.0)
    assert reg.index.view("a").recently_assigned == 1
    reg.forget_assignment(route, 7.0, now=7.1)
    assert reg.index.view("a").recently_assigned == 0
    reg.record_rtt("a", 0.05, now=7.2)
    reg.record_rtt("a", 0.02, now=7.3)
    reg.record_rtt("a", 0.09, now=7.4)  # queued on the way: the least of the last few stands
    assert reg.index.view("a").rtt == 0.02
    reg.sweep(62.0)
    assert [v.node_id for v in reg.views(62.0)] == ["a"]  # b: dead for longer than forget_after (a: not yet)


def test_a_reported_round_trip_stands_until_the_pings_disprove_it():
    reg = Registry(TrackerParams(expiry=5.0))

    def node(name: str, server_rtt_ms: float | None, *rtts: float):
        reg.apply_report(report(name, 0, 30), now=0.0)
        reg.apply_heartbeat(heartbeat(name, 0, 30, decode_tokens_per_second=50.0, server_rtt_ms=server_rtt_ms), 1.0)
        for rtt in rtts:
            reg.record_rtt(name, rtt, now=1.1)
        return reg.index.view(name).rtt

    assert node("silent", None) is None  # neither: the group's reference weighs it (speed.half_seam)
    assert node("claims", 5.0) == 0.005  # not pinged yet: its own flushes
    assert node("queued", 5.0, 0.015, 0.021) == 0.005  # pings through busy queues agree within the slack
    assert node("far", 5.0, 0.2) == 0.2  # pings far above the claim disprove it
    assert node("modest", 50.0, 0.01) == 0.01  # it says more than the pings: the pings' figure
    assert node("pinged", None, 0.03) == 0.03
    # a claim that moves by more than 10% is refiled; noise is not
    reg.apply_heartbeat(heartbeat("claims", 0, 30, decode_tokens_per_second=50.0, server_rtt_ms=5.3, seq=2), 2.0)
    assert reg.index.view("claims").rtt == 0.005
    reg.apply_heartbeat(heartbeat("claims", 0, 30, decode_tokens_per_second=50.0, server_rtt_ms=8.0, seq=3), 3.0)
    assert reg.index.view("claims").rtt == 0.008


def test_ping_sampler_is_bounded_and_puts_candidates_and_the_unmeasured_first():
    sampler = PingSampler(budget=10, settled=4)
    live = [f"n{i:03d}" for i in range(100)]
    first = sampler.choose(live, candidates=["n050", "n051", "gone"])
    assert len(first) == 10 and first[:2] == ["n050", "n051"] and "gone" not in first
    sampler.pinged_at(first, now=1.0)
    for n in first:
        sampler.answered(n)
    second = sampler.choose(live, candidates=["n050", "n051"])
    assert second[:2] == ["n050", "n051"]  # candidates keep their share: their figure settles
    assert len(second) == 10 and not set(second[2:]) & set(first)  # the never measured before the measured
    assert len(sampler.choose(live[:3], candidates=[])) == 3


def test_importing_the_planner_loads_no_nats_and_the_client_loads_no_tracker():
    code = (
        "import sys\n"
        "import neuron_bus.tracker.planner, neuron_bus.tracker.coverage\n"
        "assert not [m for m in sys.modules if m == 'nats' or m.startswith('nats.')], 'planner loaded NATS'\n"
        "import neuron_bus.repair, neuron_bus.worker.node_telemetry\n"
        "del sys.modules['neuron_bus.tracker.planner']\n"
        "import neuron_bus.client\n"
        "assert 'neuron_bus.tracker.service' not in sys.modules, 'the client loaded the tracker service'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    code = "import sys, neuron_bus.repair, neuron_bus.worker.node_telemetry\nprint(sorted(m for m in sys.modules if m.startswith('neuron_bus.tracker')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_registry_knows_in_constant_time_whether_any_node_places_itself():
    """The placer builds a view of every node only when some node can move (`self_placed`):
    10,000 nodes placed by hand cost it nothing."""
    reg = Registry(TrackerParams(expiry=5.0, forget_after=10.0))
    reg.apply_report(report("a", 0, 30), now=0.0)
    assert reg.self_placed == set()
    fit = messages.NodeFit(max_layers=30, memory_budget=0, kv_positions=0)
    reg.apply_report(report("b", 0, 30, placement="auto", fit=fit), now=0.0)
    assert reg.self_placed == {"b"}
    reg.apply_report(report("b", 0, 30), now=1.0)  # placed by hand from now on
    assert reg.self_placed == set()
    reg.apply_report(report("c", 0, 30, placement="auto", fit=fit), now=1.0)
    reg.apply_heartbeat(heartbeat("c", 0, 30), now=1.0)
    reg.sweep(20.0)  # c: silent for longer than forget_after
    assert reg.self_placed == set() and reg.views(20.0) == []


def test_node_entries_are_built_ahead_for_a_forked_map_and_again_only_for_nodes_that_changed():
    """A map built in a forked child finds the entries built here (registry.build_tracked);
    a node refiled by a heartbeat has its entry built again, a forgotten one is dropped."""
    reg = Registry(TrackerParams(expiry=5.0, forget_after=10.0))
    for name in ("a", "b", "c"):
        reg.apply_report(report(name, 0, 30), now=0.0)
        reg.apply_heartbeat(heartbeat(name, 0, 30, decode_tokens_per_second=50.0), now=1.0)
    assert all(r.tracked is None for r in reg.records())
    assert reg.build_tracked(limit=2) == 1  # bounded: one left for the next map (or the child)
    assert reg.build_tracked(limit=2) == 0
    built = {r.node_id: r.tracked for r in reg.records()}
    assert all(t is not None for t in built.values())
    fresh = [coverage.tracked_node(r.view, False) for r in reg.records()]
    assert list(built.values()) == fresh  # what the child would have built itself
    reg.apply_heartbeat(heartbeat("a", 0, 30, seq=2, decode_tokens_per_second=50.0), now=2.0)  # nothing new
    reg.apply_heartbeat(heartbeat("b", 0, 30, seq=2, decode_tokens_per_second=50.0, sessions_active=1), now=2.0)
    after = {r.node_id: r.tracked for r in reg.records()}
    assert after["a"] is built["a"] and after["b"] is None and after["c"] is built["c"]
    assert reg.build_tracked(limit=5) == 0
    assert next(r.tracked for r in reg.records() if r.node_id == "b").sessions_active == 1
    reg.apply_heartbeat(heartbeat("b", 0, 30, seq=3, decode_tokens_per_second=50.0), now=9.0)
    reg.expire(7.0)  # a and c expire (last heard at 2.0 and 1.0): refiled, their entries to build again
    reg.sweep(15.0)  # ... then forgotten; b expires (last heard at 9.0)
    assert [r.node_id for r in reg.records()] == ["b"]
    assert reg.build_tracked(limit=0) == 1  # b's entry only: the forgotten nodes' are dropped
    assert reg.build_tracked(limit=5) == 0
    assert next(r.tracked for r in reg.records()).alive is False


def test_a_node_with_assignments_is_refiled_only_while_they_count_as_its_load():
    """An assignment counts on its node until a heartbeat a grace after it shows the session;
    it stays in the node's record for the assignment window (the coverage map shows it), but
    heartbeats that change nothing, and the window's end, no longer refile the node then."""
    reg = Registry(TrackerParams(expiry=5.0, forget_after=100.0, assignment_window=30.0, assignment_grace=1.0))
    reg.apply_report(report("a", 0, 30), now=0.0)
    reg.apply_heartbeat(heartbeat("a", 0, 30, decode_tokens_per_second=50.0), now=1.0)
    reg.record_assignment(one_hop_route("a"), now=1.5)
    reg.record_assignment(one_hop_route("a"), now=1.6)
    assert reg.index.view("a").recently_assigned == 2
    hb = {"decode_tokens_per_second": 50.0, "sessions_active": 1}
    reg.apply_heartbeat(heartbeat("a", 0, 30, seq=2, **hb), now=2.0)
    assert reg.index.view("a").recently_assigned == 1  # one shown by the heartbeat's rise, one not yet
    reg.apply_heartbeat(heartbeat("a", 0, 30, seq=3, **hb), now=2.55)
    assert reg.index.view("a").recently_assigned == 1  # the grace has passed the first only
    reg.apply_heartbeat(heartbeat("a", 0, 30, seq=4, **hb), now=3.0)
    assert reg.index.view("a").recently_assigned == 0  # the grace has passed both


def test_heartbeats_and_the_window_end_do_not_refile_a_node_whose_assignments_no_longer_count():
    """The node stays where the index filed it, with the same coverage entry (nothing to build
    again for the next map), while its assignment sits out the window uncounted."""
    reg = Registry(TrackerParams(expiry=50.0, forget_after=100.0, assignment_window=30.0, assignment_grace=1.0))
    reg.apply_report(report("a", 0, 30), now=0.0)
    reg.apply_heartbeat(heartbeat("a", 0, 30, decode_tokens_per_second=50.0), now=1.0)
    reg.record_assignment(one_hop_route("a"), now=1.5)
    reg.apply_heartbeat(heartbeat("a", 0, 30, seq=2, decode_tokens_per_second=50.0, sessions_active=1), now=3.0)
    assert reg.index.view("a").recently_assigned == 0
    reg.build_tracked(limit=10)
    filed = reg.index.view("a")
    (entry,) = [r.tracked for r in reg.records()]
    for seq, now in enumerate((4.0, 5.0, 6.0), start=3):
        reg.apply_heartbeat(heartbeat("a", 0, 30, seq=seq, decode_tokens_per_second=50.0, sessions_active=1), now=now)
    reg.expire(32.0)  # the assignment's window ends: it had stopped counting long before
    assert reg.index.view("a") is filed
    assert [r.tracked for r in reg.records()] == [entry] and reg.records()[0].tracked is entry
    assert reg.records()[0].assigned == ()
    reg.record_assignment(one_hop_route("a"), now=33.0)  # a new one counts at once
    assert reg.index.view("a").recently_assigned == 1


def test_pending_assignments_counted_from_the_newest_agree_with_counting_them_all():
    """The registry's count against a model that keeps every assignment and marks the ones each
    heartbeat's rise in sessions showed (the oldest still counted, made before it arrived)."""
    rng = random.Random(7)
    params = TrackerParams(expiry=1e9, forget_after=1e9, assignment_window=30.0, assignment_grace=1.0)
    reg = Registry(params)
    reg.apply_report(report("a", 0, 30), now=0.0)
    now, seq, sessions, last = 0.0, 0, 0, None
    times: list[float] = []
    shown: set[int] = set()

    def counted(i: int, at: float) -> bool:
        return (
            i not in shown
            and at - times[i] <= params.assignment_window
            and (last is None or times[i] > last - params.assignment_grace)
        )

    for _ in range(2000):
        now += rng.uniform(0.0, 0.4)
        if rng.random() < 0.3:
            seq += 1
            before, sessions = sessions, max(0, sessions + rng.randint(-1, 3))
            if seq > 1 and sessions > before:
                candidates = [i for i in range(len(times)) if counted(i, times[i]) and times[i] <= now]
                shown.update(candidates[: sessions - before])
            reg.apply_heartbeat(heartbeat("a", 0, 30, seq=seq, sessions_active=sessions), now=now)
            last = now
        else:
            reg.record_assignment(one_hop_route("a"), now=now)
            times.append(now)
        reg.expire(now)
        expected = sum(counted(i, now) for i in range(len(times)))
        assert reg.index.view("a").recently_assigned == expected
        assert reg.tracked(reg.records(), now, (), ())[0].recently_assigned == expected


def test_an_assignment_a_rise_showed_does_not_count_again_at_the_next_heartbeat():
    """Nodes beat as soon as a session opens: the next heartbeat, within the grace and with no
    rise of its own, must not count the assignment on top of the session it reports."""
    reg = Registry(TrackerParams(expiry=5.0, forget_after=100.0, assignment_window=30.0, assignment_grace=1.0))
    reg.apply_report(report("a", 0, 30), now=0.0)
    reg.apply_heartbeat(heartbeat("a", 0, 30, decode_tokens_per_second=50.0), now=1.0)
    reg.record_assignment(one_hop_route("a"), now=1.5)
    hb = {"decode_tokens_per_second": 50.0, "sessions_active": 1}
    reg.apply_heartbeat(heartbeat("a", 0, 30, seq=2, **hb), now=1.55)  # the prompt beat: the session
    assert reg.index.view("a").recently_assigned == 0
    reg.apply_heartbeat(heartbeat("a", 0, 30, seq=3, **hb), now=2.0)  # its regular beat, no rise
    assert reg.index.view("a").recently_assigned == 0
    assert reg.touch("a", now=2.2)  # another tracker's relay: liveness only
    assert reg.index.view("a").recently_assigned == 0
    # a rise with no assignment before it shows nothing to come: the next one counts
    reg.apply_heartbeat(heartbeat("a", 0, 30, seq=4, decode_tokens_per_second=50.0, sessions_active=2), now=2.5)
    reg.record_assignment(one_hop_route("a"), now=2.6)
    assert reg.index.view("a").recently_assigned == 1


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("seq", -1, "seq must not be negative"),
        ("queue_depth", -3, "queue_depth must not be negative"),
        ("neighbour_latency_ms", {"x": -1.0}, "neighbour_latency_ms must not be negative"),
        ("server_rtt_ms", -0.5, "server_rtt_ms must not be negative"),
        ("node_id", "a b", "is not 1-128 of"),
        ("layer_end", 0, "is empty or negative"),
    ],
)
def test_a_heartbeat_that_fails_the_quick_test_is_refused_with_its_reason(field, value, reason):
    from neuron_bus.errors import MalformedMessage

    good = messages.encode(heartbeat("a", 0, 30, neighbour_latency_ms={"x": 2.0}))
    assert messages.decode(good, messages.NodeHeartbeat).neighbour_latency_ms == {"x": 2.0}
    body = msgspec.json.decode(good)
    body[field] = value
    with pytest.raises(MalformedMessage, match=reason):
        messages.decode(msgspec.json.encode(body), messages.NodeHeartbeat)
