"""Load: 16 concurrent sessions through one 2-hop route (real processes), nothing lost, each
greedy output equal to the same prompt's solo run."""

from __future__ import annotations

import asyncio

import pytest

from neuron_bus import messages as M
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

N_SESSIONS = 16
N_TOKENS = 12
SUBJECTS = [
    "the sea",
    "a mountain",
    "the moon",
    "coffee",
    "a library",
    "winter",
    "the desert",
    "a violin",
    "bread",
    "the river",
    "a robot",
    "autumn leaves",
    "the city",
    "a garden",
    "thunder",
    "the stars",
]


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    s = LocalSwarm(
        smollm2_path,
        2,
        workdir=tmp_path_factory.mktemp("load"),
        worker_extra={i: ["--max-sessions", str(N_SESSIONS), "--n-ctx", "256"] for i in range(2)},
    )
    s.start()
    yield s
    s.stop()


def test_sixteen_concurrent_sessions_all_complete_with_their_solo_output(swarm):
    sampling = M.SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)

    async def scenario():
        async with await NeuronClient.connect(swarm.url) as c:
            route = await c.route("smollm2-135m")
            prompts = [
                (
                    await c.control(route.hops[0].node_id, M.TokenizeRequest(text=f"Write one sentence about {s}:"))
                ).tokens
                for s in SUBJECTS
            ]
            solo = [(await c.complete(prompt_tokens=p, route=route, sampling=sampling)).tokens for p in prompts]
            together = await asyncio.gather(
                *(c.complete(prompt_tokens=p, route=route, sampling=sampling) for p in prompts)
            )
            reports = [await c.sessions(h.node_id) for h in route.hops]
            return solo, together, reports

    solo, together, reports = asyncio.run(scenario())
    assert len(together) == N_SESSIONS
    assert len({g.session_id for g in together}) == N_SESSIONS
    for s, g in zip(solo, together):
        assert len(g.tokens) == N_TOKENS and g.finish_reason == "length"
        assert g.tokens == s
    assert all(r.sessions == [] for r in reports)  # every session closed, nothing left behind
    assert all(sum(r.rejected.values()) == 0 for r in reports)  # nothing dropped or refused on the way
