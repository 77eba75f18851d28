"""llama.cpp layer-range backend: one slice GGUF, one context, one KV stream per session.

The head takes token ids, every other hop takes hidden states (a batch made with
``llama_batch_init(n, n_embd, 1)``); every non-tail hop returns the residual output of its last
layer, read in the eval callback (see ``llama_cpp_common.LayerOutputTap``); the tail returns the
logits of the last row. Sessions map to llama.cpp sequence ids of one context whose KV streams
are separate (``kv_unified`` off), so sessions never see each other's cells and several of them
can decode in one ``llama_decode``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from workers.errors import BadInput, UnsupportedModel
from workers.llama_cpp_common import ContextConfig, LlamaCppModel, NoFreeSlot, Rows, read_metadata
from workers.protocol import DEFAULT_N_CTX, Backend, Capability

DEFAULT_SESSIONS = 4  # session slots per context
DEFAULT_N_BATCH = 512  # rows per llama_decode (longer prefill chunks are run in pieces)


def _file_layers(path: Path) -> int:
    """How many blocks the GGUF at ``path`` holds (a vocab-only read: fast)."""
    arch = read_metadata(path, ["general.architecture"])["general.architecture"]
    count = read_metadata(path, [f"{arch}.block_count"])[f"{arch}.block_count"]
    if count is None:
        raise UnsupportedModel(f"{path} states no {arch}.block_count")
    return int(count)


class LlamaCppRangeBackend(Backend):
    """Layers [layer_start, layer_end) of a model of ``n_layers`` layers, on llama.cpp.

    ``path`` holds exactly those layers: a slice GGUF of the range (the bus cuts and caches it,
    neuron_bus/execution.py) or, for the whole range, the model itself (no range given).
    """

    backend_id = "llama-cpp"

    def __init__(
        self,
        path: str | Path,
        layer_start: int | None = None,
        layer_end: int | None = None,
        *,
        n_layers: int | None = None,
        n_threads: int = 1,
        n_ctx: int = DEFAULT_N_CTX,
        max_sessions: int = DEFAULT_SESSIONS,
        n_batch: int = DEFAULT_N_BATCH,
        flash_attn: bool = True,
        kv_type: str = "f16",
        benchmark: bool = True,
        native_tap: bool = True,
    ):
        file = Path(path)
        held = _file_layers(file)
        if layer_start is None and layer_end is None:  # the whole model
            layer_start, layer_end, n_layers = 0, held, held if n_layers is None else n_layers
        if layer_start is None or layer_end is None or n_layers is None:
            raise BadInput("a layer range needs its start, end and the model's n_layers")
        start, end = layer_start, layer_end
        if not 0 <= start < end <= n_layers:
            raise BadInput(f"layer range [{start}, {end}) is outside the model's {n_layers} layers")
        if end - start != held:
            raise BadInput(f"{file} holds {held} layers, not layers {start}-{end - 1}: load a slice of that range")
        self.file = file
        self.config = ContextConfig(flash_attn=flash_attn, kv_type=kv_type)
        self.model = LlamaCppModel(
            file,
            n_ctx_slot=n_ctx,
            n_slots=max_sessions,
            n_batch=n_batch,
            n_threads=n_threads,
            config=self.config,
            tap_output=end < n_layers,
            native_tap=native_tap,
        )
        super().__init__(
            layer_start=start,
            layer_end=end,
            n_layers=n_layers,
            hidden_size=self.model.n_embd,
            vocab_size=self.model.n_vocab,
        )
        self._seq: dict[str, int] = {}  # session -> llama.cpp sequence id
        self._free = list(range(max_sessions))
        rng = np.random.default_rng(0)
        self.state_bytes_per_token, self.state_fixed_bytes, self.truncatable = self.model.measure_state(
            0, self.is_head, rng
        )
        self.prefill_tps = 0.0
        self.decode_tps = 0.0
        if benchmark:
            self.prefill_tps, self.decode_tps = self._benchmark()

    # -- what this backend is ----------------------------------------------------------------

    @property
    def slot_bytes(self) -> int:
        """Cache and state one session slot holds for this file's layers at its full n_ctx."""
        return self.model.n_ctx_slot * self.state_bytes_per_token + self.state_fixed_bytes

    @property
    def capability(self) -> Capability:
        return Capability(
            model_arch=self.model.arch,
            supported_runtime="llama.cpp",
            supports_prefill=True,
            supports_decode_step=True,
            supports_layer_range=True,
            supports_partial_artifacts=True,
            cache_abi=self.cache_abi,
            cache_bytes_per_token_estimate=self.state_bytes_per_token,
            cache_fixed_bytes=self.state_fixed_bytes,
            supports_truncate=self.truncatable,
            prefill_tokens_per_second=self.prefill_tps,
            decode_tokens_per_second=self.decode_tps,
            # weights (mmapped file) + the KV of every slot, allocated when the context is made
            active_memory_floor=os.path.getsize(self.file) + self.slot_bytes * self.model.n_slots,
        )

    @property
    def cache_abi(self) -> str:
        return self.config.cache_abi

    @property
    def n_ctx(self) -> int:
        """Positions one session can hold."""
        return self.model.n_ctx_slot

    # -- hooks -------------------------------------------------------------------------------

    def _take_slot(self, session_id: str, n_ctx: int) -> int:
        if n_ctx > self.model.n_ctx_slot:
            raise BadInput(f"n_ctx {n_ctx} exceeds this worker's {self.model.n_ctx_slot} positions per session")
        if not self._free:
            raise NoFreeSlot(f"all {self.model.n_slots} session slots are in use")
        seq = self._free.pop(0)
        self.model.clear(seq)
        self._seq[session_id] = seq
        return seq

    def _release_slot(self, session_id: str) -> None:
        seq = self._seq.pop(session_id)
        self.model.clear(seq)
        self._free.append(seq)
        self._free.sort()

    def _open(self, session_id: str, n_ctx: int) -> None:
        self._take_slot(session_id, n_ctx)

    def _close(self, session_id: str) -> None:
        self._release_slot(session_id)

    def batch_rank(self, session_id: str) -> int:
        # Each session is a sequence with its own KV stream; llama.cpp splits such a batch into
        # passes of consecutive sequence ids (split_equal, sequential). Steps of slots 0-3 run as
        # one pass, steps of slots 0, 2, 4, 6 as four: 55% slower for a 4-step wave here.
        self._state(session_id)
        return self._seq[session_id]

    def _cache_bytes(self, session_id: str) -> int:
        # The slot's cache and state for this file's layers, reserved for the session's lifetime.
        return self.slot_bytes

    @property
    def _want(self) -> str:
        return "logits" if self.is_tail else "hidden"

    def _forward(self, session_id: str, position: int, x: np.ndarray) -> np.ndarray:
        seq = self._seq[session_id]
        step = self.model.n_batch
        try:
            outs = [
                self.model.decode([Rows(seq, position + i, x[i : i + step])], self._want)[0]
                for i in range(0, x.shape[0], step)
            ]
        except BaseException:
            self.model.forget_from(seq, position)  # a failed call leaves no cells behind
            raise
        return outs[-1] if self.is_tail else np.concatenate(outs)

    def _forward_batch(self, steps: list[tuple[str, int, np.ndarray]]) -> list[np.ndarray]:
        if len(steps) > self.model.n_batch or len({sid for sid, _, _ in steps}) != len(steps):
            return super()._forward_batch(steps)
        return self._decode_together(steps, self._want)

    def _forward_rows(self, steps: list[tuple[str, int, np.ndarray]]) -> list[np.ndarray]:
        # Steps of equal length run together: llama.cpp splits a batch of several sequences into
        # micro-batches of equally many rows per sequence, and the boundary tap sees the rows in
        # micro-batch order, which is the batch's order only when every sequence has as many rows.
        by_length: dict[int, list[int]] = {}
        for k, (_, _, x) in enumerate(steps):
            by_length.setdefault(x.shape[0], []).append(k)
        result: list[np.ndarray] = [None] * len(steps)  # type: ignore[list-item]
        for ks in by_length.values():
            if sum(steps[k][2].shape[0] for k in ks) > self.model.n_batch:
                raise BadInput(f"a decode batch of more than {self.model.n_batch} rows")
            for k, out in zip(ks, self._decode_together([steps[k] for k in ks], "rows" if self.is_tail else "hidden")):
                result[k] = out
        return result

    def _decode_together(self, steps: list[tuple[str, int, np.ndarray]], want: str) -> list[np.ndarray]:
        """One llama_decode for ``steps`` (distinct sessions); a failed call leaves no cells behind."""
        # Rows in sequence-id order: the order llama.cpp runs sequences of one batch in.
        order = sorted(range(len(steps)), key=lambda k: self._seq[steps[k][0]])
        parts = [Rows(self._seq[steps[k][0]], steps[k][1], steps[k][2]) for k in order]
        try:
            outs = self.model.decode(parts, want)
        except BaseException:
            for part in parts:
                self.model.forget_from(part.seq_id, part.position)
            raise
        self.forward_calls += 1
        result: list[np.ndarray] = [None] * len(steps)  # type: ignore[list-item]
        for k, out in zip(order, outs):
            result[k] = out
        return result

    def _truncate(self, session_id: str, position: int) -> None:
        if position == self.session_position(session_id):
            return  # nothing to drop
        if not self.model.forget_from(self._seq[session_id], position):
            raise UnsupportedModel(
                f"{self.model.arch}: llama.cpp keeps only the newest recurrent state of a session and "
                f"cannot take it back to position {position} (restore a snapshot of that position instead)"
            )

    def _export(self, session_id: str) -> bytes:
        return self.model.seq_state(self._seq[session_id])

    def _import(self, session_id: str, n_ctx: int, position: int, blob: bytes) -> None:
        seq = self._take_slot(session_id, n_ctx)
        try:
            self.model.set_seq_state(seq, blob)
            held = self.model.seq_pos_max(seq) + 1
            if held < position or (held > position and not self.model.forget_from(seq, position)):
                raise BadInput(f"the state holds {held} positions, not {position}")
        except BaseException:
            self._release_slot(session_id)
            raise

    # -- self-benchmark ----------------------------------------------------------------------

    def _benchmark(self, n_prefill: int = 32, n_decode: int = 8) -> tuple[float, float]:
        """Prefill and decode tokens/s on a scratch sequence (runs once, at construction)."""
        seq = self._free[0]
        rng = np.random.default_rng(0)
        if self.is_head:
            rows = rng.integers(0, self.vocab_size, size=n_prefill + n_decode, dtype=np.int32)
        else:
            rows = rng.standard_normal((n_prefill + n_decode, self.hidden_size)).astype(np.float32)
        n_prefill = min(n_prefill, self.model.n_batch, self.model.n_ctx_slot - n_decode)
        try:
            t0 = time.perf_counter()
            self.model.decode([Rows(seq, 0, rows[:n_prefill])], self._want)
            t1 = time.perf_counter()
            for i in range(n_prefill, n_prefill + n_decode):
                self.model.decode([Rows(seq, i, rows[i : i + 1])], self._want)
            t2 = time.perf_counter()
        finally:
            self.model.clear(seq)
        return n_prefill / max(t1 - t0, 1e-9), n_decode / max(t2 - t1, 1e-9)

    def close(self) -> None:
        super().close()
        self.model.close()
