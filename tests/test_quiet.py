"""The client's rule for a quiet route (neuron_bus/quiet.py), without a bus: when a quiet spell is
a dead route, when it is a session waiting its turn, and what the client owes the route meanwhile."""

from __future__ import annotations

from neuron_bus import messages as M
from neuron_bus import quiet, timing
from neuron_bus.quiet import QuietSpell, busy_nodes, keep_alive_every


def beat(node: str, sessions: int, queued: int) -> bytes:
    return M.encode(
        M.NodeHeartbeat(
            node_id=node, seq=1, ts=0.0, layer_start=0, layer_end=15, cache_abi="a", sessions_active=sessions,
            queue_depth=queued,
        )
    )  # fmt: skip


def test_a_node_is_busy_with_other_sessions_or_queued_work():
    beats = {
        "w-own-work": beat("w-own-work", 1, 5),  # this session alone, its chunks queued: a slow hop at work
        "w-idle": beat("w-idle", 1, 0),
        "w-shared": beat("w-shared", 3, 0),
        "w-queued": beat("w-queued", 2, 4),
        "w-garbled": b"{not a heartbeat",
    }
    assert busy_nodes(beats) == ["w-own-work", "w-queued", "w-shared"]


def test_a_quiet_route_with_no_busy_node_stalls_at_the_stall_timeout():
    spell, asked = QuietSpell(), []

    def busy() -> list[str]:
        asked.append(spell.seconds)
        return []

    for _ in range(int(quiet.STALL_TIMEOUT_S) - 1):
        due = spell.grow(1.0, busy)
        assert due.stalled is None and due.notice is None and not due.keep_alive
    assert asked[0] == quiet.WAIT_NOTICE_S  # the heartbeats are not read before a notice may be due
    due = spell.grow(1.0, busy)
    assert due.stalled == f"for {quiet.STALL_TIMEOUT_S:.0f}s"


def test_a_session_waiting_its_turn_is_named_kept_alive_and_given_up_only_at_the_busy_bound():
    spell, busy = QuietSpell(), ["worker-0", "worker-1"]
    notices, keep_alives = [], []
    t = 0.0
    while True:
        t += 1.0
        due = spell.grow(1.0, lambda nodes=busy: nodes)
        if due.stalled:
            break
        if due.notice:
            notices.append((t, due.notice))
        if due.keep_alive:
            keep_alives.append(t)
        if t == 100.0:
            busy = ["worker-0"]  # one hop is done with the others: the notice changes once
    assert t == timing.BUSY_WAIT_S and "busy with other sessions" in due.stalled
    assert notices == [(quiet.WAIT_NOTICE_S, ["worker-0", "worker-1"]), (101.0, ["worker-0"])]
    every = quiet.KEEP_ALIVE_EVERY_S
    assert keep_alives == [every * k for k in range(1, int(timing.BUSY_WAIT_S // every))]


def test_progress_ends_the_spell():
    spell = QuietSpell()
    for _ in range(int(quiet.KEEP_ALIVE_EVERY_S) + 5):
        spell.grow(1.0, lambda: ["worker-0"])
    spell.progress()
    assert (spell.seconds, spell.named, spell.keep_alive_at) == (0.0, [], quiet.KEEP_ALIVE_EVERY_S)
    # a later wait is named again, and its first keep-alive is a whole interval away
    dues = [spell.grow(1.0, lambda: ["worker-0"]) for _ in range(int(quiet.KEEP_ALIVE_EVERY_S))]
    assert dues[int(quiet.WAIT_NOTICE_S) - 1].notice == ["worker-0"]
    assert [d.keep_alive for d in dues].index(True) == int(quiet.KEEP_ALIVE_EVERY_S) - 1


def test_keep_alives_come_well_within_the_shortest_idle_timeout_the_hops_announced():
    every = quiet.KEEP_ALIVE_EVERY_S
    assert keep_alive_every([]) == every
    assert keep_alive_every([0.0, 0.0]) == every  # hops that did not say
    assert keep_alive_every([300.0, 600.0]) == every
    assert keep_alive_every([300.0, 90.0, 0.0]) == 30.0
    assert keep_alive_every([3.0, 300.0]) == 1.0
    # a hop freeing sessions after 3 s: kept alive from the first second of waiting, named only
    # once the notice is due
    spell, dues = QuietSpell(keep_alive_every([3.0, 300.0])), []
    for _ in range(5):
        dues.append(spell.grow(1.0, lambda: ["worker-0"]))
    assert [d.keep_alive for d in dues] == [True] * 5
    assert [d.notice for d in dues] == [None, ["worker-0"], None, None, None]
