"""Round trips: to a node (a `Ping` on its control subject, answered by a `Pong` naming it), and
to the connection's own server (the protocol's PING/PONG).

Used by the tracker (latency to every node it may route through, and its own to its server) and
by workers (latency to their route neighbours, and to their server). Lives outside ``tracker/``
so that a worker never loads the tracker.
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


async def server_round_trip(nc: nats.NATS, timeout: float = 1.0) -> float | None:
    """Seconds for a PING to ``nc``'s server and its PONG back, or None if none came within
    ``timeout`` (or the connection is down).

    Not ``nc.flush(timeout)``: on a timeout nats-py (2.16) cancels the flush's future but leaves it
    queued for the PONG, and the PONG that arrives later (a link that held its bytes, not one that
    dropped them) makes ``_process_pong`` set the result of a cancelled future: the
    InvalidStateError ends the client's read loop, and the connection goes on sending but never
    reads again (tests/test_ping.py shows both). Here the future is never cancelled: a late PONG
    completes it, unread; a reconnect drops it with the client's list of PONGs awaited."""
    if not nc.is_connected:
        return None
    pong = asyncio.get_running_loop().create_future()
    t0 = time.perf_counter()
    try:
        await nc._send_ping(pong)  # nats-py has no public ping without flush's cancellation
    except (nats.errors.Error, OSError, AssertionError):
        return None
    done, _ = await asyncio.wait({pong}, timeout=timeout)
    return time.perf_counter() - t0 if done else None


async def ping_many(
    nc: nats.NATS,
    node_ids: Iterable[str],
    timeout: float = 1.0,
    concurrency: int | None = None,
    stall: float | None = None,
) -> dict[str, float | None]:
    """Ping the nodes, at most ``concurrency`` at a time (all at once for None); node id -> round
    trip seconds (None: no valid answer). Few at a time keeps the answers from queueing behind
    each other in this process, which would add to every round trip measured.

    ``stall``: watch this process's event loop meanwhile (a timer every STALL_TICK); a round trip
    during which the loop stalled longer than ``stall`` (a collection, a long callback) measured
    this process, not the path: it comes back None as well."""
    ids = list(node_ids)
    gate = asyncio.Semaphore(concurrency or max(len(ids), 1))
    spans: dict[str, tuple[float, float]] = {}
    stalls: list[float] = []  # when a stall ended (perf_counter), longer than ``stall``

    async def one(node_id: str) -> float | None:
        async with gate:
            t0 = time.perf_counter()
            rtt = await ping(nc, node_id, timeout)
            spans[node_id] = (t0, time.perf_counter())
            return rtt

    async def watch(limit: float) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(STALL_TICK)
            if time.perf_counter() - t - STALL_TICK > limit:
                stalls.append(time.perf_counter())

    watcher = asyncio.create_task(watch(stall)) if stall is not None else None
    try:
        results = dict(zip(ids, await asyncio.gather(*(one(n) for n in ids))))
    finally:
        if watcher is not None:
            watcher.cancel()
    if stalls:
        for node_id, (t0, t1) in spans.items():
            if any(t0 < s <= t1 + STALL_TICK for s in stalls):
                results[node_id] = None
    return results


STALL_TICK = 0.005
