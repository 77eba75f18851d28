"""Owned layer work: what one token costs a node, from the weights of its layer range.

A node's work per token is the number of weights it multiplies (≈ half its FLOPs per token):
- every tensor of its blocks, except that a mixture-of-experts layer multiplies only
  ``expert_used_count`` of its ``n`` routed experts: each routed-expert tensor (``*_exps``, one
  slice per expert) counts ``expert_used_count / n`` of its weights. The router, the shared
  experts, attention and the dense leading layers count in full;
- nothing for multi-token-prediction blocks (cuts.MTP): llama.cpp loads them but never runs them;
- the output head when it is the tail (the tail projects the hidden state onto the vocabulary;
  with tied embeddings that is the token embedding matrix). The head's embedding lookup is a
  gather, not a matmul, and costs nothing here; so do DeepSeek-V4's token-id expert tables.
The unit is millions of weights, independent of quantization (a Q4 and an F16 layer cost the same
FLOPs). Parameter count would rank a 256-expert layer 32 times too heavy against an 8-active one.
"""

from __future__ import annotations

import math
from pathlib import Path

from neuron_bus.artifacts.cuts import n_mtp_layers
from neuron_bus.artifacts.gguf_model import META_PREFIX, OUTPUT, TOKEN_EMBD, GGUFModel, Tensor

_GATHERED = ("ffn_gate_tid2eid.weight",)  # looked up by token id, never multiplied


def _is_routed_expert(t: Tensor) -> bool:
    return t.name.split(".", 2)[2].split(".")[0].endswith("_exps")


def tensor_work(t: Tensor, experts_used: int) -> float:
    """Weights of ``t`` a token multiplies: a routed-expert tensor's experts are its last GGUF
    dimension, of which ``experts_used`` run per token."""
    n = math.prod(t.shape)
    if t.name.endswith(_GATHERED):
        return 0.0
    if _is_routed_expert(t) and len(t.shape) >= 2 and experts_used:
        return n * min(experts_used, t.shape[-1]) / t.shape[-1]
    return float(n)


def owned_layer_work(
    model: GGUFModel | str | Path, layer_start: int, layer_end: int, n_layers: int | None = None
) -> float:
    """Millions of weights multiplied per token by layers [layer_start, layer_end).

    ``model`` may be the whole GGUF or a slice holding the range (its blocks are renumbered from
    0); ``n_layers`` is the model's layer count (a slice's own block count differs).
    """
    m = model if isinstance(model, GGUFModel) else GGUFModel(Path(model))
    offset = int(m.field(META_PREFIX + "layer_start", 0) or 0)  # a slice holds blocks from 0
    total = int(m.field(META_PREFIX + "n_layers_total", 0) or 0) or m.n_layers
    total = total if n_layers is None else n_layers
    used = int(m.field(f"{m.arch}.expert_used_count", 0) or 0)
    first_mtp = m.n_layers - n_mtp_layers(m)  # MTP blocks are the last ones (cuts.layer_kinds): never run
    tensors = m.layer_tensors(layer_start - offset, layer_end - offset)
    weights = sum(tensor_work(t, used) for t in tensors if t.layer is not None and t.layer < first_mtp)
    if layer_end == total:
        weights += head_weights(m)
    return weights / 1e6


def head_weights(model: GGUFModel) -> int:
    """Weights of the output head (the token embedding matrix when the model ties them)."""
    head = model.by_name.get(OUTPUT) or model.by_name.get(TOKEN_EMBD)
    return math.prod(head.shape) if head is not None else 0


def layer_work(model: GGUFModel) -> list[float]:
    """Work per token of each layer (millions of weights); the last layer carries the output head."""
    return [owned_layer_work(model, i, i + 1, model.n_layers) for i in range(model.n_layers)]


def stored_parameters(model: GGUFModel) -> float:
    """Millions of weights the blocks and the output head store (what a parameter count says)."""
    blocks = sum(math.prod(t.shape) for t in model.layer_tensors(0, model.n_layers))
    return (blocks + head_weights(model)) / 1e6
