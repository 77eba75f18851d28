"""Reading stored messages back: validation events, verdicts, ledger entries (JetStream direct reads)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.errors import NeuronBusError
from workers.errors import Reason


async def stored(js: JetStreamContext, stream: str, subject: str, kind) -> AsyncIterator:
    """Every message of ``stream`` on ``subject`` (wildcards allowed), oldest first, decoded as ``kind``."""
    async for _subject, msg in stored_on(js, stream, subject, kind):
        yield msg


async def stored_on(js: JetStreamContext, stream: str, subject: str, kind) -> AsyncIterator:
    """Like `stored`, each message with the subject it was published on."""
    seq = 1
    while True:
        try:
            raw = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return
        yield raw.subject, M.decode(raw.data, kind)
        seq = (raw.seq or seq) + 1


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
