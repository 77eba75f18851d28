"""The inputs a worker holds: delivered by its consumers, not yet settled.

The server redelivers an input nobody acknowledged after the consumers' ack wait (timing.py:
`ACK_WAIT_S`, a few seconds), so a delivery lost on its way (the connection or the cluster route it
crossed died with a server, mid-write) comes again soon, instead of after a generation's stall
timeout. An input the worker does hold may be held longer than that: queued behind other sessions'
work, or its output waiting on a full next hop. For those, `Holds.keep_alive` tells the server
"in progress" every `KEEP_ALIVE_S` (the server starts its ack wait again), so they are not sent
twice; an input held past `MAX_HOLD_S` is left to redelivery, as is one the worker lets go (an
output it could not send: the input comes again after the ack wait).

An input is settled by acknowledging it, terminating it or letting it go, through its `Held`
handle (the engine's `Incoming.handle`); settling removes it from the holds.
"""

from __future__ import annotations

import asyncio
import logging
import time

from neuron_bus.timing import KEEP_ALIVE_S, MAX_HOLD_S

log = logging.getLogger("neuron_bus.worker")


class Held:
    """One delivered input, until it is settled. ``msg``: the transport's message."""

    __slots__ = ("msg", "since", "_holds")

    def __init__(self, msg, holds: Holds):
        self.msg = msg
        self.since = time.monotonic()
        self._holds = holds

    async def ack(self) -> None:
        self._holds.settled(self)
        await self.msg.ack()

    async def ack_sync(self) -> None:
        """Acknowledge and wait until the server has processed it."""
        self._holds.settled(self)
        await self.msg.ack_sync()

    async def term(self) -> None:
        """Never to be delivered again."""
        self._holds.settled(self)
        await self.msg.term()

    @property
    def redelivered(self) -> bool:
        """Delivered before: a copy the server sent again after its ack wait."""
        try:
            return self.msg.metadata.num_delivered > 1
        except Exception:  # not a JetStream delivery
            return False

    def let_go(self) -> None:
        """Leave it unacknowledged, no longer kept alive: the server delivers it again after its ack wait."""
        self._holds.settled(self)


class Holds:
    def __init__(self, keep_alive_s: float = KEEP_ALIVE_S, max_hold_s: float = MAX_HOLD_S):
        self.keep_alive_s = keep_alive_s
        self.max_hold_s = max_hold_s
        self._held: dict[Held, None] = {}  # in the order delivered: the oldest first

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, msg) -> Held:
        h = Held(msg, self)
        self._held[h] = None
        return h

    def settled(self, h: Held) -> None:
        self._held.pop(h, None)

    async def keep_alive(self) -> None:
        """Forever: every ``keep_alive_s``, report in progress each input held longer than that."""
        while True:
            await asyncio.sleep(self.keep_alive_s)
            try:
                await self.touch(time.monotonic())
            except Exception:  # never let one round end the loop
                log.exception("keeping held inputs alive failed")

    async def touch(self, now: float) -> int:
        """Report in progress the inputs held ``keep_alive_s`` or longer; let go those held past
        ``max_hold_s``. Returns how many were reported."""
        reported = 0
        for h in list(self._held):
            age = now - h.since
            if age < self.keep_alive_s:
                break  # the rest came later
            if age > self.max_hold_s:
                h.let_go()
                continue
            try:
                await h.msg.in_progress()
                reported += 1
            except Exception as exc:  # the connection is closing: the server redelivers it after the ack wait
                log.debug("in-progress report failed: %s", exc)
                return reported
        return reported
