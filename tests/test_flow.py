"""Publishing into a full subject (flow.py) against a real nats-server: how long the publisher
waits, and what ends its wait."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats.js.api import DiscardPolicy, StreamConfig

from neuron_bus import flow, timing
from neuron_bus.errors import NeuronBusError
from workers.errors import Reason


async def one_per_subject(js) -> None:
    """A stream that holds one message per subject and refuses the next, as a hop's input window
    does (topology.py), with ``w.a`` full."""
    config = StreamConfig(
        name="W",
        subjects=["w.>"],
        max_msgs_per_subject=1,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
    )
    await js.add_stream(config)
    await js.publish("w.a", b"first")


def test_a_full_subject_is_waited_on_as_long_as_a_busy_hop_may_take(nats_server, monkeypatch):
    """A hop busy with older sessions' inputs keeps a session's subject full for as long as they
    take: the publisher waits for that (`timing.BUSY_WAIT_S`), not for the bound on a bus that
    does not answer (`timing.PUBLISH_WAIT_S`); past it, it gives up with backpressure_timeout, and
    its caller may stop it sooner (a hop's output whose session closed)."""
    monkeypatch.setattr(timing, "PUBLISH_WAIT_S", 0.5)
    monkeypatch.setattr(timing, "BUSY_WAIT_S", 3.0)

    async def scenario():
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        await one_per_subject(js)

        async def take_later() -> None:  # the busy hop gets to the waiting input after 1.5 s
            await asyncio.sleep(1.5)
            await js.purge_stream("W", subject="w.a")

        t0 = time.monotonic()
        taking = asyncio.create_task(take_later())
        waits = await flow.publish(js, "w.a", b"second")
        waited = time.monotonic() - t0
        await taking

        t1 = time.monotonic()  # nobody takes "second"
        with pytest.raises(NeuronBusError) as timed_out:
            await flow.publish(js, "w.a", b"third")
        gave_up = time.monotonic() - t1

        def session_gone(n: int) -> None:
            if n >= 3:
                raise NeuronBusError(Reason.SESSION_GONE, "session closed")

        t2 = time.monotonic()
        with pytest.raises(NeuronBusError) as stopped:
            await flow.publish(js, "w.a", b"fourth", on_wait=session_gone)
        stopped_after = time.monotonic() - t2
        kept = (await js.get_last_msg("W", "w.a")).data
        await nc.close()
        return waits, waited, timed_out.value, gave_up, stopped.value, stopped_after, kept

    waits, waited, timed_out, gave_up, stopped, stopped_after, kept = asyncio.run(scenario())
    assert waits > 0 and waited > 1.5 > timing.PUBLISH_WAIT_S  # waited past the bus bound, and got in
    assert timed_out.reason == Reason.BACKPRESSURE_TIMEOUT and "w.a stayed full for 3s" in str(timed_out)
    assert 3.0 <= gave_up < 5.0, gave_up
    assert stopped.reason == Reason.SESSION_GONE and stopped_after < 1.0, stopped_after
    assert kept == b"second"  # nothing was lost or overwritten: the full subject refused the rest


def test_a_bus_that_does_not_answer_is_given_up_on_after_the_bus_bound(nats_server, monkeypatch):
    """No stream takes the subject: retried for `timing.PUBLISH_WAIT_S`, then bus_unreachable."""
    monkeypatch.setattr(timing, "PUBLISH_WAIT_S", 1.0)

    async def scenario():
        nc = await nats.connect(nats_server.url)
        t0 = time.monotonic()
        with pytest.raises(NeuronBusError) as err:
            await flow.publish(nc.jetstream(timeout=0.2), "nostream.a", b"x")
        await nc.close()
        return err.value, time.monotonic() - t0

    err, took = asyncio.run(scenario())
    assert err.reason == Reason.BUS_UNREACHABLE and "nostream.a: no stream answered for 1s" in str(err)
    assert 1.0 <= took < 3.0, took
