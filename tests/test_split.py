"""Work-balanced layer splits (neuron_bus.split)."""

from __future__ import annotations

import itertools

import pytest

from neuron_bus.artifacts.gguf_model import GGUFModel
from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.split import balanced_split, layer_work


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
