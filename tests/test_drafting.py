"""Drafting for speculative ring steps, in one process and without a model: prompt lookup, the
scoring of proposals against what really followed, the step-cost fit and the draft budget."""

from __future__ import annotations

import pytest

from neuron_bus.worker.drafting import Acceptance, Draft, DraftBudget, NgramDrafter, StepCost


def test_the_longest_earlier_suffix_proposes_what_followed_it():
    d = NgramDrafter([1, 2, 3, 4, 9, 9, 2, 3, 5, 7, 1, 2, 3])
    # [1, 2, 3] occurred at the start (then 4); [2, 3] last occurred before 5: the longest wins
    assert d.draft(3) == Draft([4, 9, 9], 3)
    d.extend([6])  # [..., 3, 6]: no earlier "3 6", no earlier "6": nothing to propose
    assert d.draft(3) == Draft([], 0)
    assert NgramDrafter([5, 6, 7]).draft(4) == Draft([], 0)
    assert NgramDrafter([5, 6, 5]).draft(0) == Draft([], 0)


def test_a_continuation_that_reaches_the_present_goes_on_from_the_draft():
    # a loop of period 2: the suffix [7, 8] last ended two tokens ago; the draft repeats the loop
    assert NgramDrafter([1, 7, 8, 7, 8]).draft(5) == Draft([7, 8, 7, 8, 7], 2)


def test_growing_the_context_drafts_as_the_whole_context_would():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    grown = NgramDrafter(tokens[:3])
    for i in range(3, len(tokens)):
        grown.extend([tokens[i]])
        assert grown.draft(4) == NgramDrafter(tokens[: i + 1]).draft(4)
    with pytest.raises(ValueError):
        NgramDrafter([], max_ngram=0)


def test_every_proposal_is_scored_against_the_tokens_that_followed():
    a = Acceptance()
    assert a.rate(2) == 0.5  # the prior
    a.proposed(Draft([10, 11, 12], 2))
    a.proposed(Draft([11, 99], 1))  # proposed one token later (say, not sent): scored all the same
    a.generated(10)  # first proposal: hit; second: miss (it expected 11 here)
    a.generated(11)  # first: hit
    a.generated(13)  # first: miss at its third token
    assert (a.hits[2], a.misses[2], a.hits[1], a.misses[1]) == (2, 1, 0, 1)
    assert a.rate(2) == pytest.approx(3 / 5) and a.rate(1) == pytest.approx(1 / 3)
    a.proposed(Draft([], 0))  # nothing to score
    a.generated(1)
    assert sum(a.hits) + sum(a.misses) == 4


def test_the_step_cost_fit_finds_the_latency_and_the_row_cost():
    cost = StepCost()
    cost.observe(1, 0.1)
    assert cost.fit() is None  # nothing known of a row yet
    cost.row_compute(0.005, hops=2)  # the tail: 5 ms a row; two hops: 10 ms a row for the ring
    base, per_row = cost.fit()
    assert base == pytest.approx(0.1) and per_row == pytest.approx(0.010)
    for rows in (1, 3, 5, 2, 4, 1, 5) * 3:  # a ring whose rows cost 20 ms, its latency 100 ms
        cost.observe(rows, 0.1 + 0.02 * (rows - 1))
    base, per_row = cost.fit()
    assert base == pytest.approx(0.1, abs=0.005) and per_row == pytest.approx(0.02, abs=0.002)


def _budget(base: float, per_row: float, hits: int, misses: int, k_max: int = 8) -> DraftBudget:
    b = DraftBudget(k_max, hops=2)
    b.cost.row_compute(per_row / 2, hops=2)
    for _ in range(5):
        b.cost.observe(1, base)
    b.acceptance.hits[3], b.acceptance.misses[3] = hits, misses
    return b


def test_drafts_are_sent_when_they_pay_for_their_rows():
    draft = Draft(list(range(8)), 3)
    # over 25 ms links a step costs ~110 ms, a row 10: even a coin-flip draft pays, and a sure one in full
    assert _budget(0.110, 0.010, hits=19, misses=1).choose(draft, room=100) == 8
    assert 1 <= _budget(0.110, 0.010, hits=1, misses=1).choose(draft, room=100) < 8
    # on one machine a step costs 12 ms and a row 10: only near-certain drafts pay
    assert _budget(0.012, 0.010, hits=1, misses=1).choose(draft, room=100) == 0
    assert _budget(0.012, 0.010, hits=98, misses=2).choose(draft, room=100) > 0
    # never more than the session may still emit, nor more than the draft has
    assert _budget(0.110, 0.010, hits=9, misses=1).choose(draft, room=3) == 3
    assert _budget(0.110, 0.010, hits=9, misses=1).choose(Draft([4, 2], 3), room=100) == 2
    assert DraftBudget(8, 2).choose(draft, room=100) == 0  # nothing measured yet
    assert DraftBudget(8, 2, adaptive=False).choose(draft, room=5) == 5  # every draft there is
