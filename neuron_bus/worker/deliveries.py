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

import asyncio

SETTLE_S = (
    5.0  # the longest a close waits for them (a delivery stops waiting on a full next hop once its session is gone)
)


class Deliveries:
    def __init__(self) -> None:
        self._last: dict[str, asyncio.Task] = {}  # session -> its latest delivery not finished yet

    def latest(self, session_id: str) -> asyncio.Task | None:
        return self._last.get(session_id)

    def record(self, session_id: str, task: asyncio.Task) -> None:
        self._last[session_id] = task
        task.add_done_callback(lambda t: self._last.pop(session_id) if self._last.get(session_id) is t else None)

    async def settled(self, session_id: str, timeout: float = SETTLE_S) -> None:
        """Until the session's deliveries have finished (or ``timeout``)."""
        task = self._last.get(session_id)
        if task is not None:
            await asyncio.wait([task], timeout=timeout)
