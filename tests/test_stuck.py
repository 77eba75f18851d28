"""A hop whose backend call never returns (a deadlocked or swapping backend) while its heartbeats
go on: it says it is stuck (worker/runner.py), the tracker routes no new session to it, and the
client moves its session elsewhere at once instead of waiting out the busy hop's 600 s."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time

import pytest

from neuron_bus import messages as M
from neuron_bus.client import NeuronClient
from neuron_bus.errors import NeuronBusError, RouteError
from neuron_bus.local_swarm import LocalSwarm, WorkerSpec
from neuron_bus.tasks import cancel_and_wait
from neuron_bus.topology import connect
from neuron_bus.worker.runner import STUCK_FACTOR, BackendRunner
from neuron_bus.worker.service import STOP_BACKEND_GRACE_S
from tests.hop_node import Node, heartbeats
from tests.sessions import one_hop_session
from tests.test_reliability import node_alive
from workers.errors import Reason

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


def test_closing_the_runner_leaves_a_call_that_never_returns_and_drops_those_not_started():
    runner = BackendRunner("n", NoMetrics())
    started, release = threading.Event(), threading.Event()

    def blocked() -> str:
        started.set()
        release.wait()
        return "returned"

    async def scenario():
        call = asyncio.ensure_future(runner.call(blocked))
        assert await asyncio.to_thread(started.wait, 5)
        queued = asyncio.ensure_future(runner.call(lambda: "ran"))
        await asyncio.sleep(0.05)
        assert "in a call for" in runner.in_call()
        assert runner.close() is False  # at once: the call in progress is not waited for
        release.set()
        assert await call == "returned"
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert runner.in_call() == "idle"

    asyncio.run(scenario())
    assert BackendRunner("idle", NoMetrics()).close() is True


async def test_a_node_refuses_session_opens_while_its_heartbeat_says_stuck(nats_server, tiny_f32, tmp_path):
    """In process: the beat that finds the call in progress far overdue says stuck and makes the
    engine refuse opens (a route assigned before the tracker heard); the beat after the call
    returned says ready, and opens are taken again."""
    nc = await connect(nats_server.url)
    node = Node(nc, tiny_f32, tmp_path)
    inbox = await heartbeats(nc)
    req = one_hop_session().open
    req.route.hops[0].cache_abi = node.engine.cache_abi
    try:
        node.runner.running = (time.monotonic() - 3600.0, "prefill", 4)  # a call an hour old
        assert (await node.beat(inbox)).status == "stuck"
        assert node.runner.metrics.registry.get_sample_value("neuron_node_stuck") == 1.0
        with pytest.raises(NeuronBusError) as refused:
            node.engine.check_open(req)
        assert refused.value.reason == Reason.STUCK and "stuck in a call" in str(refused.value)
        node.runner.running = None  # it returned
        assert (await node.beat(inbox)).status == "ready"
        assert node.runner.metrics.registry.get_sample_value("neuron_node_stuck") == 0.0
        assert node.engine.check_open(req).node_id == "n"
    finally:
        await node.close()
        await nc.close()


async def _route_through(c: NeuronClient, node: str) -> M.RouteAssignment:
    for _ in range(20):  # the tracker spreads routes over the replicas
        route = await c.route("smollm2-135m")
        if node in {h.node_id for h in route.hops}:
            return route
    raise AssertionError(f"no route through {node}")


@pytest.mark.slow
def test_a_stuck_hop_is_left_for_a_new_route_gets_none_and_stops_without_its_backend(smollm2_path, tmp_path, reference):
    """Hanging replicas: a session moves off one, equal to the reference, and no later route goes
    through it. A stuck worker told to stop exits (status 1) without waiting for its backend, which
    never returns: at once when its sessions are closed, after its grace for the backend when a
    session's client vanished (also when told by SIGINT and SIGTERM, as `up` under Ctrl-C does),
    and at once when told twice by the same signal."""
    swarm = LocalSwarm(smollm2_path, workdir=tmp_path, ranges=[(0, 15), (15, 30)])
    ids = reference.tokenizer.encode("The three primary colors are")
    n = 8

    async def moved_off(stuck: str):
        async with await NeuronClient.connect(swarm.url) as c:
            route = await _route_through(c, stuck)
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
            # a route assigned before the node was stuck: its open is refused at once, not queued
            # behind the stuck call until the client gives up on it
            with pytest.raises(RouteError) as refused:
                await c.control(
                    stuck, M.SessionOpen(session_id="late", route=route, hop_index=1, prompt_tokens=4, n_ctx=256)
                )
        assert refused.value.reason == Reason.STUCK and refused.value.node_id == stuck, refused.value
        assert [[h.node_id for h in r.hops] for r in routes] == [["worker-0", stuck], ["worker-0", "worker-1"]]
        assert out == reference(ids, n)
        assert nodes[stuck].alive and nodes[stuck].status == "stuck"  # heartbeating, and saying so
        assert all(stuck not in {h.node_id for h in r.hops} for r in later)

    async def abandoned(stuck: str):
        """A session through ``stuck`` whose client vanishes while its prefill hangs (before the
        node is stuck: 2 s), never closing it."""
        c = await NeuronClient.connect(swarm.url)
        route = await _route_through(c, stuck)
        run = asyncio.ensure_future(c.generate(prompt_tokens=ids, route=route).__anext__())
        await asyncio.sleep(1.0)
        await c.nc.close()
        await cancel_and_wait(run)

    def hanging(node_id: str, scenario) -> subprocess.Popen:
        swarm.workers.append(spec := WorkerSpec((15, 30), node_id, ["--fault", "hang", "--stuck-after", "2"]))
        proc = swarm.start_worker(spec)
        asyncio.run(node_alive(swarm.url, node_id))
        asyncio.run(scenario(node_id))
        return proc

    with swarm:
        proc = hanging("stuck-1", moved_off)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 1  # its session was closed: nothing to wait for, and not joined to the backend
        assert "its backend is in a call for" in swarm.log_tail("stuck-1")

        proc = hanging("stuck-2", abandoned)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)  # Ctrl-C under `up`: the terminal's SIGINT, then up's SIGTERM
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_BACKEND_GRACE_S + 10) == 1
        assert STOP_BACKEND_GRACE_S - 1 < time.monotonic() - t0  # the grace for the session's close
        assert "did not free the sessions within" in swarm.log_tail("stuck-2")
        assert "again while stopping" not in swarm.log_tail("stuck-2")  # one request to stop, not two

        proc = hanging("stuck-3", abandoned)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # waiting for the backend to free the session
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 1
        assert time.monotonic() - t0 < STOP_BACKEND_GRACE_S - 1
        assert "SIGTERM again while stopping" in swarm.log_tail("stuck-3")
