"""A round trip to the server over a link that holds its bytes (a WAN partition that heals): the
measurement gives up on time and the connection goes on reading afterwards. nats-py's own
``flush(timeout)`` does not survive the same: the late PONG ends its read loop (why
``server_round_trip`` exists). Real nats-server, real link emulator in between."""

from __future__ import annotations

import asyncio

import nats
import nats.errors
import pytest

from neuron_bus.ping import server_round_trip
from neuron_bus.topology import connect
from neuron_bus.wan.linkem import AddLink, LinkEmulator, Partition

pytestmark = pytest.mark.timeout(60)
HELD_S = 0.3


@pytest.fixture
async def held_link(nats_server):
    """(a connection through an emulated link, a direct connection, the emulator)."""
    em = LinkEmulator()
    reply = await em.apply(AddLink(name="node", target_port=nats_server.config.port))
    assert reply.ok, reply.error
    behind = await connect(f"nats://127.0.0.1:{reply.port}", max_reconnect_attempts=1)
    direct = await connect(nats_server.url, max_reconnect_attempts=1)
    try:
        yield behind, direct, em
    finally:
        await behind.close()
        await direct.close()
        await em.close()


async def still_reads(behind: nats.NATS, direct: nats.NATS) -> bool:
    """Whether ``behind`` still receives what ``direct`` publishes."""
    got = asyncio.Event()

    async def on(msg):
        got.set()

    sub = await behind.subscribe("still.reads", cb=on)
    await asyncio.sleep(0.3)  # the subscription reaches the server (writing still works; no flush: it reads)
    await direct.publish("still.reads", b"x")
    try:
        await asyncio.wait_for(got.wait(), 2)
        return True
    except TimeoutError:
        return False
    finally:
        await sub.unsubscribe()


async def hold_then_heal(em: LinkEmulator, measure) -> object:
    await em.apply(Partition(name="node", mode="hold"))
    try:
        return await measure()
    finally:
        await em.apply(Partition(name="node", mode="none"))
        await asyncio.sleep(0.2)  # the held PING reaches the server, its PONG comes back


async def test_a_round_trip_over_a_held_link_gives_up_and_the_connection_reads_on(held_link):
    behind, direct, em = held_link
    before = await server_round_trip(behind, timeout=2)
    assert before is not None and 0 < before < 1
    assert await hold_then_heal(em, lambda: server_round_trip(behind, timeout=HELD_S)) is None
    assert await still_reads(behind, direct)
    after = await server_round_trip(behind, timeout=2)
    assert after is not None and 0 < after < 1


async def test_nats_py_flush_timing_out_over_a_held_link_leaves_a_connection_that_never_reads(held_link):
    """The hazard itself (nats-py 2.16): if this starts failing, nats-py mended it and
    server_round_trip may go back to flush."""
    behind, direct, em = held_link

    async def flush():
        with pytest.raises(nats.errors.TimeoutError):
            await behind.flush(timeout=HELD_S)

    await hold_then_heal(em, flush)
    assert behind.is_connected  # nothing tells the client: it looks connected
    assert not await still_reads(behind, direct)


async def test_a_round_trip_on_a_closed_connection_is_none(nats_server):
    nc = await connect(nats_server.url, max_reconnect_attempts=1)
    await nc.close()
    assert await server_round_trip(nc, timeout=0.5) is None
