"""A plain torch llama for one contiguous layer range, loaded straight from a GGUF file.

Shaped like gpt-fast's model.py: ``ModelArgs`` from the GGUF metadata, an explicit ``KVCache``,
``RMSNorm``, ``Attention``, ``FeedForward``, ``TransformerBlock`` and ``LayerRange``, which holds
only blocks [layer_start, layer_end), plus the token embedding on the head and the output norm and
lm_head on the tail.

RoPE: llama.cpp's NORM mode, i.e. the rotation acts on *adjacent* pairs (x[2i], x[2i+1]) of each
head (Meta's original layout). The GGUF converter permutes the rows of attn_q/attn_k from the
Hugging Face rotate-half layout into exactly this layout, so the weights are used as stored.

Loading reads only the tensors of the range with ``gguf.GGUFReader`` (memory-mapped) and
dequantizes them with ``gguf.quants.dequantize``; ``token_embd`` is dequantized only when the head
needs it, or when the tail ties its lm_head to it. Weights and activations use one compute dtype
(float32 or bfloat16); norms (and their weights), RoPE and softmax stay in float32.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from workers.errors import BadInput, UnsupportedModel
from workers.gguf_reader import GGUFReader

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "fp32": torch.float32}

# Why other architectures are refused (the math below is llama's and nothing else's).
UNSUPPORTED_ARCHS = {
    "gemma3": "embedding scale (x sqrt(hidden)) and a different block structure "
    "(post-attention/post-ffn norms, q/k norms, sliding-window layers, GELU FFN)",
    "gemma2": "embedding scale, post-norms, logit soft-capping",
    "gemma": "embedding scale (x sqrt(hidden)) and GELU FFN",
    "qwen2": "q/k/v projection biases",
    "qwen3": "q/k norms",
    "phi3": "fused qkv and gate/up projections",
}


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


@dataclass
class ModelArgs:
    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    rope_base: float
    norm_eps: float
    vocab: int
    context_length: int
    rope_scale: float = 1.0  # linear position scaling (positions are divided by it)

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> ModelArgs:
        arch = _field(reader, "general.architecture")
        if arch != "llama":
            reason = UNSUPPORTED_ARCHS.get(arch, "only the llama architecture is implemented")
            raise UnsupportedModel(f"torch backend: architecture {arch!r} is unsupported: {reason}")
        a = f"{arch}."
        if _field(reader, a + "expert_count", 0):
            raise UnsupportedModel("torch backend: mixture-of-experts llama models are unsupported")
        hidden = int(_field(reader, a + "embedding_length"))
        n_heads = int(_field(reader, a + "attention.head_count"))
        n_kv_heads = int(_field(reader, a + "attention.head_count_kv", n_heads))
        head_dim = int(_field(reader, a + "attention.key_length", hidden // n_heads))
        rope_dim = int(_field(reader, a + "rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise UnsupportedModel(f"torch backend: partial RoPE ({rope_dim} of {head_dim} dims) is unsupported")
        scaling = _field(reader, a + "rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise UnsupportedModel(f"torch backend: RoPE scaling {scaling!r} is unsupported")
        factor = float(_field(reader, a + "rope.scaling.factor", 1.0) or 1.0) if scaling == "linear" else 1.0
        vocab = _field(reader, a + "vocab_size")
        if vocab is None:
            vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        return cls(
            arch=arch,
            n_layers=int(_field(reader, a + "block_count")),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            ffn=int(_field(reader, a + "feed_forward_length")),
            rope_base=float(_field(reader, a + "rope.freq_base", 10000.0)),
            norm_eps=float(_field(reader, a + "attention.layer_norm_rms_epsilon")),
            vocab=int(vocab),
            context_length=int(_field(reader, a + "context_length", 2048)),
            rope_scale=factor,
        )


class KVCache:
    """One session's keys and values for the layers of a range: [n_layers, n_ctx, n_kv_heads, head_dim]."""

    def __init__(self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype):
        shape = (n_layers, n_ctx, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

    @property
    def n_ctx(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(self, layer: int, position: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v ([T, n_kv_heads, head_dim]) at [position, position + T); return keys/values [0, position + T)."""
        end = position + k.shape[0]
        self.k[layer, position:end] = k
        self.v[layer, position:end] = v
        return self.k[layer, :end], self.v[layer, :end]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rope_angles(positions: torch.Tensor, head_dim: int, base: float, scale: float = 1.0) -> torch.Tensor:
    """theta[p, i] = (p / scale) * base^(-2i / head_dim), float32, shape [*positions.shape, head_dim // 2]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return (positions.float() / scale)[..., None] * inv_freq


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) by angles[..., i]. x: [B, T, heads, head_dim]; angles: [B, T, head_dim/2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.hidden, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.hidden, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.hidden, bias=False)

    def forward(
        self, x: torch.Tensor, angles: torch.Tensor, caches: list[KVCache], layer: int, positions: list[int]
    ) -> torch.Tensor:
        """x: [B, T, hidden]; row b holds positions [positions[b], positions[b] + T) of caches[b]."""
        B, T, _ = x.shape
        q = apply_rope(self.wq(x).unflatten(-1, (self.n_heads, self.head_dim)), angles)
        k = apply_rope(self.wk(x).unflatten(-1, (self.n_kv_heads, self.head_dim)), angles)
        v = self.wv(x).unflatten(-1, (self.n_kv_heads, self.head_dim))
        rows = [cache.update(layer, p, k[b], v[b]) for b, (cache, p) in enumerate(zip(caches, positions))]
        # Pad every row's keys to the longest one; the mask hides the padding and the future.
        n_keys = max(len(kb) for kb, _ in rows)
        keys = torch.stack([F.pad(kb, (0, 0, 0, 0, 0, n_keys - len(kb))) for kb, _ in rows])  # [B, L, kvh, hd]
        values = torch.stack([F.pad(vb, (0, 0, 0, 0, 0, n_keys - len(vb))) for _, vb in rows])
        query_pos = torch.tensor(positions)[:, None] + torch.arange(T)  # [B, T]
        visible = torch.arange(n_keys)[None, None, :] <= query_pos[:, :, None]  # [B, T, L]

        group = self.n_heads // self.n_kv_heads  # query head h reads kv head h // group
        keys = keys.repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, L, hd]
        values = values.repeat_interleave(group, dim=2).transpose(1, 2)
        q = q.transpose(1, 2)  # [B, H, T, hd]
        scores = (q @ keys.transpose(-1, -2)).float() / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(values.dtype)
        out = (weights @ values).transpose(1, 2).flatten(-2)  # [B, T, H * hd]
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: w_down(silu(w_gate x) * w_up x)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w_gate = nn.Linear(args.hidden, args.ffn, bias=False)
        self.w_up = nn.Linear(args.hidden, args.ffn, bias=False)
        self.w_down = nn.Linear(args.ffn, args.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.hidden, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x, angles, caches, layer, positions):
        h = x + self.attention(self.attention_norm(x), angles, caches, layer, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class LayerRange(nn.Module):
    """Blocks [layer_start, layer_end) of a llama; embedding if head, output norm + lm_head if tail."""

    def __init__(self, args: ModelArgs, layer_start: int, layer_end: int):
        super().__init__()
        self.args, self.layer_start, self.layer_end = args, layer_start, layer_end
        self.is_head, self.is_tail = layer_start == 0, layer_end == args.n_layers
        if self.is_head:
            self.tok_embeddings = nn.Embedding(args.vocab, args.hidden)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(layer_start, layer_end))
        if self.is_tail:
            self.norm = RMSNorm(args.hidden, args.norm_eps)
            self.lm_head = nn.Linear(args.hidden, args.vocab, bias=False)

    def new_cache(self, n_ctx: int) -> KVCache:
        a = self.args
        return KVCache(len(self.layers), n_ctx, a.n_kv_heads, a.head_dim, self.dtype)

    @property
    def dtype(self) -> torch.dtype:
        first: TransformerBlock = self.layers[0]  # type: ignore[assignment]  # ModuleList items are Modules
        return first.attention.wq.weight.dtype

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights (a tied lm_head shares tok_embeddings' storage and counts once)."""
        return sum(p.nbytes for p in {p.untyped_storage().data_ptr(): p for p in self.parameters()}.values())

    @torch.inference_mode()
    def forward(
        self, x: torch.Tensor, caches: list[KVCache], positions: list[int], every_row: bool = False
    ) -> torch.Tensor:
        """x: token ids [B, T] on the head, hidden [B, T, hidden] elsewhere.

        Returns hidden [B, T, hidden] (compute dtype), or on the tail the logits of each row's last
        position, float32 [B, vocab] (``every_row``: of every position, [B, T, vocab]).
        """
        h = self.tok_embeddings(x) if self.is_head else x.to(self.dtype)
        T = h.shape[1]
        pos = torch.tensor(positions)[:, None] + torch.arange(T)
        angles = rope_angles(pos, self.args.head_dim, self.args.rope_base, self.args.rope_scale)
        for i, block in enumerate(self.layers):
            h = block(h, angles, caches, i, positions)
        if not self.is_tail:
            return h
        return self.lm_head(self.norm(h if every_row else h[:, -1])).float()


# -- loading from GGUF -----------------------------------------------------------------------

_BLOCK_NAMES = {
    "attn_norm": "attention_norm",
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w_gate",
    "ffn_up": "feed_forward.w_up",
    "ffn_down": "feed_forward.w_down",
}


def _dequantize(t: gguf.ReaderTensor, dtype: torch.dtype) -> torch.Tensor:
    """A GGUF tensor as a torch tensor in numpy/torch order (GGUF shape reversed)."""
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    arr = np.ascontiguousarray(arr.reshape([int(d) for d in reversed(t.shape)]), dtype=np.float32)
    if not arr.flags.writeable:  # float32 tensors come back as views of the read-only memory map
        arr = arr.copy()
    return torch.from_numpy(arr).to(dtype)


@functools.lru_cache(maxsize=4)
def _reader(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
    """Parsing the metadata (the vocabulary) takes seconds: reuse the reader for the same file."""
    return GGUFReader(path)


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    st = os.stat(path)
    return _reader(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


def load_layer_range(path: str | Path, layer_start: int, layer_end: int, dtype: str = "float32") -> LayerRange:
    """Build a ``LayerRange`` with exactly the GGUF tensors it needs."""
    if dtype not in DTYPES:
        raise BadInput(f"torch backend: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype]
    reader = open_gguf(path)
    args = ModelArgs.from_gguf(reader)
    if not 0 <= layer_start < layer_end <= args.n_layers:
        raise BadInput(f"layer range [{layer_start}, {layer_end}) is outside the model's {args.n_layers} layers")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise UnsupportedModel("torch backend: per-frequency RoPE factors (rope_freqs, llama 3.1) are unsupported")

    wanted: dict[str, str] = {}  # GGUF name -> state-dict name
    for layer in range(layer_start, layer_end):
        prefix = f"blk.{layer}."
        for name in (n for n in tensors if n.startswith(prefix)):
            kind, _, suffix = name[len(prefix) :].partition(".")
            if kind not in _BLOCK_NAMES or suffix != "weight":
                raise UnsupportedModel(f"torch backend: unexpected tensor {name} in a llama block")
            wanted[name] = f"layers.{layer - layer_start}.{_BLOCK_NAMES[kind]}.weight"
    if layer_start == 0:
        wanted["token_embd.weight"] = "tok_embeddings.weight"
    if layer_end == args.n_layers:
        wanted["output_norm.weight"] = "norm.weight"
        if "output.weight" in tensors:
            wanted["output.weight"] = "lm_head.weight"
        elif layer_start > 0:
            wanted["token_embd.weight"] = "lm_head.weight"  # tied; a whole-model range shares tok_embeddings

    missing = [n for n in wanted if n not in tensors]
    if missing:
        raise UnsupportedModel(f"torch backend: the GGUF lacks tensors {missing[:4]}")

    state: dict[str, torch.Tensor] = {}
    for gguf_name, sd_name in wanted.items():
        # Norm weights are tiny and used in float32 math: keep them exact.
        state[sd_name] = _dequantize(tensors[gguf_name], torch.float32 if "norm" in sd_name else torch_dtype)
    if layer_end == args.n_layers and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["tok_embeddings.weight"]  # tied, head and tail in one range

    with torch.device("meta"):
        model = LayerRange(args, layer_start, layer_end)
    model.load_state_dict(state, strict=True, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
