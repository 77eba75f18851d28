"""Small synthetic GGUFs of the architectures neuron-bus targets, with seeded random weights.

A synthetic model has the metadata keys, tensor names and tensor shapes that the llama.cpp bundled
with llama-cpp-python 0.3.36 expects for its architecture (its loader decides where gguf-py's
tables lag it), a handful of layers of hidden size 64, a few experts, and a byte-level
SentencePiece vocabulary llama.cpp accepts. It exercises the same loader, graph and cache code as
the real model of hundreds of gigabytes: the architecture matrix (neuron_bus/arch_matrix.py),
the audit and the tests are built on these files.

One builder, parameterized per family: an ``ArchSpec`` names the architecture, the kind of every
layer (``attention``, ``recurrent``, ``ffn`` for a feed-forward-only block, ``mtp`` for a
multi-token-prediction block after the main stack) and the parts its blocks are made of (GQA or
MLA attention, a gated-delta-net or Mamba-2 mixer, dense or mixture-of-experts feed-forward).
Shapes below are numpy's (rows first): a weight mapping ``n_in`` to ``n_out`` is ``(n_out, n_in)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np

from neuron_bus.artifacts.gguf_model import ArtifactError
from workers.errors import Reason

ATTENTION, RECURRENT, FFN_ONLY, MTP = "attention", "recurrent", "ffn", "mtp"


# -- the parts of a block ------------------------------------------------------------------------


@dataclass(frozen=True)
class Attention:
    """Grouped-query attention, with the variants the families use."""

    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    rope_dim: int | None = None  # rotated dimensions per head (None: all of them)
    qk_norm: bool = False  # RMS norm of every query and key head (qwen3, gemma3)
    qkv_bias: bool = False  # biases on q, k, v (glm4moe, gpt-oss)
    out_bias: bool = False  # bias on the output projection (gpt-oss)
    sinks: bool = False  # one learned attention sink per head (gpt-oss)
    gated: bool = False  # attn_q also produces a sigmoid output gate: twice the rows (qwen3.5)
    sliding_window: int = 0  # > 0: layers slide over this many positions (pattern from llama.cpp)


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention in the absorbed form llama.cpp runs (attn_k_b, attn_v_b):
    the cache keeps one latent of ``kv_lora_rank + rope_dim`` values per position and layer.
    ``indexer_heads`` > 0 adds the lightning indexer of DeepSeek sparse attention (glm-dsa);
    ``shared_indexer`` lists the layers that reuse the previous full layer's top-k selection."""

    n_heads: int = 4
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    nope_dim: int = 16
    rope_dim: int = 8
    v_head_dim: int = 16
    indexer_heads: int = 0
    indexer_head_dim: int = 64  # llama.cpp's Hadamard rotation of the indexer keys needs >= 64
    indexer_top_k: int = 8
    shared_indexer: tuple[int, ...] = ()


@dataclass(frozen=True)
class CompressedAttention:
    """DeepSeek-V4's attention: one shared key/value head (MQA with attention sinks) over a sliding
    window, KV compressed per layer by ``ratios`` (0: none, 4: compressed, with a lightning indexer,
    128: heavily compressed), a grouped low-rank output projection, and hyper-connections: the
    residual stream is ``hc_mult`` copies of the hidden state, mixed before and after every
    attention and feed-forward (llama.cpp requires hc_mult 4)."""

    n_heads: int = 4
    head_dim: int = 64  # llama.cpp's Hadamard rotation of compressed keys needs >= 64
    rope_dim: int = 8
    q_lora_rank: int = 32
    out_groups: int = 2
    out_lora_rank: int = 16
    hc_mult: int = 4
    ratios: tuple[int, ...] = (0, 4, 128)
    indexer_heads: int = 2
    indexer_head_dim: int = 64
    indexer_top_k: int = 8
    sliding_window: int = 16

    @property
    def hc_mix(self) -> int:  # pre weights, post weights and the hc x hc combination, per token
        return (2 + self.hc_mult) * self.hc_mult


@dataclass(frozen=True)
class GatedDeltaNet:
    """The linear-attention mixer of Qwen3.5 / Qwen3-Next: a fixed recurrent state per layer."""

    state_dim: int = 16  # key and value head size
    n_k_heads: int = 2
    n_v_heads: int = 4
    conv_kernel: int = 4

    @property
    def key_dim(self) -> int:
        return self.state_dim * self.n_k_heads

    @property
    def value_dim(self) -> int:
        return self.state_dim * self.n_v_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class Mamba2:
    """The Mamba-2 state-space mixer of Nemotron-H and Granite 4 hybrids."""

    inner: int = 128
    state_dim: int = 16
    n_groups: int = 2
    n_heads: int = 4
    conv_kernel: int = 4

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.n_groups * self.state_dim

    @property
    def in_proj(self) -> int:
        return 2 * self.inner + 2 * self.n_groups * self.state_dim + self.n_heads


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts feed-forward: a router over ``n_experts``, ``n_used`` of them per token,
    ``n_shared`` always-on experts, after ``leading_dense`` dense layers."""

    n_experts: int = 4
    n_used: int = 2
    width: int = 32  # feed-forward width of one expert
    n_shared: int = 0
    leading_dense: int = 0
    selection_bias: bool = False  # exp_probs_b: a bias added to the router scores for selection only
    router_bias: bool = False  # ffn_gate_inp.bias (gpt-oss)
    expert_bias: bool = False  # biases of every expert's projections (gpt-oss)
    gating: int = 0  # <arch>.expert_gating_func (1 softmax, 2 sigmoid); 0: not stated
    weights_norm: bool | None = None  # <arch>.expert_weights_norm; None: not stated


@dataclass(frozen=True)
class ArchSpec:
    arch: str
    layers: tuple[str, ...]  # the kind of every block
    hidden: int = 64
    ffn: int = 128  # dense feed-forward width
    attention: Attention | LatentAttention | CompressedAttention | None = None
    recurrent: GatedDeltaNet | Mamba2 | None = None
    experts: Experts | None = None
    gated_ffn: bool = True  # gate/up/down (SwiGLU, GeGLU); False: up/down only (Nemotron-H's ReLU^2)
    ffn_in_mixer_blocks: bool = True  # False: attention and recurrent blocks have no feed-forward (Nemotron-H)
    ffn_norm: str = "ffn_norm"  # name of the pre-feed-forward norm (glm4moe, gpt-oss: post_attention_norm)
    post_norms: bool = False  # gemma3: norms after attention and after the feed-forward
    tie_embeddings: bool = True
    per_layer_heads: bool = False  # head_count_kv / feed_forward_length as per-layer arrays (nemotron_h)
    metadata: tuple[tuple[str, object], ...] = ()  # extra keys, "{arch}." prefixed by the writer
    context: int = 4096
    seed: int = 0

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_mtp(self) -> int:
        return sum(k == MTP for k in self.layers)

    def is_moe(self, layer: int) -> bool:
        return self.experts is not None and layer >= self.experts.leading_dense


def _layers(*runs: tuple[str, int]) -> tuple[str, ...]:
    return tuple(kind for kind, n in runs for _ in range(n))


# -- the architectures -----------------------------------------------------------------------------

MOE = Experts()

ARCHITECTURES: dict[str, ArchSpec] = {
    spec.arch: spec
    for spec in (
        ArchSpec("llama", _layers((ATTENTION, 4)), attention=Attention()),
        ArchSpec("qwen3", _layers((ATTENTION, 4)), attention=Attention(qk_norm=True)),
        ArchSpec("qwen3moe", _layers((ATTENTION, 4)), attention=Attention(qk_norm=True), experts=MOE),
        # 8 layers: llama.cpp slides 5 of every 6 (layer 5 is global); a slice restates the pattern
        ArchSpec(
            "gemma3",
            _layers((ATTENTION, 8)),
            attention=Attention(qk_norm=True, sliding_window=8),
            post_norms=True,
        ),
        ArchSpec(
            "deepseek2",
            _layers((ATTENTION, 4)),
            attention=LatentAttention(),
            experts=Experts(n_shared=1, leading_dense=1, selection_bias=True, gating=2, weights_norm=True),
        ),
        ArchSpec(
            "deepseek4",
            _layers((ATTENTION, 3)),
            attention=CompressedAttention(),
            experts=Experts(n_shared=1, selection_bias=True, gating=4, weights_norm=True),  # 4: sqrt(softplus)
            tie_embeddings=False,
        ),
        ArchSpec(
            "glm4moe",
            _layers((ATTENTION, 4), (MTP, 1)),
            attention=Attention(qkv_bias=True, rope_dim=8),
            experts=Experts(n_shared=1, leading_dense=1, selection_bias=True, gating=2, weights_norm=True),
            ffn_norm="post_attention_norm",
            tie_embeddings=False,
        ),
        ArchSpec(
            "glm-dsa",
            _layers((ATTENTION, 4), (MTP, 1)),
            attention=LatentAttention(indexer_heads=2, shared_indexer=(2,)),
            experts=Experts(n_shared=1, leading_dense=1, selection_bias=True, gating=2, weights_norm=True),
            tie_embeddings=False,
        ),
        # layer i is linear attention unless (i + 1) % 4 == 0 (llama.cpp's default interval)
        ArchSpec(
            "qwen35",
            tuple(ATTENTION if (i + 1) % 4 == 0 else RECURRENT for i in range(12)),
            attention=Attention(qk_norm=True, gated=True),
            recurrent=GatedDeltaNet(),
            ffn_norm="post_attention_norm",
            tie_embeddings=False,
            metadata=(("rope.dimension_sections", [3, 3, 2, 0]), ("full_attention_interval", 4)),
        ),
        ArchSpec(
            "gpt-oss",
            _layers((ATTENTION, 6)),  # even layers slide (llama.cpp's period of 2)
            attention=Attention(qkv_bias=True, out_bias=True, sinks=True, sliding_window=8),
            experts=Experts(router_bias=True, expert_bias=True),
            ffn_norm="post_attention_norm",
            tie_embeddings=False,
        ),
        # Mamba-2, attention and MLP-only blocks; llama.cpp tells them apart by the per-layer arrays
        ArchSpec(
            "nemotron_h",
            (RECURRENT, ATTENTION, FFN_ONLY) * 3,
            attention=Attention(),
            recurrent=Mamba2(),
            gated_ffn=False,
            ffn_in_mixer_blocks=False,
            tie_embeddings=False,
            per_layer_heads=True,
        ),
    )
}


def architecture(name: str) -> ArchSpec:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ArtifactError(
            Reason.UNKNOWN_ARCHITECTURE, f"no synthetic model of {name!r}: known are {', '.join(ARCHITECTURES)}"
        ) from None


# -- the vocabulary --------------------------------------------------------------------------------


def add_spm_tokenizer(w: gguf.GGUFWriter, vocab: tuple[list[str], list[float], list[int]]) -> None:
    """The tokenizer metadata of an `spm_vocab` vocabulary (<unk> 0, <s> 1, </s> 2, BOS added)."""
    tokens, scores, types = vocab
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A byte-level SentencePiece vocabulary: <unk> <s> </s>, 256 byte tokens, a-z and ▁a-▁z."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
        "\u2581" + chr(c) for c in range(ord("a"), ord("z") + 1)
    ]
    tokens += letters
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(letters))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(letters)  # UNKNOWN, CONTROL, BYTE, NORMAL
    return tokens, scores, types


# -- the tensors -----------------------------------------------------------------------------------


@dataclass
class _Tensors:
    """Named tensors in writing order; weights are seeded random numbers scaled by fan-in."""

    rng: np.random.Generator
    items: dict[str, np.ndarray] = field(default_factory=dict)

    def linear(self, name: str, n_out: int, n_in: int, *lead: int) -> None:
        self.items[name] = (self.rng.standard_normal((*lead, n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(self, name: str, *shape: int) -> None:
        self.items[name] = (1.0 + 0.1 * self.rng.standard_normal(shape)).astype(np.float32)

    def small(self, name: str, *shape: int, scale: float = 0.1) -> None:
        self.items[name] = (scale * self.rng.standard_normal(shape)).astype(np.float32)

    def negative(self, name: str, *shape: int) -> None:  # decay rates: the state must shrink
        self.items[name] = -(0.5 + self.rng.random(shape)).astype(np.float32)


def _attention(t: _Tensors, p: str, a: Attention, hidden: int) -> None:
    q_rows = a.n_heads * a.head_dim * (2 if a.gated else 1)
    kv = a.n_kv_heads * a.head_dim
    t.linear(p + "attn_q.weight", q_rows, hidden)
    t.linear(p + "attn_k.weight", kv, hidden)
    t.linear(p + "attn_v.weight", kv, hidden)
    t.linear(p + "attn_output.weight", hidden, a.n_heads * a.head_dim)
    if a.qkv_bias:
        t.small(p + "attn_q.bias", q_rows)
        t.small(p + "attn_k.bias", kv)
        t.small(p + "attn_v.bias", kv)
    if a.out_bias:
        t.small(p + "attn_output.bias", hidden)
    if a.sinks:
        t.small(p + "attn_sinks.weight", a.n_heads, scale=1.0)
    if a.qk_norm:
        t.norm(p + "attn_q_norm.weight", a.head_dim)
        t.norm(p + "attn_k_norm.weight", a.head_dim)


def _latent_attention(t: _Tensors, p: str, m: LatentAttention, hidden: int, layer: int) -> None:
    head_k = m.nope_dim + m.rope_dim
    t.linear(p + "attn_q_a.weight", m.q_lora_rank, hidden)
    t.norm(p + "attn_q_a_norm.weight", m.q_lora_rank)
    t.linear(p + "attn_q_b.weight", m.n_heads * head_k, m.q_lora_rank)
    t.linear(p + "attn_kv_a_mqa.weight", m.kv_lora_rank + m.rope_dim, hidden)
    t.norm(p + "attn_kv_a_norm.weight", m.kv_lora_rank)
    t.linear(p + "attn_k_b.weight", m.kv_lora_rank, m.nope_dim, m.n_heads)  # per head: nope -> latent
    t.linear(p + "attn_v_b.weight", m.v_head_dim, m.kv_lora_rank, m.n_heads)  # per head: latent -> value
    t.linear(p + "attn_output.weight", hidden, m.n_heads * m.v_head_dim)
    if m.indexer_heads and layer not in m.shared_indexer:
        t.norm(p + "indexer.k_norm.weight", m.indexer_head_dim)
        t.small(p + "indexer.k_norm.bias", m.indexer_head_dim)
        t.linear(p + "indexer.proj.weight", m.indexer_heads, hidden)
        t.linear(p + "indexer.attn_k.weight", m.indexer_head_dim, hidden)
        t.linear(p + "indexer.attn_q_b.weight", m.indexer_heads * m.indexer_head_dim, m.q_lora_rank)


def _compressed_attention(t: _Tensors, p: str, c: CompressedAttention, hidden: int, layer: int) -> None:
    t.small(p + "attn_sinks.weight", c.n_heads, scale=1.0)
    t.linear(p + "attn_q_a.weight", c.q_lora_rank, hidden)
    t.norm(p + "attn_q_a_norm.weight", c.q_lora_rank)
    t.linear(p + "attn_q_b.weight", c.n_heads * c.head_dim, c.q_lora_rank)
    t.linear(p + "attn_kv.weight", c.head_dim, hidden)
    t.norm(p + "attn_kv_a_norm.weight", c.head_dim)
    t.linear(p + "attn_output_a.weight", c.out_lora_rank * c.out_groups, c.n_heads * c.head_dim // c.out_groups)
    t.linear(p + "attn_output_b.weight", hidden, c.out_groups * c.out_lora_rank)
    for part in ("attn", "ffn"):  # hyper-connection mixing around the attention and the feed-forward
        t.linear(f"{p}hc_{part}_fn.weight", c.hc_mix, c.hc_mult * hidden)
        t.small(f"{p}hc_{part}_base.weight", c.hc_mix)
        t.norm(f"{p}hc_{part}_scale.weight", 3)
    ratio = c.ratios[layer % len(c.ratios)]
    if ratio:
        width = (2 if ratio == 4 else 1) * c.head_dim  # ratio 4 compresses overlapping windows
        t.linear(p + "attn_compressor_kv.weight", width, hidden)
        t.linear(p + "attn_compressor_gate.weight", width, hidden)
        t.small(p + "attn_compressor_ape.weight", ratio, width)
        t.norm(p + "attn_compressor_norm.weight", c.head_dim)
    if ratio == 4:
        t.linear(p + "indexer.proj.weight", c.indexer_heads, hidden)
        t.linear(p + "indexer.attn_q_b.weight", c.indexer_heads * c.indexer_head_dim, c.q_lora_rank)
        t.linear(p + "indexer_compressor_kv.weight", 2 * c.indexer_head_dim, hidden)
        t.linear(p + "indexer_compressor_gate.weight", 2 * c.indexer_head_dim, hidden)
        t.small(p + "indexer_compressor_ape.weight", 4, 2 * c.indexer_head_dim)
        t.norm(p + "indexer_compressor_norm.weight", c.indexer_head_dim)


def _gated_delta_net(t: _Tensors, p: str, g: GatedDeltaNet, hidden: int) -> None:
    t.linear(p + "attn_qkv.weight", g.conv_dim, hidden)
    t.linear(p + "attn_gate.weight", g.value_dim, hidden)
    t.small(p + "ssm_conv1d.weight", g.conv_dim, g.conv_kernel, scale=0.5)
    t.small(p + "ssm_dt.bias", g.n_v_heads)
    t.negative(p + "ssm_a", g.n_v_heads)
    t.linear(p + "ssm_beta.weight", g.n_v_heads, hidden)
    t.linear(p + "ssm_alpha.weight", g.n_v_heads, hidden)
    t.norm(p + "ssm_norm.weight", g.state_dim)
    t.linear(p + "ssm_out.weight", hidden, g.value_dim)


def _mamba2(t: _Tensors, p: str, m: Mamba2, hidden: int) -> None:
    t.linear(p + "ssm_in.weight", m.in_proj, hidden)
    t.small(p + "ssm_conv1d.weight", m.conv_dim, m.conv_kernel, scale=0.5)
    t.small(p + "ssm_conv1d.bias", m.conv_dim)
    t.small(p + "ssm_dt.bias", m.n_heads)
    t.negative(p + "ssm_a", m.n_heads, 1)
    t.norm(p + "ssm_d", m.n_heads, 1)
    t.norm(p + "ssm_norm.weight", m.n_groups, m.inner // m.n_groups)
    t.linear(p + "ssm_out.weight", hidden, m.inner)


def _dense_ffn(t: _Tensors, p: str, hidden: int, width: int, gated: bool) -> None:
    if gated:
        t.linear(p + "ffn_gate.weight", width, hidden)
    t.linear(p + "ffn_up.weight", width, hidden)
    t.linear(p + "ffn_down.weight", hidden, width)


def _experts(t: _Tensors, p: str, e: Experts, hidden: int) -> None:
    t.linear(p + "ffn_gate_inp.weight", e.n_experts, hidden)
    if e.router_bias:
        t.small(p + "ffn_gate_inp.bias", e.n_experts)
    if e.selection_bias:
        t.small(p + "exp_probs_b.bias", e.n_experts)
    t.linear(p + "ffn_gate_exps.weight", e.width, hidden, e.n_experts)
    t.linear(p + "ffn_up_exps.weight", e.width, hidden, e.n_experts)
    t.linear(p + "ffn_down_exps.weight", hidden, e.width, e.n_experts)
    if e.expert_bias:
        t.small(p + "ffn_gate_exps.bias", e.n_experts, e.width)
        t.small(p + "ffn_up_exps.bias", e.n_experts, e.width)
        t.small(p + "ffn_down_exps.bias", e.n_experts, hidden)
    if e.n_shared:
        _dense_ffn(t, p, hidden, e.width * e.n_shared, gated=True)
        for part in ("gate", "up", "down"):  # the shared expert's names
            t.items[f"{p}ffn_{part}_shexp.weight"] = t.items.pop(f"{p}ffn_{part}.weight")


def _block(t: _Tensors, spec: ArchSpec, i: int) -> None:
    p, kind, h = f"blk.{i}.", spec.layers[i], spec.hidden
    t.norm(p + "attn_norm.weight", h)
    if kind in (ATTENTION, MTP):
        if isinstance(spec.attention, LatentAttention):
            _latent_attention(t, p, spec.attention, h, i)
        elif isinstance(spec.attention, CompressedAttention):
            _compressed_attention(t, p, spec.attention, h, i)
        else:
            assert isinstance(spec.attention, Attention), f"{spec.arch}: block {i} attends, the spec has no attention"
            _attention(t, p, spec.attention, h)
    elif kind == RECURRENT:
        if isinstance(spec.recurrent, GatedDeltaNet):
            _gated_delta_net(t, p, spec.recurrent, h)
        else:
            assert isinstance(spec.recurrent, Mamba2), f"{spec.arch}: block {i} is recurrent, the spec has no mixer"
            _mamba2(t, p, spec.recurrent, h)
    if spec.post_norms:
        t.norm(p + "post_attention_norm.weight", h)
    if kind == FFN_ONLY or spec.ffn_in_mixer_blocks:
        if kind != FFN_ONLY:  # a feed-forward-only block normalizes with its attn_norm
            t.norm(f"{p}{spec.ffn_norm}.weight", h)
        if spec.is_moe(i):
            assert spec.experts is not None
            _experts(t, p, spec.experts, h)
        else:
            _dense_ffn(t, p, h, spec.ffn, spec.gated_ffn)
    if spec.post_norms:
        t.norm(p + "post_ffw_norm.weight", h)
    if kind == MTP:
        t.linear(p + "nextn.eh_proj.weight", h, 2 * h)
        t.norm(p + "nextn.enorm.weight", h)
        t.norm(p + "nextn.hnorm.weight", h)
        t.norm(p + "nextn.shared_head_norm.weight", h)


def _tensors(spec: ArchSpec, vocab: int) -> dict[str, np.ndarray]:
    t = _Tensors(np.random.default_rng(spec.seed))
    t.linear("token_embd.weight", vocab, spec.hidden)
    for i in range(spec.n_layers):
        _block(t, spec, i)
    t.norm("output_norm.weight", spec.hidden)
    if isinstance(spec.attention, CompressedAttention):  # the head folds the hc copies into one
        hc = spec.attention.hc_mult
        t.linear("output_hc_fn.weight", hc, hc * spec.hidden)
        t.small("output_hc_base.weight", hc)
        t.norm("output_hc_scale.weight", 1)
    if not spec.tie_embeddings:
        t.linear("output.weight", vocab, spec.hidden)
    return t.items


# -- the metadata ----------------------------------------------------------------------------------


def _metadata(spec: ArchSpec, vocab: int) -> dict[str, object]:
    """Keys without the ``<arch>.`` prefix."""
    meta: dict[str, object] = {
        "block_count": spec.n_layers,
        "context_length": spec.context,
        "embedding_length": spec.hidden,
        "feed_forward_length": spec.ffn,
        "rope.freq_base": 10000.0,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "attention.layer_norm_epsilon": 1e-5,
        "vocab_size": vocab,
    }
    for part in (_attention_metadata, _recurrent_metadata, _expert_metadata):
        meta.update(part(spec))
    if spec.n_mtp:
        meta["nextn_predict_layers"] = spec.n_mtp
    meta.update(dict(spec.metadata))
    return meta


def _attention_metadata(spec: ArchSpec) -> dict[str, object]:
    kinds, a = spec.layers, spec.attention
    meta: dict[str, object] = {}
    if isinstance(a, Attention):
        meta.update(
            {
                "attention.head_count": a.n_heads,
                "attention.head_count_kv": a.n_kv_heads,
                "attention.key_length": a.head_dim,
                "attention.value_length": a.head_dim,
                "rope.dimension_count": a.rope_dim or a.head_dim,
            }
        )
        if a.sliding_window:
            meta["attention.sliding_window"] = a.sliding_window
    elif isinstance(a, LatentAttention):
        meta.update(
            {
                "attention.head_count": a.n_heads,
                "attention.head_count_kv": 1,  # the absorbed form is MQA over the latent
                "attention.q_lora_rank": a.q_lora_rank,
                "attention.kv_lora_rank": a.kv_lora_rank,
                "attention.key_length": a.kv_lora_rank + a.rope_dim,
                "attention.value_length": a.kv_lora_rank,
                "attention.key_length_mla": a.nope_dim + a.rope_dim,
                "attention.value_length_mla": a.v_head_dim,
                "rope.dimension_count": a.rope_dim,
            }
        )
        if a.indexer_heads:
            main = [i for i, k in enumerate(kinds) if k != MTP]
            meta.update(
                {
                    "attention.indexer.head_count": a.indexer_heads,
                    "attention.indexer.key_length": a.indexer_head_dim,
                    "attention.indexer.top_k": a.indexer_top_k,
                    "attention.indexer.types": [int(i not in a.shared_indexer) for i in main],
                }
            )
    elif isinstance(a, CompressedAttention):
        meta.update(_compressed_metadata(a, spec.n_layers))
    if spec.per_layer_heads:  # which blocks attend, which have a feed-forward: per-layer arrays
        assert isinstance(a, Attention)
        meta["attention.head_count_kv"] = [a.n_kv_heads if k == ATTENTION else 0 for k in kinds]
        meta["feed_forward_length"] = [spec.ffn if k == FFN_ONLY else 0 for k in kinds]
    return meta


def _compressed_metadata(a: CompressedAttention, n_layers: int) -> dict[str, object]:
    """DeepSeek-V4's compressed attention and hyper-connections."""
    return {
        "attention.head_count": a.n_heads,
        "attention.head_count_kv": 1,
        "attention.key_length": a.head_dim,
        "attention.value_length": a.head_dim,
        "rope.dimension_count": a.rope_dim,
        "attention.q_lora_rank": a.q_lora_rank,
        "attention.sliding_window": a.sliding_window,
        "attention.output_group_count": a.out_groups,
        "attention.output_lora_rank": a.out_lora_rank,
        "attention.compress_rope_freq_base": 10000.0,
        "attention.compress_ratios": [a.ratios[i % len(a.ratios)] for i in range(n_layers)],
        "attention.indexer.head_count": a.indexer_heads,
        "attention.indexer.key_length": a.indexer_head_dim,
        "attention.indexer.top_k": a.indexer_top_k,
        "hyper_connection.count": a.hc_mult,
        "hyper_connection.sinkhorn_iterations": 3,
        "hyper_connection.epsilon": 1e-6,
        "hash_layer_count": 0,  # no layer routes experts by token id
        "swiglu_clamp_exp": 10.0,
    }


def _recurrent_metadata(spec: ArchSpec) -> dict[str, object]:
    r = spec.recurrent
    if isinstance(r, GatedDeltaNet):  # llama.cpp's names: inner = values, heads = value heads, groups = key heads
        inner, heads, groups = r.value_dim, r.n_v_heads, r.n_k_heads
    elif isinstance(r, Mamba2):
        inner, heads, groups = r.inner, r.n_heads, r.n_groups
    else:
        return {}
    return {
        "ssm.conv_kernel": r.conv_kernel,
        "ssm.inner_size": inner,
        "ssm.state_size": r.state_dim,
        "ssm.time_step_rank": heads,
        "ssm.group_count": groups,
    }


def _expert_metadata(spec: ArchSpec) -> dict[str, object]:
    e = spec.experts
    meta: dict[str, object] = {}
    if e is not None:
        meta.update(
            {
                "expert_count": e.n_experts,
                "expert_used_count": e.n_used,
                "expert_feed_forward_length": e.width,
                "expert_shared_count": e.n_shared,
                "leading_dense_block_count": e.leading_dense,
                "expert_weights_scale": 1.0,
            }
        )
        if e.gating:
            meta["expert_gating_func"] = e.gating
        if e.weights_norm is not None:
            meta["expert_weights_norm"] = e.weights_norm
    return meta


def _add(writer: gguf.GGUFWriter, key: str, value: object) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list) and value and isinstance(value[0], bool):
        writer.add_array(key, value)
    elif isinstance(value, list):
        writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    else:
        raise TypeError(f"metadata {key}: cannot write {type(value).__name__}")


# -- writing ---------------------------------------------------------------------------------------


def write_model(
    path: Path | str,
    spec: ArchSpec | str,
    *,
    without: Iterable[str] = (),
    metadata: Mapping[str, object] | None = None,
) -> Path:
    """Write the synthetic model of ``spec`` (an ArchSpec or an architecture name) to ``path``.

    ``without`` drops tensors and ``metadata`` overrides keys (without the ``<arch>.`` prefix):
    the broken models the tests feed the bus and llama.cpp.
    """
    spec = architecture(spec) if isinstance(spec, str) else spec
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab = spm_vocab()
    meta = {**_metadata(spec, len(vocab[0])), **(metadata or {})}
    tensors = _tensors(spec, len(vocab[0]))
    for name in without:
        if tensors.pop(name, None) is None:
            raise ArtifactError(Reason.BAD_SPEC, f"{spec.arch} has no tensor {name} to leave out")
    w = gguf.GGUFWriter(str(path), spec.arch)
    w.add_name(f"synthetic-{spec.arch}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, value in meta.items():
        _add(w, f"{spec.arch}.{key}", value)
    add_spm_tokenizer(w, vocab)
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def variant(spec: ArchSpec | str, **changes) -> ArchSpec:
    """``spec`` with some fields changed (another seed, more layers, another name...)."""
    return replace(architecture(spec) if isinstance(spec, str) else spec, **changes)
