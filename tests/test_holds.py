"""A worker's held inputs (neuron_bus/worker/holds.py) on a real nats-server: an input the worker
still holds is reported in progress and not delivered twice, however long past the ack wait; one
it lets go (or one whose delivery was lost on its way) comes again after the ack wait, not after
a generation's stall timeout, and says so; one held past the longest hold is left to redelivery."""

from __future__ import annotations

import asyncio
import time

import pytest

from neuron_bus import subjects as S
from neuron_bus.topology import connect, ensure_topology
from neuron_bus.worker.consumers import RouteConsumers
from neuron_bus.worker.holds import Holds
from tests.sessions import one_hop_route

pytestmark = [pytest.mark.timeout(120)]

ACK_WAIT = 1.5  # a short ack wait, so the test takes seconds
KEEP_ALIVE = ACK_WAIT / 4


class FakeMsg:
    def __init__(self):
        self.progress = 0

    async def in_progress(self):
        self.progress += 1


def test_touch_reports_inputs_held_long_enough_and_lets_go_those_held_too_long():
    holds = Holds(keep_alive_s=1.0, max_hold_s=10.0)
    old, settled, young = FakeMsg(), FakeMsg(), FakeMsg()
    holds.hold(old)
    holds.hold(settled).let_go()
    h_young = holds.hold(young)
    t = h_young.since
    assert asyncio.run(holds.touch(t + 0.5)) == 0  # nothing held a second yet
    h_young.since = t + 0.4  # delivered later than the others
    assert asyncio.run(holds.touch(t + 1.2)) == 1 and (old.progress, settled.progress, young.progress) == (1, 0, 0)
    assert asyncio.run(holds.touch(t + 5.0)) == 2 and len(holds) == 2
    assert asyncio.run(holds.touch(t + 10.2)) == 1 and len(holds) == 1  # the first held too long: let go
    assert old.progress == 2 and young.progress == 2


async def received_within(nats_server, hold_for: float, settle) -> list[tuple[float, bool]]:
    """Bind a hop's consumers with a short ack wait, publish one decode input, hold what arrives for
    ``hold_for`` seconds (keeping it alive), then ``settle(handle)``; when each delivery came, and
    whether it says it is a redelivery."""
    nc = await connect(nats_server.url)
    try:
        await ensure_topology(nc.jetstream())
        holds = Holds(keep_alive_s=KEEP_ALIVE)
        arrivals: list[float] = []
        handles = []

        def deliver(phase, m):
            arrivals.append(time.monotonic())
            handles.append(m.handle)

        consumers = RouteConsumers(nc.jetstream(), deliver, 16, 4, holds, ack_wait=ACK_WAIT)
        await consumers.bind(one_hop_route("w0"), 0)
        alive = asyncio.create_task(holds.keep_alive())
        t0 = time.monotonic()
        await nc.jetstream().publish(S.hop_input("w0", "r", 0, "decode"), b"x")
        while not arrivals:
            await asyncio.sleep(0.01)
        await asyncio.sleep(hold_for)
        await settle(handles[0])
        await asyncio.sleep(3 * ACK_WAIT)
        alive.cancel()
        for h in handles[1:]:
            await h.ack()
        await consumers.unbind_all()
        return [(a - t0, h.redelivered) for a, h in zip(arrivals, handles)]
    finally:
        await nc.close()


async def ack(h):
    await h.ack()


async def let_go(h):
    h.let_go()


def test_an_input_held_past_the_ack_wait_is_kept_alive_and_delivered_once(nats_server):
    arrivals = asyncio.run(received_within(nats_server, 4 * ACK_WAIT, ack))
    assert len(arrivals) == 1, arrivals


def test_an_input_let_go_comes_again_after_the_ack_wait(nats_server):
    """As one whose delivery was lost on its way does: nobody holds it, nobody keeps it alive."""
    arrivals = asyncio.run(received_within(nats_server, 0.0, let_go))
    assert len(arrivals) >= 2, arrivals
    (first, again), (second, copy) = arrivals[:2]
    assert ACK_WAIT * 0.9 <= second - first <= 3 * ACK_WAIT, arrivals
    assert not again and copy
