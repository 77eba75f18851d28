"""Artifact manifests: a GGUF model's files cut into hashed pieces and mapped onto its layers.

`build_manifest` reads a model (one file or a gguf-split set) once: every file is cut into
regions (its header, then one region per shared tensor and per layer's run of block tensors),
each region into pieces of at most ``piece_size`` bytes, and every piece, tensor and file is
hashed with sha256 in a single streaming pass. The artifact id is derived from the content.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import msgspec

from neuron_bus import models
from neuron_bus.artifacts.cuts import layer_kinds
from neuron_bus.artifacts.gguf_model import META_PREFIX, ArtifactError, GGUFModel, Tensor
from neuron_bus.messages import (
    ArtifactManifest,
    CacheDescriptor,
    FileHash,
    PieceHash,
    TensorEntry,
)
from workers.errors import Reason
from workers.files import atomic_output

DEFAULT_PIECE_SIZE = 1 << 20
READ_CHUNK = 1 << 20
HEADER = "header"

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


def sha256_range(f, offset: int, length: int) -> str:
    """sha256 of ``length`` bytes at ``offset`` of an open binary file; short reads are an error."""
    h = hashlib.sha256()
    f.seek(offset)
    left = length
    while left:
        buf = f.read(min(READ_CHUNK, left))
        if not buf:
            raise ArtifactError(Reason.TRUNCATED, f"{f.name}: truncated (needs {length} bytes at {offset})")
        h.update(buf)
        left -= len(buf)
    return h.hexdigest()


def region_of(t: Tensor) -> str:
    return f"blk.{t.layer}" if t.layer is not None else t.name


@dataclass(frozen=True)
class _Region:
    name: str
    start: int
    end: int


def _regions(tensors: list[Tensor], size: int) -> list[_Region]:
    """Cut one file into its header and runs of tensors of the same layer (or shared tensor)."""
    tensors = sorted(tensors, key=lambda t: t.offset)
    data_start = tensors[0].offset if tensors else size
    cuts: list[tuple[str, int]] = [(HEADER, 0)]
    for t in tensors:
        if region_of(t) != cuts[-1][0]:
            cuts.append((region_of(t), t.offset))
    bounds = [c[1] for c in cuts[1:]] + [size]
    regions = [_Region(name, start, end) for (name, start), end in zip(cuts, bounds)]
    assert regions[0].end == data_start
    return [r for r in regions if r.end > r.start]


def _ordered(paths: list[Path] | GGUFModel) -> GGUFModel:
    """Open a model (GGUFModel puts a gguf-split set in split order); file names must be distinct."""
    model = paths if isinstance(paths, GGUFModel) else GGUFModel(paths)
    if len({p.name for p in model.paths}) != len(model.paths):
        raise ArtifactError(Reason.BAD_FILES, "model files must have distinct names")
    return model


def metadata_digest(model: GGUFModel) -> str:
    """sha256 over the metadata a layer-range slice keeps unchanged (whole models and slices alike).

    Left out: the GGUF/split/neuron_bus bookkeeping keys, the block count and per-layer arrays
    (a slice changes those).
    """
    h = hashlib.sha256()
    skip = ("GGUF.", "split.", META_PREFIX)
    for name in sorted(model.meta.fields):
        if name.startswith(skip) or name == f"{model.arch}.block_count":
            continue
        field = model.meta.fields[name]
        value = field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        if (
            name.startswith(f"{model.arch}.")
            and sub not in (None, gguf.GGUFValueType.STRING)
            and isinstance(value, list)
            and len(value) == model.n_layers
        ):
            continue
        h.update(msgspec.json.encode([name, [int(t) for t in field.types], value]))
    return h.hexdigest()


def _quantization(model: GGUFModel) -> str:
    ft = model.field("general.file_type")
    if ft is not None:
        try:
            return gguf.LlamaFileType(int(ft)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    by_bytes: Counter[str] = Counter()
    for t in model.tensors:
        if t.layer is not None:
            by_bytes[t.ggml_type.name] += t.nbytes
    return by_bytes.most_common(1)[0][0] if by_bytes else "unknown"


def _first(value):
    return max(value) if isinstance(value, list) else value


def cache_descriptor(model: GGUFModel) -> CacheDescriptor:
    a = model.arch
    hidden = int(model.field(f"{a}.embedding_length", 0))
    n_heads = int(_first(model.field(f"{a}.attention.head_count", 1)) or 1)
    n_kv = int(_first(model.field(f"{a}.attention.head_count_kv", n_heads)) or n_heads)
    k_dim = int(model.field(f"{a}.attention.key_length", hidden // n_heads))
    v_dim = int(model.field(f"{a}.attention.value_length", k_dim))
    return CacheDescriptor(
        architecture=a,
        n_layers=model.n_layers,
        n_kv_heads=n_kv,
        head_dim=k_dim,
        hidden_size=hidden,
        kv_bytes_per_token_per_layer=n_kv * (k_dim + v_dim) * 2,
        layer_kinds=layer_kinds(model),
    )


def _hash_file(path: Path, pieces: list[PieceHash], tensors: list[TensorEntry], tick: Callable[[int], None]) -> str:
    """One pass over ``path``: fills in piece and tensor sha256s, returns the file's sha256."""
    file_h = hashlib.sha256()
    tensors = sorted(tensors, key=lambda t: t.offset)
    hashers = {t.name: hashlib.sha256() for t in tensors}
    ti = 0
    with open(path, "rb") as f:
        for p in pieces:  # contiguous, in file order, covering the whole file
            buf = f.read(p.length)
            if len(buf) != p.length:
                raise ArtifactError(Reason.TRUNCATED, f"{path}: truncated while hashing")
            file_h.update(buf)
            p.sha256 = hashlib.sha256(buf).hexdigest()
            end = p.offset + p.length
            while ti < len(tensors) and tensors[ti].offset + tensors[ti].nbytes <= p.offset:
                ti += 1
            j = ti
            while j < len(tensors) and tensors[j].offset < end:
                t = tensors[j]
                lo, hi = max(t.offset, p.offset), min(t.offset + t.nbytes, end)
                hashers[t.name].update(buf[lo - p.offset : hi - p.offset])
                j += 1
            tick(p.length)
    for t in tensors:
        t.sha256 = hashers[t.name].hexdigest()
    return file_h.hexdigest()


def artifact_id_for(file_hashes: list[FileHash], piece_size: int) -> str:
    """Content-derived: the files' hashes and sizes, in order, and the piece size (pieces are named by index)."""
    h = hashlib.sha256(b"neuron-bus artifact v1\n")
    h.update(f"piece_size={piece_size}\n".encode())
    for fh in file_hashes:
        h.update(f"{fh.size} {fh.sha256}\n".encode())
    return h.hexdigest()[:32]


def _layout(
    path: Path, tensors: list[Tensor], piece_size: int, first: int
) -> tuple[list[PieceHash], list[TensorEntry]]:
    """One file's pieces (numbered from ``first``, not hashed yet) and its tensors with the pieces holding them."""
    pieces = [
        PieceHash(
            index=first + i, file=path.name, offset=off, length=min(piece_size, r.end - off), sha256="", region=r.name
        )
        for i, (r, off) in enumerate(
            (r, off) for r in _regions(tensors, path.stat().st_size) for off in range(r.start, r.end, piece_size)
        )
    ]
    entries = [
        TensorEntry(
            name=t.name,
            file=path.name,
            offset=t.offset,
            nbytes=t.nbytes,
            ggml_type=t.ggml_type.name,
            shape=list(t.shape),
            layer=t.layer,
            pieces=[p.index for p in pieces if p.offset < t.offset + t.nbytes and p.offset + p.length > t.offset],
        )
        for t in tensors
    ]
    return pieces, entries


def _ticker(total: int, progress: Progress | None) -> Callable[[int], None]:
    """Count bytes hashed and report (done, total) to ``progress``."""
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(done, total)

    return tick


def build_manifest(
    paths: list[Path] | Path | GGUFModel,
    piece_size: int = DEFAULT_PIECE_SIZE,
    model_preset: str | None = None,
    upstream_repo: str | None = None,
    revision: str = "",
    license: str | None = None,
    runtime_backend: str = "llama.cpp",
    context_cap: int | None = None,
    progress: Progress | None = None,
) -> ArtifactManifest:
    """Hash and map a model (one GGUF or every file of a gguf-split set)."""
    if piece_size < 4096:
        raise ArtifactError(Reason.BAD_PIECE_SIZE, f"piece size {piece_size} is too small (at least 4096 bytes)")
    if isinstance(paths, (str, Path)):
        paths = [Path(paths)]
    model = _ordered(paths if isinstance(paths, GGUFModel) else [Path(p) for p in paths])

    pieces: list[PieceHash] = []
    entries: list[TensorEntry] = []
    per_file: list[tuple[Path, list[PieceHash], list[TensorEntry]]] = []
    for path in model.paths:
        file_pieces, file_entries = _layout(
            path, [t for t in model.tensors if t.file == path.name], piece_size, len(pieces)
        )
        pieces += file_pieces
        entries += file_entries
        per_file.append((path, file_pieces, file_entries))
    header_pieces = [p.index for p in pieces if p.region == HEADER]

    tick = _ticker(sum(p.length for p in pieces), progress)
    file_hashes = [
        FileHash(name=path.name, size=path.stat().st_size, sha256=_hash_file(path, fp, fe, tick))
        for path, fp, fe in per_file
    ]
    layer_map = {str(i): sorted({p for e in entries if e.layer == i for p in e.pieces}) for i in range(model.n_layers)}
    preset_name = model_preset or models.preset_for(model.paths[0])
    preset = models.PRESETS.get(preset_name)
    return ArtifactManifest(
        artifact_id=artifact_id_for(file_hashes, piece_size),
        model_preset=preset_name,
        upstream_repo=upstream_repo if upstream_repo is not None else (preset.upstream_repo if preset else ""),
        upstream_revision=revision,
        license=license
        if license is not None
        else (preset.license if preset else str(model.field("general.license", "") or "")),
        runtime_backend=runtime_backend,
        quantization=_quantization(model),
        context_cap=int(context_cap or model.field(f"{model.arch}.context_length", 0) or 0),
        piece_size=piece_size,
        file_hashes=file_hashes,
        piece_hashes=pieces,
        tensor_to_layer_map=entries,
        layer_to_artifact_map=layer_map,
        tokenizer_artifacts=sorted(k for k in model.meta.fields if k.startswith("tokenizer.")),
        cache_descriptor=cache_descriptor(model),
        header_pieces=header_pieces,
        metadata_sha256=metadata_digest(model),
    )


def n_layers(manifest: ArtifactManifest) -> int:
    return manifest.cache_descriptor.n_layers


def encode_manifest(manifest: ArtifactManifest) -> bytes:
    return msgspec.json.format(msgspec.json.encode(manifest), indent=1)


def decode_manifest(data: bytes, source: str = "manifest") -> ArtifactManifest:
    try:
        manifest = msgspec.json.decode(data, type=ArtifactManifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ArtifactError(Reason.BAD_MANIFEST, f"{source}: not an artifact manifest ({exc})") from None
    if len(manifest.layer_to_artifact_map) != manifest.cache_descriptor.n_layers:
        raise ArtifactError(Reason.BAD_MANIFEST, f"{source}: layer map does not cover the model's layers")
    return manifest


def save_manifest(manifest: ArtifactManifest, path: Path) -> Path:
    """Write JSON whole (workers/files.py)."""
    path = Path(path)
    with atomic_output(path) as tmp:
        tmp.write_bytes(encode_manifest(manifest))
    return path


def load_manifest(path: Path) -> ArtifactManifest:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ArtifactError(Reason.MISSING, f"{path}: cannot read manifest ({exc.strerror})") from None
    return decode_manifest(data, str(path))
