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
    **opts,
) -> Backend:
    """A backend of ``kind`` for layers [layer_start, layer_end) of ``model_path``.

    llama-cpp: ``model_path`` is a whole model (sliced into a cache dir) or a slice GGUF;
    llama-cpp-full: the whole model, the range must be empty or complete;
    torch: layers loaded straight from the GGUF.
    ``opts`` go to the backend's constructor (n_ctx, max_sessions, flash_attn, dtype, ...);
    ``benchmark`` (run the short self-benchmark at construction) is understood by every kind.
    """
    if kind == "llama-cpp":
        from workers.llama_cpp_range import LlamaCppRangeBackend

        return LlamaCppRangeBackend(model_path, layer_start, layer_end, n_threads=threads or 1, **opts)
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

            n_layers = ModelArgs.from_gguf(open_gguf(model_path)).n_layers
            layer_start = 0 if layer_start is None else layer_start
            layer_end = n_layers if layer_end is None else layer_end
        if "benchmark" in opts:
            opts["selfbench"] = opts.pop("benchmark")
        return TorchBackend(model_path, layer_start, layer_end, threads=threads, **opts)
    if kind == "noop":  # the bus alone, for per-hop overhead benchmarks
        from neuron_bus.artifacts.gguf_model import GGUFModel
        from workers.noop_backend import NoopBackend

        m = GGUFModel(model_path)
        return NoopBackend(
            layer_start=layer_start or 0,
            layer_end=m.n_layers if layer_end is None else layer_end,
            n_layers=m.n_layers,
            hidden_size=int(m.field(f"{m.arch}.embedding_length")),
            vocab_size=len(m.field("tokenizer.ggml.tokens")),
        )
    raise BadInput(f"unknown backend kind {kind!r}: use one of {', '.join(KINDS)}")
