"""The worker's outbox (neuron_bus/worker/outbox.py) in process, its bus faked where it fails:
a redelivered copy of an input already taken is counted apart from replays; an output the bus
does not take fails its session, explicitly, instead of leaving it to a redelivery it would refuse."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from nats.errors import ConnectionClosedError

from neuron_bus import messages as M
from neuron_bus.errors import NeuronBusError
from neuron_bus.worker.engine import Output, Rejection, Send, Step
from neuron_bus.worker.metrics import WorkerMetrics
from neuron_bus.worker.outbox import Outbox
from tests.sessions import one_hop_session
from workers.errors import Reason


class FakeHandle:
    def __init__(self, redelivered: bool = False):
        self.redelivered = redelivered
        self.settled = ""

    async def term(self):
        self.settled = "term"

    async def ack(self):
        self.settled = "ack"

    def let_go(self):
        self.settled = "let_go"


class FakeJS:
    def __init__(self, exc: Exception | None):
        self.exc = exc

    async def publish(self, subject, body, headers=None):
        if self.exc is not None:
            raise self.exc


class FakeNC:
    def __init__(self, exc: Exception | None = None):
        self.js = FakeJS(exc)
        self.published: list[tuple[str, bytes]] = []

    def jetstream(self):
        return self.js

    async def publish(self, subject, body):
        self.published.append((subject, body))


class FakeEngine:
    node_id = "w0"

    def __init__(self, current: bool = True):
        self.sessions: dict = {}
        self.current = current

    def is_current(self, s) -> bool:
        return self.current


class FakeLifecycle:
    def __init__(self):
        self.closed: list[tuple[str, bool]] = []

    async def close(self, session_id: str, failed: bool = False) -> int:
        self.closed.append((session_id, failed))
        return 0


def outbox(nc, engine, lifecycle=None) -> tuple[Outbox, WorkerMetrics]:
    metrics = WorkerMetrics("w0")
    return Outbox(nc, engine, None, lifecycle, None, None, None, metrics), metrics


@pytest.mark.parametrize("reason", [Reason.REPLAYED, Reason.OUT_OF_ORDER, Reason.BAD_MAC])
@pytest.mark.parametrize("redelivered", [False, True])
def test_a_redelivered_copy_is_terminated_and_counted_apart_from_replays(reason, redelivered):
    box, metrics = outbox(FakeNC(), FakeEngine())
    handle = FakeHandle(redelivered)

    async def scenario():
        box.reject(Rejection(handle, reason, "seq 3 again", "s1", "r1"))
        await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert handle.settled == "term"
    apart = redelivered and reason != Reason.BAD_MAC  # a forged copy is refused as such, redelivered or not
    assert metrics.redelivered._value.get() == metrics.redelivered_copies == (1 if apart else 0)
    assert metrics.rejected_by_reason == ({} if apart else {reason: 1})


@pytest.mark.parametrize(
    "exc, reason",
    [
        (ConnectionClosedError(), Reason.NATS),
        (NeuronBusError(Reason.BUS_UNREACHABLE, "no stream answered for 120s"), Reason.BUS_UNREACHABLE),
        (NeuronBusError(Reason.BACKPRESSURE_TIMEOUT, "stayed full for 120s"), Reason.BACKPRESSURE_TIMEOUT),
    ],
)
@pytest.mark.parametrize("current", [True, False])
def test_an_output_the_bus_does_not_take_fails_its_session(exc, reason, current):
    nc, lifecycle = FakeNC(exc), FakeLifecycle()
    box, _ = outbox(nc, FakeEngine(current), lifecycle)
    handle = FakeHandle()
    s = one_hop_session("w0", position=3)
    out = Output(step=Step(handle, s, None, np.zeros((1, 4), np.float32)), sends=[Send("neuron.act.x", b"x")])

    async def scenario():
        await box._deliver(out)
        await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert handle.settled == "term"  # its copy would be refused as replayed: nothing to wait for
    if not current:  # closed or moved to a repaired route meanwhile: nothing of it to fail here
        assert lifecycle.closed == [] and nc.published == []
        return
    assert lifecycle.closed == [("s1", True)]
    (subject, body), *_ = nc.published
    err = M.decode(body, M.SessionError)
    assert err.fatal and err.code == reason and err.node_id == "w0" and "output not sent" in err.message


class GatedJS:
    """A bus whose acknowledgements of the token stream wait until the test lets them through."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject, body, headers=None):
        if not subject.startswith("neuron.validation."):
            await self.gate.wait()
        self.published.append((subject, body))


def test_the_validation_event_keeps_its_logit_samples_when_the_client_closes_before_the_last_ack():
    """The client has the last token as soon as the stream stores it, and may close the session on
    the tail (which drops its logit samples) before the tail's own publish is acknowledged: the
    event is made before the token goes out. (It went out empty before: a CI run caught it.)"""
    from types import SimpleNamespace

    from neuron_bus.worker.audit_trail import AuditTrail
    from neuron_bus.worker.tail import TokenStep

    js = GatedJS()
    nc = FakeNC()
    nc.js = js
    s = one_hop_session("w0")
    s.tail = SimpleNamespace(generated=[5, 6, 7, 8])
    trail = AuditTrail(js, SimpleNamespace(node_id="w0"))
    for i in range(4):
        trail.observe("s1", i, np.arange(16, dtype=np.float32))
    box = Outbox(nc, FakeEngine(), None, None, None, None, trail, WorkerMetrics("w0"))
    delta = M.TokenDelta(session_id="s1", index=3, token_id=8, text="", finished=True, finish_reason="length")
    out = Output(
        step=Step(FakeHandle(), s, None, np.zeros((1, 4), np.float32)),
        sends=[Send("neuron.tokens.s1", b"t")],
        token=TokenStep(delta),
    )

    async def scenario():
        sending = asyncio.create_task(box._send(out))
        await asyncio.sleep(0.01)
        await trail.close(s.open)  # the client's close, handled while the token's ack is on its way
        js.gate.set()
        await sending

    asyncio.run(scenario())
    ((subject, body),) = [(sub, b) for sub, b in js.published if sub.startswith("neuron.validation.")]
    event = M.decode(body, M.ValidationEvent)
    assert [x.index for x in event.logit_samples] == [0, 1, 2, 3] and event.output_tokens == [5, 6, 7, 8]
