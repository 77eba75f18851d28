"""What a session's subjects say, as a client reads them: token deltas, telemetry, errors.

Every session has three subjects, under the identity of the client that opened it (``owner``):
its token deltas (``neuron.session.<owner>.<id>.tokens``) and errors
(``neuron.session.<owner>.<id>.error``), which only that client may read, and its public telemetry
(``neuron.telemetry.<owner>.<id>``, no text). `read` turns one
message into the event a client yields, or raises the `RouteError` that a fatal error or a failed
route means, naming the phase and the node it failed at. The client's generation run and the
gateway's ``attach`` both read sessions with it.
"""

from __future__ import annotations

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.errors import MalformedMessage, RouteError
from workers.errors import Reason

SUBJECTS = (("token", S.session_tokens), ("error", S.session_error), ("telemetry", S.telemetry))  # (owner, id)

Event = M.TokenDelta | M.GenerationTelemetry


def read(kind: str, data: bytes, last_phase: M.Phase) -> Event | None:
    """The event in one message of a session's subjects (None: a rejected stray message, or one
    that is not a message of its kind at all — anyone may publish garbage there —, the session goes
    on); raises RouteError when the session failed."""
    try:
        return _read(kind, data, last_phase)
    except MalformedMessage:
        return None


def _read(kind: str, data: bytes, last_phase: M.Phase) -> Event | None:
    if kind == "error":
        err = M.decode(data, M.SessionError)
        if err.fatal:
            raise RouteError(err.code, err.message, phase=err.phase, node_id=err.node_id)
        return None
    if kind == "telemetry":
        t = M.decode(data, M.GenerationTelemetry)
        if t.phase == "failed":
            raise RouteError(
                Reason.ROUTE_FAILED,
                t.failure_reason or "route failed",
                phase=t.failure_phase or last_phase,
                node_id=t.failure_node,
            )
        return t
    return M.decode(data, M.TokenDelta)
