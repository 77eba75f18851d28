"""Property-based fuzzing of a serving worker (hypothesis, real processes).

While a real session decodes again and again on the route, thousands of malformed messages hit
every subject the workers consume: activation messages captured from the route with mutated
headers and bodies (retargeted at closed, unknown, live and probe sessions, seq and positions made
invalid), raw garbage, and garbage on the control subjects. Property: the live session's output
never changes, the workers stay up and answer, every data-plane message is rejected and counted,
and the probe session (open, never fed) is never advanced.
"""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_bus import codec
from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.client import NeuronClient
from neuron_bus.flow import publish
from neuron_bus.local_swarm import LocalSwarm
from tests import wire
from tests.threaded_loop import Loop

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

EXAMPLES, BATCH = 100, 20  # 2000 malformed messages
PROMPT = "The three primary colors are"
SAFE_SEQ = 10**9  # far ahead of any real seq: out_of_order, never the next step of a live session

ascii_text = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=24)
token_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=40)


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    s = LocalSwarm(smollm2_path, 2, workdir=tmp_path_factory.mktemp("fuzz"))
    s.start()
    yield s
    s.stop()


def mutate(draw, fields: dict, body: bytes) -> tuple[dict | str | None, bytes]:
    """Mutated header fields (or the activation header's text replaced whole, or None: no headers) and body."""
    fields = dict(fields)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(
            st.sampled_from(
                [
                    "drop",
                    "text",
                    "int",
                    "dtype",
                    "encoding",
                    "shape",
                    "phase",
                    "layers",
                    "skip_position",
                    "truncate",
                    "extend",
                    "random_body",
                    "empty_body",
                    "zstd_garbage",
                    "huge_shape",
                    "header_text",
                    "no_headers",
                ]
            )
        )
        key = draw(st.sampled_from(sorted(fields))) if fields else "seq"
        if kind == "drop" and fields:
            fields.pop(key)
        elif kind == "text":
            fields[key] = draw(ascii_text)
        elif kind == "int":
            fields[draw(st.sampled_from(["position", "seq", "layer_start", "layer_end"]))] = draw(
                st.integers(-(10**12), 10**12)
            )
        elif kind == "dtype":
            fields["dtype"] = draw(st.sampled_from(["f32", "bf16", "i32", "f64", "", "F32"]))
        elif kind == "encoding":
            fields["encoding"] = draw(st.sampled_from(["raw", "zstd", "gzip", ""]))
        elif kind == "shape":
            fields["shape"] = draw(st.lists(st.integers(-5, 5000), max_size=3))
        elif kind == "phase":
            fields["phase"] = draw(st.sampled_from(["prefill", "decode", "finalizing", ""]))
        elif kind == "layers":
            fields["layer_start"], fields["layer_end"] = draw(st.tuples(st.integers(-3, 40), st.integers(-3, 40)))
        elif kind == "skip_position":
            position = fields.get("position")
            fields["position"] = (position if type(position) is int else 0) + draw(st.integers(1, 10**6))
        elif kind == "truncate":
            body = body[: draw(st.integers(0, max(0, len(body) - 1)))]
        elif kind == "extend":
            body = body + draw(st.binary(min_size=1, max_size=64))
        elif kind == "random_body":
            body = draw(st.binary(max_size=4096))
        elif kind == "empty_body":
            body = b""
        elif kind == "zstd_garbage":
            fields["encoding"] = "zstd"
            body = draw(
                st.sampled_from(
                    [zstandard.ZstdCompressor().compress(body[: len(body) // 2]), b"\x28\xb5\x2f\xfd" + body[:64]]
                )
            )
        elif kind == "huge_shape":
            fields["shape"] = [draw(st.integers(10**5, 10**7)), 576]
        elif kind == "header_text":
            return draw(ascii_text), body
        elif kind == "no_headers":
            return None, body
    return fields, body


def make_safe(fields: dict, target: str) -> None:
    """Keep a message malformed for the live and probe sessions whatever the mutations did."""

    def as_int(name: str):
        value = fields.get(name)
        return value if type(value) is int else None  # exactly what the codec takes for an int

    if target == "live" and as_int("seq") is not None and 0 <= as_int("seq") < SAFE_SEQ:
        fields["seq"] = SAFE_SEQ + as_int("seq")
    if target == "probe" and as_int("seq") == 0 and as_int("position") == 0:
        fields["position"] = 7


def wire_headers(mutated: dict | str | None, mac: str | None) -> dict[str, str] | None:
    """The headers a mutated message goes out with (its original MAC, which no longer matches)."""
    if mutated is None:
        return None
    text = mutated if isinstance(mutated, str) else json.dumps(mutated)
    return {codec.HEADER: text} | ({codec.MAC_HEADER: mac} if mac else {})


def test_malformed_messages_never_disturb_a_decoding_session(swarm):
    loop = Loop()
    state: dict = {"live": "none", "outputs": [], "errors": [], "stop": False}
    sampling = M.SamplingParams(max_tokens=24, ignore_eos=True)

    async def setup():
        client = await NeuronClient.connect(swarm.url)
        route = await client.route("smollm2-135m")
        captured: list[tuple[str, dict, bytes]] = []

        async def capture(msg):
            captured.append((msg.subject, dict(msg.headers or {}), msg.data))

        sub = await client.nc.subscribe(f"neuron.act.*.{route.route_id}.>", cb=capture)
        ids = (await client.control(route.hops[0].node_id, M.TokenizeRequest(text=PROMPT))).tokens
        solo = (await client.complete(prompt_tokens=ids, route=route, sampling=sampling, chunk_size=4)).tokens
        await sub.unsubscribe()
        probe = f"probe{int(time.time() * 1000)}"
        for i, hop in enumerate(route.hops):
            await client.control(
                hop.node_id, M.SessionOpen(session_id=probe, route=route, hop_index=i, prompt_tokens=4, n_ctx=512)
            )
        return client, route, ids, solo, captured, probe

    client, route, ids, solo, captured, probe = loop.run(setup())
    assert any(wire.fields(h)["phase"] == "decode" for _, h, _ in captured) and any(
        wire.fields(h)["phase"] == "prefill" for _, h, _ in captured
    )
    nodes = [h.node_id for h in route.hops]

    async def victim():
        while not state["stop"]:
            try:
                tokens = []
                async for ev in client.generate(prompt_tokens=ids, route=route, sampling=sampling, chunk_size=4):
                    state["live"] = ev.session_id
                    if isinstance(ev, M.TokenDelta):
                        tokens.append(ev.token_id)
                state["outputs"].append(tokens)
            except Exception as exc:  # recorded: the property below fails on any
                state["errors"].append(repr(exc))

    async def rejected_total() -> dict[str, int]:
        total: dict[str, int] = {}
        for node in nodes:
            for k, v in (await client.sessions(node)).rejected.items():
                total[k] = total.get(k, 0) + v
        return total

    before = loop.run(rejected_total())
    victim_task = asyncio.run_coroutine_threadsafe(victim(), loop.loop)
    sent = {"data": 0, "control": 0}

    @st.composite
    def data_message(draw):
        if draw(st.integers(0, 9)) == 0:  # raw garbage on an activation subject
            hop = draw(st.integers(0, 1))
            subject = S.hop_input(
                route.hops[hop].node_id, route.route_id, hop, draw(st.sampled_from(["prefill", "decode"])), "fuzz"
            )
            headers = draw(st.one_of(st.none(), st.dictionaries(token_ids, ascii_text, max_size=6)))
            return subject, headers or None, draw(st.binary(max_size=2048)), "garbage"
        by_phase = [[c for c in captured if wire.fields(c[1])["phase"] == p] for p in ("prefill", "decode")]
        subject, headers, body = draw(st.one_of(*(st.sampled_from(group) for group in by_phase)))
        target = draw(st.sampled_from(["closed", "unknown", "live", "probe"]))
        fields = wire.fields(headers)
        if target == "unknown":
            fields["session_id"] = draw(token_ids)
        elif target == "live":
            fields["session_id"] = state["live"]
        elif target == "probe":  # the probe expects seq 0 at position 0: only the position is wrong then
            fields["session_id"] = probe
            fields["seq"] = 0
        mutated, body = mutate(draw, fields, body)
        if isinstance(mutated, dict):
            make_safe(mutated, target)
        return subject, wire_headers(mutated, headers.get(codec.MAC_HEADER)), body, target

    control_message = st.one_of(
        st.binary(max_size=512),
        st.builds(
            lambda op, fields: json.dumps({"op": op, **fields}).encode(),
            st.sampled_from(["open", "close", "resume", "sessions", "ping", "tokenize", "bogus", ""]),
            st.dictionaries(
                st.sampled_from(
                    ["session_id", "route", "hop_index", "position", "replay_end", "text", "sent_at", "n_ctx"]
                ),
                st.one_of(st.integers(-(10**6), 10**6), ascii_text, st.none(), st.lists(st.integers(), max_size=3)),
                max_size=5,
            ),
        ),
    )

    async def fire(batch, controls):
        for subject, headers, body, _ in batch:
            try:
                await publish(client.js, subject, body, headers)
            except Exception:
                continue  # refused by the server (not a message a worker consumed)
            sent["data"] += 1
        for node, data in controls:
            reply = await client.nc.request(S.node_control(node), data, timeout=10)
            msgspec.json.decode(reply.data)  # every control message gets an answer, never silence
            sent["control"] += 1
        for node in nodes:  # both workers stay up and responsive
            await client.control(node, M.Ping(sent_at=time.time()), timeout=10)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        batch=st.lists(data_message(), min_size=BATCH - 2, max_size=BATCH - 2),
        controls=st.lists(st.tuples(st.sampled_from(nodes), control_message), min_size=2, max_size=2),
    )
    def malformed_messages_are_rejected(batch, controls):
        loop.run(fire(batch, controls))
        assert all(p.poll() is None for p in swarm.procs.values())

    def certain() -> list:
        """A message for each of the two reasons that only the probe session gives for sure (it
        expects seq 0 at position 0; a prompt chunk, as it is still in its prefill): hypothesis
        draws them among the rest about one run in ten too rarely to count on them."""
        subject, headers, body = next(c for c in captured if wire.fields(c[1])["phase"] == "prefill")
        subject = f"{subject.rsplit('.', 1)[0]}.{probe}"
        gap = wire.edit(headers, session_id=probe, seq=0, position=7)
        ahead = wire.edit(headers, session_id=probe, seq=5, position=0)
        return [(subject, gap, body, "probe"), (subject, ahead, body, "probe")]

    try:
        malformed_messages_are_rejected()
        loop.run(fire(certain(), []))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            after = loop.run(rejected_total())
            grew = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            if sum(v for k, v in grew.items() if k != "bad_control") >= sent["data"]:
                break
            time.sleep(1)
        state["stop"] = True
        victim_task.result(300)
        probe_positions = [
            [s.position for s in loop.run(client.sessions(n)).sessions if s.session_id == probe] for n in nodes
        ]
    finally:
        state["stop"] = True
        loop.run(client.close())
        loop.close()

    assert sent["data"] >= EXAMPLES * (BATCH - 2) * 0.95 and sent["control"] == EXAMPLES * 2
    assert not state["errors"], state["errors"][:3]
    assert state["outputs"] and all(out == solo for out in state["outputs"])
    assert sum(v for k, v in grew.items() if k != "bad_control") == sent["data"]  # every one rejected and counted
    assert grew.get("bad_control", 0) > 0
    for reason in ("unknown_session", "out_of_order", "position_gap", "missing_header", "bad_header", "size_mismatch"):
        assert grew.get(reason, 0) > 0, (reason, str(sorted(grew.items())))
    assert probe_positions == [[0], [0]]  # the probe session was never fed by any of them
    assert all(p.poll() is None for p in swarm.procs.values())
