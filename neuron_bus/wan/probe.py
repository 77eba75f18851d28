"""What the link emulator costs by itself: small NATS request/replies through a 0 ms link against
the same over a direct connection.

A responder connects directly; a requester connects once directly and once through an emulated
link with no delay. Each round trip through the link crosses it twice (request up, reply down),
so the emulator's own cost per crossing is half the difference of the p50 round trips.
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


async def _rtts(requester_url: str, subject: str, n: int, body: bytes) -> list[float]:
    nc = await connect(requester_url, name="linkem-probe-requester")
    try:
        for _ in range(20):  # warm-up: connection, subscription interest, code paths
            await nc.request(subject, body, timeout=5)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await nc.request(subject, body, timeout=5)
            out.append(1000 * (time.perf_counter() - t0))
        return out
    finally:
        await nc.close()


async def _measure(server_url: str, relayed_url: str, n: int, rounds: int, body: bytes) -> Overhead:
    responder = await connect(server_url, name="linkem-probe-responder")
    subject = "linkem.probe"

    async def answer(msg) -> None:
        await msg.respond(msg.data)

    await responder.subscribe(subject, cb=answer)
    await responder.flush()
    direct, relayed = [], []
    try:
        for _ in range(rounds):  # alternate, so drift of a shared machine hits both alike
            direct += await _rtts(server_url, subject, n, body)
            relayed += await _rtts(relayed_url, subject, n, body)
    finally:
        await responder.close()
    d, r = statistics.median(direct), statistics.median(relayed)
    return Overhead(
        direct_rtt_ms_p50=d,
        relayed_rtt_ms_p50=r,
        overhead_ms_p50=r - d,
        overhead_per_crossing_ms_p50=(r - d) / 2,
        samples=len(direct),
    )


def emulator_overhead(emulator: Emulator, server_port: int, n: int = 300, rounds: int = 3) -> Overhead:
    """p50 round trips of 128-byte request/replies to a responder on ``server_port``, direct and
    through a fresh 0 ms link of ``emulator`` (removed afterwards)."""
    name = f"probe-{server_port}-{time.monotonic_ns()}"
    port = emulator.add_link(name, server_port)
    try:
        return asyncio.run(
            _measure(f"nats://127.0.0.1:{server_port}", f"nats://127.0.0.1:{port}", n, rounds, b"\0" * 128)
        )
    finally:
        emulator.remove(name)
