"""A worker's KV pool (workers/kv_pool.py): sessions are admitted by the positions they need.

The accounting on its own, the llama.cpp backend on a synthetic model, and the acceptance test on
a real route: nats-server, tracker and two SmolLM2 worker processes (one thread each) with the
default memory (today's 8 slots of 4608 positions) take 32 sessions of 512 positions at once, and
every one of them gives the tokens it gives alone.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from neuron_bus import messages as M
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm
from workers.errors import BadInput, NoFreeSlot
from workers.kv_pool import GRANULE, KvPool
from workers.llama_cpp_full import LlamaCppFullBackend

DEFAULT_BUDGET = 8 * 4608  # the default fixed slots: 8 sessions of 4608 positions


class FakeLanes:
    """The pool's callbacks, recording which lanes exist (no llama.cpp)."""

    def __init__(self):
        self.open: dict[int, tuple[int, int]] = {}

    def open_lane(self, index: int, streams: int, positions: int) -> int:
        self.open[index] = (streams, positions)
        return positions

    def close_lane(self, index: int) -> None:
        del self.open[index]


def admit(pool: KvPool, lanes: FakeLanes, need: int):
    return pool.admit(need, lanes.open_lane, lanes.close_lane)


def test_full_size_sessions_get_exactly_the_fixed_slots_of_before():
    pool, lanes = KvPool(DEFAULT_BUDGET, 4608, overhead=10_000), FakeLanes()
    slots = [admit(pool, lanes, 4608) for _ in range(8)]
    assert lanes.open == {0: (8, 4608)} and [s.seq for s in slots] == list(range(8))
    with pytest.raises(NoFreeSlot, match="no room for a session of 4608 positions"):
        admit(pool, lanes, 4608)
    pool.release(slots[3])
    assert admit(pool, lanes, 4000).seq == 3  # a free stream that holds it


def test_short_sessions_share_one_lane_of_many_streams_and_leave_room_for_a_long_one():
    pool, lanes = KvPool(DEFAULT_BUDGET, 4608, overhead=10_000), FakeLanes()
    short = [admit(pool, lanes, 512) for _ in range(32)]
    assert len(lanes.open) == 1 and all(s.positions == 512 for s in short)
    long = admit(pool, lanes, 4608)  # the room kept for one session of the largest size
    assert long.positions == 4608 and len(lanes.open) == 2
    assert pool.reserved <= pool.budget
    n = len(short)
    while True:  # the short lane's streams, then a lane in what is left
        try:
            short.append(admit(pool, lanes, 512))
        except NoFreeSlot:
            break
    assert len(short) > n and pool.reserved <= pool.budget


def test_idle_lanes_give_their_memory_to_another_size():
    pool, lanes = KvPool(DEFAULT_BUDGET, 4608, overhead=10_000), FakeLanes()
    short = [admit(pool, lanes, 300) for _ in range(40)]  # class 512
    longs = [admit(pool, lanes, 4608)]
    with pytest.raises(NoFreeSlot):
        longs.append(admit(pool, lanes, 4608))
    for s in short:
        pool.release(s)
    longs.append(admit(pool, lanes, 4608))  # the idle short lane is dropped for it
    assert all(p == 4608 for _, p in lanes.open.values())


def test_a_workload_moving_to_short_sessions_gets_short_streams_not_the_idle_long_ones():
    """Found by scripts/bench: after sessions of 2048 and 4096 positions left idle lanes of long
    streams, 8 concurrent sessions of 200 positions got only the 6 long streams those lanes held
    and the rest waited; the idle lanes now give their memory to a lane of the short class."""
    pool, lanes = KvPool(DEFAULT_BUDGET, 4608, overhead=10_000), FakeLanes()
    for need in (2049, 4097):
        pool.release(admit(pool, lanes, need))
    short = [admit(pool, lanes, 200) for _ in range(16)]
    assert {s.positions for s in short} == {256} and len({s.lane for s in short}) == 1
    assert pool.reserved <= pool.budget


def test_sizes_are_classes_of_doubling_granules_and_bad_sizes_are_refused():
    pool = KvPool(DEFAULT_BUDGET, 4608)
    assert [pool.size_class(n) for n in (1, 256, 257, 512, 513, 3000, 4608)] == [256, 256, 512, 512, 1024, 4096, 4608]
    with pytest.raises(BadInput):
        pool.size_class(4609)
    with pytest.raises(BadInput):
        KvPool(100, 4608)  # cannot hold one session
    assert GRANULE == 256


def test_the_backend_admits_by_positions_within_its_budget(tiny_gguf):
    # a budget of 4 sessions of 1024 positions (a 1024-position lane, and 256-position lanes)
    full = LlamaCppFullBackend(tiny_gguf, n_ctx=1024, kv_budget=4096, benchmark=False)
    reserved, budget = full.kv_positions()
    assert reserved == 0 and budget >= 4096
    small = [f"s{i}" for i in range(8)]
    for sid in small:
        full.open_session(sid, 200)
    assert {full.cache_bytes(s) for s in small} == {256 * full.state_bytes_per_token + full.state_fixed_bytes}
    ranks = [full.batch_rank(s) for s in small]
    assert ranks == sorted(ranks) and ranks[-1] - ranks[0] == 7  # one lane, neighbouring streams
    logits = full.decode_batch([(s, 0, np.array([5], np.int32)) for s in small])
    assert all(np.array_equal(logits[0], x) for x in logits)  # same input, same output on every stream
    for sid in small:
        full.close_session(sid)
    full.close()
    with pytest.raises(BadInput, match="positions or in bytes"):
        LlamaCppFullBackend(tiny_gguf, n_ctx=256, kv_budget=512, kv_budget_bytes=1 << 20, benchmark=False)


# -- the acceptance test on a real route -------------------------------------------------------------

SESSIONS = 32
NEW_TOKENS = 32
PROMPT_TOKENS = 512 - NEW_TOKENS  # every session needs 512 positions


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    with LocalSwarm(smollm2_path, 2, workdir=tmp_path_factory.mktemp("kvpool")) as s:  # the default memory
        yield s


def _prompts(tok) -> list[list[int]]:
    text = " ".join(
        f"Note {i}: the harbour master logged ship {i * 7 % 31} arriving from port {i * 13 % 17} with cargo of "
        f"{['grain', 'timber', 'salt', 'wool', 'iron'][i % 5]} and {i * 3 % 11} passengers."
        for i in range(400)
    )
    ids = tok.encode(text)
    assert len(ids) >= PROMPT_TOKENS + 4 * SESSIONS
    return [ids[4 * k : 4 * k + PROMPT_TOKENS] for k in range(SESSIONS)]


@pytest.mark.timeout(1500)
def test_32_concurrent_sessions_of_512_positions_fit_the_default_memory_and_equal_their_solo_runs(swarm, reference):
    prompts = _prompts(reference.tokenizer)
    sampling = M.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    head = swarm.workers[0].node_id

    async def one(c: NeuronClient, ids: list[int]) -> list[int]:
        return [
            ev.token_id async for ev in c.generate(prompt_tokens=ids, sampling=sampling) if isinstance(ev, M.TokenDelta)
        ]

    async def scenario():
        # queue_limit 0: a hop without room answers no_free_slot at once instead of queueing the generation
        async with await NeuronClient.connect(swarm.url, queue_limit=0) as c:
            runs = asyncio.gather(*(one(c, ids) for ids in prompts))
            peak = 0
            while not runs.done():
                peak = max(peak, len((await c.sessions(head)).sessions))
                await asyncio.sleep(0.2)
            return await runs, peak

    solo = [reference.soon(ids, NEW_TOKENS) for ids in prompts]  # computed while the route works
    outs, peak = asyncio.run(scenario())
    assert peak > 8  # more sessions open at once than the 8 fixed slots held
    for k, out in enumerate(outs):
        assert len(out) == NEW_TOKENS
        assert out == solo[k].result(), f"session {k} differs from its solo run"
