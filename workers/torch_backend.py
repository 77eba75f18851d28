"""`TorchBackend`: the torch layer range (workers.torch_model) behind the backend protocol.

Every session owns a preallocated ``KVCache`` of n_ctx positions for this range's layers only.
Prefill/decode run one torch call; ``decode_batch`` runs one decode position of several sessions
in one torch call (each session still reads and writes only its own cache).

Exported state is ``MAGIC | u32 header length | JSON header | keys | values``, where keys and
values are the raw bytes of positions [0, position) in the cache's dtype, shape
[n_layers_in_range, position, n_kv_heads, head_dim].
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np
import torch

from workers.errors import BackendError, BadInput
from workers.protocol import Backend, Capability
from workers.torch_model import DTYPES, KVCache, ModelArgs, load_layer_range, open_gguf

MAGIC = b"NBTKV1\0\0"
_HEADER_LEN = struct.Struct("<I")


class TorchBackend(Backend):
    backend_id = "torch"

    def __init__(
        self,
        model_path: str | Path,
        layer_start: int,
        layer_end: int,
        dtype: str = "float32",
        threads: int | None = None,
        selfbench: bool = True,
    ):
        if dtype not in DTYPES:
            raise BadInput(f"torch backend: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if threads:
            torch.set_num_threads(threads)
        args = ModelArgs.from_gguf(open_gguf(model_path))
        super().__init__(
            layer_start=layer_start,
            layer_end=layer_end,
            n_layers=args.n_layers,
            hidden_size=args.hidden,
            vocab_size=args.vocab,
        )
        self.model_path = Path(model_path)
        self.model = load_layer_range(model_path, layer_start, layer_end, dtype)
        self.dtype = self.model.dtype
        self.cache_abi = f"torch-{str(self.dtype).removeprefix('torch.')}-normrope-v1"
        self._caches: dict[str, KVCache] = {}
        self._prefill_tps, self._decode_tps = self._selfbench() if selfbench else (0.0, 0.0)

    # -- capability --------------------------------------------------------------------------

    @property
    def capability(self) -> Capability:
        a = self.model.args
        per_token = 2 * len(self.model.layers) * a.n_kv_heads * a.head_dim * self.dtype.itemsize
        return Capability(
            model_arch=a.arch,
            supported_runtime="torch",
            supports_prefill=True,
            supports_decode_step=True,
            supports_layer_range=True,
            supports_partial_artifacts=False,  # reads a whole GGUF (only its range's tensors)
            cache_abi=self.cache_abi,
            cache_bytes_per_token_estimate=per_token,
            prefill_tokens_per_second=self._prefill_tps,
            decode_tokens_per_second=self._decode_tps,
            active_memory_floor=self.model.weight_bytes,
        )

    def benchmark(self) -> tuple[float, float]:
        self._prefill_tps, self._decode_tps = self._selfbench()
        return self._prefill_tps, self._decode_tps

    def _selfbench(self, n_prefill: int = 16, n_decode: int = 4) -> tuple[float, float]:
        """Tokens per second of one short prefill and a few decode steps (well under a second)."""
        cache = self.model.new_cache(1 + n_prefill + n_decode)
        gen = torch.Generator().manual_seed(0)

        def rows(n: int) -> torch.Tensor:
            if self.is_head:
                return torch.randint(0, self.vocab_size, (1, n), generator=gen)
            return torch.randn(1, n, self.hidden_size, generator=gen)

        self.model(rows(1), [cache], [0])  # warm-up
        t0 = time.perf_counter()
        self.model(rows(n_prefill), [cache], [1])
        t1 = time.perf_counter()
        for i in range(n_decode):
            self.model(rows(1), [cache], [1 + n_prefill + i])
        t2 = time.perf_counter()
        return n_prefill / max(t1 - t0, 1e-9), n_decode / max(t2 - t1, 1e-9)

    # -- hooks -------------------------------------------------------------------------------

    def _open(self, session_id: str, n_ctx: int) -> None:
        if self.model is None:
            raise BackendError("torch backend is closed")
        self._caches[session_id] = self.model.new_cache(n_ctx)

    def _close(self, session_id: str) -> None:
        del self._caches[session_id]

    def _cache_bytes(self, session_id: str) -> int:
        return self._caches[session_id].nbytes

    def _model_input(self, rows: list[np.ndarray]) -> torch.Tensor:
        """[B, T] token ids on the head, [B, T, hidden] hidden states elsewhere."""
        x = torch.from_numpy(np.stack(rows))
        return x.long() if self.is_head else x

    def _forward(self, session_id: str, position: int, x: np.ndarray) -> np.ndarray:
        out = self.model(self._model_input([x]), [self._caches[session_id]], [position])
        return out[0].float().numpy()

    def _forward_batch(self, steps: list[tuple[str, int, np.ndarray]]) -> list[np.ndarray]:
        if not steps:
            return []
        sids = [sid for sid, _, _ in steps]
        if len(set(sids)) != len(sids):
            raise BadInput("a decode batch carries each session at most once")
        out = self.model(
            self._model_input([x for _, _, x in steps]),
            [self._caches[sid] for sid in sids],
            [pos for _, pos, _ in steps],
        )
        self.forward_calls += 1
        return list(out.float().numpy())

    def _forward_rows(self, steps: list[tuple[str, int, np.ndarray]]) -> list[np.ndarray]:
        by_length: dict[int, list[int]] = {}  # one torch call per step length (a [B, T] batch)
        for k, (_, _, x) in enumerate(steps):
            by_length.setdefault(x.shape[0], []).append(k)
        result: list[np.ndarray] = [None] * len(steps)  # type: ignore[list-item]
        for ks in by_length.values():
            out = self.model(
                self._model_input([steps[k][2] for k in ks]),
                [self._caches[steps[k][0]] for k in ks],
                [steps[k][1] for k in ks],
                every_row=True,
            )
            self.forward_calls += 1
            for k, rows in zip(ks, out.float().numpy()):
                result[k] = rows
        return result

    # -- state export ------------------------------------------------------------------------

    def _header(self, position: int) -> dict:
        a = self.model.args
        return {
            "cache_abi": self.cache_abi,
            "layer_start": self.layer_start,
            "layer_end": self.layer_end,
            "n_kv_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "position": position,
        }

    def _truncate(self, session_id: str, position: int) -> None:
        cache = self._caches[session_id]
        for t in (cache.k, cache.v):
            t[:, position:] = 0  # positions are overwritten anyway; zero them so nothing stale survives

    def _export(self, session_id: str) -> bytes:
        position = self._sessions[session_id].position
        cache = self._caches[session_id]
        header = json.dumps(self._header(position)).encode()
        parts = [MAGIC, _HEADER_LEN.pack(len(header)), header]
        for t in (cache.k, cache.v):
            parts.append(t[:, :position].contiguous().view(torch.uint8).numpy().tobytes())
        return b"".join(parts)

    def _import(self, session_id: str, n_ctx: int, position: int, blob: bytes) -> None:
        if not 0 <= position <= n_ctx or n_ctx <= 0:
            raise BadInput(f"position {position} does not fit n_ctx {n_ctx}")
        start = len(MAGIC) + _HEADER_LEN.size
        if blob[: len(MAGIC)] != MAGIC or len(blob) < start:
            raise BadInput("not a torch backend cache snapshot")
        (n,) = _HEADER_LEN.unpack_from(blob, len(MAGIC))
        try:
            header = json.loads(blob[start : start + n])
        except ValueError as e:
            raise BadInput(f"corrupt snapshot header: {e}") from None
        held = header.get("position")  # may exceed position: a speculative step's drafts, dropped here
        if not (isinstance(held, int) and position <= held <= n_ctx):
            held = position
        expected = self._header(held)
        if header != expected:
            diff = {k: (header.get(k), v) for k, v in expected.items() if header.get(k) != v}
            raise BadInput(f"snapshot does not fit this backend (got, expected): {diff}")
        cache = self.model.new_cache(n_ctx)
        body = blob[start + n :]
        half = cache.k[:, :held].nbytes
        if len(body) != 2 * half:
            raise BadInput(f"snapshot body is {len(body)} bytes, expected {2 * half}")
        if half:
            for dst, lo in ((cache.k, 0), (cache.v, half)):
                raw = torch.frombuffer(bytearray(body[lo : lo + half]), dtype=torch.uint8)
                dst[:, :position] = raw.view(self.dtype).view(dst[:, :held].shape)[:, :position]
        self._caches[session_id] = cache

    def close(self) -> None:
        """Free every session, then the weights."""
        super().close()
        self.model = None  # type: ignore[assignment]  # free the weights; _open refuses new sessions after this
