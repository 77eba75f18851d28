"""Layer-range slices: a loadable GGUF holding only blocks [start, end) of a model.

Metadata is copied, ``<arch>.block_count`` becomes the range size, per-layer arrays are cut and
what llama.cpp derives from layer indices or leading/trailing counts is restated
(cuts.slice_metadata), ``blk.{start..end-1}`` are renamed ``blk.{0..}``, tensor bytes are copied
raw (no requantization), and the original range is recorded under ``neuron_bus.*``. The file is written to a temporary name and renamed into place,
so a failed write leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np

from neuron_bus.artifacts.cuts import check_cut, layer_kinds, slice_metadata
from neuron_bus.artifacts.gguf_model import META_PREFIX, ArtifactError, GGUFModel, Tensor, format_layers
from workers.errors import Reason
from workers.files import atomic_output

_SKIP_KEYS = ("GGUF.", "split.", META_PREFIX)


def _copy_metadata(model: GGUFModel, writer: gguf.GGUFWriter, start: int, end: int) -> None:
    """Every key of the model, with what the slice restates (cuts.slice_metadata) in its place."""
    restated = slice_metadata(model, start, end)
    for name, field in model.meta.fields.items():
        if name.startswith(_SKIP_KEYS) or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = restated.pop(name, field.contents())
        writer.add_key_value(name, value, vtype, sub)
    for name, value in restated.items():  # keys the whole model leaves to llama.cpp's derivations
        if isinstance(value, list) and value and isinstance(value[0], bool):
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)


def slice_gguf(
    model: GGUFModel | Path | list[Path],
    start: int,
    end: int,
    out_path: Path,
    artifact_id: str = "",
) -> Path:
    """Write blocks [start, end) of ``model`` as a standalone GGUF at ``out_path``."""
    if not isinstance(model, GGUFModel):
        model = GGUFModel(model)
    if not 0 <= start < end <= model.n_layers:
        raise ArtifactError(
            Reason.BAD_RANGE,
            f"layer range {start}-{end - 1} is outside the model: it has layers 0-{model.n_layers - 1}",
        )
    check_cut(layer_kinds(model), start, end)  # a slice llama.cpp would abort on is of no use
    real, placeholder = model.needed_shared(start, end)
    tensors: list[tuple[str, Tensor, bool]] = []  # (new name, tensor, placeholder?)
    for t in model.tensors:
        if t.layer is None:
            if t.name in real or t.name in placeholder:
                tensors.append((t.name, t, t.name in placeholder))
        elif start <= t.layer < end:
            new = f"blk.{t.layer - start}." + t.name.split(".", 2)[2]
            tensors.append((new, t, False))

    out_path = Path(out_path)
    with atomic_output(out_path) as tmp:
        writer = gguf.GGUFWriter(tmp, model.arch)
        _copy_metadata(model, writer, start, end)
        writer.add_uint32(META_PREFIX + "layer_start", start)
        writer.add_uint32(META_PREFIX + "layer_end", end)
        writer.add_uint32(META_PREFIX + "n_layers_total", model.n_layers)
        writer.add_string(META_PREFIX + "artifact_id", artifact_id)
        writer.add_array(META_PREFIX + "placeholder_tensors", [n for n, _, p in tensors if p] or [""])
        for name, t, _ in tensors:
            data = t.reader_tensor.data
            writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, t.ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _name, t, is_placeholder in tensors:
            data = t.reader_tensor.data
            writer.write_tensor_data(np.zeros_like(data) if is_placeholder else data)
        writer.close()
    return out_path


def cached_slice(model_path: Path, start: int, end: int, cache_dir: Path, model: GGUFModel | None = None) -> Path:
    """The slice [start, end) of the whole model at ``model_path``, cut once into ``cache_dir``
    (keyed by the model file's path, size and modification time); ``model``: the file already
    parsed, if the caller has it."""
    model_path = Path(model_path)
    st = model_path.stat()
    key = hashlib.sha256(f"{model_path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = Path(cache_dir) / f"{model_path.stem}.{format_layers(start, end)}.{key}.gguf"
    if not out.is_file():
        slice_gguf(model or model_path, start, end, out)
    return out


def slice_info(path: Path | GGUFModel) -> dict | None:
    """The range a slice was cut from, or None for a whole model."""
    model = path if isinstance(path, GGUFModel) else GGUFModel(path)
    start = model.field(META_PREFIX + "layer_start")
    if start is None:
        return None
    return {
        "layer_start": int(start),
        "layer_end": int(model.field(META_PREFIX + "layer_end")),
        "n_layers_total": int(model.field(META_PREFIX + "n_layers_total")),
        "artifact_id": model.field(META_PREFIX + "artifact_id") or "",
        "range": format_layers(int(start), int(model.field(META_PREFIX + "layer_end"))),
    }
