"""`neuron-bus up`: the README's first command, end to end, with each shipped model, and its
refusals (taken ports) before anything starts."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager

import openai
import psutil
import pytest

from neuron_bus.local_swarm import cli
from neuron_bus.natsserver import free_port, port_taken
from neuron_bus.wan.linkem import TIMER_SLACK_S

pytestmark = [pytest.mark.timeout(600)]


@contextmanager
def running_up(tmp_path, *args: str, timeout: float = 300):
    """`neuron-bus up` on free ports until it says "swarm up"; yields (process, nats port, gateway port)."""
    port, http, gateway = free_port(), free_port(), free_port()
    up = subprocess.Popen(
        cli()
        + [
            "up",
            "--nats-port",
            str(port),
            "--http-port",
            str(http),
            "--port",
            str(gateway),
            "--workdir",
            str(tmp_path),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + timeout
        lines = []
        while time.monotonic() < deadline:
            line = up.stderr.readline()
            lines.append(line)
            if "swarm up" in line or not line:
                break
        assert any("swarm up" in line for line in lines), "".join(lines)
        yield up, port, gateway
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(60)


@pytest.mark.slow
def test_up_then_generate_produces_text_and_ctrl_c_stops_everything(tmp_path):
    with running_up(tmp_path) as (up, port, gateway):
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= 5  # nats-server, tracker, two workers, gateway
        page = urllib.request.urlopen(f"http://127.0.0.1:{gateway}/", timeout=10).read().decode()
        assert "<html" in page.lower()
        out = subprocess.run(
            cli() + ["generate", "Name a colour:", "--nats", f"nats://127.0.0.1:{port}", "--max-tokens", "12"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip(), "no text generated"
        up.send_signal(signal.SIGINT)
        up.wait(60)
    assert up.returncode == 0
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
@pytest.mark.parametrize("shards", [2, 3])
def test_up_with_gemma3_serves_the_openai_client(tmp_path, shards):
    """Gemma 3's balanced split once gave its tail a lone global-attention layer, which aborts llama.cpp."""
    with running_up(tmp_path, "--model", "gemma3-270m", "--shards", str(shards)) as (up, _, gateway):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model="gemma3-270m", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
        )
        assert r.choices[0].message.content
        assert len(r.neuron_route["nodes"]) == shards


@pytest.mark.slow
def test_up_behind_emulated_links_serves_and_each_worker_is_a_link_away(tmp_path):
    delay_ms = 40
    with running_up(tmp_path, "--link-delay-ms", str(delay_ms)) as (up, port, gateway):
        deadline = time.monotonic() + 60
        while True:  # a worker reports its round trip to the server once it has measured it
            out = subprocess.run(
                cli() + ["coverage", "--nats", f"nats://127.0.0.1:{port}", "--json"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            rtts = [n["rtt_ms"] for n in json.loads(out.stdout)["nodes"]]
            if len(rtts) == 2 and None not in rtts or time.monotonic() > deadline:
                break
            time.sleep(1)
        # the link, both ways: each direction releases a chunk up to TIMER_SLACK_S before its time
        # (linkem aims half of epoll's millisecond early), so a round trip may fall that short of 2 delays
        shortest = 2 * (delay_ms - TIMER_SLACK_S * 1000)
        assert len(rtts) == 2 and all(r is not None and r >= shortest for r in rtts), rtts
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
        )
        assert r.choices[0].message.content and len(r.neuron_route["nodes"]) == 2


@contextmanager
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    "option,what", [("--http-port", "monitoring port"), ("--port", "gateway port"), ("--nats-port", "client port")]
)
def test_up_reports_a_taken_port_before_anything_starts(tmp_path, option, what):
    ports = {"--nats-port": free_port(), "--http-port": free_port(), "--port": free_port()}
    with taken_port() as busy:
        ports[option] = busy
        args = [x for kv in ports.items() for x in (kv[0], str(kv[1]))]
        out = subprocess.run(
            cli() + ["up", "--workdir", str(tmp_path), *args], capture_output=True, text=True, timeout=60
        )
    assert out.returncode == 1
    assert f"{what} {busy}" in out.stderr and option in out.stderr and "in use" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "nats").exists()  # nothing was started
    assert not any(port_taken("127.0.0.1", p) for o, p in ports.items() if o != option)


def test_gateway_reports_its_taken_port(nats_server):
    with taken_port() as busy:
        out = subprocess.run(
            cli() + ["gateway", "--nats", nats_server.url, "--port", str(busy)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 1 and f"gateway port {busy}" in out.stderr and "in use" in out.stderr, out.stderr


def read_until(stream, pattern: str, timeout: float) -> str:
    """Lines of ``stream`` until one matches ``pattern`` (all of them, joined)."""
    import re

    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if re.search(pattern, line):
            return "".join(seen)
    raise AssertionError(f"no line matching {pattern!r} in: {''.join(seen)[-2000:]}")


@pytest.mark.slow
def test_up_reports_a_killed_worker_restarts_it_and_serves_again(tmp_path):
    with running_up(tmp_path) as (up, port, gateway):
        worker = next(p for p in psutil.Process(up.pid).children(recursive=True) if "worker-1" in " ".join(p.cmdline()))
        worker.kill()
        said = read_until(up.stderr, r"worker-1 restarted", 60)
        assert "worker-1 killed by SIGKILL" in said and "restarting it in" in said, said
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="x", max_retries=0, timeout=60)
        deadline = time.monotonic() + 120
        while True:  # the restarted worker loads, announces itself, and routes reach it again
            try:
                r = client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=4)
                break
            except openai.APIStatusError:
                assert time.monotonic() < deadline, "the swarm did not serve again"
                time.sleep(2)
        assert r.usage.completion_tokens >= 1


@pytest.mark.slow
def test_up_stops_with_a_clear_message_when_nats_server_dies(tmp_path):
    with running_up(tmp_path) as (up, _, _):
        server = next(p for p in psutil.Process(up.pid).children(recursive=True) if "nats-server" in p.name())
        server.kill()
        said = read_until(up.stderr, r"the swarm stops", 30)
        assert "nats-server" in said and "killed by SIGKILL" in said
        up.wait(60)
        assert up.returncode == 1
