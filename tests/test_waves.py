"""Decode waves and prefill batches (neuron_bus.worker.waves): which queued steps a worker runs as
one backend call.

Real session-table entries, real NATS message objects (as the consumer delivers them) and a real
llama.cpp backend over a tiny GGUF, whose slots give the batch ranks.
"""

from __future__ import annotations

import asyncio
from collections import deque

import numpy as np
import pytest
from nats.aio.msg import Msg

from neuron_bus import codec
from neuron_bus import messages as M
from neuron_bus.worker.engine import Incoming
from neuron_bus.worker.session_table import HopSession, SessionTable
from neuron_bus.worker.waves import DecodeWaves, next_prefill
from workers.llama_cpp_full import LlamaCppFullBackend


def route(hops: int) -> M.RouteAssignment:
    return M.RouteAssignment(
        route_id="r",
        model_preset="m",
        model_revision="v",
        n_layers_total=hops,
        hops=[
            M.RouteHop(node_id=f"n{i}", layer_start=i, layer_end=i + 1, subject="", backend_id="b", cache_abi="a")
            for i in range(hops)
        ],
    )


def decoding(session_id: str, hop_index: int, hops: int = 2) -> HopSession:
    open_ = M.SessionOpen(session_id=session_id, route=route(hops), hop_index=hop_index, prompt_tokens=4, n_ctx=64)
    return HopSession(open=open_, node_id=f"n{hop_index}", position=4)  # past its prompt: decoding


def prefilling(session_id: str) -> HopSession:
    open_ = M.SessionOpen(session_id=session_id, route=route(2), hop_index=0, prompt_tokens=512, n_ctx=1024)
    return HopSession(open=open_, node_id="n0")


def activation(session_id: str, rows: int, phase: str) -> dict[str, str]:
    """The headers of a step of ``rows`` positions (waves read only those, never the body)."""
    header = M.ActivationHeader(
        session_id=session_id, route_id="r", model_preset="m", model_revision="v", backend_id="b", cache_abi="a",
        layer_start=0, layer_end=1, position=4, phase=phase, seq=0, dtype="i32", shape=[rows],
    )  # fmt: skip
    return codec.encode(header, np.zeros(rows, dtype=np.int32))[0]


def step(session_id: str) -> Incoming:
    msg = Msg(_client=None, subject="neuron.act.r.0.decode", headers=activation(session_id, 1, "decode"), data=b"")
    return Incoming(msg, msg.headers, msg.data)  # what the consumer queues


@pytest.fixture
def backend(tiny_gguf):
    b = LlamaCppFullBackend(tiny_gguf, n_ctx=64, max_sessions=4, benchmark=False)
    for sid in ("c", "a", "d", "b"):  # slots 0, 1, 2, 3
        b.open_session(sid, 64)
    yield b
    b.close()


def test_the_head_groups_its_sessions_into_runs_of_neighbouring_slots(backend):
    sessions = [decoding(sid, 0) for sid in "abcd"]
    waves = DecodeWaves(deque(), asyncio.Event(), max_batch=8, wait_ms=10)
    size, wave_of = waves.plan(sessions, backend)
    assert size == 2  # four sessions over a two-hop ring: two waves, one per hop
    assert wave_of == {"c": 0, "a": 0, "d": 1, "b": 1}
    assert waves.plan(sessions[:1], backend)[0] == 1  # one session: nothing to batch
    assert waves.plan([decoding(sid, 0, hops=3) for sid in "abcd"], backend)[0] == 2  # ceil(4 / 3)
    assert (
        DecodeWaves(deque(), asyncio.Event(), max_batch=3, wait_ms=10).plan(
            [decoding(sid, 0, hops=1) for sid in "abcd"], backend
        )[0]
        == 2
    )  # capped at 3: the fewest waves that respect it (two), balanced (2 + 2, not 3 + 1)
    finished = decoding("a", 0)
    finished.finished = True
    assert "a" not in waves.plan([finished, *sessions[1:]], backend)[1]


def test_the_head_takes_the_oldest_steps_wave_and_waits_for_its_straggler(backend):
    async def run():
        queue = deque([step("d"), step("c"), step("a")])
        arrived = asyncio.Event()
        waves = DecodeWaves(queue, arrived, max_batch=8, wait_ms=2000)
        sessions = [decoding(sid, 0) for sid in "abcd"]

        def straggler():
            queue.append(step("b"))
            arrived.set()

        asyncio.get_running_loop().call_later(0.05, straggler)
        picked = await waves.next(sessions, backend)
        return [m.session_id for m in picked], [m.session_id for m in queue]

    picked, left = asyncio.run(run())
    assert picked == ["d", "b"]  # d's wave (slots 2, 3), once b's step arrived
    assert left == ["c", "a"]  # the other wave stays queued, in order


def test_a_missing_member_holds_the_wave_only_for_the_wait(backend):
    async def run():
        queue = deque([step("d")])
        waves = DecodeWaves(queue, asyncio.Event(), max_batch=8, wait_ms=30)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        picked = await waves.next([decoding(sid, 0) for sid in "abcd"], backend)
        return [m.session_id for m in picked], loop.time() - t0

    picked, waited = asyncio.run(run())
    assert picked == ["d"] and waited >= 0.03


def test_later_hops_take_steps_in_arrival_order(backend):
    async def run():
        queue = deque([step(sid) for sid in "dcab"])
        waves = DecodeWaves(queue, asyncio.Event(), max_batch=8, wait_ms=10)
        picked = await waves.next([decoding(sid, 1) for sid in "abcd"], backend)
        return [m.session_id for m in picked], len(queue)

    assert asyncio.run(run()) == (["d", "c"], 2)


def chunk(session_id: str, rows: int, name: str) -> Incoming:
    headers = activation(session_id, rows, "prefill") | {"name": name}
    msg = Msg(_client=None, subject="neuron.act.r.0.prefill", headers=headers, data=b"")
    return Incoming(msg, msg.headers, msg.data)


def in_arrival_order(session_id: str | None) -> int:
    return 0  # every session's turn alike, and as much prompt left: ties go as the chunks arrived


def test_a_prefill_batch_takes_each_sessions_oldest_chunk_within_the_row_budget():
    queue = deque(
        [
            chunk("a", 100, "a1"),
            chunk("a", 100, "a2"),  # a's second chunk waits for its first
            chunk("b", 300, "b1"),
            chunk("c", 200, "c1"),  # would pass the budget of 512: stays, and so does c's next
            chunk("c", 10, "c2"),
            chunk("d", 50, "d1"),
        ]
    )
    picked = next_prefill(queue, in_arrival_order, in_arrival_order, max_rows=512)
    assert [m.headers["name"] for m in picked] == ["a1", "b1", "d1"]
    assert [m.headers["name"] for m in queue] == ["a2", "c1", "c2"]
    assert [m.headers["name"] for m in next_prefill(queue, in_arrival_order, in_arrival_order, max_rows=512)] == [
        "a2",
        "c1",
    ]
    # the oldest chunk always goes, even when it alone is longer than the budget
    big = deque([chunk("x", 900, "x1"), chunk("y", 1, "y1")])
    assert [m.headers["name"] for m in next_prefill(big, in_arrival_order, in_arrival_order, 512)] == ["x1"]


def test_prefill_batches_serve_the_sessions_in_the_turn_the_hop_took_them_not_as_their_chunks_arrived():
    """Sessions sharing a route publish their chunks interleaved; the hop takes the earliest
    sessions' chunks first, so they reach their first tokens while the later ones wait."""
    table = SessionTable()
    for sid in "abcd":
        table.add(prefilling(sid))
    queue = deque(chunk(sid, 256, f"{sid}{k}") for k in (1, 2) for sid in "dcba")  # d1 c1 b1 a1 d2 c2 b2 a2
    batches = []
    while queue:
        batches.append([m.headers["name"] for m in next_prefill(queue, table.turn, table.left, max_rows=512)])
    assert batches == [["a1", "b1"], ["a2", "b2"], ["c1", "d1"], ["c2", "d2"]]
    # a message of a session the hop does not hold goes first: it is refused without model work
    queue = deque([chunk("a", 256, "a3"), chunk("zz", 256, "z1")])
    assert [m.headers["name"] for m in next_prefill(queue, table.turn, table.left, max_rows=256)] == ["z1"]


def test_a_short_prompt_behind_long_ones_gets_the_one_place_out_of_turn_in_the_next_batch():
    table = SessionTable()
    for sid in "ab":
        table.add(prefilling(sid))  # 512 prompt positions each: two chunks of 256
    short = prefilling("c")
    short.open.prompt_tokens = 100
    table.add(short)
    assert [table.left(sid) for sid in "abc"] == [512, 512, 100]
    queue = deque([chunk("a", 256, "a1"), chunk("b", 256, "b1"), chunk("a", 256, "a2"), chunk("c", 100, "c1")])
    assert [m.headers["name"] for m in next_prefill(queue, table.turn, table.left, max_rows=512)] == ["c1", "a1"]
    table.get("a").position = 256  # a1 computed: a has the fewest left of the two long ones
    table.get("c").position = 100  # c's prompt is in
    assert [m.headers["name"] for m in next_prefill(queue, table.turn, table.left, max_rows=512)] == ["a2", "b1"]


def test_a_session_that_replaces_its_own_entry_keeps_its_turn():
    table = SessionTable()
    for sid in "ab":
        table.add(prefilling(sid))
    turns = table.turn("a"), table.turn("b")
    table.add(prefilling("a"))  # the route repaired: a resumed session replaces a's entry
    table.add(prefilling("c"))
    assert (table.turn("a"), table.turn("b")) == turns and table.turn("c") > turns[1] > turns[0] > 0
    table.pop("b")
    assert table.turn("b") == 0


def test_the_head_plans_more_waves_once_it_has_measured_long_links(backend):
    """Four sessions over two hops: one wave per hop until the ring is measured; 100 ms of links
    and calls that cost about as much per row as they do fixed make four waves of one."""
    sessions = [decoding(sid, 0) for sid in "abcd"]
    waves = DecodeWaves(deque(), asyncio.Event(), max_batch=8, wait_ms=10)
    assert waves.plan(sessions, backend)[0] == 2
    for rows, seconds in ((1, 0.008), (2, 0.012)):
        waves.ran(sessions[:rows], rows, seconds, when=0.0)
    assert waves.plan(sessions, backend)[0] == 2  # no trip measured yet
    waves.returned(step("a"), when=0.110)  # 110 ms away, 12 ms of it the other hop's compute
    size, wave_of = waves.plan(sessions, backend)
    assert waves.links.latency() == pytest.approx(0.098)
    assert size == 1 and sorted(wave_of.values()) == [0, 1, 2, 3]
    later = DecodeWaves(deque(), asyncio.Event(), max_batch=8, wait_ms=10)
    later.ran([decoding(sid, 1) for sid in "ab"], 2, 0.012, when=0.0)  # a later hop heads nothing
    later.returned(step("a"), when=0.110)
    assert later.links.latency() is None


def test_the_ttft_bench_bound_is_first_come_first_served_at_the_runs_own_rate():
    from scripts.ttft_bench import figures

    in_turn = figures([4.0, 1.0, 3.0, 2.0])  # one after another: the k-th after k/4 of the last
    assert in_turn["first_come_bound_mean_s"] == 2.5 and in_turn["ttft_mean_vs_first_come_bound"] == 1.0
    shared = figures([4.0, 4.0, 4.0, 4.0])  # every prompt done at the end
    assert shared["ttft_mean_vs_first_come_bound"] == 1.6 and shared["ttft_first_s"] == 4.0
