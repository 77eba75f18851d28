"""TrackerService: the tracker's NATS side around the registry, planner and coverage map.

Subscriptions (core NATS; route and coverage requests in the queue group ``neuron-tracker`` so
several trackers can share them, each keeping its own registry from the same heartbeats):
- ``neuron.node.*.caps``       CapabilityReport -> registry
- ``neuron.node.*.heartbeat``  NodeHeartbeat -> registry (liveness on the tracker's clock)
- ``neuron.route.request``     RouteRequest -> RouteAssignment | RouteRejection; an assignment is
  published with JetStream on ``neuron.route.assign.<route_id>`` and put in KV ``neuron-routes``
  before the reply, so it is durable when the client sees it.
- ``neuron.tracker.coverage``  CoverageRequest -> CoverageReport

A report or heartbeat whose node id is not the one its subject (or KV key) names is ignored and
counted (`spoofed`): with per-node credentials the server lets a node publish under its own id
only, so the subject is the sender's proven identity.

On start the registry is rebuilt from KV ``neuron-nodes`` (every report a node ever put) plus the
live heartbeats; a heartbeat from a node without a report triggers a KV read of its report. The
tracker does not create streams or buckets: ``neuron-bus server`` provisions them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import nats
import nats.js.errors as jserr

from neuron_bus import messages
from neuron_bus import subjects as S
from neuron_bus.errors import MalformedMessage, NeuronBusError
from neuron_bus.messages import CapabilityReport, CoverageRequest, NodeHeartbeat, RouteRejection, RouteRequest
from neuron_bus.tracker import latency
from neuron_bus.tracker.coverage import coverage_report
from neuron_bus.tracker.params import TrackerParams
from neuron_bus.tracker.planner import Rejection, plan_route, to_assignment, to_rejection
from neuron_bus.tracker.registry import Registry
from neuron_bus.trust.sampler import TrackerTrust

log = logging.getLogger("neuron_bus.tracker")

QUEUE_GROUP = "neuron-tracker"
SWEEP_INTERVAL = 0.25
REPORT_RETRY = 2.0


class TrackerError(NeuronBusError):
    """The tracker cannot run: missing buckets, no server."""


def _subject_node(subject: str) -> str | None:
    """The node a ``neuron.node.<node>.<kind>`` subject names."""
    parts = subject.split(".")
    return parts[2] if len(parts) == 4 else None


def _mono() -> float:
    return time.monotonic()


class TrackerService:
    def __init__(self, nc: nats.NATS, params: TrackerParams = TrackerParams()):
        self.nc = nc
        self.params = params
        self.registry = Registry(params)
        self._subs: list = []
        self._tasks: set[asyncio.Task] = set()
        self._fetching: set[str] = set()
        self._started_at: float | None = None
        self.trust = TrackerTrust(nc, params.audit_rate)  # replay sampling, audit flags
        self.spoofed = 0  # reports and heartbeats naming another node than their subject

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        js = self.nc.jetstream()
        try:
            self._kv_nodes = await js.key_value(S.KV_NODES)
            self._kv_routes = await js.key_value(S.KV_ROUTES)
        except (jserr.NotFoundError, jserr.BucketNotFoundError) as exc:
            raise TrackerError(
                "missing_bucket",
                f"KV buckets {S.KV_NODES}/{S.KV_ROUTES} not found ({exc}): provision the server first "
                "(neuron-bus server does)",
            ) from exc
        self._js = js
        self._started_at = _mono()
        self._subs = [
            await self.nc.subscribe(S.NODE_HEARTBEAT_ALL, cb=self._on_heartbeat),
            await self.nc.subscribe(S.NODE_ANNOUNCE_ALL, cb=self._on_report),
            await self.nc.subscribe(S.ROUTE_REQUEST, queue=QUEUE_GROUP, cb=self._on_route_request),
            await self.nc.subscribe(S.TRACKER_COVERAGE, queue=QUEUE_GROUP, cb=self._on_coverage),
        ]
        await self._load_reports()
        await self.trust.start()
        await self.nc.flush()
        self._spawn(self._sweep_loop())
        if self.params.ping_interval > 0:
            self._spawn(self._ping_loop())
        log.info("tracker started: %d node report(s) from %s", len(self.registry.views(_mono())), S.KV_NODES)

    async def stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass
        self._subs = []
        await self.trust.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- node table ---------------------------------------------------------------------------

    async def _load_reports(self) -> None:
        try:
            keys = await self._kv_nodes.keys()
        except jserr.NoKeysError:
            return
        for key in keys:
            await self._fetch_report(key)

    async def _fetch_report(self, node_id: str) -> bool:
        try:
            entry = await self._kv_nodes.get(node_id)
            caps = messages.decode(entry.value, CapabilityReport)
            if self._spoofed(caps.node_id, node_id, f"KV {S.KV_NODES}"):
                return False
            self.registry.apply_report(caps, _mono())
            return True
        except jserr.KeyNotFoundError:
            log.warning("node %s heartbeats but has no report in %s", node_id, S.KV_NODES)
        except MalformedMessage as exc:
            log.warning("bad report for %s in %s: %s", node_id, S.KV_NODES, exc)
        except (jserr.InvalidKeyError, nats.errors.Error) as exc:
            log.warning("could not read the report of %s: %s", node_id, exc)
        return False

    async def _refresh_report(self, node_id: str) -> None:
        try:
            if not await self._fetch_report(node_id):
                await asyncio.sleep(REPORT_RETRY)  # do not re-read on every heartbeat
        finally:
            self._fetching.discard(node_id)

    async def _on_report(self, msg) -> None:
        try:
            caps = messages.decode(msg.data, CapabilityReport)
        except MalformedMessage as exc:
            log.warning("ignored a report on %s: %s", msg.subject, exc)
            return
        if self._spoofed(caps.node_id, _subject_node(msg.subject), msg.subject):
            return
        self.registry.apply_report(caps, _mono())

    async def _on_heartbeat(self, msg) -> None:
        try:
            hb = messages.decode(msg.data, NodeHeartbeat)
        except MalformedMessage as exc:
            log.debug("ignored a heartbeat on %s: %s", msg.subject, exc)
            return
        if self._spoofed(hb.node_id, _subject_node(msg.subject), msg.subject):
            return
        self.registry.apply_heartbeat(hb, _mono())
        if self.registry.needs_report(hb.node_id) and hb.node_id not in self._fetching:
            self._fetching.add(hb.node_id)
            self._spawn(self._refresh_report(hb.node_id))

    def _spoofed(self, claimed: str, proven: str | None, where: str) -> bool:
        if claimed == proven:
            return False
        self.spoofed += 1
        log.warning("ignored a message on %s claiming to be node %s", where, claimed)
        return True

    async def _sweep_loop(self) -> None:
        while True:
            joined, expired = self.registry.sweep(_mono())
            for node_id in joined:
                log.info("node %s is alive", node_id)
            for node_id in expired:
                log.warning("node %s expired: no heartbeat for %.1fs", node_id, self.params.expiry)
            await asyncio.sleep(SWEEP_INTERVAL)

    async def _ping_loop(self) -> None:
        while True:
            rtts = await latency.ping_all(self.nc, self.registry.live_ids(_mono()))
            for node_id, rtt in rtts.items():
                self.registry.record_rtt(node_id, rtt)
            await asyncio.sleep(self.params.ping_interval)

    # -- requests -----------------------------------------------------------------------------

    async def route(self, req: RouteRequest) -> messages.RouteAssignment | RouteRejection:
        """Plan, publish and record a route, or say why not."""
        result = plan_route(req, self._views(), self.params)
        waited = _mono() - (self._started_at or 0.0)
        if isinstance(result, Rejection) and waited < self.params.warmup:
            await asyncio.sleep(self.params.warmup - waited)  # just (re)started: heartbeats are coming
            result = plan_route(req, self._views(), self.params)
        if isinstance(result, Rejection):
            log.info("route request %s rejected: %s", req.request_id, "; ".join(result.reasons))
            return to_rejection(result, req)
        assignment = to_assignment(result, req, uuid.uuid4().hex, time.time())
        data = messages.encode(assignment)
        try:
            await self._js.publish(S.route_assign(assignment.route_id), data)
            await self._kv_routes.put(assignment.route_id, data)
        except (nats.errors.Error, jserr.Error) as exc:
            return RouteRejection(request_id=req.request_id, reasons=[f"could not publish the route assignment: {exc}"])
        self.registry.record_assignment(assignment, _mono())
        log.info(
            "route %s for %s: %s (%.2f ms/token expected)",
            assignment.route_id,
            req.request_id,
            " -> ".join(f"{h.node_id}[{h.layer_start}-{h.layer_end - 1}]" for h in assignment.hops),
            result.seconds_per_token * 1000,
        )
        return assignment

    async def _on_route_request(self, msg) -> None:
        try:
            req = messages.decode(msg.data, RouteRequest)
        except MalformedMessage as exc:
            await msg.respond(messages.encode(RouteRejection(request_id="", reasons=[str(exc)])))
            return
        await msg.respond(messages.encode(await self.route(req)))

    def _views(self) -> list:
        """The live node views, with the audit flags set: what routes and coverage both see."""
        return self.trust.mark(self.registry.views(_mono()))

    def coverage(self, model_preset: str | None = None) -> messages.CoverageReport:
        return coverage_report(self._views(), time.time(), self.params, model_preset)

    async def _on_coverage(self, msg) -> None:
        try:
            req = messages.decode(msg.data, CoverageRequest) if msg.data else CoverageRequest()
        except MalformedMessage as exc:
            await msg.respond(messages.encode(messages.ControlError(code="bad_json", message=str(exc))))
            return
        await msg.respond(messages.encode(self.coverage(req.model_preset)))
