"""Where a model may be cut: each layer's kind, what a slice must restate, and the layer ranges
llama.cpp cannot load or run alone.

Known before anything loads, from the GGUF's tensors and metadata (or a manifest's cache
descriptor, or a capability report: all carry the same per-layer kinds), so the splitter, `up`,
the tracker's hints and the worker's own start-up check all refuse a range that would abort
llama.cpp or compute something else than the whole model.

Kinds: the layer's mixer, and ``+moe`` when its feed-forward is a mixture of experts.
- ``attention``: full attention, GQA/MHA K and V grow with the context
- ``swa``: sliding-window attention, the cache keeps a window
- ``mla``: DeepSeek's latent attention, one compressed latent per position grows with the context
- ``dsa`` / ``dsa-shared``: latent attention with DeepSeek sparse attention's lightning indexer
  (its keys are cached too); a shared layer reuses the top-k of the full layer before it
- ``recurrent``: a state-space or linear-attention mixer, a fixed state per session
- ``hc``: DeepSeek-V4's hyper-connected block (its residual stream is hc_mult × hidden wide)
- ``ffn``: a block with no mixer (Nemotron-H's MLP blocks)
- ``mtp``: a multi-token-prediction block after the main stack; llama.cpp loads but never runs it

Rules, with the llama.cpp behaviour behind each (llama-cpp-python 0.3.36), in `cut_problem`.
What llama.cpp derives from a layer's index or from counts, a slice (which renumbers its layers)
must restate: `slice_metadata`.
"""

from __future__ import annotations

from collections.abc import Sequence

from neuron_bus.artifacts.gguf_model import ArtifactError, GGUFModel, format_layers
from workers.errors import Reason

ATTENTION, SWA, MLA, DSA, DSA_SHARED = "attention", "swa", "mla", "dsa", "dsa-shared"
RECURRENT, HC, FFN, MTP = "recurrent", "hc", "ffn", "mtp"
MOE_SUFFIX = "+moe"
KV_MIXERS = (ATTENTION, SWA, MLA, DSA, DSA_SHARED)  # mixers whose cache grows with the context

# Architectures whose sliding-window layers llama.cpp derives from the layer index (period p:
# layer i slides iff i % p < p - 1), unless the GGUF states the per-layer pattern itself.
SWA_PERIOD = {"gemma3": 6, "gpt-oss": 2}

# Architectures whose linear-attention layers llama.cpp derives from the layer index (layer i is
# recurrent iff (i + 1) % <arch>.full_attention_interval != 0) unless the GGUF states
# <arch>.attention.recurrent_layers, which a slice therefore states.
RECURRENT_INTERVAL = ("qwen35", "qwen35moe", "qwen3next")

# Architectures whose graphs abort on hidden-state input (batch.embd) unless the model uses
# M-RoPE ("This GGUF does not support multimodal", src/models/glm4-moe.cpp). A slice that takes
# hidden states states M-RoPE sections: with text positions (every section the same position)
# M-RoPE rotates exactly like the model's own RoPE (bit-identical, tests/test_architectures.py).
EMBD_NEEDS_ROPE_SECTIONS = ("glm4", "glm4moe")

# tensor name (after "blk.N.") -> the mixer it marks; the first match wins
_MIXER_TENSORS = (
    ("hc_attn_fn.weight", HC),
    ("ssm_conv1d.weight", RECURRENT),
    ("ssm_in.weight", RECURRENT),
    ("shortconv.conv.weight", RECURRENT),
    ("indexer.attn_k.weight", DSA),
    ("attn_kv_a_mqa.weight", MLA),
    ("attn_q.weight", ATTENTION),
    ("attn_qkv.weight", ATTENTION),
    ("attn_q_a.weight", ATTENTION),
)


def mixer(kind: str) -> str:
    return kind.removesuffix(MOE_SUFFIX)


def is_moe(kind: str) -> bool:
    return kind.endswith(MOE_SUFFIX)


def swa_pattern(arch: str, n_layers: int, start: int = 0) -> list[bool] | None:
    """The implicit sliding-window pattern of layers [start, n_layers), or None if ``arch`` has none."""
    period = SWA_PERIOD.get(arch)
    if period is None:
        return None
    return [i % period < period - 1 for i in range(start, n_layers)]


def n_mtp_layers(model: GGUFModel) -> int:
    return int(model.field(f"{model.arch}.nextn_predict_layers", 0) or 0)


def _sliding(model: GGUFModel) -> list[bool]:
    n, arch = model.n_layers, model.arch
    if not model.field(f"{arch}.attention.sliding_window"):
        return [False] * n
    stated = model.field(f"{arch}.attention.sliding_window_pattern")
    if isinstance(stated, list) and len(stated) == n:
        return [bool(x) for x in stated]
    if isinstance(stated, int) and stated > 0:  # some converters store the period
        return [i % stated < stated - 1 for i in range(n)]
    # a window without a known pattern: llama.cpp treats every layer alike
    return swa_pattern(arch, n) or [False] * n


def _shared_indexer(model: GGUFModel) -> list[bool]:
    """Layers whose DSA indexer reuses the previous full layer's top-k (<arch>.attention.indexer.types)."""
    types = model.field(f"{model.arch}.attention.indexer.types")
    if not isinstance(types, list):
        return [False] * model.n_layers
    return [not bool(t) for t in types] + [False] * (model.n_layers - len(types))


def layer_kinds(model: GGUFModel) -> list[str]:
    """The kind of every layer of ``model`` (a whole model: a slice's own layers are renumbered)."""
    n = model.n_layers
    suffixes: list[set[str]] = [set() for _ in range(n)]
    for t in model.tensors:
        if t.layer is not None and t.layer < n:
            suffixes[t.layer].add(t.name.split(".", 2)[2])
    first_mtp = n - n_mtp_layers(model)
    sliding, shared = _sliding(model), _shared_indexer(model)
    kinds = []
    for i, names in enumerate(suffixes):
        if i >= first_mtp:
            kinds.append(MTP)
            continue
        kind = next((k for name, k in _MIXER_TENSORS if name in names), FFN)
        if kind == ATTENTION and sliding[i]:
            kind = SWA
        if kind in (MLA, DSA) and shared[i]:
            kind = DSA_SHARED
        if "ffn_gate_inp.weight" in names:
            kind += MOE_SUFFIX
        kinds.append(kind)
    return kinds


def cut_problem(kinds: Sequence[str], start: int, end: int) -> str | None:
    """Why layers [start, end) cannot be loaded or run as a slice, or None when they can.

    ``kinds`` are the whole model's layer kinds; empty means unknown (nothing is refused).
    """
    if not kinds:
        return None
    n, where = len(kinds), format_layers(start, end)
    if not 0 <= start < end <= n:
        return f"layers {where} are outside the model (layers 0-{n - 1})"
    if (start, end) == (0, n):
        return None
    mixers = [mixer(k) for k in kinds]
    own = mixers[start:end]
    if HC in mixers:
        return (
            "DeepSeek-V4's residual stream is hc_mult x hidden wide (hyper-connections) and its first layers "
            "route experts by token id: llama.cpp takes hidden-size states and no token ids at a slice's input, "
            "so it runs only as a whole model"
        )
    if MTP in own and (end != n or all(m == MTP for m in own)):
        return (
            f"layers {where} cut into the multi-token-prediction blocks: llama.cpp loads them with the tail "
            "(nextn_predict_layers must stay below a slice's block count) and never runs them"
        )
    if SWA in mixers and SWA not in own:
        return (
            f"layers {where} hold only full-attention layers of a sliding-window model; "
            "llama.cpp cannot create such a slice's cache (GGML_ASSERT(hparams.is_swa_any()))"
        )
    if own[0] == DSA_SHARED:
        return (
            f"layer {start} reuses the lightning indexer's top-k of the layer before it: a slice must start at "
            "a full indexer layer (GGML_ASSERT: shared indexer layer must follow a previous full indexer layer)"
        )
    if RECURRENT in mixers and any(m in KV_MIXERS for m in mixers):
        main = [m for m in own if m != MTP]
        if RECURRENT not in main or not any(m in KV_MIXERS for m in main):
            return (
                f"layers {where} of a hybrid model must hold both a recurrent and an attention layer: "
                "llama.cpp gives a hybrid slice both caches and the one without layers has no buffer "
                "(GGML_ASSERT(buffer) in llm_graph_input_mem_hybrid::set_input)"
            )
    return None


def loadable(kinds: Sequence[str], start: int, end: int) -> bool:
    return cut_problem(kinds, start, end) is None


def check_cut(kinds: Sequence[str], start: int, end: int) -> None:
    """Raise ArtifactError(Reason.UNCUTTABLE) when layers [start, end) cannot be loaded as a slice."""
    problem = cut_problem(kinds, start, end)
    if problem:
        raise ArtifactError(Reason.UNCUTTABLE, problem)


# -- what a slice restates -------------------------------------------------------------------------


def slice_metadata(model: GGUFModel, start: int, end: int) -> dict[str, object]:
    """Metadata of the slice [start, end) that differs from the whole model's, by key.

    Per-layer arrays (of the model's block count, or of its main stack without MTP blocks) are cut
    to the range. Counts llama.cpp reads as "the first k layers" or "the last k layers" are
    restated for the renumbered layers, and patterns it derives from the layer index are written
    out as the slice's own arrays (which llama.cpp reads instead).
    """
    arch, n = model.arch, model.n_layers
    n_main = n - n_mtp_layers(model)
    out: dict[str, object] = {f"{arch}.block_count": end - start}
    for name, field in model.meta.fields.items():
        if not name.startswith(f"{arch}."):
            continue
        value = field.contents()
        if isinstance(value, list) and value and not isinstance(value[0], str):
            if len(value) == n:
                out[name] = value[start:end]
            elif len(value) == n_main and n_main < n:  # an array of the main stack's layers
                out[name] = value[start : min(end, n_main)] or value[:0]
    lead = model.field(f"{arch}.leading_dense_block_count")
    if lead is not None:  # dense layers are the first `lead` ones: the slice's share of them
        out[f"{arch}.leading_dense_block_count"] = max(0, min(int(lead) - start, end - start))
    if n_main < n:  # MTP blocks are the last ones: the slice's share of them
        out[f"{arch}.nextn_predict_layers"] = max(0, end - max(start, n_main))
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    implicit = swa_pattern(arch, end, start)
    if implicit and model.field(f"{arch}.attention.sliding_window") and model.field(pattern_key) is None:
        out[pattern_key] = implicit
    recurrent_key = f"{arch}.attention.recurrent_layers"
    if arch in RECURRENT_INTERVAL and model.field(recurrent_key) is None:
        interval = int(model.field(f"{arch}.full_attention_interval", 4))
        out[recurrent_key] = [(i + 1) % interval != 0 and i < n_main for i in range(start, end)]
    sections_key = f"{arch}.rope.dimension_sections"
    if arch in EMBD_NEEDS_ROPE_SECTIONS and start > 0 and model.field(sections_key) is None:
        pairs = int(model.field(f"{arch}.rope.dimension_count", 0) or 0) // 2
        if pairs >= 2:
            out[sections_key] = [pairs - pairs // 2, pairs // 2, 0, 0]
    return out
