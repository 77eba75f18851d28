"""Issue 7's acceptance on real processes over loopback: nats-server, tracker and llama.cpp workers
serving SmolLM2 (one thread each), driven through the bus and the `neuron-bus coverage` CLI.

Two small swarms, one per test class (class-scoped, so only one runs at a time on this 2-core
machine):
- TestReplicas: a head (0-14), a fast tail and a tail slowed on purpose (--slow-ms 200), both
  15-29, and a tail with another cache ABI (--no-flash-attn). Each test first brings the swarm to
  the state it needs (Fleet.ensure), so the tests are independent; in file order few restarts are
  needed.
- TestFullReplicas: two workers serving all 30 layers.

Timing is never asserted tightly: states are polled with generous deadlines; the one latency
claim (a killed node's layers become a gap within the heartbeat expiry) allows a few seconds of
slack for polling and a loaded machine.
"""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import pytest

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.cli.tracker import fetch_coverage
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm, WorkerSpec, cli
from neuron_bus.topology import connect
from neuron_bus.tracker.coverage import coverage_report
from neuron_bus.tracker.view import NodeView
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

PROMPT = "The three primary colors are"
SLOW_MS = 200.0
START_TIMEOUT = 240.0  # worker start-up: slicing (cached) and the self-benchmark, on a busy machine
SLACK = 3.0  # polling and scheduling slack on top of the heartbeat expiry


def run(coro):
    return asyncio.run(coro)


wait_until = functools.partial(wait_for, every=0.25)


async def ask_route(url: str, **pins) -> M.RouteAssignment | M.RouteRejection:
    """One route request on the bus, the raw reply (a rejection keeps its list of reasons)."""
    nc = await connect(url, name="acceptance-route")
    try:
        req = M.RouteRequest(request_id=uuid.uuid4().hex, model_preset="smollm2-135m", **pins)
        msg = await nc.request(S.ROUTE_REQUEST, M.encode(req), timeout=30)
        return M.decode(msg.data, M.RouteReply)
    finally:
        await nc.close()


async def ask_routes(url: str, n: int) -> list[M.RouteAssignment | M.RouteRejection]:
    """``n`` concurrent route requests, as ``n`` clients starting sessions at once would send."""
    return list(await asyncio.gather(*(ask_route(url) for _ in range(n))))


async def generate(url: str, route: M.RouteAssignment, max_tokens: int = 8):
    async with await NeuronClient.connect(url) as client:
        return await client.complete(
            PROMPT, route=route, sampling=M.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )


def nodes_of(route) -> list[str]:
    assert isinstance(route, M.RouteAssignment), route
    return [h.node_id for h in route.hops]


def coverage_cli(url: str) -> M.CoverageReport:
    """`neuron-bus coverage --json`, as an operator runs it."""
    out = subprocess.run(
        cli() + ["coverage", "--json", "--nats", url, "--timeout", "10"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return M.decode(json.dumps(json.loads(out.stdout)).encode(), M.CoverageReport)


def group(report: M.CoverageReport, cache_abi: str) -> M.ModelCoverage:
    (found,) = [g for g in report.models if g.cache_abi == cache_abi]
    return found


def statuses(g: M.ModelCoverage, start: int, end: int) -> set[str]:
    return {row.status for row in g.layers[start:end]}


@dataclass
class Fleet:
    """A LocalSwarm plus the workers started next to its base ranges (replicas, other ABIs)."""

    swarm: LocalSwarm
    specs: dict[str, WorkerSpec]

    @classmethod
    def start(cls, swarm: LocalSwarm, extra: list[WorkerSpec]) -> Fleet:
        # LocalSwarm.start waits for one route over all of its ranges, so it starts with distinct
        # ranges only; replicas join afterwards.
        swarm.start(START_TIMEOUT)
        fleet = cls(swarm, {s.node_id: s for s in [*swarm.workers, *extra]})
        fleet.ensure(alive=list(fleet.specs))
        return fleet

    @property
    def url(self) -> str:
        return self.swarm.url

    def coverage(self) -> M.CoverageReport:
        return run(fetch_coverage(self.url, None, 10))

    def node(self, node_id: str) -> M.TrackedNode:
        (found,) = [n for n in self.coverage().nodes if n.node_id == node_id]
        return found

    def live(self) -> set[str]:
        return {n.node_id for n in self.coverage().nodes if n.alive}

    def running(self, name: str) -> bool:
        proc = self.swarm.procs.get(name)
        return proc is not None and proc.poll() is None

    def ensure(self, alive=(), dead=()) -> None:
        """Kill ``dead``, (re)start ``alive``, and wait until the tracker sees exactly that."""
        for name in dead:
            self.swarm.kill(name)
        for name in alive:
            if not self.running(name):
                self.swarm.start_worker(self.specs[name])

        def settled():
            live = self.live()
            return live if set(alive) <= live and not live & set(dead) else False

        wait_until(settled, START_TIMEOUT, f"tracker to see {sorted(alive)} alive and {sorted(dead)} expired")

    def kill_and_wait_expired(self, name: str) -> float:
        """SIGKILL a worker; wait until the tracker declares it expired. Returns the seconds taken."""
        t0 = time.monotonic()
        self.swarm.kill(name)
        wait_until(lambda: name not in self.live(), 60, f"{name} to expire")
        return time.monotonic() - t0


# -- a head, a fast and a slowed tail replica, a tail with another cache ABI ---------------------

HEAD, FAST, SLOW, OTHER_ABI = "worker-0", "worker-1", "worker-2", "worker-3"


@pytest.fixture(scope="class")
def replicas(smollm2_path, tmp_path_factory):
    swarm = LocalSwarm(smollm2_path, ranges=[(0, 15), (15, 30)], workdir=tmp_path_factory.mktemp("replicas"))
    try:
        yield Fleet.start(
            swarm,
            [
                WorkerSpec((15, 30), SLOW, ["--slow-ms", str(SLOW_MS)]),
                WorkerSpec((15, 30), OTHER_ABI, ["--no-flash-attn"]),
            ],
        )
    finally:
        swarm.stop()


class TestReplicas:
    def test_slow_replica_is_avoided_then_used_alone_and_marked_under_provisioned(self, replicas):
        fleet = replicas
        fleet.ensure(alive=[HEAD, FAST, SLOW, OTHER_ABI])
        assert fleet.node(SLOW).slow and not fleet.node(FAST).slow

        routes = run(ask_routes(fleet.url, 8))
        assert [nodes_of(r) for r in routes] == [[HEAD, FAST]] * 8
        fast = run(generate(fleet.url, routes[0]))
        assert len(fast.tokens) == 8 and fast.text

        # The fast replica dies: once it has expired, the slow one is the only replica and is used.
        fleet.kill_and_wait_expired(FAST)
        alone = run(ask_route(fleet.url))
        assert nodes_of(alone) == [HEAD, SLOW]
        slow = run(generate(fleet.url, alone, max_tokens=12))
        assert slow.tokens[:8] == fast.tokens  # greedy: the same model gives the same tokens on either route

        # The slow node's heartbeats now carry its measured rate: 11 decode steps, each >= 200 ms.
        def measured():
            n = fleet.node(SLOW)
            return n if n.decode_tokens_per_second and n.decode_tokens_per_second <= 1000.0 / SLOW_MS else None

        wait_until(measured, 10, "the slow node's reported decode rate to stay under 1000/slow_ms")

        report = coverage_cli(fleet.url)
        flash = group(report, alone.hops[1].cache_abi)
        tail = flash.layers[15:30]
        assert {r.status for r in tail} == {"under-provisioned"}
        assert all(r.replicas == [SLOW] for r in tail)
        assert "single replica" in tail[0].reasons and any(r.startswith("only slow replicas") for r in tail[0].reasons)
        assert [n.node_id for n in report.nodes if n.slow] == [SLOW]
        # Rebalancing hint: the weakest under-provisioned range is the slow-only tail.
        assert (flash.hint.layer_start, flash.hint.layer_end) == (15, 30)
        assert flash.hint.reason.startswith("under-provisioned: layers 15-29")

    def test_other_cache_abi_is_never_routed_and_a_request_only_it_could_serve_is_rejected(self, replicas):
        fleet = replicas
        fleet.ensure(alive=[HEAD, SLOW, OTHER_ABI], dead=[FAST])
        other_abi = fleet.node(OTHER_ABI).cache_abi
        assert other_abi != fleet.node(HEAD).cache_abi

        # The other-ABI tail is faster than the slowed one, and still never joins a route.
        routes = run(ask_routes(fleet.url, 8))
        assert [nodes_of(r) for r in routes] == [[HEAD, SLOW]] * 8
        assert all(h.cache_abi != other_abi for r in routes for h in r.hops)

        # Only the other-ABI node serves layers 15-29 now: rejected, and the reason says why.
        fleet.kill_and_wait_expired(SLOW)
        rejection = run(ask_route(fleet.url))
        assert isinstance(rejection, M.RouteRejection), rejection
        tail_gap = [r for r in rejection.reasons if r.startswith("coverage gap at layers 15-29")]
        assert len(tail_gap) == 1
        assert f"{OTHER_ABI} (layers 15-29, cache ABI {other_abi})" in tail_gap[0]
        assert "cannot share a route" in tail_gap[0]

        # Asking for that cache ABI explicitly: rejected as well, for the layers nobody else has.
        pinned = run(ask_route(fleet.url, cache_abi=other_abi))
        assert isinstance(pinned, M.RouteRejection) and pinned.reasons == ["coverage gap at layers 0-14"]

    def test_killing_the_only_node_of_a_range_turns_its_layers_into_a_gap_within_the_expiry(self, replicas):
        fleet = replicas
        fleet.ensure(alive=[HEAD, FAST])
        abi = fleet.node(HEAD).cache_abi
        assert statuses(group(fleet.coverage(), abi), 0, 15) != {"gap"}

        t0 = time.monotonic()
        fleet.swarm.kill(HEAD)
        expiry = fleet.coverage().expiry_seconds
        wait_until(lambda: statuses(group(fleet.coverage(), abi), 0, 15) == {"gap"}, 60, "layers 0-14 to become a gap")
        assert time.monotonic() - t0 <= expiry + SLACK

        report = coverage_cli(fleet.url)
        flash = group(report, abi)
        assert statuses(flash, 0, 15) == {"gap"} and "gap" not in statuses(flash, 15, 30)
        assert HEAD in flash.nodes_expired
        assert (flash.hint.layer_start, flash.hint.layer_end) == (0, 15) and "coverage gap" in flash.hint.reason
        rejection = run(ask_route(fleet.url, cache_abi=abi))
        assert isinstance(rejection, M.RouteRejection) and rejection.reasons == ["coverage gap at layers 0-14"]


# -- two workers serving the whole model --------------------------------------------------------

FULL = ("worker-0", "worker-1")


@pytest.fixture(scope="class")
def full_replicas(smollm2_path, tmp_path_factory):
    swarm = LocalSwarm(smollm2_path, ranges=[(0, 30)], workdir=tmp_path_factory.mktemp("full"))
    try:
        yield Fleet.start(swarm, [WorkerSpec((0, 30), FULL[1])])
    finally:
        swarm.stop()


class TestFullReplicas:
    def test_sixteen_route_requests_are_spread_over_both_replicas(self, full_replicas):
        fleet = full_replicas
        fleet.ensure(alive=FULL)
        routes = run(ask_routes(fleet.url, 16))
        counts = Counter(tuple(nodes_of(r)) for r in routes)
        assert set(counts) == {(FULL[0],), (FULL[1],)}, counts
        assert min(counts.values()) >= 3, counts  # spread by load, not merely touched
        first = {nodes_of(r)[0]: r for r in routes}
        for route in first.values():
            assert len(run(generate(fleet.url, route)).tokens) == 8

        # 14 of those routes never became sessions: once heartbeats after them show no session,
        # they stop counting as load (seconds, not the 30 s assignment window).
        def unloaded():
            nodes = [n for n in fleet.coverage().nodes if n.node_id in FULL]
            return all(n.recently_assigned == 0 and n.sessions_active == 0 for n in nodes) and nodes

        wait_until(unloaded, 20, "assignments nobody opened to stop counting as load")

    def test_tracker_restart_keeps_every_heartbeating_node_and_new_sessions_work(self, full_replicas):
        fleet = full_replicas
        gone = "worker-2"  # a third replica that dies before the restart: its report stays in KV
        fleet.specs[gone] = WorkerSpec((0, 30), gone)
        fleet.ensure(alive=[*FULL, gone])
        before = {n.node_id: (n.layer_start, n.layer_end, n.cache_abi, n.backend_id) for n in fleet.coverage().nodes}
        fleet.swarm.kill(gone)

        forget_after = 15.0
        fleet.swarm.kill("tracker")
        fleet.swarm._spawn("tracker", ["tracker", "--nats", fleet.url, "--forget-after", str(forget_after)])
        # Workers announce their capability report once, at start: the new tracker rebuilds them from
        # the neuron-nodes bucket plus live heartbeats.
        wait_until(lambda: _answer(fleet), 60, "the new tracker to answer")
        route = run(ask_route(fleet.url))  # right away: the restarted tracker waits briefly for heartbeats
        assert isinstance(route, M.RouteAssignment), route
        assert nodes_of(route)[0] in FULL

        report = wait_until(lambda: fleet.live() >= set(FULL) and fleet.coverage(), 30, "every heartbeating node alive")
        after = {n.node_id: (n.layer_start, n.layer_end, n.cache_abi, n.backend_id) for n in report.nodes if n.alive}
        assert after == {k: v for k, v in before.items() if k in FULL}
        assert gone in report.models[0].nodes_expired  # known from KV, not heartbeating: never routed
        assert len(run(generate(fleet.url, route)).tokens) == 8
        # The dead node's stored report does not haunt the coverage map forever.
        wait_until(
            lambda: gone not in {n.node_id for n in fleet.coverage().nodes}, forget_after + 30, f"{gone} forgotten"
        )


def _answer(fleet: Fleet) -> M.CoverageReport | None:
    try:
        return fleet.coverage()
    except Exception:  # no tracker subscribed yet
        return None


# -- the straggler rule on the throughputs real workers report ---------------------------------


def test_stragglers_are_judged_per_token_against_peers_of_their_size():
    """Decode tok/s as SmolLM2 workers reported them on one thread (a fixed cost per call: 15
    layers are not twice as fast as 30). Per layer, the 2-layer node would look 4x slower than the
    whole model; per token against peers of its size it is fine, and the slowed tail stands out."""
    from tests.test_planner import report as caps

    measured = {
        "full": (0, 30, 65.4),
        "head": (0, 15, 83.7),
        "tail": (15, 30, 62.6),
        "slowed": (15, 30, 4.8),
        "small": (0, 2, 120.0),
    }
    views = [NodeView(caps=caps(k, a, b, tps=tps), decode_tps=tps) for k, (a, b, tps) in measured.items()]
    assert [n.node_id for n in coverage_report(views, 0.0).nodes if n.slow] == ["slowed"]
