"""One round trip to a node: a `Ping` on its control subject, answered by a `Pong` naming it.

Used by the tracker (latency to every node it may route through) and by workers (latency to
their route neighbours). Lives outside ``tracker/`` so that a worker never loads the tracker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import nats
import nats.errors

from neuron_bus import messages
from neuron_bus import subjects as S
from neuron_bus.errors import MalformedMessage


async def ping(nc: nats.NATS, node_id: str, timeout: float = 1.0) -> float | None:
    """Seconds for a Ping to ``node_id`` and its Pong back, or None without a valid answer
    (no reply, a reply that is not a Pong, or a Pong from another node)."""
    t0 = time.perf_counter()
    try:
        msg = await nc.request(
            S.node_control(node_id), messages.encode(messages.Ping(sent_at=time.time())), timeout=timeout
        )
        reply = messages.decode(msg.data, messages.ControlReply)
    except (TimeoutError, nats.errors.Error, MalformedMessage):
        return None
    if not isinstance(reply, messages.Pong) or reply.node_id != node_id:
        return None
    return time.perf_counter() - t0


async def ping_many(
    nc: nats.NATS, node_ids: Iterable[str], timeout: float = 1.0, concurrency: int | None = None
) -> dict[str, float | None]:
    """Ping the nodes, at most ``concurrency`` at a time (all at once for None); node id -> round
    trip seconds (None: no valid answer). Few at a time keeps the answers from queueing behind
    each other in this process, which would add to every round trip measured."""
    ids = list(node_ids)
    gate = asyncio.Semaphore(concurrency or max(len(ids), 1))

    async def one(node_id: str) -> float | None:
        async with gate:
            return await ping(nc, node_id, timeout)

    results = await asyncio.gather(*(one(n) for n in ids))
    return dict(zip(ids, results))
