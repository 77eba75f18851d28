"""The tracker at scale, on real processes: the swarm simulator (neuron_bus/sim) against real
`neuron-bus tracker` processes on a real nats-server, and several trackers sharing one bus.

- 500 simulated nodes with churn (joins, leaves, silent deaths): every route is complete,
  ordered, made of real nodes with their real ranges, honours its policy, and never goes through
  a node whose last heartbeat is older than the tracker's expiry when the request was sent.
- Three trackers, one SIGKILLed mid-run: every route request is answered (those in flight at the
  dead tracker once more, with the same request id), and no route it assigned is lost.
- Trackers sharing the requests count each other's assignments (spreading works across them),
  a request asked twice gets the same route, and one of them holds the placement lease.
- Each heartbeat reaches one of three trackers, which passes it on to the other two (mostly as
  the node's id); a lone tracker passes nothing on; a malformed relay changes nothing.
- A simulated node heartbeats at once when a session opens on it and when it ends, as a worker
  does, and otherwise keeps its interval.
- The simulator's CPU figure of a process includes its reaped children (a tracker's forked map
  builds), and shows their part apart.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from neuron_bus import messages
from neuron_bus import subjects as S
from neuron_bus.sim.procs import Usage
from neuron_bus.sim.run import Options, simulate
from neuron_bus.topology import connect
from neuron_bus.tracker import TrackerParams, TrackerService, beats
from tests.test_tracker import ask_route, bus, hops  # noqa: F401  (bus: the fixture)

EXPIRY = 2.0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_500_simulated_nodes_with_churn_get_complete_routes_never_through_the_dead(tmp_path):
    result = simulate(
        Options(
            nodes=500,
            trackers=1,
            duration=12.0,
            churn="joins=0.3,leaves=0.3,deaths=0.6",  # per minute: ~300 churn events over the run
            route_rate=20.0,
            coverage_rate=0.5,
            throughput_seconds=3.0,
            idle_seconds=1.0,
            expiry=EXPIRY,
            seed=5,
        ),
        tmp_path,
    )
    checks = result["checks"]
    assert checks["requests"] >= 200 and checks["routes"] == checks["requests"], checks
    assert checks["bad_routes"] == 0, checks["examples"]
    assert checks["through_gone_after_expiry"] == 0, checks["examples"]
    assert result["pool"]["gone"] >= 50, result["pool"]  # the churn happened: nodes left and died
    lat = result["latency_phase"]
    assert lat["coverage_ms"]["n"] >= 3 and not lat["coverage_errors"], lat
    assert result["quality"]["n"] > 0 and result["quality"]["search_on_truth"]["max_ratio"] <= 1.0 + 1e-9


FORKS_AND_REAPS = """
import os, sys, time
sys.stdin.readline()
pid = os.fork()
if pid == 0:
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass
    os._exit(0)
os.waitpid(pid, 0)
print("reaped", flush=True)
sys.stdin.readline()
"""


def test_the_simulator_counts_a_trackers_reaped_children_in_its_cpu_and_apart():
    """A tracker's forked map builds are its CPU too (swarm_sim's cpu_share), shown apart."""
    proc = subprocess.Popen([sys.executable, "-c", FORKS_AND_REAPS], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        usage = Usage({"p": proc.pid})
        usage.start()
        proc.stdin.write(b"fork\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"reaped\n"
        got = usage.stop()["p"]
    finally:
        proc.kill()
        proc.wait(10)
    assert got["children_cpu_share"] > 0 and got["cpu_share"] >= got["children_cpu_share"], got


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killing_one_of_three_trackers_keeps_route_requests_answered(tmp_path):
    result = simulate(
        Options(
            nodes=300,
            trackers=3,
            duration=10.0,
            churn="0",
            route_rate=20.0,
            coverage_rate=0.0,
            throughput_seconds=0.0,
            idle_seconds=0.5,
            kill_tracker_at=3.0,
            expiry=EXPIRY,
            seed=6,
        ),
        tmp_path,
    )
    kill, checks = result["kill"], result["checks"]
    assert kill["requests_after"] >= 100, kill
    assert kill["unanswered_after"] == 0 and checks["unanswered"] == 0, (kill, checks)
    assert checks["routes"] == checks["requests"] and checks["bad_routes"] == 0, checks
    assert kill["routes_before"] >= 40 and kill["routes_before_lost"] == 0, kill  # the dead one's routes stand


PARAMS = TrackerParams(expiry=EXPIRY, ping_interval=0.0, warmup=0.5)


@pytest.fixture
async def trackers(bus):  # noqa: F811
    services = []
    for _ in range(3):
        nc = await connect(bus.url, max_reconnect_attempts=1)
        service = TrackerService(nc, PARAMS)
        await service.start()
        services.append(service)
    try:
        yield services
    finally:
        for service in services:
            await service.stop()
            await service.nc.close()


async def live_everywhere(services, *ids):
    deadline = time.monotonic() + 10
    while not all(set(ids) <= set(s.registry.live_ids(time.monotonic())) for s in services):
        assert time.monotonic() < deadline, "trackers did not see the nodes"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(60)
async def test_three_trackers_spread_requests_as_one_and_a_repeated_request_gets_its_route(bus, trackers):  # noqa: F811
    await bus.node("left", 0, 30)
    await bus.node("right", 0, 30)
    await live_everywhere(trackers, "left", "right")
    routes = [await ask_route(bus.nc, request_id=f"spread-{i}") for i in range(18)]
    used = [hops(r)[0][0] for r in routes]
    # each tracker answers some of them and counts the others' assignments: one tracker would split 9/9
    assert 8 <= used.count("left") <= 10, used
    served = [len(t._ours) for t in trackers]
    assert sum(served) == 18 and sum(n > 0 for n in served) >= 2, served
    again = await ask_route(bus.nc, request_id="spread-3")  # asked again (a client that timed out)
    assert again == routes[3]


@pytest.mark.timeout(60)
async def test_one_tracker_holds_the_placement_lease_and_hands_it_over_when_it_stops(bus, trackers):  # noqa: F811
    held = [t for t in trackers if t.placement is not None and t.placement.held]
    assert len(held) == 1
    await held[0].placement.stop()  # the holder stops (its lease is released)
    others = [t for t in trackers if t is not held[0]]
    deadline = time.monotonic() + S.LEASE_TTL_S  # the others retry every third of the lease's life
    while not any(t.placement.held for t in others):
        assert time.monotonic() < deadline, "nobody took the placement lease over"
        await asyncio.sleep(0.05)
    assert sum(t.placement.held for t in others) == 1


@pytest.mark.timeout(60)
async def test_an_assignment_is_recorded_once_and_its_request_id_cannot_take_another(bus, trackers):  # noqa: F811
    await bus.node("whole", 0, 30)
    await live_everywhere(trackers, "whole")
    first = await ask_route(bus.nc, request_id="once")
    kv = await bus.nc.jetstream().key_value(S.KV_ROUTES)
    entry = await kv.get(first.route_id)
    assert messages.decode(entry.value, messages.RouteAssignment) == first
    asked = await asyncio.gather(*(ask_route(bus.nc, request_id="once") for _ in range(6)))  # several trackers at once
    assert all(r == first for r in asked)
    assert (await kv.get(first.route_id)).revision == entry.revision  # never overwritten
    other = await ask_route(bus.nc, request_id="once", wire_dtype="bf16")  # same id, another request
    assert isinstance(other, messages.RouteAssignment) and other.wire_dtype == "bf16"
    assert other.route_id != first.route_id and hops(other) == hops(first)


async def peers_known(services):
    deadline = time.monotonic() + 5
    while not all(len(s.beats.peers()) == len(services) - 1 for s in services):
        assert time.monotonic() < deadline, [s.beats.peers() for s in services]
        await asyncio.sleep(0.05)


@pytest.mark.timeout(60)
async def test_each_heartbeat_reaches_one_tracker_and_the_others_get_it_passed_on(bus, trackers):  # noqa: F811
    await peers_known(trackers)
    await asyncio.sleep(beats.WHOLE_FOR_NEW_S)  # after it, a heartbeat that says nothing new goes as an id
    nodes = [await bus.node(f"beat-{i}", 0, 30) for i in range(6)]
    await live_everywhere(trackers, *(n.node_id for n in nodes))
    await asyncio.sleep(1.5)
    ids, now = sorted(n.node_id for n in nodes), time.monotonic()
    # every tracker heard from every node within the last second (ids alone keep a node alive)
    assert [sorted(i for i in ids if t.registry.alive(i, now + EXPIRY - 1.0)) for t in trackers] == [ids] * 3
    for n in nodes:
        await n.stop()
    await asyncio.sleep(0.6)  # the last relays are sent (every 0.2 s) and applied
    sent = sum(n.seq for n in nodes)
    taken = [t._beats for t in trackers]
    applied = [t.beats.applied for t in trackers]
    # the bus delivered each heartbeat to one tracker, not to all three ...
    assert sum(taken) == sent and all(k > 0 for k in taken), (sent, taken)
    # ... and each tracker applied those the other two took
    assert [k + a for k, a in zip(taken, applied)] == [sent] * 3, (sent, taken, applied)
    # most of them as ids: after a node's first, only every tenth is whole
    touched = sum(t.beats.touched for t in trackers)
    assert touched >= 0.6 * sum(applied) and sum(t.beats.unknown for t in trackers) == 0, (touched, applied)


@pytest.mark.timeout(60)
async def test_a_lone_tracker_passes_nothing_on_and_a_bad_relay_changes_nothing(bus):  # noqa: F811
    nc = await connect(bus.url, max_reconnect_attempts=1)
    tracker = TrackerService(nc, PARAMS)
    await tracker.start()
    try:
        node = await bus.node("alone", 0, 30)
        await live_everywhere([tracker], "alone")
        await asyncio.sleep(0.5)
        assert tracker._beats >= 3 and tracker.beats.passed_on == 0 and tracker.beats.peers() == []
        seq = tracker.registry.last_heartbeat("alone").seq
        forged = messages.NodeHeartbeat(
            node_id="alone",
            seq=seq + 1000,
            ts=time.time() + 1000,
            layer_start=0,
            layer_end=30,
            cache_abi="x",
            status="draining",
        )
        relay = messages.encode(messages.HeartbeatRelay(tracker_id="other", heartbeats=[forged]))
        for bad in (b"not json", relay.replace(b'"other"', b'"bad id!"'), relay.replace(b'"seq":', b'"seq":-')):
            await bus.nc.publish(S.TRACKER_HEARTBEATS, bad)
        await bus.nc.flush()
        await asyncio.sleep(0.3)
        assert tracker.beats.bad_relays == 3 and tracker.beats.applied == 0 and tracker.beats.peers() == []
        assert tracker.registry.last_heartbeat("alone").seq < seq + 1000
        await node.stop()
    finally:
        await tracker.stop()
        await nc.close()


async def test_a_simulated_node_beats_at_once_when_a_session_opens_and_when_it_ends(bus, monkeypatch):  # noqa: F811
    from neuron_bus.sim import pool as sim_pool
    from neuron_bus.sim import swarm

    monkeypatch.setattr(swarm, "SESSION_S", (0.6, 0.6))
    node = swarm.generate(swarm.SwarmSpec(nodes=1, seed=3))[0]
    node.phase = 0.0  # its first beat at once, then every 30 s
    pool = sim_pool.Pool(bus.nc, [node], time.time(), interval=30.0)
    beats: asyncio.Queue = asyncio.Queue()

    async def on_beat(msg):
        await beats.put((messages.decode(msg.data, messages.NodeHeartbeat), time.monotonic()))

    await bus.nc.subscribe(S.node_heartbeat(node.node_id), cb=on_beat)
    await pool.start()
    await pool.announce([node])
    loop = asyncio.create_task(pool.beat_loop())
    try:
        first, _ = await asyncio.wait_for(beats.get(), 5)
        hop = messages.RouteHop(
            node_id=node.node_id, layer_start=node.layer_start, layer_end=node.layer_end, subject="",
            backend_id=swarm.BACKEND, cache_abi=swarm.CACHE_ABI,
        )  # fmt: skip
        route = messages.RouteAssignment(
            route_id="r1", model_preset=swarm.MODEL, model_revision=swarm.REVISION, n_layers_total=swarm.N_LAYERS,
            hops=[hop],
        )  # fmt: skip
        await bus.nc.publish(S.route_assign("r1"), messages.encode(route))
        opened, opened_at = await asyncio.wait_for(beats.get(), 5)
        assert (opened.seq, opened.sessions_active) == (first.seq + 1, 1)
        ended, ended_at = await asyncio.wait_for(beats.get(), 5)
        assert (ended.seq, ended.sessions_active) == (opened.seq + 1, 0)
        assert 0.4 < ended_at - opened_at < 3.0  # when the 0.6 s session ended, not at the interval
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(beats.get(), 0.5)  # nothing changed since: the interval holds
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        for sub in pool._subs:
            await sub.unsubscribe()


@pytest.mark.timeout(60)
async def test_a_stopping_tracker_passes_on_the_heartbeats_it_holds_and_says_it_left(bus, trackers, monkeypatch):  # noqa: F811
    await peers_known(trackers)
    monkeypatch.setattr(beats, "RELAY_INTERVAL_S", 30.0)  # no timed relay from here on: only the stop sends one
    await asyncio.sleep(2 * 0.2)  # every relay loop is in its long sleep now
    leaving, *staying = trackers
    before = [t.beats.applied for t in staying]
    hb = messages.NodeHeartbeat(node_id="ghost", seq=1, ts=time.time(), layer_start=0, layer_end=30, cache_abi="x")
    await leaving.beats.take(hb, True, len(messages.encode(hb)))
    trackers.remove(leaving)  # stopped here, not by the fixture
    await leaving.stop()
    await leaving.nc.close()
    deadline = time.monotonic() + 5
    while [t.beats.applied for t in staying] != [b + 1 for b in before]:
        assert time.monotonic() < deadline, ([t.beats.applied for t in staying], before)
        await asyncio.sleep(0.05)
    # and the others no longer pass heartbeats on to it, at once rather than PEER_TIMEOUT_S later
    assert all(t.beats.peers() == [s.tracker_id for s in staying if s is not t] for t in staying)
