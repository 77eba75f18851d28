"""The leader lease (neuron_bus/lease.py) on a real nats-server: one holder at a time, handed over
when the holder stops (at once) or dies (after the bucket's expiry), with growing fencing tokens."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.js.api import KeyValueConfig, StorageType

from neuron_bus import subjects as S
from neuron_bus.lease import Lease, LeaseError
from neuron_bus.topology import connect, ensure_topology

pytestmark = pytest.mark.timeout(60)

TTL = 1.0
BUCKET = "test-leases"


@pytest.fixture
async def js(nats_server):
    nc = await connect(nats_server.url, max_reconnect_attempts=1)
    js = nc.jetstream()
    await js.create_key_value(KeyValueConfig(bucket=BUCKET, history=1, ttl=TTL, storage=StorageType.MEMORY))
    try:
        yield js
    finally:
        await nc.close()


async def until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        await asyncio.sleep(0.02)


async def test_one_holder_among_three_and_a_clean_handover(js):
    leases = [Lease(js, BUCKET, "placement", holder=f"t{i}") for i in range(3)]
    for lease in leases:
        await lease.start()
    try:
        for _ in range(5):  # renewals keep it where it is
            assert sum(lease.held for lease in leases) == 1
            await asyncio.sleep(TTL / 3)
        (holder,) = [lease for lease in leases if lease.held]
        assert (await holder.holder_now()).holder == holder.holder
        first_token = holder.token
        await holder.stop()  # releases the key: the others need not wait for the expiry
        others = [lease for lease in leases if lease is not holder]
        released = time.monotonic()
        await until(lambda: any(lease.held for lease in others), TTL, "a new holder after the release")
        assert time.monotonic() - released < TTL
        (second,) = [lease for lease in others if lease.held]
        assert second.token > first_token and sum(lease.held for lease in others) == 1
    finally:
        for lease in leases:
            await lease.stop()


async def test_a_dead_holder_is_replaced_after_the_expiry_and_never_overlaps(js):
    dead = Lease(js, BUCKET, "k", holder="dead")
    assert await dead.step()  # took it, and will never renew (its process died)
    token = dead.token
    alive = Lease(js, BUCKET, "k", holder="alive")
    assert not await alive.step()
    t0 = time.monotonic()
    while not await alive.step():
        await asyncio.sleep(0.05)
        assert time.monotonic() - t0 < 10 * TTL, "the server never expired the dead holder's key"
    # not before the dead holder's own deadline: a live holder and its successor never overlap
    assert not dead.held and time.monotonic() - t0 >= TTL * 0.8
    assert alive.token > token and (await alive.holder_now()).holder == "alive"
    assert not await dead.step()  # it comes back: the lease is someone else's now
    await alive.stop()


async def test_a_holder_that_cannot_renew_stops_believing_it_holds(js):
    t = [0.0]
    lease = Lease(js, BUCKET, "clock", holder="x", clock=lambda: t[0])
    assert await lease.step() and lease.held
    t[0] += TTL + 0.01  # past its deadline without a successful renewal
    assert not lease.held


async def test_missing_bucket_and_a_bucket_that_never_expires_are_refused(nats_server):
    nc = await connect(nats_server.url, max_reconnect_attempts=1)
    try:
        js = nc.jetstream()
        with pytest.raises(LeaseError, match="not found"):
            await Lease(js, "no-such-bucket", "k", holder="x").open()
        await js.create_key_value(KeyValueConfig(bucket="forever", history=1))
        with pytest.raises(LeaseError, match="never expire"):
            await Lease(js, "forever", "k", holder="x").open()
        await ensure_topology(js)  # the project's bucket: provisioned with an expiry
        lease = Lease(js, S.KV_LEASES, "k", holder="x")
        await lease.open()
        assert lease.ttl == S.LEASE_TTL_S
    finally:
        await nc.close()
