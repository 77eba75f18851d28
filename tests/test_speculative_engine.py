"""Speculative ring steps in one process: two engines of a tiny synthetic llama wired by hand
(tests/test_engine.py's `Route`), the backends' every-row calls, the tail's check of each draft,
and the position checks every hop makes before any model work.
"""

from __future__ import annotations

import numpy as np
import pytest

from neuron_bus import codec
from neuron_bus import messages as M
from neuron_bus.errors import NeuronBusError
from neuron_bus.execution import open_range, open_tokenizer
from neuron_bus.routes import hop_header
from neuron_bus.worker.audit_trail import AuditTrail
from neuron_bus.worker.engine import HopEngine, Incoming, Output
from neuron_bus.worker.tail import TailDecoder
from tests.test_engine import N_CTX, Route, greedy

LOOP = [1, 5, 9, 13, 17, 21, 25, 5, 9, 13, 17]  # a prompt that repeats itself: drafts to be had
SEEDED = M.SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.gguf_factory import TinyLlama, write_tiny_llama

    # Q8_0 blocks: llama.cpp multiplies every row of a quantized matrix alone, so a row's output does not
    # depend on the rows beside it (bit-identical; SmolLM2's Q4_1 too). F32 weights go through a
    # blocked GEMM for several rows whose last bits differ from one row's: identical up to near-ties.
    return write_tiny_llama(tmp_path_factory.mktemp("spec") / "tiny.gguf", TinyLlama(quant="Q8_0"))


@pytest.fixture
def route(tiny, tmp_path):
    r = Route(tiny, tmp_path, adaptive_drafts=False)  # every draft found is sent: the rollbacks are exercised
    yield r
    r.close()


def test_every_row_of_a_step_equals_the_positions_run_one_by_one(tiny, tmp_path):
    """decode_rows: steps of different lengths in one call, bit-identical to one position at a time."""
    head, tail = (
        open_range("llama-cpp", tiny, a, b, cache_dir=tmp_path, n_ctx=N_CTX, benchmark=False)
        for a, b in ((0, 2), (2, 4))
    )
    ids = np.array(LOOP, dtype=np.int32)
    for b in (head, tail):
        for sid in ("one", "five", "three"):
            b.open_session(sid, N_CTX)
    for sid in ("one", "five", "three"):
        tail.prefill(sid, 0, head.prefill(sid, 0, ids[:6]))
    single = [tail.decode_step("one", p, head.decode_step("one", p, ids[p : p + 1])) for p in range(6, 11)]
    hidden = head.decode_rows([("five", 6, ids[6:11]), ("three", 6, ids[6:9])])
    five, three = tail.decode_rows([("five", 6, hidden[0]), ("three", 6, hidden[1])])
    assert five.shape == (5, tail.vocab_size) and np.array_equal(five, np.stack(single))
    assert np.array_equal(three, np.stack(single[:3]))
    for b in (head, tail):  # two drafts rejected: back to position 7, then on from there
        b.truncate("three", 7)
    again = tail.decode_rows([("three", 7, head.decode_rows([("three", 7, ids[7:9])])[0])])[0]
    assert np.array_equal(again, np.stack(single[1:3]))
    head.close()
    tail.close()


def test_a_speculative_ring_gives_the_whole_models_greedy_tokens(route, tiny):
    route.open("spec", prompt=LOOP, max_tokens=24, speculative=4)
    route.open("plain", prompt=LOOP, max_tokens=24)
    tokens = route.run(["spec", "plain"])
    want = greedy(tiny, LOOP, 24)
    assert tokens == {"spec": want, "plain": want}
    spec = route.engines[1].sessions.get("spec").tail
    assert spec.spec.drafted > spec.spec.accepted > 0  # drafts were kept, and drafts were dropped
    assert spec.ring_steps < 23  # fewer trips around the ring than tokens
    assert spec.progress.snapshot().accepted_draft_tokens == spec.spec.accepted
    for e in route.engines:  # every hop holds exactly the positions of the tokens the tail kept
        s = e.sessions.get("spec")
        held = s.verified
        assert held <= e.backend.session_position("spec") and s.position - s.drafts_held == held


def test_seeded_sampling_with_drafts_is_plain_seeded_decoding(route):
    route.open("spec", prompt=LOOP, max_tokens=24, sampling=SEEDED, speculative=6)
    route.open("plain", prompt=LOOP, max_tokens=24, sampling=SEEDED)
    tokens = route.run(["spec", "plain"])
    assert tokens["spec"] == tokens["plain"] and len(set(tokens["plain"])) > 3
    assert route.engines[1].sessions.get("spec").tail.spec.drafted > 0


def _decode(route: Route, hop: int, sid: str, position: int, rows: int, seq: int | None = None) -> Incoming:
    s = route.engines[hop].sessions.get(sid)
    if hop == 0:
        x = np.full(rows, 5, dtype=np.int32)
        header = hop_header(route.route, 0, sid, position, "decode", s.seq if seq is None else seq, "i32")
    else:
        x = np.zeros((rows, route.backends[hop].hidden_size), dtype=np.float32)
        header = hop_header(route.route, hop, sid, position, "decode", s.seq if seq is None else seq, "f32")
    headers, body = codec.encode(header, x)
    return Incoming("forged", headers, body)


def test_a_step_with_a_wrong_position_header_is_refused_before_any_model_work(route):
    route.open("a", prompt=LOOP, max_tokens=24, speculative=3)
    e1 = route.engines[1]
    _prefill(route, "a", LOOP)  # the tail's first ring step waits at hop 0
    n = len(LOOP)
    calls = [b.forward_calls for b in route.backends]

    def refused(hop: int, position: int, rows: int) -> str:
        steps, rejected = route.engines[hop].admit([_decode(route, hop, "a", position, rows)], "decode")
        assert not steps and len(rejected) == 1
        return f"{rejected[0].reason}: {rejected[0].message}"

    assert refused(0, n + 1, 3).startswith("position_gap")  # past the positions hop 0 holds
    assert refused(0, n - 1, 3).startswith("replayed")  # into the prompt
    assert "1 to 4 positions" in refused(0, n, 5)  # more drafts than the session allows
    assert refused(1, n + 1, 2).startswith("position_gap")
    # the tail knows the ring step it sent: one position at n (a session's first ring step drafts
    # only what the prompt offers); a step of another size or place is not it
    ring = e1.sessions.get("a").tail
    assert ring.ring_position == n
    assert refused(1, n, 1 + len(ring.spec.in_flight) + 1).startswith("position_gap")
    assert [b.forward_calls for b in route.backends] == calls  # nothing reached a model


def test_the_tail_keeps_drafts_while_its_choice_agrees_and_stops_at_the_end(tiny):
    tok = open_tokenizer(tiny)
    route = M.RouteAssignment(route_id="r", model_preset="t", model_revision="v", n_layers_total=1, hops=[])
    params = M.SamplingParams(max_tokens=5, ignore_eos=True)
    tail = TailDecoder(
        M.SessionOpen(
            session_id="a", route=route, hop_index=0, prompt_tokens=3, n_ctx=8, sampling=params, speculative=4
        ),
        tok,
    )
    eye = np.eye(tok.vocab_size, dtype=np.float32)
    tail.token(eye[7])
    tail.spec.in_flight = [8, 9, 10]  # the ring step in flight: token 7, drafts 8 9 10
    steps = tail.verify(eye[[8, 9, 11, 12]])  # agrees with 8 and 9, then chooses 11 over 10
    assert [s.delta.token_id for s in steps] == [8, 9, 11] and tail.spec.accepted == 2
    assert tail.generated == [7, 8, 9, 11]
    tail.spec.in_flight = [12, 13]
    steps = tail.verify(eye[[12, 13, 14]])  # max_tokens 5: the generation ends after 12
    assert [s.delta.token_id for s in steps] == [12] and steps[-1].delta.finish_reason == "length"
    with pytest.raises(ValueError, match="rows"):
        tail.verify(eye[[1, 2]])  # the step had three positions


def test_a_recurrent_hop_refuses_a_speculative_session_with_a_reason(tmp_path):
    from neuron_bus.artifacts.gguf_model import GGUFModel
    from neuron_bus.artifacts.synthetic import write_model
    from neuron_bus.split import model_split

    path = write_model(tmp_path / "qwen35.gguf", "qwen35")
    start, end = model_split(GGUFModel(path), 2)[0]  # recurrent layers and an attention layer
    backend = open_range("llama-cpp", path, start, end, cache_dir=tmp_path, n_ctx=64, max_sessions=1, benchmark=False)
    try:
        cap = backend.capability
        hop = M.RouteHop(
            node_id="n0", layer_start=start, layer_end=end, subject="", backend_id="llama-cpp", cache_abi=cap.cache_abi
        )
        route = M.RouteAssignment(
            route_id="r", model_preset="q", model_revision="v", n_layers_total=backend.n_layers, hops=[hop, hop]
        )
        engine = HopEngine("n0", cap.cache_abi, backend, None, AuditTrail(None, None))
        req = M.SessionOpen(
            session_id="s",
            route=route,
            hop_index=0,
            prompt_tokens=4,
            n_ctx=32,
            sampling=M.SamplingParams(max_tokens=8),
            speculative=4,
        )
        with pytest.raises(NeuronBusError, match="recurrent state") as refused:
            engine.check_open(req)
        assert refused.value.reason == "cannot_speculate" and "n0" in str(refused.value)
        req.speculative = 0
        engine.check_open(req)  # the same session, plain, is welcome
        req.speculative = M.MAX_SPECULATIVE + 1
        with pytest.raises(ValueError, match="between 0 and"):
            engine.check_open(req)
    finally:
        backend.close()


def test_outputs_of_a_speculative_step_carry_its_tokens_in_order(route):
    route.open("a", prompt=LOOP, max_tokens=12, speculative=4)
    out = _prefill(route, "a", LOOP)
    for _ in range(11):  # around the ring until a step yields several tokens
        out = _around(route, out)
        deltas = [M.decode(s.body, M.TokenDelta) for s in out.sends if not s.seam]
        if len(deltas) > 1:
            break
    assert len(deltas) > 1
    assert out.sends[0].seam == "decode"  # the ring step goes first: the next token's critical path
    assert [d.index for d in deltas] == list(range(deltas[0].index, deltas[0].index + len(deltas)))
    assert out.token is not None and out.token.delta == deltas[-1]


def _prefill(route: Route, sid: str, prompt: list[int]) -> Output:
    """The prompt through both hops: the tail's output of the last chunk (the first ring step)."""
    for chunk in route.prompt(sid, prompt):
        (o,), _ = route.step(0, [chunk], "prefill")
        (out,), _ = route.step(1, [Incoming("h", o.sends[0].headers, o.sends[0].body)], "prefill")
    assert isinstance(out, Output)
    return out


def _around(route: Route, tail_out: Output) -> Output:
    """The tail's ring step once around: hop 0, then the tail; the tail's output."""
    ring = tail_out.sends[0]
    (o,), _ = route.step(0, [Incoming("ring", ring.headers, ring.body)], "decode")
    (out,), _ = route.step(1, [Incoming("h", o.sends[0].headers, o.sends[0].body)], "decode")
    assert isinstance(out, Output)
    return out
