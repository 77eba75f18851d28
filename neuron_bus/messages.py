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

from typing import Literal

import msgspec

SCHEMA_VERSION = 1

Phase = Literal["queued", "loading", "prefill", "decode", "finalizing", "done", "failed"]
ActivationPhase = Literal["prefill", "decode"]
WireDtype = Literal["f32", "bf16", "i32"]
Encoding = Literal["raw", "zstd"]
RoutePolicy = Literal["public", "private", "paid-trusted"]
TrustTier = Literal["untrusted", "trusted", "paid-trusted"]


class Struct(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Base for every message: keyword-only fields; unknown fields are ignored (forward compatible)."""


# --------------------------------------------------------------------------------------------
# Nodes


class BackendCapability(Struct):
    """What an execution backend reports about itself (seed challenge 7); throughputs are
    measured by a short self-benchmark when the backend starts."""

    model_arch: str
    supported_runtime: str
    supports_prefill: bool
    supports_decode_step: bool
    supports_layer_range: bool
    supports_partial_artifacts: bool
    cache_abi: str
    cache_bytes_per_token_estimate: int
    prefill_tokens_per_second: float = 0.0
    decode_tokens_per_second: float = 0.0
    active_memory_floor: int = 0


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


class NodeHeartbeat(Struct):
    """Periodic worker telemetry; the tracker expires nodes whose heartbeats stop."""

    node_id: str
    seq: int
    ts: float
    layer_start: int
    layer_end: int
    cache_abi: str
    sessions_active: int = 0
    cache_bytes: int = 0
    queue_depth: int = 0
    prefill_tokens_per_second: float = 0.0
    decode_tokens_per_second: float = 0.0
    memory_pressure: float = 0.0
    disk_read_bytes_per_second: float = 0.0
    neighbour_latency_ms: dict[str, float] = {}
    route_failure_rate: float = 0.0
    cache_warmth: float = 0.0
    status: Literal["starting", "ready", "draining"] = "ready"


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


class RouteRejection(Struct, tag_field="type", tag="rejected"):
    """The tracker's answer when no route can satisfy a request, with every reason."""

    request_id: str
    reasons: list[str]


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


class SessionOpened(Struct, tag_field="type", tag="opened"):
    """A hop's confirmation that it allocated cache for the session."""

    session_id: str
    route_id: str
    node_id: str
    hop_index: int
    layer_start: int
    layer_end: int
    cache_bytes: int


class SessionClose(Struct, tag_field="op", tag="close"):
    session_id: str
    route_id: str
    reason: str = "finished"


class SessionClosed(Struct, tag_field="type", tag="closed"):
    session_id: str
    node_id: str
    freed_bytes: int


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


class SessionResumed(Struct, tag_field="type", tag="resumed"):
    session_id: str
    route_id: str
    node_id: str
    hop_index: int
    position: int  # the session's position on this hop now (restored snapshot or truncation)
    snapshot: str | None = None  # object name of the restored snapshot


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


class TokenizeReply(Struct, tag_field="type", tag="tokens"):
    tokens: list[int]
    text: str


class ControlError(Struct, tag_field="type", tag="error"):
    """A control request that failed: ``code`` is a short label, ``message`` one clear line."""

    code: str
    message: str


ControlRequest = SessionOpen | SessionClose | SessionsQuery | Ping | TokenizeRequest | SessionResume
ControlReply = SessionOpened | SessionClosed | SessionsReport | Pong | TokenizeReply | ControlError | SessionResumed
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


class TokenDelta(Struct):
    """One generated token, published by the route's tail."""

    session_id: str
    index: int
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: dict[str, float] | None = None
    finished: bool = False
    finish_reason: Literal["stop", "length", "error"] | None = None


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
    output_logits_sample: list[float] = []
    created_at: float = 0.0
    logit_samples: list[LogitSample] = []  # the first few generated tokens' top logits
    wire_dtype: WireDtype = "f32"
    encoding: Encoding = "raw"
    chunk_size: int = 256
    finish_reason: str | None = None
    tail_node_id: str = ""  # the node that published the event


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
    layer_kinds: list[str] = []  # per layer: attention | swa (artifacts/cuts.py: where it may be cut)


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
    rtt_ms: float | None = None
    slow: bool = False
    trust_tier: TrustTier = "untrusted"
    flagged: bool = False  # audits caught it: never routed


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


ALL_MESSAGES: tuple[type[Struct], ...] = (
    CapabilityReport,
    NodeHeartbeat,
    RouteRequest,
    RouteAssignment,
    RouteRejection,
    SessionOpen,
    SessionOpened,
    SessionClose,
    SessionClosed,
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
    ArtifactManifest,
    CoverageRequest,
    CoverageReport,
    LeaseRecord,
)

_encoder = msgspec.json.Encoder()


def encode(msg: Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, kind):
    """Decode JSON into ``kind``; raise :class:`MalformedMessage` with a clear reason otherwise."""
    from neuron_bus.errors import MalformedMessage

    try:
        return msgspec.json.decode(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        name = (
            getattr(kind, "__name__", None)
            or " | ".join(k.__name__ for k in getattr(kind, "__args__", ()))
            or str(kind)
        )
        raise MalformedMessage("bad_json", f"malformed {name}: {exc}") from exc
