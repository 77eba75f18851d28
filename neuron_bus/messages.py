"""Every message neuron-bus carries, as msgspec Structs.

This module is the single source of truth: schemas/ is generated from it
(`python -m neuron_bus.schemagen`), and subjects.md names the Struct carried on each subject.

Conventions
- Layer ranges are half-open: ``layer_start`` is the first layer a node runs, ``layer_end`` is one
  past its last (the CLI spells the same range inclusively, ``--layers 16-29`` = [16, 30)).
- Times are Unix seconds (float); sizes are bytes; rates are per second.
- JSON on the wire for control and telemetry; activation bodies are raw binary (see codec.py) and
  their state key travels in NATS headers as an :class:`ActivationHeader`.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from workers.errors import Reason
from workers.protocol import Capability as BackendCapability  # the backends' own report: workers/ owns that interface

SCHEMA_VERSION = 1
# The swarm's wire protocol. Nodes, trackers and clients work together only on the same protocol:
# a tracker routes through nodes that report its own and answers requests of its own only, and a
# node opens sessions only on routes assigned under its own. Raised by any change a peer of the
# previous protocol would misread (a message's meaning, the activation wire, the hop header).
PROTOCOL = 1


MAX_SPECULATIVE = 16  # draft tokens one decode step may carry at most (SessionOpen.speculative)

Phase = Literal["queued", "loading", "prefill", "decode", "done", "failed"]
ActivationPhase = Literal["prefill", "decode"]
WireDtype = Literal["f32", "bf16", "i32"]
Encoding = Literal["raw", "zstd"]
RoutePolicy = Literal["public", "private", "paid-trusted"]
TrustTier = Literal["untrusted", "trusted", "paid-trusted"]
FinishReason = Literal["stop", "length", "error"]


class Struct(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Base for every message: keyword-only fields; unknown fields are ignored (forward compatible)."""


_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def _require(ok: bool, what: str) -> None:
    """A semantic check of a message (``__post_init__``): msgspec turns the ValueError into a
    ValidationError when decoding, so such a message is malformed like any other."""
    if not ok:
        raise ValueError(what)


def _check_node(node_id: str, layer_start: int, layer_end: int, n_layers: int | None = None) -> None:
    _require(bool(_ID.match(node_id)), f"node_id {node_id[:40]!r} is not 1-128 of A-Z a-z 0-9 _ -")
    _require(0 <= layer_start < layer_end, f"layer range [{layer_start}, {layer_end}) is empty or negative")
    if n_layers is not None:
        _require(layer_end <= n_layers, f"layer range [{layer_start}, {layer_end}) beyond the model's {n_layers}")


def _non_negative(**values: float) -> None:
    for name, v in values.items():
        _require(v >= 0, f"{name} must not be negative")


def protocol_mismatch(us: str, them: str, theirs: int) -> str | None:
    """Why ``us`` (of this build's protocol) will not work with ``them`` (of ``theirs``), or None."""
    if theirs == PROTOCOL:
        return None
    return f"{us} speaks protocol {PROTOCOL}, {them} {theirs}: run compatible neuron-bus versions"


# --------------------------------------------------------------------------------------------
# Nodes


class NodeFit(Struct):
    """What a self-placing node can hold: at most ``max_layers`` layers, and within ``memory_budget``
    bytes the weights of its layers plus ``kv_positions`` positions of their KV (all its slots)
    and, for a tail, the output head (0: no budget)."""

    max_layers: int
    memory_budget: int = 0
    kv_positions: int = 0


class PlacementRequest(Struct):
    """A joining node asks the tracker which layers to serve (``model_preset`` "any": of which model)."""

    node_id: str
    model_preset: str
    fit: NodeFit
    backend_id: str = "llama-cpp"
    trust_tier: TrustTier = "untrusted"
    protocol: int = PROTOCOL  # the node's: a tracker of another places it nowhere


class PlacementDecision(Struct, tag_field="type", tag="placement"):
    """A range given to a node (the reply to a PlacementRequest, or a move), and why; every decision
    is also published on ``neuron.placement.decisions``."""

    node_id: str
    model_preset: str
    artifact_id: str
    layer_start: int
    layer_end: int
    reason: str
    kind: Literal["join", "move"] = "join"
    bottleneck_before: float = 0.0
    bottleneck_after: float = 0.0
    decided_at: float = 0.0
    tracker_id: str = ""


class PlacementRejection(Struct, tag_field="type", tag="placement_rejection"):
    node_id: str
    reasons: list[str]


PlacementReply = PlacementDecision | PlacementRejection


class CapabilityReport(BackendCapability, kw_only=True):
    """What a worker can do, announced at start and kept in the ``neuron-nodes`` KV bucket:
    its backend's capability plus the node, model and range it serves."""

    node_id: str
    model_preset: str
    model_revision: str
    artifact_id: str
    backend_id: str
    layer_start: int
    layer_end: int
    n_layers_total: int
    hidden_size: int
    wire_dtypes: list[WireDtype] = msgspec.field(default_factory=lambda: ["f32", "bf16"])
    trust_tier: TrustTier = "untrusted"
    started_at: float = 0.0
    layer_kinds: list[str] = []  # every layer of the whole model (artifacts/cuts.py); [] unknown
    placement: Literal["pinned", "auto"] = "pinned"  # auto: the tracker chose its range and may move it
    fit: NodeFit | None = None  # auto: what it can hold, for the tracker's placement
    # millions of weights a token multiplies in each of this node's layers, [layer_start, layer_end):
    # a mixture-of-experts layer counts its active experts only; the tail's last entry includes the
    # output head (artifacts/work.py). [] unknown
    active_parameters_per_layer: list[float] = []
    protocol: int = PROTOCOL  # the node's (PROTOCOL): a tracker of another never routes through it

    def __post_init__(self) -> None:
        _check_node(self.node_id, self.layer_start, self.layer_end, self.n_layers_total)
        _require(self.hidden_size > 0, "hidden_size must be positive")
        _require(
            not self.active_parameters_per_layer
            or len(self.active_parameters_per_layer) == self.layer_end - self.layer_start,
            "active_parameters_per_layer must hold one figure per layer of the range",
        )
        _non_negative(
            work=min(self.active_parameters_per_layer, default=0.0),
            prefill_tokens_per_second=self.prefill_tokens_per_second,
            decode_tokens_per_second=self.decode_tokens_per_second,
            cache_bytes_per_token_estimate=self.cache_bytes_per_token_estimate,
        )


# starting; ready; draining: moving to other layers (no new sessions); stuck: a backend call far
# past what its positions take (worker/runner.py), so its sessions' clients move them elsewhere
NodeStatus = Literal["starting", "ready", "draining", "stuck"]


class NodeHeartbeat(Struct):
    """Periodic worker telemetry; the tracker expires nodes whose heartbeats stop."""

    node_id: str
    seq: int
    ts: float
    layer_start: int
    layer_end: int
    cache_abi: str
    sessions_active: int = 0
    queue_depth: int = 0
    prefill_tokens_per_second: float = 0.0
    decode_tokens_per_second: float = 0.0
    memory_pressure: float = 0.0
    neighbour_latency_ms: dict[str, float] = {}
    route_failure_rate: float = 0.0
    status: NodeStatus = "ready"
    # the node's own round trip to its NATS server (least of its last few PINGs), if it measured
    # one: the tracker plans on it while its pings agree (registry._round_trip)
    server_rtt_ms: float | None = None

    def __post_init__(self) -> None:  # the tracker decodes thousands a second: one cheap test, then the reasons
        if _ID.match(self.node_id) is None or not 0 <= self.layer_start < self.layer_end:
            _check_node(self.node_id, self.layer_start, self.layer_end)
        lowest = min(
            self.seq,
            self.sessions_active,
            self.queue_depth,
            self.prefill_tokens_per_second,
            self.decode_tokens_per_second,
            self.memory_pressure,
            self.route_failure_rate,
            min(self.neighbour_latency_ms.values(), default=0.0),
            self.server_rtt_ms or 0.0,
        )
        if lowest >= 0:
            return
        _non_negative(
            seq=self.seq,
            sessions_active=self.sessions_active,
            queue_depth=self.queue_depth,
            prefill_tokens_per_second=self.prefill_tokens_per_second,
            decode_tokens_per_second=self.decode_tokens_per_second,
            memory_pressure=self.memory_pressure,
            route_failure_rate=self.route_failure_rate,
            neighbour_latency_ms=min(self.neighbour_latency_ms.values(), default=0.0),
            server_rtt_ms=self.server_rtt_ms or 0.0,
        )


class HeartbeatRelay(Struct):
    """Heartbeats one tracker took from the queue group, passed on to the other trackers in one
    message (tracker/beats.py): whole, or as the node's id alone when the heartbeat told the
    tracker nothing new but that the node is alive. An empty one says that its tracker is there."""

    tracker_id: str
    heartbeats: list[NodeHeartbeat] = []
    alive: list[str] = []  # nodes whose heartbeat changed nothing a route is planned on
    leaving: bool = False  # its tracker stops: the last relay it sends, pass nothing on to it any more

    def __post_init__(self) -> None:
        _require(
            bool(_ID.match(self.tracker_id)), f"tracker_id {self.tracker_id[:40]!r} is not 1-128 of A-Z a-z 0-9 _ -"
        )


# --------------------------------------------------------------------------------------------
# Routes


class RouteRequest(Struct):
    """A client (gateway, CLI) asks the tracker for a route (request/reply)."""

    request_id: str
    model_preset: str
    model_revision: str | None = None
    backend_id: str | None = None
    cache_abi: str | None = None
    policy: RoutePolicy = "public"
    wire_dtype: WireDtype = "f32"
    encoding: Encoding = "raw"
    protocol: int = PROTOCOL  # the client's
    # Nodes this generation lost or found faulty (a reply of the wrong kind): routed around while
    # the other nodes still cover the model, used only when nothing else covers their layers.
    avoid: list[str] = msgspec.field(default_factory=list)


class RouteHop(Struct):
    node_id: str
    layer_start: int
    layer_end: int
    subject: str
    backend_id: str
    cache_abi: str
    trust_tier: TrustTier = "untrusted"


class RouteAssignment(Struct, tag_field="type", tag="route"):
    """An ordered, complete layer coverage; hop i feeds hop i+1, the tail feeds hop 0 in decode."""

    route_id: str
    model_preset: str
    model_revision: str
    n_layers_total: int
    hops: list[RouteHop]
    wire_dtype: WireDtype = "f32"
    encoding: Encoding = "raw"
    created_at: float = 0.0
    policy: RoutePolicy = "public"  # the policy the route was planned under
    protocol: int = PROTOCOL  # the assigning tracker's: a node of another refuses the route's sessions


class RouteRejection(Struct, tag_field="type", tag="rejected"):
    """The tracker's answer when no route can satisfy a request, with every reason."""

    request_id: str
    reasons: list[str]
    # no_route; bad_json (a malformed request); nats (the bus did not take the assignment: ask again);
    # protocol (the request's is not the tracker's: asking again will not help)
    code: str = Reason.NO_ROUTE.value


# --------------------------------------------------------------------------------------------
# Sessions


class SamplingParams(Struct):
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 128
    stop: list[str] = []
    logprobs: bool = False
    ignore_eos: bool = False  # benchmarks: always generate max_tokens


PREFIX_BLOCK = 256  # prompt tokens per block of a prefix hash (neuron_bus/prefix.py)


class PrefixReuse(Struct):
    """A prompt prefix whose KV a hop attaches from its prefix cache instead of computing it."""

    positions: int  # positions [0, positions) of the prompt: a multiple of PREFIX_BLOCK, short of the last token
    block_hash: (
        str  # the chained hash of those positions' tokens: SessionOpen.prefix_blocks[positions // PREFIX_BLOCK - 1]
    )


class SessionOpen(Struct, tag_field="op", tag="open"):
    """Ask one hop of a route (``hop_index`` of ``route``) to allocate cache for a new session."""

    session_id: str
    route: RouteAssignment
    hop_index: int
    prompt_tokens: int
    n_ctx: int
    chunk_size: int = 256
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    prompt: list[int] | None = None  # the prompt's token ids, sent to the tail only (its validation event)
    # the identity of the client that opened the session: its tokens and errors go to
    # neuron.session.<owner>.<session>.*, which only that client's credential may read
    owner: str = "public"
    # link keys (trust/sealing.py), fresh per session: this hop's input link (it verifies what it
    # receives with it) and its output link (the next hop's input; at the tail, hop 0's for the
    # ring). Empty: an unauthenticated session, refused by workers that require keys
    input_key: str = ""
    output_key: str = ""
    encrypt: bool = False  # activation bodies (and snapshots) sealed with AEAD
    # speculative ring steps: a decode step may carry up to this many draft tokens after its token
    # (the tail drafts them from the session's own text and keeps the ones it agrees with; every
    # hop runs the step's positions in one call and drops the rejected ones). 0: plain decoding;
    # at most MAX_SPECULATIVE
    speculative: int = 0
    # prefix KV reuse (neuron_bus/prefix.py): the chained hashes of the prompt's blocks of PREFIX_BLOCK
    # tokens (those before its last token), what every hop keeps this session's KV under when it
    # ends; hop 0 with reuse_prefix attaches the longest of them it holds and says which
    # (SessionOpened.prefix); every other hop is then opened with that ``prefix`` and attaches
    # exactly it, or refuses (prefix_missing) and the client opens the route again without reuse
    prefix_blocks: list[str] = []
    reuse_prefix: bool = False
    prefix: PrefixReuse | None = None


class SessionOpened(Struct, tag_field="type", tag="opened"):
    """A hop's confirmation that it allocated cache for the session."""

    session_id: str
    route_id: str
    node_id: str
    hop_index: int
    layer_start: int
    layer_end: int
    cache_bytes: int
    prefix: PrefixReuse | None = None  # the prompt prefix this hop attached from its cache
    # the hop frees the session after this long with nothing computed for it and no keep-alive
    # (neuron-bus worker --idle-timeout): a client waiting its turn sends keep-alives well within it
    # (quiet.keep_alive_every). 0: not said (a hop of an earlier build)
    idle_timeout_s: float = 0.0


class SessionClose(Struct, tag_field="op", tag="close"):
    session_id: str
    route_id: str
    reason: str = "finished"
    proof: str = ""  # MAC of sealing.close_parts with the hop's input key: only the session's client can close it
    # prefix reuse: the chained block hashes of the session's prompt and the tokens it generated
    # (neuron_bus/prefix.py), extending SessionOpen.prefix_blocks: a hop keeps the session's KV
    # under as many of them as it holds positions for (a chat's next turn reuses the answer too)
    keep_blocks: list[str] = []


class SessionClosed(Struct, tag_field="type", tag="closed"):
    session_id: str
    node_id: str
    freed_bytes: int


class SessionKeepAlive(Struct, tag_field="op", tag="keep_alive"):
    """The session's client still wants it, though nothing of it reached this hop for a while: it
    waits its turn behind other sessions' work on its route. The hop counts it idle (and frees it
    past ``neuron-bus worker --idle-timeout``) from now on."""

    session_id: str
    route_id: str
    proof: str = ""  # MAC of sealing.keep_alive_parts with the hop's input key: only the session's client may


class SessionKeptAlive(Struct, tag_field="type", tag="kept_alive"):
    session_id: str
    node_id: str


class SessionResume(Struct, tag_field="op", tag="resume"):
    """Route repair: move a session onto ``open.route`` (a new route id) at ``position``.

    A surviving hop (``restore`` false) truncates its cache back to ``position``. The replacement
    hop (``restore`` true) imports the newest compatible snapshot of its layer range at or before
    ``position`` and answers with the position it restored. Positions ``[position, replay_end)``
    then arrive again as prefill-like chunks from the client; the tail emits no token for them
    except the last, which is token number ``len(generated)``. ``generated`` are the tokens the
    client already received (the tail rebuilds its text and counts from them).
    """

    open: SessionOpen
    position: int
    replay_end: int
    generated: list[int] = []
    restore: bool = False
    # a surviving hop: MAC of ("resume", session, new route, position, replay end) with its input
    # key; only the client that opened the session can move it
    proof: str = ""


class SessionResumed(Struct, tag_field="type", tag="resumed"):
    session_id: str
    route_id: str
    node_id: str
    hop_index: int
    position: int  # the session's position on this hop now (restored snapshot or truncation)
    snapshot: str | None = None  # object name of the restored snapshot
    idle_timeout_s: float = 0.0  # as SessionOpened's: a replacement's own, for the client's keep-alives


class SessionKey(Struct):
    """The session state key: the session, route, model, backend numerics and layer range a piece
    of hot state belongs to, and its position. Activations carry it; snapshots record it."""

    session_id: str
    route_id: str
    model_preset: str
    model_revision: str
    backend_id: str
    cache_abi: str
    layer_start: int
    layer_end: int
    position: int


class SnapshotMeta(SessionKey, kw_only=True):
    """What a KV snapshot holds: stored as the description of its object in ``neuron-snapshots``.

    A snapshot may only be restored by a node of the same model revision, backend, cache ABI and
    layer range; ``position`` positions [0, position) are in the blob.
    """

    generation_id: str  # unique per written snapshot
    node_id: str
    n_ctx: int
    nbytes: int
    created_at: float = 0.0
    mac: str = ""  # MAC of this metadata and the blob with the hop's input key (trust/sealing.py)
    sealed: bool = False  # the blob is AEAD-sealed (the session encrypts its activations)


class SessionsQuery(Struct, tag_field="op", tag="sessions"):
    """Ask a node for its active sessions (``neuron-bus sessions NODE``)."""


class SessionInfo(Struct):
    session_id: str
    route_id: str
    hop_index: int
    position: int
    cache_bytes: int
    idle_seconds: float


class SessionsReport(Struct, tag_field="type", tag="sessions"):
    node_id: str
    sessions: list[SessionInfo]
    cache_bytes_total: int
    backend_forward_calls: int
    rejected: dict[str, int] = {}
    snapshots_written: int = 0
    snapshot_failures: dict[str, int] = {}  # reason -> count; snapshot writes never block decode
    redelivered_copies: int = 0  # copies of inputs already taken, sent again by the server: not rejections


class Ping(Struct, tag_field="op", tag="ping"):
    sent_at: float


class Pong(Struct, tag_field="type", tag="pong"):
    node_id: str
    sent_at: float


class TokenizeRequest(Struct, tag_field="op", tag="tokenize"):
    """Ask a route's head to tokenize a prompt (or apply the model's chat template first)."""

    text: str | None = None
    messages: list[dict[str, str]] | None = None
    add_generation_prompt: bool = True
    tokens: list[int] | None = None  # a prompt given as token ids: checked against the head's vocabulary


class TokenizeReply(Struct, tag_field="type", tag="tokens"):
    tokens: list[int]
    text: str


class ControlError(Struct, tag_field="type", tag="error"):
    """A control request that failed: ``code`` is a short label, ``message`` one clear line."""

    code: str
    message: str


class MoveRange(Struct, tag_field="op", tag="move"):
    """The tracker asks a self-placed node to serve other layers (of its model, or of another one):
    it stops taking sessions, lets its running ones finish, loads the new range and announces it."""

    model_preset: str
    artifact_id: str
    layer_start: int
    layer_end: int
    reason: str = ""


class MoveAccepted(Struct, tag_field="type", tag="moving"):
    node_id: str
    layer_start: int
    layer_end: int
    sessions_draining: int = 0


ControlRequest = (
    SessionOpen | SessionClose | SessionKeepAlive | SessionsQuery | Ping | TokenizeRequest | SessionResume | MoveRange
)
ControlReply = (
    SessionOpened
    | SessionClosed
    | SessionKeptAlive
    | SessionsReport
    | Pong
    | TokenizeReply
    | ControlError
    | SessionResumed
    | MoveAccepted
)
# What answers each control request, besides ControlError. Any other answer comes from a faulty or
# foreign responder on the node's subject (client.control says which node, as bad_reply).
CONTROL_ANSWERS: dict[type, type] = {
    SessionOpen: SessionOpened,
    SessionClose: SessionClosed,
    SessionKeepAlive: SessionKeptAlive,
    SessionsQuery: SessionsReport,
    Ping: Pong,
    TokenizeRequest: TokenizeReply,
    SessionResume: SessionResumed,
    MoveRange: MoveAccepted,
}
RouteReply = RouteAssignment | RouteRejection


class SessionError(Struct):
    """An explicit, final route-session error: what failed, where, and in which phase."""

    session_id: str
    route_id: str
    phase: Phase
    code: str
    message: str
    node_id: str | None = None
    position: int | None = None
    fatal: bool = True  # False: one message was rejected, the session goes on


class ActivationHeader(SessionKey, kw_only=True):
    """The session state key and tensor description carried in the headers of every activation
    (``position`` is the first position in the body)."""

    phase: ActivationPhase
    seq: int
    dtype: WireDtype
    shape: list[int]
    encoding: Encoding = "raw"
    mac: str = ""  # MAC over every other field and the body with the link key (trust/sealing.py)


class TokenDelta(Struct):
    """One generated token, published by the route's tail."""

    session_id: str
    index: int
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: dict[str, float] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None


class GenerationTelemetry(Struct):
    """Progress of one generation on ``neuron.telemetry.<session_id>`` (JSON, any NATS client)."""

    session_id: str
    route_id: str
    model_preset: str
    phase: Phase
    prefill_tokens_done: int = 0
    prefill_tokens_total: int = 0
    generated_tokens: int = 0
    rolling_tokens_per_second: float = 0.0
    average_tokens_per_second: float = 0.0
    active_route_nodes: list[str] = []
    failure_reason: str | None = None
    failure_phase: Phase | None = None  # the last phase before the failure
    failure_node: str | None = None
    queue_position: int | None = None  # phase queued: generations ahead of this one, waiting for a free slot
    draft_tokens: int = 0  # speculative sessions: draft tokens sent around the ring so far
    accepted_draft_tokens: int = 0  # of which the tail's own choice agreed with (each one a token)
    prefill_tokens_reused: int = 0  # prompt positions every hop attached from its prefix cache (not computed)
    # route nodes that reported other sessions or queued work while this session showed no progress
    # for a few seconds (quiet.py: WAIT_NOTICE_S): it waits its turn there. Published by the
    # client, on the session's last telemetry; the next progress has it empty again.
    waiting_at: list[str] = []
    ts: float = 0.0


# --------------------------------------------------------------------------------------------
# Audit and ledger


class RouteMember(Struct):
    node_id: str
    layer_start: int
    layer_end: int
    backend_id: str
    cache_abi: str
    trust_tier: TrustTier = "untrusted"


class LogitSample(Struct):
    """The tail's top raw logits before sampling generated token ``index`` (for replay tolerance checks)."""

    index: int
    token_ids: list[int]
    logits: list[float]


class ValidationEvent(Struct):
    """Enough to reproduce a generation's route membership and its observed output."""

    event_id: str
    session_id: str
    route_id: str
    model_preset: str
    model_revision: str
    route: list[RouteMember]
    prompt_sha256: str
    prompt_tokens: list[int]
    output_tokens: list[int]
    sampling: SamplingParams
    policy: RoutePolicy = "public"
    created_at: float = 0.0
    logit_samples: list[LogitSample] = []  # the first few generated tokens' top logits
    wire_dtype: WireDtype = "f32"
    encoding: Encoding = "raw"
    chunk_size: int = 256
    finish_reason: str | None = None
    tail_node_id: str = ""  # the node that published the event
    owner: str = "public"  # the client that opened the session (its tokens: neuron.session.<owner>.<session>.*)
    activation_auth: Literal["none", "mac", "aead"] = "none"  # how the session's activations were protected


class AuditRequest(Struct):
    """The tracker sampled a session for replay (``neuron.audit.request``)."""

    session_id: str
    event_id: str
    requested_at: float = 0.0


AuditOutcome = Literal["agree", "disagree", "unverifiable"]


class AuditVerdict(Struct):
    """The result of replaying one validation event on a reference."""

    session_id: str
    event_id: str
    verdict: AuditOutcome
    reference: str  # "single" (one-process llama.cpp) or "route"
    members: list[str]  # node ids of the replayed route, head first
    detail: str = ""
    compared_tokens: int = 0
    first_divergence: int | None = None  # index of the first generated token that differs
    max_logit_diff: float = 0.0
    tolerance: float = 0.0
    attributed_to: list[str] = []  # nodes this disagreement was pinned on (see trust/attribution.py)
    ts: float = 0.0


class NodeTrust(Struct):
    """A node's audit record, kept in KV ``neuron-flags``; a flagged node is never routed."""

    node_id: str
    agreements: int = 0
    disagreements: int = 0
    attributed: int = 0  # disagreements pinned on this node alone
    flagged: bool = False
    reason: str = ""
    sessions: list[str] = []  # the sessions whose replays flagged it
    updated_at: float = 0.0


class LedgerEntry(Struct):
    """Work attributed to one node; seeding is recorded but never paid as inference."""

    entry_id: str
    node_id: str
    kind: Literal["inference", "seeding"]
    ts: float
    session_id: str | None = None
    layer_start: int = 0
    layer_end: int = 0
    owned_layer_work: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    bytes_served: int = 0
    reward_weight: float = 0.0


MeterStatus = Literal["finished", "unfinished", "repaired", "unmetered"]


class MeteredWork(Struct):
    """What the swarm observed one route member compute for a session (trust/meter.py).

    ``prefill_tokens``/``decode_tokens`` are the positions whose results the route delivered;
    ``max_*`` what an honest hop may have computed beyond them (a step in flight when the session
    ended, a repair's replay): a self-report above them is flagged. ``exact`` false (a repaired
    range): the member is paid its claim up to ``reward_weight``, not ``reward_weight`` itself.
    """

    node_id: str
    hop_index: int
    layer_start: int
    layer_end: int
    owned_layer_work: float  # from the model's layer work, not from the node's own report
    prefill_tokens: int
    decode_tokens: int
    reward_weight: float
    max_prefill_tokens: int
    max_decode_tokens: int
    exact: bool = True


class SessionMeter(Struct):
    """The metered record of one session, kept in KV ``neuron-meter`` (key: the session id).

    Written once by a meter (``neuron-bus tracker`` runs one) from what the swarm observed: the
    tracker's route assignment, the token deltas the tail delivered, the validation event, the
    session's last telemetry and the model's layer work (the nodes' capability reports, per layer
    the median). The ledger pays these figures; ledger entries (self-reports) are only checked
    against them.
    """

    session_id: str
    status: MeterStatus
    route_id: str = ""
    model_preset: str = ""
    model_revision: str = ""
    prompt_tokens: int = 0
    delivered_tokens: int = 0
    members: list[MeteredWork] = []
    sources: list[str] = []  # the observations used: assignment, token-deltas, validation, telemetry, layer-work
    notes: list[str] = []  # why a figure is bounded or missing; disagreements between observations
    metered_at: float = 0.0


# --------------------------------------------------------------------------------------------
# Artifacts


class FileHash(Struct):
    name: str
    size: int
    sha256: str


class PieceHash(Struct):
    """A piece of one artifact file: at most ``piece_size`` bytes, never crossing a region.

    A file is cut into regions (its header, each shared tensor, each layer's run of tensors) and
    each region into fixed-size pieces (its last piece may be shorter). Pieces therefore never
    straddle two layers: a node fetching a layer range downloads no byte of its neighbours.
    """

    index: int
    file: str
    offset: int
    length: int
    sha256: str
    region: str = ""  # "header", "blk.<layer>" or a shared tensor's name


class TensorEntry(Struct):
    name: str
    file: str
    offset: int  # absolute offset of the tensor's data in ``file``
    nbytes: int
    ggml_type: str
    shape: list[int]
    layer: int | None
    pieces: list[int]  # the pieces holding the tensor's bytes
    sha256: str = ""  # of the tensor's bytes (they are copied raw into slices: proves slices)


class CacheDescriptor(Struct):
    architecture: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    kv_bytes_per_token_per_layer: int  # K and V at f16
    layer_kinds: list[
        str
    ] = []  # per layer: attention, swa, mla, recurrent, mtp... (artifacts/cuts.py: where it may be cut)


class ArtifactManifest(Struct):
    """Maps a GGUF's storage (files, pieces) to its semantic parts (layers, shared tensors).

    ``header_pieces`` hold every file's header (metadata, tokenizer, tensor index): any node
    needs them to read its range. ``tokenizer_artifacts`` names the metadata keys holding the
    tokenizer (they live in the first file's header pieces). ``metadata_sha256`` digests the
    metadata a slice keeps unchanged, so a slice's metadata can be proven too.
    """

    artifact_id: str
    model_preset: str
    upstream_repo: str
    upstream_revision: str
    license: str
    runtime_backend: str
    quantization: str
    context_cap: int
    piece_size: int
    file_hashes: list[FileHash]
    piece_hashes: list[PieceHash]
    tensor_to_layer_map: list[TensorEntry]
    layer_to_artifact_map: dict[str, list[int]]
    tokenizer_artifacts: list[str]
    cache_descriptor: CacheDescriptor
    header_pieces: list[int] = []
    metadata_sha256: str = ""
    schema_version: int = SCHEMA_VERSION


# --------------------------------------------------------------------------------------------
# Tracker: coverage map


CoverageStatus = Literal["covered", "under-provisioned", "gap"]


class CoverageRequest(Struct, tag_field="op", tag="coverage"):
    """Ask the tracker for its coverage map (``neuron.tracker.coverage``, request/reply).

    A full map grows with the swarm (about 700 bytes per node at 80 layers: every node, and every
    layer's replica ids); ``nodes`` and ``replicas`` false leave those lists empty. A map larger
    than the server's max payload is answered with a ``ControlError`` (``too_large``) saying so.
    """

    model_preset: str | None = None  # None: every model the tracker knows
    nodes: bool = True  # CoverageReport.nodes: every node the tracker knows
    replicas: bool = True  # LayerCoverage.replicas: the ids of every layer's replicas


class LayerCoverage(Struct):
    """One layer of one model group: its live replicas and their summed measured decode tok/s.

    ``status`` is ``gap`` with no live replica, ``under-provisioned`` when ``reasons`` say why
    (single replica, only slow replicas, capacity under the tracker's threshold), else ``covered``.
    """

    layer: int
    status: CoverageStatus
    replicas: list[str]
    capacity_tokens_per_second: float
    reasons: list[str] = []


class RebalanceHint(Struct):
    """The layer range a joining node should take to help this model group most (half-open)."""

    layer_start: int
    layer_end: int
    reason: str


class ModelCoverage(Struct):
    """Coverage of one numerics group: nodes that may share a route (same model, revision,
    backend and cache ABI)."""

    model_preset: str
    model_revision: str
    backend_id: str
    cache_abi: str
    n_layers_total: int
    layers: list[LayerCoverage]
    nodes_live: list[str] = []
    nodes_expired: list[str] = []
    hint: RebalanceHint | None = None


class TrackedNode(Struct):
    """A node as the tracker sees it: its range, liveness and measured telemetry."""

    node_id: str
    model_preset: str
    layer_start: int
    layer_end: int
    backend_id: str
    cache_abi: str
    alive: bool
    status: str
    seconds_since_heartbeat: float | None = None
    decode_tokens_per_second: float | None = None  # measured (heartbeat) or self-benchmark
    prefill_tokens_per_second: float | None = None
    sessions_active: int = 0
    recently_assigned: int = 0
    queue_depth: int = 0
    route_failure_rate: float = 0.0
    memory_pressure: float = 0.0  # share of the node's memory in use, from its last heartbeat
    rtt_ms: float | None = None
    slow: bool = False
    trust_tier: TrustTier = "untrusted"
    flagged: bool = False  # audits caught it: never routed
    protocol: int = PROTOCOL  # the node's: one other than the tracker's is never routed


class LeaseRecord(Struct):
    """The value of a lease key in KV ``neuron-leases`` (neuron_bus/lease.py): who holds it, since
    when and when it last renewed it (the holder's clock: for people; the bucket's expiry and the
    key's revision are what count)."""

    holder: str
    since: float
    renewed: float


class CoverageReport(Struct, tag_field="type", tag="coverage"):
    """The tracker's coverage map: per model group and layer, plus every node it knows."""

    generated_at: float
    expiry_seconds: float
    min_replicas: int
    min_capacity_tokens_per_second: float
    slow_factor: float
    models: list[ModelCoverage]
    nodes: list[TrackedNode] = []
    placements: list[PlacementDecision] = []  # the latest placement decisions (joins and moves), oldest first
    protocol: int = PROTOCOL  # the tracker's: nodes of another are listed, never routed


ALL_MESSAGES: tuple[type[msgspec.Struct], ...] = (
    CapabilityReport,
    NodeHeartbeat,
    HeartbeatRelay,
    RouteRequest,
    RouteAssignment,
    RouteRejection,
    SessionOpen,
    SessionOpened,
    SessionClose,
    SessionClosed,
    SessionKeepAlive,
    SessionKeptAlive,
    SessionsQuery,
    SessionsReport,
    SessionResume,
    SessionResumed,
    SnapshotMeta,
    Ping,
    Pong,
    TokenizeRequest,
    TokenizeReply,
    ControlError,
    SessionError,
    ActivationHeader,
    TokenDelta,
    GenerationTelemetry,
    ValidationEvent,
    AuditRequest,
    AuditVerdict,
    NodeTrust,
    LedgerEntry,
    MeteredWork,
    SessionMeter,
    ArtifactManifest,
    CoverageRequest,
    CoverageReport,
    PlacementRequest,
    PlacementDecision,
    PlacementRejection,
    MoveRange,
    MoveAccepted,
    LeaseRecord,
)

_encoder = msgspec.json.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


_decoders: dict[object, msgspec.json.Decoder] = {}


def decode(data: bytes | None, kind):
    """Decode JSON into ``kind``; raise :class:`MalformedMessage` with a clear reason otherwise."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(type=kind)
    try:
        return decoder.decode(data or b"")
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        from neuron_bus.errors import MalformedMessage

        name = (
            getattr(kind, "__name__", None)
            or " | ".join(k.__name__ for k in getattr(kind, "__args__", ()))
            or str(kind)
        )
        raise MalformedMessage(Reason.BAD_JSON, f"malformed {name}: {exc}") from exc
