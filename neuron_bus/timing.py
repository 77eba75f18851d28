"""The bus's coupled timings, defined once.

A worker heartbeats every `HEARTBEAT_INTERVAL_S`; a client watching its route calls a node lost
after `HEARTBEAT_LOSS_S` of silence (a few missed beats, so one late beat does not fail a
session); the tracker stops routing to a node after `NODE_EXPIRY_S`, so a retry that avoids the
lost node for `AVOID_LOST_S` outlasts the tracker's view of it. An activation nobody acknowledged
is redelivered after `ACK_WAIT_S`, far beyond any of these: redelivery is a last resort, failures
are detected by heartbeats.
"""

from __future__ import annotations

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_LOSS_S = 3 * HEARTBEAT_INTERVAL_S
NODE_EXPIRY_S = 5 * HEARTBEAT_INTERVAL_S
AVOID_LOST_S = NODE_EXPIRY_S + 3.0
ACK_WAIT_S = 120.0
