"""The per-range index the planner and the coverage map read instead of the whole registry.

Usable nodes (alive, ready, consistent: NodeView.usable) are filed by numerics group (nodes that
may share a route) and, within a group, by layer range: a ``RangeClass`` holds the replicas of
one range, in two heaps (trusted tiers, and the rest) ordered by ring weight, the node's whole
share of a ring's cost: its expected seconds per token (speed.py: measured speed stretched by
load and failures) plus both of its half seams. Only a few replicas per range can be on the
cheapest route (the lightest ones, unless a measured neighbour latency favours another), so the
planner reads the ``k`` lightest of each range, not the group.

Cost, with m replicas in a range, c ranges in a group, k candidates per range:
- ``update`` (a heartbeat, an assignment, a round trip, an expiry): O(1) when the node's weight
  moved by 1% at most (throughput noise: most heartbeats), else O(log m) amortised: a heap entry
  is pushed and the old one left behind, stale, until it surfaces or the heap is rebuilt (when it
  holds more than twice its live entries: O(m), amortised O(1)).
- ``best`` (per range, per route request): O((k + s) log m), s the entries skipped on the way
  (stale, filtered out by the request, or stragglers).
- ``GroupIndex.speed``: the group's straggler references (speed.GroupSpeed), rebuilt in
  O(m log m) when the group changed, but never more often than it pays for: not before 20x its
  last build time has passed. Small groups (under 2 ms) are rebuilt when read; large ones by the
  tracker in a worker thread (``stale_speeds``), never inside a route request.

Pure state: no NATS; the only clock it reads times its own rebuilds (perf_counter).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from neuron_bus.routes import TRUSTED_TIERS
from neuron_bus.tracker import layers, speed
from neuron_bus.tracker.params import TrackerParams
from neuron_bus.tracker.view import NodeView, Numerics

Range = tuple[int, int]
SPEED_REBUILD_FACTOR = 20.0  # a group's speed references are rebuilt at most every 20x their build time
CHEAP_REBUILD_S = 0.002  # references that take longer to build are rebuilt in the background


def ring_weight(view: NodeView, refs: speed.References, params: TrackerParams) -> float:
    """A node's share of any ring it is on: seconds per token plus both its half seams."""
    return speed.expected_seconds_per_token(view, refs.per_layer, params) + 2 * speed.half_seam(view, params, refs.rtt)


@dataclass
class _Entry:
    view: NodeView
    version: int  # of its live heap entry
    weight: float  # its weight in the heap (the view's own may differ by up to REPUSH)
    trusted: bool


REPUSH = 0.01  # a node is re-pushed into its heap when its weight moved by more than 1%


class RangeClass:
    """The usable replicas of one layer range of one group."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end
        self.nodes: dict[str, _Entry] = {}
        self._heaps: dict[bool, list[tuple[float, str, int]]] = {True: [], False: []}  # trusted? -> heap
        self._sorted_ids: list[str] | None = None
        self._next = 0  # versions of heap entries

    def put(self, view: NodeView, weight: float) -> None:
        """File ``view`` at ``weight``; its heap entry stays if it moved by REPUSH at most (most
        heartbeats: throughput noise), so the heap order is right within that margin."""
        trusted = view.caps.trust_tier in TRUSTED_TIERS
        entry = self.nodes.get(view.node_id)
        if entry is None:
            self._sorted_ids = None
        elif entry.trusted == trusted and abs(weight - entry.weight) <= REPUSH * entry.weight:
            entry.view = view
            return
        self._next += 1
        self.nodes[view.node_id] = _Entry(view, self._next, weight, trusted)
        heap = self._heaps[trusted]
        heapq.heappush(heap, (weight, view.node_id, self._next))
        if len(heap) > 2 * len(self.nodes) + 16:
            self._rebuild()

    def drop(self, node_id: str) -> None:
        if self.nodes.pop(node_id, None) is not None:
            self._sorted_ids = None

    def _rebuild(self) -> None:
        for trusted in (True, False):
            self._heaps[trusted] = [(e.weight, i, e.version) for i, e in self.nodes.items() if e.trusted == trusted]
            heapq.heapify(self._heaps[trusted])

    def frozen(self) -> RangeClass:
        """A copy of the replicas as they are now, for a reader in another thread (no heaps)."""
        copy = RangeClass(self.start, self.end)
        copy.nodes = dict(self.nodes)
        copy._sorted_ids = self._sorted_ids
        return copy

    def sorted_ids(self) -> list[str]:
        if self._sorted_ids is None:
            self._sorted_ids = sorted(self.nodes)
        return self._sorted_ids

    def best(
        self,
        k: int,
        keep: Callable[[NodeView], bool],
        trusted_only: bool,
        slow: Callable[[NodeView], bool],
        weigh: Callable[[NodeView], float] | None = None,
    ) -> tuple[list[NodeView], list[NodeView]]:
        """(the ``k`` lightest replicas ``keep`` accepts, the ``k`` lightest of those that are not slow).

        Reads each heap from the top, dropping stale entries for good and putting the rest back;
        gives up on a heap after ``k + SKIP`` live entries. ``weigh``: a node's weight now; a node
        weighed by its group's references (no measured throughput or round trip) found heavier than
        filed (the references moved) goes back at its new weight, so the lightest are found by
        today's weights.
        """
        taken: list[tuple[list, tuple[float, str, int]]] = []
        kept: list[tuple[float, str, NodeView, bool]] = []
        for trusted in (True,) if trusted_only else (True, False):
            heap = self._heaps[trusted]
            looked = n_kept = n_fast = 0
            while heap and looked < k + SKIP and (n_kept < k or n_fast < k):
                item = heapq.heappop(heap)
                entry = self.nodes.get(item[1])
                if entry is None or entry.version != item[2]:
                    continue  # stale: superseded or dropped
                view = entry.view
                if weigh is not None and (view.decode_tps is None or view.rtt is None):  # weighed by references
                    weight = weigh(view)
                    if weight > item[0] * (1 + REPUSH):
                        self._next += 1
                        entry.version, entry.weight = self._next, weight
                        heapq.heappush(heap, (weight, item[1], self._next))
                        continue
                taken.append((heap, item))
                looked += 1
                if keep(entry.view):
                    is_slow = slow(entry.view)
                    kept.append((item[0], item[1], entry.view, is_slow))
                    n_kept += 1
                    n_fast += not is_slow
        for heap, item in taken:
            heapq.heappush(heap, item)
        kept.sort(key=lambda x: (x[0], x[1]))
        return [x[2] for x in kept[:k]], [x[2] for x in kept if not x[3]][:k]


def _anyone(view: NodeView) -> bool:
    return True


def _never(view: NodeView) -> bool:
    return False


SKIP = 32  # live entries a range may skip per request (filtered out, or stragglers) beyond its k


class GroupIndex:
    """One numerics group: its ranges, and its speed references."""

    def __init__(self, numerics: Numerics):
        self.numerics = numerics
        self.classes: dict[Range, RangeClass] = {}
        self._speed: speed.GroupSpeed | None = None
        self._speed_built = 0.0
        self._speed_cost = 0.0
        self._changed = True
        self._chainable: list[RangeClass] | None = None

    def frozen(self) -> GroupIndex:
        """A copy of the group's ranges and references as they are now (see RangeClass.frozen)."""
        copy = GroupIndex(self.numerics)
        copy.classes = {r: c.frozen() for r, c in self.classes.items()}
        copy._speed, copy._speed_cost, copy._speed_built = self._speed, self._speed_cost, self._speed_built
        copy._changed = self._speed is None
        return copy

    def chainable(self) -> list[RangeClass]:
        """The ranges that can be on a complete route at all: reached by a chain from layer 0 and
        reaching the last layer, with every range of the group (the rest never chain)."""
        if self._chainable is None:
            ranges = list(self.classes)
            n = self.numerics.n_layers_total
            starts, ends = layers.reachable_from_start(ranges), layers.reaching_end(ranges, n)
            self._chainable = [c for (a, b), c in sorted(self.classes.items()) if a in starts and b in ends]
        return self._chainable

    def ranges_changed(self) -> None:
        self._chainable = None

    def members(self) -> Iterable[NodeView]:
        for cls in self.classes.values():
            for e in cls.nodes.values():
                yield e.view

    def __len__(self) -> int:
        return sum(len(c.nodes) for c in self.classes.values())

    def touched(self) -> None:
        self._changed = True

    def adopt(self, group_speed: speed.GroupSpeed, cost: float | None = None) -> None:
        """Take references built from the members (``cost``: what building them took)."""
        self._speed, self._changed = group_speed, False
        self._speed_built = time.perf_counter()
        if cost is not None:
            self._speed_cost = cost

    def references(self) -> speed.References:
        """The references as last built (they weigh unmeasured nodes; a little staleness is fine)."""
        return self._speed.references if self._speed is not None else speed.References()

    def _stale(self, now: float) -> bool:
        return self._speed is None or (
            self._changed and now - self._speed_built >= SPEED_REBUILD_FACTOR * self._speed_cost
        )

    def speed(self) -> speed.GroupSpeed:
        """The group's straggler references: rebuilt here when the group changed and they are
        cheap to rebuild (small groups: always fresh); a large group's are rebuilt by the
        caller's background work (``RouteIndex.stale_speeds``) and read here as they are."""
        now = time.perf_counter()
        group_speed = self._speed
        if group_speed is None or (self._stale(now) and self._speed_cost <= CHEAP_REBUILD_S):
            group_speed = self._speed = speed.GroupSpeed(list(self.members()))
            self._speed_cost = time.perf_counter() - now
            self._speed_built = now
            self._changed = False
        return group_speed

    def needs_background_speed(self) -> bool:
        return self._speed_cost > CHEAP_REBUILD_S and self._stale(time.perf_counter())


class RouteIndex:
    """Every usable node, by group and range (see the module docstring)."""

    def __init__(self, params: TrackerParams = TrackerParams()):
        self.params = params
        self.groups: dict[Numerics, GroupIndex] = {}
        self._where: dict[str, tuple[Numerics, Range]] = {}

    @classmethod
    def of(cls, views: Iterable[NodeView], params: TrackerParams) -> RouteIndex:
        """An index of ``views`` (the usable ones), for one plan or report."""
        index = cls(params)
        by_group: dict[Numerics, list[NodeView]] = {}
        for v in views:
            if v.usable:
                by_group.setdefault(v.numerics, []).append(v)
        for numerics, members in by_group.items():
            group_speed = speed.GroupSpeed(members)
            for v in members:
                index._put(v, group_speed.references)
            index.groups[numerics].adopt(group_speed)
        return index

    def update(self, view: NodeView) -> None:
        """File (or refile) a node as it is now; a node that is not usable leaves the index."""
        if not view.usable:
            self.discard(view.node_id)
            return
        group = self.groups.get(view.numerics)
        self._put(view, group.references() if group is not None else speed.References())

    def _put(self, view: NodeView, refs: speed.References) -> None:
        node_id = view.node_id
        where = (view.numerics, (view.layer_start, view.layer_end))
        if self._where.get(node_id) != where:
            self.discard(node_id)
            self._where[node_id] = where
        group = self.groups.get(view.numerics)
        if group is None:
            group = self.groups[view.numerics] = GroupIndex(view.numerics)
        cls = group.classes.get(where[1])
        if cls is None:
            cls = group.classes[where[1]] = RangeClass(*where[1])
            group.ranges_changed()
        cls.put(view, ring_weight(view, refs, self.params))
        group.touched()

    def discard(self, node_id: str) -> None:
        where = self._where.pop(node_id, None)
        if where is None:
            return
        group = self.groups[where[0]]
        cls = group.classes[where[1]]
        cls.drop(node_id)
        group.touched()
        if not cls.nodes:
            del group.classes[where[1]]
            group.ranges_changed()
        if not group.classes:
            del self.groups[where[0]]

    def frozen(self) -> RouteIndex:
        """A copy of the index as it is now, for building a coverage map in another thread: O(c)
        dict copies of the ranges' replicas, no heaps."""
        copy = RouteIndex(self.params)
        copy.groups = {k: g.frozen() for k, g in self.groups.items()}
        return copy

    def view(self, node_id: str) -> NodeView | None:
        where = self._where.get(node_id)
        if where is None:
            return None
        return self.groups[where[0]].classes[where[1]].nodes[node_id].view

    def stale_speeds(self) -> list[GroupIndex]:
        """Large groups whose speed references are due for a rebuild in the background."""
        return [g for g in self.groups.values() if g.needs_background_speed()]

    def candidates(self, k: int, seams: bool = True) -> set[str]:
        """The ``k`` lightest replicas of every range that can chain, for public and for trusted
        routes: the nodes routes are about to use. ``seams`` false: by seconds per token alone
        (the nodes that would be candidates with the best round trips). O(c k log m)."""
        out: set[str] = set()
        for group in self.groups.values():
            refs = group.references()

            def weigh(v: NodeView, refs=refs) -> float:
                if seams:
                    return ring_weight(v, refs, self.params)
                return speed.expected_seconds_per_token(v, refs.per_layer, self.params)

            for cls in group.chainable():
                for trusted_only in (True, False):
                    if seams:
                        top, _ = cls.best(k, _anyone, trusted_only, _never, weigh)
                    else:
                        top = heapq.nsmallest(
                            k, (e.view for e in cls.nodes.values() if trusted_only <= e.trusted), key=weigh
                        )
                    out.update(v.node_id for v in top)
        return out

    def groups_of(self, model_preset: str | None) -> list[GroupIndex]:
        """The groups of a model (all of them for None), in numerics order."""
        return [g for numerics, g in sorted(self.groups.items()) if model_preset in (None, numerics.model_preset)]

    def __len__(self) -> int:
        return len(self._where)
