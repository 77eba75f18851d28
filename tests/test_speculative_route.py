"""Speculative ring steps on a real route: nats-server, tracker and two SmolLM2 worker processes
(one thread each). The workers send every draft they find (``--draft-policy all``: the most
rollbacks), so identical output here is identical output under any budget.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from neuron_bus import codec
from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.routes import hop_header

pytestmark = pytest.mark.timeout(900)

PROMPTS = [  # repetitive text (code to edit, text to quote) and free text
    "Rename the variable x to count in this code:\ndef f(x):\n    x = x + 1\n    return x * x\n",
    "Repeat after me exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "Summarize, quoting the key sentence: 'The meeting is moved to Friday at noon.' Summary: '",
    "List the numbers: 1, 2, 3, 4, 5, 6, 7, 8,",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "Write a haiku about autumn leaves:",
    "Translate to French: good morning, my friend.",
    "What is the boiling point of water?",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\nclass Vector:\n",
    "Fix the typo: 'Teh cat sat on teh mat.' Fixed: '",
    "a b c a b c a b c a b",
    "Explain photosynthesis in one sentence.",
    "The three primary colors are",
    "SELECT name FROM users WHERE id = 1;\nSELECT name FROM users WHERE id = 2;\nSELECT",
    "My favourite food is",
    "Q: What is 2 + 2? A: 4. Q: What is 3 + 3? A: 6. Q: What is 4 + 4? A:",
    "import numpy as np\nimport pandas as pd\nimport",
    "The weather today is sunny and warm, and tomorrow",
]
SEEDED = dict(temperature=0.8, top_k=40, top_p=0.95, seed=1234)


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    extra = ["--draft-policy", "all", "--max-sessions", "4"]
    with LocalSwarm(smollm2_path, 2, workdir=tmp_path_factory.mktemp("spec"), worker_extra={0: extra, 1: extra}) as s:
        yield s


async def _generate(client: NeuronClient, ids: list[int], sampling: M.SamplingParams, speculative: int):
    """The tokens of one generation and its last telemetry."""
    tokens: list[int] = []
    last = None
    async for ev in client.generate(prompt_tokens=ids, sampling=sampling, speculative=speculative):
        if isinstance(ev, M.TokenDelta):
            tokens.append(ev.token_id)
        else:
            last = ev
    return tokens, last


def test_greedy_output_with_speculation_equals_plain_for_20_prompts(swarm, reference):
    tok = reference.tokenizer
    sampling = M.SamplingParams(max_tokens=32, ignore_eos=True)

    async def scenario():
        async with await NeuronClient.connect(swarm.url) as c:
            out = []
            for text in PROMPTS:
                ids = tok.encode(text)
                plain, _ = await _generate(c, ids, sampling, 0)
                spec, telemetry = await _generate(c, ids, sampling, 6)
                out.append((ids, plain, spec, telemetry))
            return out

    results = asyncio.run(scenario())
    for (_, plain, spec, _), text in zip(results, PROMPTS):
        assert spec == plain, f"speculative output differs for {text!r}"
        assert len(spec) == 32
    assert results[0][1] == reference(results[0][0], 32)  # and plain is the single process's output
    accepted = [t.accepted_draft_tokens for _, _, _, t in results]
    drafted = [t.draft_tokens for _, _, _, t in results]
    assert sum(accepted) > 100 and sum(drafted) > sum(accepted)  # drafts were kept, and dropped
    assert sum(1 for a in accepted if a > 0) >= 15


def test_seeded_sampling_with_speculation_repeats_itself_and_plain_decoding(swarm, reference):
    tok = reference.tokenizer
    sampling = M.SamplingParams(max_tokens=40, ignore_eos=True, **SEEDED)

    async def scenario():
        async with await NeuronClient.connect(swarm.url) as c:
            out = []
            for text in PROMPTS[:4]:
                ids = tok.encode(text)
                runs = [await _generate(c, ids, sampling, 6) for _ in range(2)]
                plain, _ = await _generate(c, ids, sampling, 0)
                out.append(([r[0] for r in runs], plain, runs[0][1]))
            return out

    results = asyncio.run(scenario())
    for (first, second), plain, telemetry in results:
        assert first == second == plain
        assert telemetry.draft_tokens > 0
    greedy = [reference(tok.encode(text), 40) for text in PROMPTS[:4]]
    assert any(plain != g for (_, plain, _), g in zip(results, greedy))  # sampled, not greedy


def test_a_step_of_k_positions_with_a_wrong_position_is_refused_before_model_work(swarm):
    async def scenario():
        async with await NeuronClient.connect(swarm.url) as c:
            route = await c.route("smollm2-135m")
            sid = f"spec-victim-{np.random.default_rng().integers(1 << 30)}"
            errors: list[M.SessionError] = []

            async def on_error(msg):
                errors.append(M.decode(msg.data, M.SessionError))

            sub = await c.nc.subscribe(S.session_error(c.owner, sid), cb=on_error)
            sampling = M.SamplingParams(max_tokens=1, ignore_eos=True)  # the prompt's one token, then done
            for i, hop in enumerate(route.hops):
                req = M.SessionOpen(
                    session_id=sid, route=route, hop_index=i, prompt_tokens=4, n_ctx=64, sampling=sampling,
                    speculative=4, prompt=[1, 2, 3, 4] if i == 1 else None,
                )  # fmt: skip
                await c.control(hop.node_id, req)
            js = c.nc.jetstream()
            h, body = codec.encode(hop_header(route, 0, sid, 0, "prefill", 0, "i32"), np.array([1, 2, 3, 4], np.int32))
            await js.publish(S.hop_input(route.hops[0].node_id, route.route_id, 0, "prefill", sid), body, headers=h)
            for _ in range(200):  # the prompt through both hops: both now expect a decode step at 4 (seq 1)
                report = await c.sessions(route.hops[1].node_id)
                if any(s.session_id == sid and s.position == 4 for s in report.sessions):
                    break
                await asyncio.sleep(0.05)
            before = [await c.sessions(h.node_id) for h in route.hops]
            for hop_index, position, rows in ((0, 6, 3), (0, 4, 6), (1, 5, 3)):  # a gap, too many drafts, a gap
                dtype: M.WireDtype = "i32" if hop_index == 0 else "f32"
                x = np.ones(rows, np.int32) if hop_index == 0 else np.zeros((rows, 576), np.float32)
                h, body = codec.encode(hop_header(route, hop_index, sid, position, "decode", 1, dtype), x)
                subject = S.hop_input(route.hops[hop_index].node_id, route.route_id, hop_index, "decode")
                await js.publish(subject, body, headers=h)
            for _ in range(200):
                if len(errors) >= 3:
                    break
                await asyncio.sleep(0.05)
            after = [await c.sessions(h.node_id) for h in route.hops]
            await sub.unsubscribe()
            for hop in route.hops:
                await c.control(hop.node_id, M.SessionClose(session_id=sid, route_id=route.route_id))
            return route, before, after, errors

    route, before, after, errors = asyncio.run(scenario())
    assert [a.backend_forward_calls for a in after] == [b.backend_forward_calls for b in before]  # no model work
    grew = [{k: a.rejected.get(k, 0) - b.rejected.get(k, 0) for k in a.rejected} for a, b in zip(after, before)]
    assert grew[0].get("position_gap") == 1 and grew[0].get("wrong_phase") == 1 and grew[1].get("position_gap") == 1
    by_node = {e.node_id: e for e in errors}
    assert len(errors) == 3 and all(not e.fatal for e in errors)
    for hop in route.hops:  # each refusal names the node that refused
        assert by_node[hop.node_id].message.startswith(f"{hop.node_id}: rejected message")
    assert any("1 to 5 positions" in e.message for e in errors)
