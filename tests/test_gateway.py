"""The gateway against a real swarm: nats-server, tracker, two SmolLM2 workers and the gateway
process (`neuron-bus gateway`, started by LocalSwarm), driven by the official openai client, a
WebSocket client, raw HTTP, a separate NATS subscriber process and the CLI."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from neuron_bus.local_swarm import LocalSwarm, cli
from neuron_bus.natsserver import free_port

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2-135m"
LONG_PROMPT = "The sea is wide and deep, and the ships sail on it every day. " * 8  # ~130 tokens: 9 chunks of 16


def start_swarm(model_path, workdir) -> LocalSwarm:
    return LocalSwarm(
        model_path, 2, workdir=workdir, gateway_port=free_port(), gateway_extra=["--chunk-size", "16"]
    ).start()


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    s = start_swarm(smollm2_path, tmp_path_factory.mktemp("gateway-swarm"))
    yield s
    s.stop()


# ---------------------------------------------------------------------------------------- helpers


class TelemetryListener:
    """A separate process subscribed to `neuron.telemetry.>` with plain nats-py, like `nats sub`."""

    SCRIPT = (
        "import asyncio, sys, nats\n"
        "async def main():\n"
        "    nc = await nats.connect(sys.argv[1])\n"
        "    async def cb(m): print(m.data.decode(), flush=True)\n"
        "    await nc.subscribe('neuron.telemetry.>', cb=cb)\n"
        "    await nc.flush()\n"
        "    print('ready', flush=True)\n"
        "    await asyncio.Event().wait()\n"
        "asyncio.run(main())\n"
    )

    def __init__(self, url: str):
        self.proc = subprocess.Popen([sys.executable, "-c", self.SCRIPT, url], stdout=subprocess.PIPE, text=True)
        self.lines: list[dict] = []
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                if line.strip() == "ready":
                    ready.set()
                elif line.strip():
                    self.lines.append(json.loads(line))

        threading.Thread(target=read, daemon=True).start()
        assert ready.wait(30), "telemetry listener did not subscribe"

    def of(self, session_id: str) -> list[dict]:
        return [t for t in self.lines if t["session_id"] == session_id]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)


def http(swarm, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(swarm.gateway_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def ws_run(url: str, request: dict, timeout: float = 120) -> list[dict]:
    """Send one request on /ws and collect messages until the final one (done or error)."""
    async with aiohttp.ClientSession() as session, session.ws_connect(url + "/ws") as ws:
        await ws.send_json(request)
        out = []
        while True:
            msg = await ws.receive_json(timeout=timeout)
            out.append(msg)
            if msg["type"] in ("done", "error"):
                return out


def ws_url(swarm) -> str:
    return swarm.gateway_url.replace("http://", "ws://")


# ---------------------------------------------------------------------------------------- OpenAI API


def test_openai_client_streams_chat_and_returns_logprobs_and_usage(swarm):
    from openai import OpenAI

    client = OpenAI(base_url=swarm.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert MODEL in [m.id for m in client.models.list()]
    messages = [{"role": "user", "content": "Name three colours."}]

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text.strip() and finish in (["stop"], ["length"])
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1

    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, logprobs=True, top_logprobs=3)
    choice = resp.choices[0]
    assert choice.message.content == text  # greedy: the same text streamed or not
    assert resp.usage.completion_tokens == len(choice.logprobs.content) >= 1
    assert resp.usage.prompt_tokens > 5  # the chat template wrapped the message
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    for entry in choice.logprobs.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the most likely

    done = client.completions.create(
        model=MODEL, prompt="The sea is", max_tokens=6, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6 == done.usage.completion_tokens
    assert "".join(lp.tokens) == done.choices[0].text and done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens == 3


def test_a_chats_next_turn_reports_the_prompt_tokens_its_route_took_from_the_prefix_caches(swarm):
    """usage.prompt_tokens_details.cached_tokens, as OpenAI reports prompt caching: 0 on a first
    turn, the positions attached from the hops' prefix caches (whole blocks) on the next ones."""
    from openai import OpenAI

    from neuron_bus.messages import PREFIX_BLOCK

    client = OpenAI(base_url=swarm.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    rules = " ".join(f"Rule {i}: answer in plain words about harbour {i} and its {i % 7} cranes." for i in range(40))
    messages = [{"role": "system", "content": rules}, {"role": "user", "content": "Which harbour is first?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert first.usage.prompt_tokens >= 2 * PREFIX_BLOCK and first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And the last?"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % PREFIX_BLOCK == 0 and 2 * PREFIX_BLOCK <= cached < second.usage.prompt_tokens, second.usage
    streamed = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens >= cached  # the same prompt: its blocks are kept


def test_streamed_completion_ends_with_done_and_carries_telemetry_comments(swarm):
    req = urllib.request.Request(
        swarm.gateway_url + "/v1/completions",
        data=json.dumps({"model": MODEL, "prompt": "The sea is", "max_tokens": 4, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        lines = [line.decode().rstrip("\n") for line in resp]
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert len(chunks) == 4 and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    phases = [json.loads(line[len(": telemetry ") :])["phase"] for line in lines if line.startswith(": telemetry ")]
    assert phases[:3] == ["queued", "loading", "prefill"]


# ---------------------------------------------------------------------------------------- WebSocket and telemetry


def test_websocket_shows_progress_tokens_tps_and_final_state_and_nats_sees_the_same(swarm):
    listener = TelemetryListener(swarm.url)
    try:
        msgs = asyncio.run(
            ws_run(
                ws_url(swarm),
                {
                    "type": "generate",
                    "prompt": LONG_PROMPT,
                    "max_tokens": 48,
                    "ignore_eos": True,
                },
            )
        )
        time.sleep(1.0)  # the tail's last telemetry reaches the listener
    finally:
        listener.stop()
    first_token = next(i for i, m in enumerate(msgs) if m["type"] == "token")
    before = [m for m in msgs[:first_token] if m["type"] == "telemetry"]
    assert [m["phase"] for m in before][:3] == ["queued", "loading", "prefill"]
    partial = [
        m for m in before if m["phase"] == "prefill" and 0 < m["prefill_tokens_done"] < m["prefill_tokens_total"]
    ]
    assert partial, "no prefill progress before the first token"
    assert [m["prefill_tokens_done"] for m in partial] == sorted(m["prefill_tokens_done"] for m in partial)

    tokens = [m for m in msgs if m["type"] == "token"]
    assert [t["index"] for t in tokens] == list(range(48))
    decode = [m for m in msgs if m["type"] == "telemetry" and m["phase"] == "decode"]
    assert any(m["rolling_tokens_per_second"] > 0 for m in decode), "no rolling tok/s during decode"
    assert all(m["active_route_nodes"] == ["worker-0", "worker-1"] for m in decode)

    final = msgs[-1]
    assert final["type"] == "done" and final["finish_reason"] == "length"
    assert final["text"] == "".join(t["text"] for t in tokens)
    assert final["usage"]["completion_tokens"] == 48 and final["usage"]["prompt_tokens"] > 100
    assert final["nodes"] == ["worker-0", "worker-1"]

    # the separate NATS process got every telemetry message the WebSocket showed, and the final one
    sid = final["session_id"]
    on_bus = listener.of(sid)
    for m in (m for m in msgs if m["type"] == "telemetry"):
        assert {k: v for k, v in m.items() if k != "type"} in on_bus
    assert on_bus[-1]["phase"] == "done" and on_bus[-1]["generated_tokens"] == 48

    # a late client attaches to the finished session: last telemetry, every token replayed, done
    late = asyncio.run(ws_run(ws_url(swarm), {"type": "attach", "session_id": sid}))
    assert late[-1]["type"] == "done" and late[-1]["text"] == final["text"]
    assert [m["index"] for m in late if m["type"] == "token"] == list(range(48))


def test_websocket_refusals_keep_the_socket_open(swarm):
    async def scenario():
        async with aiohttp.ClientSession() as session, session.ws_connect(ws_url(swarm) + "/ws") as ws:
            out = []
            for bad in (
                "{not json",
                json.dumps({"type": "generate", "model": "no-such-model", "prompt": "x"}),
                json.dumps({"type": "generate", "prompt": "x", "max_tokens": -1}),
                json.dumps({"type": "attach", "session_id": "nosuchsession"}),
            ):
                await ws.send_str(bad)
                out.append(await ws.receive_json(timeout=30))
            await ws.send_json({"type": "coverage"})
            out.append(await ws.receive_json(timeout=30))
            await ws.send_json({"type": "generate", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
            while (msg := await ws.receive_json(timeout=60))["type"] not in ("done", "error"):
                pass
            return out, msg

    out, last = asyncio.run(scenario())
    assert [(m["type"], m["status"], m["reason"]) for m in out[:4]] == [
        ("error", 400, "invalid_json"),
        ("error", 404, "model_not_found"),
        ("error", 422, "out_of_range"),
        ("error", 404, "unknown_session"),
    ]
    assert out[4]["type"] == "coverage" and out[4]["models"] == [MODEL]
    assert {n["node_id"] for n in out[4]["report"]["nodes"]} == {"worker-0", "worker-1"}
    assert last["type"] == "done" and last["usage"]["completion_tokens"] >= 1


# ---------------------------------------------------------------------------------------- bad requests


BAD = [
    ("malformed JSON", "/v1/chat/completions", b'{"model": ', 400, "invalid_json"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, "invalid_json"),
    (
        "unknown model",
        "/v1/chat/completions",
        {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]},
        404,
        "model_not_found",
    ),
    ("missing model", "/v1/completions", {"prompt": "hi"}, 400, "missing_required_parameter"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "missing_required_parameter"),
    ("max_tokens zero", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 422, "out_of_range"),
    ("max_tokens huge", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**6}, 422, "out_of_range"),
    (
        "max_tokens a string",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": "9"},
        422,
        "invalid_type",
    ),
    (
        "temperature out of range",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "temperature": 9},
        422,
        "out_of_range",
    ),
    ("n > 1", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2}, 422, "unsupported_value"),
    (
        "bad role",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
        422,
        "invalid_value",
    ),
    (
        "prompt too many characters",
        "/v1/completions",
        {"model": MODEL, "prompt": "a" * 70_000},
        413,
        "context_length_exceeded",
    ),
    (
        "prompt + max_tokens over the context",
        "/v1/completions",
        {"model": MODEL, "prompt": "The sea is wide and deep. " * 400, "max_tokens": 2000},
        413,
        "context_length_exceeded",
    ),
    ("body over 1 MiB", "/v1/completions", b'{"prompt": "' + b"a" * (1 << 20) + b'"}', 413, "request_too_large"),
]


@pytest.mark.parametrize("what,path,body,status,code", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_error_bodies(swarm, what, path, body, status, code):
    got, answer = http(swarm, path, raw=body) if isinstance(body, bytes) else http(swarm, path, body)
    assert got == status, answer
    err = answer["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == code and err["message"]
    # the gateway keeps serving
    assert http(swarm, "/healthz")[0] == 200


def test_unknown_path_and_method_get_error_bodies_and_serving_goes_on(swarm):
    assert http(swarm, "/v2/nothing") == (
        404,
        {"error": {"message": "404: Not Found", "type": "invalid_request_error", "param": None, "code": "not_found"}},
    )
    req = urllib.request.Request(swarm.gateway_url + "/v1/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=10)
    assert exc.value.code == 405 and json.loads(exc.value.read())["error"]["code"] == "method_not_allowed"
    status, answer = http(swarm, "/v1/completions", {"model": MODEL, "prompt": "The sea is", "max_tokens": 3})
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1


def test_healthz_and_metrics(swarm):
    status, health = http(swarm, "/healthz")
    assert status == 200 and health == {"status": "ok", "nats": True, "tracker": True, "models": [MODEL]}
    http(swarm, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    http(swarm, "/v1/completions", {"model": MODEL})
    text = urllib.request.urlopen(swarm.gateway_url + "/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    assert values['neuron_gateway_requests_total{endpoint="/v1/completions"}'] >= 2
    assert values['neuron_gateway_errors_total{endpoint="/v1/completions",status="400"}'] >= 1
    assert values['neuron_gateway_tokens_total{kind="completion"}'] >= 2
    assert values['neuron_gateway_tokens_total{kind="prompt"}'] >= 1
    assert values["neuron_gateway_active_generations"] == 0


# ---------------------------------------------------------------------------------------- following a session


def test_a_follower_waits_out_a_quiet_session_and_is_told_when_its_client_left(smollm2_path, tmp_path):
    """A second socket attached to a session follows it for as long as the generation runs in the
    gateway, through quiet spells (here a head that takes 3 s a call: longer than the follower's
    check), to its end; when the socket that started it leaves, the follower hears so at once
    (410 session_ended), not after a stall timeout."""
    swarm = LocalSwarm(
        smollm2_path, 2, workdir=tmp_path, gateway_port=free_port(), worker_extra={0: ["--slow-ms", "3000"]}
    ).start()
    request = {"type": "generate", "prompt": "The sea is", "max_tokens": 3, "ignore_eos": True}

    async def started(ws) -> str:
        """Start a generation on ``ws``; its session id, from its first telemetry."""
        await ws.send_json(request)
        while (m := await ws.receive_json(timeout=60))["type"] != "telemetry":
            assert m["type"] != "error", m
        return m["session_id"]

    async def follow(ws, session_id: str, timeout: float) -> list[dict]:
        await ws.send_json({"type": "attach", "session_id": session_id})
        out = []
        while (m := await ws.receive_json(timeout=timeout))["type"] not in ("done", "error"):
            out.append(m)
        return out + [m]

    async def scenario():
        async with aiohttp.ClientSession() as session:
            url = ws_url(swarm) + "/ws"
            starter, follower = await session.ws_connect(url), await session.ws_connect(url)
            sid = await started(starter)
            t0 = time.monotonic()
            followed = await follow(follower, sid, timeout=60)
            whole = time.monotonic() - t0
            while (await starter.receive_json(timeout=60))["type"] != "done":
                pass
            sid = await started(starter)
            following = asyncio.create_task(follow(follower, sid, timeout=20))
            await asyncio.sleep(1.0)
            await starter.close()  # the client that started the session leaves: its generation is closed
            t1 = time.monotonic()
            left = await following
            told = time.monotonic() - t1
            await follower.close()
            return followed, whole, left, told

    try:
        followed, whole, left, told = asyncio.run(scenario())
    finally:
        swarm.stop()
    # followed to the end through spells of 3 s without a message
    assert followed[-1]["type"] == "done", followed[-1]
    assert [m["index"] for m in followed if m["type"] == "token"] == [0, 1, 2]
    assert whole > 6, whole  # at least a prefill call and two decode calls of 3 s each
    # its client left: the follower is told within a few seconds, with what a client should do
    end = left[-1]
    assert end["type"] == "error" and (end["status"], end["reason"]) == (410, "session_ended"), left
    assert "no longer runs in this gateway" in end["message"]
    assert told < 10, told


# ---------------------------------------------------------------------------------------- a node dies mid-decode


@pytest.mark.slow
def test_killed_node_ends_every_channel_with_phase_and_node(smollm2_path, tmp_path):
    swarm = start_swarm(smollm2_path, tmp_path / "swarm")
    listener = TelemetryListener(swarm.url)
    counting = "1, 2, 3, 4, 5, 6, 7, 8,"
    try:
        cli_proc = subprocess.Popen(
            cli() + ["generate", counting, "--nats", swarm.url, "--max-tokens", "3000"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        cli_started = threading.Event()
        threading.Thread(target=lambda: (cli_proc.stdout.read(1), cli_started.set()), daemon=True).start()

        async def scenario():
            async with aiohttp.ClientSession() as session:
                ws = await session.ws_connect(ws_url(swarm) + "/ws")
                await ws.send_json({"type": "generate", "prompt": counting, "max_tokens": 3000, "ignore_eos": True})
                sse = await session.post(
                    swarm.gateway_url + "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": [{"role": "user", "content": "Count to a thousand."}],
                        "max_tokens": 3000,
                        "ignore_eos": True,
                        "stream": True,
                    },
                    timeout=aiohttp.ClientTimeout(total=300),
                )
                ws_msgs, sse_lines = [], []

                async def read_ws():
                    while (m := await ws.receive_json(timeout=120))["type"] not in ("done", "error"):
                        ws_msgs.append(m)
                    ws_msgs.append(m)

                async def read_sse():
                    async for line in sse.content:
                        if line.startswith(b"data: "):
                            sse_lines.append(line[6:].decode().strip())

                readers = [asyncio.create_task(read_ws()), asyncio.create_task(read_sse())]
                deadline = time.monotonic() + 120
                while not (any(m["type"] == "token" for m in ws_msgs) and len(sse_lines) >= 2 and cli_started.is_set()):
                    assert time.monotonic() < deadline, "the three generations did not all start decoding"
                    await asyncio.sleep(0.1)
                await asyncio.to_thread(swarm.kill, "worker-1")
                killed = time.monotonic()
                await asyncio.wait_for(asyncio.gather(*readers), 30)
                ended = time.monotonic() - killed
                await ws.close()
                return ws_msgs, sse_lines, ended, killed

        ws_msgs, sse_lines, ended, killed = asyncio.run(scenario())
        cli_out = cli_proc.communicate(timeout=30)
        cli_ended = time.monotonic() - killed
    finally:
        time.sleep(1.0)
        listener.stop()
        swarm.stop()

    assert ended < 10 and cli_ended < 12, (ended, cli_ended)
    # WebSocket: a final error with the phase, the node and the reason
    err = ws_msgs[-1]
    assert err["type"] == "error" and err["reason"] == "node_lost", err
    assert err["phase"] == "decode" and err["node_id"] == "worker-1" and "worker-1" in err["message"]
    # SSE: the stream's last event is an error naming the same, then [DONE]
    assert sse_lines[-1] == "[DONE]"
    sse_err = json.loads(sse_lines[-2])["error"]
    assert (sse_err["code"], sse_err["phase"], sse_err["node_id"]) == ("node_lost", "decode", "worker-1")
    # CLI: non-zero exit, one line naming phase, node and reason
    assert cli_proc.returncode != 0
    assert "failed in phase decode at node worker-1: node_lost" in cli_out[1], cli_out[1]
    # telemetry: each of the three sessions ends with a failed state carrying phase, node and reason
    finals = {}
    for t in listener.lines:
        finals[t["session_id"]] = t
    failed = [t for t in finals.values() if t["phase"] == "failed"]
    assert len(failed) == 3, [(t["phase"], t["failure_reason"]) for t in finals.values()]
    assert all(t["failure_reason"].startswith("node_lost in phase decode at node worker-1") for t in failed)
    assert err["session_id"] in finals and sse_err["session_id"] in finals
