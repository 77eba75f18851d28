"""Property-based fuzzing of the tracker, the meter, the auditor and the gateway (hypothesis, real
processes), as tests/test_fuzz.py does for the workers.

One swarm: nats-server, a tracker sampling every session for replay (and metering), an auditor,
two SmolLM2 workers and the gateway. Properties:

- malformed and out-of-range messages on every subject the tracker, its meter and the auditor
  consume (capability reports, heartbeats, route and coverage requests, validation events, audit
  requests, ledger claims, and garbage in the KV buckets they read) change nothing: sessions keep
  their solo output, route and coverage requests are answered throughout with the real nodes
  only, no honest node is flagged, every process stays up, logs no traceback, and comes back
  after a restart with the garbage still stored;
- garbage on the subjects of a session the gateway streams (its tokens, errors, telemetry) leaves
  the streamed text as it was;
- a rogue responder answering the tracker's requests with garbage makes the gateway answer with
  clean errors (never 500, never a hang), and nothing once it is gone.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.client import NeuronClient
from neuron_bus.flow import publish
from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.natsserver import free_port
from neuron_bus.topology import connect
from neuron_bus.trust.meter import KV_METER
from tests.test_trust import flags as trust_flags
from tests.test_trust import read
from tests.threaded_loop import Loop

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]

MODEL = "smollm2-135m"
PROMPT = "The three primary colors are"
LEGIT = ("worker-0", "worker-1")

text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=0x2FF), max_size=24)
ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=40)
numbers = st.one_of(
    st.integers(-(10**18), 10**18), st.floats(allow_nan=False, allow_infinity=False, width=64), st.sampled_from([0, -1])
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, text),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    s = LocalSwarm(
        smollm2_path,
        2,
        workdir=tmp_path_factory.mktemp("fuzz-services"),
        tracker_extra=["--audit-rate", "1.0"],
        auditor_extra=[],
        gateway_port=free_port(),
        gateway_extra=["--chunk-size", "16"],
    )
    s.start(timeout=300)
    yield s
    s.stop()


def mutate(draw, valid: dict) -> bytes:
    """A real message made malformed or out of range: fields dropped, retyped, pushed to extremes."""
    body = dict(valid)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(body))) if body else "x"
        kind = draw(st.sampled_from(["drop", "retype", "extreme", "negative", "range", "node"]))
        if kind == "drop":
            body.pop(key, None)
        elif kind == "retype":
            body[key] = draw(json_values)
        elif kind == "extreme":
            body[key] = draw(st.sampled_from([10**30, -(10**30), 1e308, -1e308, "", "x" * 5000, [], {}]))
        elif kind == "negative" and isinstance(body.get(key), int | float):
            body[key] = -abs(body[key]) - 1
        elif kind == "range":
            body["layer_start"], body["layer_end"] = draw(st.tuples(st.integers(-5, 40), st.integers(-5, 40)))
        else:
            body["node_id"] = draw(st.one_of(ids.map(lambda s: "fz-" + s), text, st.just("")))
    if body.get("node_id") in LEGIT:
        body["node_id"] = "fz-" + body["node_id"]  # near-valid messages never impersonate a real node
    return json.dumps(body).encode()


def invalid(kind, data: bytes) -> bytes:
    """``data`` if it does not decode as ``kind``; else the same made out of range (an empty layer
    range): a valid report and heartbeat for one fake id would be a sybil node, not a malformed one."""
    try:
        M.decode(data, kind)
    except Exception:
        return data
    body = json.loads(data)
    body["layer_end"] = body.get("layer_start", 0)
    return json.dumps(body).encode()


def garbage(draw) -> bytes:
    return draw(
        st.one_of(
            st.binary(max_size=2048),
            json_values.map(lambda v: json.dumps(v).encode()),
            st.just(b"{" * 5000),  # deep nesting
            st.just(b'{"node_id": "fz-x", "seq": 1'),  # truncated
        )
    )


async def legit_messages(url: str) -> dict[str, dict]:
    """Real messages of each consumed kind, to mutate."""
    nc = await connect(url)
    try:
        js = nc.jetstream()
        kv = await js.key_value(S.KV_NODES)
        caps = msgspec.to_builtins(M.decode((await kv.get("worker-0")).value, M.CapabilityReport))
        got: list[bytes] = []

        async def cb(msg):
            got.append(msg.data)

        sub = await nc.subscribe(S.node_heartbeat("worker-0"), cb=cb)
        while not got:
            await asyncio.sleep(0.1)
        await sub.unsubscribe()
        events = [e async for e in _stored(js, S.STREAM_VALIDATION, S.VALIDATION_ALL, M.ValidationEvent)]
        claims = [e async for e in _stored(js, S.STREAM_LEDGER, S.LEDGER_ALL, M.LedgerEntry)]
        return {
            "caps": caps,
            "heartbeat": json.loads(got[0]),
            "route": msgspec.to_builtins(M.RouteRequest(request_id="r", model_preset=MODEL)),
            "validation": msgspec.to_builtins(events[-1]),
            "claim": msgspec.to_builtins(claims[-1]),
            "audit": msgspec.to_builtins(M.AuditRequest(session_id=events[-1].session_id, event_id="e")),
        }
    finally:
        await nc.close()


async def _stored(js, stream, subject, kind):
    from neuron_bus.trust.events import stored

    async for e in stored(js, stream, subject, kind):
        yield e


def solo(loop: Loop, client: NeuronClient) -> list[int]:
    async def run():
        g = await client.complete(PROMPT, sampling=M.SamplingParams(max_tokens=8, ignore_eos=True))
        return g.tokens

    return loop.run(run())


def no_traceback(swarm, *names: str) -> None:
    for name in names:
        log = (swarm.workdir / f"{name}.log").read_text(errors="replace")
        assert "Traceback" not in log and "exception was never retrieved" not in log, swarm.log_tail(name, 40)


@st.composite
def tracker_message(draw, legit: dict):
    """(how, subject, body): one malformed message for the tracker, its meter or the auditor."""
    target = draw(st.sampled_from(["caps", "heartbeat", "route", "coverage", "validation", "claim", "audit", "kv"]))
    body = garbage(draw) if draw(st.integers(0, 3)) == 0 else None
    node = draw(st.one_of(st.sampled_from(LEGIT), ids.map(lambda s: "fz-" + s)))
    session = "fz-" + draw(ids)
    if target in ("caps", "heartbeat"):
        if body is None:
            body = invalid(M.CapabilityReport if target == "caps" else M.NodeHeartbeat, mutate(draw, legit[target]))
        elif node in LEGIT and draw(st.booleans()):
            pass  # garbage under a real node's subject: ignored, the real node unaffected
        subject = S.node_caps(node) if target == "caps" else S.node_heartbeat(node)
        return "core", subject, body
    if target in ("route", "coverage"):
        body = body if body is not None else mutate(draw, legit["route"])
        return "request", S.ROUTE_REQUEST if target == "route" else S.TRACKER_COVERAGE, body
    if target == "validation":
        # a route nobody assigned, naming the real nodes: replays of it must pin nothing on them
        ev = dict(legit["validation"], session_id=session, event_id=draw(ids), route_id="fz-" + draw(ids))
        data = mutate(draw, ev)
        try:
            if json.loads(data).get("route_id") == legit["validation"]["route_id"]:
                data = json.dumps(dict(json.loads(data), route_id="fz-x")).encode()
        except (AttributeError, ValueError):
            pass
        return "js", S.validation(session), body if body is not None else data
    if target == "claim":
        claim = dict(legit["claim"], entry_id=draw(ids), session_id=draw(st.sampled_from([session, "x" * 200, ""])))
        return "js", S.ledger(node if node not in LEGIT else "fz-" + node), body or mutate(draw, claim)
    if target == "audit":
        req = dict(legit["audit"], session_id=draw(st.sampled_from([session, legit["audit"]["session_id"]])))
        return "js", S.AUDIT_REQUEST, body if body is not None else mutate(draw, req)
    bucket = draw(st.sampled_from([S.KV_NODES, S.KV_FLAGS, KV_METER]))
    return "kv", f"{bucket}/fz-{draw(ids)}", body if body is not None else mutate(draw, legit["caps"])


async def fire(client: NeuronClient, batch) -> dict[str, int]:
    sent = {"core": 0, "request": 0, "js": 0, "kv": 0}
    for how, subject, body in batch:
        if how == "core":
            await client.nc.publish(subject, body)
        elif how == "request":
            reply = await client.nc.request(subject, body, timeout=10)  # answered, never silence
            msgspec.json.decode(reply.data)
        elif how == "js":
            try:
                await publish(client.js, subject, body, max_wait=5)
            except Exception:
                continue  # refused by the server (too big): nobody consumed it
        else:
            bucket, key = subject.split("/", 1)
            await (await client.js.key_value(bucket)).put(key, body)
        sent[how] += 1
    await client.nc.flush()
    return sent


async def check_tracker(client: NeuronClient) -> None:
    """Route and coverage requests answered, with the real nodes only."""
    route = await client.route(MODEL)
    assert {h.node_id for h in route.hops} <= set(LEGIT), route.hops
    report = await client.coverage(MODEL, timeout=10, wait=0)
    assert {n for m in report.models for n in m.nodes_live} == set(LEGIT), report.models


def test_malformed_messages_never_disturb_the_tracker_meter_and_auditor(swarm):
    loop = Loop()
    client = loop.run(NeuronClient.connect(swarm.url))
    reference = solo(loop, client)
    legit = loop.run(legit_messages(swarm.url))
    state: dict = {"outputs": [], "errors": [], "stop": False, "sent": {}}

    async def victim():
        while not state["stop"]:
            try:
                g = await client.complete(PROMPT, sampling=M.SamplingParams(max_tokens=8, ignore_eos=True))
                state["outputs"].append(g.tokens)
            except Exception as exc:  # recorded: the property fails on any
                state["errors"].append(repr(exc))

    victim_task = loop.spawn(victim())

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(tracker_message(legit), min_size=10, max_size=10))
    def malformed_messages_are_ignored(batch):
        for how, n in loop.run(fire(client, batch)).items():
            state["sent"][how] = state["sent"].get(how, 0) + n
        loop.run(check_tracker(client))
        assert all(p.poll() is None for p in swarm.procs.values())

    try:
        malformed_messages_are_ignored()
        time.sleep(3.0)  # the meter settles, the auditor drains its requests
        state["stop"] = True
        victim_task.result(180)
        assert not state["errors"], state["errors"][:3]
        assert state["outputs"] and all(out == reference for out in state["outputs"])
        flags = loop.run(read(swarm.url, trust_flags))
        assert not any(flags.get(n) and flags[n].flagged for n in LEGIT), flags
        assert sum(state["sent"].values()) >= 500, state["sent"]
        print(f"fuzzed the tracker, meter and auditor: {state['sent']}; {len(state['outputs'])} sessions unchanged")
        no_traceback(swarm, "tracker", "auditor")
        # they come back with the garbage still stored (KV, streams), and serve
        for name in ("tracker", "auditor"):
            swarm.kill(name)
            swarm.respawn(name)
        time.sleep(2.0)
        loop.run(check_tracker(client), timeout=60)
        assert solo(loop, client) == reference
        assert all(p.poll() is None for p in swarm.procs.values())
        no_traceback(swarm, "tracker", "auditor")
    finally:
        state["stop"] = True
        loop.run(client.close())
        loop.close()


# ------------------------------------------------------------------------------ the gateway


def sse(base: str, body: dict, on_session=None) -> tuple[int, str]:
    """Stream a completion from the gateway; (status, the text streamed)."""
    req = urllib.request.Request(
        f"{base}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    out = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if on_session and not out:
                on_session(chunk["id"].removeprefix("cmpl-"))
            assert "error" not in chunk, chunk
            out.append(chunk["choices"][0]["text"])
        return resp.status, "".join(out)


@st.composite
def session_message(draw):
    """A malformed message for a session's token, error or telemetry subject (no valid next token,
    no fatal error, no failed telemetry: forging those is authentication's business, not parsing's)."""
    kind = draw(st.sampled_from(["token", "error", "telemetry"]))
    if draw(st.integers(0, 2)) == 0:
        return kind, garbage(draw)
    if kind == "token":
        index = draw(st.sampled_from([-1, 10**9, 0]))  # never the next one: negative, far ahead, a repeat
        delta = {"session_id": "SID", "index": index, "token_id": draw(st.integers(-5, 10**6)), "text": draw(text)}
        data = mutate(draw, delta) if draw(st.booleans()) else json.dumps(delta).encode()
        try:
            if M.decode(data, M.TokenDelta).index not in (-1, 0, 10**9):
                data = json.dumps(dict(json.loads(data), index=10**9)).encode()  # never a next token
        except Exception:
            pass
        return kind, data
    if kind == "error":
        err = {"session_id": "SID", "route_id": "r", "phase": "decode", "code": "x", "message": "y", "fatal": False}
        body = json.loads(mutate(draw, err))
        if not isinstance(body, dict) or body.get("fatal") is not False:
            body = {**(body if isinstance(body, dict) else {}), "fatal": "maybe"}  # never a valid fatal one
        return kind, json.dumps(body).encode()
    tel = {"session_id": "SID", "route_id": "r", "model_preset": MODEL, "phase": draw(st.sampled_from(["x", 3, None]))}
    data = mutate(draw, tel)
    try:
        if M.decode(data, M.GenerationTelemetry).phase == "failed":
            data = b"{}"  # never a valid failure
    except Exception:
        pass
    return kind, data


def test_garbage_on_a_streamed_sessions_subjects_leaves_its_text_alone(swarm):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "ignore_eos": True, "stream": True}
    status, reference = sse(swarm.gateway_url, body)
    assert status == 200 and reference
    loop = Loop()
    client = loop.run(NeuronClient.connect(swarm.url))

    @settings(max_examples=8, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(messages=st.lists(session_message(), min_size=40, max_size=40))
    def garbage_is_ignored(messages):
        fired = []

        def on_session(session_id: str) -> None:
            async def burst():
                for kind, data in messages:
                    subject = {"token": S.session_tokens, "error": S.session_error, "telemetry": S.telemetry}[kind]
                    # the gateway's sessions are owned by its identity: "public" on this bus, as the test's client
                    await client.nc.publish(
                        subject(client.owner, session_id), data.replace(b"SID", session_id.encode())
                    )
                await client.nc.flush()

            fired.append(loop.spawn(burst()))

        status, streamed = sse(swarm.gateway_url, body, on_session)
        fired[0].result(30)
        assert status == 200 and streamed == reference

    try:
        garbage_is_ignored()
        no_traceback(swarm, "gateway")
    finally:
        loop.run(client.close())
        loop.close()


def test_a_rogue_responder_answering_garbage_gets_clean_errors_from_the_gateway(swarm):
    loop = Loop()

    async def rogue():
        nc = await connect(swarm.url)

        async def answer(msg):
            await msg.respond(b'{"type": "route", "route_id": 7}' if len(msg.data) % 2 else b"\x00garbage")

        subs = [
            await nc.subscribe(S.ROUTE_REQUEST, queue="neuron-tracker", cb=answer),
            await nc.subscribe(S.TRACKER_COVERAGE, queue="neuron-tracker", cb=answer),
        ]
        await nc.flush()
        return nc, subs

    nc, subs = loop.run(rogue())
    statuses = []
    try:
        for i in range(16):
            req = urllib.request.Request(
                f"{swarm.gateway_url}/v1/completions",
                data=json.dumps({"model": MODEL, "prompt": "Hi" * (i + 1), "max_tokens": 2}).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    statuses.append(resp.status)
            except urllib.error.HTTPError as exc:
                err = json.loads(exc.read())["error"]
                statuses.append(exc.code)
                assert exc.code in (502, 503) and err["code"] in ("bad_reply", "no_route", "no_tracker"), err
        assert 502 in statuses, statuses  # some requests met the rogue, and were told so
    finally:
        loop.run(nc.close())
    status, _ = sse(swarm.gateway_url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True})
    assert status == 200
    loop.close()
    no_traceback(swarm, "gateway")
