"""What the worker sends for the engine's outcomes, and when it acknowledges their inputs.

- Outputs: a batch's messages are started in order and the processing loop goes on: waiting for
  the streams' acknowledgements (a round trip to the server, 50 ms over a 25 ms link) happens
  beside it, so other sessions' steps fill the time. Each input is acknowledged only once the next
  stream accepted its outputs (backpressure: the consumer's ack window bounds what is in flight);
  a session's outputs are delivered one after another, so its chunks never reorder on a full
  next hop's retries. A snapshot due at a step's position is exported before the loop can run
  the session's next step. An output that cannot be sent fails its session (its input already
  moved the session on: a redelivered copy would be refused); one that waited on a full next hop
  while its session closed or moved is dropped. At the tail: the validation event when a generation finishes, and the
  generation's telemetry (core NATS: the telemetry stream keeps the last one all the same, and
  a token must not wait for it).
- Rejections: counted by reason, the message terminated, and its session told (non-fatal),
  without holding up the data path. A copy the server delivered again of an input already taken
  (refused as replayed or out of order) is terminated and counted apart, and nobody is told.
- Failures: a fatal `SessionError` naming this node and the phase, and the session closed here.
"""

from __future__ import annotations

import asyncio
import logging

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.errors import NeuronBusError
from neuron_bus.flow import publish
from neuron_bus.tasks import Background
from neuron_bus.worker.engine import Failed, Output, Rejection
from neuron_bus.worker.session_table import HopSession
from workers.errors import Reason

log = logging.getLogger("neuron_bus.worker")

REDELIVERY_REASONS = (Reason.REPLAYED, Reason.OUT_OF_ORDER)  # what a second copy of a taken input is refused as


class Outbox:
    def __init__(self, nc, engine, runner, lifecycle, deliveries, snapshots, trail, metrics):
        self.nc, self.js = nc, nc.jetstream()
        self.engine = engine
        self.runner = runner
        self.lifecycle = lifecycle
        self.snapshots = snapshots
        self.trail = trail
        self.metrics = metrics
        self.node_id = engine.node_id
        self._background = Background()  # rejections' replies: never awaited by the loop
        self.deliveries = deliveries

    async def stop(self) -> None:
        await self._background.cancel_all()
        await self.deliveries.cancel_all()

    # ------------------------------------------------------------------ outputs

    async def send(self, outputs: list[Output]) -> None:
        """Export the snapshots due, then start every output's delivery, in order, and return."""
        for out in outputs:
            if out.snapshot:
                await self._snapshot(out.step.session)
        for out in outputs:
            self.deliveries.spawn(out.step.session.session_id, self._deliver(out))  # after the session's previous one

    async def _deliver(self, out: Output) -> None:
        try:
            await self._send(out)
        except NeuronBusError as exc:
            if exc.reason == Reason.SESSION_GONE:
                await out.step.handle.term()
                return
            await self._unsent(out, exc.reason, exc)
            return
        except Exception as exc:
            await self._unsent(out, Reason.NATS, exc)
            return
        if not out.finished:
            await out.step.handle.ack()
            return
        try:  # the session's last input: its ack processed before the close can delete the consumer
            await out.step.handle.ack_sync()
        except Exception as exc:  # unconfirmed: may reach the route's next binding, refused there
            log.warning(
                "worker %s: last input of %s not confirmed acked: %s", self.node_id, out.step.session.session_id, exc
            )

    async def _unsent(self, out: Output, reason: Reason, exc: Exception) -> None:
        """An output that could not be sent (the bus unreachable, or the next hop full, for as long as
        flow.py waits): the session cannot go on here. Its input already moved the session on, so a
        redelivered copy would be refused as replayed: the input is terminated and the session
        failed (its client told, if the bus takes the message), in the background, as its close
        waits for this delivery to end."""
        s = out.step.session
        log.warning("worker %s: %s output of %s not sent: %s", self.node_id, s.phase, s.session_id, exc)
        try:
            await out.step.handle.term()
        except Exception:  # the connection is gone: a copy the server sends again is refused as replayed
            pass
        if self.engine.is_current(s):
            self._background.spawn(self.fail(s, reason, f"{s.phase} output not sent: {exc}"))

    async def _send(self, out: Output) -> None:
        s = out.step.session

        def still_current(_waits: int) -> None:  # stop waiting on a full (dead?) next hop once the session is gone
            if not self.engine.is_current(s):
                raise NeuronBusError(Reason.SESSION_GONE, f"session {s.session_id} closed or moved to a repaired route")

        validation = None  # made before the last token goes out: its client may close the session at once
        if out.token is not None and out.finished and s.tail is not None:
            validation = self.trail.validation_event(s.open, s.tail.generated, out.token.delta.finish_reason)
        sends = [publish(self.js, m.subject, m.body, m.headers, on_wait=still_current) for m in out.sends]
        await (sends[0] if len(sends) == 1 else asyncio.gather(*sends))
        for m in out.sends:
            if m.seam:
                self.metrics.seam(m.seam, "out", len(m.body))
        try:  # side outputs: the step's own went out, so a failure here fails nothing
            if validation is not None:
                await self.trail.validation(validation)
            if out.telemetry is not None:
                await self.nc.publish(S.telemetry(s.open.owner, s.session_id), M.encode(out.telemetry))
        except Exception as exc:
            log.warning("worker %s: validation event or telemetry of %s not sent: %s", self.node_id, s.session_id, exc)

    async def _snapshot(self, s: HopSession) -> None:
        """Export the session's cache now (it is at a snapshot position) and upload it in the background."""
        if self.snapshots.busy(s.session_id):
            return
        try:
            blob = await self.runner.call(self.engine.backend.export_state, s.session_id)
        except Exception as exc:
            log.warning("worker %s: export of %s failed: %s", self.node_id, s.session_id, exc)
            self.snapshots.failed("export")
            return
        self.snapshots.write(s, blob)

    # ------------------------------------------------------------------ refusals and failures

    async def failed(self, o: Failed) -> None:
        if o.fatal:
            await self.fail(o.step.session, o.reason, o.message)
            await o.step.handle.term()
        else:
            s = o.step.session
            self.reject(Rejection(o.step.handle, o.reason, o.message, s.session_id, s.route.route_id))

    def reject(self, r: Rejection) -> None:
        """Count and refuse a message; tell its session's client (non-fatal) if this node holds it.
        A redelivered copy of an input already taken (its ack lost, or held past the ack wait) is
        terminated and counted apart: it is not a replay from the wire."""
        self._background.spawn(r.handle.term())
        if r.reason in REDELIVERY_REASONS and r.handle.redelivered:
            self.metrics.redelivered_copy()
            return
        self.metrics.reject(r.reason)
        s = self.engine.sessions.get(r.session_id) if r.session_id else None
        if s is None:
            return  # no session of this node: counted, nobody to tell (its owner is unknown here)
        subject = S.session_error(s.open.owner, s.session_id)
        err = M.SessionError(
            session_id=r.session_id,
            route_id=r.route_id,
            phase=s.phase,
            code=r.reason,
            message=f"{self.node_id}: rejected message: {r.message}",
            node_id=self.node_id,
            fatal=False,
        )
        self._background.spawn(self.nc.publish(subject, M.encode(err)))

    async def fail(self, s: HopSession, code: Reason, message: str) -> None:
        """A fatal session error: tell the client, free this hop's cache."""
        err = M.SessionError(
            session_id=s.session_id,
            route_id=s.route.route_id,
            phase=s.phase,
            code=code,
            message=f"{self.node_id}: {message}",
            node_id=self.node_id,
            position=s.position,
            fatal=True,
        )
        await self.nc.publish(S.session_error(s.open.owner, s.session_id), M.encode(err))
        if s.tail is not None:
            s.tail.progress.fail(f"{code}: {message}", s.phase, self.node_id)
            await self.nc.publish(s.tail.progress.subject, M.encode(s.tail.progress.snapshot()))
        await self.lifecycle.close(s.session_id, failed=True)
