"""Where a model may be cut: each layer's kind, and the layer ranges llama.cpp cannot load alone.

Known before anything loads, from the GGUF's metadata (or a manifest's cache descriptor, or a
capability report: all carry the same per-layer kinds), so the splitter, `up`, the tracker's
hints and the worker's own start-up check all refuse a range that would abort llama.cpp.

Kinds: ``attention`` (full attention: GQA/MHA KV grows with the context) and ``swa``
(sliding-window attention: the KV keeps a window).

Rules, with the llama.cpp behaviour behind each (llama-cpp-python 0.3.36):
- sliding-window models: when a model declares a sliding window, llama.cpp creates an iSWA cache
  and asserts ``GGML_ASSERT(hparams.is_swa_any())`` in ``llama_model::create_memory``: a slice
  holding only full-attention layers aborts the process. Gemma 3 (5 sliding layers, then one
  global) cannot be cut to a range of global layers only, e.g. its last layer alone.
- where llama.cpp derives which layers slide from the layer index (``SWA_PERIOD``), a slice
  renumbers its layers and must state the original pattern (slicing.py writes it).
"""

from __future__ import annotations

from collections.abc import Sequence

from neuron_bus.artifacts.gguf_model import ArtifactError, GGUFModel, format_layers

ATTENTION, SWA = "attention", "swa"

# Architectures whose sliding-window layers llama.cpp derives from the layer index (period p:
# layer i slides iff i % p < p - 1), unless the GGUF states the per-layer pattern itself.
SWA_PERIOD = {"gemma3": 6}


def swa_pattern(arch: str, n_layers: int, start: int = 0) -> list[bool] | None:
    """The implicit sliding-window pattern of layers [start, n_layers), or None if ``arch`` has none."""
    period = SWA_PERIOD.get(arch)
    if period is None:
        return None
    return [i % period < period - 1 for i in range(start, n_layers)]


def layer_kinds(model: GGUFModel) -> list[str]:
    """The kind of every layer of ``model`` (a whole model: a slice's own layers are renumbered)."""
    n, arch = model.n_layers, model.arch
    if not model.field(f"{arch}.attention.sliding_window"):
        return [ATTENTION] * n
    stated = model.field(f"{arch}.attention.sliding_window_pattern")
    pattern: list[bool] | None
    if isinstance(stated, list) and len(stated) == n:
        pattern = [bool(x) for x in stated]
    elif isinstance(stated, int) and stated > 0:  # some converters store the period
        pattern = [i % stated < stated - 1 for i in range(n)]
    else:
        pattern = swa_pattern(arch, n)
    if pattern is None:  # a window without a known pattern: llama.cpp treats every layer alike
        return [ATTENTION] * n
    return [SWA if s else ATTENTION for s in pattern]


def cut_problem(kinds: Sequence[str], start: int, end: int) -> str | None:
    """Why layers [start, end) cannot be loaded as a slice, or None when they can.

    ``kinds`` are the whole model's layer kinds; empty means unknown (nothing is refused).
    """
    if not kinds:
        return None
    if not 0 <= start < end <= len(kinds):
        return f"layers {format_layers(start, end)} are outside the model (layers 0-{len(kinds) - 1})"
    if SWA in kinds and SWA not in kinds[start:end]:
        return (
            f"layers {format_layers(start, end)} hold only full-attention layers of a sliding-window model; "
            "llama.cpp cannot create such a slice's cache (GGML_ASSERT(hparams.is_swa_any()))"
        )
    return None


def loadable(kinds: Sequence[str], start: int, end: int) -> bool:
    return cut_problem(kinds, start, end) is None


def check_cut(kinds: Sequence[str], start: int, end: int) -> None:
    """Raise ArtifactError("uncuttable") when layers [start, end) cannot be loaded as a slice."""
    problem = cut_problem(kinds, start, end)
    if problem:
        raise ArtifactError("uncuttable", problem)
