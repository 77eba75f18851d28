"""What a client of the gateway is told when the swarm cannot serve it now: every KV slot in use
(queued, with its place in the queue; 429 with Retry-After beyond the queue's limit; with queueing
off, 503 with Retry-After, for streaming and non-streaming requests alike), no tracker, the bus
down. Real processes: nats-server, tracker, workers, gateways."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import openai
import pytest

from neuron_bus.errors import RouteError
from neuron_bus.gateway.bus import route_api_error
from neuron_bus.local_swarm import LocalSwarm, cli
from neuron_bus.natsserver import free_port
from workers.errors import Reason

pytestmark = pytest.mark.timeout(300)


def post(url: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read()) if not body.get("stream") else {}
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


@pytest.fixture(scope="module")
def one_slot_swarm(smollm2_path, tmp_path_factory):
    """Two workers with a KV pool of one session's positions each (256: a generation of a short
    prompt and 100 tokens fills it), slowed so a generation holds it for seconds; its gateway does
    not queue (``--max-queue 0``)."""
    extra = ["--n-ctx", "256", "--kv-budget", "256", "--slow-ms", "25"]
    s = LocalSwarm(
        smollm2_path,
        2,
        workdir=tmp_path_factory.mktemp("one-slot"),
        gateway_port=free_port(),
        gateway_extra=["--max-queue", "0"],
        worker_extra={0: extra, 1: extra},
    ).start()
    yield s
    s.stop()


@contextmanager
def gateway(swarm, *args: str):
    """Another gateway on the same swarm (its own queue), until the block ends."""
    port = free_port()
    proc = subprocess.Popen(
        cli() + ["gateway", "--nats", swarm.url, "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline and proc.poll() is None, "gateway did not start"
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(20)


@contextmanager
def slot_held(base: str):
    """A streaming generation that holds the route's only slot until the block ends (and then finishes)."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    started, text = threading.Event(), []

    def hold() -> None:
        stream = client.completions.create(model="smollm2-135m", prompt="Once upon a time", max_tokens=100, stream=True)
        for chunk in stream:
            started.set()
            text.append(chunk.choices[0].text if chunk.choices else "")

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert started.wait(60), "the first generation did not start"
        yield text
    finally:
        t.join(120)
    assert "".join(text), "the slot holder's generation must finish untouched"


def sse(url: str, body: dict) -> tuple[int, list[dict], list[dict]]:
    """A streaming completion read as raw SSE: (status, telemetry comments, data chunks)."""
    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    telemetry, chunks = [], []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith(": telemetry "):
                telemetry.append(json.loads(line[len(": telemetry ") :]))
            elif line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :]))
        return resp.status, telemetry, chunks


@pytest.mark.parametrize("reason", [Reason.DRAINING, Reason.STUCK, Reason.NODE_LOST])
def test_a_node_that_takes_no_new_session_after_the_retry_is_503_with_retry_after(reason):
    """A node moving, stuck or gone, still on the route after the generation's retry: the swarm's
    own state, which the tracker routes around within seconds; not a node's wrong answer (502)."""
    response = route_api_error(RouteError(reason, "w: no new sessions", phase="prefill", node_id="w")).response()
    assert response.status == 503 and response.headers["Retry-After"] == "5"


def test_with_queueing_off_requests_beyond_the_free_kv_slots_get_503_with_retry_after(one_slot_swarm):
    base = one_slot_swarm.gateway_url
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    with slot_held(base):
        body = {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 4}
        status, headers, answer = post(base + "/v1/completions", body)
        assert status == 503, answer
        assert int(headers["Retry-After"]) >= 1
        err = answer["error"]
        assert err["code"] == "no_free_slot" and "KV pool has no room" in err["message"] and err["node_id"]
        status, headers, answer = post(base + "/v1/completions", {**body, "stream": True})
        assert status == 503 and "Retry-After" in headers and answer["error"]["code"] == "no_free_slot"
        with pytest.raises(openai.APIStatusError) as info:  # what the official client raises
            client.chat.completions.create(
                model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
        assert info.value.status_code == 503
    status, _, answer = post(base + "/v1/completions", {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 4})
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1  # the freed slot serves again


def test_requests_beyond_the_free_kv_slots_wait_in_a_queue_and_beyond_its_limit_get_429(one_slot_swarm):
    with gateway(one_slot_swarm, "--max-queue", "2") as base, slot_held(base):
        url = base + "/v1/completions"
        results: dict = {}

        def ask(name: str) -> None:
            results[name] = sse(url, {"model": "smollm2-135m", "prompt": f"{name}:", "max_tokens": 4})

        waiting = [threading.Thread(target=ask, args=(n,)) for n in ("first", "second")]
        for t in waiting:
            t.start()
            time.sleep(0.5)  # in this order
        status, headers, answer = post(url, {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 4})
        assert status == 429 and int(headers["Retry-After"]) >= 1, answer  # two waiting: the queue is full
        assert answer["error"]["code"] == "queue_full"
    for t in waiting:
        t.join(120)
    for name, ahead in (("first", 0), ("second", 1)):
        status, telemetry, chunks = results[name]
        assert status == 200 and "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        queued = [t for t in telemetry if t["phase"] == "queued"]
        assert queued and queued[0]["queue_position"] == ahead, telemetry[:3]  # its place, before any token
        assert [t["phase"] for t in telemetry].index("queued") < len(telemetry) - 1


def test_errors_name_the_tracker_then_the_bus(tmp_path):
    from tests.conftest import start_nats

    srv = start_nats(tmp_path)
    port = free_port()
    gw = subprocess.Popen(
        cli() + ["gateway", "--nats", srv.url, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        deadline = time.monotonic() + 60
        while True:  # up once it answers at all
            try:
                status, headers, answer = post(url, {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 2})
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline and gw.poll() is None, (
                    gw.stderr.read() if gw.poll() is not None else ""
                )
                time.sleep(0.3)
        assert status == 503 and headers.get("Retry-After")
        assert answer["error"]["code"] == "no_tracker" and "no tracker answered" in answer["error"]["message"]
        srv.stop()  # the bus goes away; the tracker was never the problem now
        status, headers, answer = post(url, {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 2})
        assert status == 503 and headers.get("Retry-After")
        assert answer["error"]["code"] == "bus_unreachable", answer
        assert "the bus is unreachable" in answer["error"]["message"] and srv.url in answer["error"]["message"]
        assert "tracker" not in answer["error"]["message"]
    finally:
        gw.terminate()
        gw.wait(20)
        srv.stop()
