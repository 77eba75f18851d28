"""Which nodes the tracker pings: a bounded sample per round, route candidates first.

A round (every ``ping_interval``) pings at most ``ping_budget`` nodes, in this order:
1. route candidates never measured (the planner would route through them on a guessed seam),
2. other nodes never measured (by node id),
3. then, alternately, the candidates and the other nodes measured longest ago.
So a new node that could win routes is measured within a round, the candidates stay fresh, and
the rest of a large swarm is re-measured a budget at a time.

Cost per round: O(n + b log n) for n live nodes and a budget of b pings, i.e. amortised O(1)
per node per round; the pings themselves are bounded by the budget, whatever n is.
Pure: the round trips themselves go through neuron_bus/ping.py (service.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from itertools import chain, zip_longest


class PingSampler:
    def __init__(self, budget: int):
        self.budget = budget
        self.pinged: dict[str, float] = {}  # node id -> when it was last pinged (answered or not)

    def choose(self, live: Iterable[str], candidates: Iterable[str]) -> list[str]:
        """The nodes to ping this round (see the module docstring)."""
        live = set(live)
        cands = [c for c in dict.fromkeys(candidates) if c in live]
        cand_set = set(cands)
        others = [n for n in live if n not in cand_set]
        b = self.budget
        fresh_c = [c for c in cands if c not in self.pinged]
        fresh_o = sorted(n for n in others if n not in self.pinged)[:b]  # sorted: deterministic
        old_c = heapq.nsmallest(b, (c for c in cands if c in self.pinged), key=self.pinged.__getitem__)
        old_o = heapq.nsmallest(b, (n for n in others if n in self.pinged), key=self.pinged.__getitem__)
        alternate = (x for pair in zip_longest(old_c, old_o) for x in pair if x is not None)
        return list(chain(fresh_c, fresh_o, alternate))[:b]

    def pinged_at(self, node_ids: Iterable[str], now: float) -> None:
        for n in node_ids:
            self.pinged[n] = now

    def forget(self, keep: Iterable[str]) -> None:
        """Drop what is known about nodes outside ``keep`` (gone from the registry)."""
        keep = set(keep)
        for n in [n for n in self.pinged if n not in keep]:
            del self.pinged[n]
