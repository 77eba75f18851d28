"""The node pool: one process playing thousands of simulated nodes on a real bus.

Each node speaks the workers' protocol: its ``CapabilityReport`` in KV ``neuron-nodes`` and on
``neuron.node.<id>.caps``, a ``NodeHeartbeat`` every interval on ``neuron.node.<id>.heartbeat``
(phases spread over the interval, published in batches from one timer; sooner when its sessions
opened or closed, as a worker's), and a ``Pong`` for every
``Ping`` on ``neuron.node.<id>.ctl`` after its simulated round trip (one wildcard subscription
answers for all of them; a dead node does not answer). Route assignments
(``neuron.route.assign.>``) open simulated sessions on their hops: heartbeats report them as
``sessions_active`` and the route neighbours' latencies as ``neighbour_latency_ms``; the round
trip its own flushes would measure (its true one, a little over) as ``server_rtt_ms``.

    python -m neuron_bus.sim.pool --nats URL --nodes N --seed S --duration D --churn C --t0 WALL

Prints JSON lines on stdout: ``{"ready": n}`` once the initial nodes are announced, one
``{"gone": id, ...}`` per node that left or died (with its last heartbeat's wall time), and
``{"stats": ...}`` when it stops (SIGTERM, or by itself after ``--max-seconds``).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import signal
import sys
import time

import nats.errors
import nats.js.errors as jserr
from nats.aio.subscription import Subscription

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.errors import MalformedMessage
from neuron_bus.gctune import freeze_old_objects
from neuron_bus.sim import swarm
from neuron_bus.tasks import cancel_and_wait
from neuron_bus.timing import HEARTBEAT_SOON_S
from neuron_bus.topology import connect
from workers.errors import Reason

TICK_S = 0.005
ANNOUNCE_BATCH = 256


def capability(node: swarm.SimNode) -> M.CapabilityReport:
    return M.CapabilityReport(
        node_id=node.node_id,
        model_preset=swarm.MODEL,
        model_revision=swarm.REVISION,
        artifact_id="sim-artifact",
        backend_id=swarm.BACKEND,
        layer_start=node.layer_start,
        layer_end=node.layer_end,
        n_layers_total=swarm.N_LAYERS,
        hidden_size=8192,
        model_arch="llama",
        supported_runtime="sim",
        supports_prefill=True,
        supports_decode_step=True,
        supports_layer_range=True,
        supports_partial_artifacts=True,
        cache_abi=swarm.CACHE_ABI,
        cache_bytes_per_token_estimate=327680,
        prefill_tokens_per_second=node.decode_tps * 10,
        decode_tokens_per_second=node.decode_tps,
        trust_tier=node.trust_tier,
        started_at=time.time(),
    )


def emit(**record) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


class Pool:
    def __init__(self, nc, nodes: list[swarm.SimNode], t0: float, interval: float):
        self.nc = nc
        self.nodes = {n.node_id: n for n in nodes}
        self.t0 = t0
        self.interval = interval
        self.live: set[str] = set()
        self.draining: set[str] = set()
        self.seq: dict[str, int] = {}
        self.last_beat: dict[str, float] = {}
        self.noise: dict[str, float] = {}  # node -> measured / true throughput
        self.rng = random.Random(7)
        self._due: list[tuple[float, str]] = []  # (monotonic time of the next heartbeat, node id)
        # a node whose sessions changed beats at once, as workers do (worker/heartbeat.py):
        # (when, when its sessions changed, node id), monotonic
        self._soon: list[tuple[float, float, str]] = []
        self._sent: dict[str, float] = {}  # node id -> monotonic time of its last heartbeat
        self._sessions: dict[str, list[tuple[float, tuple[str, ...]]]] = {}  # node -> (end, neighbours)
        self.stats = {"heartbeats": 0, "pings": 0, "pongs": 0, "assignments": 0, "announced": 0, "gone": 0}
        self._subs: list[Subscription] = []

    # -- nodes joining and leaving -----------------------------------------------------------

    async def announce(self, nodes: list[swarm.SimNode]) -> None:
        kv = await self.nc.jetstream().key_value(S.KV_NODES)
        for i in range(0, len(nodes), ANNOUNCE_BATCH):
            batch = nodes[i : i + ANNOUNCE_BATCH]
            datas = [M.encode(capability(n)) for n in batch]
            await asyncio.gather(*(kv.put(n.node_id, d) for n, d in zip(batch, datas)))
            for n, d in zip(batch, datas):
                await self.nc.publish(S.node_caps(n.node_id), d)
                self._join(n)
        self.stats["announced"] += len(nodes)

    def _join(self, node: swarm.SimNode) -> None:
        self.live.add(node.node_id)
        first = time.monotonic() + node.phase * self.interval
        heapq.heappush(self._due, (first, node.node_id))

    def _gone(self, node: swarm.SimNode) -> None:
        self.live.discard(node.node_id)
        self.draining.discard(node.node_id)
        self.stats["gone"] += 1
        emit(gone=node.node_id, kind=node.leave_kind, at=time.time(), last_beat=self.last_beat.get(node.node_id))

    async def churn_loop(self) -> None:
        events: list[tuple[float, str, str]] = []  # (seconds after t0, "join" | "leave" | "die", node id)
        for n in self.nodes.values():
            if n.join_at > 0:
                events.append((n.join_at, "join", n.node_id))
            if n.leave_at is not None:
                assert n.leave_kind is not None, "generate() sets leave_at and leave_kind together"
                events.append((n.leave_at, n.leave_kind, n.node_id))
        events.sort()
        for at, kind, node_id in events:
            delay = self.t0 + at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            node = self.nodes[node_id]
            if kind == "join":
                await self.announce([node])
            elif node_id in self.live:
                if kind == "leave":
                    self.draining.add(node_id)  # the next heartbeat says draining, then silence
                else:
                    self._gone(node)

    # -- heartbeats --------------------------------------------------------------------------

    def heartbeat(self, node: swarm.SimNode, now_wall: float) -> M.NodeHeartbeat:
        node_id = node.node_id
        self.seq[node_id] = seq = self.seq.get(node_id, 0) + 1
        sessions = self._active(node_id, time.monotonic())
        neighbours: dict[str, float] = {}
        for _, ids in sessions:
            for other in ids:
                peer = self.nodes.get(other)
                if peer is not None:
                    neighbours[other] = round((node.rtt + peer.rtt) / 2 * 1000 * self.rng.uniform(0.95, 1.05), 3)
        noise = self.noise.get(node_id, 1.0)
        if sessions:  # a rolling measurement of real work drifts a little; an idle node repeats itself
            noise = self.noise[node_id] = min(1.03, max(0.97, noise + self.rng.gauss(0.0, 0.004)))
        return M.NodeHeartbeat(
            node_id=node_id,
            seq=seq,
            ts=now_wall,
            layer_start=node.layer_start,
            layer_end=node.layer_end,
            cache_abi=swarm.CACHE_ABI,
            sessions_active=len(sessions),
            decode_tokens_per_second=node.decode_tps * noise,
            prefill_tokens_per_second=node.decode_tps * 10 * noise,
            neighbour_latency_ms=neighbours,
            route_failure_rate=node.failure_rate,
            status="draining" if node_id in self.draining else "ready",
            server_rtt_ms=round(node.rtt * 1000 * 1.02 + 0.1, 3),  # its flushes cross its own loop too
        )

    def _active(self, node_id: str, now: float):
        held = self._sessions.get(node_id)
        if not held:
            return []
        held[:] = [s for s in held if s[0] > now]
        return held

    async def beat_loop(self) -> None:
        while True:
            now = time.monotonic()
            wall = time.time()
            while self._due and self._due[0][0] <= now:
                _, node_id = heapq.heappop(self._due)
                if node_id in self.live and await self._beat(node_id, now, wall):
                    heapq.heappush(self._due, (now + self.interval, node_id))
            while self._soon and self._soon[0][0] <= now:
                _, changed_at, node_id = heapq.heappop(self._soon)
                last = self._sent.get(node_id)
                if node_id not in self.live or (last is not None and last >= changed_at):
                    continue  # gone, or a beat since the change told it
                if last is not None and now < last + HEARTBEAT_SOON_S:
                    heapq.heappush(self._soon, (last + HEARTBEAT_SOON_S, changed_at, node_id))
                    continue
                await self._beat(node_id, now, wall)  # the regular beats keep their own schedule
            await asyncio.sleep(TICK_S)

    async def _beat(self, node_id: str, now: float, wall: float) -> bool:
        """Send the node's heartbeat; False if that was its last (a leaving node's draining one)."""
        node = self.nodes[node_id]
        await self.nc.publish(S.node_heartbeat(node_id), M.encode(self.heartbeat(node, wall)))
        self.last_beat[node_id] = wall
        self._sent[node_id] = now
        self.stats["heartbeats"] += 1
        if self.stats["heartbeats"] % 16 == 0:
            await asyncio.sleep(0)  # pongs due now go out on time
        if node_id in self.draining:
            self._gone(node)  # a leaving node: its draining heartbeat was its last
            return False
        return True

    # -- pings and assignments ---------------------------------------------------------------

    async def _on_control(self, msg) -> None:
        node_id = msg.subject.split(".")[2]
        node = self.nodes.get(node_id)
        if node is None or node_id not in self.live or not msg.reply:
            return  # not ours, or dead: no answer
        try:
            req = M.decode(msg.data, M.ControlRequest)
        except MalformedMessage as exc:
            await msg.respond(M.encode(M.ControlError(code=Reason.BAD_CONTROL, message=str(exc))))
            return
        if not isinstance(req, M.Ping):
            await msg.respond(M.encode(M.ControlError(code=Reason.UNSUPPORTED, message="simulated node: pings only")))
            return
        self.stats["pings"] += 1
        pong = M.encode(M.Pong(node_id=node_id, sent_at=req.sent_at))
        asyncio.get_running_loop().call_later(node.rtt, lambda: asyncio.ensure_future(self._pong(msg, pong)))

    async def _pong(self, msg, data: bytes) -> None:
        try:
            await msg.respond(data)
            self.stats["pongs"] += 1
        except nats.errors.Error:
            pass

    async def _on_assignment(self, msg) -> None:
        try:
            route = M.decode(msg.data, M.RouteAssignment)
        except MalformedMessage:
            return
        self.stats["assignments"] += 1
        now = time.monotonic()
        end = now + swarm.session_seconds(route.route_id)
        ids = [h.node_id for h in route.hops]
        for i, node_id in enumerate(ids):
            neighbours = tuple({ids[i - 1], ids[(i + 1) % len(ids)]} - {node_id})
            self._sessions.setdefault(node_id, []).append((end, neighbours))
            heapq.heappush(self._soon, (now, now, node_id))  # opened: a beat says so
            heapq.heappush(self._soon, (end, end, node_id))  # and one when it ends

    async def start(self) -> None:
        self._subs = [
            await self.nc.subscribe(f"{S.ROOT}.node.*.ctl", cb=self._on_control),
            await self.nc.subscribe(f"{S.ROOT}.route.assign.>", cb=self._on_assignment),
        ]


async def run(args) -> None:
    spec = swarm.SwarmSpec(
        nodes=args.nodes, seed=args.seed, duration=args.duration, churn=swarm.Churn.parse(args.churn)
    )
    nodes = swarm.generate(spec)
    nc = await connect(args.nats, name="swarm-sim-pool", max_reconnect_attempts=-1)
    pool = Pool(nc, nodes, args.t0, args.interval)
    told_to_stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, told_to_stop.set)
    await pool.start()
    try:
        await pool.announce([n for n in nodes if n.join_at == 0])
    except (jserr.Error, nats.errors.Error) as exc:
        emit(error=f"node pool: could not announce the nodes: {exc}")
        raise SystemExit(1) from exc
    # thousands of nodes' state: full collections would stall every pong for 100 ms and more, a
    # delay no real node has; the pool lives for one simulation and never asks for one
    freeze_old_objects()
    tasks = [asyncio.create_task(pool.beat_loop()), asyncio.create_task(pool.churn_loop())]
    emit(ready=len(pool.live))
    try:
        await asyncio.wait_for(told_to_stop.wait(), args.max_seconds)
    except TimeoutError:
        pass
    await cancel_and_wait(*tasks)
    emit(stats=pool.stats)
    await nc.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nats", required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--churn", default="")
    p.add_argument("--t0", type=float, default=0.0, help="wall time of the run's start (churn times count from it)")
    p.add_argument("--interval", type=float, default=1.0, help="heartbeat interval, seconds")
    p.add_argument("--max-seconds", type=float, default=600.0, help="stop by itself after this long")
    args = p.parse_args(argv)
    if not args.t0:
        args.t0 = time.time()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
