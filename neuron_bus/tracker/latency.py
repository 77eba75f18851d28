"""Which nodes the tracker pings: a bounded sample per round, route candidates first.

A round trip measured through queues only ever comes out too long, so the tracker keeps the
least of a node's last few (registry.RTT_SAMPLES) and pings the nodes whose figure is least
settled first. A round (every ``ping_interval``) pings at most ``ping_budget`` nodes: half the
budget for route candidates (the lightest replicas of every range: the nodes routes are about to
use), a quarter for the promising nodes (the fastest replicas of every range, whatever their
round trip: the nodes that would be candidates if theirs turned out short), a quarter for the
rest of the swarm; each share ordered by (answers so far, capped at ``settled``; then the
longest since pinged). What a share does not use goes to the others.
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
        rest = live - cands - hopeful
        b = self.budget
        tops = [
            heapq.nsmallest(b, sorted(group), key=self._rank) for group in (cands, hopeful, rest)
        ]  # sorted: ties on ids
        shares = [b // 2, b // 4, b - b // 2 - b // 4]
        chosen = [n for top, share in zip(tops, shares) for n in top[:share]]
        spare = b - len(chosen)  # what a share did not use goes to the others, in the same order
        taken = set(chosen)
        for top in tops:
            extra = [n for n in top if n not in taken][:spare]
            chosen += extra
            spare -= len(extra)
        return chosen

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
