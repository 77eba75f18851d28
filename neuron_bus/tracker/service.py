"""TrackerService: the tracker's NATS side around the registry, planner and coverage map.

Subscriptions (core NATS):
- ``neuron.node.*.caps``       CapabilityReport -> registry
- ``neuron.node.*.heartbeat``  NodeHeartbeat -> registry (liveness on the tracker's clock), queue
  group ``neuron-tracker``: each heartbeat reaches one tracker, which passes it on to the others
- ``neuron.tracker.heartbeats`` HeartbeatRelay: the heartbeats the other trackers took (beats.py)
- ``neuron.route.request``     RouteRequest -> RouteAssignment | RouteRejection, queue group
  ``neuron-tracker``: each request goes to one of the trackers running.
- ``neuron.tracker.coverage``  CoverageRequest -> CoverageReport, same queue group
- ``neuron.route.assign.>``    every tracker's assignments: they count as load on their nodes
  here too, so trackers sharing the requests spread them as one would.

Several trackers. Each keeps its own registry from the same heartbeats (each taken from the bus
by one of them and passed on to the others in batches: beats.py) and answers a share of the
requests. What they hand out is recorded once: an assignment is created in KV
``neuron-routes`` under a route id derived from the request id, with ``create`` (fails if the
key exists) as the arbiter, and only then published on ``neuron.route.assign.<route_id>``
(JetStream, deduplicated by route id) and answered. A request asked again (its tracker died
before answering, and the client retried with the same request id) finds the route already
recorded and gets that same route back, if its nodes are still alive and it is recent.
A route once answered needs no tracker: it is durable in KV and the stream before the client
sees it, and the hops are told by the client; a tracker that dies costs no assigned route.
Decisions that one tracker at a time must make (placement) hold the ``placement`` lease
(neuron_bus/lease.py): ``TrackerService.placement.held``.

Cost per message (n nodes, m replicas in a range, c ranges; registry.py, index.py, planner.py,
ring.py, coverage.py, latency.py for the parts):
- heartbeat: O(1) when nothing that matters changed, else O(log m); report: O(log m); each
  heartbeat is delivered to one tracker and reaches the others in a relay of many (one message);
- route request: O(c k log m + the ring search over c k candidates), independent of n beyond
  the log; several are served concurrently (the KV and stream writes overlap), each reserving
  its nodes' load before its first await so concurrent plans spread. A request that names nodes
  to avoid (its generation lost them, or they answered nonsense) is planned without them first,
  and with them only when that finds no route: at most two searches. A request no route can
  serve is explained by the pure planner over every node: O(n log n), the rejection path;
- coverage request: the map built and encoded (O(n log n + output)) in a child forked from the
  tracker (forked.py: the table as it is, nothing copied on the event loop but page tables, and
  no interpreter lock shared) from FORK_COVERAGE_AT nodes on, below that from a copy of the index
  and the node entries (O(n) cheap steps on the loop) in a low-priority thread (offloop.py); the
  node entries of nodes that changed are built by the sweep (TRACKED_PER_SWEEP at a time, O(1)
  each), so a child builds only those of nodes that changed since the last sweep; each node is
  judged slow once a map (coverage.stragglers);
  built at most every COVERAGE_REUSE times its build time, served from that copy in between, and
  from an older one (``coverage_freshness``) while the next is built;
- pings: a bounded sample per interval (latency.py), whatever n is; a large group's straggler
  references are rebuilt in a low-priority worker thread, at most every 20 times what they take.
The tracker process (``tune_process``) runs full garbage collections on a timer: at 10,000 nodes
each one stops the event loop for 100-200 ms.

A report or heartbeat whose node id is not the one its subject (or KV key) names is ignored and
counted (`spoofed`): with per-node credentials the server lets a node publish under its own id
only, so the subject is the sender's proven identity.

On start the registry is rebuilt from KV ``neuron-nodes`` (every report a node ever put) plus the
live heartbeats; a heartbeat from a node without a report triggers a KV read of its report. The
tracker does not create streams or buckets: ``neuron-bus server`` provisions them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sys
import time
import uuid
from collections import OrderedDict, deque

import nats
import nats.js.errors as jserr

from neuron_bus import messages
from neuron_bus import subjects as S
from neuron_bus.errors import MalformedMessage, NeuronBusError
from neuron_bus.gctune import collect_frozen_too, freeze_old_objects
from neuron_bus.lease import Lease, LeaseError
from neuron_bus.messages import (
    CapabilityReport,
    CoverageRequest,
    NodeHeartbeat,
    RouteAssignment,
    RouteRejection,
    RouteRequest,
    protocol_mismatch,
)
from neuron_bus.ping import ping_many, server_round_trip
from neuron_bus.tasks import Background
from neuron_bus.tracker import forked
from neuron_bus.tracker.beats import HeartbeatShare
from neuron_bus.tracker.coverage import assemble, stragglers
from neuron_bus.tracker.index import RouteIndex
from neuron_bus.tracker.latency import PingSampler
from neuron_bus.tracker.offloop import OffLoop
from neuron_bus.tracker.params import TrackerParams
from neuron_bus.tracker.placer import Placer
from neuron_bus.tracker.planner import Plan, Rejection, plan_indexed, plan_route, to_assignment, to_rejection
from neuron_bus.tracker.registry import RTT_SAMPLES, Record, Registry
from neuron_bus.tracker.speed import GroupSpeed
from neuron_bus.trust.sampler import TrackerTrust
from workers.errors import Reason

log = logging.getLogger("neuron_bus.tracker")

QUEUE_GROUP = "neuron-tracker"
SWEEP_INTERVAL = 0.25
REPORT_RETRY = 2.0
IN_FLIGHT = 64  # route requests served at once
COVERAGE_REUSE = 4.0  # a coverage report is served as is while younger than this many times its build time
COVERAGE_STALE = 20.0  # ... then at once, while a new one is built, for up to this many times more
COVERAGE_STALE_EXPIRY = 0.5  # (and at most this share of the expiry more: liveness is that uncertain anyway)
TRACKED_PER_SWEEP = 250  # coverage-map node entries built per sweep, of nodes that changed (3-7 us each)
FORK_COVERAGE_AT = 2000  # nodes in the table from which coverage maps are built in a forked child (forked.py)
FULL_GC_INTERVAL = 120.0  # seconds between full collections once tune_process ran
PLACEMENT_LEASE = "placement"
YIELD_EVERY = 32  # heartbeats handled in a row before other callbacks get a turn
PING_CONCURRENCY = 8
PING_STALL = 0.005  # a round trip during which this loop stalled longer is not a measurement
PROMISING = 8  # the fastest replicas of each range, pinged first among the rest (latency.py)
PROMISING_EVERY = 10  # rounds between two readings of them (O(n))  # pings in flight at once: answers queueing here would inflate every round trip


class TrackerError(NeuronBusError):
    """The tracker cannot run: missing buckets, no server."""


def _subject_node(subject: str) -> str | None:
    """The node a ``neuron.node.<node>.<kind>`` subject names."""
    parts = subject.split(".")
    return parts[2] if len(parts) == 4 else None


def _mono() -> float:
    return time.monotonic()


def route_id_for(request_id: str) -> str:
    """The route id a request gets, the same on every tracker (so a retried request meets its route)."""
    return hashlib.sha256(request_id.encode()).hexdigest()[:32]


class TrackerService:
    def __init__(self, nc: nats.NATS, params: TrackerParams = TrackerParams(), maps_nc: nats.NATS | None = None):
        """``maps_nc``: a second connection to serve coverage maps on. A map of 10,000 nodes is
        7 MB, and on the connection that answers routes, the answers sent after it wait until it
        is through (60-120 ms: the simulator's slow routes were the ones asked with a map)."""
        self.nc = nc
        self.maps_nc = maps_nc or nc
        self.params = params
        self.tracker_id = uuid.uuid4().hex[:12]
        self.registry = Registry(params)
        self.pings = PingSampler(params.ping_budget, settled=RTT_SAMPLES)
        self._subs: list = []
        self._background = Background()  # the loops, route answers, report refreshes
        self._fetching: set[str] = set()
        self._beats = 0
        self._full_gc_at: float | None = None  # tune_process: when the next full collection runs
        self._started_at: float | None = None
        self._ours: OrderedDict[str, float] = OrderedDict()  # route ids this tracker assigned -> when
        self._in_flight = asyncio.Semaphore(IN_FLIGHT)
        self._coverage: dict[tuple, tuple[float, float, bytes]] = {}  # request kind -> (built at, cost, report)
        self._coverage_builds: dict[tuple, asyncio.Future] = {}
        self._offloop = OffLoop()  # coverage maps and speed references, at the lowest CPU priority
        self.fork_coverage_at = FORK_COVERAGE_AT  # large maps: in a child process instead of a thread
        self.placement: Lease | None = None
        self.placer: Placer | None = None  # joining --layers auto nodes, and moves (holder of the lease only)
        self.trust = TrackerTrust(nc, params.audit_rate)  # replay sampling, audit flags
        self.spoofed = 0  # reports and heartbeats naming another node than their subject
        self.beats = HeartbeatShare(nc, self.tracker_id, self._ingest, self.registry.touch, clock=_mono)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        js = self.nc.jetstream()
        try:
            self._kv_nodes = await js.key_value(S.KV_NODES)
            self._kv_routes = await js.key_value(S.KV_ROUTES)
        except (jserr.NotFoundError, jserr.BucketNotFoundError) as exc:
            raise TrackerError(
                Reason.MISSING_BUCKET,
                f"KV buckets {S.KV_NODES}/{S.KV_ROUTES} not found ({exc}): provision the server first "
                "(neuron-bus server does)",
            ) from exc
        self._js = js
        self._started_at = _mono()
        self._subs = [
            await self.nc.subscribe(S.TRACKER_HEARTBEATS, cb=self.beats.on_relay),
            await self.nc.subscribe(S.NODE_HEARTBEAT_ALL, queue=QUEUE_GROUP, cb=self._on_heartbeat),
            await self.nc.subscribe(S.NODE_ANNOUNCE_ALL, cb=self._on_report),
            await self.nc.subscribe(S.ROUTE_ASSIGN_ALL, cb=self._on_assignment),
            await self.nc.subscribe(S.ROUTE_REQUEST, queue=QUEUE_GROUP, cb=self._on_route_request),
            await self.maps_nc.subscribe(S.TRACKER_COVERAGE, queue=QUEUE_GROUP, cb=self._on_coverage),
        ]
        await self._load_reports()
        await self.trust.start()
        await self.nc.flush()
        self._background.spawn(self._sweep_loop())
        self._background.spawn(self.beats.run())
        if self.params.ping_interval > 0:
            self._background.spawn(self._ping_loop())
        self.placement = Lease(js, S.KV_LEASES, PLACEMENT_LEASE, holder=f"tracker-{self.tracker_id}")
        try:
            await self.placement.start()
            self.placer = Placer(
                self.nc,
                self._views,
                self.tracker_id,
                self.placement,
                self_placed=lambda: bool(self.registry.self_placed),
            )
            await self.placer.start()
        except (LeaseError, jserr.NotFoundError, jserr.BucketNotFoundError) as exc:
            log.warning("no placement (%s): this tracker never makes placement decisions", exc)
            self.placement = self.placer = None
        log.info("tracker %s started: %d node report(s) from %s", self.tracker_id, len(self.registry), S.KV_NODES)

    async def stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass
        self._subs = []
        await self.beats.hand_over()
        if self.placer is not None:
            await self.placer.stop()
        if self.placement is not None:
            await self.placement.stop()
        await self.trust.stop()
        await self._background.cancel_all()
        self._offloop.shutdown()

    def tune_process(self) -> None:
        """For a tracker process (the CLI calls it): what is alive now (modules, the table read
        from KV) is frozen out of full collections (gctune.py), which run from the sweep loop every
        FULL_GC_INTERVAL instead of whenever survivors pile up; each forked map build freezes
        what is alive then, and those full collections take in the frozen objects too."""
        freeze_old_objects()
        self._full_gc_at = _mono() + FULL_GC_INTERVAL
        # coverage maps and straggler references are built in a worker thread: the event loop
        # gets the interpreter back within a millisecond (the default is 5 ms a handover)
        sys.setswitchinterval(0.001)

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
        self._beats += 1
        if self._beats % YIELD_EVERY == 0:
            await asyncio.sleep(0)  # a burst of heartbeats does not hold up requests and pongs
        try:
            hb = messages.decode(msg.data, NodeHeartbeat)
        except MalformedMessage as exc:
            log.debug("ignored a heartbeat on %s: %s", msg.subject, exc)
            return
        if self._spoofed(hb.node_id, _subject_node(msg.subject), msg.subject):
            return
        new = self._ingest(hb)
        await self.beats.take(hb, new, len(msg.data))

    def _ingest(self, hb: NodeHeartbeat) -> bool:
        """A heartbeat this tracker took, or one another tracker took and passed on whole:
        whether it told the registry something new."""
        new = self.registry.apply_heartbeat(hb, _mono())
        if self.registry.needs_report(hb.node_id) and hb.node_id not in self._fetching:
            self._fetching.add(hb.node_id)
            self._background.spawn(self._refresh_report(hb.node_id))
        return new

    def _spoofed(self, claimed: str, proven: str | None, where: str) -> bool:
        if claimed == proven:
            return False
        self.spoofed += 1
        log.warning("ignored a message on %s claiming to be node %s", where, claimed)
        return True

    async def _on_assignment(self, msg) -> None:
        """Another tracker's assignment (our own come back too: already recorded)."""
        route_id = msg.subject.rsplit(".", 1)[-1]
        if route_id in self._ours:
            return
        try:
            route = messages.decode(msg.data, RouteAssignment)
        except MalformedMessage as exc:
            log.debug("ignored an assignment on %s: %s", msg.subject, exc)
            return
        self.registry.record_assignment(route, _mono())

    async def _sweep_loop(self) -> None:
        while True:
            now = _mono()
            joined, expired = self.registry.sweep(now)
            self.registry.build_tracked(TRACKED_PER_SWEEP)  # for maps built in forked children
            for node_id in joined:
                log.info("node %s is alive", node_id)
            for node_id in expired:
                log.warning("node %s expired: no heartbeat for %.1fs", node_id, self.params.expiry)
            while self._ours and now - next(iter(self._ours.values())) > self.params.assignment_window:
                self._ours.popitem(last=False)
            if self._full_gc_at is not None and now >= self._full_gc_at:
                collect_frozen_too()  # the forks froze what was alive then
                self._full_gc_at = now + FULL_GC_INTERVAL
            for group in self.registry.index.stale_speeds():  # large groups: rebuilt off the event loop
                members, t0 = list(group.members()), _mono()
                group.adopt(await self._offloop.run(GroupSpeed, members), cost=_mono() - t0)
            await asyncio.sleep(SWEEP_INTERVAL)

    async def _ping_loop(self) -> None:
        """Ping a sample of nodes every interval (latency.py). A node's round trip is counted from
        the server: the tracker's own round trip to it (a PING, the least of the last few) is
        taken off, as the seams between two nodes never cross the tracker."""
        own: deque[float] = deque(maxlen=16)
        rounds, promising = 0, set()
        while True:
            rtt = await server_round_trip(self.nc, timeout=1)  # not flush: see ping.py
            if rtt is not None:
                own.append(rtt)
            base = min(own, default=0.0)
            now = _mono()
            index = self.registry.index
            if rounds % PROMISING_EVERY == 0:
                promising = index.candidates(PROMISING, seams=False)
            rounds += 1
            chosen = self.pings.choose(
                self.registry.live_ids(now), index.candidates(self.params.route_candidates), promising
            )
            self.pings.pinged_at(chosen, now)
            rtts = await ping_many(self.nc, chosen, concurrency=PING_CONCURRENCY, stall=PING_STALL)
            for node_id, rtt in rtts.items():
                if rtt is not None:  # no answer: the last measurement stands
                    self.registry.record_rtt(node_id, max(rtt - base, 0.0), _mono())
                    self.pings.answered(node_id)
            if len(self.pings.pinged) > 2 * len(self.registry) + 64:
                self.pings.forget(self.registry.live_ids(_mono()))
            await asyncio.sleep(self.params.ping_interval)

    # -- requests -----------------------------------------------------------------------------

    def _plan(self, req: RouteRequest) -> Plan | Rejection:
        now = _mono()
        flagged = self.trust.flagged
        registry = self.registry
        registry.expire(now)

        def keep(v) -> bool:
            return v.node_id not in flagged and registry.alive(v.node_id, now)

        if req.avoid:  # around them while the others cover the model; through them only if nothing else does
            avoid = set(req.avoid)
            plan = plan_indexed(req, registry.index, self.params, lambda v: v.node_id not in avoid and keep(v))
            if plan is not None:
                return plan
        plan = plan_indexed(req, registry.index, self.params, keep)
        if plan is not None:
            return plan
        return plan_route(req, self._views(), self.params)  # every reason, from every node

    async def route(self, req: RouteRequest) -> RouteAssignment | RouteRejection:
        """Plan, record, publish and hand out a route, or say why not."""
        if why := protocol_mismatch(f"tracker {self.tracker_id}", "this request", req.protocol):
            return RouteRejection(request_id=req.request_id, reasons=[why], code=Reason.PROTOCOL.value)
        result = self._plan(req)
        waited = _mono() - (self._started_at or 0.0)
        if isinstance(result, Rejection) and waited < self.params.warmup:
            await asyncio.sleep(self.params.warmup - waited)  # just (re)started: heartbeats are coming
            result = self._plan(req)
        if isinstance(result, Rejection):
            log.info("route request %s rejected: %s", req.request_id, "; ".join(result.reasons))
            return to_rejection(result, req)
        assignment = to_assignment(result, req, route_id_for(req.request_id), time.time())
        when = _mono()
        self.registry.record_assignment(assignment, when)  # before any await: concurrent plans see the load
        try:
            handed = await self._record(assignment, req, result, when)
        except (nats.errors.Error, jserr.Error) as exc:
            self.registry.forget_assignment(assignment, when, _mono())
            return RouteRejection(
                request_id=req.request_id,
                reasons=[
                    f"tracker {self.tracker_id}: the bus did not take the route assignment "
                    f"(KV {S.KV_ROUTES}, stream {S.STREAM_ROUTES}): {type(exc).__name__} {exc}".rstrip()
                ],
                code=Reason.NATS.value,
            )
        if handed.created_at != assignment.created_at:
            self.registry.forget_assignment(assignment, when, _mono())
            log.info("route request %s asked again: route %s as recorded", req.request_id, handed.route_id)
            return handed
        log.info(
            "route %s for %s: %s (%.2f ms/token expected)",
            handed.route_id,
            req.request_id,
            " -> ".join(f"{h.node_id}[{h.layer_start}-{h.layer_end - 1}]" for h in handed.hops),
            result.seconds_per_token * 1000,
        )
        return handed

    async def _record(self, assignment: RouteAssignment, req: RouteRequest, plan: Plan, when: float) -> RouteAssignment:
        """Create the assignment in KV (the arbiter), then publish it. Returns what to hand out:
        this assignment, or the one already recorded for the same request."""
        data = messages.encode(assignment)
        try:
            await self._kv_routes.create(assignment.route_id, data)
        except jserr.KeyWrongLastSequenceError:
            existing = await self._recorded(assignment.route_id, req)
            if existing is not None:
                return existing
            # the id is taken by an older or different request with the same id: a fresh id
            assignment = to_assignment(plan, req, uuid.uuid4().hex, assignment.created_at)
            data = messages.encode(assignment)
            await self._kv_routes.create(assignment.route_id, data)
        self._ours[assignment.route_id] = when  # before the publish: its echo must not count twice
        await self._js.publish(
            S.route_assign(assignment.route_id), data, headers={"Nats-Msg-Id": assignment.route_id}, timeout=5.0
        )
        return assignment

    async def _recorded(self, route_id: str, req: RouteRequest) -> RouteAssignment | None:
        """The route recorded under ``route_id`` if it answers ``req`` and can still be used."""
        try:
            entry = await self._kv_routes.get(route_id)
            route = messages.decode(entry.value, RouteAssignment)
        except (jserr.KeyNotFoundError, MalformedMessage):
            return None
        now = _mono()
        fits = (
            route.model_preset == req.model_preset
            and route.policy == req.policy
            and route.wire_dtype == req.wire_dtype
            and route.encoding == req.encoding
            and time.time() - route.created_at <= self.params.assignment_window
            and all(self.registry.alive(h.node_id, now) for h in route.hops)
        )
        return route if fits else None

    async def _on_route_request(self, msg) -> None:
        await self._in_flight.acquire()  # beyond IN_FLIGHT, requests wait in the subscription
        self._background.spawn(self._answer_route(msg))

    async def _answer_route(self, msg) -> None:
        try:
            try:
                req = messages.decode(msg.data, RouteRequest)
            except MalformedMessage as exc:
                rejection = RouteRejection(request_id="", reasons=[str(exc)], code=Reason.BAD_JSON.value)
                await msg.respond(messages.encode(rejection))
                return
            await msg.respond(messages.encode(await self.route(req)))
        except nats.errors.Error as exc:
            log.warning("could not answer a route request: %s", exc)
        finally:
            self._in_flight.release()

    def _views(self) -> list:
        """Every node's view, with the audit flags set: what rejection reasons see."""
        return self.trust.mark(self.registry.views(_mono()))

    async def coverage(self, req: CoverageRequest = CoverageRequest()) -> bytes:
        """The encoded coverage map for ``req``, built and encoded in a forked child (a large
        swarm) or in a worker thread from a copy taken here (a small one), meanwhile route
        requests and heartbeats go on; one build at a time per kind of request.
        The last map is served as is while younger than COVERAGE_REUSE times its build time, then
        at once while a new one is built (``coverage_freshness``) for COVERAGE_STALE times its
        build time more, at most COVERAGE_STALE_EXPIRY of the expiry more: a large swarm's map
        (a build of 0.2-0.5 s at 10,000 nodes) is then not waited for by a client asking every
        few seconds, and is about as old as that client's last request; a small swarm's map
        (a few ms) is fresh."""
        key = (req.model_preset, req.nodes, req.replicas)
        cached = self._coverage.get(key)
        freshness = "build" if cached is None else coverage_freshness(_mono() - cached[0], cached[1], self.params)
        if cached is not None and freshness == "fresh":
            return cached[2]
        pending = self._coverage_builds.get(key)
        if pending is None:
            pending = self._coverage_builds[key] = self._background.spawn(
                self._build_coverage(req, key), name="coverage"
            )
            pending.add_done_callback(lambda f: self._coverage_built(key, f))
        if cached is not None and freshness == "stale":
            return cached[2]
        return await asyncio.shield(pending)

    def _coverage_built(self, key: tuple, build: asyncio.Future) -> None:
        self._coverage_builds.pop(key, None)
        if not build.cancelled() and build.exception() is not None:  # also when nobody waited for it
            log.warning("tracker: building the coverage map failed: %r", build.exception())

    async def _build_coverage(self, req: CoverageRequest, key: tuple) -> bytes:
        t0 = _mono()
        registry, flagged, params = self.registry, self.trust.flagged, self.params
        registry.expire(t0)
        placements = list(self.placer.decisions) if self.placer is not None else []

        def build(index: RouteIndex, records: list[Record]) -> bytes:
            expiry = params.expiry
            slow = stragglers(index, [r.view for r in records], params)
            nodes = registry.tracked(records, t0, slow, flagged) if req.nodes else []
            everyone = [(r.view, r.last_seen is not None and t0 - r.last_seen <= expiry) for r in records]
            report = assemble(
                index, everyone, slow, lambda: nodes, time.time(), params, req.model_preset, req.nodes, req.replicas
            )
            report.placements = placements
            return messages.encode(report)

        if len(registry) >= self.fork_coverage_at and forked.available():
            # the table as it is now, in a child: nothing copied here, no lock shared (forked.py)
            data = await forked.run(
                lambda: build(registry.index, registry.records(req.model_preset)),
                freeze=self._full_gc_at is not None,  # a tracker process: its sweep collects what was frozen
            )
        else:
            index, records = registry.index.frozen(), registry.records(req.model_preset)
            data = await self._offloop.run(build, index, records)
        self._coverage[key] = (t0, _mono() - t0, data)
        return data

    async def _on_coverage(self, msg) -> None:
        try:
            req = messages.decode(msg.data, CoverageRequest) if msg.data else CoverageRequest()
        except MalformedMessage as exc:
            await msg.respond(messages.encode(messages.ControlError(code=Reason.BAD_JSON, message=str(exc))))
            return
        data = await self.coverage(req)
        limit = self.maps_nc.max_payload
        if len(data) > limit:
            data = messages.encode(
                messages.ControlError(
                    code="too_large",
                    message=f"tracker: the coverage map is {len(data)} bytes, over the server's max payload of {limit}:"
                    " ask for one model, or without the node list or replica ids (CoverageRequest nodes/replicas false)",
                )
            )
        await msg.respond(data)


def coverage_freshness(age: float, cost: float, params: TrackerParams) -> str:
    """How a coverage map ``age`` seconds old that took ``cost`` seconds to build is served:
    ``fresh`` (as is), ``stale`` (at once, while a new one is built) or ``build`` (after a new
    one is built)."""
    reuse = COVERAGE_REUSE * cost
    if age <= reuse:
        return "fresh"
    if age <= reuse + min(COVERAGE_STALE * cost, COVERAGE_STALE_EXPIRY * params.expiry):
        return "stale"
    return "build"
