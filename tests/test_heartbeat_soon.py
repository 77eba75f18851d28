"""A worker heartbeats at once when a session opens or closes (heartbeat.py ``next_beat``), no
sooner than ``HEARTBEAT_SOON_S`` after its last beat, and otherwise every interval: on a tiny llama
on llama.cpp and a real nats-server, with the worker's own heartbeat loop and a 30 s interval, so
every beat seen here within seconds was a prompt one. A prompt beat starts no round of pings
sooner than ``PROBE_EVERY_S`` after the last."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from neuron_bus.timing import HEARTBEAT_SOON_S
from neuron_bus.topology import connect
from neuron_bus.worker.service import WorkerOptions, WorkerService
from tests.hop_node import Node, heartbeats
from tests.sessions import one_hop_session

INTERVAL_S = 30.0


async def next_heartbeat(inbox: asyncio.Queue, within: float = 5.0):
    beat = await asyncio.wait_for(inbox.get(), within)
    return beat, time.monotonic()


async def test_a_worker_beats_at_once_when_its_sessions_change(nats_server, tiny_f32, tmp_path):
    nc = await connect(nats_server.url)
    node = Node(nc, tiny_f32, tmp_path)
    inbox = await heartbeats(nc)
    worker = SimpleNamespace(heartbeat=node.heartbeat, opts=WorkerOptions(heartbeat_interval=INTERVAL_S), queue_depth=0)
    loop = None
    try:
        await node.heartbeat.send(0)  # as WorkerService.start does
        first, _ = await next_heartbeat(inbox)
        assert first.sessions_active == 0
        loop = asyncio.create_task(WorkerService._heartbeat_loop(worker))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(inbox.get(), 0.5)  # nothing changed: the interval holds

        node.engine.sessions.add(one_hop_session(session_id="s1"))
        opened, opened_at = await next_heartbeat(inbox)
        assert (opened.seq, opened.sessions_active) == (first.seq + 1, 1)

        # two changes at once: one beat, no sooner than HEARTBEAT_SOON_S after the last, telling both
        node.engine.sessions.add(one_hop_session(session_id="s2"))
        node.engine.sessions.pop("s1")
        probed_at = node.heartbeat.probed_at
        both, both_at = await next_heartbeat(inbox)
        assert (both.seq, both.sessions_active) == (opened.seq + 1, 1)
        assert both_at - opened_at >= HEARTBEAT_SOON_S * 0.9
        assert node.heartbeat.probed_at == probed_at  # pings keep the regular beats' pace

        node.engine.sessions.pop("s2")
        closed, _ = await next_heartbeat(inbox)
        assert (closed.seq, closed.sessions_active) == (both.seq + 1, 0)
        node.engine.sessions.pop("s2")  # not there: nothing changed, no beat
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(inbox.get(), 0.5)
    finally:
        if loop is not None:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
        await node.close()
        await nc.close()
