"""Admission: more generations than the swarm has free KV slots wait their turn, first come first served.

A generation whose route has no free session slot right now (``no_free_slot`` from a hop) does not
fail: it waits in its client's queue — telemetry phase ``queued`` with its position — and tries
again when another of this client's generations frees its slots, or every `RETRY_S` (other
clients free slots too). Only the head of the queue tries, so nobody overtakes; with nobody
waiting a generation tries at once, beside the others starting. With the queue
at its limit a newcomer is refused at once (``queue_full``: the gateway answers 429 with
Retry-After); a limit of 0 queues nothing (``no_free_slot`` is then the answer: 503).

One queue per `NeuronClient` (the gateway has one client for all its requests).
"""

from __future__ import annotations

import asyncio
from collections import deque

from neuron_bus.errors import RouteError
from workers.errors import Reason

DEFAULT_LIMIT = 64
RETRY_S = 1.0


class Ticket:
    """A place in the queue."""


class Admission:
    def __init__(self, limit: int = DEFAULT_LIMIT, retry_s: float = RETRY_S):
        self.limit = limit
        self.retry_s = retry_s
        self._queue: deque[Ticket] = deque()
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._queue)

    def enter(self) -> Ticket:
        """Join the queue (``queue_full`` when it is at its limit and not empty)."""
        if len(self._queue) >= self.limit:
            raise RouteError(
                Reason.QUEUE_FULL, f"{len(self._queue)} generations are already waiting for a free session slot"
            )
        ticket = Ticket()
        self._queue.append(ticket)
        return ticket

    def position(self, ticket: Ticket) -> int:
        """0 for the head of the queue."""
        return self._queue.index(ticket)

    async def changed(self, timeout: float | None = None) -> None:
        """Until the queue moves or a generation frees its slots (or ``timeout``)."""
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass

    def leave(self, ticket: Ticket) -> None:
        if ticket in self._queue:
            self._queue.remove(ticket)
            self.released()

    def released(self) -> None:
        """Slots were freed (or the queue moved): wake everyone waiting."""
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def queues(self) -> bool:
        return self.limit > 0
