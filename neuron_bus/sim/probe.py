"""The simulator's clients: route and coverage requests on the real subjects, timed and checked.

A route request that gets no answer (its tracker died with it) is sent again once with the same
``request_id``: the tracker that answers returns the route already recorded for it, if any.
Every answer is kept with the wall time it was sent, for the checks and the quality judge.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import nats
import nats.errors

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.errors import MalformedMessage
from neuron_bus.sim import swarm

PRIVATE_SHARE = 0.1


class _ModelSummary(msgspec.Struct):
    nodes_live: list[str] = []


class _CoverageSummary(msgspec.Struct):
    """The part of a CoverageReport the probe reads (decoding all of a 7 MB map would stall the
    probe's own event loop, and the route latencies it measures with it)."""

    models: list[_ModelSummary] = []
    generated_at: float = 0.0


@dataclass
class RouteResult:
    request_id: str
    policy: M.RoutePolicy
    sent: float  # wall time of the first attempt
    latency: float | None  # seconds until an answer (None: none came)
    attempts: int
    reply: M.RouteAssignment | M.RouteRejection | None = None
    error: str | None = None
    sessions: dict[str, int] | None = None  # ground-truth sessions when it was sent (sampled requests)


@dataclass
class CoverageResult:
    sent: float
    latency: float | None
    size: int = 0
    live: int = 0
    age: float | None = None  # how old the map was when it arrived (the tracker may serve its last one)
    error: str | None = None


@dataclass
class Probe:
    nc: nats.NATS
    timeout: float = 3.0
    sessions: swarm.Sessions = field(default_factory=swarm.Sessions)
    routes: list[RouteResult] = field(default_factory=list)
    coverages: list[CoverageResult] = field(default_factory=list)
    sample_every: int = 1  # keep the ground-truth sessions of every k-th request (quality)
    rng: random.Random = field(default_factory=lambda: random.Random(11))
    # the map watchers' own connection, as an operator's CLI or a web page has: on the route
    # clients' connection the route answers would queue behind each 7 MB map
    maps_nc: nats.NATS | None = None

    async def route(self, keep: bool = True) -> RouteResult:
        policy: M.RoutePolicy = "private" if self.rng.random() < PRIVATE_SHARE else "public"
        req = M.RouteRequest(request_id=uuid.uuid4().hex, model_preset=swarm.MODEL, policy=policy)
        data = M.encode(req)
        sent_wall, t0 = time.time(), time.perf_counter()
        snapshot = self.sessions.snapshot(sent_wall) if keep and len(self.routes) % self.sample_every == 0 else None
        result = RouteResult(req.request_id, policy, sent_wall, None, 0, sessions=snapshot)
        for attempt in (1, 2):
            result.attempts = attempt
            try:
                msg = await self.nc.request(S.ROUTE_REQUEST, data, timeout=self.timeout)
            except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
                result.error = type(exc).__name__
                continue
            try:
                result.reply = M.decode(msg.data, M.RouteReply)
                result.error = None
            except MalformedMessage as exc:
                result.error = str(exc)
            result.latency = time.perf_counter() - t0
            break
        if isinstance(result.reply, M.RouteAssignment):
            self.sessions.open(result.reply.route_id, [h.node_id for h in result.reply.hops], time.time())
        if keep:
            self.routes.append(result)
        return result

    async def coverage(self) -> CoverageResult:
        sent, t0 = time.time(), time.perf_counter()
        try:
            nc = self.maps_nc or self.nc
            msg = await nc.request(S.TRACKER_COVERAGE, M.encode(M.CoverageRequest()), timeout=30)
            report = msgspec.json.decode(msg.data, type=_CoverageSummary)
        except (TimeoutError, nats.errors.Error, msgspec.DecodeError) as exc:
            result = CoverageResult(sent, None, error=f"{type(exc).__name__}: {exc}")
        else:
            live = sum(len(g.nodes_live) for g in report.models)
            age = time.time() - report.generated_at
            result = CoverageResult(sent, time.perf_counter() - t0, len(msg.data), live, age)
        self.coverages.append(result)
        return result

    async def open_loop(self, rate: float, seconds: float, coverage_rate: float = 0.0) -> None:
        """Route requests at ``rate`` per second (and coverage requests at ``coverage_rate``), each
        sent on time whatever the answers do; returns when every answer is in."""
        tasks: list[asyncio.Task[RouteResult | CoverageResult]] = []
        start = time.monotonic()
        next_cov = start
        i = 0
        while True:
            due = start + i / rate
            now = time.monotonic()
            if due - start >= seconds:
                break
            if due > now:
                await asyncio.sleep(due - now)
            tasks.append(asyncio.create_task(self.route()))
            i += 1
            if coverage_rate > 0 and time.monotonic() >= next_cov:
                tasks.append(asyncio.create_task(self.coverage()))
                next_cov += 1.0 / coverage_rate
        await asyncio.gather(*tasks)

    async def closed_loop(self, concurrency: int, seconds: float) -> tuple[int, float, list[float]]:
        """``concurrency`` clients asking for routes back to back: (answers, seconds, latencies)."""
        deadline = time.monotonic() + seconds
        latencies: list[float] = []
        answered = 0

        async def client():
            nonlocal answered
            while time.monotonic() < deadline:
                r = await self.route(keep=False)
                if r.latency is not None and r.attempts == 1:
                    answered += 1
                    latencies.append(r.latency)

        t0 = time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return answered, time.monotonic() - t0, latencies


def check_route(route: M.RouteAssignment, truth: dict[str, swarm.SimNode], policy: str) -> str | None:
    """Why ``route`` is not a complete, ordered ring of real nodes honouring ``policy`` (None: it is)."""
    at = 0
    for h in route.hops:
        node = truth.get(h.node_id)
        if node is None:
            return f"unknown node {h.node_id}"
        if (h.layer_start, h.layer_end) != (node.layer_start, node.layer_end):
            return f"{h.node_id} does not serve layers {h.layer_start}-{h.layer_end}"
        if h.layer_start != at:
            return f"hop {h.node_id} starts at {h.layer_start}, expected {at}"
        if policy != "public" and node.trust_tier == "untrusted":
            return f"untrusted {h.node_id} on a {policy} route"
        at = h.layer_end
    if at != route.n_layers_total or at != swarm.N_LAYERS:
        return f"route ends at layer {at} of {swarm.N_LAYERS}"
    if len({h.node_id for h in route.hops}) != len(route.hops):
        return "a node appears twice"
    return None
