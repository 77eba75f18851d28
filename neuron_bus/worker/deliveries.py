"""A hop's output deliveries in flight, per session: the outbox starts them and they finish
beside the processing loop (a publish's acknowledgement, then the input's ack); each waits for
its session's one before it, so the latest stands for all.

A hop's last session of a route to close waits for them before the route's consumers are deleted:
an input still unacknowledged when its consumer goes stays in the work-queue stream and is
delivered to the route's next binding, a step of a session nobody holds (the tail of a finished
generation acknowledges its last input after the token's publish, the validation event and the
telemetry, while the client may already have closed the session). That last input is acknowledged
with ``ack_sync`` (outbox.py): a plain ack may still wait in the server's queue when the
consumer's deletion is processed.
"""

from __future__ import annotations

from neuron_bus.tasks import InOrder

SETTLE_S = (
    5.0  # the longest a close waits for them (a delivery stops waiting on a full next hop once its session is gone)
)


class Deliveries(InOrder):
    """``spawn(session_id, delivery)``: after the session's previous delivery."""

    async def settled(self, key, timeout: float | None = SETTLE_S) -> None:
        await super().settled(key, timeout)
