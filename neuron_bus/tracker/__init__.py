"""The tracker: node registry from heartbeats, telemetry-based route planning, coverage map.

Modules, one role each:
- params.py    tunables (expiry, straggler factor, under-provisioning thresholds...)
- view.py      NodeView: an immutable snapshot of one node for the pure functions
- layers.py    layer-range arithmetic: gaps, reachable boundaries, inclusive spelling
- speed.py     measured seconds per token, load and straggler detection
- registry.py  the node table (capability reports + heartbeats, expiry, assignments)
- planner.py   route planning: a cheapest ring over layer boundaries, or reasons
- coverage.py  the coverage map and the rebalancing hint
- latency.py   ping round trips from the tracker to nodes (over the bus)
- service.py   TrackerService: the NATS subscriptions around all of the above
"""

from neuron_bus.tracker.params import TrackerParams
from neuron_bus.tracker.service import TrackerService

__all__ = ["TrackerParams", "TrackerService"]
