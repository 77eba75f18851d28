"""Proof by hash: which layer ranges a local file or directory can serve for a manifest's artifact.

Two kinds of local GGUF count as evidence:

- a file of the artifact itself (the original, or a sparse reassembly): each of its pieces is
  hashed; a layer is proven when all its pieces and every file's header pieces match;
- a layer-range slice (``neuron_bus.layer_start`` in its metadata): slices copy tensor bytes raw,
  so each tensor is hashed and compared with the manifest's per-tensor sha256 (block names mapped
  back to the original layer); its metadata must match the manifest's metadata digest.

A range [a, b) is proven when all its layers are, and so are the shared tensors a slice of it
needs (`needed_shared`): output_norm always, token_embd for the head, the lm_head for the tail.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from neuron_bus.artifacts.gguf_model import (
    META_PREFIX,
    ArtifactError,
    GGUFModel,
    format_layers,
    layer_of,
    needed_shared,
)
from neuron_bus.artifacts.manifest import metadata_digest, n_layers, sha256_range
from neuron_bus.messages import ArtifactManifest
from workers.errors import Reason


@dataclass
class SourceReport:
    path: str
    kind: str  # "file" (a file of the artifact), "slice", or "unusable"
    ok: bool  # everything in it matched
    layers: str | None = None  # for a slice: the range it was cut from
    problem: str | None = None


@dataclass
class VerifyReport:
    artifact_id: str
    n_layers: int
    ranges: list[tuple[int, int]]  # maximal proven ranges, half-open; any sub-range is servable
    sources: list[SourceReport] = field(default_factory=list)

    @property
    def problem(self) -> str | None:
        return next((s.problem for s in self.sources if s.problem), None)

    def to_dict(self) -> dict:
        return {
            "artifact_id": self.artifact_id,
            "n_layers": self.n_layers,
            "ranges": [format_layers(a, b) for a, b in self.ranges],
            "sources": [s.__dict__ for s in self.sources],
        }


@dataclass
class _Evidence:
    pieces: set[int] = field(default_factory=set)  # matching pieces of artifact files
    layers: set[int] = field(default_factory=set)  # layers proven by slices
    shared: set[str] = field(default_factory=set)  # shared tensors proven by slices


def _gguf_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ArtifactError(Reason.MISSING, f"{path}: no such file or directory")
    files = [
        p
        for p in sorted(path.rglob("*.gguf"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    if not files:
        raise ArtifactError(Reason.MISSING, f"{path}: no .gguf files in this directory")
    return files


def _check_file(path: Path, manifest: ArtifactManifest, ev: _Evidence, why_not_gguf: str | None) -> SourceReport:
    """Hash the pieces of a (claimed) file of the artifact, matched by name, else by size."""
    size = path.stat().st_size
    fh = next((f for f in manifest.file_hashes if f.name == path.name), None)
    if fh is None:
        same_size = [f for f in manifest.file_hashes if f.size == size]
        fh = same_size[0] if len(same_size) == 1 else None
    if fh is None:
        names = ", ".join(f"{f.name} ({f.size} bytes)" for f in manifest.file_hashes)
        problem = why_not_gguf or f"{path} is not a file of artifact {manifest.artifact_id} (it has {names})"
        return SourceReport(str(path), "unusable", False, problem=problem)
    pieces = [p for p in manifest.piece_hashes if p.file == fh.name]
    bad = []
    with open(path, "rb") as f:
        for p in pieces:
            if p.offset + p.length <= size and sha256_range(f, p.offset, p.length) == p.sha256:
                ev.pieces.add(p.index)
            else:
                bad.append(p)
    header = [i for i in manifest.header_pieces if manifest.piece_hashes[i].file == fh.name]
    if any(i not in ev.pieces for i in header):
        problem = (
            f"{path} does not match artifact {manifest.artifact_id}: its header differs from "
            f"{fh.name}'s (is the manifest for a different file?)"
        )
        return SourceReport(str(path), "unusable", False, problem=problem)
    if bad:
        problem = (
            f"{path}: {len(bad)} of {len(pieces)} pieces do not match (first: piece {bad[0].index}, {bad[0].region})"
        )
        return SourceReport(str(path), "file", False, problem=problem)
    return SourceReport(str(path), "file", True)


def _check_slice(path: Path, model: GGUFModel, manifest: ArtifactManifest, ev: _Evidence) -> SourceReport:
    start = int(model.field(META_PREFIX + "layer_start"))
    end = int(model.field(META_PREFIX + "layer_end", start))
    layers = format_layers(start, end)

    def unusable(problem: str) -> SourceReport:
        return SourceReport(str(path), "slice", False, layers=layers, problem=f"{path}: {problem}")

    aid = model.field(META_PREFIX + "artifact_id") or ""
    if aid and aid != manifest.artifact_id:
        return unusable(f"a slice of artifact {aid}, not {manifest.artifact_id}")
    if int(model.field(META_PREFIX + "n_layers_total", -1)) != n_layers(manifest):
        return unusable(f"cut from a model of another size, not artifact {manifest.artifact_id}")
    if metadata_digest(model) != manifest.metadata_sha256:
        return unusable(f"its metadata differs from artifact {manifest.artifact_id}'s")
    expected = {t.name: t for t in manifest.tensor_to_layer_map}
    placeholders = set(model.field(META_PREFIX + "placeholder_tensors", []) or [])
    matched: set[str] = set()
    bad: list[str] = []
    with open(path, "rb") as f:
        for t in model.tensors:
            if t.name in placeholders:
                continue
            name = t.name if t.layer is None else f"blk.{t.layer + start}." + t.name.split(".", 2)[2]
            want = expected.get(name)
            if want is None or want.nbytes != t.nbytes or sha256_range(f, t.offset, t.nbytes) != want.sha256:
                bad.append(name)
            else:
                matched.add(name)
    for layer in range(start, end):
        if all(n in matched for n, e in expected.items() if e.layer == layer):
            ev.layers.add(layer)
    ev.shared |= {n for n in matched if layer_of(n) is None}
    if bad:
        return unusable(f"{len(bad)} tensors do not match artifact {manifest.artifact_id} (first: {bad[0]})")
    return SourceReport(str(path), "slice", True, layers=layers)


def _proven_ranges(manifest: ArtifactManifest, ev: _Evidence) -> list[tuple[int, int]]:
    n = n_layers(manifest)
    if all(i in ev.pieces for i in manifest.header_pieces):  # the artifact's own files
        for t in manifest.tensor_to_layer_map:
            if all(i in ev.pieces for i in t.pieces):
                if t.layer is None:
                    ev.shared.add(t.name)
        for layer in range(n):
            if all(i in ev.pieces for i in manifest.layer_to_artifact_map[str(layer)]):
                ev.layers.add(layer)
    shared_names = [t.name for t in manifest.tensor_to_layer_map if t.layer is None]

    def servable(a: int, b: int) -> bool:
        real, _ = needed_shared(shared_names, n, a, b)
        return all(name in ev.shared for name in real)

    ranges = []
    layer = 0
    while layer < n:
        if layer not in ev.layers:
            layer += 1
            continue
        a = layer
        while layer < n and layer in ev.layers:
            layer += 1
        b = layer
        # A run touching the head or tail may lack token_embd / the lm_head: drop that end layer.
        for a2, b2 in ((a, b), (a + 1, b), (a, b - 1), (a + 1, b - 1)):
            if a2 < b2 and servable(a2, b2):
                ranges.append((a2, b2))
                break
    return ranges


def verify(path: Path, manifest: ArtifactManifest) -> VerifyReport:
    """Which layer ranges of ``manifest``'s artifact the GGUF file(s) at ``path`` prove, by hash."""
    ev = _Evidence()
    sources = []
    for file in _gguf_files(Path(path)):
        try:
            model = GGUFModel(file)
        except ArtifactError as exc:
            if exc.reason in (Reason.NOT_GGUF, Reason.CORRUPT, Reason.TRUNCATED, Reason.MISSING):
                why = str(exc)
            else:  # one file of a gguf-split set cannot be read alone: check it by pieces
                why = None
            sources.append(_check_file(file, manifest, ev, why))
            continue
        if model.field(META_PREFIX + "layer_start") is not None:
            sources.append(_check_slice(file, model, manifest, ev))
        else:
            sources.append(_check_file(file, manifest, ev, None))
    return VerifyReport(manifest.artifact_id, n_layers(manifest), _proven_ranges(manifest, ev), sources)
