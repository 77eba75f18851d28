"""`neuron-bus up` then `neuron-bus generate`: the README's first command, end to end."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request

import psutil
import pytest

from neuron_bus.local_swarm import cli
from neuron_bus.natsserver import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_up_then_generate_produces_text_and_ctrl_c_stops_everything(tmp_path):
    port, http, gateway = free_port(), free_port(), free_port()
    up = subprocess.Popen(
        cli() + ["up", "--nats-port", str(port), "--http-port", str(http), "--port", str(gateway), "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 300
        lines = []
        while time.monotonic() < deadline:
            line = up.stderr.readline()
            lines.append(line)
            if "swarm up" in line or not line:
                break
        assert any("swarm up" in line for line in lines), "".join(lines)
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= 5  # nats-server, tracker, two workers, gateway
        page = urllib.request.urlopen(f"http://127.0.0.1:{gateway}/", timeout=10).read().decode()
        assert "<html" in page.lower()
        out = subprocess.run(
            cli() + ["generate", "Name a colour:", "--nats", f"nats://127.0.0.1:{port}", "--max-tokens", "12"],
            capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip(), "no text generated"
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)
    assert up.returncode == 0
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
