"""The tracker's side of audits: sample sessions for replay, and follow the flags.

- Every validation event (``neuron.validation.>``) is sampled with probability ``audit_rate``,
  decided by a hash of the session id (so several trackers sample the same sessions); a sampled
  session becomes an `AuditRequest` on ``neuron.audit.request`` (stream NEURON_AUDIT), which an
  auditor (``neuron-bus auditor``) replays.
- KV ``neuron-flags`` is mirrored by one watcher (kvmirror.py: no consumer per read) and looked at
  every ``poll`` seconds; `mark` sets ``flagged`` on the node views the planner sees, and the
  planner never routes a flagged node.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time

import nats
import nats.js.errors as jserr
from nats.aio.subscription import Subscription

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.errors import MalformedMessage, NeuronBusError
from neuron_bus.flow import publish
from neuron_bus.kvmirror import KVMirror
from neuron_bus.tasks import cancel_and_wait

log = logging.getLogger("neuron_bus.tracker.audit")


def sampled(session_id: str, rate: float) -> bool:
    if rate <= 0.0:
        return False
    if rate >= 1.0:
        return True
    h = int.from_bytes(hashlib.sha256(session_id.encode()).digest()[:8], "big")
    return h / 2**64 < rate


class TrackerTrust:
    def __init__(self, nc: nats.NATS, audit_rate: float, poll: float = 1.0):
        self.nc = nc
        self.js = nc.jetstream()
        self.audit_rate = audit_rate
        self.poll = poll
        self.flagged: dict[str, str] = {}  # node id -> reason
        self._sub: Subscription | None = None
        self._task: asyncio.Task | None = None
        self._flags = KVMirror(self.js, S.KV_FLAGS, M.NodeTrust)

    async def start(self) -> None:
        if self.audit_rate > 0:
            self._sub = await self.nc.subscribe(S.VALIDATION_ALL, cb=self._on_event)
        await self._flags.start()
        await self._read_flags()
        self._task = asyncio.create_task(self._flag_loop())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        await self._flags.stop()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except nats.errors.Error:
                pass

    async def _on_event(self, msg) -> None:
        # the subject names the session (neuron.validation.<session>): most events are not sampled,
        # and those are never decoded
        if not sampled(msg.subject.rsplit(".", 1)[-1], self.audit_rate):
            return
        try:
            event = M.decode(msg.data, M.ValidationEvent)
        except MalformedMessage as exc:
            log.warning("ignored a validation event on %s: %s", msg.subject, exc)
            return
        req = M.AuditRequest(session_id=event.session_id, event_id=event.event_id, requested_at=time.time())
        try:
            # every tracker samples the same sessions: the message id lets the stream keep one request
            await publish(
                self.js, S.AUDIT_REQUEST, M.encode(req), {"Nats-Msg-Id": f"audit-{event.event_id}"}, max_wait=10.0
            )
            log.info("session %s sampled for replay", event.session_id)
        except (NeuronBusError, nats.errors.Error, jserr.Error) as exc:
            log.warning("could not request a replay of %s: %s", event.session_id, exc)

    async def _read_flags(self) -> None:
        """The flagged nodes, from the mirror of KV neuron-flags."""
        flagged = {
            rec.node_id: rec.reason
            for rec in self._flags.values.values()
            if isinstance(rec, M.NodeTrust) and rec.flagged
        }
        for node in flagged.keys() - self.flagged.keys():
            log.warning("node %s is flagged by audits and excluded from routes: %s", node, flagged[node])
        self.flagged = flagged

    async def _flag_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll)
            await self._read_flags()

    def mark(self, views: list) -> list:
        """The planner's node views with ``flagged`` set on nodes audits flagged."""
        return [dataclasses.replace(v, flagged=True) if v.node_id in self.flagged else v for v in views]
