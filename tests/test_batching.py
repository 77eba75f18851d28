"""Cross-session batching: concurrent sessions share backend calls and keep their own KV."""

from __future__ import annotations

import asyncio

import pytest

from neuron_bus import messages as M
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.natsserver import free_port
from neuron_bus.worker.runner import INLINE_ALONE_S
from tests.prom import counter, metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [
    "The history of the printing press",
    "Recipe: a simple tomato soup. Ingredients:",
    "def fibonacci(n):",
    "Les montagnes des Alpes sont",
]


def test_concurrent_sessions_batch_decode_and_match_their_solo_runs(smollm2_path, tmp_path):
    from workers.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_path)
    prompts = [tok.encode(p) for p in PROMPTS]
    sampling = M.SamplingParams(max_tokens=32, ignore_eos=True)
    ports = [free_port(), free_port()]
    swarm = LocalSwarm(
        smollm2_path, 2, workdir=tmp_path, worker_extra={i: ["--metrics-port", str(p)] for i, p in enumerate(ports)}
    )

    async def one(client, ids):
        return (await client.complete(prompt_tokens=ids, sampling=sampling)).tokens

    async def solo():
        async with await NeuronClient.connect(swarm.url) as c:
            return [await one(c, ids) for ids in prompts]

    async def together():
        async with await NeuronClient.connect(swarm.url) as c:
            return await asyncio.gather(*(one(c, ids) for ids in prompts))

    def quick(port):  # decode calls that took at most INLINE_ALONE_S
        return metric(port, "neuron_backend_call_seconds_bucket", phase="decode", le=str(INLINE_ALONE_S))

    with swarm:
        alone = asyncio.run(solo())
        calls0 = counter(ports[1], "neuron_backend_call_seconds_count", "decode")
        slow0 = calls0 - quick(ports[1])
        steps0 = counter(ports[1], "neuron_tokens_total", "decode")
        inline0 = counter(ports[1], "neuron_backend_inline_calls_total", "decode")
        both = asyncio.run(together())
        calls = counter(ports[1], "neuron_backend_call_seconds_count", "decode") - calls0
        steps = counter(ports[1], "neuron_tokens_total", "decode") - steps0
        inline = counter(ports[1], "neuron_backend_inline_calls_total", "decode") - inline0
        stages = {
            s: metric(ports[1], "neuron_step_seconds_total", phase="decode", stage=s)
            for s in ("wait", "admit", "compute", "advance", "send")
        }
        busy = counter(ports[1], "neuron_backend_call_seconds_sum", "decode")
    assert list(both) == alone
    assert steps == 4 * 31  # every decode step of every session went through the tail
    assert calls < steps, f"{calls} backend calls for {steps} decode steps: nothing was batched"
    # llama.cpp steps take milliseconds: a session alone on the hop runs them inline (no hand-off to
    # wait for, nothing to overlap with), sessions sharing the hop on the backend thread. A call goes
    # to the thread only after one over INLINE_ALONE_S (a busy machine preempts a few), or as the
    # worker's first decode call: each of those, and nothing else, may cost one inline call
    assert calls0 == 4 * 31
    assert inline0 >= calls0 - slow0 - 1, (
        f"{inline0} of the solo runs' {calls0:.0f} decode calls ran inline, though only {slow0:.0f} took over "
        f"{INLINE_ALONE_S} s"
    )
    # the loop's stages per wave (scripts/token_profile): the compute stage holds the call itself
    assert all(v > 0 for v in stages.values()), stages
    assert busy <= stages["compute"] < busy + 1.0, (busy, stages)  # the hand-offs: well under a second
    assert inline < calls / 2, f"{inline} of {calls} decode calls of sessions sharing the hop ran inline"
