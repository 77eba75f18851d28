"""The tracker: node registry from heartbeats, telemetry-based route planning, coverage map.

Modules, one role each:
- params.py    tunables (expiry, straggler factor, under-provisioning thresholds...)
- view.py      NodeView: an immutable snapshot of one node for the pure functions
- layers.py    layer-range arithmetic: gaps, reachable boundaries, inclusive spelling
- speed.py     measured seconds per token, load and straggler detection
- registry.py  the node table (capability reports + heartbeats, expiry, assignments)
- index.py     the usable nodes by group and layer range, lightest first (what routes read)
- ring.py      the cheapest ring over a set of candidates (the search)
- planner.py   route planning: filters, candidates per range, the search, or reasons
- coverage.py  the coverage map and the rebalancing hint
- latency.py   which nodes to ping: a bounded sample a round, route candidates first
- offloop.py   the low-priority threads that build coverage maps and speed references
- service.py   TrackerService: the NATS subscriptions around all of the above

Each module's docstring gives the cost of its paths; docs/tracker-scale.md the measurements.

Only service.py loads NATS; ``TrackerService`` is imported on first use, so
``import neuron_bus.tracker.planner`` stays free of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from neuron_bus.tracker.params import TrackerParams

if TYPE_CHECKING:
    from neuron_bus.tracker.service import TrackerService

__all__ = ["TrackerParams", "TrackerService"]


def __getattr__(name: str):
    if name == "TrackerService":
        from neuron_bus.tracker.service import TrackerService

        return TrackerService
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
