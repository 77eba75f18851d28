"""A backend that does no model work: it measures what the bus itself costs per hop.

Hidden states pass through unchanged; the head embeds a token id as a one-hot-free constant row
and the tail returns constant logits (token 0 wins greedy sampling). Shapes, dtypes, session
bookkeeping and validation are the real ones (they come from `Backend`), so a route of no-op
hops moves exactly the bytes and messages a real route moves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from workers.gguf_reader import GGUFReader
from workers.protocol import Backend, Capability


class NoopBackend(Backend):
    backend_id = "noop"

    def __init__(self, *, layer_start: int, layer_end: int, n_layers: int, hidden_size: int, vocab_size: int):
        super().__init__(
            layer_start=layer_start,
            layer_end=layer_end,
            n_layers=n_layers,
            hidden_size=hidden_size,
            vocab_size=vocab_size,
        )
        self._logits = np.zeros(vocab_size, dtype=np.float32)
        self._logits[0] = 1.0

    @classmethod
    def for_model(cls, path: str | Path, layer_start: int | None, layer_end: int | None) -> NoopBackend:
        """The shapes of the GGUF at ``path`` (a whole model), layers [layer_start, layer_end)."""
        meta = GGUFReader(path).fields
        arch = meta["general.architecture"].contents()
        n_layers = int(meta[f"{arch}.block_count"].contents())
        return cls(
            layer_start=layer_start or 0,
            layer_end=n_layers if layer_end is None else layer_end,
            n_layers=n_layers,
            hidden_size=int(meta[f"{arch}.embedding_length"].contents()),
            vocab_size=len(meta["tokenizer.ggml.tokens"].contents()),
        )

    @property
    def capability(self) -> Capability:
        return Capability(
            model_arch="noop",
            supported_runtime="none",
            supports_prefill=True,
            supports_decode_step=True,
            supports_layer_range=True,
            supports_partial_artifacts=True,
            cache_abi="noop-v1",
            cache_bytes_per_token_estimate=0,
            prefill_tokens_per_second=1e9,
            decode_tokens_per_second=1e9,
        )

    def _open(self, session_id: str, n_ctx: int) -> None:
        pass  # no cache: the base class keeps the session table

    def _close(self, session_id: str) -> None:
        pass

    def _cache_bytes(self, session_id: str) -> int:
        return 0

    def _truncate(self, session_id: str, position: int) -> None:
        pass  # no cache to cut back: the base class moves the session's position

    def _forward_rows(self, steps: list[tuple[str, int, np.ndarray]]) -> list[np.ndarray]:
        if not self.is_tail:
            return super()._forward_rows(steps)
        self.forward_calls += 1
        return [np.tile(self._logits, (x.shape[0], 1)) for _, _, x in steps]

    def _forward(self, session_id: str, position: int, x: np.ndarray) -> np.ndarray:
        if self.is_tail:
            return self._logits
        if self.is_head:
            return np.zeros((x.shape[0], self.hidden_size), dtype=np.float32)
        return x
