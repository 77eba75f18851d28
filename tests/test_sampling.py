"""Tail sampling: greedy, temperature/top-k/top-p with a seed that makes every draw replayable."""

from __future__ import annotations

import numpy as np

from neuron_bus.messages import SamplingParams
from neuron_bus.sampling import log_softmax, sample, top_indices

rng = np.random.default_rng(7)
LOGITS = rng.standard_normal(1000).astype(np.float32) * 3


def test_greedy_is_argmax_and_skips_the_softmax_unless_asked():
    s = sample(LOGITS, SamplingParams(), 0)
    assert s.token_id == int(np.argmax(LOGITS)) and s.logprob is None and s.top_logprobs is None
    s = sample(LOGITS, SamplingParams(logprobs=True), 0, top_n=3)
    assert s.logprob == float(log_softmax(LOGITS)[s.token_id])
    assert list(s.top_logprobs) == list(np.argsort(-LOGITS)[:3])


def test_seeded_draws_depend_only_on_seed_and_index():
    p = SamplingParams(temperature=1.0, seed=42)
    first = [sample(LOGITS, p, i).token_id for i in range(50)]
    again = [sample(LOGITS, p, i).token_id for i in range(50)]
    other = [sample(LOGITS, SamplingParams(temperature=1.0, seed=43), i).token_id for i in range(50)]
    assert first == again and first != other
    assert len(set(first)) > 5  # it really samples


def test_top_k_and_top_p_restrict_the_candidates():
    order = list(np.argsort(-LOGITS))
    for i in range(30):
        assert sample(LOGITS, SamplingParams(temperature=2.0, top_k=3, seed=i), i).token_id in order[:3]
        assert sample(LOGITS, SamplingParams(temperature=1.0, top_k=1, seed=i), i).token_id == order[0]
        assert sample(LOGITS, SamplingParams(temperature=1.0, top_p=1e-6, seed=i), i).token_id == order[0]


def test_temperature_follows_the_softmax():
    logits = np.array([2.0, 1.0, 0.0], dtype=np.float32)
    draws = [sample(logits, SamplingParams(temperature=1.0, seed=1), i).token_id for i in range(3000)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(freq, np.exp(log_softmax(logits)), atol=0.03)


def test_top_indices_equal_the_stable_sort_with_ties_nans_and_signed_zeros():
    gen = np.random.default_rng(3)
    for _ in range(3000):
        n, k = int(gen.integers(1, 60)), int(gen.integers(1, 70))
        x = gen.integers(-3, 4, size=n).astype(gen.choice([np.float32, np.float64]))  # many ties
        if gen.random() < 0.3:
            x[gen.integers(0, n, size=int(gen.integers(1, n + 1)))] = np.nan
        if gen.random() < 0.3:
            x[gen.integers(0, n)] = -0.0
        assert np.array_equal(top_indices(x, k), np.argsort(-x, kind="stable")[:k]), (x, k)
    assert np.array_equal(top_indices(LOGITS, 8), np.argsort(-LOGITS, kind="stable")[:8])


def test_seeded_top_k_draws_are_those_of_the_full_stable_sort():
    """The partitioned top-k keeps every seeded draw what it was with the vocabulary sorted whole."""
    p = SamplingParams(temperature=0.8, top_k=40, seed=5)
    for i in range(50):
        scaled = LOGITS.astype(np.float64) / p.temperature
        order = np.argsort(-scaled, kind="stable")[: p.top_k]
        probs = np.exp(scaled[order] - scaled[order[0]])
        probs /= probs.sum()
        want = int(order[np.random.default_rng([p.seed, i]).choice(len(order), p=probs)])
        assert sample(LOGITS, p, i).token_id == want
