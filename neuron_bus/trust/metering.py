"""The meter service: writes each session's metered record (trust/meter.py) into KV ``neuron-meter``.

``neuron-bus tracker`` runs one beside the tracker service (several trackers may: they share the
durable consumer, and a record is created once per session, so the first one written holds).

A session is metered when a node claims it: the durable pull consumer ``neuron-meter`` reads the
self-reports on ``neuron.ledger.>`` (stream NEURON_LEDGER); `SETTLE_S` after the first claim of a
session (every hop closes it at once, and the tail's last token and validation event precede the
close) the meter reads what the swarm observed of the session — its validation event, its last
telemetry, its token deltas, the tracker's route assignment and the nodes' capability reports —
and creates the record; the claims are acknowledged after that, so a meter that dies meanwhile
leaves them to the next one. A claim older than the token stream's retention (`EVIDENCE_MAX_AGE_S`)
cannot be metered any more and is left for the ledger to show as pending.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import nats
import nats.js.errors as jserr
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.kv import KeyValue

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.errors import MalformedMessage
from neuron_bus.kvmirror import KVMirror
from neuron_bus.routes import base_route_id
from neuron_bus.tasks import Background
from neuron_bus.topology import topology
from neuron_bus.trust.events import route_assignment, routes_bucket, stored
from neuron_bus.trust.meter import (
    KV_METER,
    Evidence,
    disagreement,
    layer_work,
    meter_session,
    route_id_of,
)
from workers.errors import Reason

log = logging.getLogger("neuron_bus.meter")

DURABLE = "neuron-meter"
SETTLE_S = 2.0
EVIDENCE_MAX_AGE_S = 900.0  # NEURON_TOKENS keeps token deltas 15 minutes
MAX_DELTAS = 1 << 16


async def _ack(msg) -> None:
    try:
        await msg.ack()
    except (nats.errors.Error, jserr.Error):  # the connection moved: the claim comes again, and is metered once
        pass


@dataclass
class _Pending:
    first: float
    msgs: list = field(default_factory=list)
    claims: list[M.LedgerEntry] = field(default_factory=list)


class Meter:
    def __init__(self, nc: nats.NATS, settle: float = SETTLE_S):
        self.nc = nc
        self.js = nc.jetstream()
        self.settle = settle
        self.metered = 0
        self.flagged_claims = 0
        self.pending: dict[str, _Pending] = {}
        self._work: tuple[int, dict[str, list[float | None]]] = (-1, {})
        self._routes: KeyValue | None = None
        self._nodes = KVMirror(self.js, S.KV_NODES, M.CapabilityReport)  # the reports: the model's layer work
        self._loops = Background()
        self._sub: JetStreamContext.PullSubscription | None = None

    async def start(self) -> None:
        try:
            self.kv = await self.js.key_value(KV_METER)
        except (jserr.NotFoundError, jserr.BucketNotFoundError):
            self.kv = await self.js.create_key_value(next(kv for kv in topology().kv if kv.bucket == KV_METER))
        self._routes = await routes_bucket(self.js)
        await self._nodes.start()
        self._sub = sub = await self.js.pull_subscribe(
            S.LEDGER_ALL,
            durable=DURABLE,
            stream=S.STREAM_LEDGER,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=60.0,
                max_ack_pending=8192,
            ),
        )
        self._loops.spawn(self._fetch_loop(sub), "meter-fetch")
        self._loops.spawn(self._settle_loop(), "meter-settle")

    async def stop(self) -> None:
        await self._loops.cancel_all()
        if self._sub is not None:
            # closed here: nats-py's fetch takes messages off the subscription's queue without
            # marking them done, so draining the connection would wait on it for ever
            try:
                await self._sub.unsubscribe()
            except nats.errors.Error:
                pass
            self._sub = None
        await self._nodes.stop()

    # ------------------------------------------------------------------ claims in

    async def _fetch_loop(self, sub: JetStreamContext.PullSubscription) -> None:
        while True:
            try:
                msgs = await sub.fetch(64, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except (nats.errors.Error, jserr.Error) as exc:
                log.warning("ledger claims not readable: %s", exc)
                await asyncio.sleep(1.0)
                continue
            for msg in msgs:
                await self._take(msg)

    async def _take(self, msg) -> None:
        try:
            claim = M.decode(msg.data, M.LedgerEntry)
            if claim.kind != "inference" or not claim.session_id:
                raise MalformedMessage(Reason.NOT_INFERENCE, "no session to meter")
            if not S.is_own_ledger(msg.subject, claim.node_id):  # as read_ledger: a claim for another node
                raise MalformedMessage(Reason.NOT_OWNER, f"a claim for {claim.node_id} on {msg.subject}")
            S.check_token(claim.session_id, "session id")
        except (MalformedMessage, ValueError):
            await _ack(msg)  # seeding, or nothing a session could be metered for
            return
        stamp = msg.metadata.timestamp.timestamp() if msg.metadata and msg.metadata.timestamp else time.time()
        if time.time() - stamp > EVIDENCE_MAX_AGE_S:
            await _ack(msg)  # its evidence is gone: the ledger shows it as pending, unpaid
            return
        p = self.pending.setdefault(claim.session_id, _Pending(time.monotonic()))
        p.msgs.append(msg)
        p.claims.append(claim)

    async def _settle_loop(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.settle))
            now = time.monotonic()
            for session_id in [s for s, p in self.pending.items() if now - p.first >= self.settle]:
                p = self.pending.pop(session_id)
                try:
                    record = await self.meter(session_id)
                except (nats.errors.Error, jserr.Error) as exc:
                    log.warning("session %s not metered yet: %s", session_id, exc)
                    continue  # unacknowledged: redelivered after the ack wait
                except MalformedMessage as exc:  # a record that is not one sits under its key
                    log.warning("session %s: its stored record is unreadable: %s", session_id, exc)
                    record = M.SessionMeter(session_id=session_id, status="unmetered")
                self._warn(record, p.claims)
                for msg in p.msgs:
                    await _ack(msg)

    def _warn(self, record: M.SessionMeter, claims: list[M.LedgerEntry]) -> None:
        for claim in claims:
            why, _ = disagreement(claim, record)
            if why:
                self.flagged_claims += 1
                log.warning("session %s: the claim of %s is flagged: %s", record.session_id, claim.node_id, why)

    # ------------------------------------------------------------------ metering

    async def meter(self, session_id: str) -> M.SessionMeter:
        """The session's record: the stored one, or metered now from the evidence and stored."""
        try:
            return M.decode((await self.kv.get(session_id)).value, M.SessionMeter)
        except (jserr.KeyNotFoundError, MalformedMessage):
            pass
        record = meter_session(await self.evidence(session_id))
        if record.status == "unmetered" and not record.route_id:
            # nothing observed the session at all: claims for invented sessions are not paid, and
            # cost no record (a claim must not buy a write)
            log.info("session %s: claimed, never observed: not metered", session_id)
            return record
        try:
            await self.kv.create(session_id, M.encode(record))
        except jserr.KeyWrongLastSequenceError:  # another meter was first
            return M.decode((await self.kv.get(session_id)).value, M.SessionMeter)
        self.metered += 1
        members = ", ".join(f"{m.node_id} {m.reward_weight:.1f}" for m in record.members)
        log.info("session %s metered: %s (%s)%s", session_id, record.status, members, "; ".join(["", *record.notes]))
        return record

    async def evidence(self, session_id: str) -> Evidence:
        ev = Evidence(session_id)
        validation = await self._last(S.STREAM_VALIDATION, S.validation(session_id), M.ValidationEvent)
        ev.validation = validation[1] if validation else None
        # the session's owner: named by its tail in the validation event, else by the subject of its
        # last telemetry (only the owner and workers may publish under neuron.telemetry.<owner>.>)
        owner = ev.validation.owner if ev.validation else None
        subject = S.telemetry(owner, session_id) if owner else S.telemetry_of_any_owner(session_id)
        telemetry = await self._last(S.STREAM_TELEMETRY, subject, M.GenerationTelemetry)
        if telemetry:
            ev.telemetry, owner = telemetry[1], owner or S.owner_of_telemetry(telemetry[0])
        ev.deltas = await self._deltas(owner, session_id) if owner else []
        route_id = route_id_of(ev)
        if route_id:
            ev.assignment = await route_assignment(self.js, base_route_id(route_id), self._routes)
        ev.layer_work = self._layer_work()
        return ev

    async def _last(self, stream: str, subject: str, kind):
        """The last message on ``subject`` (wildcards allowed) with the subject it came on, or None."""
        try:
            raw = await self.js.get_last_msg(stream, subject)
            return raw.subject, M.decode(raw.data, kind)
        except (jserr.NotFoundError, MalformedMessage, ValueError):
            return None

    async def _deltas(self, owner: str, session_id: str) -> list[M.TokenDelta]:
        """Every well-formed token delta of the session (forged or malformed ones are skipped by
        `meter_session`: only indices 0..k-1 all present count)."""
        out: list[M.TokenDelta] = []
        subject = S.session_tokens(owner, session_id)
        async for delta in stored(self.js, S.STREAM_TOKENS, subject, M.TokenDelta, skip_malformed=True):
            out.append(delta)
            if len(out) == MAX_DELTAS:
                break
        return out

    def _layer_work(self) -> dict[str, list[float | None]]:
        """The layer work per model revision, from the mirror of KV neuron-nodes (derived again
        when a report changed)."""
        version, work = self._work
        if version != self._nodes.version:
            reports = [r for r in self._nodes.values.values() if isinstance(r, M.CapabilityReport)]
            work = layer_work(reports)
            self._work = (self._nodes.version, work)
        return work
