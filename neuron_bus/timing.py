"""The bus's coupled timings, defined once.

A worker heartbeats every `HEARTBEAT_INTERVAL_S`; a client watching its route calls a node lost
after `heartbeat_loss_s(rtt)` of silence: `HEARTBEAT_LOSS_S` (a few missed beats, so one late beat
does not fail a session) plus four of its measured round trips to that node (a WAN link's delay
and jitter delay beats too); the tracker stops routing to a node after `NODE_EXPIRY_S`, so a retry that avoids the
lost node for `AVOID_LOST_S` outlasts the tracker's view of it.

An activation the server delivered and nobody acknowledged is redelivered after `ACK_WAIT_S`: a
delivery lost on its way (the connection or the route it crossed died with a server, mid-write)
comes again within that, not after a generation's stall timeout. A worker that still holds an
input (queued behind other work, its output waiting on a full next hop) tells the server so every
`KEEP_ALIVE_S`, for at most `MAX_HOLD_S`, so a slow input is not sent twice. Failures of nodes are
detected by heartbeats, not by redelivery.
"""

from __future__ import annotations

HEARTBEAT_INTERVAL_S = 1.0
# A node whose sessions opened or closed heartbeats at once, no sooner than this after its last
# beat: the tracker routes on the load it heard of, and a session that ended a second ago would
# keep the node looking busy for that second (the swarm simulator's judge measured it: routes
# 1.1-1.2x the optimum under load, 1.0x once the tracker knew what the nodes knew).
HEARTBEAT_SOON_S = 0.1
HEARTBEAT_LOSS_S = 3 * HEARTBEAT_INTERVAL_S
LOSS_RTT_FACTOR = 4.0  # over a slow link, beats arrive later and less evenly: room for four round trips
NODE_EXPIRY_S = 5 * HEARTBEAT_INTERVAL_S
AVOID_LOST_S = NODE_EXPIRY_S + 3.0
ACK_WAIT_S = 10.0
KEEP_ALIVE_S = ACK_WAIT_S / 4  # an input held longer than this is reported in progress, every this long
# A busy hop takes its sessions' inputs oldest first, so a session may wait its turn behind every
# other session's prompt there, with nothing to show for it: for at most BUSY_WAIT_S, both as a
# client watching its quiet route (generation.py's stall rule) and as a publish into a full next
# hop (flow.py; the publisher stops waiting as soon as the session ends).
BUSY_WAIT_S = 600.0
PUBLISH_WAIT_S = 120.0  # a publish that no stream answers is retried this long (flow.py)
MAX_HOLD_S = BUSY_WAIT_S + 60.0  # held longer, an input is left to redelivery


def heartbeat_loss_s(rtt_s: float | None = None) -> float:
    """Silence after which a route's node is lost, for a node ``rtt_s`` away (measured by the client:
    its session open's round trip): 3 s on a LAN, 3.4 s over a 50 ms link, 3.8 s over 100 ms."""
    return HEARTBEAT_LOSS_S + LOSS_RTT_FACTOR * (rtt_s or 0.0)
