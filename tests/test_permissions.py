"""Bus permissions on a real nats-server: generated users per role, enforced by the server; TLS."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
from pathlib import Path

import nats
import pytest

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.local_swarm import cli
from neuron_bus.natsserver import NatsServer, ServerConfig, free_port
from neuron_bus.topology import connect, ensure_topology
from neuron_bus.trust.permissions import ROLES, new_passwords, render, role_url

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def auth_server(tmp_path):
    passwords = new_passwords()
    srv = NatsServer(
        ServerConfig(store_dir=tmp_path / "nats", port=free_port(), http_port=free_port(), extra=render(passwords))
    )
    srv.start()
    try:
        yield srv, passwords
    finally:
        srv.stop()


async def _observer_is_refused(url: str, passwords: dict[str, str]) -> dict:
    admin = await connect(role_url(url, "admin", passwords["admin"]))
    await ensure_topology(admin.jetstream())
    violations: list[str] = []

    async def on_error(exc):
        violations.append(str(exc))

    observer = await nats.connect(
        servers=[role_url(url, "observer", passwords["observer"])], error_cb=on_error, max_reconnect_attempts=0
    )
    got: dict[str, list] = {"act": [], "assign": [], "telemetry": []}

    async def into(kind):
        async def cb(msg):
            got[kind].append(msg.subject)

        return cb

    await admin.subscribe("neuron.act.x.0.prefill", cb=await into("act"))
    await admin.subscribe("neuron.route.assign.x", cb=await into("assign"))
    await observer.subscribe("neuron.telemetry.>", cb=await into("telemetry"))
    await admin.flush()
    await observer.flush()
    await observer.publish("neuron.act.x.0.prefill", b"\0" * 16)
    await observer.publish("neuron.route.assign.x", b"{}")
    await observer.flush()
    # the JetStream way is refused too: no ack ever comes back
    js_refused = False
    try:
        await observer.jetstream().publish("neuron.act.x.0.prefill", b"\0" * 16, timeout=1.0)
    except Exception:
        js_refused = True
    t = M.GenerationTelemetry(session_id="s1", route_id="r1", model_preset="m", phase="decode")
    await admin.jetstream().publish(S.telemetry("alice", "s1"), M.encode(t))
    # stored telemetry is readable too (a late observer)
    stored = await observer.jetstream().get_last_msg(S.STREAM_TELEMETRY, S.telemetry("alice", "s1"))
    await asyncio.sleep(0.5)
    # reading anything else is refused
    await observer.subscribe("neuron.node.*.heartbeat")
    await observer.flush()
    await asyncio.sleep(0.3)
    stream_count = (await admin.jetstream().stream_info(S.STREAM_PREFILL)).state.messages
    await observer.close()
    await admin.close()
    return {
        "got": got,
        "violations": violations,
        "js_refused": js_refused,
        "stored": stored.data,
        "prefill_messages": stream_count,
    }


def test_observer_can_read_telemetry_and_cannot_publish_activations_or_assignments(auth_server):
    srv, passwords = auth_server
    r = asyncio.run(_observer_is_refused(srv.url, passwords))
    assert r["got"]["act"] == [] and r["got"]["assign"] == []  # never arrived
    assert r["prefill_messages"] == 0 and r["js_refused"]
    text = " ".join(r["violations"]).lower()
    assert "permissions violation" in text and "neuron.act.x.0.prefill" in text and "neuron.route.assign.x" in text
    assert "neuron.node.*.heartbeat" in text  # subscribing elsewhere is refused as well
    assert r["got"]["telemetry"] == ["neuron.telemetry.alice.s1"]
    assert json.loads(r["stored"])["session_id"] == "s1"


@contextlib.contextmanager
def cli_server(store: Path, *options: str):
    """`neuron-bus server` as a process on free ports, ready; yields (process, client port)."""
    port, http = free_port(), free_port()
    proc = subprocess.Popen(
        cli() + ["server", "--port", str(port), "--http-port", str(http), "--store-dir", str(store), *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "ready" in line:
                break
        else:
            raise AssertionError("server exited: " + "".join(seen))
        yield proc, port
    finally:
        proc.terminate()
        proc.wait(20)


async def _tracker_subjects(url: str, passwords: dict[str, str]) -> dict:
    admin = await connect(role_url(url, "admin", passwords["admin"]))
    violations: list[str] = []

    async def on_error(exc):
        violations.append(str(exc))

    def as_role(role):
        return nats.connect(servers=[role_url(url, role, passwords[role])], error_cb=on_error, max_reconnect_attempts=0)

    tracker, other_tracker, worker = await as_role("tracker"), await as_role("tracker"), await as_role("worker")
    relays: list[bytes] = []
    decisions: list[bytes] = []

    async def on_relay(msg):
        relays.append(msg.data)

    async def on_place(msg):
        await msg.respond(b"placed")

    async def on_decision(msg):
        decisions.append(msg.data)

    await other_tracker.subscribe(S.TRACKER_HEARTBEATS, cb=on_relay)
    await tracker.subscribe(S.TRACKER_PLACE, cb=on_place)
    await admin.subscribe(S.PLACEMENT_DECISIONS, cb=on_decision)
    for nc in (admin, tracker, other_tracker):
        await nc.flush()
    await tracker.publish(S.TRACKER_HEARTBEATS, b"from a tracker")
    await worker.publish(S.TRACKER_HEARTBEATS, b"from a worker")  # a node cannot pass itself off as a tracker
    await tracker.publish(S.PLACEMENT_DECISIONS, b"decided")
    placed = (await worker.request(S.TRACKER_PLACE, b"where?", timeout=3)).data  # a --layers auto worker
    await asyncio.sleep(0.3)
    for nc in (worker, other_tracker, tracker, admin):
        await nc.close()
    return {"relays": relays, "decisions": decisions, "placed": placed, "violations": violations}


def test_trackers_pass_heartbeats_on_and_answer_placement_and_a_worker_cannot_forge_a_relay(auth_server):
    srv, passwords = auth_server
    got = asyncio.run(_tracker_subjects(srv.url, passwords))
    assert got["relays"] == [b"from a tracker"] and got["decisions"] == [b"decided"] and got["placed"] == b"placed", got
    assert any(S.TRACKER_HEARTBEATS in v for v in got["violations"]), got["violations"]


def test_wrong_password_is_refused(auth_server):
    srv, passwords = auth_server

    async def go():
        return await nats.connect(
            servers=[role_url(srv.url, "worker", "not-the-password")],
            max_reconnect_attempts=0,
            allow_reconnect=False,
            connect_timeout=3,
        )

    with pytest.raises(Exception) as err:
        asyncio.run(go())
    assert "authorization" in str(err.value).lower()


def test_permissions_command_writes_users_and_server_enforces_them(tmp_path):
    """`neuron-bus permissions` then `neuron-bus server --auth`: the admin provisions, roles connect."""
    out, pw = tmp_path / "nats-auth.conf", tmp_path / "pw.json"
    done = subprocess.run(
        cli() + ["permissions", "--out", str(out), "--password-file", str(pw)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    passwords = json.loads(pw.read_text())
    assert set(passwords) == set(ROLES) and (pw.stat().st_mode & 0o777) == 0o600
    text = out.read_text()
    for role in ROLES:
        assert f'user: "{role}"' in text
    with cli_server(tmp_path / "store", "--auth", str(out), "--password-file", str(pw)) as (proc, port):
        topo = proc.stdout.readline()
        assert "NEURON_AUDIT" in topo and "neuron-flags" in topo

        async def as_worker():
            nc = await connect(role_url(f"nats://127.0.0.1:{port}", "worker", passwords["worker"]))
            try:
                await ensure_topology(nc.jetstream())  # what a worker does at start: allowed
                kv = await nc.jetstream().key_value(S.KV_NODES)
                await kv.put("w", b"{}")
                return (await kv.get("w")).value
            finally:
                await nc.close()

        assert asyncio.run(as_worker()) == b"{}"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_server_serves_tls_with_a_self_signed_certificate(tmp_path):
    import ssl

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    with cli_server(tmp_path / "store", "--tls-cert", str(cert), "--tls-key", str(key)) as (_proc, port):

        async def roundtrip():
            ctx = ssl.create_default_context(cafile=str(cert))
            nc = await connect(f"tls://127.0.0.1:{port}", tls=ctx)
            try:
                return (await nc.jetstream().stream_info(S.STREAM_VALIDATION)).config.name
            finally:
                await nc.close()

        assert asyncio.run(roundtrip()) == S.STREAM_VALIDATION
