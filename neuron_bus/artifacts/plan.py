"""Planning: the exact pieces a node must hold to serve a layer range, from the manifest alone."""

from __future__ import annotations

from dataclasses import dataclass, field

from neuron_bus.artifacts.gguf_model import ArtifactError, format_layers, needed_shared
from neuron_bus.artifacts.manifest import n_layers
from neuron_bus.messages import ArtifactManifest
from workers.errors import Reason


@dataclass(frozen=True)
class Plan:
    artifact_id: str
    start: int
    end: int  # half-open
    header_pieces: list[int]  # every file's header: needed to read any tensor
    block_pieces: list[int]  # the range's block tensors
    shared_pieces: dict[str, list[int]]  # real shared tensors the slice needs, by name
    placeholders: list[str]  # shared tensors the slice holds as zeros: nothing to fetch
    pieces: list[int] = field(default_factory=list)  # all of the above, sorted, distinct
    nbytes: int = 0  # bytes of those pieces

    @property
    def layers(self) -> str:
        return format_layers(self.start, self.end)

    def to_dict(self) -> dict:
        return {
            "artifact_id": self.artifact_id,
            "layers": self.layers,
            "layer_start": self.start,
            "layer_end": self.end,
            "pieces": self.pieces,
            "bytes": self.nbytes,
            "header_pieces": self.header_pieces,
            "block_pieces": self.block_pieces,
            "shared_pieces": self.shared_pieces,
            "placeholders": self.placeholders,
        }


def plan(manifest: ArtifactManifest, start: int, end: int) -> Plan:
    """Pieces for layers [start, end): headers, the range's blocks, and the shared tensors it needs."""
    n = n_layers(manifest)
    if not 0 <= start < end <= n:
        raise ArtifactError(
            Reason.BAD_RANGE, f"layer range {start}-{end - 1} is outside the model: it has layers 0-{n - 1}"
        )
    shared = [t for t in manifest.tensor_to_layer_map if t.layer is None]
    real, placeholders = needed_shared([t.name for t in shared], n, start, end)
    shared_pieces = {t.name: list(t.pieces) for t in shared if t.name in real}
    missing = [name for name in real if name not in shared_pieces]
    if missing:
        raise ArtifactError(Reason.BAD_MANIFEST, f"manifest {manifest.artifact_id} has no tensor {missing[0]}")
    block = sorted({i for layer in range(start, end) for i in manifest.layer_to_artifact_map[str(layer)]})
    header = list(manifest.header_pieces)
    pieces = sorted(set(header) | set(block) | {i for p in shared_pieces.values() for i in p})
    nbytes = sum(manifest.piece_hashes[i].length for i in pieces)
    return Plan(
        artifact_id=manifest.artifact_id,
        start=start,
        end=end,
        header_pieces=header,
        block_pieces=block,
        shared_pieces=shared_pieces,
        placeholders=placeholders,
        pieces=pieces,
        nbytes=nbytes,
    )
