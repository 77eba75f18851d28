"""Load: 16 concurrent sessions through one 2-hop route (real processes), nothing lost, each
greedy output equal to the same prompt's solo run."""

from __future__ import annotations

import asyncio
import json

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
    assert all(sum(r.rejected.values()) == 0 for r in reports), [
        r.rejected for r in reports
    ]  # nothing dropped or refused on the way


@pytest.fixture(scope="module")
def eight_slot_swarm(smollm2_path, tmp_path_factory):
    """A KV pool of 8 sessions of 256 positions per worker (its default memory takes many more of
    these short sessions: workers/kv_pool.py), and a gateway."""
    from neuron_bus.natsserver import free_port

    extra = ["--n-ctx", "256", "--max-sessions", "8"]
    s = LocalSwarm(
        smollm2_path, 2, workdir=tmp_path_factory.mktemp("queue"), gateway_port=free_port(),
        worker_extra={0: extra, 1: extra},
    )  # fmt: skip
    s.start()
    yield s
    s.stop()


def test_twenty_four_requests_on_eight_slots_all_finish_with_their_solo_output_the_rest_queued(eight_slot_swarm):
    """Issue 18: three times as many concurrent requests as a worker has KV slots, through the gateway."""
    import aiohttp

    url = eight_slot_swarm.gateway_url + "/v1/completions"
    prompts = [f"Tell me about {s}." for s in SUBJECTS + SUBJECTS[:8]]

    async def one(session: aiohttp.ClientSession, prompt: str) -> tuple[str, list[str]]:
        body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": N_TOKENS, "stream": True}
        text, phases, finish = [], [], None
        async with session.post(url, json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith(": telemetry "):
                    t = json.loads(line[len(": telemetry ") :])
                    phases.append((t["phase"], t.get("queue_position")))
                elif line.startswith("data: {"):
                    chunk = json.loads(line[len("data: ") :])
                    assert "error" not in chunk, chunk
                    text.append(chunk["choices"][0]["text"])
                    finish = chunk["choices"][0]["finish_reason"] or finish
        assert finish in ("stop", "length"), (prompt, finish)
        return "".join(text), phases

    async def scenario():
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            solo = [await one(session, p) for p in prompts[:16]]
            together = await asyncio.gather(*(one(session, p) for p in prompts))
            return solo, together

    solo, together = asyncio.run(scenario())
    texts = [t for t, _ in together]
    alone = [t for t, _ in solo]
    assert texts == alone + alone[:8]  # each its solo output (greedy), queued or not
    queued = [p for _, p in together if any(ph == "queued" and pos is not None for ph, pos in p)]
    assert len(queued) >= 24 - 8 - 2  # at most 8 sessions fit at once: the others waited their turn
    for phases in queued:  # a queued request hears its place in the queue before anything else happens
        first = next(i for i, (ph, pos) in enumerate(phases) if ph == "queued" and pos is not None)
        assert all(ph in ("queued", "loading") for ph, _ in phases[:first])
