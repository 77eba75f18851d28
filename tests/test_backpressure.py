"""Backpressure: a slow hop stalls its upstream instead of any buffer growing (real processes)."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WINDOW = 2


def prompt(tokenizer, n: int) -> list[int]:
    return tokenizer.encode("Waves roll over the quiet harbour at dawn. " * (n // 6 + 8))[:n]


async def watch_generation(swarm: LocalSwarm, ids: list[int], chunk: int, pids: dict[str, int]):
    """Run one generation; meanwhile sample per-subject queue depth and each hop's RSS from the
    moment the hop has computed the session's first chunk (its KV pool makes a lane for the
    session at open, and the lane's compute buffers are first touched by that chunk: neither is
    the prompt)."""
    depth: dict[str, int] = {}
    in_flight: dict[str, int] = {}  # most prefill messages a hop held un-acknowledged
    rss: dict[str, list[int]] = {name: [] for name in pids}
    opened: set[str] = set()
    async with await NeuronClient.connect(swarm.url) as client:
        js = client.nc.jetstream()
        route = await client.route(swarm.preset)
        gen = asyncio.create_task(
            client.complete(
                prompt_tokens=ids,
                route=route,
                chunk_size=chunk,
                sampling=M.SamplingParams(max_tokens=2, ignore_eos=True),
                # nothing kept at close: with reuse the hops copy the prompt's KV into their prefix
                # caches (memory under --prefix-cache's budget, not prefill buffering; the head's RSS
                # grew by its KV twice, 115 MB, when the sampling caught the close)
                prefix_reuse=False,
            )
        )
        while not gen.done():
            info = await js.stream_info(S.STREAM_PREFILL, subjects_filter=f"neuron.act.*.{route.route_id}.>")
            for subject, count in (info.state.subjects or {}).items():
                depth[subject] = max(depth.get(subject, 0), count)
            for c in await js.consumers_info(S.STREAM_PREFILL):
                if c.config.filter_subject and route.route_id in c.config.filter_subject:
                    subject = c.config.filter_subject
                    in_flight[subject] = max(in_flight.get(subject, 0), c.num_ack_pending)
            for name, pid in pids.items():
                if name not in opened and any(x.position > 0 for x in (await client.sessions(name)).sessions):
                    opened.add(name)
                if name in opened:
                    rss[name].append(psutil.Process(pid).memory_info().rss)
            await asyncio.sleep(0.02)
        result = await gen
    return route, result, depth, in_flight, rss


def test_slow_hop_holds_its_upstream_to_the_window(smollm2_path, tmp_path):
    from workers.tokenizer import Tokenizer

    ids = prompt(Tokenizer(smollm2_path), 640)
    swarm = LocalSwarm(
        smollm2_path,
        2,
        workdir=tmp_path,
        prefill_window=WINDOW,
        worker_extra={1: ["--slow-ms", "150"]},  # the tail takes 150 ms more per chunk
    )
    with swarm:
        pids = {n: p.pid for n, p in swarm.procs.items() if n.startswith("worker")}
        started = time.monotonic()
        route, result, depth, in_flight, _ = asyncio.run(watch_generation(swarm, ids, 32, pids))  # 20 chunks
        elapsed = time.monotonic() - started
    assert len(result.tokens) == 2
    # one session: each hop's prefill input is one subject (the session's), under the hop's filter
    tail_filter = S.hop_inputs(route.hops[1].node_id, route.route_id, 1, "prefill")
    head_filter = S.hop_inputs(route.hops[0].node_id, route.route_id, 0, "prefill")
    (tail_subject,) = [s for s in depth if s.startswith(tail_filter[:-1])]
    head_depth = max((d for s, d in depth.items() if s.startswith(head_filter[:-1])), default=0)
    # the slow hop's input filled up to the window and never past it; so did the head's
    assert depth[tail_subject] == WINDOW
    assert max(depth.values()) <= WINDOW
    assert head_depth <= WINDOW
    # a hop takes what the window lets wait for it, no more: its unacknowledged chunks stay in the stream
    assert max(in_flight.values()) <= WINDOW
    # and the whole prompt waited on the slow hop (20 chunks x 150 ms), it was not buffered ahead
    assert elapsed > 20 * 0.15


def test_prefill_memory_of_every_hop_is_bounded_by_chunk_size(smollm2_path, tmp_path):
    """During a 4K prefill at most WINDOW chunks wait for a hop in the stream, those it holds
    unacknowledged among them (its MaxAckPending is the window); its RSS grows by its KV, not by
    the prompt."""
    from workers.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_path)
    swarm = LocalSwarm(smollm2_path, 2, workdir=tmp_path, prefill_window=WINDOW)
    with swarm:
        pids = {n: p.pid for n, p in swarm.procs.items() if n.startswith("worker")}
        _, result, depth, in_flight, rss = asyncio.run(watch_generation(swarm, prompt(tok, 4096), 256, pids))
    assert len(result.tokens) == 2
    assert max(depth.values()) <= WINDOW
    assert max(in_flight.values()) <= WINDOW
    # KV of a hop's layers (19 at most) for 4K positions: 2 (k, v) x 3 KV heads x 64 dims x 2 bytes (f16) per layer
    kv_bytes = 4096 * max(end - start for start, end in (w.layers for w in swarm.workers)) * 2 * 3 * 64 * 2
    for name, samples in rss.items():
        assert max(samples) - samples[0] < kv_bytes + 32 * 2**20, (name, max(samples) - samples[0])


def test_a_prompt_waiting_its_turn_behind_other_sessions_is_not_failed_as_stalled(smollm2_path, tmp_path, monkeypatch):
    """A head hop computes prompt chunks oldest first, so a session whose prompt waits behind the
    others' shows no progress for as long as they take (here several seconds: four chunks of 260
    positions, one per call, on a head slowed by 500 ms a call). The client's stall timeout, cut to
    3 s, fails a quiet route only while its nodes' heartbeats show nothing else to do; past
    WAIT_NOTICE_S the session's telemetry names the busy nodes it waits at; and the client keeps
    telling the hops that the waiting session is wanted, so they do not free it as idle: their idle
    timeout is cut to 3 s, which they announce when the session opens, and the client's keep-alives
    come as often as that needs (not every KEEP_ALIVE_EVERY_S)."""
    from neuron_bus import quiet as quiet_rule
    from workers.tokenizer import Tokenizer

    monkeypatch.setattr(quiet_rule, "STALL_TIMEOUT_S", 3.0)
    monkeypatch.setattr(quiet_rule, "WAIT_NOTICE_S", 1.0)
    ids = prompt(Tokenizer(smollm2_path), 264 + 4)
    prompts = [ids[k : k + 264] for k in range(4)]  # a chunk of 260 each: no two fit one prefill call (512)
    sampling = M.SamplingParams(max_tokens=2, ignore_eos=True)
    idle = ["--idle-timeout", "3"]
    swarm = LocalSwarm(smollm2_path, 2, workdir=tmp_path, worker_extra={0: ["--slow-ms", "500", *idle], 1: idle})

    async def one(c: NeuronClient, route, ids: list[int]) -> tuple[list[int], float, list[list[str]]]:
        """The session's tokens, the longest it went without progress, and the waiting notices it got."""
        tokens, last, quiet, notices = [], time.monotonic(), 0.0, []
        async for ev in c.generate(
            prompt_tokens=ids, route=route, sampling=sampling, chunk_size=260, prefill_retries=0
        ):
            if isinstance(ev, M.GenerationTelemetry) and ev.waiting_at:
                notices.append(ev.waiting_at)
                continue
            now = time.monotonic()
            quiet, last = max(quiet, now - last), now
            if isinstance(ev, M.TokenDelta):
                tokens.append(ev.token_id)
        return tokens, quiet, notices

    async def scenario():
        async with await NeuronClient.connect(swarm.url) as c:
            route = await c.route(swarm.preset)
            return await asyncio.gather(*(one(c, route, p) for p in prompts))

    with swarm:
        done = asyncio.run(scenario())
    assert [len(tokens) for tokens, _, _ in done] == [2, 2, 2, 2]
    assert max(quiet for _, quiet, _ in done) > quiet_rule.STALL_TIMEOUT_S  # a prompt did wait longer than that
    # and was told where it waits (the page shows it): at the head, busy with the others' prompts
    tokens, quiet, notices = max(done, key=lambda d: d[1])
    assert notices and all(n == ["worker-0"] or n == ["worker-0", "worker-1"] for n in notices), notices
    assert not any(notices for _, quiet, notices in done if quiet < quiet_rule.WAIT_NOTICE_S)
