"""The tracker: node registry from heartbeats, telemetry-based route planning, coverage map.

Modules, one role each:
- params.py    tunables (expiry, straggler factor, under-provisioning thresholds...)
- view.py      NodeView: an immutable snapshot of one node for the pure functions
- layers.py    layer-range arithmetic: gaps, reachable boundaries, inclusive spelling
- speed.py     measured seconds per token, load and straggler detection
- registry.py  the node table (capability reports + heartbeats, expiry, assignments)
- planner.py   route planning: a cheapest ring over layer boundaries, or reasons
- coverage.py  the coverage map and the rebalancing hint
- service.py   TrackerService: the NATS subscriptions around all of the above

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
