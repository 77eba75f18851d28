"""A 3-server NATS cluster under a real swarm: replicated topology, and a generation that survives
the death of the server leading its decode stream."""

from __future__ import annotations

import asyncio

import pytest

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    s = LocalSwarm(smollm2_path, 2, workdir=tmp_path_factory.mktemp("cluster"), cluster=3)
    s.start()
    yield s
    s.stop()


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
