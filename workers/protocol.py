"""The one small protocol every execution backend implements.

A backend runs a contiguous, half-open layer range [layer_start, layer_end) of one model and owns
the hot KV cache of those layers for every open session. The head (layer_start == 0) takes token
ids; every other hop takes hidden states. Every non-tail hop returns the residual stream after its
last layer; the tail (layer_end == n_layers) returns logits.

Inputs and outputs are numpy arrays:
- head input: int32 token ids, shape [n]
- hidden states in and out: float32, shape [n, hidden_size]
- tail output: float32 logits of the *last* row only, shape [vocab] (that is all sampling needs)

`Backend` does the bookkeeping every backend shares (session table, position tracking, input
validation with typed errors) so that a bad call never touches model state; subclasses implement
the `_open/_forward/_close/_cache_bytes/_truncate/_export/_import` hooks.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import msgspec
import numpy as np

from workers.errors import (
    BadInput,
    PositionGap,
    SessionExists,
    UnknownSession,
)

DEFAULT_N_CTX = 4608  # positions per session, for every backend and the reference replays are compared with


class Capability(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """What an execution backend reports about itself (seed challenge 7); throughputs are
    measured by a short self-benchmark when the backend starts. The bus announces it as part of
    a node's `CapabilityReport` (neuron_bus/messages.py), so it is a msgspec Struct."""

    model_arch: str
    supported_runtime: str
    supports_prefill: bool
    supports_decode_step: bool
    supports_layer_range: bool
    supports_partial_artifacts: bool
    cache_abi: str
    cache_bytes_per_token_estimate: int  # what a session's cache (and its snapshot) grows by per position
    cache_fixed_bytes: int = 0  # per-session state that does not grow with the context (recurrent layers)
    supports_truncate: bool = True  # the cache can go back to an earlier position (repair's surviving hops)
    prefill_tokens_per_second: float = 0.0
    decode_tokens_per_second: float = 0.0
    active_memory_floor: int = 0


@dataclass
class SessionState:
    session_id: str
    n_ctx: int
    position: int = 0  # next position to be written


class Backend(abc.ABC):
    """Base class: validation and the session table; subclasses do the model work."""

    backend_id: str = "abstract"

    def __init__(self, *, layer_start: int, layer_end: int, n_layers: int, hidden_size: int, vocab_size: int):
        if not 0 <= layer_start < layer_end <= n_layers:
            raise BadInput(f"layer range [{layer_start}, {layer_end}) is outside the model's {n_layers} layers")
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.n_layers = n_layers
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self._sessions: dict[str, SessionState] = {}
        self.forward_calls = 0  # backend model calls (batched calls count once)

    # -- shape of the range ------------------------------------------------------------------

    @property
    def is_head(self) -> bool:
        return self.layer_start == 0

    @property
    def is_tail(self) -> bool:
        return self.layer_end == self.n_layers

    @property
    @abc.abstractmethod
    def capability(self) -> Capability: ...

    def benchmark(self) -> tuple[float, float]:
        """Take the self-benchmark again, now: (prefill, decode) tokens per second, which
        `capability` reports from then on. It runs on scratch state (no session's cache is
        touched). A worker takes it when idle, so that a figure taken while the machine was busy
        (loading other models, say) does not stand for good. A backend without a model to
        measure keeps its figures."""
        c = self.capability
        return c.prefill_tokens_per_second, c.decode_tokens_per_second

    # -- session lifecycle -------------------------------------------------------------------

    def open_session(self, session_id: str, n_ctx: int) -> int:
        """Allocate this range's cache for a session; return its cache bytes."""
        if session_id in self._sessions:
            raise SessionExists(f"session {session_id} is already open")
        if n_ctx <= 0:
            raise BadInput(f"n_ctx must be positive, got {n_ctx}")
        self._open(session_id, n_ctx)
        self._sessions[session_id] = SessionState(session_id, n_ctx)
        return self.cache_bytes(session_id)

    def close_session(self, session_id: str) -> None:
        self._state(session_id)
        self._close(session_id)
        del self._sessions[session_id]

    def sessions(self) -> dict[str, int]:
        """Open sessions and their cache bytes."""
        return {sid: self.cache_bytes(sid) for sid in self._sessions}

    def session_position(self, session_id: str) -> int:
        return self._state(session_id).position

    def cache_bytes(self, session_id: str) -> int:
        self._state(session_id)
        return self._cache_bytes(session_id)

    def kv_positions(self) -> tuple[int, int]:
        """(positions the cache holds for sessions now, positions it may hold; 0: no budget)."""
        return sum(st.n_ctx for st in self._sessions.values()), 0

    def batch_rank(self, session_id: str) -> int:
        """Where the session sits for batching: steps of sessions with consecutive ranks batch best.

        Most backends batch any set of sessions equally well (rank 0 for all); llama.cpp runs only
        consecutive sequence ids in one pass (see `LlamaCppRangeBackend.batch_rank`).
        """
        self._state(session_id)
        return 0

    # -- compute -----------------------------------------------------------------------------

    def prefill(self, session_id: str, position: int, x: np.ndarray) -> np.ndarray:
        """Run a chunk of positions [position, position + n)."""
        return self._run(session_id, position, x)

    def prefill_batch(self, steps: list[tuple[str, int, np.ndarray]]) -> list[np.ndarray]:
        """A prompt chunk for each of several sessions in one call: each output is what `prefill`
        returns for it. Backends that can batch override `_forward_chunks`."""
        return self._run_sessions(steps, self._forward_chunks, "prefill")

    def decode_step(self, session_id: str, position: int, x: np.ndarray) -> np.ndarray:
        """Run exactly one position."""
        n = x.shape[0] if x.ndim else 0
        if n != 1:
            raise BadInput(f"a decode step carries exactly one position, got {n}")
        return self._run(session_id, position, x)

    def decode_batch(self, steps: list[tuple[str, int, np.ndarray]]) -> list[np.ndarray]:
        """One decode step for several sessions; backends that can batch override `_forward_batch`."""
        for sid, pos, x in steps:
            self._check(sid, pos, x)
            if x.shape[0] != 1:
                raise BadInput(f"a decode step carries exactly one position, got {x.shape[0]}")
        outs = self._forward_batch([(sid, pos, self._as_input(x)) for sid, pos, x in steps])
        for sid, _, _ in steps:
            self._advance(sid, 1)
        return outs

    def decode_rows(self, steps: list[tuple[str, int, np.ndarray]]) -> list[np.ndarray]:
        """Decode steps of one or more positions each, for several sessions in one call.

        A speculative step carries the last sampled token and the drafts that may follow it; every
        row is computed and every row's output returned: hidden states [n, hidden], or at the tail
        the logits of every row [n, vocab] (the tail checks each draft against its own choice).
        """
        return self._run_sessions(steps, self._forward_rows, "decode")

    def _run_sessions(self, steps: list[tuple[str, int, np.ndarray]], forward, phase: str) -> list[np.ndarray]:
        """Steps of several sessions (each at most once, any number of positions) through ``forward``."""
        if len({sid for sid, _, _ in steps}) != len(steps):
            raise BadInput(f"a {phase} batch carries each session at most once")
        for sid, pos, x in steps:
            self._check(sid, pos, x)
        outs = forward([(sid, pos, self._as_input(x)) for sid, pos, x in steps])
        for sid, _, x in steps:
            self._advance(sid, x.shape[0])
        return outs

    # -- state export (snapshots) and route repair ------------------------------------------

    def truncate(self, session_id: str, position: int) -> None:
        """Forget positions >= ``position`` (route repair: back to a snapshot, then replay)."""
        st = self._state(session_id)
        if not 0 <= position <= st.position:
            raise BadInput(f"session {session_id}: cannot truncate to {position}, it holds {st.position} positions")
        self._truncate(session_id, position)
        st.position = position

    @property
    def can_export(self) -> bool:
        """Whether a session's cache state can be exported (snapshots, kept prefixes)."""
        return type(self)._export is not Backend._export

    def export_state(self, session_id: str) -> bytes:
        self._state(session_id)
        return self._export(session_id)

    def import_state(self, session_id: str, n_ctx: int, position: int, blob: bytes) -> None:
        """Open ``session_id`` from an exported blob holding positions [0, position) and perhaps more
        (a speculative step's drafts, exported before the next step said which were kept): those
        beyond ``position`` are dropped."""
        if session_id in self._sessions:
            raise SessionExists(f"session {session_id} is already open")
        self._import(session_id, n_ctx, position, blob)
        self._sessions[session_id] = SessionState(session_id, n_ctx, position=position)

    # -- validation --------------------------------------------------------------------------

    def _state(self, session_id: str) -> SessionState:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise UnknownSession(f"unknown or closed session {session_id}") from None

    def _check(self, session_id: str, position: int, x: np.ndarray) -> SessionState:
        st = self._state(session_id)
        if position != st.position:
            raise PositionGap(f"session {session_id}: expected position {st.position}, got {position}")
        if self.is_head:
            if x.ndim != 1 or x.dtype.kind not in "iu":  # numpy's integer dtypes (not bool)
                raise BadInput(f"head input must be a 1-D array of token ids, got {x.dtype}{list(x.shape)}")
            if x.size:  # a decode step's one token is read, not reduced twice (4 us of every head step)
                lo, hi = (int(x[0]),) * 2 if x.size == 1 else (int(x.min()), int(x.max()))
                if lo < 0 or hi >= self.vocab_size:
                    raise BadInput(f"token id out of range [0, {self.vocab_size})")
        else:
            if x.dtype != np.float32:
                raise BadInput(f"hidden states must be float32, got {x.dtype}")
            if x.ndim != 2 or x.shape[1] != self.hidden_size:
                raise BadInput(f"hidden states must have shape [n, {self.hidden_size}], got {list(x.shape)}")
        n = x.shape[0]
        if n == 0:
            raise BadInput("empty input")
        if position + n > st.n_ctx:
            raise BadInput(f"session {session_id}: {position + n} positions exceed n_ctx {st.n_ctx}")
        return st

    def _as_input(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=np.int32 if self.is_head else np.float32)

    def _advance(self, session_id: str, n: int) -> None:
        st = self._sessions[session_id]
        st.position += n

    def _run(self, session_id: str, position: int, x: np.ndarray) -> np.ndarray:
        self._check(session_id, position, x)
        out = self._forward(session_id, position, self._as_input(x))
        self.forward_calls += 1
        self._advance(session_id, x.shape[0])
        return out

    # -- hooks -------------------------------------------------------------------------------

    @abc.abstractmethod
    def _open(self, session_id: str, n_ctx: int) -> None: ...

    @abc.abstractmethod
    def _close(self, session_id: str) -> None: ...

    @abc.abstractmethod
    def _cache_bytes(self, session_id: str) -> int: ...

    @abc.abstractmethod
    def _forward(self, session_id: str, position: int, x: np.ndarray) -> np.ndarray: ...

    def _forward_batch(self, steps: list[tuple[str, int, np.ndarray]]) -> list[np.ndarray]:
        outs = [self._forward(sid, pos, x) for sid, pos, x in steps]
        self.forward_calls += len(steps)
        return outs

    def _forward_chunks(self, steps: list[tuple[str, int, np.ndarray]]) -> list[np.ndarray]:
        outs = [self._forward(sid, pos, x) for sid, pos, x in steps]
        self.forward_calls += len(steps)
        return outs

    def _forward_rows(self, steps: list[tuple[str, int, np.ndarray]]) -> list[np.ndarray]:
        """Every row's output of each step (see `decode_rows`); hidden states are per row already."""
        if self.is_tail:
            raise NotImplementedError(f"{self.backend_id} cannot return the logits of every row")
        outs = [self._forward(sid, pos, x) for sid, pos, x in steps]
        self.forward_calls += len(steps)
        return outs

    def _truncate(self, session_id: str, position: int) -> None:
        raise NotImplementedError(f"{self.backend_id} cannot truncate a session's cache")

    def _export(self, session_id: str) -> bytes:
        raise NotImplementedError(f"{self.backend_id} cannot export cache state")

    def _import(self, session_id: str, n_ctx: int, position: int, blob: bytes) -> None:
        raise NotImplementedError(f"{self.backend_id} cannot import cache state")

    def close(self) -> None:
        """Free every session and the model."""
        for sid in list(self._sessions):
            self.close_session(sid)
