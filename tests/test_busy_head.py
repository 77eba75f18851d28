"""A head busy computing a prompt (slowed by 2 s a call), on a real route (real processes, real bus):
the prompts waiting for it take turns in the order it opened their sessions, not in the order
their chunks reached it; a new request's prompt is tokenized at once, not after the compute."""

from __future__ import annotations

import asyncio
import time

import pytest

from neuron_bus import messages as M
from neuron_bus.client import NeuronClient
from neuron_bus.generation import GenerationRun
from neuron_bus.local_swarm import LocalSwarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CHUNK = 180  # two chunks of one prefill batch (512 rows), not three
SAMPLING = M.SamplingParams(max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    with LocalSwarm(
        smollm2_path, 2, workdir=tmp_path_factory.mktemp("busy"), worker_extra={0: ["--slow-ms", "2000"]}
    ) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def text(smollm2_path) -> list[int]:
    from workers.tokenizer import Tokenizer

    return Tokenizer(smollm2_path).encode("Waves roll over the quiet harbour at dawn. " * 300)


class HeldRun(GenerationRun):
    """A generation that opens its session on every hop, then holds its prompt until released."""

    def __init__(self, client: NeuronClient, route: M.RouteAssignment, ids: list[int], chunk: int):
        super().__init__(
            client, sampling=SAMPLING, model_preset=route.model_preset, wire_dtype="f32", encoding="raw",
            chunk_size=chunk, policy="public", route=route, prompt=None, messages=None, prompt_tokens=ids,
            prefill_retries=0, prefix_reuse=False,
        )  # fmt: skip
        self.opened_everywhere, self.release, self.sent = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def _send_prompt(self, tokens: list[int], start: int = 0) -> None:
        self.opened_everywhere.set()
        await self.release.wait()
        await super()._send_prompt(tokens, start)
        self.sent.set()


async def follow(run: HeldRun, name: str, log: list[tuple[float, str, str]]) -> None:
    """Note when the tail reports the session's first prompt chunk computed, and its first token."""
    seen = False
    async for ev in run.events():
        if isinstance(ev, M.GenerationTelemetry) and ev.prefill_tokens_done >= CHUNK and not seen:
            seen = True
            log.append((time.monotonic(), name, "chunk"))
        elif isinstance(ev, M.TokenDelta) and ev.index == 0:
            log.append((time.monotonic(), name, "token"))


async def keep_busy(
    c: NeuronClient, route: M.RouteAssignment, ids: list[int], log: list
) -> tuple[HeldRun, asyncio.Task]:
    """A session whose one chunk of 500 positions the head takes at once (nothing else is queued)."""
    busy = HeldRun(c, route, ids, 500)
    task = asyncio.create_task(follow(busy, "busy", log))
    await busy.opened_everywhere.wait()
    busy.release.set()
    await busy.sent.wait()
    await asyncio.sleep(1.0)  # in the head's compute call: 2 s of sleep, then the chunk
    return busy, task


def test_a_busy_head_computes_waiting_prompts_in_the_order_it_opened_them(swarm, text):
    """Sessions a, b, c, d open one after another; then, while the head computes another prompt
    (slowed by 2 s a call), their prompts (two chunks each) reach it in the reverse order, d's
    first. The head takes two chunks a batch: a's and b's, again a's and b's (their first tokens),
    then c's and d's. Taken in arrival order (`next_prefill` given no turns, checked) the first
    batch was d's and c's, and a and b reached their first tokens last."""
    prompts = {name: text[k : k + 2 * CHUNK] for k, name in enumerate("abcd")}

    async def scenario() -> list[tuple[float, str, str]]:
        log: list[tuple[float, str, str]] = []
        async with await NeuronClient.connect(swarm.url) as c:
            route = await c.route(swarm.preset)
            runs = {name: HeldRun(c, route, ids, CHUNK) for name, ids in prompts.items()}
            tasks = []
            for name, run in runs.items():  # the hops open them in this order (an open waits out a compute call)
                tasks.append(asyncio.create_task(follow(run, name, log)))
                await run.opened_everywhere.wait()
            _, busy = await keep_busy(c, route, text[1000:1500], log)  # while the others' prompts arrive
            tasks.append(busy)
            for run in reversed(runs.values()):  # d's chunks reach the head first, a's last
                run.release.set()
                await run.sent.wait()
            await asyncio.wait_for(asyncio.gather(*tasks), 300)
        return sorted(log)

    log = asyncio.run(scenario())
    order = [(name, what) for _, name, what in log if name in "abcd"]
    assert sorted(order) == sorted((n, w) for n in "abcd" for w in ("chunk", "token")), order
    first_of_later = min(order.index((n, "chunk")) for n in "cd")
    assert {n for n, w in order[:first_of_later]} == {"a", "b"}, order
    assert all(order.index((n, "token")) < first_of_later for n in "ab"), order


def test_a_busy_head_tokenizes_a_new_prompt_without_waiting_for_its_compute(swarm, text):
    """While the head computes a chunk (3 s and more to go), a new request's prompt is tokenized
    there: the reply comes while the chunk is still uncomputed (the session's position at the head
    is 0). On the backend thread, as before, the tokenizing waited for the compute call to end."""

    async def scenario() -> tuple[M.TokenizeReply, list[int]]:
        async with await NeuronClient.connect(swarm.url) as c:
            route = await c.route(swarm.preset)
            head = route.hops[0].node_id
            busy, task = await keep_busy(c, route, text[1500:2000], [])
            reply = await c.control(head, M.TokenizeRequest(text="Tell me about harbours."))
            held = (await c.sessions(head)).sessions
            positions = [s.position for s in held if s.session_id == busy.session_id]
            await asyncio.wait_for(task, 300)
        return reply, positions

    reply, positions = asyncio.run(scenario())
    assert reply.tokens and positions == [0]
