"""Layer ranges for a pipeline of shards, balanced by the work each shard does per token.

A route is a pipeline: with many sessions in flight, every hop computes at once and the slowest
hop sets the pace. Equal layer counts are not equal work: the tail also projects onto the
vocabulary (SmolLM2's head multiplies as many weights as 8 of its 30 layers), so the balanced
split gives the tail fewer layers. One session's latency is the sum over hops and does not change.

Only ranges llama.cpp can load are offered (`neuron_bus.artifacts.cuts`): Gemma 3's balanced
2-way split would give the tail its last layer alone, a global-attention layer that cannot be a
slice, so the tail gets the last sliding-window layer too.
"""

from __future__ import annotations

from collections.abc import Callable

from neuron_bus.artifacts.cuts import layer_kinds, loadable
from neuron_bus.artifacts.gguf_model import GGUFModel
from neuron_bus.artifacts.work import layer_work


def model_split(model: GGUFModel, shards: int) -> list[tuple[int, int]]:
    """The work-balanced split of ``model`` into ``shards`` ranges that each load as a slice."""
    kinds = layer_kinds(model)
    return balanced_split(layer_work(model), shards, allowed=lambda a, b: loadable(kinds, a, b))


def balanced_split(
    work: list[float], shards: int, allowed: Callable[[int, int], bool] | None = None
) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, one per shard, minimising the largest shard's work.

    Among the splits with that minimum, the one whose shards are closest to equal layer counts
    wins (so equal per-layer work gives the even split). ``allowed(start, end)`` says whether a
    range may be a shard at all (None: every range may).
    """
    n = len(work)
    if not 1 <= shards <= n:
        raise ValueError(f"cannot split {n} layers into {shards} shards")
    prefix = [0.0]
    for w in work:
        prefix.append(prefix[-1] + w)
    even = n / shards

    # best[k][j]: (largest work, layer-count deviation) of splitting layers [0, j) into k shards
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(shards + 1)]
    cut = [[0] * (n + 1) for _ in range(shards + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, shards + 1):
        for j in range(k, n - (shards - k) + 1):
            for i in range(k - 1, j):
                prev = best[k - 1][i]
                if prev == inf or (allowed is not None and not allowed(i, j)):
                    continue
                cand = (max(prev[0], round(prefix[j] - prefix[i], 6)), prev[1] + abs((j - i) - even))
                if cand < best[k][j]:
                    best[k][j], cut[k][j] = cand, i
    if best[shards][n] == inf:
        raise ValueError(f"no split of {n} layers into {shards} shards has only ranges that can be loaded")
    bounds, j = [n], n
    for k in range(shards, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    bounds.reverse()
    return list(zip(bounds[:-1], bounds[1:]))
