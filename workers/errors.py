"""Typed errors raised by backends, and the one set of failure reasons the whole project uses.

`Reason` is shared by the backends and the bus side (``neuron_bus`` imports it from here: workers
owns the interface). Its values are what goes on the wire (``SessionError.reason``,
``ControlError.code``), into HTTP error bodies and into Prometheus labels, so the label set is
closed. A reason read from the wire is parsed with `Reason.of`, which never raises.

A raised backend error never leaves another session's state changed.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    BACKEND_ERROR = "backend_error"
    BACKPRESSURE_TIMEOUT = "backpressure_timeout"
    BAD_CONFIG = "bad_config"
    BAD_CONTROL = "bad_control"
    BAD_FILES = "bad_files"
    BAD_HEADER = "bad_header"
    BAD_ID = "bad_id"
    BAD_INPUT = "bad_input"
    BAD_JSON = "bad_json"
    BAD_MAC = "bad_mac"
    BAD_MANIFEST = "bad_manifest"
    BAD_PIECE_SIZE = "bad_piece_size"
    BAD_RANGE = "bad_range"
    BAD_REPLY = "bad_reply"
    BAD_SEAL = "bad_seal"
    BAD_SLICE = "bad_slice"
    BAD_SPEC = "bad_spec"
    BUS_UNREACHABLE = "bus_unreachable"
    CANNOT_SPECULATE = "cannot_speculate"
    CORRUPT = "corrupt"
    CORRUPT_ZSTD = "corrupt_zstd"
    DRAINING = "draining"
    EMPTY_PROMPT = "empty_prompt"
    ERROR = "error"
    EXITED = "exited"
    HASH_MISMATCH = "hash_mismatch"
    HOT_KV_LOST = "hot_kv_lost"
    IDLE_TIMEOUT = "idle_timeout"
    INCOMPLETE_SPLIT = "incomplete_split"
    INCONSISTENT = "inconsistent"
    LLAMA_CPP_ERROR = "llama_cpp_error"
    MISSING = "missing"
    MISSING_BUCKET = "missing_bucket"
    MISSING_HEADER = "missing_header"
    MISSING_PIECE = "missing_piece"
    MOVING = "moving"
    NATS = "nats"
    NODE_LOST = "node_lost"
    NODE_MOVING = "node_moving"
    NODE_UNREACHABLE = "node_unreachable"
    NOT_FOUND = "not_found"
    NOT_GGUF = "not_gguf"
    NOT_INFERENCE = "not_inference"
    NOT_OWNER = "not_owner"
    NOT_PERMITTED = "not_permitted"
    NOT_PLACED = "not_placed"
    NOT_READY = "not_ready"
    NO_ARTIFACT = "no_artifact"
    NO_BINARY = "no_binary"
    NO_FREE_SLOT = "no_free_slot"
    NO_REPLACEMENT = "no_replacement"
    NO_ROLLBACK = "no_rollback"
    NO_ROUTE = "no_route"
    NO_SNAPSHOT = "no_snapshot"
    NO_STORE = "no_store"
    NO_TRACKER = "no_tracker"
    NO_TTL = "no_ttl"
    OUT_OF_ORDER = "out_of_order"
    OVERRUN = "overrun"
    OVERSIZED = "oversized"
    PINNED = "pinned"
    PORT_IN_USE = "port_in_use"
    POSITION_GAP = "position_gap"
    PREFIX_MISSING = "prefix_missing"
    PREFILL_FAILED = "prefill_failed"
    PROTOCOL = "protocol"  # peers of different wire protocols (neuron_bus.messages.PROTOCOL)
    QUEUE_FULL = "queue_full"
    REMOTE_ERROR = "remote_error"
    REPAIR_FAILED = "repair_failed"
    REPLAYED = "replayed"
    ROUTE_FAILED = "route_failed"
    SESSION_EXISTS = "session_exists"
    SESSION_GONE = "session_gone"
    SIZE_MISMATCH = "size_mismatch"
    STALLED = "stalled"
    STUCK = "stuck"  # a node whose backend call is far overdue (neuron_bus/worker/runner.py)
    SWARM_FAILED = "swarm_failed"
    SWARM_NOT_READY = "swarm_not_ready"
    TOO_SMALL = "too_small"
    TRUNCATED = "truncated"
    UNASSIGNED = "unassigned"
    UNAUTHENTICATED = "unauthenticated"
    UNCUTTABLE = "uncuttable"
    UNKNOWN_ARCHITECTURE = "unknown_architecture"
    UNKNOWN_DTYPE = "unknown_dtype"
    UNKNOWN_ENCODING = "unknown_encoding"
    UNKNOWN_SESSION = "unknown_session"
    UNSUPPORTED = "unsupported"
    UNSUPPORTED_MODEL = "unsupported_model"
    WRONG_KEY = "wrong_key"
    WRONG_LAYERS = "wrong_layers"
    WRONG_MANIFEST = "wrong_manifest"
    WRONG_PHASE = "wrong_phase"
    WRONG_ROUTE = "wrong_route"

    @classmethod
    def of(cls, code: str) -> Reason:
        """The reason named ``code`` (from the wire); `REMOTE_ERROR` when no such reason exists."""
        try:
            return cls(code)
        except ValueError:
            return cls.REMOTE_ERROR


class BackendError(Exception):
    """Base class; ``reason`` labels metrics and error messages on the bus."""

    reason: Reason = Reason.BACKEND_ERROR


class BadInput(BackendError):
    """Wrong hidden size, wrong dtype, wrong number of positions, token id out of range."""

    reason = Reason.BAD_INPUT


class PositionGap(BackendError):
    """The input's position is not the session's next position."""

    reason = Reason.POSITION_GAP


class UnknownSession(BackendError):
    """The session was never opened on this backend, or is already closed."""

    reason = Reason.UNKNOWN_SESSION


class SessionExists(BackendError):
    reason = Reason.SESSION_EXISTS


class UnsupportedModel(BackendError):
    """The artifact cannot run on this backend (architecture, layer-boundary limits)."""

    reason = Reason.UNSUPPORTED_MODEL


class NoFreeSlot(BackendError):
    """The backend's KV pool has no room for the session's positions right now (retry later)."""

    reason = Reason.NO_FREE_SLOT
