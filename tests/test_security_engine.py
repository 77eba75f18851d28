"""Per-session link keys in the engine, in one process (no bus): MACs checked before any model work,
sealed (AEAD) bodies, copies replayed or moved, forged headers, ownership proofs for close/resume,
and sealed snapshots. The same two-hop tiny llama route as test_engine.py."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

from neuron_bus import codec
from neuron_bus import messages as M
from neuron_bus.errors import NeuronBusError, SessionMismatch
from neuron_bus.routes import hop_header
from neuron_bus.trust import sealing
from neuron_bus.worker.engine import Incoming, Output
from tests import wire
from tests.test_engine import N_CTX, PROMPT, Route, greedy


class KeyedRoute(Route):
    """The route with fresh link keys per session (what NeuronClient sends every hop)."""

    def __init__(self, gguf, tmp_path, encrypt=False, **opts):
        super().__init__(gguf, tmp_path, **opts)
        self.encrypt = encrypt
        self.keys: dict[str, list[str]] = {}

    def open(self, sid, prompt=PROMPT, max_tokens=8, chunk_size=4):
        keys = self.keys[sid] = [sealing.new_key() for _ in self.engines]
        for i, e in enumerate(self.engines):
            req = self.request(sid, i, prompt, max_tokens, chunk_size)
            e.check_open(req)
            e.backend.open_session(sid, req.n_ctx)
            e.add(req)
        return keys

    def request(self, sid, i, prompt=PROMPT, max_tokens=8, chunk_size=4, keys=None):
        keys = keys or self.keys[sid]
        return M.SessionOpen(
            session_id=sid,
            route=self.route,
            hop_index=i,
            prompt_tokens=len(prompt),
            n_ctx=len(prompt) + max_tokens,
            chunk_size=chunk_size,
            sampling=M.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            owner="alice",
            input_key=keys[i],
            output_key=keys[(i + 1) % len(keys)],
            encrypt=self.encrypt,
        )

    def prompt(self, sid, prompt=PROMPT, chunk_size=4):
        out = []
        for m in super().prompt(sid, prompt, chunk_size):
            h = codec.decode_header(m.headers)
            headers, body = sealing.seal(h, dict(m.headers or {}), m.data, self.keys[sid][0], self.encrypt)
            out.append(Incoming(m.handle, headers, body))
        return out


@pytest.fixture(params=[False, True], ids=["mac", "aead"])
def keyed(request, tiny_f32, tmp_path):
    r = KeyedRoute(tiny_f32, tmp_path, encrypt=request.param, require_keys=True)
    yield r
    r.close()


def test_an_authenticated_ring_gives_the_undisturbed_tokens(keyed, tiny_f32):
    keyed.open("a")
    tokens = keyed.run(["a"])
    assert tokens == {"a": greedy(tiny_f32, PROMPT, 8)}
    tail = keyed.engines[1].sessions.get("a")
    assert tail.open.owner == "alice"


def test_forged_copied_and_moved_activations_are_refused_before_model_work(keyed):
    keyed.open("a")
    keyed.open("b")
    e = keyed.engines[0]
    good = keyed.prompt("a")
    calls = e.backend.forward_calls

    def reason(msg: Incoming) -> str:
        steps, rejected = e.admit([msg], "prefill")
        assert not steps and len(rejected) == 1, (steps, rejected)
        return rejected[0].reason

    # a valid-looking header (right session, route, seq, position) signed with another key
    forged = hop_header(keyed.route, 0, "a", 0, "prefill", 0, "i32")
    h, body = codec.encode(forged, np.asarray(PROMPT[:4], dtype=np.int32))
    h, body = sealing.seal(forged, h, body, sealing.new_key(), keyed.encrypt)
    assert reason(Incoming("x", h, body)) == "bad_mac"
    # no MAC at all
    plain = dict(good[0].headers)
    plain.pop("mac")
    assert reason(Incoming("x", plain, good[0].data)) == "bad_mac"
    # a changed body under the original MAC (a flipped byte)
    flipped = bytes([good[0].data[0] ^ 1]) + good[0].data[1:]
    assert reason(Incoming("x", good[0].headers, flipped)) in ("bad_mac", "size_mismatch")
    # a copy moved to another session (its MAC covers the session id)
    assert reason(Incoming("x", wire.edit(good[0].headers, session_id="b"), good[0].data)) == "bad_mac"
    # the same fields written another way (spaces): the MAC covers the bytes carried, not a re-encoding
    spaced = {**good[0].headers, codec.HEADER: good[0].headers[codec.HEADER].replace(",", ", ")}
    assert reason(Incoming("x", spaced, good[0].data)) == "bad_mac"
    assert e.backend.forward_calls == calls  # nothing reached the model
    steps, rejected = e.admit([good[0]], "prefill")
    assert len(steps) == 1 and not rejected
    e.advance(steps, e.compute(steps, "prefill"))
    # the genuine chunk copied from the wire and replayed
    assert reason(Incoming("x", good[0].headers, good[0].data)) == "replayed"


def test_hop_outputs_are_signed_with_the_next_links_key(keyed):
    keys = keyed.open("a")
    e = keyed.engines[0]
    steps, _ = e.admit(keyed.prompt("a")[:1], "prefill")
    (out,) = e.advance(steps, e.compute(steps, "prefill"))
    assert isinstance(out, Output)
    (send,) = out.sends
    header = codec.decode_header(send.headers)
    assert send.subject == "neuron.act.n1.r1.1.prefill.a"  # keyed by the receiving node, one subject per session
    head = sealing.head_of(send.headers)
    body = sealing.verify(header, head, send.body, keys[1], keyed.encrypt)  # link 1's key, not link 0's
    with pytest.raises(SessionMismatch):
        sealing.verify(header, head, send.body, keys[0], keyed.encrypt)
    if keyed.encrypt:  # the hidden states are not on the wire in the clear
        x = codec.decode_body(header, body)
        assert x.tobytes() not in send.body


def test_keys_are_required_and_only_the_opener_may_reopen_close_or_move_a_session(keyed):
    e = keyed.engines[0]
    bare = msgspec.structs.replace(keyed.request("x", 0, keys=[sealing.new_key()] * 2), input_key="", output_key="")
    with pytest.raises(NeuronBusError) as err:
        e.check_open(bare)
    assert err.value.reason == "unauthenticated"
    keys = keyed.open("a")
    with pytest.raises(NeuronBusError) as err:  # another client opening the same session id
        e.check_open(keyed.request("a", 0, keys=[sealing.new_key(), sealing.new_key()]))
    assert err.value.reason == "session_exists"
    with pytest.raises(NeuronBusError) as err:
        e.check_close(M.SessionClose(session_id="a", route_id="r1"))
    assert err.value.reason == "not_owner"
    with pytest.raises(NeuronBusError):
        e.check_close(
            M.SessionClose(session_id="a", route_id="r1", proof=sealing.LinkKey.parse(keys[1]).proof("close", "a"))
        )
    e.check_close(
        M.SessionClose(session_id="a", route_id="r1", proof=sealing.LinkKey.parse(keys[0]).proof("close", "a"))
    )
    moved = msgspec.structs.replace(keyed.route, route_id="r1-r1")
    resume = M.SessionResume(open=msgspec.structs.replace(keyed.request("a", 0), route=moved), position=4, replay_end=7)
    with pytest.raises(NeuronBusError) as err:
        e.check_resume(resume)
    assert err.value.reason == "not_owner"
    resume.proof = sealing.LinkKey.parse(keys[0]).proof(*sealing.resume_parts(resume))
    assert e.check_resume(resume) is e.sessions.get("a")


def test_only_the_opener_may_keep_a_waiting_session_from_being_freed_as_idle(keyed):
    """A session waiting its turn upstream computes nothing here for a while: its client says it is
    still wanted, and nobody else can (a session id is public on its telemetry subject)."""
    e = keyed.engines[0]
    keys = keyed.open("a")
    s = e.sessions.get("a")
    s.last_used = time.monotonic() - 1000.0
    for forged in ("", sealing.LinkKey.parse(keys[1]).proof("keep_alive", "a", "r1")):
        with pytest.raises(NeuronBusError) as err:
            e.keep_alive(M.SessionKeepAlive(session_id="a", route_id="r1", proof=forged))
        assert err.value.reason == "not_owner"
    assert time.monotonic() - s.last_used > 999.0  # still idle
    for session_id, route_id in (("b", "r1"), ("a", "r2")):  # not a session of this hop, or not on that route
        with pytest.raises(NeuronBusError) as err:
            e.keep_alive(M.SessionKeepAlive(session_id=session_id, route_id=route_id))
        assert err.value.reason == "unknown_session"
    req = M.SessionKeepAlive(session_id="a", route_id="r1")
    req.proof = sealing.prove(keys[0], sealing.keep_alive_parts(req))
    e.keep_alive(req)
    assert time.monotonic() - s.last_used < 1.0


def test_snapshots_are_sealed_under_the_hops_key():
    meta = M.SnapshotMeta(
        generation_id="g",
        session_id="a",
        route_id="r1",
        node_id="n0",
        model_preset="tiny",
        model_revision="v1",
        backend_id="llama-cpp",
        cache_abi="abi",
        layer_start=0,
        layer_end=2,
        position=8,
        n_ctx=N_CTX,
        nbytes=0,
    )
    key, state = sealing.new_key(), bytes(range(256)) * 64
    for encrypt in (False, True):
        m = msgspec.structs.replace(meta)
        blob = sealing.seal_snapshot(m, state, key, encrypt)
        assert m.mac and m.sealed == encrypt and m.nbytes == len(blob)
        assert (state in blob) != encrypt
        assert sealing.open_snapshot(m, blob, key) == state
        with pytest.raises(ValueError):
            sealing.open_snapshot(m, blob, sealing.new_key())  # another session's (or a forger's) key
        with pytest.raises(ValueError):
            sealing.open_snapshot(msgspec.structs.replace(m, position=16), blob, key)  # metadata changed
        with pytest.raises(ValueError):
            sealing.open_snapshot(m, blob[:-1] + bytes([blob[-1] ^ 1]), key)
