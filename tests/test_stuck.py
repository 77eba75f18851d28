"""A hop whose backend call never returns (a deadlocked or swapping backend) while its heartbeats
go on: it says it is stuck (worker/runner.py), the tracker routes no new session to it, and the
client moves its session elsewhere at once instead of waiting out the busy hop's 600 s."""

from __future__ import annotations

import asyncio
import time

import pytest

from neuron_bus import messages as M
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm, WorkerSpec
from neuron_bus.worker.runner import STUCK_FACTOR, BackendRunner
from tests.test_reliability import node_alive

pytestmark = pytest.mark.timeout(300)


class NoMetrics:
    def computed(self, *args) -> None:
        pass


def test_a_call_is_stuck_only_past_both_the_floor_and_many_times_its_expected_time():
    runner = BackendRunner("n", NoMetrics())
    try:
        now = time.monotonic()
        assert not runner.stuck(now, {"prefill": 1000.0}, after_s=2.0)  # nothing runs
        runner.running = (now - 5.0, "prefill", 100)  # 0.1 s of work at 1000 positions/s, running 5 s
        assert runner.stuck(now, {"prefill": 1000.0}, after_s=2.0)
        assert not runner.stuck(now, {"prefill": 1000.0}, after_s=10.0)  # the floor
        assert not runner.stuck(now, {"prefill": 10.0}, after_s=2.0)  # a slow hop: 10 s of work, 200 s bound
        assert runner.stuck(now + STUCK_FACTOR * 10.0, {"prefill": 10.0}, after_s=2.0)
    finally:
        runner.close()


async def _route_through(c: NeuronClient, node: str) -> M.RouteAssignment:
    for _ in range(20):  # the tracker spreads routes over the replicas
        route = await c.route("smollm2-135m")
        if node in {h.node_id for h in route.hops}:
            return route
    raise AssertionError(f"no route through {node}")


@pytest.mark.slow
def test_a_stuck_hop_is_left_for_a_new_route_and_gets_none(smollm2_path, tmp_path, reference):
    swarm = LocalSwarm(smollm2_path, workdir=tmp_path, ranges=[(0, 15), (15, 30)])
    ids = reference.tokenizer.encode("The three primary colors are")
    n = 8

    async def scenario():
        async with await NeuronClient.connect(swarm.url) as c:
            route = await _route_through(c, "stuck-1")
            routes: list[M.RouteAssignment] = []
            out = [
                ev.token_id
                async for ev in c.generate(
                    prompt_tokens=ids,
                    route=route,
                    sampling=M.SamplingParams(max_tokens=n, ignore_eos=True),
                    on_route=routes.append,
                )
                if isinstance(ev, M.TokenDelta)
            ]
            nodes = {v.node_id: v for v in (await c.coverage("smollm2-135m")).nodes}
            later = [await c.route("smollm2-135m") for _ in range(4)]
            return out, routes, nodes, later

    with swarm:
        swarm.workers.append(spec := WorkerSpec((15, 30), "stuck-1", ["--fault", "hang", "--stuck-after", "2"]))
        swarm.start_worker(spec)
        asyncio.run(node_alive(swarm.url, "stuck-1"))
        out, routes, nodes, later = asyncio.run(scenario())
    assert [[h.node_id for h in r.hops] for r in routes] == [["worker-0", "stuck-1"], ["worker-0", "worker-1"]]
    assert out == reference(ids, n)
    assert nodes["stuck-1"].alive and nodes["stuck-1"].status == "stuck"  # heartbeating, and saying so
    assert all("stuck-1" not in {h.node_id for h in r.hops} for r in later)
