"""The seed's target architectures on stock llama-cpp-python, proven on synthetic models
(neuron_bus/artifacts/synthetic.py): the matrix's JSON, logits of every split it calls bit-exact,
the range rules (a refused range really fails, its neighbour loads), what slices restate, snapshots
of hybrid models, MoE-aware work, and bad input."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import tempfile

import numpy as np
import pytest

from neuron_bus.artifacts import slicing
from neuron_bus.artifacts.cuts import cut_problem, layer_kinds
from neuron_bus.artifacts.gguf_model import META_PREFIX, ArtifactError, GGUFModel
from neuron_bus.artifacts.synthetic import ARCHITECTURES, variant, write_model
from neuron_bus.artifacts.work import layer_work, owned_layer_work
from neuron_bus.execution import open_range, open_reference
from neuron_bus.local_swarm import cli
from neuron_bus.repair import rollback_problem
from neuron_bus.split import model_split
from tests.test_split import load_ranges
from workers.errors import UnsupportedModel

# The architectures the seed names (issue 19): each must have a row.
REQUIRED = (
    "llama",
    "qwen3",
    "qwen3moe",
    "gemma3",
    "deepseek2",
    "deepseek4",
    "glm4moe",
    "glm-dsa",
    "qwen35",
    "gpt-oss",
    "nemotron_h",
)
HYBRIDS = ("qwen35", "nemotron_h")
N_CTX = 256
OPTS = dict(n_ctx=N_CTX, max_sessions=2, threads=1, benchmark=False)
TEXT = "the quick brown fox jumps over the lazy dog and runs to the river before the sun sets"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Every synthetic architecture, written once."""
    d = tmp_path_factory.mktemp("archs")
    return {arch: write_model(d / f"{arch}.gguf", arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="module")
def matrix():
    """`neuron-bus audit architectures --json`: one row per architecture."""
    done = subprocess.run(cli() + ["audit", "architectures", "--json"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return {row["arch"]: row for row in json.loads(done.stdout)}


def greedy(hops, prompt: np.ndarray, n_decode: int, sid: str = "s") -> list[np.ndarray]:
    """Logits after the prompt and after each greedy token, through ``hops`` in order."""

    def run(pos, x):
        for h in hops:
            x = h.prefill(sid, pos, x) if x.shape[0] > 1 else h.decode_step(sid, pos, x)
        return x

    for h in hops:
        h.open_session(sid, N_CTX)
    out = [run(0, prompt)]
    for k in range(n_decode):
        out.append(run(len(prompt) + k, np.array([int(out[-1].argmax())], dtype=np.int32)))
    return out


def prompt_of(path, n: int = 40) -> np.ndarray:
    full = open_reference(path, **OPTS)
    ids = full.tokenize(TEXT)
    full.close()
    assert len(ids) >= n
    return np.array(ids[:n], dtype=np.int32)


# -- the matrix ------------------------------------------------------------------------------------


def test_the_matrix_has_a_row_for_every_target_architecture(matrix):
    assert set(REQUIRED) <= set(matrix)
    for arch, row in matrix.items():
        assert row["loads"] and row["full_inference"], (arch, row["detail"])
        assert row["cache_abi"].startswith("llama.cpp-0.3.36-fa1-f16kv") and row["cache_bytes_per_token"] > 0
        assert row["split"] in ("bit-exact", "unsupported"), (arch, row["split"], row["split_detail"])
        assert row["snapshot"] in ("restores", "restores, no truncation"), (arch, row["snapshot_detail"])
    # DeepSeek-V4 runs whole only, and the row says why
    assert matrix["deepseek4"]["split"] == "unsupported" and "hyper-connections" in matrix["deepseek4"]["split_detail"]
    assert all(matrix[a]["split"] == "bit-exact" for a in REQUIRED if a != "deepseek4")
    # recurrent state does not grow with the context, and cannot be truncated
    for arch in HYBRIDS:
        row = matrix[arch]
        assert row["snapshot"] == "restores, no truncation" and row["cache_fixed_bytes"] > 10_000, row
    assert matrix["llama"]["cache_fixed_bytes"] < 1024 and matrix["llama"]["snapshot"] == "restores"
    # MLA's latent is smaller per layer than GQA's K and V: 4 latent layers cost less than 4 GQA layers
    assert matrix["deepseek2"]["cache_bytes_per_token"] < matrix["llama"]["cache_bytes_per_token"]
    # an MoE model multiplies fewer weights than it stores; a dense one all of them
    for arch in ("qwen3moe", "deepseek2", "glm4moe", "gpt-oss"):
        assert matrix[arch]["active_parameters"] < matrix[arch]["total_parameters"]
    assert matrix["llama"]["active_parameters"] == matrix["llama"]["total_parameters"]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_bit_exact_row_is_proven_by_logits(arch, models, matrix, tmp_path):
    """The whole model and its work-balanced 2- and 3-way splits (other ranges than the matrix's
    even ones), over a 40-token prompt and 32 greedy steps: logits equal bit for bit."""
    path, model = models[arch], GGUFModel(models[arch])
    try:
        splits = [model_split(model, k) for k in (2, 3)]
    except ValueError as exc:
        assert matrix[arch]["split"] == "unsupported", exc
        return
    prompt = prompt_of(path)
    full = open_reference(path, **OPTS)
    expected = greedy([full], prompt, 32)
    full.close()
    for ranges in splits:
        hops = [open_range("llama-cpp", path, a, b, cache_dir=tmp_path, **OPTS) for a, b in ranges]
        got = greedy(hops, prompt, 32)
        for h in hops:
            h.close()
        same = all(np.array_equal(a, b) for a, b in zip(got, expected))
        assert same == (matrix[arch]["split"] == "bit-exact"), (arch, ranges)
        assert same, (arch, ranges, max(float(np.abs(a - b).max()) for a, b in zip(got, expected)))


# -- range rules: a refused range really fails, its neighbour loads ---------------------------------

# (architecture, refused range, the neighbour that loads, words of the reason)
RULES = [
    ("gpt-oss", (1, 2), (1, 3), "full-attention"),  # a global layer alone: is_swa_any
    ("glm4moe", (4, 5), (3, 5), "multi-token-prediction"),  # the MTP block without a main layer
    ("glm-dsa", (2, 5), (1, 5), "lightning indexer"),  # a slice starting at a shared indexer layer
    ("qwen35", (0, 3), (0, 4), "hybrid"),  # recurrent layers only
    ("qwen35", (3, 4), (2, 4), "hybrid"),  # an attention layer only
    ("nemotron_h", (7, 9), (6, 9), "hybrid"),  # attention and MLP blocks, no recurrent one
]


@pytest.mark.parametrize("arch,refused,neighbour,words", RULES)
def test_a_refused_range_really_fails_and_its_neighbour_loads(arch, refused, neighbour, words, models, tmp_path):
    kinds = layer_kinds(GGUFModel(models[arch]))
    assert words in (cut_problem(kinds, *refused) or ""), cut_problem(kinds, *refused)
    assert cut_problem(kinds, *neighbour) is None
    with pytest.raises(ArtifactError, match=words):
        slicing.slice_gguf(models[arch], *refused, tmp_path / "refused.gguf")
    # cut it anyway: llama.cpp aborts on it (or on its first decode)
    original = slicing.check_cut
    slicing.check_cut = lambda *a: None
    try:
        slicing.slice_gguf(models[arch], *refused, tmp_path / "refused.gguf")
    finally:
        slicing.check_cut = original
    aborted = load_ranges(tmp_path / "refused.gguf", [refused])
    assert aborted.returncode in (-signal.SIGABRT, 1), aborted.stderr[-1000:]
    assert "loaded" not in aborted.stdout
    slicing.slice_gguf(models[arch], *neighbour, tmp_path / "neighbour.gguf")
    done = load_ranges(tmp_path / "neighbour.gguf", [neighbour])
    assert done.returncode == 0, done.stderr[-1000:]


def test_deepseek4_is_refused_everywhere_but_whole():
    kinds = ["hc+moe"] * 3
    assert cut_problem(kinds, 0, 3) is None
    assert all("hyper-connections" in cut_problem(kinds, a, b) for a, b in [(0, 1), (1, 3), (0, 2)])


def test_kinds_name_each_family(models):
    kinds = {arch: layer_kinds(GGUFModel(path)) for arch, path in models.items()}
    assert kinds["deepseek2"] == ["mla", "mla+moe", "mla+moe", "mla+moe"]
    assert kinds["glm-dsa"] == ["dsa", "dsa+moe", "dsa-shared+moe", "dsa+moe", "mtp"]
    assert kinds["glm4moe"][-1] == "mtp" and kinds["glm4moe"][0] == "attention"
    assert kinds["gemma3"] == ["swa"] * 5 + ["attention", "swa", "swa"]
    assert kinds["gpt-oss"] == ["swa+moe", "attention+moe"] * 3
    assert kinds["qwen35"] == (["recurrent"] * 3 + ["attention"]) * 3
    assert kinds["nemotron_h"] == ["recurrent", "attention", "ffn"] * 3
    assert kinds["deepseek4"] == ["hc+moe"] * 3


# -- what a slice restates -------------------------------------------------------------------------


def _slice(models, arch, a, b, tmp_path) -> GGUFModel:
    return GGUFModel(slicing.slice_gguf(models[arch], a, b, tmp_path / f"{arch}.{a}-{b}.gguf"))


def test_slices_restate_what_llama_cpp_derives_from_layer_indices_and_counts(models, tmp_path):
    # DeepSeek: the first layer is dense; a slice from layer 1 has no dense layer, one from 0 keeps it
    assert _slice(models, "deepseek2", 1, 4, tmp_path).field("deepseek2.leading_dense_block_count") == 0
    assert _slice(models, "deepseek2", 0, 2, tmp_path).field("deepseek2.leading_dense_block_count") == 1
    # GLM-4.5: the MTP block goes with the tail; hidden-state slices state M-RoPE sections
    tail, head = _slice(models, "glm4moe", 3, 5, tmp_path), _slice(models, "glm4moe", 0, 3, tmp_path)
    assert tail.field("glm4moe.nextn_predict_layers") == 1 and head.field("glm4moe.nextn_predict_layers") == 0
    assert tail.field("glm4moe.rope.dimension_sections") == [2, 2, 0, 0]
    assert head.field("glm4moe.rope.dimension_sections") is None  # the head takes tokens
    # GLM-5 DSA: the indexer types of the main stack are cut to the slice
    assert _slice(models, "glm-dsa", 1, 5, tmp_path).field("glm-dsa.attention.indexer.types") == [1, 0, 1]
    # Qwen3.5: linear-attention layers follow the layer index; a slice states its own
    s = _slice(models, "qwen35", 2, 8, tmp_path)
    assert s.field("qwen35.attention.recurrent_layers") == [True, False, True, True, True, False]
    # gpt-oss: even layers slide; a slice from layer 1 states its pattern
    assert _slice(models, "gpt-oss", 1, 4, tmp_path).field("gpt-oss.attention.sliding_window_pattern") == [
        False,
        True,
        False,
    ]
    # Nemotron-H: per-layer head and feed-forward arrays are cut
    nh = _slice(models, "nemotron_h", 3, 9, tmp_path)
    assert nh.field("nemotron_h.attention.head_count_kv") == [0, 2, 0, 0, 2, 0]
    assert nh.field("nemotron_h.feed_forward_length") == [0, 0, 128, 0, 0, 128]
    # an untied model keeps `output` in every slice: zeros before the tail (gpt-oss requires it)
    assert "output.weight" in _slice(models, "gpt-oss", 0, 3, tmp_path).by_name
    assert "output.weight" in (
        _slice(models, "gpt-oss", 0, 3, tmp_path).field(META_PREFIX + "placeholder_tensors") or []
    )


# -- snapshots of hybrid models --------------------------------------------------------------------


@pytest.mark.parametrize("arch", HYBRIDS)
def test_a_hybrid_snapshot_restores_recurrent_state_in_fresh_backends(arch, models, tmp_path):
    path = models[arch]
    ranges = model_split(GGUFModel(path), 2)
    prompt = prompt_of(path, 24)
    hops = [open_range("llama-cpp", path, a, b, cache_dir=tmp_path, **OPTS) for a, b in ranges]
    expected = greedy(hops, prompt, 12)
    tokens = [int(x.argmax()) for x in expected]
    # the same session again, exported after 6 decode steps
    for h in hops:
        h.close_session("s")
    run_to = len(prompt) + 6
    greedy_run = greedy(hops, prompt, 6)
    assert all(np.array_equal(a, b) for a, b in zip(greedy_run, expected[:7]))
    blobs = [h.export_state("s") for h in hops]
    assert all(h.capability.cache_fixed_bytes > 10_000 and not h.capability.supports_truncate for h in hops)
    with pytest.raises(UnsupportedModel, match="recurrent state"):
        hops[0].truncate("s", len(prompt))
    assert hops[0].session_position("s") == run_to  # the refused truncation changed nothing
    fresh = [open_range("llama-cpp", path, a, b, cache_dir=tmp_path, **OPTS) for a, b in ranges]
    for h, blob in zip(fresh, blobs):
        h.import_state("moved", N_CTX, run_to, blob)
    for k in range(6, 12):
        x = np.array([tokens[k]], dtype=np.int32)
        for h in fresh:
            x = h.decode_step("moved", len(prompt) + k, x)
        assert np.array_equal(x, expected[k + 1]), f"restored state diverges at decode step {k}"
    for h in hops + fresh:
        h.close()


def test_repair_refuses_a_route_whose_survivors_cannot_truncate():
    from neuron_bus import messages as M
    from tests.test_planner import report as capability

    def report(node, start, end, truncates):
        return capability(node, start, end, n=12, model="qwen35", model_arch="qwen35", supports_truncate=truncates)

    hops = [
        M.RouteHop(node_id=n, layer_start=a, layer_end=b, subject="s", backend_id="llama-cpp", cache_abi="abi")
        for n, a, b in (("w0", 0, 6), ("w1", 6, 12))
    ]
    route = M.RouteAssignment(route_id="r", model_preset="qwen35", model_revision="r", n_layers_total=12, hops=hops)
    reports = {"w0": report("w0", 0, 6, False), "w1": report("w1", 6, 12, False)}
    problem = rollback_problem(reports, route, dead_index=1)
    assert problem and "w0" in problem and "recurrent state" in problem
    assert rollback_problem({"w0": report("w0", 0, 6, True)}, route, dead_index=1) is None
    assert rollback_problem({}, route, dead_index=1) is None  # nothing known: as before


# -- MoE-aware work --------------------------------------------------------------------------------


def test_an_moe_layer_is_credited_its_active_experts_not_its_parameters(models):
    """DeepSeek-2 layer 1 by hand: attention in full, router and shared expert in full, and 2 of
    the 4 routed experts (hidden 64, expert width 32)."""
    model = GGUFModel(models["deepseek2"])
    h, q, kv, nope, rope, vh, heads, width, n_exp, used = 64, 32, 32, 16, 8, 16, 4, 32, 4, 2
    attention = (
        h  # attn_norm
        + q * h  # attn_q_a
        + q  # attn_q_a_norm
        + heads * (nope + rope) * q  # attn_q_b
        + (kv + rope) * h  # attn_kv_a_mqa
        + kv  # attn_kv_a_norm
        + heads * kv * nope  # attn_k_b
        + heads * vh * kv  # attn_v_b
        + h * heads * vh  # attn_output
    )
    ffn = h + n_exp * h + n_exp + 3 * h * width  # ffn_norm, router, exp_probs_b, shared expert
    routed = 3 * n_exp * h * width  # gate, up, down of every expert
    active = attention + ffn + routed * used // n_exp
    assert owned_layer_work(model, 1, 2) == pytest.approx(active / 1e6)
    stored = sum(math.prod(t.shape) for t in model.layer_tensors(1, 2))
    assert stored == attention + ffn + routed and active < stored
    # the dense leading layer counts in full
    assert owned_layer_work(model, 0, 1) == pytest.approx(
        sum(math.prod(t.shape) for t in model.layer_tensors(0, 1)) / 1e6
    )


def test_mtp_blocks_cost_nothing_and_slices_count_their_own_layers(models, tmp_path):
    model = GGUFModel(models["glm4moe"])
    work = layer_work(model)
    head = math.prod(model.by_name["output.weight"].shape) / 1e6
    assert work[-1] == pytest.approx(head)  # the MTP block: only the tail's output head
    tail = slicing.slice_gguf(model, 3, 5, tmp_path / "tail.gguf")
    assert owned_layer_work(tail, 3, 5, 5) == pytest.approx(owned_layer_work(model, 3, 5))
    assert owned_layer_work(tail, 3, 4, 5) == pytest.approx(owned_layer_work(model, 3, 4))


def test_the_ledger_entry_of_an_moe_worker_is_its_active_work(models):
    """The worker CLI's report carries active parameters per layer, and the ledger unit is their sum."""
    from neuron_bus.cli.worker import build_report
    from neuron_bus.trust.ledger import inference_weight

    model = GGUFModel(models["qwen3moe"])
    backend = open_range("llama-cpp", models["qwen3moe"], 0, 4, **OPTS)
    per_layer = [owned_layer_work(model, i, i + 1) for i in range(4)]
    report = build_report("n", backend, "qwen3moe", "r", "", "untrusted", active_parameters=per_layer)
    backend.close()
    assert report.active_parameters_per_layer == [round(w, 6) for w in per_layer]
    assert sum(per_layer) == pytest.approx(owned_layer_work(model, 0, 4))
    stored = sum(math.prod(t.shape) for t in model.layer_tensors(0, 4)) / 1e6
    assert sum(per_layer[:3]) < 0.75 * stored  # 2 of 4 experts
    assert inference_weight(sum(per_layer), 10, 5) == pytest.approx(15 * owned_layer_work(model, 0, 4))


# -- bad input -------------------------------------------------------------------------------------


def test_an_architecture_llama_cpp_does_not_know_is_named(tmp_path):
    path = write_model(tmp_path / "unknown.gguf", variant("llama", arch="no-such-arch"))
    assert GGUFModel(path).arch == "no-such-arch"  # a readable GGUF
    with pytest.raises(UnsupportedModel, match="unknown model architecture: 'no-such-arch'"):
        open_reference(path, **OPTS)


def test_a_missing_tensor_is_named(tmp_path):
    path = write_model(tmp_path / "holey.gguf", "qwen3", without=["blk.2.attn_k.weight"])
    with pytest.raises(UnsupportedModel, match="blk.2.attn_k.weight"):
        open_reference(path, **OPTS)
    with tempfile.TemporaryDirectory() as cache:  # a slice holding the hole fails the same way
        with pytest.raises(UnsupportedModel, match=r"blk.0.attn_k.weight.*slice of layers 2-3: blk.0 is layer 2"):
            open_range("llama-cpp", path, 2, 4, cache_dir=cache, **OPTS)


def test_an_expert_count_that_disagrees_with_the_tensors_is_refused_before_loading(tmp_path):
    path = write_model(tmp_path / "experts.gguf", "qwen3moe", metadata={"expert_count": 8})
    with pytest.raises(ArtifactError, match="expert_count is 8 but blk.0.ffn_gate_inp.weight holds 4 experts"):
        GGUFModel(path)
    with pytest.raises(ArtifactError, match="expert_count is 8"):
        open_range("llama-cpp", path, 0, 2, cache_dir=tmp_path, **OPTS)
    used = write_model(tmp_path / "used.gguf", "qwen3moe", metadata={"expert_used_count": 5})
    with pytest.raises(ArtifactError, match="expert_used_count 5 is not within 1..4"):
        GGUFModel(used)
