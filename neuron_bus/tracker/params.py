"""The tracker's tunables, with the defaults the CLI exposes."""

from __future__ import annotations

from dataclasses import dataclass

from neuron_bus.timing import NODE_EXPIRY_S


@dataclass(frozen=True)
class TrackerParams:
    # A node whose last heartbeat is older than this many seconds is dead.
    expiry: float = NODE_EXPIRY_S
    # Dead nodes are dropped from the table (and the coverage map) after this long; a report never
    # followed by a heartbeat (e.g. read from KV after a restart) this long after it was read.
    forget_after: float = 600.0
    # Seam latency assumed between two nodes when nothing was measured (seconds).
    default_hop_latency: float = 0.001
    # Seconds per layer per token assumed for a node that reported no throughput at all.
    unknown_seconds_per_layer: float = 0.01
    # A node without a measured throughput is assumed this many times slower per layer than its
    # group's reference: usable, but a measured node of reference speed is preferred.
    unmeasured_factor: float = 1.5
    # A node is slow when its seconds per token exceed this factor times its reference: the lower
    # median of what the group's measured nodes take per token for as many layers (speed.py).
    slow_factor: float = 3.0
    # Routes assigned within this window count as load on their nodes, on top of the sessions
    # their heartbeats report, until heartbeats report the sessions themselves: an assignment
    # stops counting once a heartbeat arrives ``assignment_grace`` seconds after it (a session
    # opened on it is in that heartbeat's count; a route nobody opened, e.g. a readiness probe or
    # a client that gave up, weighs no longer). Added, not the larger of the two: a node with
    # sessions would otherwise look no busier for a second of new routes, and draw them all. A
    # heartbeat whose session count rose by k shows the node's k oldest assignments still counted
    # (made before it arrived): those stop counting at once, and do not count again at the next
    # heartbeat (nodes beat as soon as a session opens, so that one is usually within the grace).
    assignment_window: float = 30.0
    assignment_grace: float = 1.0
    # Coverage: a layer with fewer live replicas than this is under-provisioned.
    min_replicas: int = 2
    # Coverage: a layer whose measured capacity (sum of decode tok/s) is below this is
    # under-provisioned.
    min_capacity_tokens_per_second: float = 2.0
    # After a (re)start, a request that cannot be routed yet waits this long for heartbeats.
    warmup: float = 1.5
    # How often the tracker pings nodes to measure round trips (0: never), and how many it pings
    # each time at most: route candidates first, then nodes never measured, then the longest unmeasured.
    ping_interval: float = 1.0
    ping_budget: int = 400
    # Replicas of each layer range the route search considers (the lightest ones, see planner.py).
    route_candidates: int = 3
    # Fraction of sessions (validation events) sent to the auditor for replay (trust/sampler.py).
    audit_rate: float = 0.1
