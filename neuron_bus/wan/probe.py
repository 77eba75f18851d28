"""What the link emulator costs by itself: small NATS request/replies through a 0 ms link against
the same over a direct connection.

A responder connects directly; two requesters connect, one directly and one through an emulated
link with no delay, and take turns request by request. Each round trip through the link crosses
it twice (request up, reply down), so the emulator's own cost per crossing is half the difference
of the p50 round trips.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import msgspec

from neuron_bus.topology import connect
from neuron_bus.wan.linkem import Emulator


class Overhead(msgspec.Struct, kw_only=True):
    direct_rtt_ms_p50: float
    relayed_rtt_ms_p50: float
    overhead_ms_p50: float  # per round trip (two crossings of the link)
    overhead_per_crossing_ms_p50: float
    samples: int


async def _round_trip(nc, subject: str, body: bytes) -> float:
    t0 = time.perf_counter()
    await nc.request(subject, body, timeout=5)
    return 1000 * (time.perf_counter() - t0)


async def _measure(server_url: str, relayed_url: str, n: int, body: bytes) -> Overhead:
    responder = await connect(server_url, name="linkem-probe-responder")
    subject = "linkem.probe"

    async def answer(msg) -> None:
        await msg.respond(msg.data)

    await responder.subscribe(subject, cb=answer)
    await responder.flush()
    direct_nc = await connect(server_url, name="linkem-probe-direct")
    relayed_nc = await connect(relayed_url, name="linkem-probe-relayed")
    direct: list[float] = []
    relayed: list[float] = []
    pair = [(direct_nc, direct), (relayed_nc, relayed)]
    try:
        for nc, _ in pair * 20:  # warm-up: connections, subscription interest, code paths
            await _round_trip(nc, subject, body)
        for i in range(n):
            # Paired and alternated request by request (which goes first alternates too), so drift
            # of a shared machine -- a busy neighbour, a frequency change -- hits both alike.
            for nc, out in pair if i % 2 == 0 else pair[::-1]:
                out.append(await _round_trip(nc, subject, body))
    finally:
        await direct_nc.close()
        await relayed_nc.close()
        await responder.close()
    d, r = statistics.median(direct), statistics.median(relayed)
    return Overhead(
        direct_rtt_ms_p50=d,
        relayed_rtt_ms_p50=r,
        overhead_ms_p50=r - d,
        overhead_per_crossing_ms_p50=(r - d) / 2,
        samples=len(direct),
    )


def emulator_overhead(emulator: Emulator, server_port: int, n: int = 900) -> Overhead:
    """p50 round trips of ``n`` pairs of 128-byte request/replies to a responder on
    ``server_port``, direct and through a fresh 0 ms link of ``emulator`` (removed afterwards)."""
    name = f"probe-{server_port}-{time.monotonic_ns()}"
    port = emulator.add_link(name, server_port)
    try:
        return asyncio.run(_measure(f"nats://127.0.0.1:{server_port}", f"nats://127.0.0.1:{port}", n, b"\0" * 128))
    finally:
        emulator.remove(name)
