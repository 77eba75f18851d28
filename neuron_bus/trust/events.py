"""Reading stored messages back: validation events, verdicts, ledger entries, route assignments
(JetStream direct reads)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.errors import MalformedMessage, NeuronBusError
from neuron_bus.routes import base_route_id
from workers.errors import Reason


async def stored(js: JetStreamContext, stream: str, subject: str, kind, skip_malformed: bool = False) -> AsyncIterator:
    """Every message of ``stream`` on ``subject`` (wildcards allowed), oldest first, decoded as
    ``kind``; ``skip_malformed``: one that is not a ``kind`` is passed over (anyone who may publish
    there may publish garbage) instead of raising MalformedMessage."""
    async for _subject, msg in stored_on(js, stream, subject, kind, skip_malformed):
        yield msg


async def stored_on(
    js: JetStreamContext, stream: str, subject: str, kind, skip_malformed: bool = False
) -> AsyncIterator:
    """Like `stored`, each message with the subject it was published on."""
    seq = 1
    while True:
        try:
            raw = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return
        seq = (raw.seq or seq) + 1
        try:
            decoded = M.decode(raw.data, kind)
        except MalformedMessage:
            if skip_malformed:
                continue
            raise
        yield raw.subject, decoded


async def validation_event(js: JetStreamContext, key: str) -> M.ValidationEvent:
    """The validation event of session ``key``, or the one whose event id is ``key``."""
    try:
        S.check_token(key, "session or event id")
        raw = await js.get_last_msg(S.STREAM_VALIDATION, S.validation(key))
        return M.decode(raw.data, M.ValidationEvent)
    except (NotFoundError, ValueError):
        pass
    async for event in stored(js, S.STREAM_VALIDATION, S.VALIDATION_ALL, M.ValidationEvent):
        if event.event_id == key:
            return event
    raise NeuronBusError(
        Reason.NOT_FOUND, f"no validation event for session or event id {key!r} in {S.STREAM_VALIDATION}"
    )


async def routes_bucket(js: JetStreamContext) -> KeyValue | None:
    """KV neuron-routes, opened once by a reader of many assignments (None: not provisioned)."""
    try:
        return await js.key_value(S.KV_ROUTES)
    except NotFoundError:  # BucketNotFoundError is a NotFoundError
        return None


async def route_assignment(js: JetStreamContext, route_id: str, kv: KeyValue | None = None) -> M.RouteAssignment | None:
    """The tracker's assignment of ``route_id`` (KV neuron-routes, else NEURON_ROUTES), or None;
    ``kv``: the bucket as `routes_bucket` opened it (else it is opened for this call)."""
    try:
        S.check_token(route_id, "route id")
    except ValueError:
        return None
    try:
        kv = kv or await js.key_value(S.KV_ROUTES)
        return M.decode((await kv.get(route_id)).value, M.RouteAssignment)
    except (NotFoundError, MalformedMessage):  # KeyNotFoundError is a NotFoundError
        pass
    try:
        return M.decode((await js.get_last_msg(S.STREAM_ROUTES, S.route_assign(route_id))).data, M.RouteAssignment)
    except (NotFoundError, MalformedMessage):
        return None


def unassigned(event: M.ValidationEvent, assignment: M.RouteAssignment | None) -> str | None:
    """Why an event's route is not one the tracker assigned (None: it is). A repaired route
    (``<route>-r<n>``) keeps the assignment's ranges; only its nodes may differ."""
    base = base_route_id(event.route_id)
    if assignment is None or assignment.route_id != base:
        return f"route {event.route_id} was not assigned by the tracker"
    got = [(m.layer_start, m.layer_end) for m in event.route]
    if got != [(h.layer_start, h.layer_end) for h in assignment.hops]:
        return f"the event's route members {got} are not the assignment's ranges"
    if event.route_id == base and [m.node_id for m in event.route] != [h.node_id for h in assignment.hops]:
        return "the event's route members are not the nodes the tracker assigned"
    return None
