"""Open an execution backend by kind; each backend module is imported only when asked for."""

from __future__ import annotations

from pathlib import Path

from workers.errors import BadInput
from workers.protocol import Backend

KINDS = ("llama-cpp", "llama-cpp-full", "torch", "noop")


def open_backend(
    kind: str,
    model_path: str | Path,
    layer_start: int | None = None,
    layer_end: int | None = None,
    threads: int | None = 1,
    n_layers: int | None = None,
    **opts,
) -> Backend:
    """A backend of ``kind`` for layers [layer_start, layer_end) of a model of ``n_layers`` layers.

    llama-cpp: ``model_path`` holds exactly the range (a slice, or the whole model with no range);
    llama-cpp-full: the whole model, the range must be empty or complete;
    torch: the whole model's GGUF, layers read by index;
    noop: no model work, shapes read from the GGUF.
    ``opts`` go to the backend's constructor (n_ctx, max_sessions, flash_attn, dtype, ...);
    ``benchmark`` (run the short self-benchmark at construction) is understood by every kind.
    """
    if kind == "llama-cpp":
        from workers.llama_cpp_range import LlamaCppRangeBackend

        return LlamaCppRangeBackend(
            model_path, layer_start, layer_end, n_layers=n_layers, n_threads=threads or 1, **opts
        )
    if kind == "llama-cpp-full":
        from workers.llama_cpp_full import LlamaCppFullBackend

        backend = LlamaCppFullBackend(model_path, n_threads=threads or 1, **opts)
        if (layer_start, layer_end) not in ((None, None), (0, backend.n_layers)):
            backend.close()
            raise BadInput(f"llama-cpp-full runs all {backend.n_layers} layers, not [{layer_start}, {layer_end})")
        return backend
    if kind == "torch":
        from workers.torch_backend import TorchBackend

        if layer_start is None or layer_end is None:
            from workers.torch_model import ModelArgs, open_gguf

            total = ModelArgs.from_gguf(open_gguf(model_path)).n_layers
            layer_start = 0 if layer_start is None else layer_start
            layer_end = total if layer_end is None else layer_end
        if "benchmark" in opts:
            opts["selfbench"] = opts.pop("benchmark")
        return TorchBackend(model_path, layer_start, layer_end, threads=threads, **opts)
    if kind == "noop":  # the bus alone, for per-hop overhead benchmarks
        from workers.noop_backend import NoopBackend

        return NoopBackend.for_model(model_path, layer_start, layer_end)
    raise BadInput(f"unknown backend kind {kind!r}: use one of {', '.join(KINDS)}")
