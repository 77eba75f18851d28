"""The tracker against a real nats-server: the test plays the nodes (real reports, heartbeats
and pings over NATS) and the client (real route requests), and reads the route stream and KV."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from neuron_bus import messages
from neuron_bus import subjects as S
from neuron_bus.cli.tracker import render
from neuron_bus.client import NeuronClient, RouteError
from neuron_bus.errors import NeuronBusError
from neuron_bus.gateway.bus import route_api_error
from neuron_bus.topology import connect, ensure_topology
from neuron_bus.tracker import TrackerParams, TrackerService, forked
from neuron_bus.tracker.registry import Registry
from neuron_bus.tracker.service import coverage_freshness
from neuron_bus.worker.source import ask_for_range
from tests.test_planner import report
from workers.errors import Reason

BIN = str(Path(sys.executable).parent / "neuron-bus")
EXPIRY = 1.0
BEAT = 0.2
PARAMS = TrackerParams(expiry=EXPIRY, ping_interval=0.0, warmup=0.5)

pytestmark = pytest.mark.timeout(60)


class Node:
    """A node on the bus as far as the tracker can tell: report, heartbeats, pings."""

    def __init__(self, nc, node_id: str, a: int, b: int, tps: float = 50.0, answer_pings: bool = False, **kw):
        self.nc, self.caps, self.tps = nc, report(node_id, a, b, tps=tps, **kw), tps
        self.answer_pings = answer_pings
        self._task = self._ctl = None
        self.seq = 0
        self.memory_pressure = 0.0

    @property
    def node_id(self) -> str:
        return self.caps.node_id

    async def start(self) -> Node:
        data = messages.encode(self.caps)
        kv = await self.nc.jetstream().key_value(S.KV_NODES)
        await kv.put(self.node_id, data)
        await self.nc.publish(S.node_caps(self.node_id), data)
        if self.answer_pings:
            self._ctl = await self.nc.subscribe(S.node_control(self.node_id), cb=self._on_ctl)
        self._task = asyncio.create_task(self._beat())
        return self

    async def _on_ctl(self, msg):
        ping = messages.decode(msg.data, messages.ControlRequest)
        await msg.respond(messages.encode(messages.Pong(node_id=self.node_id, sent_at=ping.sent_at)))

    async def _beat(self):
        while True:
            self.seq += 1
            hb = messages.NodeHeartbeat(
                node_id=self.node_id,
                seq=self.seq,
                ts=time.time(),
                layer_start=self.caps.layer_start,
                layer_end=self.caps.layer_end,
                cache_abi=self.caps.cache_abi,
                decode_tokens_per_second=self.tps,
                memory_pressure=self.memory_pressure,
            )
            await self.nc.publish(S.node_heartbeat(self.node_id), messages.encode(hb))
            await asyncio.sleep(BEAT)

    async def stop(self):
        """Stop heartbeating (the node died, as far as anyone can tell)."""
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._ctl:
            await self._ctl.unsubscribe()
            self._ctl = None


@pytest.fixture
async def bus(nats_server):
    nc = await connect(nats_server.url, max_reconnect_attempts=1)
    await ensure_topology(nc.jetstream())
    nodes: list[Node] = []

    class Bus:
        url = nats_server.url

        def __init__(self):
            self.nc = nc

        async def node(self, *args, **kw) -> Node:
            n = await Node(nc, *args, **kw).start()
            nodes.append(n)
            return n

    try:
        yield Bus()
    finally:
        for n in nodes:
            await n.stop()
        await nc.close()


@pytest.fixture
async def tracker(bus):
    nc = await connect(bus.url, max_reconnect_attempts=1)
    service = TrackerService(nc, PARAMS)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()
        await nc.close()


async def ask_route(nc, **kw):
    req = messages.RouteRequest(request_id=kw.pop("request_id", "req"), model_preset="smollm2-135m", **kw)
    msg = await nc.request(S.ROUTE_REQUEST, messages.encode(req), timeout=5)
    return messages.decode(msg.data, messages.RouteReply)


async def ask_coverage(nc, model: str | None = None) -> messages.CoverageReport:
    msg = await nc.request(S.TRACKER_COVERAGE, messages.encode(messages.CoverageRequest(model_preset=model)), timeout=5)
    return messages.decode(msg.data, messages.CoverageReport)


async def eventually(check, timeout: float = 5.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {result!r}")
        await asyncio.sleep(every)


async def live(tracker: TrackerService, *ids: str):
    async def check():
        return set(ids) <= set(tracker.registry.live_ids(time.monotonic()))

    await eventually(check)


def hops(route) -> list[tuple[str, int, int]]:
    assert isinstance(route, messages.RouteAssignment), route
    return [(h.node_id, h.layer_start, h.layer_end) for h in route.hops]


# ---------------------------------------------------------------------------------------------


async def test_route_is_published_on_the_stream_and_in_kv(bus, tracker):
    await bus.node("head", 0, 15)
    await bus.node("tail", 15, 30)
    await live(tracker, "head", "tail")
    route = await ask_route(bus.nc, wire_dtype="bf16")
    assert hops(route) == [("head", 0, 15), ("tail", 15, 30)]
    assert [h.subject for h in route.hops] == [
        f"neuron.act.{h.node_id}.{route.route_id}.{i}" for i, h in enumerate(route.hops)
    ]
    assert route.wire_dtype == "bf16" and route.n_layers_total == 30 and route.model_revision == "r1"
    js = bus.nc.jetstream()
    stored = await js.get_last_msg(S.STREAM_ROUTES, S.route_assign(route.route_id))
    assert messages.decode(stored.data, messages.RouteAssignment) == route
    entry = await (await js.key_value(S.KV_ROUTES)).get(route.route_id)
    assert messages.decode(entry.value, messages.RouteAssignment) == route


async def test_slow_replica_avoided_then_used_alone_and_marked_under_provisioned(bus, tracker):
    await bus.node("head", 0, 15)
    await bus.node("head2", 0, 15)
    fast = await bus.node("fast", 15, 30, tps=50)
    await bus.node("slow", 15, 30, tps=2)
    await live(tracker, "head", "head2", "fast", "slow")
    for i in range(6):
        assert "slow" not in [h[0] for h in hops(await ask_route(bus.nc, request_id=f"r{i}"))]
    await fast.stop()

    async def fast_gone():
        return "fast" not in tracker.registry.live_ids(time.monotonic())

    await eventually(fast_gone, timeout=EXPIRY + 2)
    assert hops(await ask_route(bus.nc))[1] == ("slow", 15, 30)
    cov = await ask_coverage(bus.nc)
    (group,) = cov.models
    tail_rows = group.layers[15:30]
    assert {r.status for r in tail_rows} == {"under-provisioned"} and tail_rows[0].replicas == ["slow"]
    assert {r.status for r in group.layers[:15]} == {"covered"}
    assert group.nodes_expired == ["fast"]
    assert (group.hint.layer_start, group.hint.layer_end) == (15, 30)


async def test_other_cache_abi_is_never_routed_and_its_only_range_is_rejected_with_reason(bus, tracker):
    await bus.node("head", 0, 15)
    await bus.node("odd-tail", 15, 30, cache_abi="llama-kv-q8-v2")
    await live(tracker, "head", "odd-tail")
    reply = await ask_route(bus.nc, request_id="abi")
    assert isinstance(reply, messages.RouteRejection) and reply.request_id == "abi"
    assert any("coverage gap at layers 15-29 among nodes with cache ABI llama-kv-f16-v1" in r for r in reply.reasons)
    pinned = await ask_route(bus.nc, cache_abi="z")
    assert isinstance(pinned, messages.RouteRejection) and "with cache ABI z" in pinned.reasons[0]
    await bus.node("tail", 15, 30)
    await live(tracker, "tail")
    for _ in range(4):
        assert "odd-tail" not in [h[0] for h in hops(await ask_route(bus.nc))]


async def test_killing_the_only_node_of_a_range_makes_a_gap_within_the_expiry(bus, tracker):
    await bus.node("head", 0, 15)
    tail = await bus.node("tail", 15, 30)
    await live(tracker, "head", "tail")
    await tail.stop()
    killed = time.monotonic()

    async def gap():
        cov = await ask_coverage(bus.nc, "smollm2-135m")
        return cov.models[0].layers[20].status == "gap" and cov

    cov = await eventually(gap, timeout=EXPIRY + 2)
    assert time.monotonic() - killed <= EXPIRY + BEAT + 0.5
    assert {r.status for r in cov.models[0].layers[15:]} == {"gap"}
    reply = await ask_route(bus.nc)
    assert isinstance(reply, messages.RouteRejection) and reply.reasons == ["coverage gap at layers 15-29"]


async def test_sixteen_requests_over_two_full_replicas_are_spread(bus, tracker):
    await bus.node("left", 0, 30)
    await bus.node("right", 0, 30)
    await live(tracker, "left", "right")
    routes = [await ask_route(bus.nc, request_id=f"r{i}") for i in range(16)]
    used = [hops(r)[0][0] for r in routes]
    assert used.count("left") == 8 and used.count("right") == 8
    assert len({r.route_id for r in routes}) == 16


async def test_tracker_restart_rebuilds_the_registry_from_kv_and_heartbeats(bus):
    nc1 = await connect(bus.url, max_reconnect_attempts=1)
    first = TrackerService(nc1, PARAMS)
    await first.start()
    await bus.node("head", 0, 15)
    await bus.node("tail", 15, 30)
    await live(first, "head", "tail")
    assert isinstance(await ask_route(bus.nc), messages.RouteAssignment)
    await first.stop()
    await nc1.close()
    # The reports were announced before this tracker existed: only the KV bucket has them.
    nc2 = await connect(bus.url, max_reconnect_attempts=1)
    second = TrackerService(nc2, PARAMS)
    await second.start()
    try:
        assert {v.node_id for v in second.registry.views(time.monotonic())} == {"head", "tail"}
        route = await ask_route(bus.nc)  # right after the restart: the warmup waits for heartbeats
        assert hops(route) == [("head", 0, 15), ("tail", 15, 30)]
        cov = await ask_coverage(bus.nc)
        assert cov.models[0].nodes_live == ["head", "tail"]
    finally:
        await second.stop()
        await nc2.close()


async def test_heartbeat_without_report_reads_the_report_from_kv(bus, tracker):
    caps = report("late", 0, 30)
    await (await bus.nc.jetstream().key_value(S.KV_NODES)).put("late", messages.encode(caps))
    hb = messages.NodeHeartbeat(
        node_id="late", seq=1, ts=time.time(), layer_start=0, layer_end=30, cache_abi=caps.cache_abi
    )
    for _ in range(3):
        await bus.nc.publish(S.node_heartbeat("late"), messages.encode(hb))
    await live(tracker, "late")
    assert hops(await ask_route(bus.nc)) == [("late", 0, 30)]


async def test_coverage_shows_the_last_heartbeats_memory_pressure(bus, tracker):
    node = await bus.node("solo", 0, 30)
    node.memory_pressure = 0.25
    await live(tracker, "solo")

    async def shows(pressure: float):
        async def check():
            return [n.memory_pressure for n in (await ask_coverage(bus.nc)).nodes] == [pressure]

        await eventually(check)

    await shows(0.25)
    node.memory_pressure = 0.75  # nothing the route index cares about changes: the node is not refiled
    await shows(0.75)


async def test_a_large_swarms_map_is_built_in_a_forked_child_and_equals_the_threads(bus, tracker, monkeypatch):
    await bus.node("head", 0, 15)
    await bus.node("fast", 15, 30, tps=50)
    await bus.node("slow", 15, 30, tps=2)
    await live(tracker, "head", "fast", "slow")
    children = []
    run = forked.run

    async def counted(func, **kw):
        children.append(func)
        return await run(func, **kw)

    monkeypatch.setattr(forked, "run", counted)

    async def build(fork_at: int) -> messages.CoverageReport:
        tracker.fork_coverage_at = fork_at
        tracker._coverage.clear()
        return await ask_coverage(bus.nc)

    def comparable(report: messages.CoverageReport):
        for n in report.nodes:
            n.seconds_since_heartbeat = None  # the clock moves between the two builds
        return msgspec.structs.replace(report, generated_at=0.0)

    async def entries_built() -> bool:  # by the sweep, on the loop, before any map: a child finds them
        registry = tracker.registry
        return registry.build_tracked(limit=0) == 0 and all(r.tracked is not None for r in registry.records())

    await eventually(entries_built)
    in_thread = await build(fork_at=10**9)
    assert children == []
    in_child = await build(fork_at=0)
    assert len(children) == 1
    assert comparable(in_child) == comparable(in_thread)
    assert [n.node_id for n in in_child.nodes if n.slow] == ["slow"]


async def test_coverage_maps_are_answered_on_the_maps_connection_and_routes_on_the_other(bus, nats_server):
    nc = await connect(bus.url, name="t-tracker")
    maps_nc = await connect(bus.url, name="t-tracker-maps")
    service = TrackerService(nc, PARAMS, maps_nc=maps_nc)
    await service.start()
    try:
        await bus.node("solo", 0, 30)
        await live(service, "solo")
        assert [n.node_id for n in (await ask_coverage(bus.nc)).nodes] == ["solo"]
        assert hops(await ask_route(bus.nc)) == [("solo", 0, 30)]
        connz = await asyncio.to_thread(nats_server.monitor, "connz?subs=1")
        subs = {c.get("name"): set(c.get("subscriptions_list", [])) for c in connz["connections"]}
        assert S.TRACKER_COVERAGE in subs["t-tracker-maps"] and S.ROUTE_REQUEST not in subs["t-tracker-maps"]
        assert S.ROUTE_REQUEST in subs["t-tracker"] and S.TRACKER_COVERAGE not in subs["t-tracker"]
    finally:
        await service.stop()
        await maps_nc.close()
        await nc.close()


def test_a_coverage_map_is_served_fresh_then_stale_while_rebuilt_then_only_after_a_rebuild():
    params = TrackerParams(expiry=5.0)
    cost = 0.2  # a 10,000-node map: fresh for 4x its cost, then stale for up to half the expiry more
    assert coverage_freshness(0.8, cost, params) == "fresh"
    assert coverage_freshness(0.81, cost, params) == "stale"
    assert coverage_freshness(3.3, cost, params) == "stale"  # half the expiry (2.5 s) caps 20x the cost (4 s)
    assert coverage_freshness(3.31, cost, params) == "build"
    assert coverage_freshness(2.0, 1.0, params) == "fresh"  # a slow build's own reuse time comes first
    assert coverage_freshness(6.51, 1.0, params) == "build"
    assert coverage_freshness(0.049, 0.002, params) == "build"  # a small swarm's map: 4x + 20x 2 ms


async def test_a_stale_coverage_map_is_served_at_once_and_the_next_request_gets_the_rebuilt_one(bus, tracker):
    await bus.node("first", 0, 30)
    await live(tracker, "first")
    key = (None, True, True)

    def node_ids(report):
        return {n.node_id for n in report.nodes}

    assert node_ids(await ask_coverage(bus.nc)) == {"first"}
    await bus.node("second", 0, 30)
    await live(tracker, "second")
    _, _, data = tracker._coverage[key]
    # as if the map had taken 50 ms to build and were 0.4 s old: past 4x its cost, within half the expiry more
    tracker._coverage[key] = (time.monotonic() - 0.4, 0.05, data)
    assert node_ids(await ask_coverage(bus.nc)) == {"first"}  # the last map, at once

    async def rebuilt():
        return node_ids(await ask_coverage(bus.nc)) == {"first", "second"}

    await eventually(rebuilt, timeout=2)
    # a map older than the stale window is not served: the request waits for a new one
    await bus.node("third", 0, 30)
    await live(tracker, "third")
    _, _, data = tracker._coverage[key]
    tracker._coverage[key] = (time.monotonic() - 0.9, 0.05, data)
    assert node_ids(await ask_coverage(bus.nc)) == {"first", "second", "third"}


def test_a_heartbeat_sent_before_the_one_applied_is_dropped():
    reg, caps = Registry(PARAMS), report("n", 0, 30)
    reg.apply_report(caps, now=0.0)

    def beat(seq: int, ts: float, **kw) -> tuple[str, int]:
        hb = messages.NodeHeartbeat(
            node_id="n", seq=seq, ts=ts, layer_start=0, layer_end=30, cache_abi=caps.cache_abi, **kw
        )
        reg.apply_heartbeat(hb, now=0.1)
        (view,) = reg.views(now=0.1)
        return view.status, view.sessions_active

    assert beat(5, 100.0, status="draining", sessions_active=2) == ("draining", 2)
    assert beat(4, 99.0) == ("draining", 2)  # delivered late: it would make the node ready and idle again
    assert reg.late_heartbeats == 1
    assert beat(1, 101.0, sessions_active=1) == ("ready", 1)  # the node restarted: it counts from 1 again, later
    assert reg.late_heartbeats == 1


def test_an_id_passed_on_keeps_a_node_alive_here_only_if_it_is_alive_with_its_state_here():
    reg, caps = Registry(PARAMS), report("n", 0, 30)
    reg.apply_report(caps, now=0.0)
    assert not reg.touch("n", now=0.1) and not reg.touch("unknown", now=0.1)  # no heartbeat here yet
    assert reg.live_ids(now=0.1) == []
    hb = messages.NodeHeartbeat(node_id="n", seq=1, ts=1.0, layer_start=0, layer_end=30, cache_abi=caps.cache_abi)
    assert reg.apply_heartbeat(hb, now=0.2)  # its first: new
    assert not reg.apply_heartbeat(msgspec.structs.replace(hb, seq=2, ts=2.0), now=0.4)  # the same state
    assert reg.touch("n", now=0.9 * EXPIRY + 0.4)  # liveness alone, past the expiry of the last heartbeat
    assert reg.live_ids(now=1.2 * EXPIRY + 0.4) == ["n"]
    assert reg.last_heartbeat("n").seq == 2
    reg.expire(now=3 * EXPIRY)
    # dead here: only a whole heartbeat revives it
    assert reg.live_ids(now=3 * EXPIRY) == [] and not reg.touch("n", now=3 * EXPIRY)


async def test_pings_measure_round_trips_to_nodes(bus):
    nc = await connect(bus.url, max_reconnect_attempts=1)
    service = TrackerService(nc, TrackerParams(expiry=EXPIRY, ping_interval=0.1))
    await service.start()
    try:
        await bus.node("pinged", 0, 30, answer_pings=True)
        await bus.node("mute", 0, 30)

        async def measured():
            nodes = {n.node_id: n for n in (await ask_coverage(bus.nc)).nodes}
            return nodes.get("pinged") and nodes["pinged"].rtt_ms is not None and nodes

        nodes = await eventually(measured)
        assert 0 < nodes["pinged"].rtt_ms < 1000 and nodes["mute"].rtt_ms is None
    finally:
        await service.stop()
        await nc.close()


async def test_malformed_route_request_gets_a_rejection(bus, tracker):
    msg = await bus.nc.request(S.ROUTE_REQUEST, b"{not json", timeout=5)
    reply = messages.decode(msg.data, messages.RouteReply)
    assert isinstance(reply, messages.RouteRejection) and "malformed RouteRequest" in reply.reasons[0]
    assert reply.code == "bad_json"


async def test_a_route_the_bus_does_not_record_is_refused_naming_the_bus_and_the_gateway_says_retry(bus, tracker):
    await bus.node("whole", 0, 30)
    await live(tracker, "whole")
    js = bus.nc.jetstream()
    await js.delete_key_value(S.KV_ROUTES)  # the arbiter of assignments is gone: the write fails
    async with await NeuronClient.connect(bus.url, tracker_wait=0) as client:
        with pytest.raises(RouteError) as err:
            await client.route("smollm2-135m")
    assert err.value.reason == Reason.NATS
    assert f"tracker {tracker.tracker_id}: the bus did not take the route assignment (KV {S.KV_ROUTES}" in str(
        err.value
    )
    answer = route_api_error(err.value)  # what the gateway tells an HTTP client: try again, not a node's fault
    response = answer.response()
    assert response.status == 503 and response.headers["Retry-After"] == "5"
    (whole,) = tracker.registry.views(time.monotonic())
    assert whole.recently_assigned == 0  # the refused route's load was given back
    await ensure_topology(js)  # the bucket is back: routes are recorded again
    assert hops(await ask_route(bus.nc, request_id="again")) == [("whole", 0, 30)]


async def test_protocols_do_not_mix_a_node_or_a_client_of_another_is_told_which_the_tracker_speaks(
    bus, tracker, capsys, monkeypatch
):
    newer = messages.PROTOCOL + 1
    await bus.node("current", 0, 30)
    await bus.node("upgraded", 0, 30, tps=500, protocol=newer)  # faster: the route's choice, were it usable
    await live(tracker, "current", "upgraded")
    for i in range(4):
        route = await ask_route(bus.nc, request_id=f"p{i}")
        assert hops(route) == [("current", 0, 30)] and route.protocol == messages.PROTOCOL
    cov = await ask_coverage(bus.nc)
    assert cov.protocol == messages.PROTOCOL
    assert {n.node_id: n.protocol for n in cov.nodes} == {"current": messages.PROTOCOL, "upgraded": newer}
    monkeypatch.setenv("COLUMNS", "200")  # the table unabridged
    render(cov)  # the CLI's table marks the node the tracker does not route
    assert f"protocol {newer}: not routed" in capsys.readouterr().out
    async with await NeuronClient.connect(bus.url, tracker_wait=0) as client:
        with pytest.raises(RouteError) as err:
            await client.route("smollm2-135m", protocol=newer)  # a client of the newer protocol
    assert err.value.reason == Reason.PROTOCOL
    assert f"speaks protocol {messages.PROTOCOL}, this request {newer}" in str(err.value)
    # a --layers auto node of the newer protocol is placed nowhere (it would load a range never routed)
    join = messages.PlacementRequest(
        node_id="joining", model_preset="smollm2-135m", fit=messages.NodeFit(max_layers=30), protocol=newer
    )
    with pytest.raises(NeuronBusError) as refused:
        await ask_for_range(bus.nc, join, wait_s=10)
    assert refused.value.reason == Reason.NOT_PLACED and f"the node {newer}" in str(refused.value)


async def test_policy_private_uses_only_trusted_nodes(bus, tracker):
    await bus.node("public", 0, 30, tps=500)
    await bus.node("trusted", 0, 30, trust_tier="trusted")
    await live(tracker, "public", "trusted")
    assert hops(await ask_route(bus.nc, policy="private"))[0][0] == "trusted"
    assert route_trust(await ask_route(bus.nc, policy="paid-trusted")) == ["trusted"]


def route_trust(route) -> list[str]:
    return [h.trust_tier for h in route.hops]


# -- the CLI, as subprocesses -----------------------------------------------------------------


def _run(*args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=timeout)


async def test_cli_tracker_serves_routes_and_coverage_then_stops_on_sigterm(bus):
    proc = subprocess.Popen(
        [BIN, "tracker", "--nats", bus.url, "--expiry", str(EXPIRY)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
        assert "tracker ready" in line, line + proc.stderr.read()
        await bus.node("head", 0, 15)
        await bus.node("tail", 15, 30, tps=2)
        await asyncio.sleep(2 * BEAT)
        assert hops(await ask_route(bus.nc)) == [("head", 0, 15), ("tail", 15, 30)]

        out = await asyncio.to_thread(_run, "coverage", "--nats", bus.url, "--json")
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        (group,) = doc["models"]
        assert group["layers"][0]["replicas"] == ["head"]
        assert {row["status"] for row in group["layers"]} == {"under-provisioned"}
        assert messages.decode(out.stdout.encode(), messages.CoverageReport).models[0].n_layers_total == 30

        table = await asyncio.to_thread(_run, "coverage", "--nats", bus.url, "--model", "smollm2-135m")
        assert table.returncode == 0, table.stderr
        assert "under-provisioned" in table.stdout and "15-29" in table.stdout and "single replica" in table.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rest, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err
    assert "tracker stopped" in rest


async def test_cli_coverage_without_a_tracker_fails_with_one_clear_line(bus):
    out = await asyncio.to_thread(_run, "coverage", "--nats", bus.url, "--timeout", "1")
    assert out.returncode == 1
    assert out.stderr.strip().startswith("error: no tracker answered on neuron.tracker.coverage")


async def test_cli_tracker_on_an_unprovisioned_server_fails_clearly(nats_server):
    out = await asyncio.to_thread(_run, "tracker", "--nats", nats_server.url)
    assert out.returncode == 1 and "provision" in out.stderr


async def test_a_route_goes_around_the_nodes_a_request_avoids_while_others_cover_their_layers(bus, tracker):
    await bus.node("whole", 0, 30, tps=100.0)
    await bus.node("head", 0, 15, tps=50.0)
    await bus.node("tail", 15, 30, tps=50.0)
    await live(tracker, "whole", "head", "tail")
    assert hops(await ask_route(bus.nc, request_id="a")) == [("whole", 0, 30)]  # the cheapest
    assert hops(await ask_route(bus.nc, request_id="b", avoid=["whole"])) == [("head", 0, 15), ("tail", 15, 30)]
    assert hops(await ask_route(bus.nc, request_id="c", avoid=["tail"])) == [("whole", 0, 30)]
    # nothing covers layers 15-29 without an avoided node: the route goes through one (a lost node
    # that came back is used again) rather than being refused
    route = hops(await ask_route(bus.nc, request_id="d", avoid=["whole", "tail"]))
    assert route[-1][2] == 30 and {"whole", "tail"} & {node for node, _, _ in route}
