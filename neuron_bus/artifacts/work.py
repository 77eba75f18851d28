"""Owned layer work: what one token costs a node, from the weights of its layer range.

A node's work per token is the number of weights it multiplies (≈ half its FLOPs per token):
every tensor of its blocks, plus the output head when it is the tail (the tail projects the
hidden state onto the vocabulary; with tied embeddings that is the token embedding matrix).
The head's embedding lookup is a gather, not a matmul, and costs nothing here. The unit is
millions of weights, independent of quantization (a Q4 and an F16 layer cost the same FLOPs).
"""

from __future__ import annotations

import math
from pathlib import Path

from neuron_bus.artifacts.gguf_model import OUTPUT, TOKEN_EMBD, GGUFModel


def owned_layer_work(
    model: GGUFModel | str | Path, layer_start: int, layer_end: int, n_layers: int | None = None
) -> float:
    """Millions of weights multiplied per token by layers [layer_start, layer_end).

    ``model`` may be the whole GGUF or a slice holding the range; ``n_layers`` is the model's
    layer count (a slice's own block count may differ).
    """
    m = model if isinstance(model, GGUFModel) else GGUFModel(Path(model))
    total = m.n_layers if n_layers is None else n_layers
    weights = sum(math.prod(t.shape) for t in m.layer_tensors(layer_start, layer_end))
    if layer_end == total:
        head = m.by_name.get(OUTPUT) or m.by_name.get(TOKEN_EMBD)
        if head is not None:
            weights += math.prod(head.shape)
    return weights / 1e6


def layer_work(model: GGUFModel) -> list[float]:
    """Work per token of each layer (millions of weights); the last layer carries the output head."""
    return [owned_layer_work(model, i, i + 1, model.n_layers) for i in range(model.n_layers)]
