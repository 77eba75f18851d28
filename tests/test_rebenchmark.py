"""An idle node takes its self-benchmark again (heartbeat.py), on a tiny llama on llama.cpp and a
real nats-server: a figure taken while the machine was busy does not stand once it is idle, the
new figure reaches the heartbeats, a slowed node stays slowed, and a node with sessions or with
real work to measure from is left alone."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from neuron_bus.topology import connect
from neuron_bus.worker.metrics import WorkerMetrics
from neuron_bus.worker.runner import BackendRunner
from tests.hop_node import UNDER_LOAD_TPS, Node, heartbeats
from tests.sessions import one_hop_session


async def test_an_idle_node_takes_its_benchmark_again_and_reports_it(nats_server, tiny_f32, tmp_path):
    nc = await connect(nats_server.url)
    node = Node(nc, tiny_f32, tmp_path)
    try:
        inbox = await heartbeats(nc)
        first = await node.beat(inbox)
        assert first.decode_tokens_per_second == UNDER_LOAD_TPS  # fresh: it stands
        assert not node.heartbeat._rebench
        node.age_benchmark()
        before = node.heartbeat.report
        await node.beat(inbox)
        after = await node.benchmarked(before)
        assert after.decode_tokens_per_second > 20 * UNDER_LOAD_TPS
        assert after.prefill_tokens_per_second > 20 * UNDER_LOAD_TPS
        # the rest of the report is the node's as before
        assert msgspec.structs.replace(after, prefill_tokens_per_second=0.0, decode_tokens_per_second=0.0) == (
            msgspec.structs.replace(before, prefill_tokens_per_second=0.0, decode_tokens_per_second=0.0)
        )
        beat = await node.beat(inbox)
        assert beat.decode_tokens_per_second == after.decode_tokens_per_second
        assert beat.server_rtt_ms is not None and 0 < beat.server_rtt_ms < 1000  # its PINGs, since the first beat
        assert not node.heartbeat.rebench_due(time.monotonic())  # once per REBENCH_IDLE_S while idle
    finally:
        await node.close()
        await nc.close()


async def test_a_slowed_node_benchmarks_as_slow_as_it_computes(nats_server, tiny_f32, tmp_path):
    nc = await connect(nats_server.url)
    node = Node(nc, tiny_f32, tmp_path, slow_ms=200)
    try:
        node.age_benchmark()
        before = node.heartbeat.report
        await node.heartbeat.send(0)
        after = await node.benchmarked(before)
        assert UNDER_LOAD_TPS < after.decode_tokens_per_second < 5.0  # one decode call takes over 200 ms
    finally:
        await node.close()
        await nc.close()


async def test_a_node_with_sessions_or_real_work_keeps_what_it_measured(nats_server, tiny_f32, tmp_path):
    nc = await connect(nats_server.url)
    node = Node(nc, tiny_f32, tmp_path)
    try:
        node.age_benchmark()
        now = time.monotonic()
        assert node.heartbeat.rebench_due(now)
        # real decode work in the window: that is measured, the benchmark is not needed
        await node.runner.compute(lambda: time.sleep(0.01), "decode", 8)
        assert node.runner.measures("decode") and not node.heartbeat.rebench_due(now)
        assert node.heartbeat.build(0).decode_tokens_per_second == pytest.approx(8 / 0.01, rel=0.5)
        node.runner._window.clear()
        assert node.heartbeat.rebench_due(now)
        # a session open (or the node draining): not idle
        node.engine.sessions.add(one_hop_session())
        assert not node.heartbeat.rebench_due(now)
        node.engine.sessions.pop("s1")
        node.engine.draining = True
        assert not node.heartbeat.rebench_due(now)
        node.engine.draining = False
        # queued messages: not idle either (send is told the queue depth)
        await node.heartbeat.send(3)
        assert not node.heartbeat._rebench
        assert node.heartbeat.report.decode_tokens_per_second == UNDER_LOAD_TPS
    finally:
        await node.close()
        await nc.close()


def test_measured_throughput_is_over_the_last_30_seconds_of_each_phase(monkeypatch):
    from neuron_bus.worker import runner as runner_module

    clock = [1000.0]
    monkeypatch.setattr(runner_module.time, "monotonic", lambda: clock[0])
    runner = BackendRunner("n", WorkerMetrics("n"))
    try:

        def call(phase: str, positions: int, seconds: float) -> None:
            def fn():
                clock[0] += seconds

            asyncio.run(runner.compute(fn, phase, positions))

        call("decode", 4, 0.1)  # too few positions to measure
        assert runner.measured_tps("decode", -1.0) == -1.0
        call("decode", 6, 0.1)
        call("prefill", 512, 0.5)
        assert runner.measured_tps("decode", -1.0) == pytest.approx(10 / 0.2)
        assert runner.measured_tps("prefill", -1.0) == pytest.approx(512 / 0.5)
        clock[0] += runner_module.WORK_WINDOW_S - 0.75  # the first decode call (started 30.05 s before) leaves
        call("decode", 20, 0.1)
        assert runner.measured_tps("decode", -1.0) == pytest.approx(26 / 0.2)
        assert runner.measured_tps("prefill", -1.0) == pytest.approx(512 / 0.5)  # started 29.85 s before
        clock[0] += runner_module.WORK_WINDOW_S + 1  # all of it leaves
        assert runner.measured_tps("decode", -1.0) == -1.0 and not runner.measures("prefill")
        call("prefill", 64, 0.25)
        assert runner.measured_tps("prefill", -1.0) == pytest.approx(64 / 0.25)
    finally:
        runner.close()
