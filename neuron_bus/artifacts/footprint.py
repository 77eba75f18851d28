"""What serving a layer range of a model costs a node in memory, from the model's manifest.

Per layer: its tensors' bytes (as stored: the quantization stays) plus the KV of that layer for
every position the node's slots hold (the manifest's cache descriptor: bytes per token per layer).
At the edges: the token embeddings for the head (layer 0), the output head for the tail (its own
matrix, or the embeddings again when the model ties them). A self-placing worker states its
budget and slots; the tracker only offers it ranges that fit (tracker/placement.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from neuron_bus.artifacts.gguf_model import OUTPUT, OUTPUT_NORM, TOKEN_EMBD
from neuron_bus.messages import ArtifactManifest


@dataclass(frozen=True)
class Footprint:
    layer_bytes: tuple[int, ...]
    embd_bytes: int
    head_bytes: int

    def smallest(self) -> int:
        """The bytes of the cheapest single layer a node could serve (a middle one: no edges)."""
        middles = self.layer_bytes[1:-1] or self.layer_bytes
        return min(middles)


def footprint(manifest: ArtifactManifest, kv_positions: int) -> Footprint:
    n = manifest.cache_descriptor.n_layers
    weights = [0] * n
    shared: dict[str, int] = {}
    for t in manifest.tensor_to_layer_map:
        if t.layer is None:
            shared[t.name] = t.nbytes
        elif 0 <= t.layer < n:
            weights[t.layer] += t.nbytes
    kv = manifest.cache_descriptor.kv_bytes_per_token_per_layer * kv_positions
    embd = shared.get(TOKEN_EMBD, 0)
    head = shared.get(OUTPUT, embd) + shared.get(OUTPUT_NORM, 0)
    return Footprint(tuple(w + kv for w in weights), embd, head)
