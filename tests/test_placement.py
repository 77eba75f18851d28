"""Placement (neuron_bus.tracker.placement): which layers a joining node takes, and which node moves."""

from __future__ import annotations

from neuron_bus.tracker.placement import Fit, Picture, Placed, choose_range, plan_move

N = 30
T = 0.002  # seconds per layer per token


def join(picture: Picture, node: str, max_layers: int = 20, spl: float = T, **fit) -> tuple[int, int]:
    d = choose_range(picture, node, Fit(max_layers, **fit))
    assert d is not None
    picture.nodes.append(Placed(node, d.layer_start, d.layer_end, spl))
    return d.layer_start, d.layer_end


def test_joining_nodes_cover_the_model_then_even_out_its_weakest_layers():
    p = Picture(N)
    assert join(p, "a") == (0, 20)  # the most uncovered layers it can hold, from a seam
    assert join(p, "b") == (20, 30)  # the gap that is left, meeting a's end
    assert min(p.capacity()) > 0
    assert join(p, "c") == (0, 20)  # the weakest layers now: a's, at 1 / (20 T) each
    cap = p.capacity()
    assert max(cap) / min(cap) < 1.01  # every layer carries the same tokens per second


def test_a_joining_node_takes_the_range_with_the_least_throughput_per_layer():
    p = Picture(N, [Placed("h1", 0, 15, T), Placed("h2", 0, 15, T), Placed("t", 15, 30, T)])
    start, end = join(p, "new", max_layers=15)
    assert (start, end) == (15, 30)  # one replica there, two on the head's layers


def test_what_fits_the_memory_budget_and_the_ranges_that_cannot_load_are_respected():
    p = Picture(N)
    layer_bytes = tuple([100] * N)
    d = choose_range(p, "n", Fit(30, budget=1250, layer_bytes=layer_bytes, head_bytes=600))
    assert d is not None and d.layer_end - d.layer_start == 12  # 12 layers fit, not the tail's head too
    assert d.layer_end < N or sum(layer_bytes[d.layer_start :]) + 600 <= 1250
    only_even_starts = choose_range(p, "n", Fit(10), loadable=lambda a, b: a % 2 == 0)
    assert only_even_starts is not None and only_even_starts.layer_start % 2 == 0
    assert choose_range(p, "n", Fit(10), loadable=lambda a, b: False) is None


def test_a_lost_tail_is_covered_by_a_replica_that_can_move_without_opening_a_gap():
    fits = {n: Fit(20) for n in ("a", "c")}
    p = Picture(N, [Placed("a", 0, 20, T), Placed("c", 0, 20, T)])  # b, the tail, is gone
    move = plan_move(p, fits, now=1000.0)
    assert move is not None and (move.layer_start, move.layer_end) == (20, 30) and "uncovered" in move.reason
    # the only holder of a range never moves away from it
    p = Picture(N, [Placed("a", 0, 20, T), Placed("b", 20, 30, T)])
    assert plan_move(p, {"a": Fit(20), "b": Fit(20)}, now=1000.0) is None


def test_the_slow_replica_is_the_one_that_moves():
    slow, fast = 5 * T, T
    p = Picture(N, [Placed("fast", 0, 15, fast), Placed("slow", 0, 15, slow), Placed("t", 15, 30, T)])
    p.nodes.append(Placed("t2", 15, 30, T))
    p.nodes.append(Placed("t3", 15, 30, T))  # the tail's layers are plentiful, the head's are not
    move = plan_move(p, {n.node_id: Fit(15) for n in p.nodes}, now=1000.0)
    assert move is not None and move.node_id in ("t2", "t3", "t")  # a tail replica helps the head most
    p = Picture(N, [Placed("fast", 0, 15, fast), Placed("slow", 0, 15, slow), Placed("t", 15, 30, T / 8)])
    p.nodes.append(Placed("t2", 15, 30, T / 8))
    same = {n: Fit(15) for n in ("fast", "slow")}  # only the head's replicas may move
    assert plan_move(p, same, now=1000.0) is None  # the head's two replicas: neither move helps
    p = Picture(N, [Placed("fast", 0, 20, fast), Placed("slow", 0, 20, slow), Placed("t", 20, 30, T)])
    p.nodes.append(Placed("t2", 20, 30, T))
    uncovered = Picture(N, [n for n in p.nodes if n.node_id not in ("t", "t2")])
    move = plan_move(uncovered, {"fast": Fit(20), "slow": Fit(20)}, now=1000.0)
    assert move is not None and move.node_id == "slow"  # either would do: the slow one goes


def test_moves_have_hysteresis_and_a_minimum_stay():
    tail = [Placed(n, 15, 30, T, placed_at=990.0) for n in "bcd"]  # three tail replicas, one head
    p = Picture(N, [Placed("a", 0, 15, T), *tail])
    fits = {n: Fit(15) for n in "abcd"}
    assert plan_move(p, fits, now=1000.0) is None  # a tail replica would help the head, but they just arrived
    move = plan_move(p, fits, now=2000.0)
    assert move is not None and move.node_id in "bcd" and (move.layer_start, move.layer_end) == (0, 15)
    assert "bottleneck" in move.reason and abs(move.bottleneck_after - 2 * move.bottleneck_before) < 1e-3
    assert plan_move(p, fits, now=2000.0, gain=2.5) is None  # not worth a move at that bar
