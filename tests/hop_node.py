"""One whole-model hop of the tiny llama on llama.cpp with its engine, runner and heartbeat on a
real bus, and a queue of the heartbeats it publishes: for tests of the worker's heartbeat
(tests/test_rebenchmark.py, tests/test_heartbeat_soon.py)."""

from __future__ import annotations

import asyncio
import time

import msgspec

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.cli.worker import build_report
from neuron_bus.execution import open_range, open_tokenizer
from neuron_bus.worker import heartbeat as hb_module
from neuron_bus.worker.audit_trail import AuditTrail
from neuron_bus.worker.engine import EngineOptions, HopEngine
from neuron_bus.worker.heartbeat import Heartbeat
from neuron_bus.worker.metrics import WorkerMetrics
from neuron_bus.worker.node_telemetry import NodeTelemetry
from neuron_bus.worker.runner import BackendRunner

UNDER_LOAD_TPS = 0.5  # what a benchmark taken while four models loaded beside it might have said


class Node:
    """One whole-model hop's engine, runner and heartbeat, its report's benchmark as if taken under load."""

    def __init__(self, nc, gguf, tmp_path, slow_ms: float = 0.0):
        backend = open_range("llama-cpp", gguf, 0, 4, cache_dir=tmp_path, n_ctx=64, max_sessions=2, threads=1)
        self.engine = HopEngine(
            "n", backend.capability.cache_abi, backend, open_tokenizer(gguf), AuditTrail(None, None),
            EngineOptions(slow_ms=slow_ms),
        )  # fmt: skip
        self.runner = BackendRunner("n", WorkerMetrics("n"))
        report = build_report("n", backend, "tiny", "v1", "a1", "trusted", slow_ms=slow_ms)
        loaded = msgspec.structs.replace(
            report, prefill_tokens_per_second=UNDER_LOAD_TPS, decode_tokens_per_second=UNDER_LOAD_TPS
        )
        self.heartbeat = Heartbeat(nc, loaded, self.engine, self.runner, NodeTelemetry("n"))

    def age_benchmark(self) -> None:
        self.heartbeat.benchmarked_at = time.monotonic() - hb_module.REBENCH_IDLE_S - 1

    async def beat(self, inbox: asyncio.Queue) -> M.NodeHeartbeat:
        await self.heartbeat.send(0)
        return await asyncio.wait_for(inbox.get(), 10)

    async def benchmarked(self, before: M.CapabilityReport) -> M.CapabilityReport:
        deadline = time.monotonic() + 30
        while self.heartbeat.report is before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert self.heartbeat.report is not before, "the idle node never took its benchmark again"
        return self.heartbeat.report

    async def close(self) -> None:
        await self.heartbeat.stop()
        self.runner.close()
        self.engine.backend.close()


async def heartbeats(nc) -> asyncio.Queue:
    inbox: asyncio.Queue = asyncio.Queue()

    async def cb(msg):
        await inbox.put(M.decode(msg.data, M.NodeHeartbeat))

    await nc.subscribe(S.node_heartbeat("n"), cb=cb)
    return inbox
