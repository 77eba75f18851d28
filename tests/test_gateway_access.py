"""The gateway with API keys (``--api-keys``) on a real swarm: 401 without a valid key, 200 with one,
429 with Retry-After past a key's rate; keys never in logs, error bodies or metrics; the WebSocket
takes a key as a header or as the subprotocols ``bearer, <key>``; a streaming client (SSE or
WebSocket) that disconnects mid-decode has its session freed on every hop within 5 s."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest

from neuron_bus.client import NeuronClient
from neuron_bus.gateway.access import add_key
from neuron_bus.local_swarm import LocalSwarm, cli
from neuron_bus.natsserver import free_port

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    limited = add_key(path, "alice", requests_per_minute=6, burst=2)
    unlimited = add_key(path, "bob", requests_per_minute=0)
    return path, limited, unlimited


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory, keys):
    s = LocalSwarm(
        smollm2_path,
        2,
        workdir=tmp_path_factory.mktemp("access"),
        gateway_port=free_port(),
        gateway_extra=["--chunk-size", "16", "--api-keys", str(keys[0])],
    ).start()
    yield s
    s.stop()


def call(url: str, body: dict | None = None, key: str | None = None, header: str | None = None):
    headers = {"Content-Type": "application/json"}
    if header is not None:
        headers["Authorization"] = header
    elif key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


COMPLETION = {"model": MODEL, "prompt": "The sea is", "max_tokens": 4}


def test_without_a_valid_key_401_with_one_200_and_the_open_paths_stay_open(swarm, keys):
    _, alice, bob = keys
    base = swarm.gateway_url
    for header in (None, "Bearer", "Basic Ym9iOmJvYg==", "Bearer nb-not-a-key-0123456789"):
        status, headers, body = call(f"{base}/v1/completions", COMPLETION, header=header)
        assert status == 401, (header, status, body)
        err = json.loads(body)["error"]
        assert err["code"] == "invalid_api_key" and headers.get("WWW-Authenticate", "").startswith("Bearer")
        assert "nb-not-a-key" not in body
    assert call(f"{base}/v1/models")[0] == 401
    status, _, body = call(f"{base}/v1/completions", COMPLETION, key=bob)
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 4
    assert call(f"{base}/healthz")[0] == 200 and call(f"{base}/")[0] == 200
    # the official client sends the key the same way
    client = openai.OpenAI(base_url=base + "/v1", api_key=bob, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()


def test_past_a_keys_rate_429_with_retry_after_other_keys_unaffected(swarm, keys):
    _, alice, bob = keys
    url = f"{swarm.gateway_url}/v1/models"
    assert [call(url, key=alice)[0] for _ in range(2)] == [200, 200]  # its burst
    status, headers, body = call(url, key=alice)
    assert status == 429, body
    err = json.loads(body)["error"]
    assert err["code"] == "rate_limit_exceeded" and "alice" in err["message"]
    assert 1 <= int(headers["Retry-After"]) <= 10  # one request every 10 s
    assert call(url, key=bob)[0] == 200
    # the limit is per key, counted by id in the metrics
    metrics = call(f"{swarm.gateway_url}/metrics")[2]
    assert 'neuron_gateway_rate_limited_total{key_id="alice"} 1.0' in metrics
    assert 'neuron_gateway_key_requests_total{key_id="bob"}' in metrics
    assert 'neuron_gateway_auth_failures_total{reason="invalid"}' in metrics


def test_keys_never_appear_in_logs_error_bodies_or_metrics(swarm, keys):
    path, alice, bob = keys
    wrong = "nb-wrong-" + "x" * 30
    bodies = [call(f"{swarm.gateway_url}/v1/completions", COMPLETION, key=wrong)[2]]
    bodies.append(call(f"{swarm.gateway_url}/v1/completions", {"model": MODEL}, key=bob)[2])  # 400 as bob
    bodies.append(call(f"{swarm.gateway_url}/metrics")[2])
    log = (swarm.workdir / "gateway.log").read_text()
    for secret in (alice, bob, wrong):
        assert all(secret not in b for b in bodies) and secret not in log
    assert alice not in path.read_text() and bob not in path.read_text()  # the file holds hashes only


def test_the_websocket_takes_a_key_as_header_or_subprotocol(swarm, keys):
    _, _, bob = keys
    url = swarm.gateway_url.replace("http", "ws", 1) + "/ws"

    async def scenario():
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(url)
            assert refused.value.status == 401
            for kw in ({"headers": {"Authorization": f"Bearer {bob}"}}, {"protocols": ("bearer", bob)}):
                async with http.ws_connect(url, **kw) as ws:
                    await ws.send_json({"type": "generate", "prompt": "Hi", "max_tokens": 3})
                    while (msg := await ws.receive_json(timeout=120))["type"] not in ("done", "error"):
                        pass
                    assert msg["type"] == "done" and msg["usage"]["completion_tokens"] == 3, msg
                    if "protocols" in kw:
                        assert ws.protocol == "bearer"

    asyncio.run(scenario())


# ------------------------------------------------------------------------------ disconnects


async def open_sessions_async(swarm) -> dict[str, set[str]]:
    return await open_sessions(swarm)


async def open_sessions(swarm) -> dict[str, set[str]]:
    async with await NeuronClient.connect(swarm.url) as c:
        return {w.node_id: {s.session_id for s in (await c.sessions(w.node_id)).sessions} for w in swarm.workers}


def cli_sessions(swarm, node: str) -> set[str]:
    out = subprocess.run(
        cli() + ["sessions", node, "--json", "--nats", swarm.url], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return {s["session_id"] for s in json.loads(out.stdout)["sessions"]}


def sse_until_tokens(base: str, key: str, n: int) -> tuple[socket.socket, str]:
    """A raw HTTP client streaming a long completion; returns its socket once ``n`` tokens came."""
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps(
        {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "stream": True, "ignore_eos": True}
    )
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(
        (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        ).encode()
    )
    buf, session = b"", ""
    while buf.count(b'"text_completion"') < n:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"no {n} tokens streamed: {buf[-800:]!r}") from None
        assert chunk, buf[-500:]
        buf += chunk
    for line in buf.split(b"\n"):
        if line.startswith(b"data: {"):
            session = json.loads(line[6:])["id"].removeprefix("cmpl-")
            break
    return sock, session


def wait_freed(swarm, session: str, started: float) -> float:
    while True:
        held = [n for n, sessions in asyncio.run(open_sessions(swarm)).items() if session in sessions]
        elapsed = time.monotonic() - started
        if not held:
            return elapsed
        assert elapsed < 5.0, f"session {session} still open on {held} {elapsed:.1f}s after the client left"
        time.sleep(0.1)


def test_an_sse_client_that_disconnects_mid_decode_frees_its_session_on_every_hop_within_5s(swarm, keys):
    _, _, bob = keys
    sock, session = sse_until_tokens(swarm.gateway_url, bob, 5)
    assert all(session in s for s in asyncio.run(open_sessions(swarm)).values())  # decoding on every hop
    sock.close()
    freed = wait_freed(swarm, session, time.monotonic())
    assert all(session not in cli_sessions(swarm, w.node_id) for w in swarm.workers)  # `neuron-bus sessions`
    print(f"SSE disconnect: freed on every hop after {freed:.2f}s")


def test_a_websocket_client_that_disconnects_mid_decode_frees_its_session_within_5s(swarm, keys):
    _, _, bob = keys
    url = swarm.gateway_url.replace("http", "ws", 1) + "/ws"

    async def scenario() -> str:
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(url, headers={"Authorization": f"Bearer {bob}"})
            await ws.send_json(
                {"type": "generate", "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
            )
            tokens = 0
            while tokens < 5:
                msg = await ws.receive_json(timeout=120)
                tokens += msg["type"] == "token"
            session = msg["session_id"]
            assert all(session in s for s in (await open_sessions_async(swarm)).values())
            ws._response.connection.transport.abort()  # gone without a close frame
            return session

    session = asyncio.run(scenario())
    freed = wait_freed(swarm, session, time.monotonic())
    print(f"WebSocket disconnect: freed on every hop after {freed:.2f}s")


def test_up_passes_its_api_keys_to_the_gateway_and_refuses_a_bad_file_before_starting(tmp_path, keys):
    from tests.test_up import running_up

    bad = tmp_path / "bad.json"
    bad.write_text('{"keys": [{"id": "x"}]}')
    out = subprocess.run(cli() + ["up", "--api-keys", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "key x: needs 'sha256'" in out.stderr, out.stderr
    path, _, bob = keys
    with running_up(tmp_path / "up", "--shards", "1", "--api-keys", str(path)) as (_, _, gateway):
        base = f"http://127.0.0.1:{gateway}"
        assert call(f"{base}/v1/models")[0] == 401
        status, _, body = call(f"{base}/v1/completions", COMPLETION, key=bob)
        assert status == 200, body


def test_the_web_page_asks_for_a_key_and_uses_it(swarm, keys, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    _, _, bob = keys
    browser.get(swarm.gateway_url + "/")
    wait = WebDriverWait(browser, 60, poll_frequency=0.1)
    text = lambda el_id: browser.find_element(By.ID, el_id).text  # noqa: E731
    wait.until(lambda d: "API key" in text("coverage"))  # the WebSocket was refused: it says why
    box = browser.find_element(By.ID, "api_key")
    box.send_keys(bob, Keys.TAB)  # change: reconnect with the key (subprotocols "bearer, <key>")
    wait.until(lambda d: "worker-1" in text("coverage"))
    browser.find_element(By.ID, "prompt").send_keys("Hi")
    browser.find_element(By.ID, "max_tokens").clear()
    browser.find_element(By.ID, "max_tokens").send_keys("3")
    browser.find_element(By.ID, "send").click()
    wait.until(lambda d: browser.find_element(By.ID, "status").get_attribute("data-state") in ("done", "failed"))
    assert browser.find_element(By.ID, "status").get_attribute("data-state") == "done", text("error")
