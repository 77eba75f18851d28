"""Routes of no-op hops: the bus alone (what the per-hop overhead benchmark runs).

The no-op backend does no model work, so its decode calls are quicker than the hand-off to the
backend thread; the worker runs them on its event loop. Eight sessions on two hops decode in two
waves (`neuron_bus.worker.waves`), and every session still gets exactly its tokens.
"""

from __future__ import annotations

import asyncio

import pytest

from neuron_bus import messages as M
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.natsserver import free_port
from tests.prom import counter

pytestmark = [pytest.mark.timeout(300)]


def test_noop_route_decodes_inline_in_waves(smollm2_path, tmp_path):
    ports = [free_port(), free_port()]
    swarm = LocalSwarm(
        smollm2_path,
        2,
        backend="noop",
        workdir=tmp_path,
        worker_extra={i: ["--metrics-port", str(p), "--max-sessions", "8"] for i, p in enumerate(ports)},
    )
    n_tokens = 40
    sampling = M.SamplingParams(max_tokens=n_tokens, ignore_eos=True)

    async def run():
        async with await NeuronClient.connect(swarm.url) as c:
            solo = await c.complete(prompt_tokens=list(range(1, 17)), sampling=sampling)
            together = await asyncio.gather(
                *(c.complete(prompt_tokens=list(range(1, 17 + i)), sampling=sampling) for i in range(8))
            )
            return solo, together

    with swarm:
        solo, together = asyncio.run(run())
        calls = [counter(p, "neuron_backend_call_seconds_count") for p in ports]
        steps = [counter(p, "neuron_tokens_total") for p in ports]
        inline = [counter(p, "neuron_backend_inline_calls_total") for p in ports]
    # the no-op tail's logits make token 0 the greedy pick, every time
    assert solo.tokens == [0] * n_tokens
    assert [r.tokens for r in together] == [[0] * n_tokens] * 8
    assert all(r.finish_reason == "length" for r in together)
    assert steps == [9 * (n_tokens - 1)] * 2  # every decode step passed both hops once
    # decode calls ran on the event loop (the first one, on the thread, showed they are quick), except
    # while the backend thread had other work (opening a session, a prefill chunk)
    assert all(c / 2 < i <= c for i, c in zip(inline, calls)), (inline, calls)
    assert all(c < s for c, s in zip(calls, steps)), (
        f"the eight sessions' steps were never batched: {calls} calls, {steps} steps"
    )
