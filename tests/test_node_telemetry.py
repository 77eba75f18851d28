"""Heartbeat telemetry beyond throughput: neighbours, failure rate (real NATS)."""

from __future__ import annotations

import asyncio

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.topology import connect
from neuron_bus.worker.node_telemetry import NodeTelemetry, neighbours


def route(*nodes: str) -> M.RouteAssignment:
    hops = [
        M.RouteHop(node_id=n, layer_start=i, layer_end=i + 1, subject="", backend_id="b", cache_abi="a")
        for i, n in enumerate(nodes)
    ]
    return M.RouteAssignment(route_id="r", model_preset="m", model_revision="v", n_layers_total=len(nodes), hops=hops)


def test_neighbours_follow_the_ring():
    assert neighbours("b", [route("a", "b", "c")]) == {"a", "c"}
    assert neighbours("a", [route("a", "b", "c")]) == {"b", "c"}  # the tail feeds the head
    assert neighbours("a", [route("a", "b"), route("a", "d")]) == {"b", "d"}
    assert neighbours("z", [route("a", "b")]) == set()


def test_failure_rate_counts_recent_sessions():
    t = NodeTelemetry("n")
    assert t.failure_rate() == 0.0
    for failed in (False, False, True, False):
        t.session_ended(failed)
    assert t.failure_rate() == 0.25


async def test_latency_to_neighbours_is_measured_over_the_bus(nats_server):
    nc = await connect(nats_server.url)
    try:

        async def pong(msg):
            await msg.respond(M.encode(M.Pong(node_id="peer", sent_at=0.0)))

        await nc.subscribe(S.node_control("peer"), cb=pong)
        t = NodeTelemetry("me")
        await t.refresh_latency(nc, {"peer", "ghost"})
        assert set(t.latency_ms) == {"peer"} and 0 < t.latency_ms["peer"] < 1000
        await t.refresh_latency(nc, set())
        assert t.latency_ms == {}
    finally:
        await nc.close()
    await asyncio.sleep(0)


async def test_round_trip_to_the_server_is_the_least_of_the_last_pings(nats_server):
    nc = await connect(nats_server.url)
    try:
        t = NodeTelemetry("me")
        assert t.server_rtt_ms is None  # nothing measured: the heartbeat says nothing
        for _ in range(3):
            await t.measure_server_rtt(nc)
        assert 0 < t.server_rtt_ms < 1000
        assert t.server_rtt_ms == round(min(t._server_rtts) * 1000, 3)
    finally:
        await nc.close()
    await t.measure_server_rtt(nc)  # a closed connection: no figure, the last ones stand
    assert len(t._server_rtts) == 3
