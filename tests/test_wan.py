"""Generations over emulated WAN links (real nats-server, tracker and worker processes, the link
emulator in its own process): the star at 25 ms per link gives the greedy tokens of 0 ms; a
worker's link partitioned mid-decode for 2 s (the session goes on, nothing lost or repeated) and
for 15 s (an explicit failure naming node and phase, within the README's bound); a ring step lost on
a link (cut while it travels) comes again after the ack wait; the regional supercluster
generates correctly and survives the loss of a region holding no hop of the route; 8 sessions
started together over 25 ms links all reach their first token within 2 s of each other."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from neuron_bus import messages as M
from neuron_bus.client import NeuronClient, RouteError
from neuron_bus.generation import LIVENESS_CHECK_S
from neuron_bus.timing import ACK_WAIT_S, heartbeat_loss_s
from neuron_bus.topology import connect
from neuron_bus.wan.linkem import Shape
from neuron_bus.wan.topologies import RegionSwarm, StarSwarm

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PROMPT = "The three primary colors are"
N_TOKENS = 24
DELAY_MS = 25.0
# a node lost mid-decode fails its session within the README's bound: the heartbeat silence the client
# allows a node 4 links away (heartbeat_loss_s), one liveness check, and the repair attempt (capability
# reports and a coverage map over the client's link), which finds no replica here
REPAIR_ATTEMPT_S = 1.5
LOSS_BOUND_S = heartbeat_loss_s(4 * DELAY_MS / 1000) + LIVENESS_CHECK_S + REPAIR_ATTEMPT_S


@pytest.fixture(scope="module")
def star(smollm2_path, tmp_path_factory):
    s = StarSwarm(
        smollm2_path,
        2,
        delay_ms=0.0,
        workdir=tmp_path_factory.mktemp("star"),
        worker_extra={i: ["--max-sessions", "8", "--n-ctx", "512"] for i in range(2)},
    )
    s.start()
    yield s
    s.stop()


@pytest.fixture
def star25(star):
    """The star with every link at 25 ms one way (each test leaves it healed)."""
    star.shape_all(delay_ms=DELAY_MS)
    yield star
    for link in star.emulator.stats():
        if link.partition != "none":
            star.emulator.heal(link.name)


def greedy(n: int = N_TOKENS) -> M.SamplingParams:
    return M.SamplingParams(max_tokens=n, ignore_eos=True)


async def tokens_of(url: str, ids: list[int], n: int = N_TOKENS) -> list[int]:
    async with await NeuronClient.connect(url) as c:
        return (await c.complete(prompt_tokens=ids, sampling=greedy(n))).tokens


def test_star_at_25ms_gives_the_tokens_of_0ms(star, reference):
    ids = reference.tokenizer.encode(PROMPT)
    star.shape_all(delay_ms=0.0)
    at0 = asyncio.run(tokens_of(star.link_url("client"), ids))
    star.shape_all(delay_ms=DELAY_MS)
    t0 = time.monotonic()
    at25 = asyncio.run(tokens_of(star.link_url("client"), ids))
    took = time.monotonic() - t0
    assert at25 == at0 == reference(ids, N_TOKENS)
    # the links were really slow: every token crosses 4 links of 25 ms (2 hops, in and out of the server)
    assert took >= N_TOKENS * 4 * DELAY_MS / 1000


async def partitioned_generation(swarm: StarSwarm, ids: list[int], victim: str, mode: str, seconds: float, n: int):
    """Greedy generation; after 8 tokens ``victim``'s link is partitioned for ``seconds``.

    Returns (token deltas, error or None, seconds from the partition to the generation's end)."""
    deltas: list[M.TokenDelta] = []
    error, cut_at, healer = None, None, None

    async def heal_later() -> None:
        await asyncio.sleep(seconds)
        await asyncio.to_thread(swarm.emulator.heal, victim)

    async with await NeuronClient.connect(swarm.link_url("client")) as c:
        try:
            async for ev in c.generate(prompt_tokens=ids, sampling=greedy(n)):
                if isinstance(ev, M.TokenDelta):
                    deltas.append(ev)
                    if len(deltas) == 8:
                        await asyncio.to_thread(swarm.emulator.partition, victim, mode)
                        cut_at = time.monotonic()
                        healer = asyncio.create_task(heal_later())
        except RouteError as exc:
            error = exc
        ended = time.monotonic()
    if healer:
        await healer
    return deltas, error, ended - (cut_at or ended)


@pytest.mark.parametrize("victim", ["worker-0", "worker-1"])
@pytest.mark.parametrize("mode", ["hold", "cut"])
def test_link_partitioned_2s_mid_decode_loses_and_repeats_nothing(star25, reference, victim, mode):
    ids = reference.tokenizer.encode(PROMPT)
    n = 32
    deltas, error, _ = asyncio.run(
        asyncio.wait_for(partitioned_generation(star25, ids, victim, mode, 2.0, n), 120)  # never hangs
    )
    assert [d.index for d in deltas] == list(range(len(deltas)))  # nothing repeated, nothing skipped
    if error is not None:  # the other acceptable outcome: an explicit error naming node and phase
        assert error.node_id and error.phase in ("decode", "prefill"), error
        pytest.fail(f"the session ended on a 2 s partition ({mode}): {error.reason} at {error.node_id}")
    assert [d.token_id for d in deltas] == reference(ids, n)
    assert deltas[-1].finished


def test_a_ring_step_lost_on_its_way_to_a_hop_comes_again_after_the_ack_wait(star, reference):
    """The ring's next step is cut off on worker-0's link (300 ms one way down, the rest 0 ms: when
    the client has a token, the step sent with it is still on that link), as a server that dies
    mid-write loses it. The server counts it delivered: it comes again after the consumer's ack wait
    (ACK_WAIT_S), the generation ends with the undisturbed tokens, and nothing is repeated."""
    ids = reference.tokenizer.encode(PROMPT)
    n = 16
    star.shape_all(delay_ms=0.0)
    star.links.shape("worker-0", up=Shape(), down=Shape(delay_ms=300.0))

    async def scenario():
        deltas, gaps, last = [], [], time.monotonic()
        async with await NeuronClient.connect(star.link_url("client")) as c:
            async for ev in c.generate(prompt_tokens=ids, sampling=greedy(n)):
                if isinstance(ev, M.TokenDelta):
                    gaps.append(time.monotonic() - last)
                    last = time.monotonic()
                    deltas.append(ev)
                    if len(deltas) == 6:
                        await asyncio.to_thread(star.links.partition, "worker-0", "cut")
                        await asyncio.sleep(0.5)
                        await asyncio.to_thread(star.links.heal, "worker-0")
        return deltas, gaps

    try:
        deltas, gaps = asyncio.run(asyncio.wait_for(scenario(), 90))  # the client's stall timeout is 60 s
    finally:
        star.links.heal("worker-0")
        star.shape_all(delay_ms=0.0)
    assert [d.index for d in deltas] == list(range(n))
    assert [d.token_id for d in deltas] == reference(ids, n)
    # the step was really lost: the next token waited for the redelivery, not for a link of 300 ms
    assert max(gaps[6:]) >= ACK_WAIT_S * 0.5, gaps
    print(f"the lost step came again: the next token after {max(gaps[6:]):.1f}s (ack wait {ACK_WAIT_S:.0f}s)")


def test_100ms_of_jitter_on_every_link_does_not_fail_a_session(star25, reference):
    star25.shape_all(delay_ms=DELAY_MS, jitter_ms=100.0)
    try:
        ids = reference.tokenizer.encode(PROMPT)
        assert asyncio.run(asyncio.wait_for(tokens_of(star25.link_url("client"), ids), 300)) == reference(ids, N_TOKENS)
    finally:
        star25.shape_all(delay_ms=DELAY_MS, jitter_ms=0.0)


def test_link_partitioned_15s_fails_explicitly_in_bounded_time_then_recovers(star25, reference):
    ids = reference.tokenizer.encode(PROMPT)
    deltas, error, after = asyncio.run(
        asyncio.wait_for(partitioned_generation(star25, ids, "worker-1", "hold", 15.0, 64), 120)
    )
    assert error is not None, "a 15 s partition of the tail's link must end the session"
    assert error.reason == "node_lost" and error.node_id == "worker-1" and error.phase == "decode", error
    assert "worker-1" in str(error)
    # within the stated bound from the partition (the last heartbeat came before it): the failure never
    # waits for the lost node to answer (closing its session there is told, not asked)
    assert after <= LOSS_BOUND_S, f"node_lost came {after:.1f} s after the partition, bound {LOSS_BOUND_S:.1f} s"
    assert [d.index for d in deltas] == list(range(len(deltas)))
    # healed: the node's held traffic drained, it serves again
    assert asyncio.run(tokens_of(star25.link_url("client"), ids, 8)) == reference(ids, 8)


@pytest.mark.parametrize("routes", ["shared", "own"])
def test_eight_sessions_over_25ms_links_first_tokens_within_2s(star25, reference, routes):
    """On one route (a client's), and on a route each (as the gateway asks one per request: each
    open binds its route's consumers on every hop, and the opens must not wait for each other)."""
    topics = ["the sea", "a mountain", "the moon", "coffee", "a library", "winter", "the desert", "a violin"]
    prompts = [reference.tokenizer.encode(f"Write one sentence about {t}:") for t in topics]

    async def scenario():
        async with await NeuronClient.connect(star25.link_url("client")) as c:
            shared = await c.route()
            t0 = time.monotonic()
            firsts: list[float] = []

            async def one(ids):
                route = shared if routes == "shared" else await c.route()
                async for ev in c.generate(prompt_tokens=ids, route=route, sampling=greedy(16)):
                    if isinstance(ev, M.TokenDelta) and ev.index == 0:
                        firsts.append(time.monotonic() - t0)

            await asyncio.gather(*(one(p) for p in prompts))
            return sorted(firsts)

    firsts = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert len(firsts) == 8
    assert firsts[-1] - firsts[0] <= 2.0, f"first tokens at {[round(f, 2) for f in firsts]} s"


def test_routes_use_the_replica_behind_the_short_link_then_the_other_when_it_dies(smollm2_path, tmp_path, reference):
    """Two replicas of the tail behind 5 ms and 80 ms links: the tracker's pings see the difference."""
    swarm = StarSwarm(smollm2_path, ranges=[(0, 19), (19, 30), (19, 30)], delay_ms=0.0, workdir=tmp_path)
    with swarm:
        swarm.shape_all(["worker-1"], delay_ms=5.0)
        swarm.shape_all(["worker-2"], delay_ms=80.0)
        client_url = swarm.link_url("client")

        async def rtts() -> dict[str, float | None]:
            async with await NeuronClient.connect(client_url) as c:
                return {n.node_id: n.rtt_ms for n in (await c.coverage(swarm.preset)).nodes if n.alive}

        async def tails(k: int) -> list[str]:
            async with await NeuronClient.connect(client_url) as c:
                return [(await c.route(swarm.preset)).hops[-1].node_id for _ in range(k)]

        deadline = time.monotonic() + 60
        while True:  # the tracker pings its nodes every few seconds: wait until both tails are measured
            seen = asyncio.run(rtts())
            if seen.get("worker-1") and seen.get("worker-2") and seen["worker-2"] > seen["worker-1"] + 100:
                break
            assert time.monotonic() < deadline, f"round trips not measured: {seen}"
            time.sleep(1)
        assert asyncio.run(tails(3)) == ["worker-1"] * 3  # 2 x 75 ms more per token outweighs the load
        swarm.kill("worker-1")
        deadline = time.monotonic() + 30
        while (tail := asyncio.run(tails(1))[0]) != "worker-2":
            assert time.monotonic() < deadline, f"routes still end at {tail}"
            time.sleep(1)
        ids = reference.tokenizer.encode(PROMPT)
        assert asyncio.run(tokens_of(client_url, ids)) == reference(ids, N_TOKENS)


# ------------------------------------------------------------------------------ regions


@pytest.fixture(scope="module")
def regions(smollm2_path, tmp_path_factory):
    s = RegionSwarm(
        smollm2_path,
        2,
        regions=("a", "b", "c"),
        worker_regions=["a", "b"],
        delay_ms=DELAY_MS,
        workdir=tmp_path_factory.mktemp("regions"),
    )
    s.start()
    yield s
    s.stop()


async def meta_leader_to(swarm: RegionSwarm, cluster: str) -> str:
    """Move the supercluster's JetStream meta leader into ``cluster`` (system account); its name."""
    nc = await connect(swarm.system_url(swarm.home))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            leader = await asyncio.to_thread(swarm.meta_leader)
            if leader == f"nats-{cluster}":
                return leader
            try:
                await nc.request(
                    "$JS.API.META.LEADER.STEPDOWN", json.dumps({"placement": {"cluster": cluster}}).encode(), timeout=10
                )
            except Exception:
                pass  # no leader for a moment: ask again
            await asyncio.sleep(2)
    finally:
        await nc.close()
    raise AssertionError(f"the meta leader never moved to {cluster}")


def test_regions_generate_correctly_and_survive_losing_a_region_without_hops(regions, reference):
    ids = reference.tokenizer.encode(PROMPT)
    n = 40
    assert asyncio.run(tokens_of(regions.region_url("a"), ids, 12)) == reference(ids, 12)
    # the hardest region to lose: the one leading the JetStream meta group of the supercluster
    assert asyncio.run(meta_leader_to(regions, "c")) == "nats-c"

    async def scenario():
        tokens = []
        async with await NeuronClient.connect(regions.region_url("a")) as c:
            route = await c.route()
            assert {h.node_id for h in route.hops} == {"worker-0", "worker-1"}  # nothing of it in region c
            async for ev in c.generate(prompt_tokens=ids, route=route, sampling=greedy(n)):
                if isinstance(ev, M.TokenDelta):
                    tokens.append(ev.token_id)
                    if len(tokens) == 8:
                        await asyncio.to_thread(regions.lose_region, "c")
        return tokens

    assert asyncio.run(asyncio.wait_for(scenario(), 180)) == reference(ids, n)
    # after the loss: a new session (new consumers: the meta group re-elected its leader in a or b)
    assert asyncio.run(asyncio.wait_for(tokens_of(regions.region_url("b"), ids, 12), 180)) == reference(ids, 12)
