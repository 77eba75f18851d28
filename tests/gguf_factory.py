"""Tiny synthetic GGUFs (llama architecture) for fast unit tests.

The files are real GGUFs written with the `gguf` package: llama.cpp can load them (byte-level
SentencePiece vocabulary), and the torch backend can run them. Weights are seeded random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from neuron_bus.artifacts.synthetic import add_spm_tokenizer
from neuron_bus.artifacts.synthetic import spm_vocab as _vocab  # one vocabulary for every synthetic model


@dataclass(frozen=True)
class TinyLlama:
    n_layers: int = 4
    hidden: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn: int = 128
    context: int = 512
    rope_base: float = 10000.0
    eps: float = 1e-5
    quant: str = "Q8_0"  # block weights: "Q8_0" or "F32"
    tie_embeddings: bool = True
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads


def write_tiny_llama(path: Path | str, cfg: TinyLlama = TinyLlama()) -> Path:
    """Write a loadable llama-architecture GGUF with ``cfg.n_layers`` blocks; return its path."""
    path = Path(path)
    rng = np.random.default_rng(cfg.seed)
    spm = _vocab()
    vocab = len(spm[0])
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.context)
    w.add_embedding_length(cfg.hidden)
    w.add_feed_forward_length(cfg.ffn)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.eps)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if cfg.quant == "Q8_0" else gguf.LlamaFileType.ALL_F32)
    add_spm_tokenizer(w, spm)

    def weight(name: str, rows: int, cols: int, quant: str | None = None) -> None:
        arr = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        q = quant or cfg.quant
        if q == "Q8_0" and cols % 32 == 0:
            data = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr)

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(cfg.hidden)).astype(np.float32))

    kv_dim = cfg.n_kv_heads * cfg.head_dim
    weight("token_embd.weight", vocab, cfg.hidden)
    for i in range(cfg.n_layers):
        norm(f"blk.{i}.attn_norm.weight")
        weight(f"blk.{i}.attn_q.weight", cfg.hidden, cfg.hidden)
        weight(f"blk.{i}.attn_k.weight", kv_dim, cfg.hidden)
        weight(f"blk.{i}.attn_v.weight", kv_dim, cfg.hidden)
        weight(f"blk.{i}.attn_output.weight", cfg.hidden, cfg.hidden)
        norm(f"blk.{i}.ffn_norm.weight")
        weight(f"blk.{i}.ffn_gate.weight", cfg.ffn, cfg.hidden)
        weight(f"blk.{i}.ffn_up.weight", cfg.ffn, cfg.hidden)
        weight(f"blk.{i}.ffn_down.weight", cfg.hidden, cfg.ffn)
    norm("output_norm.weight")
    if not cfg.tie_embeddings:
        weight("output.weight", vocab, cfg.hidden)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
