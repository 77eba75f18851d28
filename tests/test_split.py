"""Work-balanced layer splits (neuron_bus.split)."""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys

import pytest

from neuron_bus import models
from neuron_bus.artifacts import slicing
from neuron_bus.artifacts.cuts import check_cut, cut_problem, layer_kinds
from neuron_bus.artifacts.gguf_model import ArtifactError, GGUFModel
from neuron_bus.artifacts.slicing import slice_gguf
from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.split import balanced_split, layer_work, model_split


def brute_force_max(work: list[float], shards: int) -> float:
    n = len(work)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), shards - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(work[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_equal_work_gives_the_even_split():
    assert balanced_split([1.0] * 30, 2) == [(0, 15), (15, 30)]
    assert balanced_split([1.0] * 30, 3) == [(0, 10), (10, 20), (20, 30)]
    assert balanced_split([2.0] * 5, 5) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]


@pytest.mark.parametrize("work", [[1, 1, 1, 1, 1, 9], [5, 1, 1, 1, 1, 1, 1, 4], [3, 2, 7, 1, 1, 6, 2, 2, 8]])
@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_the_largest_shard_is_as_small_as_any_split_allows(work, shards):
    ranges = balanced_split([float(w) for w in work], shards)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(work)
    assert all(a < b for a, b in ranges) and all(r[1] == s[0] for r, s in zip(ranges, ranges[1:]))
    assert max(sum(work[a:b]) for a, b in ranges) == brute_force_max(work, shards)


def test_bad_shard_counts_are_refused():
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 shards"):
        balanced_split([1.0, 1.0, 1.0], 4)
    with pytest.raises(ValueError):
        balanced_split([1.0], 0)


def test_the_tail_of_a_real_model_gets_fewer_layers(smollm2_path, tmp_path):
    work = layer_work(GGUFModel(smollm2_path))
    assert len(work) == 30
    assert work[-1] > 8 * work[0]  # the last layer carries the 49152 x 576 output head
    ranges = balanced_split(work, 2)
    assert ranges == [(0, 19), (19, 30)]
    assert LocalSwarm(smollm2_path, 2, workdir=tmp_path).workers[1].layers == (19, 30)  # what `up` and the bench run


# ------------------------------------------------------------------ where a model may be cut


def test_gemma3_layer_kinds_follow_llama_cpps_period_of_six(gemma3_path):
    kinds = layer_kinds(GGUFModel(gemma3_path))
    assert len(kinds) == 18
    assert [i for i, k in enumerate(kinds) if k == "attention"] == [5, 11, 17]  # every 6th layer is global
    assert layer_kinds(GGUFModel(gemma3_path)).count("swa") == 15


def test_a_range_of_only_global_layers_is_refused_before_loading():
    kinds = ["swa"] * 5 + ["attention"]
    assert cut_problem(kinds, 5, 6) and "is_swa_any" in cut_problem(kinds, 5, 6)
    assert cut_problem(kinds, 4, 6) is None and cut_problem(kinds, 0, 5) is None  # sliding layers alone load
    assert cut_problem(["attention"] * 4, 3, 4) is None  # no sliding window: any range
    assert cut_problem([], 3, 4) is None  # kinds unknown: nothing refused
    with pytest.raises(ArtifactError, match="full-attention layers"):
        check_cut(kinds, 5, 6)


def test_the_splitter_never_offers_a_range_that_cannot_load(gemma3_path, smollm2_path):
    for path in (gemma3_path, smollm2_path):
        model = GGUFModel(path)
        kinds = layer_kinds(model)
        for shards in (2, 3, 4):
            ranges = model_split(model, shards)
            assert [r[0] for r in ranges[1:]] == [r[1] for r in ranges[:-1]] and ranges[-1][1] == model.n_layers
            assert all(cut_problem(kinds, a, b) is None for a, b in ranges), (path.name, shards, ranges)
    # the unconstrained balance would give Gemma's tail its global last layer alone
    assert balanced_split(layer_work(GGUFModel(gemma3_path)), 2)[-1] == (17, 18)
    assert model_split(GGUFModel(gemma3_path), 2) == [(0, 16), (16, 18)]


def test_a_split_with_no_loadable_ranges_is_refused_clearly():
    with pytest.raises(ValueError, match="can be loaded"):
        balanced_split([1.0] * 4, 4, allowed=lambda a, b: b - a > 1)


def test_local_swarm_refuses_hand_typed_ranges_that_cannot_load(gemma3_path, tmp_path):
    with pytest.raises(ArtifactError, match="full-attention"):
        LocalSwarm(gemma3_path, 2, workdir=tmp_path, ranges=[(0, 17), (17, 18)])


def test_slicing_refuses_a_range_llama_cpp_cannot_load(gemma3_path, tmp_path):
    with pytest.raises(ArtifactError, match="full-attention"):
        slice_gguf(gemma3_path, 11, 12, tmp_path / "global-only.gguf")
    assert not list(tmp_path.iterdir())


LOAD_RANGES = """
import sys, numpy as np
from neuron_bus.execution import open_range
for spec in sys.argv[2:]:
    a, b = map(int, spec.split(":"))
    be = open_range("llama-cpp", sys.argv[1], a, b, n_ctx=64, max_sessions=1, benchmark=False)
    be.open_session("s", 16)
    x = np.array([1, 2, 3], dtype=np.int32) if a == 0 else np.zeros((3, be.hidden_size), dtype=np.float32)
    be.prefill("s", 0, x)
    be.close()
    print("loaded", spec, flush=True)
"""


def load_ranges(path, ranges) -> subprocess.CompletedProcess:
    """Load each range of ``path`` with llama.cpp in a child process (an abort must not take pytest down)."""
    args = [f"{a}:{b}" for a, b in ranges]
    return subprocess.run(
        [sys.executable, "-c", LOAD_RANGES, str(path), *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["smollm2-135m", "gemma3-270m"])
def test_every_range_the_splitter_offers_loads_and_runs(preset):
    path = models.resolve(preset)
    model = GGUFModel(path)
    offered = sorted({r for shards in (2, 3, 4) for r in model_split(model, shards)})
    done = load_ranges(path, offered)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line.split()[1] for line in done.stdout.splitlines()] == [f"{a}:{b}" for a, b in offered]


@pytest.mark.slow
def test_the_refused_ranges_really_abort_llama_cpp_and_their_neighbours_load(gemma3_path, tmp_path, monkeypatch):
    """The rule is llama.cpp's: a global-only Gemma slice aborts the process, a slice of sliding layers alone loads."""
    monkeypatch.setattr(slicing, "check_cut", lambda *a: None)  # cut what the project refuses to cut
    slice_gguf(gemma3_path, 17, 18, tmp_path / "global.gguf")
    aborted = load_ranges(tmp_path / "global.gguf", [(17, 18)])
    assert aborted.returncode == -signal.SIGABRT and "is_swa_any" in aborted.stderr
    slice_gguf(gemma3_path, 12, 17, tmp_path / "sliding.gguf")
    assert load_ranges(tmp_path / "sliding.gguf", [(12, 17)]).returncode == 0
