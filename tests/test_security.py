"""Security acceptance on real processes: a nats-server trusting an operator (decentralized auth,
`neuron-bus credentials`), a tracker and two SmolLM2 workers each on its own credential, clients
alice and bob on theirs, and spare node credentials playing the stranger who joined the swarm.

- per-node identity: node A's credential cannot publish heartbeats, caps, KV reports or ledger
  entries as node B (the server refuses: permissions violation) and the tracker never lists B;
- per-node subjects: a node's credential sees no activation or control message of a route it does
  not serve (not by subscribing, not through JetStream, not through inboxes);
- per-session keys: an activation copied from the wire and replayed, or forged with a valid-looking
  header into a route's subject, is refused before any model work and counted; the output is the
  undisturbed one;
- private outputs: bob cannot read alice's tokens, nor close or resume her session;
- admission and revocation without a restart: a credential issued after the server started
  connects; revoked, it is dropped and refused.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import nats
import numpy as np
import pytest

from neuron_bus import codec
from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.client import NeuronClient
from neuron_bus.errors import RouteError
from neuron_bus.flow import publish
from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.routes import hop_header
from neuron_bus.topology import connect
from neuron_bus.trust import sealing
from neuron_bus.trust.identity import push_account
from neuron_bus.trust.ledger import read_ledger
from tests import wire

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PROMPT = "The three primary colors are"
SAMPLING = M.SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    s = LocalSwarm(smollm2_path, 2, workdir=tmp_path_factory.mktemp("security"), identity=True)
    s.start(timeout=300)
    for name, role in (("alice", "client"), ("bob", "client"), ("node-a", "worker"), ("stranger", "worker")):
        s.issue(name, role)
    yield s
    s.stop()


def run(coro, timeout: float = 240):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def raw(swarm, name: str, violations: list[str] | None = None):
    """A plain nats-py connection on ``name``'s credential (its private inbox), recording violations."""

    async def on_error(exc):
        if violations is not None:
            violations.append(str(exc).lower())

    return await nats.connect(
        servers=[swarm.plain_url],
        user_credentials=str(swarm.creds[name]),
        inbox_prefix=f"_INBOX.{name}",
        error_cb=on_error,
        max_reconnect_attempts=0,
        allow_reconnect=False,
    )


async def client(swarm, name: str) -> NeuronClient:
    return await NeuronClient.connect(swarm.plain_url, creds=str(swarm.creds[name]))


def test_a_node_cannot_publish_as_another_and_the_tracker_never_lists_it(swarm):
    async def scenario():
        violations: list[str] = []
        a = await raw(swarm, "node-a", violations)
        hb = M.NodeHeartbeat(node_id="node-b", seq=1, ts=time.time(), layer_start=0, layer_end=30, cache_abi="x")
        caps = M.CapabilityReport(
            node_id="node-b", model_preset="smollm2-135m", model_revision="r", artifact_id="", backend_id="llama-cpp",
            layer_start=0, layer_end=30, n_layers_total=30, hidden_size=576, cache_abi="x",
            prefill_tokens_per_second=1e6, decode_tokens_per_second=1e6, model_arch="llama",
            supported_runtime="llama.cpp", supports_prefill=True, supports_decode_step=True,
            supports_layer_range=True, supports_partial_artifacts=True, cache_bytes_per_token_estimate=1,
        )  # fmt: skip
        entry = M.LedgerEntry(entry_id=uuid.uuid4().hex, node_id="node-b", kind="inference", ts=time.time())
        for _ in range(3):
            # as node B on B's subjects: refused by the server
            await a.publish(S.node_heartbeat("node-b"), M.encode(hb))
            await a.publish(S.node_caps("node-b"), M.encode(caps))
            await a.publish(S.ledger("node-b"), M.encode(entry))
            await a.publish(f"$KV.{S.KV_NODES}.node-b", M.encode(caps))
            # as node B on A's own subjects: delivered, and ignored by the tracker and the ledger
            await a.publish(S.node_heartbeat("node-a"), M.encode(hb))
            await a.publish(S.node_caps("node-a"), M.encode(caps))
            await a.flush()
            await asyncio.sleep(0.5)
        js_refused = False
        try:
            await a.jetstream().publish(S.ledger("node-b"), M.encode(entry), timeout=1.0)
        except Exception:
            js_refused = True
        await a.jetstream().publish(S.ledger("node-a"), M.encode(entry), timeout=5.0)  # A's subject, B's name
        await asyncio.sleep(1.5)
        async with await client(swarm, "alice") as c:
            report = await c.coverage()
        admin = await connect(swarm.url, **swarm.admin)
        ledger = await read_ledger(admin.jetstream())
        kv = await admin.jetstream().key_value(S.KV_NODES)
        keys = await kv.keys()
        await admin.close()
        await a.close()
        return violations, js_refused, report, ledger, keys

    violations, js_refused, report, ledger, keys = run(scenario())
    text = " ".join(violations)
    assert "permissions violation" in text
    for subject in ("neuron.node.node-b.heartbeat", "neuron.node.node-b.caps", "neuron.ledger.node-b"):
        assert subject in text, (subject, text)
    assert js_refused
    assert "node-b" not in {n.node_id for n in report.nodes}  # the tracker never lists B
    assert {n.node_id for n in report.nodes} >= {"worker-0", "worker-1"}
    assert "node-b" not in keys
    assert all(e.node_id != "node-b" for e in ledger)


async def _spy(swarm, sink: list, violations: list[str]):
    """The stranger: subscribes to everything it can think of; whatever arrives goes into ``sink``."""
    nc = await raw(swarm, "stranger", violations)

    async def cb(msg):
        sink.append(msg.subject)

    for subject in ("neuron.act.>", "neuron.node.*.ctl", "neuron.node.worker-0.ctl", "_INBOX.>", "neuron.session.>"):
        await nc.subscribe(subject, cb=cb)
    await nc.subscribe(S.node_inputs("stranger"), cb=cb)  # its own inputs: allowed, nothing comes
    await nc.flush()
    js = nc.jetstream()
    refused = []
    for attempt in (
        lambda: js.consumers_info(S.STREAM_PREFILL),
        lambda: js.get_msg(S.STREAM_DECODE, seq=1),
        lambda: js.subscribe("neuron.act.worker-1.>", stream=S.STREAM_DECODE, cb=cb),
        lambda: js.subscribe("neuron.session.alice.>", stream=S.STREAM_TOKENS, cb=cb),
    ):
        try:
            await asyncio.wait_for(attempt(), 3)
        except Exception:
            refused.append(True)
        else:
            refused.append(False)
    return nc, refused


def test_a_node_sees_nothing_of_routes_it_does_not_serve_and_bob_nothing_of_alice(swarm):
    async def scenario():
        violations: list[str] = []
        seen: list[str] = []
        spy, refused = await _spy(swarm, seen, violations)
        bob_seen: list[str] = []
        bob = await raw(swarm, "bob", violations)

        async def bob_cb(msg):
            bob_seen.append(msg.subject)

        for subject in ("neuron.session.>", "neuron.session.alice.>", "_INBOX.alice.>"):
            await bob.subscribe(subject, cb=bob_cb)
        telemetry: list[bytes] = []

        async def tel(msg):
            telemetry.append(msg.data)

        await bob.subscribe("neuron.telemetry.>", cb=tel)  # public: allowed
        await bob.flush()
        async with await client(swarm, "alice") as alice:
            g = await alice.complete(PROMPT, sampling=SAMPLING)
        await asyncio.sleep(0.5)
        await spy.close()
        await bob.close()
        return violations, seen, refused, bob_seen, telemetry, g

    violations, seen, refused, bob_seen, telemetry, g = run(scenario())
    assert len(g.tokens) == 12 and g.text
    assert seen == [] and bob_seen == []
    assert all(refused), refused
    text = " ".join(violations)
    for subject in (
        "neuron.act.>",
        "neuron.node.*.ctl",
        "neuron.node.worker-0.ctl",
        "_inbox.>",
        "neuron.session.alice.>",
    ):
        assert subject.lower() in text, (subject, text)
    ours = [t for t in telemetry if g.session_id.encode() in t]
    assert ours and all(g.text.strip().encode() not in t for t in ours)  # public telemetry, no text


async def _probe(c: NeuronClient, route: M.RouteAssignment) -> tuple[str, list[str]]:
    """Open a session alice never feeds, with link keys; returns it and its keys."""
    sid, keys = "probe" + uuid.uuid4().hex[:8], [sealing.new_key() for _ in route.hops]
    for i, hop in enumerate(route.hops):
        await c.control(
            hop.node_id,
            M.SessionOpen(
                session_id=sid, route=route, hop_index=i, prompt_tokens=4, n_ctx=512, owner=c.owner,
                input_key=keys[i], output_key=keys[(i + 1) % len(keys)],
            ),
        )  # fmt: skip
    return sid, keys


def test_replayed_and_forged_activations_are_refused_and_counted_and_bob_cannot_touch_alices_session(swarm):
    async def scenario():
        admin = await connect(swarm.url, **swarm.admin)  # stands in for a tap on the wire
        captured: list[tuple[str, dict, bytes]] = []

        async def capture(msg):
            captured.append((msg.subject, dict(msg.headers or {}), msg.data))

        await admin.subscribe("neuron.act.>", cb=capture)
        stranger = await raw(swarm, "stranger")
        sjs = stranger.jetstream()
        async with await client(swarm, "alice") as alice, await client(swarm, "bob") as bob:
            route = await alice.route("smollm2-135m")
            ids = (await alice.control(route.hops[0].node_id, M.TokenizeRequest(text=PROMPT))).tokens
            solo = (await alice.complete(prompt_tokens=ids, route=route, sampling=SAMPLING)).tokens
            before = {h.node_id: await alice.sessions(h.node_id) for h in route.hops}
            calls = {n: r.backend_forward_calls for n, r in before.items()}
            sid, _keys = await _probe(alice, route)
            # while a second session decodes, the stranger replays every copy and forges into the probe
            gen = asyncio.create_task(alice.complete(prompt_tokens=ids, route=route, sampling=SAMPLING))
            await asyncio.sleep(0.3)  # some of the live session's messages are on the wire by now
            sent = 0
            for subject, headers, body in list(captured):  # the copies so far (the replays are captured too)
                moved = wire.edit(headers, session_id=sid, seq=0, position=0)
                # replayed (its session is closed), and a real message moved onto the probe
                for h in (headers, moved):
                    await publish(sjs, subject, body, h)
                    sent += 1
            hop1 = route.hops[1]
            forged = hop_header(route, 1, sid, 0, "prefill", 0, "f32")
            h, b = codec.encode(forged, np.zeros((4, 576), dtype=np.float32))
            h, b = sealing.seal(forged, h, b, sealing.new_key(), False)  # valid-looking, signed with a guess
            await publish(sjs, S.hop_input(hop1.node_id, route.route_id, 1, "prefill", sid), b, h)
            sent += 1
            live = await gen
            # bob, who knows the session id, can neither close nor move alice's probe session
            close = M.SessionClose(session_id=sid, route_id=route.route_id)
            bob_close = await asyncio.gather(
                *(bob.control(h.node_id, close) for h in route.hops), return_exceptions=True
            )
            resume = M.SessionResume(
                open=M.SessionOpen(
                    session_id=sid, route=route, hop_index=1, prompt_tokens=4, n_ctx=512, owner="bob",
                    input_key=sealing.new_key(), output_key=sealing.new_key(),
                ),
                position=0, replay_end=4,
            )  # fmt: skip
            bob_resume = await asyncio.gather(bob.control(hop1.node_id, resume), return_exceptions=True)
            await asyncio.sleep(1.0)
            after = {h.node_id: await alice.sessions(h.node_id) for h in route.hops}
        await stranger.close()
        await admin.close()
        return route, solo, live, before, after, calls, sid, sent, bob_close, bob_resume

    route, solo, live, before, after, calls, sid, sent, bob_close, bob_resume = run(scenario())
    assert live.tokens == solo  # the undisturbed output
    grew: dict[str, int] = {}
    for node, report in after.items():
        for k, v in report.rejected.items():
            grew[k] = grew.get(k, 0) + v - before[node].rejected.get(k, 0)
    assert sum(grew.values()) >= sent, (grew, sent)
    assert grew.get("bad_mac", 0) >= 1 and grew.get("unknown_session", 0) >= 1, grew
    for report in after.values():  # the probe was never fed
        assert [s.position for s in report.sessions if s.session_id == sid] == [0]
    # no model work for any of it: the live generation's calls only (as many as the solo run's)
    solo_calls = {n: calls[n] for n in after}  # every call so far: this module's sessions, solo last
    assert all(after[n].backend_forward_calls - calls[n] <= solo_calls[n] for n in after)
    assert all(isinstance(r, RouteError) and r.reason == "not_owner" for r in bob_close), bob_close
    # refused either way: his keys are not the session's, and he has no proof
    assert all(isinstance(r, RouteError) and r.reason in ("not_owner", "session_exists") for r in bob_resume)


def test_only_a_tracker_may_ask_a_node_to_move(swarm):
    """MoveRange makes a node drop its layers: trackers alone may publish on ``.move``, and a move
    sent on ``.ctl`` (which every client may ask) is refused."""
    move = M.MoveRange(model_preset="smollm2-135m", artifact_id="x", layer_start=0, layer_end=5, reason="spoofed")

    async def scenario():
        violations: list[str] = []
        a = await raw(swarm, "node-a", violations)
        await a.publish(S.node_move("worker-0"), M.encode(move))  # another worker: refused by the server
        await a.flush()
        async with await client(swarm, "alice") as alice:
            refused_publish = False
            try:  # a client: not even delivered
                await alice.nc.request(S.node_move("worker-0"), M.encode(move), timeout=2.0)
            except Exception:
                refused_publish = True
            on_ctl = await asyncio.gather(alice.control("worker-0", move), return_exceptions=True)
            await asyncio.sleep(1.0)
            report = await alice.coverage()
        await a.close()
        return violations, refused_publish, on_ctl, report

    violations, refused_publish, on_ctl, report = run(scenario())
    assert any("neuron.node.worker-0.move" in v for v in violations), violations
    assert refused_publish
    assert isinstance(on_ctl[0], RouteError) and on_ctl[0].reason == "not_permitted", on_ctl
    worker0 = [n for n in report.nodes if n.node_id == "worker-0"]
    assert worker0 and (worker0[0].layer_start, worker0[0].layer_end) != (0, 5)  # it kept its range


def test_a_node_is_admitted_and_revoked_without_restarting_the_server(swarm):
    async def scenario():
        path = swarm.issue("late-node", "worker")  # issued after the server started
        nc = await raw(swarm, "late-node")
        await nc.publish(S.node_heartbeat("late-node"), b"{}")
        await nc.flush()
        assert swarm.authority is not None
        swarm.authority.revoke("late-node")
        answer = await push_account(swarm.plain_url, swarm.authority)
        for _ in range(50):
            if not nc.is_connected:
                break
            await asyncio.sleep(0.1)
        dropped = not nc.is_connected
        await nc.close()
        try:
            again = await nats.connect(
                servers=[swarm.plain_url],
                user_credentials=str(path),
                max_reconnect_attempts=0,
                allow_reconnect=False,
                connect_timeout=3,
            )
        except Exception as exc:
            refused = str(exc)
        else:
            await again.close()
            refused = ""
        return path, answer, dropped, refused

    path, answer, dropped, refused = run(scenario())
    assert path.is_file()
    assert '"code":200' in answer.replace(" ", "") or "jwt updated" in answer.lower(), answer
    assert dropped
    assert refused and "authorization" in refused.lower(), refused


def test_workers_refuse_sessions_without_keys_on_an_authenticated_bus(swarm):
    async def scenario():
        async with await client(swarm, "alice") as c:
            route = await c.route("smollm2-135m")
            bare = M.SessionOpen(
                session_id="bare" + uuid.uuid4().hex[:6], route=route, hop_index=0, prompt_tokens=4, n_ctx=512
            )
            try:
                await c.control(route.hops[0].node_id, msgspec.structs.replace(bare, owner=c.owner))
            except RouteError as exc:
                return exc.reason
        return None

    assert run(scenario()) == "unauthenticated"
