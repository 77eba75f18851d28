"""A client's memory of the nodes that answered it nonsense (neuron_bus/suspects.py)."""

from __future__ import annotations

from neuron_bus.suspects import MAX_SUSPECTS, Suspects


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_suspect_is_avoided_for_a_while_after_its_last_bad_answer():
    clock = Clock()
    s = Suspects(keep_s=100.0, clock=clock)
    assert s.add("rogue") is True
    clock.now = 60.0
    assert s.add("rogue") is False  # known: remembered from now
    assert s.current() == {"rogue"}
    clock.now = 150.0
    assert s.current() == {"rogue"}
    clock.now = 160.0
    assert s.current() == set()
    assert s.add("rogue") is True  # forgotten, then new again


def test_the_oldest_suspects_are_forgotten_first_past_the_bound():
    s = Suspects(clock=Clock())
    for i in range(MAX_SUSPECTS + 2):
        s.add(f"n{i}")
    assert len(s.current()) == MAX_SUSPECTS and {"n0", "n1"}.isdisjoint(s.current())
    s.add("n2")  # seen again: now the newest
    s.add("new")
    assert len(s.current()) == MAX_SUSPECTS
    assert "n3" not in s.current() and {"n2", "new"} <= s.current()
