"""A 3-server NATS cluster under a real swarm: replicated topology (streams, buckets and the
per-route consumers at R3), and a generation that survives the death of a server: stopped
(SIGTERM), or SIGKILLed while it leads the route's consumers; no acknowledged token is lost."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.trust.events import stored

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    s = LocalSwarm(smollm2_path, 2, workdir=tmp_path_factory.mktemp("cluster"), cluster=3)
    s.start()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def three_servers(swarm):
    """Each test starts with three servers, whatever the one before did: a test that failed before
    restarting the server it killed would leave the next one two, and its kill would take the
    quorum. The processes' last log lines are printed (pytest shows them when the test failed:
    where the route stopped)."""
    yield
    for name in swarm.procs:
        print(f"--- {name}\n{swarm.log_tail(name, 20)}")
    for srv in swarm.servers:
        if srv.proc is None or srv.proc.poll() is not None:
            srv.proc = None
            restart(srv)


def test_killing_one_server_mid_generation_the_generation_completes(swarm, reference):
    ids = reference.tokenizer.encode(PROMPT)
    n = 48

    async def scenario():
        tokens, killed = [], None
        async with await NeuronClient.connect(swarm.url) as c:
            info = await c.js.stream_info(S.STREAM_DECODE)
            assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2
            async for ev in c.generate(prompt_tokens=ids, sampling=M.SamplingParams(max_tokens=n, ignore_eos=True)):
                if isinstance(ev, M.TokenDelta):
                    tokens.append(ev.token_id)
                    if len(tokens) == 10:
                        # the hardest server to lose: the one leading the decode stream
                        leader = (await c.js.stream_info(S.STREAM_DECODE)).cluster.leader
                        killed = next(srv for srv in swarm.servers if srv.config.server_name == leader)
                        await asyncio.to_thread(killed.stop)
        return tokens, killed

    tokens, killed = asyncio.run(scenario())
    assert killed is not None and killed.proc is None
    assert tokens == reference(ids, n)


def restart(srv) -> None:
    """Bring a killed server back (same store), its streams' replicas caught up."""
    srv.start(timeout=60)

    async def caught_up() -> None:
        async with await NeuronClient.connect(srv.url) as c:
            for _ in range(120):
                info = await c.js.stream_info(S.STREAM_DECODE)
                if all(p.current for p in info.cluster.replicas or []) and len(info.cluster.replicas or []) == 2:
                    return
                await asyncio.sleep(0.5)

    asyncio.run(caught_up())


async def consumer_leaders(js, route: M.RouteAssignment) -> dict[str, tuple[str, int]]:
    """Per route consumer (its filter subject): its leader and how many replicas follow it."""
    out = {}
    for stream in (S.STREAM_PREFILL, S.STREAM_DECODE):
        for info in await js.consumers_info(stream):
            subject = info.config.filter_subject or ""
            if subject.startswith("neuron.act.") and f".{route.route_id}." in subject:  # neuron.act.<node>.<route>.…
                out[subject] = (info.cluster.leader, len(info.cluster.replicas or []))
    return out


def test_sigkill_of_the_server_leading_the_route_consumers_mid_generation_loses_no_token(swarm, reference):
    ids = reference.tokenizer.encode(PROMPT)
    n = 48

    gaps: list[float] = []

    async def scenario():
        tokens, killed, consumers = [], None, {}
        async with await NeuronClient.connect(swarm.url) as c:
            route = await c.route("smollm2-135m")
            sampling = M.SamplingParams(max_tokens=n, ignore_eos=True)
            last = time.monotonic()
            async for ev in c.generate(prompt_tokens=ids, route=route, sampling=sampling):
                if isinstance(ev, M.TokenDelta):
                    gaps.append(time.monotonic() - last)
                    last = time.monotonic()
                    tokens.append(ev.token_id)
                    session = ev.session_id
                    if len(tokens) == 10:
                        consumers = await consumer_leaders(c.js, route)
                        ring = consumers[S.hop_input(route.hops[0].node_id, route.route_id, 0, "decode")][
                            0
                        ]  # the ring's entry
                        killed = next(srv for srv in swarm.servers if srv.config.server_name == ring)
                        killed.proc.send_signal(signal.SIGKILL)  # no shutdown, no leadership handed over
                        await asyncio.to_thread(killed.proc.wait, 10)
            # every token whose publish the stream acknowledged is still there, on the survivors
            stored_deltas = [
                d async for d in stored(c.js, S.STREAM_TOKENS, S.session_tokens(c.owner, session), M.TokenDelta)
            ]
        return tokens, killed, consumers, stored_deltas

    tokens, killed, consumers, deltas = asyncio.run(scenario())
    assert killed is not None and killed.proc.returncode == -signal.SIGKILL
    assert consumers and all(followers == 2 for _, followers in consumers.values()), consumers  # R3 consumers
    assert tokens == reference(ids, n)
    assert sorted({d.index: d.token_id for d in deltas}.items()) == list(enumerate(tokens))
    print(f"SIGKILL of {killed.config.server_name}: the longest wait for a token {max(gaps[10:]):.1f}s")
