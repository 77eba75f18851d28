"""Subject, stream and bucket names. subjects.md documents each of them; keep the two in step."""

from __future__ import annotations

import re

ROOT = "neuron"

# Streams (JetStream). Names are fixed; subjects below say what each captures.
STREAM_PREFILL = "NEURON_PREFILL"  # neuron.act.*.*.*.prefill  work queue, window per subject
STREAM_DECODE = "NEURON_DECODE"  # neuron.act.*.*.*.decode    work queue
STREAM_ROUTES = "NEURON_ROUTES"  # neuron.route.assign.> limits, last per subject
STREAM_TELEMETRY = "NEURON_TELEMETRY"  # neuron.telemetry.>   last per subject
STREAM_TOKENS = "NEURON_TOKENS"  # neuron.session.*.*.tokens / .error, limits, memory
STREAM_VALIDATION = "NEURON_VALIDATION"  # neuron.validation.>  durable, file
STREAM_LEDGER = "NEURON_LEDGER"  # neuron.ledger.>      durable, file
STREAM_AUDIT = "NEURON_AUDIT"  # neuron.audit.>  replay requests and verdicts, file

# Key-value and object buckets.
KV_NODES = "neuron-nodes"  # node_id -> CapabilityReport
KV_ROUTES = "neuron-routes"  # route_id -> RouteAssignment
OBJ_ARTIFACTS = "neuron-artifacts"  # manifests and pieces
OBJ_SNAPSHOTS = "neuron-snapshots"  # KV cache snapshots (may live on a separate server)
KV_FLAGS = "neuron-flags"  # node_id -> NodeTrust (audit record; flagged nodes are not routed)
KV_PLACEMENTS = "neuron-placements"  # node_id -> PlacementDecision its node has not announced yet (expires)
KV_LEASES = "neuron-leases"  # lease name -> LeaseRecord (one holder at a time, entries expire: lease.py)
LEASE_TTL_S = 10.0  # the leases bucket's max age: a holder that stops renewing loses its lease after this

ROUTE_REQUEST = f"{ROOT}.route.request"  # request/reply to the tracker
ROUTE_ASSIGN_ALL = f"{ROOT}.route.assign.>"  # every tracker follows every assignment (load)
TRACKER_COVERAGE = f"{ROOT}.tracker.coverage"  # request/reply: CoverageRequest -> CoverageReport
TRACKER_HEARTBEATS = f"{ROOT}.tracker.heartbeats"  # HeartbeatRelay: heartbeats one tracker took, for the others
TRACKER_PLACE = f"{ROOT}.tracker.place"  # request/reply: PlacementRequest -> PlacementDecision | PlacementRejection
PLACEMENT_DECISIONS = f"{ROOT}.placement.decisions"  # every PlacementDecision, for operators
NODE_ANNOUNCE_ALL = f"{ROOT}.node.*.caps"
NODE_HEARTBEAT_ALL = f"{ROOT}.node.*.heartbeat"
VALIDATION_ALL = f"{ROOT}.validation.>"
AUDIT_REQUEST = f"{ROOT}.audit.request"  # AuditRequest: a session the tracker sampled for replay
LEDGER_ALL = f"{ROOT}.ledger.>"
PREFILL_ALL = f"{ROOT}.act.*.*.*.prefill.*"  # <receiving node>.<route>.<hop>.prefill.<session>
DECODE_ALL = f"{ROOT}.act.*.*.*.decode"
PUBLIC_OWNER = "public"  # the owner of sessions opened without an identity (no credentials)

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def check_token(value: str, what: str = "id") -> str:
    """Subject tokens must be plain: no dots, wildcards or spaces."""
    if not _TOKEN.match(value):
        raise ValueError(f"invalid {what} {value!r}: use 1-128 of A-Z a-z 0-9 _ -")
    return value


def node_caps(node_id: str) -> str:
    return f"{ROOT}.node.{check_token(node_id, 'node id')}.caps"


def node_heartbeat(node_id: str) -> str:
    return f"{ROOT}.node.{check_token(node_id, 'node id')}.heartbeat"


def node_control(node_id: str) -> str:
    """Request/reply: session open/close, `sessions` listing, ping (latency)."""
    return f"{ROOT}.node.{check_token(node_id, 'node id')}.ctl"


def node_move(node_id: str) -> str:
    """Request/reply: MoveRange, the tracker asking a self-placed node to serve other layers. Its
    own subject so that permissions let trackers alone publish there (anyone may ask ``.ctl``)."""
    return f"{ROOT}.node.{check_token(node_id, 'node id')}.move"


def route_assign(route_id: str) -> str:
    return f"{ROOT}.route.assign.{check_token(route_id, 'route id')}"


def hop_input(node_id: str, route_id: str, hop_index: int, phase: str, session_id: str | None = None) -> str:
    """Activations of one session into hop ``hop_index`` of a route, served by ``node_id``;
    ``phase`` is "prefill" or "decode".

    The receiving node comes first, so a node's credential may read its own inputs only
    (``neuron.act.<node>.>``). The two phases travel in separate streams: a prefill subject is
    one session's (``….prefill.<session>``) and holds at most a window of its chunks
    (backpressure per session: sessions sharing a route do not queue behind each other's
    window), decode subjects are the hop's and unbounded (a session has at most one decode step
    in flight, so the ring cannot deadlock on a full subject).
    """
    if phase == "prefill":
        if session_id is None:
            raise ValueError("a prefill subject is one session's: session_id is needed")
        return f"{hop_base(node_id, route_id, hop_index)}.prefill.{check_token(session_id, 'session id')}"
    return hop_inputs(node_id, route_id, hop_index, phase)


def hop_inputs(node_id: str, route_id: str, hop_index: int, phase: str) -> str:
    """What the hop's consumer of ``phase`` takes: every session's (``….prefill.*``, ``….decode``)."""
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be prefill or decode, got {phase!r}")
    return f"{hop_base(node_id, route_id, hop_index)}.{phase}" + (".*" if phase == "prefill" else "")


def hop_base(node_id: str, route_id: str, hop_index: int) -> str:
    """A hop's subject without its phase (``RouteHop.subject``)."""
    return f"{ROOT}.act.{check_token(node_id, 'node id')}.{check_token(route_id, 'route id')}.{int(hop_index)}"


def node_inputs(node_id: str) -> str:
    """Every activation addressed to ``node_id`` (what its credential may consume)."""
    return f"{ROOT}.act.{check_token(node_id, 'node id')}.>"


def session_tokens(owner: str, session_id: str) -> str:
    """A session's token deltas, under the identity of the client that opened it (``owner``):
    only that client's credential may read ``neuron.session.<owner>.>``."""
    return f"{session_base(owner, session_id)}.tokens"


def session_error(owner: str, session_id: str) -> str:
    return f"{session_base(owner, session_id)}.error"


def session_base(owner: str, session_id: str) -> str:
    return f"{ROOT}.session.{check_token(owner, 'owner')}.{check_token(session_id, 'session id')}"


def owner_sessions(owner: str) -> str:
    """Every session subject of one client (what its credential may read)."""
    return f"{ROOT}.session.{check_token(owner, 'owner')}.>"


def telemetry(owner: str, session_id: str) -> str:
    """A session's telemetry: public (any credential may read ``neuron.telemetry.>``), carries no
    text; only its owner (and workers) may publish under ``neuron.telemetry.<owner>.>``."""
    return f"{ROOT}.telemetry.{check_token(owner, 'owner')}.{check_token(session_id, 'session id')}"


def telemetry_of_any_owner(session_id: str) -> str:
    """A session's telemetry whoever owns it (a filter: the meter reads it from the stream)."""
    return f"{ROOT}.telemetry.*.{check_token(session_id, 'session id')}"


def owner_of_telemetry(subject: str) -> str:
    """The owner named by a telemetry subject (``neuron.telemetry.<owner>.<session>``)."""
    return subject.split(".")[2]


def validation(session_id: str) -> str:
    return f"{ROOT}.validation.{check_token(session_id, 'session id')}"


def ledger(node_id: str) -> str:
    return f"{ROOT}.ledger.{check_token(node_id, 'node id')}"


def is_own_ledger(subject: str, node_id: str) -> bool:
    """Was a ledger entry naming ``node_id`` published on that node's own subject? (per-node
    credentials let a node publish on ``neuron.ledger.<its id>`` only)"""
    return subject == f"{ROOT}.ledger.{node_id}"


def audit_verdict(session_id: str) -> str:
    return f"{ROOT}.audit.verdict.{check_token(session_id, 'session id')}"
