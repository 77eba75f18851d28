"""How many decode waves a head hop plans (neuron_bus.worker.ring_model), from the call costs and
link latencies it measures."""

from __future__ import annotations

import pytest

from neuron_bus.worker.ring_model import CallCost, RingLinks, best_wave_count, round_s, wave_size


def smollm2_like() -> CallCost:
    """Decode call costs of a SmolLM2 half on one thread of this machine: 8.5, 14, 22, 36 ms."""
    cost = CallCost()
    for rows, ms in ((1, 8.5), (2, 14.0), (4, 22.0), (8, 36.0)):
        cost.observe(rows, ms / 1000)
    return cost


def test_the_call_cost_is_a_line_through_the_sizes_seen():
    cost = CallCost()
    assert cost.line() is None and cost(4) is None
    cost.observe(4, 0.010)
    assert cost.line() == pytest.approx((0.002, 0.002))  # one size: split evenly, a guess
    cost.observe(8, 0.018)
    assert cost.line() == pytest.approx((0.002, 0.002))
    cost.observe(8, 0.028)  # a running mean per size: 0.018 + 0.2 * 0.010
    assert cost(8) == pytest.approx(0.020)
    cost.observe(1, 0.001)
    assert cost.line()[0] >= 0.0 and cost.line()[1] > 0.0


def test_the_links_are_the_shortest_trip_less_the_other_hops_compute():
    links = RingLinks()
    assert links.latency() is None
    links.left(["a", "b"], when=10.0, others_compute_s=0.030)
    links.returned("a", 10.150)
    links.returned("b", 10.200)  # waited at a busy hop: a longer trip
    links.returned("z", 10.300)  # a step of a session this hop did not send: no trip
    links.returned(None, 10.300)
    assert links.latency() == pytest.approx(0.120)
    links.left(["c"], when=11.0, others_compute_s=0.0)
    links.forget(set())  # c closed before its step came back
    links.returned("c", 11.5)
    assert links.latency() == pytest.approx(0.120)


def test_short_links_keep_one_wave_per_hop_long_links_make_more_and_smaller():
    cost = smollm2_like()
    assert best_wave_count(16, 2, 8, None, cost, current=2) == 2  # nothing measured yet
    assert best_wave_count(16, 2, 8, 0.001, cost, current=2) == 2  # one machine: the biggest batches
    at25 = best_wave_count(16, 2, 8, 0.100, cost, current=2)  # 4 crossings of 25 ms
    assert 4 <= at25 <= 8
    assert round_s(16, at25, 2, 0.100, cost) < 0.85 * round_s(16, 2, 2, 0.100, cost)
    assert best_wave_count(8, 2, 8, 0.100, cost, current=2) > 2
    assert best_wave_count(2, 2, 8, 0.100, cost, current=2) == 2  # one session per hop: no batches


def test_the_plan_keeps_its_count_unless_another_is_clearly_better_and_respects_the_batch_cap():
    cost = smollm2_like()
    best = best_wave_count(16, 2, 8, 0.100, cost, current=2)
    near = [w for w in (4, 5, 6, 8) if round_s(16, w, 2, 0.100, cost) <= 1.05 * round_s(16, best, 2, 0.100, cost)]
    assert all(best_wave_count(16, 2, 8, 0.100, cost, current=w) == w for w in near)
    assert best_wave_count(16, 2, 2, 0.001, cost, current=2) == 8  # waves of at most 2
    assert best_wave_count(5, 1, 8, 0.0, cost, current=1) == 1


def test_when_compute_is_negligible_the_fewest_waves_stay():
    """No-op hops: every count's round is the links' within 5%, so the batches stay as big as
    one wave per hop makes them (each call also costs the shell a pass)."""
    cost = CallCost()
    for rows, us in ((1, 40.0), (4, 60.0)):
        cost.observe(rows, us / 1e6)
    assert best_wave_count(8, 2, 8, 0.002, cost, current=1) == 2


@pytest.mark.parametrize("links_over_call", [1, 3, 6, 10, 17, 18, 60])
def test_a_guess_from_one_size_never_keeps_running_that_size(links_over_call):
    """A lone session's calls (one row each) are the only ones measured when eight sessions
    start: whatever the links, the plan runs a size it has not seen, and the fitted line takes
    over from the guess. (With links 6-17 times a call the guess once chose eight waves of one,
    and with only one-row calls ever measured it chose them for good: the head never batched.)"""
    call = 1e-4
    cost = CallCost()
    cost.observe(1, call)
    count = best_wave_count(8, 2, 8, links_over_call * call, cost, current=2)
    assert wave_size(8, count) != 1
    cost.observe(wave_size(8, count), call * 1.2)  # no-op hops: a bigger call costs about the same
    assert best_wave_count(8, 2, 8, links_over_call * call, cost, current=count) == count
    one_size = CallCost()
    one_size.observe(8, 0.036)  # the default's size (16 on 2 hops): the guess may move away from it
    assert best_wave_count(16, 2, 8, 0.100, one_size, current=2) > 2
