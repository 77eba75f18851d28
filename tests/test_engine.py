"""The worker's engine in one process, no bus: two hops of a tiny synthetic llama on llama.cpp
(and no-op hops) wired by hand, the way the shell wires them through JetStream.

Admission and every rejection reason, a route's ring to the last token equal to the whole
model's greedy output, decode batches, a failing step that fails only its own session, sessions
closed mid-compute, and where snapshots fall due.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from neuron_bus import codec
from neuron_bus import messages as M
from neuron_bus.errors import NeuronBusError
from neuron_bus.execution import open_range, open_reference, open_tokenizer
from neuron_bus.routes import hop_header
from neuron_bus.worker.audit_trail import AuditTrail
from neuron_bus.worker.engine import EngineOptions, Failed, Gone, HopEngine, Incoming, Output
from neuron_bus.worker.tail import TailDecoder
from tests import wire
from workers.errors import Reason

N_CTX = 64
PROMPT = [1, 5, 9, 13, 17, 21, 25]


class Route:
    """Two engines over layers [0, 2) and [2, 4); messages move between them as the bus would move them."""

    def __init__(self, gguf, tmp_path, kind="llama-cpp", **opts):
        self.tokenizer = open_tokenizer(gguf)
        self.backends = [
            open_range(kind, gguf, a, b, cache_dir=tmp_path, n_ctx=N_CTX, max_sessions=4, benchmark=False)
            for a, b in ((0, 2), (2, 4))
        ]
        abi = [b.capability.cache_abi for b in self.backends]
        self.route = M.RouteAssignment(
            route_id="r1",
            model_preset="tiny",
            model_revision="v1",
            n_layers_total=4,
            hops=[
                M.RouteHop(
                    node_id=f"n{i}",
                    layer_start=b.layer_start,
                    layer_end=b.layer_end,
                    subject="",
                    backend_id=kind,
                    cache_abi=abi[i],
                )
                for i, b in enumerate(self.backends)
            ],
        )
        self.engines = [
            HopEngine(f"n{i}", abi[i], b, self.tokenizer, AuditTrail(None, None), EngineOptions(**opts))
            for i, b in enumerate(self.backends)
        ]
        self.prompts: dict[str, tuple[list[int], int]] = {}  # session -> its prompt and chunk size

    def open(
        self, sid: str, prompt=PROMPT, max_tokens: int = 8, chunk_size: int = 4, sampling=None, speculative: int = 0
    ) -> None:
        for i, e in enumerate(self.engines):
            req = M.SessionOpen(
                session_id=sid,
                route=self.route,
                hop_index=i,
                prompt_tokens=len(prompt),
                n_ctx=len(prompt) + max_tokens,
                chunk_size=chunk_size,
                sampling=sampling or M.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                prompt=list(prompt) if i == len(self.engines) - 1 else None,
                speculative=speculative,
            )
            self.prompts[sid] = (list(prompt), chunk_size)
            e.check_open(req)
            e.backend.open_session(sid, req.n_ctx)
            e.add(req)

    def prompt(self, sid: str, prompt=PROMPT, chunk_size: int = 4) -> list[Incoming]:
        ids = np.asarray(prompt, dtype=np.int32)
        out = []
        for seq, lo in enumerate(range(0, len(ids), chunk_size)):
            headers, body = codec.encode(
                hop_header(self.route, 0, sid, lo, "prefill", seq, "i32"), ids[lo : lo + chunk_size]
            )
            out.append(Incoming(("client", seq), headers, body))
        return out

    def step(self, hop: int, batch: list[Incoming], phase: str):
        e = self.engines[hop]
        steps, rejected = e.admit(batch, phase)
        return e.advance(steps, e.compute(steps, phase)), rejected

    def run(self, sids: list[str]) -> dict[str, list[int]]:
        """Prefill every session, then run the ring until each has its last token; the tokens by session."""
        prompts = [m for sid in sids for m in self.prompt(sid, *self.prompts.get(sid, (PROMPT, 4)))]
        queues: dict[tuple[int, str], list[Incoming]] = {(0, "prefill"): prompts}
        tokens: dict[str, list[int]] = {sid: [] for sid in sids}
        while any(queues.values()):
            (hop, phase), batch = next((k, v) for k, v in queues.items() if v)
            taken = batch if phase == "decode" else batch[:1]  # a decode wave, or one prefill chunk
            queues[(hop, phase)] = batch[len(taken) :]
            outcomes, rejected = self.step(hop, taken, phase)
            assert not rejected, rejected
            for o in outcomes:
                assert isinstance(o, Output), o
                for send in o.sends:
                    if send.seam:  # an activation: into the hop the subject names
                        to, ph = send.subject.split(".")[4:6]  # neuron.act.<node>.<route>.<hop>.<phase>[.<session>]
                        queues.setdefault((int(to), ph), []).append(Incoming(("hop", hop), send.headers, send.body))
                    else:
                        tokens[o.step.session.session_id].append(M.decode(send.body, M.TokenDelta).token_id)
        return tokens

    def close(self):
        for b in self.backends:
            b.close()


@pytest.fixture
def route(tiny_f32, tmp_path):
    r = Route(tiny_f32, tmp_path)
    yield r
    r.close()


def greedy(gguf, prompt, n) -> list[int]:
    full = open_reference(gguf, n_ctx=N_CTX, max_sessions=1, benchmark=False)
    try:
        full.open_session("ref", len(prompt) + n)
        logits, out = full.prefill("ref", 0, np.asarray(prompt, dtype=np.int32)), []
        for i in range(n):
            out.append(int(np.argmax(logits)))
            logits = full.decode_step("ref", len(prompt) + i, np.array([out[-1]], dtype=np.int32))
        return out
    finally:
        full.close()


def test_the_ring_in_one_process_gives_the_whole_models_greedy_tokens(route, tiny_f32):
    route.open("a")
    route.open("b", max_tokens=8)
    tokens = route.run(["a", "b"])
    want = greedy(tiny_f32, PROMPT, 8)
    assert tokens == {"a": want, "b": want}
    tail = route.engines[1].sessions.get("a")
    assert tail.finished and tail.tail.generated == want and tail.tail.progress.phase == "done"
    # decode waves: both sessions' steps went through each hop as one batched call
    assert route.backends[0].forward_calls < 2 * 2 + 2 * 8


def test_admission_refuses_before_any_model_work_with_a_reason_each(route):
    route.open("a")
    e = route.engines[0]
    good = route.prompt("a")
    calls = e.backend.forward_calls

    def reason(headers=None, data=None, phase="prefill") -> str:
        m = good[0]
        msg = Incoming("x", m.headers if headers is None else headers, m.data if data is None else data)
        steps, rejected = e.admit([msg], phase)
        assert not steps and len(rejected) == 1
        return rejected[0].reason

    h = dict(good[0].headers)
    assert reason(phase="decode") == "wrong_phase"  # a prefill chunk on the decode subject
    assert reason(wire.edit(h, session_id="nobody")) == "unknown_session"
    assert reason(wire.edit(h, route_id="r9")) == "wrong_route"
    assert reason(wire.edit(h, cache_abi="other")) == "wrong_key"
    assert reason(wire.edit(h, layer_start=1)) == "wrong_layers"
    assert reason(wire.edit(h, seq=3)) == "out_of_order"
    assert reason(wire.edit(h, position=4)) == "position_gap"
    assert reason(data=good[0].data[:-1]) == "size_mismatch"
    assert reason(wire.edit(h, seq=None)) == "missing_header"
    steps, rejected = e.admit([good[0], good[0]], "prefill")  # the same step twice in one batch
    assert len(steps) == 1 and [r.reason for r in rejected] == ["replayed"]
    assert e.backend.forward_calls == calls  # nothing reached the model
    e.advance(steps, e.compute(steps, "prefill"))
    assert reason() == "replayed"  # once processed, the same chunk again


def test_a_step_the_backend_refuses_fails_alone_in_its_batch(route):
    for sid in ("a", "b"):
        route.open(sid, prompt=[1, 2, 3, 4], max_tokens=4)
    e = route.engines[0]
    for sid in ("a", "b"):  # both prompts in: hop 0's next input is a decode step at position 4
        e.advance(*(lambda s: (s, e.compute(s, "prefill")))(e.admit(route.prompt(sid, [1, 2, 3, 4]), "prefill")[0]))

    def decode_step(sid: str, token: int) -> Incoming:
        s = e.sessions.get(sid)
        headers, body = codec.encode(
            hop_header(route.route, 0, sid, 4, "decode", s.seq, "i32"), np.array([token], np.int32)
        )
        return Incoming(sid, headers, body)

    out, rejected = route.step(
        0, [decode_step("a", 7), decode_step("b", 10**6)], "decode"
    )  # b's token id is out of range
    assert not rejected
    by = {o.step.session.session_id: o for o in out}
    assert isinstance(by["a"], Output) and by["a"].sends
    assert isinstance(by["b"], Failed) and by["b"].reason == "bad_input" and not by["b"].fatal
    assert e.sessions.get("b").position == 4 and e.sessions.get("a").position == 5


def test_a_session_closed_while_it_computed_is_gone(route):
    route.open("a")
    e = route.engines[0]
    steps, _ = e.admit(route.prompt("a")[:1], "prefill")
    results = e.compute(steps, "prefill")
    e.sessions.pop("a")  # a SessionClose (or a repair's replacement) arrived meanwhile
    (outcome,) = e.advance(steps, results)
    assert isinstance(outcome, Gone)


def test_snapshots_fall_due_at_the_same_positions_on_every_hop_and_never_after_the_last_token(tiny_f32, tmp_path):
    r = Route(tiny_f32, tmp_path, snapshot_every=4)
    try:
        r.open("a", prompt=PROMPT, max_tokens=9)
        due: dict[int, list[int]] = {0: [], 1: []}
        orig = [e.advance for e in r.engines]

        def watch(hop):
            def advance(steps, results):
                outs = orig[hop](steps, results)
                due[hop] += [o.step.session.position for o in outs if isinstance(o, Output) and o.snapshot]
                return outs

            return advance

        for i, e in enumerate(r.engines):
            e.advance = watch(i)
        r.run(["a"])
    finally:
        r.close()
    # the prompt (7) ends in the chunk [4, 7): 8 and 12 are crossed in decode; the 9th token (position 16) is the last
    assert due[0] == due[1] == [8, 12]


def test_a_hop_refuses_a_session_on_a_route_assigned_under_another_protocol(route):
    newer = msgspec.structs.replace(route.route, protocol=M.PROTOCOL + 1)
    for i, e in enumerate(route.engines):
        req = M.SessionOpen(session_id="s", route=newer, hop_index=i, prompt_tokens=3, n_ctx=16, chunk_size=4)
        with pytest.raises(NeuronBusError) as err:
            e.check_open(req)
        assert err.value.reason == Reason.PROTOCOL and f"n{i} speaks protocol {M.PROTOCOL}" in str(err.value)
        assert e.sessions.get("s") is None
    route.open("s")  # the same session on the route as assigned is welcome


def test_noop_hops_move_the_real_shapes(tiny_f32, tmp_path):
    r = Route(tiny_f32, tmp_path, kind="noop")
    try:
        r.open("a", max_tokens=3)
        tokens = r.run(["a"])
    finally:
        r.close()
    assert tokens == {"a": [0, 0, 0]}  # constant logits: token 0 wins every time


def test_the_tail_cuts_at_a_stop_string_even_across_tokens_and_says_why(tiny_f32):
    tok = open_tokenizer(tiny_f32)
    ids = tok.encode("hello world", add_bos=False)  # letters of the tiny vocabulary, one token each
    params = M.SamplingParams(max_tokens=20, stop=["lo w"], ignore_eos=True)
    route = M.RouteAssignment(route_id="r", model_preset="t", model_revision="v", n_layers_total=1, hops=[])
    tail = TailDecoder(
        M.SessionOpen(session_id="a", route=route, hop_index=0, prompt_tokens=1, n_ctx=32, sampling=params), tok
    )
    steps = []
    for t in ids:
        logits = np.zeros(tok.vocab_size, dtype=np.float32)
        logits[t] = 1.0  # greedy picks exactly t
        steps.append(tail.token(logits))
        if steps[-1].finished:
            break
    # "lo w" spans three tokens: none of it reaches the client, although "lo" came before "w" did
    assert steps[-1].delta.finish_reason == "stop" and tail.text == " hel"
    assert "".join(s.delta.text for s in steps) == " hel" and tail.progress.phase == "done"
    params.stop.clear()
    params.max_tokens = 3
    short = TailDecoder(
        M.SessionOpen(session_id="b", route=route, hop_index=0, prompt_tokens=1, n_ctx=32, sampling=params), tok
    )
    reasons = [short.token(np.eye(tok.vocab_size, dtype=np.float32)[t]).delta.finish_reason for t in ids[:3]]
    assert reasons == [None, None, "length"]
