"""`neuron-bus server` and the topology it provisions, against real nats-server processes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neuron_bus import natsserver
from neuron_bus import subjects as S
from neuron_bus.errors import ServerError
from neuron_bus.natsserver import NatsServer, ServerConfig, ephemeral_range, free_port
from neuron_bus.topology import connect, ensure_topology, topology
from workers.errors import Reason

BIN = str(Path(sys.executable).parent / "neuron-bus")


def test_help_lists_subcommands():
    out = subprocess.run([BIN, "--help"], capture_output=True, text=True, check=True).stdout
    for cmd in (
        "server",
        "up",
        "worker",
        "tracker",
        "coverage",
        "gateway",
        "generate",
        "sessions",
        "artifact",
        "audit",
    ):
        assert f" {cmd} " in out, cmd


async def _names(url: str) -> tuple[set[str], set[str], set[str]]:
    nc = await connect(url, max_reconnect_attempts=1)
    try:
        js = nc.jetstream()
        streams = {s.config.name for s in await js.streams_info()}
        kv, obj = set(), set()
        for k in topology().kv:
            await js.key_value(k.bucket)
            kv.add(k.bucket)
        for o in topology().objects:
            await js.object_store(o.bucket)
            obj.add(o.bucket)
        return streams, kv, obj
    finally:
        await nc.close()


def test_server_command_starts_jetstream_on_loopback_and_stops_on_sigterm(tmp_path):
    port, http = free_port(), free_port()
    proc = subprocess.Popen(
        [BIN, "server", "--port", str(port), "--http-port", str(http), "--store-dir", str(tmp_path / "js")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert f"nats://127.0.0.1:{port}" in line, line + proc.stderr.read()
        assert "topology:" in proc.stdout.readline()
        streams, kv, obj = asyncio.run(_names(f"nats://127.0.0.1:{port}"))
        for name in (S.STREAM_PREFILL, S.STREAM_DECODE, S.STREAM_TELEMETRY, S.STREAM_ROUTES, S.STREAM_TOKENS):
            assert name in streams
        assert kv == {k.bucket for k in topology().kv} >= {S.KV_NODES, S.KV_ROUTES}
        assert obj == {o.bucket for o in topology().objects} == {S.OBJ_ARTIFACTS, S.OBJ_SNAPSHOTS}
        # Bound to loopback only: the monitoring endpoint reports the listen host.
        conf = (tmp_path / "js" / "nats-server.conf").read_text()
        assert 'host: "127.0.0.1"' in conf
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert "stopped" in out


def test_server_refuses_a_busy_port_with_a_clear_error(tmp_path, nats_server):
    proc = subprocess.run(
        [
            BIN,
            "server",
            "--port",
            str(nats_server.config.port),
            "--http-port",
            str(free_port()),
            "--store-dir",
            str(tmp_path / "js2"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    # refused before the binary starts, naming the port and the option that moves it
    assert proc.stderr.startswith(
        f"error: port in use on 127.0.0.1: nats-server client port {nats_server.config.port} (--port"
    )


async def test_topology_is_idempotent(nats_server):
    nc = await connect(nats_server.url)
    try:
        js = nc.jetstream()
        await ensure_topology(js)
        await ensure_topology(js)  # second run changes nothing and raises nothing
        infos = await js.streams_info()
        assert sorted(i.config.name for i in infos if i.config.name.startswith("NEURON_")) == sorted(
            s.name for s in topology().streams
        )
    finally:
        await nc.close()


def test_free_ports_lie_outside_the_kernels_source_port_range_and_are_never_handed_out_twice():
    """A port from bind(0) is one any outgoing connection may take before the server binds it (a
    CI run lost a test cluster so); free_port's ports are not."""
    lo, hi = ephemeral_range()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(not lo <= p <= hi for p in ports)
    for p in ports[:20]:  # each one can be listened on
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
            s.listen()


def test_free_port_on_kernels_whose_source_port_range_starts_low(monkeypatch):
    """Above the range when it starts low; the kernel's pick when the range leaves no room at all."""
    monkeypatch.setattr(natsserver, "ephemeral_range", lambda: (1024, 40000))
    assert all(40000 < free_port() < 65536 for _ in range(20))
    monkeypatch.setattr(natsserver, "ephemeral_range", lambda: (1024, 65535))
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


def test_a_port_taken_after_the_check_is_named_as_taken(tmp_path, monkeypatch):
    """The race free_port narrows: a port taken between the check and the server's own bind. The
    server's failure then says the port is in use, not merely that it exited."""
    monkeypatch.setattr(natsserver, "check_ports_free", lambda host, ports: None)  # the check passed, then ...
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()  # ... someone took the monitoring port
        busy = holder.getsockname()[1]
        srv = NatsServer(ServerConfig(store_dir=tmp_path / "s", port=free_port(), http_port=busy))
        with pytest.raises(ServerError) as err:
            srv.start(timeout=20)
    assert err.value.reason == Reason.PORT_IN_USE
    assert f"127.0.0.1:{busy}" in str(err.value) and "address already in use" in str(err.value)
    srv.stop()


def test_nats_server_stop_by_pid(tmp_path):
    srv = NatsServer(ServerConfig(store_dir=tmp_path / "s", port=free_port(), http_port=free_port())).start()
    pid = srv.pid
    os.kill(pid, 0)  # alive
    srv.stop()
    time.sleep(0.1)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.slow
async def test_three_server_cluster_replicates_topology(tmp_path):
    ports = [free_port() for _ in range(3)]
    cports = [free_port() for _ in range(3)]
    routes = [f"nats-route://127.0.0.1:{p}" for p in cports]
    servers = []
    try:
        for i in range(3):
            cfg = ServerConfig(
                store_dir=tmp_path / f"n{i}",
                port=ports[i],
                http_port=free_port(),
                server_name=f"n{i}",
                cluster_name="neuron",
                cluster_port=cports[i],
                routes=routes,
            )
            srv = NatsServer(cfg)
            srv.proc = None
            servers.append(srv)
        # start all three before waiting: JetStream needs its peers to become healthy
        import threading

        errors = []

        def run(s):
            try:
                s.start(timeout=60)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(s,)) for s in servers]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors, errors
        url = ",".join(s.url for s in servers)
        nc = await connect(url)
        try:
            js = nc.jetstream()
            for _attempt in range(60):
                try:
                    await ensure_topology(js, replicas=3)
                    break
                except Exception:
                    await asyncio.sleep(0.5)
            info = await js.stream_info(S.STREAM_TELEMETRY)
            assert info.config.num_replicas == 3
            assert len(info.cluster.replicas or []) == 2
        finally:
            await nc.close()
    finally:
        for s in servers:
            s.stop()
