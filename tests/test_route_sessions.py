"""Route sessions over JetStream: real nats-server, real tracker and worker processes, SmolLM2."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import numpy as np
import pytest

from neuron_bus import codec
from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm, cli
from neuron_bus.natsserver import free_port
from neuron_bus.routes import hop_header
from tests.prom import metric

pytestmark = pytest.mark.timeout(600)

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    ports = [free_port(), free_port()]
    s = LocalSwarm(
        smollm2_path,
        2,
        workdir=tmp_path_factory.mktemp("swarm"),
        worker_extra={i: ["--metrics-port", str(p)] for i, p in enumerate(ports)},
    )
    s.metrics_ports = ports
    s.start()
    yield s
    s.stop()


def run(coro):
    return asyncio.run(coro)


async def complete(url: str, **kw) -> object:
    async with await NeuronClient.connect(url) as c:
        return await c.complete(**kw)


def test_route_output_equals_single_process_full_model(swarm, reference):
    ids = reference.tokenizer.encode(PROMPT)
    g = run(
        complete(swarm.url, prompt_tokens=ids, sampling=M.SamplingParams(max_tokens=24, ignore_eos=True), chunk_size=4)
    )
    assert len(g.route.hops) == 2
    assert g.tokens == reference(ids, 24)
    assert g.text == reference.tokenizer.decode(g.tokens)


def test_bf16_wire_and_zstd_run_the_same_route(swarm, reference):
    ids = reference.tokenizer.encode(PROMPT)
    g = run(
        complete(
            swarm.url,
            prompt_tokens=ids,
            wire_dtype="bf16",
            encoding="zstd",
            sampling=M.SamplingParams(max_tokens=8, ignore_eos=True),
        )
    )
    assert g.route.wire_dtype == "bf16" and g.route.encoding == "zstd"
    assert len(g.tokens) == 8
    assert g.tokens[:2] == reference(ids, 2)  # bf16 keeps the first greedy choices on a short prompt


def decode_seam(swarm) -> tuple[float, float]:
    port = swarm.metrics_ports[0]
    return (
        metric(port, "neuron_seam_bytes_total", phase="decode", direction="out"),
        metric(port, "neuron_seam_messages_total", phase="decode", direction="out"),
    )


@pytest.mark.slow
def test_decode_seam_bytes_are_hidden_size_whatever_the_prompt_length(swarm, reference):
    """A 4K prompt is prefilled once; then every decode step moves one position per seam."""
    hidden = 576
    per_prompt = {}
    for n_prompt in (256, 4096):
        ids = (reference.tokenizer.encode("The sea is wide and deep. " * 800))[:n_prompt]
        assert len(ids) == n_prompt
        port = swarm.metrics_ports[0]
        pre_b = metric(port, "neuron_seam_bytes_total", phase="prefill", direction="out")
        dec_b, dec_m = decode_seam(swarm)
        g = run(
            complete(
                swarm.url, prompt_tokens=ids, sampling=M.SamplingParams(max_tokens=101, ignore_eos=True), chunk_size=512
            )
        )
        assert len(g.tokens) == 101
        # the prompt crossed the seam exactly once
        assert (
            metric(port, "neuron_seam_bytes_total", phase="prefill", direction="out") - pre_b == n_prompt * hidden * 4
        )
        dec_b2, dec_m2 = decode_seam(swarm)
        assert dec_m2 - dec_m == 100  # 100 decode steps after the first token
        per_prompt[n_prompt] = (dec_b2 - dec_b) / (dec_m2 - dec_m)
    assert per_prompt[256] == per_prompt[4096] == hidden * 4


def test_wrong_route_or_session_is_rejected_before_model_work(swarm, reference):
    async def scenario():
        async with await NeuronClient.connect(swarm.url) as c:
            route = await c.route("smollm2-135m")
            sid = "victim" + str(int(time.time() * 1000))
            errors: list[M.SessionError] = []

            async def on_error(msg):
                errors.append(M.decode(msg.data, M.SessionError))

            sub = await c.nc.subscribe(S.session_error(c.owner, sid), cb=on_error)
            for i, hop in enumerate(route.hops):
                await c.control(
                    hop.node_id, M.SessionOpen(session_id=sid, route=route, hop_index=i, prompt_tokens=4, n_ctx=512)
                )
            tail = route.hops[1].node_id
            before = await c.sessions(tail)
            js = c.nc.jetstream()
            # a decode step for the real session, but stamped with another route
            forged = hop_header(route, 1, sid, 0, "prefill", 0, "f32")
            forged.route_id = "someotherroute"
            h, body = codec.encode(forged, np.zeros((4, 576), dtype=np.float32))
            await js.publish(S.hop_input(tail, route.route_id, 1, "prefill", sid), body, headers=h)
            # a step for a session that does not exist
            ghost = hop_header(route, 1, "ghost" + sid, 0, "prefill", 0, "f32")
            h, body = codec.encode(ghost, np.zeros((4, 576), dtype=np.float32))
            await js.publish(S.hop_input(tail, route.route_id, 1, "prefill", "ghost" + sid), body, headers=h)
            # garbage on the same subject
            await js.publish(
                S.hop_input(tail, route.route_id, 1, "prefill", sid),
                b"\x00garbage",
                headers={codec.HEADER: json.dumps({"session_id": sid})},  # names its session, and nothing else
            )
            for _ in range(100):
                after = await c.sessions(tail)
                if sum(after.rejected.values()) - sum(before.rejected.values()) >= 3 and len(errors) >= 2:
                    break
                await asyncio.sleep(0.05)
            await sub.unsubscribe()
            for hop in route.hops:
                await c.control(hop.node_id, M.SessionClose(session_id=sid, route_id=route.route_id))
            return before, after, errors

    before, after, errors = run(scenario())
    assert after.backend_forward_calls == before.backend_forward_calls  # no model work
    grew = {k: after.rejected.get(k, 0) - before.rejected.get(k, 0) for k in after.rejected}
    assert grew.get("wrong_route") == 1 and grew.get("unknown_session") == 1 and grew.get("missing_header") == 1
    assert {e.code for e in errors} >= {"wrong_route", "missing_header"}
    assert all(not e.fatal and e.node_id == "worker-1" for e in errors)
    # the route keeps serving other sessions
    ids = reference.tokenizer.encode(PROMPT)
    g = run(complete(swarm.url, prompt_tokens=ids, sampling=M.SamplingParams(max_tokens=6, ignore_eos=True)))
    assert g.tokens == reference(ids, 6)


def sessions_json(url: str, node: str) -> dict:
    out = subprocess.run(
        cli() + ["sessions", node, "--nats", url, "--json"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_sessions_report_cache_bytes_and_close_frees_them(swarm):
    async def open_session():
        async with await NeuronClient.connect(swarm.url) as c:
            route = await c.route("smollm2-135m")
            sid = "cached" + str(int(time.time() * 1000))
            opened = []
            for i, hop in enumerate(route.hops):
                opened.append(
                    await c.control(
                        hop.node_id, M.SessionOpen(session_id=sid, route=route, hop_index=i, prompt_tokens=8, n_ctx=512)
                    )
                )
            return route, sid, opened

    async def close_session(route, sid):
        async with await NeuronClient.connect(swarm.url) as c:
            return [
                await c.control(h.node_id, M.SessionClose(session_id=sid, route_id=route.route_id)) for h in route.hops
            ]

    route, sid, opened = run(open_session())
    for hop, ack in zip(route.hops, opened):
        report = sessions_json(swarm.url, hop.node_id)
        mine = [s for s in report["sessions"] if s["session_id"] == sid]
        assert mine and mine[0]["cache_bytes"] == ack.cache_bytes > 0
    # each hop holds KV for its own layers only: the same bytes per layer on both hops, up to the
    # cells' bookkeeping every hop keeps once (llama.cpp: 12 bytes per position) and a state header
    per_layer = [o.cache_bytes / (h.layer_end - h.layer_start) for h, o in zip(route.hops, opened)]
    assert abs(per_layer[0] - per_layer[1]) < 0.002 * per_layer[0], per_layer
    closed = run(close_session(route, sid))
    assert [c.freed_bytes for c in closed] == [o.cache_bytes for o in opened]
    for hop in route.hops:
        report = sessions_json(swarm.url, hop.node_id)
        assert not [s for s in report["sessions"] if s["session_id"] == sid]
        assert report["cache_bytes_total"] == 0


def test_generate_cli_streams_json(swarm):
    out = subprocess.run(
        cli() + ["generate", PROMPT, "--nats", swarm.url, "--max-tokens", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["tokens"]) >= 1 and result["text"]
    assert result["nodes"] == ["worker-0", "worker-1"]


def test_generate_cli_without_a_bus_fails_clearly():
    out = subprocess.run(
        cli() + ["generate", "hi", "--nats", f"nats://127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert out.stderr.startswith("error:")
