"""Which nodes the tracker pings: a bounded sample per round, route candidates first.

A round trip measured through queues only ever comes out too long, so the tracker keeps the
least of a node's last few (registry.RTT_SAMPLES) and pings the nodes whose figure is least
settled first. A round (every ``ping_interval``) pings at most ``ping_budget`` nodes: half the
budget for route candidates (the lightest replicas of every range: the nodes routes are about to
use), half for the rest of the swarm, each half ordered by (answers so far, capped at
``settled``; then the longest since pinged), the rest of the swarm with the promising nodes first
among equals (the fastest replicas of their range, whatever their round trip: the nodes that
would be candidates if their round trip turned out short). A share one side does not use goes
to the other.
So a node that could win routes is measured within a round of joining and its figure settles
within a few, and the rest of a large swarm is measured, then re-measured, a budget at a time.

Cost per round: O(n + b log n) for n live nodes and a budget of b pings, i.e. amortised O(1)
per node per round; the pings themselves are bounded by the budget, whatever n is.
Pure: the round trips themselves go through neuron_bus/ping.py (service.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class PingSampler:
    def __init__(self, budget: int, settled: int = 4):
        self.budget = budget
        self.settled = settled
        self.pinged: dict[str, float] = {}  # node id -> when it was last pinged (answered or not)
        self.answers: dict[str, int] = {}  # node id -> pings it answered

    def _rank(self, node_id: str) -> tuple[int, float]:
        return (min(self.answers.get(node_id, 0), self.settled), self.pinged.get(node_id, float("-inf")))

    def choose(self, live: Iterable[str], candidates: Iterable[str], promising: Iterable[str] = ()) -> list[str]:
        """The nodes to ping this round (see the module docstring)."""
        live = set(live)
        cands = {c for c in candidates if c in live}
        hopeful = {p for p in promising if p in live} - cands
        b = self.budget

        def rank(node_id: str) -> tuple[int, bool, float]:
            answers, at = self._rank(node_id)
            return (answers, node_id not in hopeful, at)

        top_c = heapq.nsmallest(b, sorted(cands), key=self._rank)  # sorted: ties break on ids
        top_o = heapq.nsmallest(b, sorted(live - cands), key=rank)
        half = b // 2
        take_c = max(half, b - len(top_o))
        chosen = top_c[:take_c]
        return chosen + top_o[: b - len(chosen)]

    def pinged_at(self, node_ids: Iterable[str], now: float) -> None:
        for n in node_ids:
            self.pinged[n] = now

    def answered(self, node_id: str) -> None:
        self.answers[node_id] = self.answers.get(node_id, 0) + 1

    def forget(self, keep: Iterable[str]) -> None:
        """Drop what is known about nodes outside ``keep`` (gone from the registry)."""
        keep = set(keep)
        for table in (self.pinged, self.answers):
            for n in [n for n in table if n not in keep]:
                del table[n]
