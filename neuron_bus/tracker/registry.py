"""The node table: capability reports and heartbeats, with expiry, feeding the route index.

Liveness is judged on the tracker's clock (when a heartbeat arrived), never on the node's
timestamps. A heartbeat sent before the one the table holds (lower ``seq`` and earlier ``ts``:
delivered late) is dropped, so it cannot take a node back to an older state (ready again after
draining, fewer sessions); a restarted node counts from 1 again, but later, and a node that
expired is taken at its word whatever it sends. A heartbeat from a node whose report the tracker has not seen yet (a tracker
restart, a lost announcement) is kept, and ``needs_report`` tells the service to read the
node's report from the ``neuron-nodes`` KV bucket. The table is pure state: no NATS here.

Every change to a node that matters to routes (report, status, sessions, queue, failures,
throughput by more than 1%, neighbour latencies, round trip, assignment, expiry) refiles it in
the route index (index.py), so route requests never scan the table.

Cost, n nodes (m replicas in a node's range):
- ``apply_heartbeat``: O(1) when it changes nothing that matters (most heartbeats: the node is
  only marked alive), else O(1) plus the index's O(log m); ``apply_report``, ``record_rtt``: the
  same; ``record_assignment``: the same per hop. A node's assignments stay in its record for the
  assignment window (30 s) but count as its load only until a heartbeat a grace (1 s) later:
  after that its heartbeats are O(1) again, and the window's end refiles nothing.
- ``expire`` (before every plan and report, and every 0.25 s): O(1 + what changed): nodes are
  kept in order of their last heartbeat, so only the ones past the expiry are looked at; dead
  nodes in order of death, for forgetting; assignments in time order, for the end of their window.
- ``records`` + ``tracked`` (the coverage map's node list): O(n) cheap steps, the sort by map
  order kept between changes of the set of nodes; a node's entry is rebuilt only after it changed.
- ``views`` (rejection reasons, the placer when some node places itself, tests): O(n log n);
  ``self_placed`` (whether the placer has anything to move): O(1).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

from neuron_bus.messages import CapabilityReport, NodeHeartbeat, RouteAssignment, TrackedNode
from neuron_bus.tracker.coverage import tracked_node
from neuron_bus.tracker.index import RouteIndex
from neuron_bus.tracker.params import TrackerParams
from neuron_bus.tracker.view import NodeView


@dataclass
class _Entry:
    caps: CapabilityReport | None = None
    heartbeat: NodeHeartbeat | None = None
    last_seen: float | None = None  # tracker clock, when the last heartbeat arrived
    added: float | None = None  # tracker clock, when the report arrived (live or read from KV)
    rtt: float | None = None  # the least of the last RTT_SAMPLES round trips
    rtts: deque[float] = field(default_factory=lambda: deque(maxlen=RTT_SAMPLES))
    assigned: deque[float] = field(default_factory=deque)
    was_alive: bool = False
    shown_until: float = float("-inf")  # assignments made until then are in a heartbeat's count (its rise)
    filed: NodeHeartbeat | None = None  # the heartbeat the route index last saw
    view: NodeView | None = None  # the view filed then
    tracked: TrackedNode | None = None  # its coverage-map entry (built when asked for)


class Record:
    """What the coverage map needs of one node, copied from the table (registry.records)."""

    __slots__ = ("node_id", "view", "last_seen", "assigned", "shown_until", "tracked", "memory_pressure")

    def __init__(self, node_id, view, last_seen, assigned, shown_until, tracked, memory_pressure):
        self.node_id, self.view, self.last_seen = node_id, view, last_seen
        self.assigned, self.shown_until, self.tracked = assigned, shown_until, tracked
        self.memory_pressure = memory_pressure  # the last heartbeat's (the view keeps the one it was filed with)


RTT_SAMPLES = 4  # a round trip only ever gains from queueing on the way: the least of a few is the path's


class Registry:
    def __init__(self, params: TrackerParams = TrackerParams()):
        self.params = params
        self.index = RouteIndex(params)
        self._nodes: dict[str, _Entry] = {}
        self._heard: OrderedDict[str, None] = OrderedDict()  # alive nodes, least recently heard first
        self._silent: OrderedDict[str, float] = OrderedDict()  # dead (or never heard) nodes -> since when
        self._assignments: deque[tuple[float, str]] = deque()  # (when, node id), oldest first
        self._joined: list[str] = []
        self._expired: list[str] = []
        self._order: list[tuple[str, int, str]] | None = None  # tracked_order's, None after a change
        self._untracked: set[str] = set()  # nodes whose coverage-map entry is to be built again
        self.late_heartbeats = 0  # dropped: sent before the heartbeat already applied
        self.self_placed: set[str] = set()  # nodes that report ``placement: auto`` and a fit: the placer's

    # -- updates ------------------------------------------------------------------------------

    def apply_report(self, caps: CapabilityReport, now: float | None = None) -> None:
        entry = self._nodes.setdefault(caps.node_id, _Entry())
        entry.caps = caps
        if caps.placement == "auto" and caps.fit:
            self.self_placed.add(caps.node_id)
        else:
            self.self_placed.discard(caps.node_id)
        if entry.added is None:
            entry.added = now
            if entry.last_seen is None and now is not None:
                self._silent[caps.node_id] = now  # forgotten unless a heartbeat follows
        self._refile(caps.node_id, entry, now)

    def apply_heartbeat(self, hb: NodeHeartbeat, now: float) -> bool:
        """Whether the heartbeat told the index something new (a node's first, or a change of
        state: ``_same_state``); False for one that only keeps the node alive, or a late one."""
        node_id = hb.node_id
        entry = self._nodes.get(node_id)
        if entry is None:
            entry = self._nodes[node_id] = _Entry()
        previous = entry.heartbeat
        if entry.was_alive and previous is not None and _sent_before(hb, previous):
            self.late_heartbeats += 1
            return False
        same = entry.was_alive and _same_state(entry.filed, hb)
        if previous is not None and hb.sessions_active > previous.sessions_active:
            self._show(entry, hb.sessions_active - previous.sessions_active, now)
        entry.heartbeat = hb
        self._heard_from(node_id, entry, now)
        # Most heartbeats say nothing new to the index (liveness is read from last_seen); a node's
        # assignments move it only while they count as its load (the view filed is exact without).
        if not same or self._pending_moved(entry, now):
            self._refile(node_id, entry, now)
        return not same

    def touch(self, node_id: str, now: float) -> bool:
        """A heartbeat of the node that told another tracker nothing new (beats.py): liveness
        only, the state is the last heartbeat's here. False if this registry does not hold the
        node alive with a heartbeat: its state here may be old, and it waits for a whole one."""
        entry = self._nodes.get(node_id)
        if entry is None or entry.heartbeat is None or not entry.was_alive:
            return False
        self._heard_from(node_id, entry, now)
        if self._pending_moved(entry, now):
            self._refile(node_id, entry, now)
        return True

    def _show(self, entry: _Entry, rise: int, now: float) -> None:
        """A heartbeat reported ``rise`` more sessions than the one before: as many of the node's
        assignments still counted, oldest first, made before it arrived, are in its count from now
        on (a later heartbeat without a rise does not make them count again). O(those passed)."""
        since = self._counted_after(entry)
        for t in entry.assigned:
            if t <= since:
                continue
            if t > now or rise == 0:
                break
            entry.shown_until, rise = t, rise - 1

    def _counted_after(self, entry: _Entry | Record) -> float:
        """Assignments made until then no longer count: shown by a rise, or a heartbeat came
        ``assignment_grace`` after them."""
        last = entry.last_seen
        return entry.shown_until if last is None else max(entry.shown_until, last - self.params.assignment_grace)

    def _heard_from(self, node_id: str, entry: _Entry, now: float) -> None:
        entry.last_seen = now
        if not entry.was_alive:
            entry.was_alive = True
            self._joined.append(node_id)
            self._silent.pop(node_id, None)
        self._heard[node_id] = None
        self._heard.move_to_end(node_id)

    def _pending_moved(self, entry: _Entry, now: float) -> bool:
        """A heartbeat ended the count of some of the node's assignments (their grace passed)."""
        return bool(entry.assigned) and not self._pending_filed(entry, now)

    def record_rtt(self, node_id: str, rtt: float, now: float) -> None:
        entry = self._nodes.get(node_id)
        if entry is not None:
            entry.rtts.append(rtt)
            entry.rtt = min(entry.rtts)
            self._refile(node_id, entry, now)

    def record_assignment(self, route: RouteAssignment, now: float) -> None:
        for hop in route.hops:
            entry = self._nodes.get(hop.node_id)
            if entry is not None:
                entry.assigned.append(now)
                self._assignments.append((now, hop.node_id))
                self._refile(hop.node_id, entry, now)

    def forget_assignment(self, route: RouteAssignment, when: float, now: float) -> None:
        """Take back an assignment recorded at ``when`` that was never handed out."""
        for hop in route.hops:
            entry = self._nodes.get(hop.node_id)
            if entry is not None and when in entry.assigned:
                entry.assigned.remove(when)
                self._refile(hop.node_id, entry, now)

    def _refile(self, node_id: str, entry: _Entry, now: float | None) -> None:
        if entry.caps is None:
            return
        if now is None:
            now = entry.last_seen if entry.last_seen is not None else 0.0
        entry.filed = entry.heartbeat
        if entry.view is None or entry.view.caps is not entry.caps:
            self._order = None  # a new node, or a new report: its place in the map may move
        entry.view = self._view(node_id, entry, now)
        entry.tracked = None
        self._untracked.add(node_id)
        self.index.update(entry.view)

    # -- queries ------------------------------------------------------------------------------

    def alive(self, node_id: str, now: float) -> bool:
        entry = self._nodes.get(node_id)
        return entry is not None and entry.last_seen is not None and now - entry.last_seen <= self.params.expiry

    def last_heartbeat(self, node_id: str) -> NodeHeartbeat | None:
        """The newest heartbeat of the node applied here."""
        entry = self._nodes.get(node_id)
        return entry.heartbeat if entry is not None else None

    def needs_report(self, node_id: str) -> bool:
        """Heartbeating, but no capability report (or one the heartbeat contradicts)."""
        entry = self._nodes.get(node_id)
        return entry is not None and entry.heartbeat is not None and not _consistent(entry)

    def live_ids(self, now: float) -> list[str]:
        return sorted(n for n in self._heard if self.alive(n, now))

    def __len__(self) -> int:
        return len(self._nodes)

    def sweep(self, now: float) -> tuple[list[str], list[str]]:
        """``expire``, then (node ids that came alive, node ids that expired) since the last sweep."""
        self.expire(now)
        joined, self._joined = self._joined, []
        expired, self._expired = self._expired, []
        return sorted(joined), sorted(expired)

    def expire(self, now: float) -> None:
        """Note liveness changes; forget nodes dead for ``forget_after``; end assignment windows.
        O(1 + what changed): callers run it before reading the index, which is then exact.

        A report never followed by a heartbeat counts from when it arrived: the KV bucket keeps
        every node that ever announced itself, and a restarted tracker reads them all.
        """
        p = self.params
        expired = self._expired
        while self._heard:
            node_id = next(iter(self._heard))
            entry = self._nodes[node_id]
            last_seen = entry.last_seen
            assert last_seen is not None, "a heard node has had a heartbeat"
            if now - last_seen <= p.expiry:
                break
            del self._heard[node_id]
            entry.was_alive = False
            expired.append(node_id)
            self._silent[node_id] = last_seen
            self._refile(node_id, entry, now)
        while self._silent:
            node_id, since = next(iter(self._silent.items()))
            if now - since <= p.forget_after:
                break
            del self._silent[node_id]
            self._nodes.pop(node_id, None)
            self._untracked.discard(node_id)
            self.self_placed.discard(node_id)
            self._order = None
            self.index.discard(node_id)
        while self._assignments and now - self._assignments[0][0] > p.assignment_window:
            when, node_id = self._assignments.popleft()
            assigned = self._nodes.get(node_id)
            if assigned is not None:
                while assigned.assigned and now - assigned.assigned[0] > p.assignment_window:
                    assigned.assigned.popleft()
                if not self._pending_filed(assigned, now):  # it counted long ago, if ever: usually
                    self._refile(node_id, assigned, now)

    def records(self, model_preset: str | None = None) -> list[Record]:
        """Every node with a report, in the coverage map's order (model, first layer, id), copied
        as far as the map needs (O(n) cheap steps), for building the map in another thread while
        the table goes on changing. The order is kept between changes of the set of nodes."""
        if self._order is None:
            self._order = sorted(
                (e.view.caps.model_preset, e.view.layer_start, i) for i, e in self._nodes.items() if e.view
            )
        out = []
        for m, _, node_id in self._order:
            e = self._nodes.get(node_id)
            if e is not None and e.view is not None and (model_preset is None or m == model_preset):
                pressure = _memory_pressure(e.heartbeat)
                out.append(Record(node_id, e.view, e.last_seen, tuple(e.assigned), e.shown_until, e.tracked, pressure))
        return out

    def tracked(
        self, records: Iterable[Record], now: float, slow: Container[str], flagged: Container[str]
    ) -> list[TrackedNode]:
        """The coverage map's node entries as of ``now`` (pure: safe in another thread). Each
        entry is built once per change of its node (``build_tracked``, the sweep; here only for
        a node it has not reached yet); only the fields
        that depend on the clock, the flags, the map's stragglers (``slow``) and the last
        heartbeat's memory pressure (no reason to refile a node) are set here: O(1) a node."""
        out = []
        expiry = self.params.expiry
        for r in records:
            v = r.view
            t = r.tracked if r.tracked is not None else tracked_node(v, False)
            t.slow = r.node_id in slow
            alive = r.last_seen is not None and now - r.last_seen <= expiry
            t.alive = alive
            t.status = v.status if alive else "expired"
            t.seconds_since_heartbeat = None if r.last_seen is None else round(now - r.last_seen, 3)
            t.recently_assigned = self._pending_assignments(r, now)
            t.flagged = r.node_id in flagged
            t.memory_pressure = r.memory_pressure
            out.append(t)
        return out

    def build_tracked(self, limit: int) -> int:
        """Build the node entries of up to ``limit`` nodes that changed since their last one (the
        tracker's sweep does, a few hundred at a time): a map built in a thread or a forked child
        (forked.py) finds them, where entries a child built would die with it. O(limit); returns
        how many are left to build."""
        untracked, nodes = self._untracked, self._nodes
        while untracked and limit > 0:
            e = nodes.get(untracked.pop())
            if e is not None and e.view is not None and e.tracked is None:
                e.tracked = tracked_node(e.view, False)
                limit -= 1
        return len(untracked)

    def views(self, now: float) -> list[NodeView]:
        """A snapshot of every node with a capability report, for the planner and coverage."""
        return [self._view(i, e, now) for i, e in sorted(self._nodes.items()) if e.caps is not None]

    def _view(self, node_id: str, entry: _Entry, now: float) -> NodeView:
        hb = entry.heartbeat if _consistent(entry) else None
        caps = entry.caps
        assert caps is not None, "only a node with a capability report has a view"
        last_seen = entry.last_seen
        return NodeView(
            caps=caps,
            alive=last_seen is not None and now - last_seen <= self.params.expiry,
            status=hb.status if hb else "unknown",
            seconds_since_heartbeat=None if last_seen is None else now - last_seen,
            decode_tps=_measured(hb.decode_tokens_per_second if hb else 0.0, caps.decode_tokens_per_second),
            prefill_tps=_measured(hb.prefill_tokens_per_second if hb else 0.0, caps.prefill_tokens_per_second),
            sessions_active=hb.sessions_active if hb else 0,
            recently_assigned=self._pending_assignments(entry, now),
            queue_depth=hb.queue_depth if hb else 0,
            failure_rate=hb.route_failure_rate if hb else 0.0,
            memory_pressure=_memory_pressure(entry.heartbeat),
            rtt=_round_trip(entry.rtt, hb),
            neighbour_latency={k: v / 1000.0 for k, v in hb.neighbour_latency_ms.items()} if hb else {},
            consistent=entry.heartbeat is None or hb is not None,
        )

    def _pending_filed(self, entry: _Entry, now: float) -> bool:
        """The filed view counts the node's pending assignments as they are now: nothing to refile
        for them. O(1) without assignments made since the last heartbeat's grace started."""
        view = entry.view
        return view is not None and view.recently_assigned == self._pending_assignments(entry, now)

    def _pending_assignments(self, entry: _Entry | Record, now: float) -> int:
        """Recent assignments no heartbeat has reported yet (see TrackerParams): those made after
        the last heartbeat's grace started and after the last one a rise in sessions showed
        (``_show``). O(those counted): the assignments are in time order, newest last, and one
        that stopped counting never counts again (a node's last heartbeat only moves on)."""
        if not entry.assigned:
            return 0
        window = self.params.assignment_window
        since = self._counted_after(entry)
        count = 0
        for t in reversed(entry.assigned):
            if t <= since:
                break
            count += now - t <= window
        return count


TPS_NOISE = 0.01  # throughput changes within 1% (neighbour latencies: 10%) leave a node where it is in the index


def _sent_before(new: NodeHeartbeat, old: NodeHeartbeat) -> bool:
    """``new`` left the node before ``old`` did (both counters behind: not a restart)."""
    return new.seq < old.seq and new.ts < old.ts


def _same_state(old: NodeHeartbeat | None, new: NodeHeartbeat) -> bool:
    """Whether ``new`` tells the route index nothing ``old`` did not (liveness aside)."""
    if old is None:
        return False
    return (
        old.status == new.status
        and old.sessions_active == new.sessions_active
        and old.queue_depth == new.queue_depth
        and old.route_failure_rate == new.route_failure_rate
        and (old.layer_start, old.layer_end, old.cache_abi) == (new.layer_start, new.layer_end, new.cache_abi)
        and abs(new.decode_tokens_per_second - old.decode_tokens_per_second) <= TPS_NOISE * old.decode_tokens_per_second
        and old.neighbour_latency_ms.keys() == new.neighbour_latency_ms.keys()
        and all(_close(old.neighbour_latency_ms[k], v) for k, v in new.neighbour_latency_ms.items())
        and _close(old.server_rtt_ms, new.server_rtt_ms)
    )


def _close(old: float | None, new: float | None) -> bool:
    """Two reported latencies within 10% of each other (or both missing)."""
    if old is None or new is None:
        return old is new
    return abs(new - old) <= 0.1 * old


CLAIM_SLACK = (2.0, 0.020)  # a reported round trip r stands while the tracker's pings measure at most 2r + 20 ms


def _round_trip(measured: float | None, hb: NodeHeartbeat | None) -> float | None:
    """A node's round trip to the server (seconds), from the tracker's pings (``measured``: the
    least of the last few) and the node's own flushes (its heartbeat's ``server_rtt_ms``).

    A ping crosses the tracker's event loop and the server's queues, which only ever add to it,
    and at thousands of nodes most nodes are pinged a few times at most: at 10,000 simulated nodes
    a tenth of them measured 2-3x their true 5 ms. The node's own figure is the better reading,
    but it is a claim: it stands while the pings agree with it (less than they measure, within
    CLAIM_SLACK), and pings far above it disprove it. Before any ping, the claim."""
    reported = hb.server_rtt_ms / 1000.0 if hb is not None and hb.server_rtt_ms is not None else None
    if reported is None:
        return measured
    if measured is None:
        return reported
    factor, slack = CLAIM_SLACK
    if measured > factor * reported + slack:
        return measured  # the claim is disproved: the node is farther than it says
    return min(measured, reported)


def _consistent(entry: _Entry) -> bool:
    """The heartbeat describes the node the report describes (same range and cache ABI)."""
    caps, hb = entry.caps, entry.heartbeat
    if caps is None:
        return False
    if hb is None:
        return True
    return (hb.layer_start, hb.layer_end, hb.cache_abi) == (caps.layer_start, caps.layer_end, caps.cache_abi)


def _memory_pressure(hb: NodeHeartbeat | None) -> float:
    """The machine's, whatever range the heartbeat names (0.0: none heard yet)."""
    return hb.memory_pressure if hb is not None else 0.0


def _measured(rolling: float, benchmark: float) -> float | None:
    if rolling and rolling > 0:
        return rolling
    if benchmark and benchmark > 0:
        return benchmark
    return None
