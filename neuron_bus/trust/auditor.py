"""The auditor: replays the sessions the tracker sampled and flags nodes whose replays disagree.

``neuron-bus auditor`` runs it. A durable pull consumer (``neuron-auditor``) takes
`AuditRequest` messages from ``neuron.audit.request``; an event whose route the tracker never
assigned (or whose members are not the assignment's) is unverifiable and pins nothing on anyone;
every other event is replayed on the
single-process reference (replay.py, llama.cpp loaded once per model and kept), the verdict is
published on ``neuron.audit.verdict.<session>`` (stream NEURON_AUDIT) and the route members'
records (`NodeTrust`: agreements, disagreements, pinned disagreements, flagged) are written to KV
``neuron-flags``, which the tracker reads. Attribution (attribution.py) is rebuilt from the stored
verdicts at start. Several auditors may share the durable consumer.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import nats
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.kv import KeyValue

from neuron_bus import messages as M
from neuron_bus import models
from neuron_bus import subjects as S
from neuron_bus.errors import NeuronBusError
from neuron_bus.execution import Backend
from neuron_bus.flow import publish
from neuron_bus.tasks import cancel_and_wait
from neuron_bus.trust.attribution import DEFAULT_THRESHOLD, Attribution
from neuron_bus.trust.events import route_assignment, routes_bucket, stored, unassigned, validation_event
from neuron_bus.trust.replay import make_verdict, reference_backend, replay_single
from workers.errors import Reason

log = logging.getLogger("neuron_bus.auditor")

DURABLE = "neuron-auditor"


class Auditor:
    def __init__(self, nc: nats.NATS, model: str | None = None, threads: int = 1, threshold: int = DEFAULT_THRESHOLD):
        self.nc = nc
        self.js = nc.jetstream()
        self.model = model  # a path or preset overriding the event's preset
        self.threads = threads
        self.attribution = Attribution(threshold=threshold)
        self.verdicts = 0
        self._backends: dict[tuple[str, bool], Backend] = {}
        self._task: asyncio.Task | None = None
        self.sub: JetStreamContext.PullSubscription | None = None
        self.routes: KeyValue | None = None

    async def start(self) -> None:
        self.kv = await self.js.key_value(S.KV_FLAGS)
        self.routes = await routes_bucket(self.js)
        async for v in stored(self.js, S.STREAM_AUDIT, f"{S.ROOT}.audit.verdict.>", M.AuditVerdict):
            self.attribution.add(v)
        self.sub = await self.js.pull_subscribe(
            S.AUDIT_REQUEST,
            durable=DURABLE,
            stream=S.STREAM_AUDIT,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=600.0),
        )
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        if self.sub is not None:  # as the meter's (metering.py): a fetched-from subscription would stall drain
            try:
                await self.sub.unsubscribe()
            except nats.errors.Error:
                pass
            self.sub = None
        for backend in self._backends.values():
            backend.close()
        self._backends.clear()

    async def _loop(self) -> None:
        while True:
            try:
                assert self.sub is not None, "started"
                msgs = await self.sub.fetch(1, timeout=2.0)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except nats.errors.Error as exc:
                log.warning("audit requests not readable: %s", exc)
                await asyncio.sleep(1.0)
                continue
            for msg in msgs:
                try:
                    await self.handle(M.decode(msg.data, M.AuditRequest))
                except NeuronBusError as exc:  # malformed, or no such session: nothing to replay
                    log.warning("ignored an audit request: %s", exc)
                except Exception:
                    log.exception("replay failed")
                await msg.ack()

    def _backend(self, event: M.ValidationEvent):

        path = models.resolve(self.model or event.model_preset)
        key = (str(path), all("-fa0-" not in m.cache_abi for m in event.route))
        if key not in self._backends:  # one reference per model and flash-attention setting
            self._backends[key] = reference_backend(event, path, self.threads)
        return path, self._backends[key]

    async def handle(self, req: M.AuditRequest) -> M.AuditVerdict:
        event = await validation_event(self.js, req.session_id)
        # an event for a route the tracker never assigned (forged, or naming other nodes) pins nothing
        why = unassigned(event, await route_assignment(self.js, event.route_id, self.routes))
        try:
            if why:
                raise NeuronBusError(Reason.UNASSIGNED, why)
            path, backend = self._backend(event)
            verdict = await asyncio.to_thread(replay_single, event, Path(path), self.threads, backend)
        except (NeuronBusError, LookupError, OSError) as exc:
            verdict = make_verdict(event, "single", "unverifiable", f"{exc}" if why else f"no reference: {exc}")
        except (ValueError, TypeError, ArithmeticError) as exc:  # an event no reference can run (bad fields)
            log.warning("session %s cannot be replayed: %s: %s", event.session_id, type(exc).__name__, exc)
            verdict = make_verdict(event, "single", "unverifiable", f"cannot be replayed: {type(exc).__name__}: {exc}")
        changed = self.attribution.add(verdict)
        verdict.attributed_to = self.attribution.pinned_on(event.session_id)
        await publish(self.js, S.audit_verdict(event.session_id), M.encode(verdict))
        for node in changed:
            await self.kv.put(node, M.encode(self.attribution.nodes[node]))
        self.verdicts += 1
        log.info(
            "session %s: %s (%s)%s",
            event.session_id,
            verdict.verdict,
            verdict.detail,
            f"; pinned on {', '.join(verdict.attributed_to)}" if verdict.attributed_to else "",
        )
        return verdict
