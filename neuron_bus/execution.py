"""The one door from the bus to the execution backends in workers/.

workers/ owns the interface (workers/protocol.py: `Backend`, `Capability`, `DEFAULT_N_CTX`;
workers/errors.py: the backends' failures) and imports nothing from neuron_bus; the bus opens
backends only through the functions here (the wire contract, messages.py, imports `Capability`). They resolve what a backend needs from the bus's artifacts first:
a whole-model path and a layer range become a slice cut once into the cache (llama.cpp loads
exactly the layers it runs), a slice file states its own range, a reference must be a whole model.
The backend modules, and llama.cpp or torch with them, are imported only when one is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

from neuron_bus import models
from neuron_bus.artifacts.gguf_model import GGUFModel, format_layers
from neuron_bus.artifacts.slicing import cached_slice, slice_info
from workers.errors import BackendError, BadInput, UnsupportedModel
from workers.protocol import DEFAULT_N_CTX, Backend
from workers.registry import open_backend  # light: each backend module loads only when opened

if TYPE_CHECKING:
    from workers.llama_cpp_full import LlamaCppFullBackend

__all__ = ["DEFAULT_N_CTX", "Backend", "BackendError", "open_range", "open_reference", "open_tokenizer"]


def slice_cache_dir() -> Path:
    return models.cache_dir() / "slices"


def _parsed(source: str | Path | GGUFModel) -> tuple[GGUFModel, Path]:
    """The model and the path to load it from: ``source`` parsed now, or already parsed by the caller."""
    if isinstance(source, GGUFModel):
        return source, source.paths[0]
    return GGUFModel(Path(source)), Path(source)


def open_range(
    kind: str,
    source: str | Path | GGUFModel,
    layer_start: int | None = None,
    layer_end: int | None = None,
    *,
    threads: int = 1,
    cache_dir: str | Path | None = None,
    **opts,
) -> Backend:
    """A backend of ``kind`` serving layers [layer_start, layer_end) of the model ``source``: its
    path, or the model already parsed by the caller (parsing a large vocabulary takes seconds; the
    slice check, the layer count and the slicer share one parse).

    The model is a whole one (the range defaults to all of it) or a slice (its own range; asking
    for another is refused). llama.cpp backends get a slice of the range, cut once into
    ``cache_dir`` (default: the cache's ``slices/``).
    """

    model, path = _parsed(source)
    info = slice_info(model)
    if info is not None:
        start, end, n_layers = info["layer_start"], info["layer_end"], info["n_layers_total"]
        if (layer_start, layer_end) not in ((None, None), (start, end)):
            raise BadInput(
                f"{path} is the slice {info['range']}, not {format_layers(layer_start or 0, layer_end or 0)}"
            )
        return open_backend(kind, path, start, end, threads, n_layers=n_layers, **opts)
    n_layers = model.n_layers
    start = 0 if layer_start is None else layer_start
    end = n_layers if layer_end is None else layer_end
    if not 0 <= start < end <= n_layers:
        raise BadInput(f"layer range [{start}, {end}) is outside the model's {n_layers} layers")
    if kind == "llama-cpp" and (start, end) != (0, n_layers):
        path = cached_slice(path, start, end, Path(cache_dir) if cache_dir else slice_cache_dir(), model)
        try:
            return open_backend(kind, path, start, end, threads, n_layers=n_layers, **opts)
        except UnsupportedModel as exc:  # llama.cpp names the slice's own (renumbered) tensors
            raise UnsupportedModel(
                f"{exc} (in the slice of layers {format_layers(start, end)}: blk.0 is layer {start})"
            ) from None
    return open_backend(kind, path, start, end, threads, n_layers=n_layers, **opts)


def open_reference(source: str | Path | GGUFModel, *, threads: int = 1, **opts) -> LlamaCppFullBackend:
    """The whole model in one llama.cpp process: the reference that routes are compared with
    (``source``: its path, or the model already parsed by the caller)."""

    model, path = _parsed(source)
    if slice_info(model) is not None:
        raise UnsupportedModel(f"{path} is a layer-range slice, not a whole model")
    return cast("LlamaCppFullBackend", open_backend("llama-cpp-full", path, threads=threads, **opts))


def open_tokenizer(path: str | Path):
    """The model's tokenizer (a vocab-only llama.cpp load of a whole model or a slice)."""
    from workers.tokenizer import Tokenizer

    return Tokenizer(path)
