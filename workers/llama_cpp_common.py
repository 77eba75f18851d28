"""llama.cpp through llama-cpp-python's low-level API: what the full-model and layer-range
backends share.

- ``ggml``: ctypes bindings of the few ggml functions the boundary tap needs, from the ggml
  library that llama-cpp-python bundles (the very one libllama is linked against).
- ``ContextConfig``: every context setting that changes numerics (flash attention, KV dtype)
  lives here and is spelled out in ``cache_abi``; slices and the full-model reference must agree.
- ``LayerOutputTap``: the context's eval callback; it copies the residual output of the last
  layer (graph node ``l_out-<n-1>``) and returns False, which stops the graph there (no output
  norm, no lm_head on non-tail hops). ``NativeLayerOutputTap`` is the same callback in C
  (workers/native_tap.py), the default wherever a C compiler is: llama.cpp calls it for every
  graph node, which costs a Python callback half a millisecond per decode.
- ``Weights``: a loaded GGUF, shared by the contexts made on it; ``LlamaCppModel``: one context
  with one KV stream per session slot; it runs rows of tokens or hidden states for one or several
  sequences in one ``llama_decode``.

These names are llama.cpp internals; llama-cpp-python is pinned and tests/test_llama_cpp_backend.py
pins the node name and the early-stop behaviour.
"""

from __future__ import annotations

import ctypes
import pathlib
import threading
from dataclasses import dataclass

import llama_cpp as L
import numpy as np

from workers import native_tap
from workers.errors import BackendError, BadInput, NoFreeSlot, Reason, UnsupportedModel

_LIB_DIR = pathlib.Path(L.__file__).resolve().parent / "lib"
__all__ = ["NoFreeSlot"]  # the KV pool raises it (workers/kv_pool.py); importable from here as before

# Node name of the residual stream after layer `il` in llama.cpp's graphs (pinned by a test), and
# the architectures whose graphs name it otherwise. Nemotron-H calls its residual
# ``nemotron_h_block_out`` and uses ``l_out`` for the FFN output *before* the residual add: a tap
# on ``l_out`` there runs without error and hands the next hop the wrong tensor.
LAYER_OUTPUT_NODE = "l_out-{il}"
LAYER_OUTPUT_NODES = {
    "nemotron_h": "nemotron_h_block_out-{il}",
    "nemotron_h_moe": "nemotron_h_block_out-{il}",
}


def layer_output_node(arch: str, il: int) -> str:
    """The graph node holding the residual stream after layer ``il`` of an ``arch`` model."""
    return LAYER_OUTPUT_NODES.get(arch, LAYER_OUTPUT_NODE).format(il=il)


_KV_TYPES = {"f16": L.GGML_TYPE_F16, "f32": L.GGML_TYPE_F32, "q8_0": L.GGML_TYPE_Q8_0}


class LlamaCppError(BackendError):
    """llama.cpp refused: model load, context creation or decode failed."""

    reason = Reason.LLAMA_CPP_ERROR


# -- ggml, from the bundled library ----------------------------------------------------------


class _Ggml:
    """The ggml functions the tap needs, bound once from llama-cpp-python's libggml-base."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(str(_LIB_DIR / "libggml-base.so"))
        self.get_name = lib.ggml_get_name
        self.get_name.argtypes = [ctypes.c_void_p]
        self.get_name.restype = ctypes.c_char_p
        self.nbytes = lib.ggml_nbytes
        self.nbytes.argtypes = [ctypes.c_void_p]
        self.nbytes.restype = ctypes.c_size_t
        self.nrows = lib.ggml_nrows
        self.nrows.argtypes = [ctypes.c_void_p]
        self.nrows.restype = ctypes.c_int64
        self.tensor_get = lib.ggml_backend_tensor_get
        self.tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self.tensor_get.restype = None
        self._lib = lib


_ggml: _Ggml | None = None
_init_lock = threading.Lock()
_log_cb = None
_errors: list[str] = []  # llama.cpp's error log, kept so a failure can say what llama.cpp said


def ggml() -> _Ggml:
    global _ggml
    with _init_lock:
        if _ggml is None:
            _ggml = _Ggml()
        return _ggml


def quiet_logs() -> None:
    """Send llama.cpp's info logs nowhere (errors still reach stderr)."""
    global _log_cb
    if _log_cb is not None:
        return

    @L.llama_log_callback
    def _cb(level, text, _user):  # GGML_LOG_LEVEL_ERROR == 4
        if level == 4 and text:
            import sys

            line = text.decode("utf-8", "replace")
            sys.stderr.write(line)
            _errors.append(line)
            del _errors[:-64]

    _log_cb = _cb
    L.llama_log_set(_log_cb, ctypes.c_void_p())
    L.llama_backend_init()


# -- numerics-affecting settings --------------------------------------------------------------


@dataclass(frozen=True)
class ContextConfig:
    """Settings that change numerics: equal configs give bit-identical results across slices."""

    flash_attn: bool = True  # the low-level default (AUTO) resolves to on for CPU; say it explicitly
    kv_type: str = "f16"

    def __post_init__(self) -> None:
        if self.kv_type not in _KV_TYPES:
            raise BadInput(f"kv_type must be one of {sorted(_KV_TYPES)}, got {self.kv_type!r}")

    @property
    def cache_abi(self) -> str:
        return f"llama.cpp-{L.__version__}-fa{int(self.flash_attn)}-{self.kv_type}kv"


# -- the boundary tap --------------------------------------------------------------------------


class LayerOutputTap:
    """Eval callback: copy the last layer's residual output (node ``l_out-<n_layer-1>`` in most
    architectures, see ``layer_output_node``) every ubatch, and stop the graph there.

    llama_decode may split a batch into several ubatches; each one runs the graph once, so the
    rows are collected in call order and concatenated by ``take``. This is the Python callback:
    the fallback where no C compiler is, and the reference the native one is tested against.
    """

    native = False

    def __init__(self, n_layer: int, n_embd: int, arch: str = "llama"):
        self.node = layer_output_node(arch, n_layer - 1).encode()
        self.n_embd = n_embd
        self.armed = False  # only decodes of a non-tail hop read the boundary
        self._chunks: list[np.ndarray | None] = []  # None: a node of the wrong shape (take() says so)
        self.trace: list[str] | None = None  # set to [] to record the nodes offered (tests)
        self._g = ggml()
        self.callback = L.ggml_backend_sched_eval_callback(self._eval)
        self.user_data = None

    def _eval(self, tensor, ask, _user) -> bool:
        if not self.armed:
            return not ask  # observe nothing, never stop
        g = self._g
        if ask:
            name = g.get_name(tensor)
            if self.trace is not None:
                self.trace.append(name.decode())
            return name == self.node
        if g.get_name(tensor) != self.node:
            return True
        nbytes = g.nbytes(tensor)
        rows = g.nrows(tensor)
        if nbytes != rows * self.n_embd * 4:
            self._chunks.append(None)  # not f32 [rows, n_embd]: reported by take()
            return False
        out = np.empty((rows, self.n_embd), dtype=np.float32)
        g.tensor_get(tensor, out.ctypes.data, 0, nbytes)
        self._chunks.append(out)
        return False  # stop: the rest of the graph (output norm, lm_head) is not needed

    def take_nothing(self) -> None:
        self._chunks = []

    def take(self) -> np.ndarray:
        chunks, self._chunks = self._chunks, []
        if not chunks:
            raise _never_computed(self.node)
        rows = [c for c in chunks if c is not None]
        if len(rows) != len(chunks):
            raise _wrong_shape(self.node)
        return np.concatenate(rows) if len(rows) > 1 else rows[0]


def _never_computed(node: bytes) -> LlamaCppError:
    return LlamaCppError(f"graph node {node.decode()} was never computed")


def _wrong_shape(node: bytes) -> LlamaCppError:
    return LlamaCppError(f"graph node {node.decode()} is not a float32 [rows, n_embd] tensor")


class NativeLayerOutputTap:
    """`LayerOutputTap` in C (workers/native_tap.py): the same calls, the same results, no Python
    per graph node. Each ubatch's rows are appended to one buffer of ``capacity`` rows."""

    native = True
    TRACE_BYTES = 1 << 20

    def __init__(self, lib: ctypes.CDLL, n_layer: int, n_embd: int, arch: str = "llama", capacity: int = 512):
        self.n_embd = n_embd
        self._buf = np.empty((capacity, n_embd), dtype=np.float32)
        self._trace_buf: ctypes.Array | None = None
        g = ggml()
        st = self._state = native_tap.TapState()
        for field in ("get_name", "nbytes", "nrows", "tensor_get"):
            setattr(st, field, ctypes.cast(getattr(g, field), ctypes.c_void_p).value)
        st.n_embd, st.buf, st.cap = n_embd, self._buf.ctypes.data, self._buf.nbytes
        self.node = layer_output_node(arch, n_layer - 1).encode()
        self.callback = ctypes.cast(lib.neuron_tap_eval, L.ggml_backend_sched_eval_callback)
        self.user_data = ctypes.cast(ctypes.pointer(st), ctypes.c_void_p)

    @property
    def node(self) -> bytes:
        return self._state.node

    @node.setter
    def node(self, name: bytes) -> None:
        if len(name) >= 64:
            raise BadInput(f"graph node name {name!r} is longer than 63 bytes")
        self._state.node = name

    @property
    def armed(self) -> bool:
        return bool(self._state.armed)

    @armed.setter
    def armed(self, on: bool) -> None:
        self._state.armed = int(on)

    @property
    def trace(self) -> list[str] | None:
        """The names of the nodes offered since tracing was set on (``trace = []``); None: off."""
        if self._trace_buf is None:
            return None
        return ctypes.string_at(self._trace_buf, self._state.trace_used).decode().splitlines()

    @trace.setter
    def trace(self, value: list[str] | None) -> None:
        self._trace_buf = None if value is None else ctypes.create_string_buffer(self.TRACE_BYTES)
        self._state.trace = None if self._trace_buf is None else ctypes.cast(self._trace_buf, ctypes.c_void_p).value
        self._state.trace_cap, self._state.trace_used = (self.TRACE_BYTES if value is not None else 0), 0

    def take_nothing(self) -> None:
        st = self._state
        st.used = st.chunks = st.bad = 0

    def take(self) -> np.ndarray:
        st = self._state
        chunks, bad, rows = st.chunks, st.bad, st.used // (self.n_embd * 4)
        self.take_nothing()
        if bad == 2:
            raise LlamaCppError(f"more boundary rows than the tap's buffer of {self._buf.shape[0]}")
        if bad:
            raise _wrong_shape(self.node)
        if not chunks:
            raise _never_computed(self.node)
        return self._buf[:rows].copy()


def layer_output_tap(
    n_layer: int, n_embd: int, arch: str, capacity: int, native: bool = True
) -> LayerOutputTap | NativeLayerOutputTap:
    """The native tap when it can be built (and ``native``), else the Python one."""
    lib = native_tap.build() if native else None
    if lib is None:
        return LayerOutputTap(n_layer, n_embd, arch)
    return NativeLayerOutputTap(lib, n_layer, n_embd, arch, capacity)


# -- batches ------------------------------------------------------------------------------------


@dataclass
class Rows:
    """Input rows of one sequence: token ids [n] or hidden states [n, n_embd], from ``position``."""

    seq_id: int
    position: int
    x: np.ndarray


class Batch:
    """A llama_batch of token rows (n_embd == 0) or hidden-state rows, freed on close.

    Models with multi-section RoPE (M-RoPE, interleaved M-RoPE: Qwen3.5, Qwen3-VL) read
    ``pos_streams`` positions per hidden-state row, stream after stream (``pos[j * n + i]``; token
    rows are broadcast by llama.cpp itself): text has the same position in every stream.
    """

    def __init__(self, capacity: int, n_embd: int, pos_streams: int = 1):
        self.capacity = capacity
        self.n_embd = n_embd
        self.pos_streams = pos_streams if n_embd else 1
        # llama_batch_init sizes pos by its first argument: room for every stream
        self.raw = L.llama_batch_init(capacity * self.pos_streams, n_embd, 1)

    def fill(self, parts: list[Rows], outputs: str) -> list[int]:
        """Write the rows; ``outputs`` is "all" or "last" (last row of each part).

        Returns the batch index of each part's last row.
        """
        b, i, last_rows = self.raw, 0, []
        for part in parts:
            n = part.x.shape[0]
            if i + n > self.capacity:
                raise BadInput(f"batch of more than {self.capacity} rows")
            if self.n_embd:
                ctypes.memmove(
                    ctypes.addressof(b.embd.contents) + i * self.n_embd * 4,
                    part.x.ctypes.data,
                    n * self.n_embd * 4,
                )
            else:
                ctypes.memmove(ctypes.addressof(b.token.contents) + i * 4, part.x.ctypes.data, n * 4)
            for k in range(n):
                b.pos[i + k] = part.position + k
                b.n_seq_id[i + k] = 1
                b.seq_id[i + k][0] = part.seq_id
                b.logits[i + k] = 1 if outputs == "all" or k == n - 1 else 0
            i += n
            last_rows.append(i - 1)
        b.n_tokens = i
        for j in range(1, self.pos_streams):
            for k in range(i):
                b.pos[j * i + k] = b.pos[k]
        return last_rows

    def close(self) -> None:
        if self.raw is not None:
            L.llama_batch_free(self.raw)
            self.raw = None


# -- model + context ----------------------------------------------------------------------------


def _errors_since(mark: int) -> str:
    """What llama.cpp logged as errors since ``len(_errors)`` was ``mark`` (one line)."""
    said = " ".join("".join(_errors[mark:]).split())
    return f": {said}" if said else ""


def _meta_str(model, key: str) -> str | None:
    buf = ctypes.create_string_buffer(4096)
    n = L.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        L.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace")


class Weights:
    """A GGUF (whole model or slice) loaded by llama.cpp: the weights (mmapped) and what the file
    says about the model. Several contexts (the lanes of a KV pool) share one."""

    def __init__(self, path: str | pathlib.Path):
        quiet_logs()
        mark = len(_errors)
        self.path = pathlib.Path(path)
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self.model:
            raise UnsupportedModel(f"llama.cpp cannot load {self.path}{_errors_since(mark)}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.arch = _meta_str(self.model, "general.architecture") or "unknown"
        self.n_layer = L.llama_model_n_layer(self.model)
        self.n_embd = L.llama_model_n_embd(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        # hidden-state rows carry one position per RoPE section stream (llama_hparams::n_pos_per_embd)
        multi = (L.LLAMA_ROPE_TYPE_MROPE, L.LLAMA_ROPE_TYPE_IMROPE)
        self.pos_streams = 4 if L.llama_model_rope_type(self.model) in multi else 1

    def meta(self, key: str) -> str | None:
        return _meta_str(self.model, key)

    def close(self) -> None:
        if self.model:
            L.llama_model_free(self.model)
            self.model = None


class LlamaCppModel:
    """One context with ``n_slots`` independent KV streams over a loaded GGUF (``Weights``, shared
    with other contexts, or loaded here from a path and owned).

    Each slot is a llama.cpp sequence with its own stream (``kv_unified`` off), so sessions never
    see each other's cells; every slot holds ``n_ctx_slot`` positions.
    """

    def __init__(
        self,
        weights: Weights,
        *,
        n_ctx_slot: int,
        n_slots: int,
        n_batch: int,
        n_threads: int,
        config: ContextConfig,
        tap_output: bool,
        native_tap: bool = True,
    ):
        """A context on ``weights`` (loaded once, shared by the worker's contexts; closed by their owner)."""
        mark = len(_errors)
        self.weights = w = weights
        self.path, self.model, self.arch = w.path, w.model, w.arch
        self.n_layer, self.n_embd, self.n_vocab, self.pos_streams = w.n_layer, w.n_embd, w.n_vocab, w.pos_streams
        self.n_batch = n_batch
        self.tap = layer_output_tap(self.n_layer, self.n_embd, self.arch, n_batch, native_tap) if tap_output else None

        cparams = L.llama_context_default_params()
        cparams.n_ctx = n_ctx_slot * n_slots
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_slots
        cparams.kv_unified = False
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.flash_attn_type = (
            L.LLAMA_FLASH_ATTN_TYPE_ENABLED if config.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.type_k = _KV_TYPES[config.kv_type]
        cparams.type_v = _KV_TYPES[config.kv_type]
        cparams.no_perf = True
        cparams.swa_full = True  # sliding-window layers keep a full-size cache: a slot's size is n_ctx cells
        if self.tap is not None:
            cparams.cb_eval = self.tap.callback
            cparams.cb_eval_user_data = self.tap.user_data
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise LlamaCppError(f"llama.cpp could not create a context for {self.path}{_errors_since(mark)}")
        self.n_ctx_slot = L.llama_n_ctx_seq(self.ctx)
        self.memory = L.llama_get_memory(self.ctx)
        self._batches: dict[bool, Batch] = {}
        self.lock = threading.RLock()  # one llama.cpp call at a time per context

    # -- sizes -----------------------------------------------------------------------------

    def measure_state(self, seq: int, takes_tokens: bool, rng: np.random.Generator) -> tuple[int, int, bool]:
        """(bytes per position, fixed bytes, truncatable) of a sequence's state, as llama.cpp counts it.

        The state of 2 and then 4 positions on the free sequence ``seq`` is exported: what grows
        per position is the cache's share (K/V rows, MLA latents, indexer keys, plus each cell's
        position bookkeeping), what does not is recurrent (or compressor) state. Then the sequence
        is cut back to 2 positions: llama.cpp refuses when its state cannot go back. Every
        architecture's cache layout is llama.cpp's business; this asks it rather than re-deriving it.
        """
        want = "hidden" if self.tap is not None else "logits"

        def rows(position: int) -> Rows:
            if takes_tokens:
                x = rng.integers(3, self.n_vocab, size=2, dtype=np.int32)
            else:
                x = (0.1 * rng.standard_normal((2, self.n_embd))).astype(np.float32)
            return Rows(seq, position, x)

        try:
            self.decode([rows(0)], want)
            two = len(self.seq_state(seq))
            self.decode([rows(2)], want)
            four = len(self.seq_state(seq))
            truncatable = self.forget_from(seq, 2)
        finally:
            self.clear(seq)
        per_position = (four - two) // 2
        return per_position, max(0, two - 2 * per_position), truncatable

    # -- decode ----------------------------------------------------------------------------

    def _batch(self, embd: bool) -> Batch:
        if embd not in self._batches:
            self._batches[embd] = Batch(self.n_batch, self.n_embd if embd else 0, self.pos_streams)
        return self._batches[embd]

    def decode(self, parts: list[Rows], want: str) -> list[np.ndarray]:
        """Run the rows of ``parts`` in one llama_decode.

        want == "hidden": per part, the boundary rows [n, n_embd] (needs the tap);
        want == "logits": per part, the logits of its last row [n_vocab];
        want == "rows": per part, the logits of every row [n, n_vocab] (a speculative step's check).
        """
        embd = parts[0].x.ndim == 2
        with self.lock:
            batch = self._batch(embd)
            last_rows = batch.fill(parts, outputs="last" if want == "logits" else "all")
            if self.tap is not None:
                self.tap.armed = want == "hidden"
            rc = L.llama_decode(self.ctx, batch.raw)
            if rc != 0:
                if self.tap is not None:
                    self.tap.take_nothing()
                raise LlamaCppError(f"llama_decode failed with code {rc}")
            if want == "hidden":
                assert self.tap is not None  # a model without a tap never asks for hidden states
                rows = self.tap.take()
                if rows.shape[0] != batch.raw.n_tokens:
                    raise LlamaCppError(f"boundary node has {rows.shape[0]} rows, batch has {batch.raw.n_tokens}")
                out, start = [], 0
                for part in parts:  # views of the rows the tap handed over (its own copy)
                    out.append(rows[start : start + part.x.shape[0]])
                    start += part.x.shape[0]
                return out
            if want == "rows":
                return [self._logits(range(end - part.x.shape[0] + 1, end + 1)) for part, end in zip(parts, last_rows)]
            return [self._logits([i])[0] for i in last_rows]

    def _logits(self, rows) -> np.ndarray:
        """The logits of the given batch rows [len(rows), n_vocab] (copied out of llama.cpp's buffer)."""
        out = np.empty((len(rows), self.n_vocab), dtype=np.float32)
        for k, i in enumerate(rows):
            out[k] = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
        return out

    # -- sequences -------------------------------------------------------------------------

    def clear(self, seq_id: int) -> None:
        self.forget_from(seq_id, 0)

    def forget_from(self, seq_id: int, position: int) -> bool:
        """Drop the sequence's cells at positions >= ``position``; False when llama.cpp cannot
        (a recurrent state holds only the newest position: it can be dropped whole, not cut back)."""
        with self.lock:
            return bool(L.llama_memory_seq_rm(self.memory, seq_id, position, -1))

    def seq_state(self, seq_id: int) -> bytes:
        with self.lock:
            size = L.llama_state_seq_get_size(self.ctx, seq_id)
            buf = (ctypes.c_uint8 * size)()
            n = L.llama_state_seq_get_data(self.ctx, buf, size, seq_id)
            if n == 0:
                raise LlamaCppError(f"llama_state_seq_get_data failed for sequence {seq_id}")
            return ctypes.string_at(buf, n)  # one copy (slicing a ctypes array builds a list of ints)

    def set_seq_state(self, seq_id: int, blob: bytes) -> None:
        with self.lock:
            buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
            if L.llama_state_seq_set_data(self.ctx, buf, len(blob), seq_id) == 0:
                self.clear(seq_id)
                raise BadInput("llama.cpp rejected the sequence state (different model, range or cache ABI?)")

    def seq_pos_max(self, seq_id: int) -> int:
        return L.llama_memory_seq_pos_max(self.memory, seq_id)

    def meta(self, key: str) -> str | None:
        return self.weights.meta(key)

    def close(self) -> None:
        for b in self._batches.values():
            b.close()
        self._batches.clear()
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
