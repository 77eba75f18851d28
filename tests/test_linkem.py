"""The link emulator's fidelity: delay per direction within a tolerance of its setting, byte order
kept under jitter, the bandwidth cap respected, partitions that block and then resume (hold) or
cut and then accept again; its own cost over NATS at 0 ms; the same API in a child process."""

from __future__ import annotations

import asyncio
import statistics
import struct
import time

import pytest

from neuron_bus.wan.linkem import AddLink, EmulatorProcess, LinkEmulator, Partition, SetLink, Shape, Stats
from neuron_bus.wan.probe import emulator_overhead

pytestmark = pytest.mark.timeout(120)

STAMP = struct.Struct("<Id")  # sequence number, perf_counter at sending
TOLERANCE_MS = 2.0  # a chunk may leave up to the event loop's timer resolution late
LATE_MS = 5.0  # ... and, on a shared 2-core machine, a scheduling delay of the relay's process


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1]


class Sink:
    """A TCP server recording every STAMP it reads: (seq, sent, arrived); it echoes what it reads."""

    def __init__(self):
        self.got: list[tuple[int, float, float]] = []
        self.arrived = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await reader.readexactly(STAMP.size)
                seq, sent = STAMP.unpack(data)
                self.got.append((seq, sent, time.perf_counter()))
                self.arrived.set()
                writer.write(STAMP.pack(seq, time.perf_counter()))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def close(self) -> None:
        self.server.close()


async def link_to(em: LinkEmulator, sink_port: int, **shapes) -> int:
    reply = await em.apply(AddLink(name=f"l{len(em.links)}", target_port=sink_port, **shapes))
    assert reply.ok, reply.error
    return reply.port


async def send_stamps(writer: asyncio.StreamWriter, n: int, gap_s: float, first: int = 0) -> None:
    for i in range(first, first + n):
        writer.write(STAMP.pack(i, time.perf_counter()))
        await writer.drain()
        await asyncio.sleep(gap_s)


async def test_delay_each_direction_within_tolerance():
    em, sink = LinkEmulator(), Sink()
    port = await link_to(em, await sink.start(), up=Shape(delay_ms=30), down=Shape(delay_ms=10))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    downs = []
    for i in range(40):
        writer.write(STAMP.pack(i, time.perf_counter()))
        _, echoed_at = STAMP.unpack(await reader.readexactly(STAMP.size))
        downs.append(1000 * (time.perf_counter() - echoed_at))
    writer.close()
    ups = [1000 * (arrived - sent) for _, sent, arrived in sink.got]
    await em.close()
    await sink.close()
    assert 30 <= statistics.median(ups) <= 30 + TOLERANCE_MS / 2, ups
    assert 10 <= statistics.median(downs) <= 10 + TOLERANCE_MS / 2, downs
    assert min(ups) >= 30 - 0.6 and p95(ups) <= 30 + LATE_MS  # never early; late only by a wake-up
    assert min(downs) >= 10 - 0.6 and p95(downs) <= 10 + LATE_MS


async def test_jitter_keeps_byte_order():
    em, sink = LinkEmulator(), Sink()
    port = await link_to(em, await sink.start(), up=Shape(delay_ms=10, jitter_ms=40))
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    await send_stamps(writer, 300, 0.002)
    deadline = time.monotonic() + 5
    while len(sink.got) < 300 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    writer.close()
    await em.close()
    await sink.close()
    assert [seq for seq, _, _ in sink.got] == list(range(300))  # nothing overtook, nothing lost
    delays = [1000 * (arrived - sent) for _, sent, arrived in sink.got]
    assert min(delays) >= 10 - 0.6
    assert max(delays) - min(delays) > 15  # the jitter is real: delays spread over the window
    assert p95(delays) <= 10 + 40 + LATE_MS


async def test_bandwidth_cap_respected():
    em = LinkEmulator()
    got = bytearray()
    done = asyncio.Event()
    size = 1_000_000

    async def handle(reader, writer):
        while len(got) < size:
            chunk = await reader.read(65536)
            if not chunk:
                break
            got.extend(chunk)
        done.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = await link_to(em, server.sockets[0].getsockname()[1], up=Shape(rate_mbit=10, delay_ms=5))
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    writer.write(b"\1" * size)
    await writer.drain()
    await asyncio.wait_for(done.wait(), 10)
    took = time.perf_counter() - t0
    writer.close()
    server.close()
    await em.close()
    expected = size * 8 / 10e6 + 0.005  # 0.805 s: serialization at 10 Mbit/s, then the delay
    assert len(got) == size
    assert expected * 0.97 <= took <= expected * 1.10, took


async def test_hold_partition_blocks_then_resumes_in_order():
    em, sink = LinkEmulator(), Sink()
    port = await link_to(em, await sink.start(), up=Shape(delay_ms=5), down=Shape(delay_ms=5))
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    await send_stamps(writer, 10, 0.001)
    await asyncio.sleep(0.05)
    assert len(sink.got) == 10
    await em.apply(Partition(name="l0", mode="hold"))
    await send_stamps(writer, 20, 0.01, first=10)  # sent during the partition: nothing arrives
    await asyncio.sleep(0.3)
    assert len(sink.got) == 10
    held = (await em.apply(Stats(name="l0"))).links[0]
    assert held.partition == "hold" and held.queued_bytes == 20 * STAMP.size
    healed_at = time.perf_counter()
    await em.apply(Partition(name="l0", mode="none"))
    await asyncio.sleep(0.1)
    writer.close()
    await em.close()
    await sink.close()
    assert [seq for seq, _, _ in sink.got] == list(range(30))
    assert all(arrived >= healed_at for _, _, arrived in sink.got[10:])
    assert max(arrived for _, _, arrived in sink.got) - healed_at < 0.02  # released at once, not re-delayed


async def test_cut_partition_closes_and_refuses_until_healed():
    em, sink = LinkEmulator(), Sink()
    port = await link_to(em, await sink.start())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(STAMP.pack(0, time.perf_counter()))
    await reader.readexactly(STAMP.size)
    await em.apply(Partition(name="l0", mode="cut"))
    with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
        await asyncio.wait_for(reader.readexactly(1), 2)  # the open connection was cut
    r2, w2 = await asyncio.open_connection("127.0.0.1", port)  # accepted by the kernel, then reset
    with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
        w2.write(STAMP.pack(1, time.perf_counter()))
        await asyncio.wait_for(r2.readexactly(STAMP.size), 2)
    await em.apply(Partition(name="l0", mode="none"))
    r3, w3 = await asyncio.open_connection("127.0.0.1", port)
    w3.write(STAMP.pack(2, time.perf_counter()))
    assert STAMP.unpack(await asyncio.wait_for(r3.readexactly(STAMP.size), 2))[0] == 2
    stats = (await em.apply(Stats(name="l0"))).links[0]
    w3.close()
    await em.close()
    await sink.close()
    assert stats.refused == 1 and stats.accepted == 2
    assert [seq for seq, _, _ in sink.got] == [0, 2]


async def test_shape_change_applies_while_traffic_flows():
    em, sink = LinkEmulator(), Sink()
    port = await link_to(em, await sink.start(), up=Shape(delay_ms=40))
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    await send_stamps(writer, 5, 0.001)
    await em.apply(SetLink(name="l0", up=Shape(delay_ms=0)))  # later chunks may not overtake earlier ones
    await send_stamps(writer, 5, 0.001, first=5)
    await asyncio.sleep(0.1)
    writer.close()
    await em.close()
    await sink.close()
    assert [seq for seq, _, _ in sink.got] == list(range(10))


def test_emulator_process_and_its_overhead_over_nats(nats_server):
    """The child-process emulator under its control channel: a 0 ms link's own cost over real NATS
    request/replies, then a 20 ms link measured through the same API."""
    with EmulatorProcess() as em:
        cost = emulator_overhead(em, nats_server.config.port, n=400)
        assert cost.samples == 400
        assert 0 <= cost.overhead_ms_p50 < 1.0, cost  # a loopback relay hop: tens of microseconds
        port = em.add_link("slow", nats_server.config.port, delay_ms=10)
        assert em.stats("slow")[0].up.delay_ms == 10

        async def rtt() -> float:
            """The link's round trip: the least of a few (a busy machine's scheduling only adds)."""
            from neuron_bus.topology import connect

            nc = await connect(f"nats://127.0.0.1:{port}")
            try:
                trips = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    await nc.flush()  # PING/PONG: one round trip through the link
                    trips.append(1000 * (time.perf_counter() - t0))
                return min(trips)
            finally:
                await nc.close()

        assert 20 <= asyncio.run(rtt()) <= 20 + 2 * TOLERANCE_MS
        em.partition("slow", "cut")
        assert em.stats("slow")[0].connections == 0
