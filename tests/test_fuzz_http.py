"""Fuzzing the gateway's HTTP API on a real swarm (hypothesis, bounded): malformed JSON, wrong
types, huge bodies, deep nesting, lying lengths, slow clients, garbage WebSocket frames.

Properties: every request gets an answer within its bound, with an OpenAI-style JSON error body for
anything refused and never a 500; slow clients (a body a byte per second, headers dribbled) cost
only their own connection: other requests are answered as fast as ever, and a body that does not
arrive within ``--body-timeout`` is a 408."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.natsserver import free_port

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

MODEL = "smollm2-135m"
BODY_TIMEOUT_S = 3.0
ALLOWED = {200, 400, 404, 405, 408, 413, 422, 429, 503}
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "n",
    "policy",
    "ignore_eos",
]

text = st.text(max_size=40)
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(10**20), 10**20),
        st.floats(allow_nan=False, allow_infinity=False),
        text,
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
    max_leaves=10,
)


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    s = LocalSwarm(
        smollm2_path,
        2,
        workdir=tmp_path_factory.mktemp("fuzz-http"),
        gateway_port=free_port(),
        gateway_extra=["--chunk-size", "16", "--body-timeout", str(BODY_TIMEOUT_S), "--max-context", "512"],
    )
    s.start()
    yield s
    s.stop()


def send(base: str, path: str, data: bytes, content_type: str | None = "application/json", timeout: float = 90):
    """(status, body, seconds) of one POST."""
    headers = {"Content-Type": content_type} if content_type else {}
    req = urllib.request.Request(base + path, data=data, headers=headers, method="POST")
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), time.monotonic() - start
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), time.monotonic() - start


def check_error_body(status: int, body: bytes) -> None:
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"], err
    assert status != 500 and err.get("code") != "internal_error", err


@st.composite
def request_body(draw) -> bytes:
    kind = draw(st.sampled_from(["bytes", "json", "fields", "fields", "fields"]))
    if kind == "bytes":
        return draw(st.one_of(st.binary(max_size=512), text.map(str.encode), st.just(b"\xff\xfe{}")))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    chat = draw(st.booleans())
    body: dict = {"model": MODEL, "max_tokens": draw(st.integers(-2, 3))}
    if chat:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        ids = st.one_of(st.integers(0, 49151), st.integers(49152, 10**12))  # SmolLM2 has 49152 tokens
        body["prompt"] = draw(st.one_of(st.just("Hi"), st.lists(ids, min_size=1, max_size=4)))
    for _ in range(draw(st.integers(1, 4))):
        body[draw(st.one_of(st.sampled_from(FIELDS), text))] = draw(json_values)
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        body["max_tokens"] = 2  # a generation stays short: the fuzz is about shapes, not long answers
    body.pop("max_completion_tokens", None)
    return json.dumps(body).encode()


def test_malformed_and_mistyped_requests_get_clean_answers(swarm):
    seen: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
        data=request_body(),
        content_type=st.sampled_from(["application/json", "text/plain", None, "application/json; charset=latin-1"]),
    )
    def answered_cleanly(path, data, content_type):
        status, body, took = send(swarm.gateway_url, path, data, content_type)
        seen[status] = seen.get(status, 0) + 1
        assert status in ALLOWED, (status, data[:200], body[:300])
        assert took < 60, (took, data[:200])
        if status >= 400:
            check_error_body(status, body)
        elif body.lstrip().startswith(b"{"):
            assert json.loads(body)["choices"], body[:200]
        else:  # a stream: it ends (a route failing mid-stream would say so in its last chunk)
            assert body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in body, body[-300:]

    answered_cleanly()
    print(f"HTTP fuzz: statuses {dict(sorted(seen.items()))}")
    assert seen.get(200) and (seen.get(400) or 0) + (seen.get(422) or 0) > 20, seen
    assert swarm.procs["gateway"].poll() is None


@pytest.mark.parametrize(
    "what,data,status",
    [
        ("2 MiB body", json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)}).encode(), 413),
        ("deep nesting", b"[" * 200_000 + b"]" * 200_000, 400),
        ("deep object", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, 400),
        ("invalid utf-8", b'{"model": "\xff\xfe"}', 400),
        ("a token the model does not have", json.dumps({"model": MODEL, "prompt": [1, 49152]}).encode(), 422),
        (
            "huge number",
            b'{"model": "' + MODEL.encode() + b'", "prompt": "Hi", "max_tokens": 1' + b"0" * 100 + b"}",
            422,
        ),
    ],
)
def test_hostile_bodies_are_refused_with_json_errors(swarm, what, data, status):
    got, body, took = send(swarm.gateway_url, "/v1/completions", data)
    assert got == status, (what, got, body[:300])
    check_error_body(got, body)
    assert took < 30


def raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def test_a_body_that_does_not_arrive_in_time_is_408_and_slow_clients_hold_up_nobody(swarm):
    port = int(swarm.gateway_url.rsplit(":", 1)[1])
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    stop = threading.Event()
    slow: list[socket.socket] = []

    def dribble_headers(sock: socket.socket) -> None:  # headers a byte at a time, never finished
        for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n":
            if stop.wait(0.5):
                return
            try:
                sock.send(bytes([b]))
            except OSError:
                return

    threads = []
    for _ in range(20):
        sock = raw(port)
        slow.append(sock)
        threads.append(threading.Thread(target=dribble_headers, args=(sock,), daemon=True))
        threads[-1].start()
    try:
        # one client sends its headers, then its body a byte per second: 408 after the body timeout
        sock = raw(port)
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        answer = b""
        start = time.monotonic()

        def byte_per_second() -> None:
            for b in body:
                if stop.wait(1.0):
                    return
                try:
                    sock.send(bytes([b]))
                except OSError:
                    return

        threading.Thread(target=byte_per_second, daemon=True).start()
        # meanwhile everyone else is served as usual
        for _ in range(3):
            status, answer_body, took = send(swarm.gateway_url, "/v1/completions", body)
            assert status == 200 and took < 20, (status, took, answer_body[:200])
            with urllib.request.urlopen(f"{swarm.gateway_url}/healthz", timeout=5) as resp:
                assert resp.status == 200
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
        waited = time.monotonic() - start
        head, _, rest = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), head
        assert BODY_TIMEOUT_S - 0.5 <= waited < BODY_TIMEOUT_S + 10, waited
        assert b"request_timeout" in rest or b"request_timeout" in sock.recv(65536)
        # a length that lies: 10 MB announced, 10 bytes sent
        liar = raw(port)
        liar.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n0123456789")
        reply = liar.recv(65536)
        assert reply.startswith(b"HTTP/1.1 413") or reply.startswith(b"HTTP/1.1 408"), reply[:200]
    finally:
        stop.set()
        for s in slow:
            s.close()
    assert swarm.procs["gateway"].poll() is None


def test_garbage_websocket_frames_get_error_messages_and_the_socket_keeps_serving(swarm):
    url = swarm.gateway_url.replace("http", "ws", 1) + "/ws"
    frames = st.one_of(
        st.binary(max_size=256).map(lambda b: ("bytes", b)),
        text.map(lambda t: ("text", t)),
        json_values.map(lambda v: ("text", json.dumps(v))),
        st.dictionaries(st.sampled_from(["type", *FIELDS]), json_values, max_size=4).map(
            lambda d: ("text", json.dumps({**d, "type": d.get("type", "generate"), "max_tokens": 1}))
        ),
    )

    async def scenario(batch) -> None:
        async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
            for kind, data in batch:
                await (ws.send_bytes(data) if kind == "bytes" else ws.send_str(data))
            # whatever came before, a valid generation on the same socket still works
            deadline = time.monotonic() + 90
            await ws.send_json({"type": "generate", "prompt": "Hi", "max_tokens": 2})
            while True:
                assert time.monotonic() < deadline and not ws.closed
                msg = await ws.receive_json(timeout=60)
                if msg["type"] == "error":
                    assert msg["status"] != 500, msg
                if msg["type"] == "error" and msg.get("code") == "busy":  # a fuzzed generate still runs
                    await asyncio.sleep(0.5)
                    await ws.send_json({"type": "generate", "prompt": "Hi", "max_tokens": 2})
                elif msg["type"] == "done" and msg.get("usage", {}).get("completion_tokens") == 2:
                    return  # ours (a fuzzed generation may finish first)

    @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(frames, min_size=1, max_size=8))
    def socket_survives(batch):
        asyncio.run(scenario(batch))

    socket_survives()
    assert swarm.procs["gateway"].poll() is None


def test_a_prompt_token_the_head_refuses_ends_the_session_at_once(swarm):
    """Sent straight to the bus (no gateway check): the head refuses the chunk, and the session
    fails with bad_input instead of waiting for a prompt that can never go through."""
    from neuron_bus import messages as M
    from neuron_bus.client import NeuronClient, RouteError

    async def scenario():
        async with await NeuronClient.connect(swarm.url) as c:
            start = time.monotonic()
            with pytest.raises(RouteError) as failed:
                await c.complete(prompt_tokens=[1, 49152, 2], sampling=M.SamplingParams(max_tokens=2))
            return failed.value, time.monotonic() - start

    err, took = asyncio.run(scenario())
    assert err.reason == "bad_input" and err.node_id == "worker-0" and took < 10, (err, took)
