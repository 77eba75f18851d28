"""llama.cpp layer-range backend: one slice GGUF, a KV pool of llama.cpp contexts, one KV stream
per session.

The head takes token ids, every other hop takes hidden states (a batch made with
``llama_batch_init(n, n_embd, 1)``); every non-tail hop returns the residual output of its last
layer, read in the eval callback (see ``llama_cpp_common.LayerOutputTap``); the tail returns the
logits of the last row. Sessions are admitted by the positions they need (kv_pool.py): each holds
a stream of a lane, a context whose KV streams are separate (``kv_unified`` off), so sessions never
see each other's cells, a session's results do not depend on its neighbours, and several sessions
of a lane decode in one ``llama_decode``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from workers.errors import BadInput, UnsupportedModel
from workers.kv_pool import GRANULE, KvPool, round_up
from workers.llama_cpp_common import ContextConfig, LlamaCppModel, Rows, Weights
from workers.llama_cpp_lanes import Lanes
from workers.protocol import DEFAULT_N_CTX, Backend, Capability

DEFAULT_SESSIONS = 4  # sessions of n_ctx positions the KV budget holds when none is given
DEFAULT_N_BATCH = 512  # rows per llama_decode (longer prefill chunks are run in pieces)


def _blocks(weights: Weights) -> int:
    """How many blocks the loaded file holds, as its metadata states (llama_model_n_layer leaves out
    the multi-token-prediction blocks of GLM-4.5 and GLM-5)."""
    count = weights.meta(f"{weights.arch}.block_count")
    if count is None:
        raise UnsupportedModel(f"{weights.path} states no {weights.arch}.block_count")
    return int(count)


def _check_range(
    file: Path, start: int | None, end: int | None, n_layers: int | None, held: int
) -> tuple[int, int, int]:
    """The range [start, end) of a model of ``n_layers`` layers, checked against the ``held`` blocks of ``file``."""
    if start is None and end is None:  # the whole model
        start, end, n_layers = 0, held, held if n_layers is None else n_layers
    if start is None or end is None or n_layers is None:
        raise BadInput("a layer range needs its start, end and the model's n_layers")
    if not 0 <= start < end <= n_layers:
        raise BadInput(f"layer range [{start}, {end}) is outside the model's {n_layers} layers")
    if end - start != held:
        raise BadInput(f"{file} holds {held} layers, not layers {start}-{end - 1}: load a slice of that range")
    return start, end, n_layers


class LlamaCppRangeBackend(Backend):
    """Layers [layer_start, layer_end) of a model of ``n_layers`` layers, on llama.cpp.

    ``path`` holds exactly those layers: a slice GGUF of the range (the bus cuts and caches it,
    neuron_bus/execution.py) or, for the whole range, the model itself (no range given).
    ``n_ctx``: the most positions one session may hold; the KV pool holds ``kv_budget`` positions
    (or ``kv_budget_bytes`` of them), by default ``max_sessions`` sessions of ``n_ctx``.
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
        kv_budget: int | None = None,
        kv_budget_bytes: int | None = None,
        n_batch: int = DEFAULT_N_BATCH,
        flash_attn: bool = True,
        kv_type: str = "f16",
        benchmark: bool = True,
        native_tap: bool = True,
    ):
        file = Path(path)
        if n_ctx <= 0 or max_sessions <= 0 or n_batch <= 0:
            raise BadInput("n_ctx, max_sessions and n_batch must be positive")
        self.file = file
        self.config = ContextConfig(flash_attn=flash_attn, kv_type=kv_type)
        self.n_batch, self.n_threads, self.native_tap = n_batch, n_threads, native_tap
        self.weights = Weights(file)
        try:
            start, end, n_layers = _check_range(file, layer_start, layer_end, n_layers, _blocks(self.weights))
            super().__init__(
                layer_start=start,
                layer_end=end,
                n_layers=n_layers,
                hidden_size=self.weights.n_embd,
                vocab_size=self.weights.n_vocab,
            )
            self._measure(benchmark)
            positions = round_up(n_ctx, GRANULE)
            budget = self._budget(kv_budget, kv_budget_bytes, max_sessions * positions)
            overhead = -(-self.lane_overhead_bytes // max(self.state_bytes_per_token, 1))
            self.lanes = Lanes(KvPool(budget, positions, overhead=overhead), self._context)
        except BaseException:
            self.weights.close()
            raise

    def _context(self, streams: int, positions: int) -> LlamaCppModel:
        """A llama.cpp context of ``streams`` KV streams of ``positions`` each, on the loaded weights."""
        return LlamaCppModel(
            self.weights,
            n_ctx_slot=positions,
            n_slots=streams,
            n_batch=self.n_batch,
            n_threads=self.n_threads,
            config=self.config,
            tap_output=not self.is_tail,
            native_tap=self.native_tap,
        )

    def _measure(self, benchmark: bool) -> None:
        """State bytes per position (and fixed), truncatability, and throughput, on a scratch context."""
        with self._scratch() as scratch:
            rng = np.random.default_rng(0)
            self.state_bytes_per_token, self.state_fixed_bytes, self.truncatable = scratch.measure_state(
                0, self.is_head, rng
            )
            self.prefill_tps, self.decode_tps = self._benchmark(scratch) if benchmark else (0.0, 0.0)

    @contextmanager
    def _scratch(self) -> Iterator[LlamaCppModel]:
        """A one-stream context on the loaded weights, beside the sessions' lanes, closed after use."""
        scratch = self._context(1, GRANULE)
        try:
            yield scratch
        finally:
            scratch.close()

    def _budget(self, positions: int | None, nbytes: int | None, default: int) -> int:
        if positions is not None and nbytes is not None:
            raise BadInput("give the KV budget in positions or in bytes, not both")
        if nbytes is not None:
            positions = nbytes // max(self.state_bytes_per_token, 1)
        budget = default if positions is None else positions
        if budget <= 0:
            raise BadInput(f"the KV budget must hold at least one position, not {budget}")
        return budget

    # -- what this backend is ----------------------------------------------------------------

    @property
    def lane_overhead_bytes(self) -> int:
        """What a lane's context holds besides its KV: llama.cpp's output buffer, sized for its
        outputs (every row of a batch on a hop that hands hidden states on, the last rows at the
        tail), and the compute buffer (the activations of one batch)."""
        outputs = self.n_batch if not self.is_tail else 64
        return 4 * (outputs * self.vocab_size + 16 * self.n_batch * self.hidden_size)

    @property
    def kv_budget_bytes(self) -> int:
        """Memory the KV pool may take: every lane's KV and buffers together."""
        return self.lanes.pool.budget * self.state_bytes_per_token

    @property
    def capability(self) -> Capability:
        return Capability(
            model_arch=self.weights.arch,
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
            # weights (mmapped file) + the KV pool at its fullest (lanes are made as sessions need them)
            active_memory_floor=os.path.getsize(self.file) + self.kv_budget_bytes,
        )

    @property
    def cache_abi(self) -> str:
        return self.config.cache_abi

    @property
    def n_ctx(self) -> int:
        """Positions one session can hold."""
        return self.lanes.pool.max_positions

    def kv_positions(self) -> tuple[int, int]:
        return self.lanes.pool.reserved, self.lanes.pool.budget

    # -- hooks -------------------------------------------------------------------------------

    def _take_slot(self, session_id: str, n_ctx: int) -> None:
        if n_ctx > self.n_ctx:
            raise BadInput(f"n_ctx {n_ctx} exceeds this worker's {self.n_ctx} positions per session")
        self.lanes.take(session_id, n_ctx)

    def _open(self, session_id: str, n_ctx: int) -> None:
        self._take_slot(session_id, n_ctx)

    def _close(self, session_id: str) -> None:
        self.lanes.release(session_id)

    def batch_rank(self, session_id: str) -> int:
        # Each session is a sequence with its own KV stream; llama.cpp splits such a batch into
        # passes of consecutive sequence ids (split_equal, sequential), and runs one context per
        # call: steps of streams 0-3 of one lane run as one pass, streams 0, 2, 4, 6 as four (55%
        # slower for a 4-step wave here), steps of two lanes as two calls.
        self._state(session_id)
        return self.lanes.rank(session_id)

    def _cache_bytes(self, session_id: str) -> int:
        # The stream's cache and state for this file's layers, reserved for the session's lifetime.
        return self.lanes.slot(session_id).positions * self.state_bytes_per_token + self.state_fixed_bytes

    @property
    def _want(self) -> str:
        return "logits" if self.is_tail else "hidden"

    def _forward(self, session_id: str, position: int, x: np.ndarray) -> np.ndarray:
        model, seq = self.lanes.context(session_id), self.lanes.seq(session_id)
        step = self.n_batch
        try:
            outs = [
                model.decode([Rows(seq, position + i, x[i : i + step])], self._want)[0]
                for i in range(0, x.shape[0], step)
            ]
        except BaseException:
            model.forget_from(seq, position)  # a failed call leaves no cells behind
            raise
        return outs[-1] if self.is_tail else np.concatenate(outs)

    def _forward_batch(self, steps: list[tuple[str, int, np.ndarray]]) -> list[np.ndarray]:
        if len(steps) > self.n_batch or len({sid for sid, _, _ in steps}) != len(steps):
            return super()._forward_batch(steps)
        return self._decode_together(steps, self._want)

    def _forward_rows(self, steps: list[tuple[str, int, np.ndarray]]) -> list[np.ndarray]:
        result: list[np.ndarray] = [None] * len(steps)  # type: ignore[list-item]
        for ks in self._equal_lengths(steps):
            if sum(steps[k][2].shape[0] for k in ks) > self.n_batch:
                raise BadInput(f"a decode batch of more than {self.n_batch} rows")
            for k, out in zip(ks, self._decode_together([steps[k] for k in ks], "rows" if self.is_tail else "hidden")):
                result[k] = out
        return result

    def _forward_chunks(self, steps: list[tuple[str, int, np.ndarray]]) -> list[np.ndarray]:
        # Chunks of equal length run together, as many as fit in n_batch rows; a longer chunk alone.
        result: list[np.ndarray] = [None] * len(steps)  # type: ignore[list-item]
        try:
            for ks in self._equal_lengths(steps):
                rows = steps[ks[0]][2].shape[0]
                if rows > self.n_batch:
                    for k in ks:
                        result[k] = self._forward(*steps[k])
                        self.forward_calls += 1
                    continue
                per_call = self.n_batch // rows
                for i in range(0, len(ks), per_call):
                    part = ks[i : i + per_call]
                    for k, out in zip(part, self._decode_together([steps[k] for k in part], self._want)):
                        result[k] = out
        except BaseException:  # a failed batch leaves no cells behind, those of its earlier calls neither
            for sid, position, _ in steps:
                self.lanes.context(sid).forget_from(self.lanes.seq(sid), position)
            raise
        return result

    @staticmethod
    def _equal_lengths(steps: list[tuple[str, int, np.ndarray]]) -> list[list[int]]:
        """Indices of the steps grouped by their number of rows: llama.cpp splits a batch of several
        sequences into micro-batches of equally many rows per sequence, and the boundary tap sees the
        rows in micro-batch order, which is the batch's order only when every sequence has as many."""
        by_length: dict[int, list[int]] = {}
        for k, (_, _, x) in enumerate(steps):
            by_length.setdefault(x.shape[0], []).append(k)
        return list(by_length.values())

    def _decode_together(self, steps: list[tuple[str, int, np.ndarray]], want: str) -> list[np.ndarray]:
        """One llama_decode per lane for ``steps`` (distinct sessions); a failed call leaves no cells behind."""
        result: list[np.ndarray] = [None] * len(steps)  # type: ignore[list-item]
        for group in self.lanes.groups([sid for sid, _, _ in steps]):
            # Rows in sequence-id order: the order llama.cpp runs sequences of one batch in.
            model = self.lanes.context(steps[group[0]][0])
            parts = [Rows(self.lanes.seq(steps[k][0]), steps[k][1], steps[k][2]) for k in group]
            try:
                outs = model.decode(parts, want)
            except BaseException:
                for part in parts:
                    model.forget_from(part.seq_id, part.position)
                raise
            self.forward_calls += 1
            for k, out in zip(group, outs):
                result[k] = out
        return result

    def _truncate(self, session_id: str, position: int) -> None:
        if position == self.session_position(session_id):
            return  # nothing to drop
        if not self.lanes.context(session_id).forget_from(self.lanes.seq(session_id), position):
            raise UnsupportedModel(
                f"{self.weights.arch}: llama.cpp keeps only the newest recurrent state of a session and "
                f"cannot take it back to position {position} (restore a snapshot of that position instead)"
            )

    def _export(self, session_id: str) -> bytes:
        return self.lanes.context(session_id).seq_state(self.lanes.seq(session_id))

    def _import(self, session_id: str, n_ctx: int, position: int, blob: bytes) -> None:
        self._take_slot(session_id, n_ctx)
        model, seq = self.lanes.context(session_id), self.lanes.seq(session_id)
        try:
            model.set_seq_state(seq, blob)
            held = model.seq_pos_max(seq) + 1
            if held < position or (held > position and not model.forget_from(seq, position)):
                raise BadInput(f"the state holds {held} positions, not {position}")
        except BaseException:
            self.lanes.release(session_id)
            raise

    # -- self-benchmark ----------------------------------------------------------------------

    def benchmark(self) -> tuple[float, float]:
        with self._scratch() as scratch:
            self.prefill_tps, self.decode_tps = self._benchmark(scratch)
        return self.prefill_tps, self.decode_tps

    def _benchmark(self, model: LlamaCppModel, n_prefill: int = 32, n_decode: int = 8) -> tuple[float, float]:
        """Prefill and decode tokens/s on sequence 0 of a scratch context."""
        rng = np.random.default_rng(0)
        if self.is_head:
            rows = rng.integers(0, self.vocab_size, size=n_prefill + n_decode, dtype=np.int32)
        else:
            rows = rng.standard_normal((n_prefill + n_decode, self.hidden_size)).astype(np.float32)
        n_prefill = min(n_prefill, self.n_batch, model.n_ctx_slot - n_decode)
        try:
            t0 = time.perf_counter()
            model.decode([Rows(0, 0, rows[:n_prefill])], self._want)
            t1 = time.perf_counter()
            for i in range(n_prefill, n_prefill + n_decode):
                model.decode([Rows(0, i, rows[i : i + 1])], self._want)
            t2 = time.perf_counter()
        finally:
            model.clear(0)
        return n_prefill / max(t1 - t0, 1e-9), n_decode / max(t2 - t1, 1e-9)

    def close(self) -> None:
        super().close()
        self.lanes.close()
        self.weights.close()
