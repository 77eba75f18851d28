"""Next-token sampling at a route's tail: greedy, or temperature / top-k / top-p with a seed.

The random draw for token ``index`` of a session depends only on (seed, index), so a sampled
generation can be replayed exactly from its validation event.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from neuron_bus.messages import SamplingParams


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float | None  # only when asked for (a softmax over the vocabulary costs time)
    top_logprobs: dict[int, float] | None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def sample(logits: np.ndarray, params: SamplingParams, index: int, top_n: int = 0) -> Sample:
    """Choose the next token from last-position ``logits`` (float32 [vocab]).

    Log-probabilities (of the choice, and the ``top_n`` best) are computed when
    ``params.logprobs`` is set or ``top_n`` > 0.
    """
    if params.temperature <= 0.0:
        token = int(np.argmax(logits))
    else:
        scaled = logits.astype(np.float64) / params.temperature
        order = np.argsort(-scaled, kind="stable")
        if params.top_k > 0:
            order = order[: params.top_k]
        probs = np.exp(scaled[order] - scaled[order[0]])
        probs /= probs.sum()
        if params.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        rng = np.random.default_rng([params.seed & 0xFFFFFFFF, index])
        token = int(order[rng.choice(len(order), p=probs)])
    if not (params.logprobs or top_n > 0):
        return Sample(token, None, None)
    logp = log_softmax(logits)
    top = None
    if top_n > 0:
        best = np.argsort(-logp, kind="stable")[:top_n]
        top = {int(i): float(logp[i]) for i in best}
    return Sample(token, float(logp[token]), top)
