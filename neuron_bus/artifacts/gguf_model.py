"""Reading a GGUF model (one file or a gguf-split set) as metadata + tensors grouped by layer.

This is the one place that opens GGUF files for the bus side; manifests, plans and slices all
build on `GGUFModel`. Errors are `ArtifactError`s with one clear line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import gguf

from neuron_bus.errors import NeuronBusError
from workers.errors import Reason
from workers.gguf_reader import GGUFReader

META_PREFIX = "neuron_bus."  # our own metadata keys (llama.cpp's gguf-split owns "split.*")
_BLOCK = re.compile(r"^blk\.(\d+)\.")

# Tensors outside the blocks, by role. llama.cpp insists on token_embd and output_norm in every
# model it loads; `output` falls back to token_embd when a model ties its embeddings.
TOKEN_EMBD = "token_embd.weight"
OUTPUT_NORM = "output_norm.weight"
OUTPUT = "output.weight"


class ArtifactError(NeuronBusError):
    """Bad or unusable artifact: not a GGUF, truncated, wrong range, hash mismatch..."""


def layer_of(tensor_name: str) -> int | None:
    m = _BLOCK.match(tensor_name)
    return int(m.group(1)) if m else None


def parse_layers(spec: str, n_layers: int | None = None) -> tuple[int, int]:
    """'16-29' (inclusive, as users write it) or '7' -> half-open (16, 30)."""
    try:
        if "-" in spec:
            a, b = spec.split("-", 1)
            start, last = int(a), int(b)
        else:
            start = last = int(spec)
    except ValueError:
        raise ArtifactError(Reason.BAD_RANGE, f"bad layer range {spec!r}: write it as FIRST-LAST, e.g. 16-29") from None
    if start < 0 or last < start:
        raise ArtifactError(Reason.BAD_RANGE, f"bad layer range {spec!r}: FIRST must be <= LAST and >= 0")
    if n_layers is not None and last >= n_layers:
        raise ArtifactError(
            Reason.BAD_RANGE, f"layer range {spec} is outside the model: it has layers 0-{n_layers - 1}"
        )
    return start, last + 1


def format_layers(start: int, end: int) -> str:
    return f"{start}-{end - 1}"


@dataclass(frozen=True)
class Tensor:
    name: str
    file: str  # file name (within the model's directory)
    offset: int  # absolute byte offset of the data in that file
    nbytes: int
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order (fastest dimension first)
    layer: int | None
    reader_tensor: gguf.ReaderTensor  # for streaming its bytes


class GGUFModel:
    """One model: the first file's metadata and every file's tensors."""

    def __init__(self, paths: list[Path] | Path):
        if isinstance(paths, (str, Path)):
            paths = [Path(paths)]
        self.paths = [Path(p) for p in paths]
        self.readers = [self._open(p) for p in self.paths]
        # A gguf-split set may be given in any order: metadata lives in split 0.
        nos = [r.fields.get("split.no") for r in self.readers]
        if len(self.readers) > 1 and all(f is not None for f in nos):
            order = sorted(range(len(nos)), key=lambda i: int(nos[i].contents()))  # type: ignore[union-attr]
            self.paths = [self.paths[i] for i in order]
            self.readers = [self.readers[i] for i in order]
        self.meta = self.readers[0]
        self.arch = self.field("general.architecture")
        if not isinstance(self.arch, str):
            raise ArtifactError(Reason.NOT_GGUF, f"{self.paths[0]}: no general.architecture in metadata")
        self.tensors: list[Tensor] = []
        for path, reader in zip(self.paths, self.readers):
            for t in reader.tensors:
                self.tensors.append(
                    Tensor(
                        name=t.name,
                        file=path.name,
                        offset=int(t.data_offset),
                        nbytes=int(t.n_bytes),
                        ggml_type=t.tensor_type,
                        shape=tuple(int(d) for d in t.shape),
                        layer=layer_of(t.name),
                        reader_tensor=t,
                    )
                )
        self.by_name = {t.name: t for t in self.tensors}
        block_count = self.field(f"{self.arch}.block_count")
        if block_count is None:
            raise ArtifactError(Reason.CORRUPT, f"{self.paths[0]}: no {self.arch}.block_count in metadata")
        self.n_layers = int(block_count)
        self._check_complete()
        self._check_experts()

    @staticmethod
    def _open(path: Path) -> gguf.GGUFReader:
        if not path.is_file():
            raise ArtifactError(Reason.MISSING, f"{path}: no such file")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ArtifactError(Reason.NOT_GGUF, f"{path}: not a GGUF file (magic {magic!r})")
        try:
            reader = GGUFReader(path)
        except Exception as exc:  # the reader raises ValueError, IndexError, struct errors...
            raise ArtifactError(Reason.CORRUPT, f"{path}: truncated or corrupt GGUF ({exc})") from None
        size = path.stat().st_size
        for t in reader.tensors:
            if int(t.data_offset) + int(t.n_bytes) > size:
                raise ArtifactError(
                    Reason.TRUNCATED,
                    f"{path}: truncated GGUF (tensor {t.name} ends at byte "
                    f"{int(t.data_offset) + int(t.n_bytes)}, file has {size})",
                )
        return reader

    def _check_complete(self) -> None:
        missing = [i for i in range(self.n_layers) if not any(t.layer == i for t in self.tensors)]
        split_count = self.field("split.count")
        if missing and split_count and int(split_count) > len(self.paths):
            raise ArtifactError(
                Reason.INCOMPLETE_SPLIT,
                f"{self.paths[0]}: gguf-split model has {int(split_count)} files; pass all of them",
            )
        if missing:
            raise ArtifactError(Reason.CORRUPT, f"{self.paths[0]}: no tensors for layers {missing[:5]}...")

    def _check_experts(self) -> None:
        """The expert count the metadata states is the one every expert tensor holds (GGUF order:
        experts are a router's last dimension, and an expert tensor's)."""
        stated = self.field(f"{self.arch}.expert_count")
        used = self.field(f"{self.arch}.expert_used_count")
        for t in self.tensors:
            suffix = t.name.split(".", 2)[2] if t.layer is not None else ""
            if not (suffix.startswith("ffn_gate_inp.weight") or suffix.split(".")[0].endswith("_exps")):
                continue
            held = t.shape[-1]
            if stated is None:
                raise ArtifactError(
                    Reason.INCONSISTENT,
                    f"{self.paths[0]}: {t.name} holds {held} experts but {self.arch}.expert_count is missing",
                )
            if held != int(stated):
                raise ArtifactError(
                    Reason.INCONSISTENT,
                    f"{self.paths[0]}: {self.arch}.expert_count is {int(stated)} but {t.name} holds {held} experts",
                )
        if stated is not None and used is not None and not 0 < int(used) <= int(stated):
            raise ArtifactError(
                Reason.INCONSISTENT,
                f"{self.paths[0]}: {self.arch}.expert_used_count {int(used)} is not within 1..{int(stated)} experts",
            )

    def field(self, key: str, default=None):
        f = self.meta.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def layer_tensors(self, start: int, end: int) -> list[Tensor]:
        return [t for t in self.tensors if t.layer is not None and start <= t.layer < end]

    def shared_tensors(self) -> list[Tensor]:
        return [t for t in self.tensors if t.layer is None]

    @property
    def ties_embeddings(self) -> bool:
        return OUTPUT not in self.by_name

    def needed_shared(self, start: int, end: int) -> tuple[list[str], list[str]]:
        """Shared tensors a llama.cpp slice of [start, end) holds: see :func:`needed_shared`."""
        return needed_shared([t.name for t in self.shared_tensors()], self.n_layers, start, end)


def needed_shared(shared: list[str], n_layers: int, start: int, end: int) -> tuple[list[str], list[str]]:
    """Which of a model's ``shared`` (non-block) tensors a slice of [start, end) holds: (real, placeholders).

    The head needs token_embd's real bytes; so does a tail of a model with tied embeddings
    (its lm_head is token_embd). llama.cpp still loads token_embd in every other slice, but
    never reads it there (embeddings are injected), so it can be zeros: a placeholder costs
    no download. output_norm and output are needed by the tail; output_norm is loaded by
    every slice and is tiny, so it is always real. A model with its own ``output`` gets it in
    every slice, zeros before the tail: some architectures' loaders (gpt-oss) require it even
    where the graph never reaches the head. Works from tensor names alone, so a
    manifest can be planned without the model file.
    """
    ties_embeddings = OUTPUT not in shared
    is_head, is_tail = start == 0, end == n_layers
    real, placeholder = [OUTPUT_NORM], []
    if is_head or (is_tail and ties_embeddings):
        real.append(TOKEN_EMBD)
    else:
        placeholder.append(TOKEN_EMBD)
    if not ties_embeddings:  # several architectures (gpt-oss, ...) insist on `output` in every slice
        (real if is_tail else placeholder).append(OUTPUT)
    for name in shared:  # architecture extras (rope factors, ...)
        if name not in (TOKEN_EMBD, OUTPUT_NORM, OUTPUT):
            real.append(name)
    return real, placeholder
