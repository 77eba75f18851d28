"""The torch layer-range backend: numerics against transformers and llama.cpp, splits, sessions."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from workers.errors import BadInput, PositionGap, SessionExists, UnknownSession, UnsupportedModel
from workers.torch_backend import TorchBackend

torch.set_num_threads(1)

# "<|im_start|>The capital of France is Paris, and the capital of" (SmolLM2 tokenizer)
PROMPT = np.array([1, 504, 3575, 282, 4649, 314, 7042, 28, 284, 260, 3575, 282], dtype=np.int32)
TINY_PROMPT = np.array([1, 290, 300, 270, 301, 299, 305, 3, 4, 5], dtype=np.int32)  # vocab is 311


def backend(path, start, end, dtype="float32"):
    return TorchBackend(path, start, end, dtype=dtype, selfbench=False)


def chain_step(chain: list[TorchBackend], sid: str, position: int, x: np.ndarray) -> np.ndarray:
    """Pass one chunk through every hop (hidden states handed over in-process)."""
    for hop in chain:
        x = hop.prefill(sid, position, x)
    return x


def run_chain(chain, sid, prompt, n_decode, n_ctx=64, chunk=None):
    """Prefill ``prompt`` (in chunks), then greedy-decode one position per step; return every logits vector."""
    for hop in chain:
        hop.open_session(sid, n_ctx)
    chunk = chunk or len(prompt)
    logits = [chain_step(chain, sid, i, prompt[i : i + chunk]) for i in range(0, len(prompt), chunk)]
    pos = len(prompt)
    for _ in range(n_decode):
        token = np.array([int(np.argmax(logits[-1]))], dtype=np.int32)
        logits.append(chain_step(chain, sid, pos, token))
        pos += 1
    for hop in chain:
        hop.close_session(sid)
    return logits


def per_position_logits(b: TorchBackend, sid: str, prompt) -> np.ndarray:
    """Prompt logits at every position: the tail returns only the last row, so feed one token a step."""
    b.open_session(sid, len(prompt))
    out = np.stack([b.prefill(sid, i, prompt[i : i + 1]) for i in range(len(prompt))])
    b.close_session(sid)
    return out


def cosine(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def smol_whole(smollm2_path):
    return backend(smollm2_path, 0, 30)


# -- numerics against independent implementations ------------------------------------------


@pytest.mark.slow
def test_matches_transformers_fp32(smollm2_path, smol_whole, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    with torch.no_grad():
        ref = ref_model(torch.from_numpy(PROMPT[None]).long()).logits[0].numpy()
    ours = per_position_logits(smol_whole, "tf", PROMPT)
    assert ours.shape == ref.shape == (len(PROMPT), 49152)
    assert np.abs(ours - ref).max() < 1e-3


def llama_cpp_prompt_logits(path, prompt) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), logits_all=True, n_threads=1, n_ctx=64, verbose=False)
    llm.eval(prompt.tolist())
    return np.array(llm.scores[: len(prompt)])


def test_matches_llama_cpp(smollm2_path, smol_whole):
    """Q4_1 weights: llama.cpp quantizes the activations too (q8_1 dot products), so the two agree
    to a cosine of about 0.9995 over the prompt, position by position a little less."""
    ref = llama_cpp_prompt_logits(smollm2_path, PROMPT)
    ours = per_position_logits(smol_whole, "llama", PROMPT)
    assert cosine(ours, ref) >= 0.999
    for i in range(len(PROMPT)):
        assert cosine(ours[i], ref[i]) >= 0.99, i
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_matches_llama_cpp_exactly_with_f32_weights(tiny_f32):
    """With float32 weights llama.cpp does float math as well: the logits agree to float noise."""
    ref = llama_cpp_prompt_logits(tiny_f32, TINY_PROMPT)
    ours = per_position_logits(backend(tiny_f32, 0, 4), "llama", TINY_PROMPT)
    for i in range(len(TINY_PROMPT)):
        assert cosine(ours[i], ref[i]) >= 0.99999, i
    assert np.abs(ours - ref).max() < 1e-2  # llama.cpp keeps its KV cache in f16


# -- splits --------------------------------------------------------------------------------


@pytest.mark.parametrize("bounds", [(0, 2, 4), (0, 1, 3, 4)], ids=["2-way", "3-way"])
def test_tiny_split_equals_whole(tiny_f32, bounds):
    whole = run_chain([backend(tiny_f32, 0, 4)], "s", TINY_PROMPT, n_decode=6)
    chain = [backend(tiny_f32, a, b) for a, b in zip(bounds, bounds[1:])]
    split = run_chain(chain, "s", TINY_PROMPT, n_decode=6)
    for w, s in zip(whole, split):
        np.testing.assert_allclose(s, w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bounds", [(0, 15, 30), (0, 7, 19, 30)], ids=["2-way", "3-way"])
def test_smollm2_split_equals_whole(smollm2_path, smol_whole, bounds):
    whole = run_chain([smol_whole], "s", PROMPT, n_decode=4)
    split = run_chain([backend(smollm2_path, a, b) for a, b in zip(bounds, bounds[1:])], "s", PROMPT, n_decode=4)
    assert len(split) == len(whole) == 1 + 4
    for w, s in zip(whole, split):
        np.testing.assert_allclose(s, w, rtol=0, atol=1e-5)


def test_smollm2_chunked_prefill_split(smollm2_path, smol_whole):
    """Prefill in chunks of 5 through a 3-way split: same greedy path, logits within float32 noise."""
    whole = run_chain([smol_whole], "s", PROMPT, n_decode=4)
    chain = [backend(smollm2_path, a, b) for a, b in ((0, 7), (7, 19), (19, 30))]
    split = run_chain(chain, "s", PROMPT, n_decode=4, chunk=5)
    assert len(split) == 3 + 4
    for w, s in zip(whole, split[2:]):
        np.testing.assert_allclose(s, w, rtol=0, atol=1e-4)
        assert np.argmax(s) == np.argmax(w)


def test_hop_shapes(tiny_f32):
    head, tail = backend(tiny_f32, 0, 2), backend(tiny_f32, 2, 4)
    for b in (head, tail):
        b.open_session("s", 16)
    h = head.prefill("s", 0, TINY_PROMPT[:3])
    assert h.dtype == np.float32 and h.shape == (3, head.hidden_size)
    logits = tail.prefill("s", 0, h)
    assert logits.dtype == np.float32 and logits.shape == (tail.vocab_size,)


# -- bf16 ----------------------------------------------------------------------------------


def test_bf16_close_to_fp32(smollm2_path, smol_whole):
    """Same tokens through both (greedy paths may part at a near-tie, so no free-running decode)."""
    bf16 = backend(smollm2_path, 0, 30, dtype="bfloat16")
    assert bf16.capability.cache_abi != smol_whole.capability.cache_abi
    fp = per_position_logits(smol_whole, "s", PROMPT)
    lo = per_position_logits(bf16, "s", PROMPT)
    assert lo.dtype == np.float32
    for a, b in zip(fp, lo):
        assert cosine(a, b) > 0.99
    assert (fp.argmax(-1) == lo.argmax(-1)).mean() >= 0.9
    bf16.open_session("p", 16)
    assert cosine(bf16.prefill("p", 0, PROMPT), fp[-1]) > 0.99  # one chunk, last row


def test_bf16_split_equals_bf16_whole(tiny_f32):
    whole = run_chain([backend(tiny_f32, 0, 4, "bfloat16")], "s", TINY_PROMPT, n_decode=3)
    split = run_chain(
        [backend(tiny_f32, 0, 2, "bfloat16"), backend(tiny_f32, 2, 4, "bfloat16")], "s", TINY_PROMPT, n_decode=3
    )
    for w, s in zip(whole, split):  # bf16 -> float32 -> bf16 at the boundary is lossless
        np.testing.assert_allclose(s, w, rtol=0, atol=1e-5)


# -- bad input leaves other sessions intact --------------------------------------------------


def test_bad_input_raises_typed_errors_and_keeps_other_session(tiny_f32):
    head, mid = backend(tiny_f32, 0, 2), backend(tiny_f32, 2, 3)
    hidden = np.random.default_rng(0).standard_normal((4, head.hidden_size)).astype(np.float32)

    def good_steps(b, x):
        b.open_session("good", 32)
        first = b.prefill("good", 0, x[:3])
        return first, b.prefill("good", 3, x[3:4])

    ref_head = good_steps(backend(tiny_f32, 0, 2), TINY_PROMPT)
    ref_mid = good_steps(backend(tiny_f32, 2, 3), hidden)

    for b, x, ref in ((head, TINY_PROMPT, ref_head), (mid, hidden, ref_mid)):
        b.open_session("good", 32)
        np.testing.assert_array_equal(b.prefill("good", 0, x[:3]), ref[0])
        b.open_session("victim", 32)
        b.prefill("victim", 0, x[:2])
        b.close_session("victim")
        with pytest.raises(UnknownSession):
            b.prefill("victim", 2, x[2:3])  # closed
        with pytest.raises(UnknownSession):
            b.decode_step("nobody", 0, x[:1])  # never opened
        with pytest.raises(PositionGap):
            b.prefill("good", 5, x[3:4])
        with pytest.raises(PositionGap):
            b.prefill("good", 2, x[3:4])  # going back is a gap too
        with pytest.raises(BadInput):
            b.decode_step("good", 3, x[2:4])  # two positions in a decode step
        with pytest.raises(SessionExists):
            b.open_session("good", 32)
        if b.is_head:
            with pytest.raises(BadInput):
                b.prefill("good", 3, np.array([b.vocab_size], dtype=np.int32))
            with pytest.raises(BadInput):
                b.prefill("good", 3, hidden[:1])  # hidden states into the head
        else:
            with pytest.raises(BadInput):
                b.prefill("good", 3, x[3:4, :-1])  # wrong hidden size
            with pytest.raises(BadInput):
                b.prefill("good", 3, x[3:4].astype(np.float64))  # wrong dtype
            with pytest.raises(BadInput):
                b.prefill("good", 3, TINY_PROMPT[:1])  # token ids into a middle hop
        with pytest.raises(BadInput):
            b.decode_batch([("good", 3, x[3:4]), ("good", 3, x[3:4])])  # same session twice
        assert b.session_position("good") == 3
        np.testing.assert_array_equal(b.prefill("good", 3, x[3:4]), ref[1])


# -- cache accounting ----------------------------------------------------------------------


def test_cache_bytes_cover_only_the_range(smollm2_path, smol_whole):
    half = backend(smollm2_path, 0, 15)
    n_ctx = 256
    whole_bytes = smol_whole.open_session("c", n_ctx)
    half_bytes = half.open_session("c", n_ctx)
    per_layer_position = 2 * 3 * 64 * 4  # k and v, 3 kv heads of 64, float32
    assert whole_bytes == 30 * n_ctx * per_layer_position
    assert half_bytes == 15 * n_ctx * per_layer_position
    assert half.capability.cache_bytes_per_token_estimate * 2 == smol_whole.capability.cache_bytes_per_token_estimate
    assert half.sessions() == {"c": half_bytes}
    smol_whole.close_session("c")
    half.close_session("c")


def test_close_frees_the_cache(tiny_f32):
    b = backend(tiny_f32, 1, 3)
    assert b.open_session("s", 128) == 2 * 2 * 128 * 2 * 16 * 4
    b.prefill("s", 0, np.ones((2, b.hidden_size), np.float32))
    cache = weakref.ref(b._caches["s"])
    b.close_session("s")
    gc.collect()
    assert cache() is None
    assert b.sessions() == {}
    with pytest.raises(UnknownSession):
        b.cache_bytes("s")


def test_bf16_cache_is_half_size(tiny_f32):
    fp, bf = backend(tiny_f32, 0, 4), backend(tiny_f32, 0, 4, "bfloat16")
    assert fp.open_session("s", 64) == 2 * bf.open_session("s", 64)


# -- state export --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rng_range", [(0, 2), (1, 3), (2, 4)], ids=["head", "middle", "tail"])
def test_export_import_round_trip(tiny_f32, rng_range, dtype):
    a, b = rng_range
    src, dst = backend(tiny_f32, a, b, dtype), backend(tiny_f32, a, b, dtype)
    rng = np.random.default_rng(1)
    xs = TINY_PROMPT if src.is_head else rng.standard_normal((len(TINY_PROMPT), src.hidden_size)).astype(np.float32)
    src.open_session("s", 32)
    src.prefill("s", 0, xs[:7])
    blob = src.export_state("s")
    dst.import_state("copy", 32, 7, blob)
    src.import_state("copy", 32, 7, blob)  # same backend, second session
    assert dst.session_position("copy") == 7
    for pos in range(7, len(xs)):
        want = src.decode_step("s", pos, xs[pos : pos + 1])
        np.testing.assert_array_equal(dst.decode_step("copy", pos, xs[pos : pos + 1]), want)
        np.testing.assert_array_equal(src.decode_step("copy", pos, xs[pos : pos + 1]), want)


def test_import_rejects_mismatched_snapshots(tiny_f32):
    src = backend(tiny_f32, 0, 2)
    src.open_session("s", 16)
    src.prefill("s", 0, TINY_PROMPT[:4])
    blob = src.export_state("s")
    other_range = backend(tiny_f32, 0, 3)
    with pytest.raises(BadInput):
        other_range.import_state("s", 16, 4, blob)
    with pytest.raises(BadInput):
        backend(tiny_f32, 0, 2, "bfloat16").import_state("s", 16, 4, blob)  # other cache ABI
    with pytest.raises(BadInput):
        src.import_state("t", 16, 5, blob)  # wrong position: the blob holds 4
    src.import_state("t", 16, 3, blob)  # positions beyond 3 (a speculative step's drafts) are dropped
    assert src.session_position("t") == 3
    src.close_session("t")
    with pytest.raises(BadInput):
        src.import_state("t", 2, 4, blob)  # does not fit n_ctx
    with pytest.raises(BadInput):
        src.import_state("t", 16, 4, blob[:-1])
    with pytest.raises(BadInput):
        src.import_state("t", 16, 4, b"garbage" + blob)
    with pytest.raises(BadInput):
        src.import_state("t", 16, 4, blob[:10])
    with pytest.raises(BadInput):
        src.import_state("t", 0, 0, blob)
    assert list(src.sessions()) == ["s"] and other_range.sessions() == {}


# -- batched decode ------------------------------------------------------------------------


def _batched_vs_solo(path, start, end, prompts, steps=3, atol=1e-5):
    """Batched rows go through differently shaped matmuls: equal up to float32 rounding."""

    def inputs(b, p):
        if b.is_head:
            return p
        return np.random.default_rng(len(p)).standard_normal((len(p) + steps, b.hidden_size)).astype(np.float32)

    solo, batched = backend(path, start, end), backend(path, start, end)
    want, got = {}, {}
    for i, p in enumerate(prompts):
        sid, x = f"s{i}", inputs(solo, p)
        solo.open_session(sid, 64)
        solo.prefill(sid, 0, x[: len(p)])
        batched.open_session(sid, 64)
        batched.prefill(sid, 0, x[: len(p)])
        want[sid] = []
    calls = batched.forward_calls
    for step in range(steps):
        batch = []
        for i, p in enumerate(prompts):
            sid, x = f"s{i}", inputs(solo, p)
            token = (
                x[len(p) + step : len(p) + step + 1]
                if not solo.is_head
                else np.array([(7 * i + step) % 250 + 3], np.int32)
            )
            want[sid].append(solo.decode_step(sid, len(p) + step, token))
            batch.append((sid, len(p) + step, token))
        for (sid, _, _), out in zip(batch, batched.decode_batch(batch)):
            got.setdefault(sid, []).append(out)
    assert batched.forward_calls - calls == steps
    for sid in want:
        assert batched.session_position(sid) == solo.session_position(sid)
        for w, g in zip(want[sid], got[sid]):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=0, atol=atol)


def test_batched_decode_equals_solo_tiny(tiny_f32):
    prompts = [TINY_PROMPT[:3], TINY_PROMPT[:8], TINY_PROMPT[:5]]
    for start, end in ((0, 4), (0, 2), (1, 3), (2, 4)):
        _batched_vs_solo(tiny_f32, start, end, prompts)


def test_batched_decode_equals_solo_smollm2(smollm2_path):
    _batched_vs_solo(smollm2_path, 0, 30, [PROMPT[:4], PROMPT, PROMPT[:7]], atol=1e-4)  # logits ~30


# -- capability and loading ----------------------------------------------------------------


def test_capability(tiny_f32):
    b = TorchBackend(tiny_f32, 1, 3, threads=1)
    cap = b.capability
    assert cap.model_arch == "llama" and cap.supported_runtime == "torch"
    assert cap.supports_prefill and cap.supports_decode_step and cap.supports_layer_range
    assert cap.cache_abi == "torch-float32-normrope-v1"
    assert cap.cache_bytes_per_token_estimate == 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head_dim x f32
    assert cap.prefill_tokens_per_second > 0 and cap.decode_tokens_per_second > 0
    assert cap.active_memory_floor == sum(p.nbytes for p in b.model.parameters())
    assert b.forward_calls == 0  # the self-benchmark is not a session call
    assert backend(tiny_f32, 0, 4, "bfloat16").capability.cache_abi == "torch-bfloat16-normrope-v1"
    unmeasured = backend(tiny_f32, 0, 4)
    assert unmeasured.capability.prefill_tokens_per_second == 0.0  # selfbench off
    prefill, decode = unmeasured.benchmark()  # taken again later (an idle worker does)
    assert prefill > 0 and decode > 0 and unmeasured.capability.decode_tokens_per_second == decode
    assert unmeasured.forward_calls == 0


def test_loads_only_the_ranges_tensors(tiny_f32):
    head, mid, tail, whole = (backend(tiny_f32, a, b) for a, b in ((0, 1), (1, 2), (3, 4), (0, 4)))
    assert len(mid.model.layers) == 1 and len(whole.model.layers) == 4
    assert not hasattr(mid.model, "tok_embeddings") and not hasattr(mid.model, "lm_head")
    assert hasattr(head.model, "tok_embeddings") and not hasattr(head.model, "lm_head")
    assert hasattr(tail.model, "lm_head") and not hasattr(tail.model, "tok_embeddings")
    # Tied embeddings: the whole-model range shares one tensor between embedding and lm_head.
    assert whole.model.lm_head.weight.data_ptr() == whole.model.tok_embeddings.weight.data_ptr()
    assert mid.capability.active_memory_floor < head.capability.active_memory_floor
    floor = {
        name: b.capability.active_memory_floor
        for name, b in (("head", head), ("mid", mid), ("tail", tail), ("whole", whole))
    }
    embedding = whole.vocab_size * whole.hidden_size * 4
    assert floor["head"] == floor["mid"] + embedding  # one block each
    assert floor["whole"] == floor["head"] + 2 * floor["mid"] + floor["tail"] - embedding  # counted once


def test_untied_output_weight(tmp_path):
    from tests.gguf_factory import TinyLlama, write_tiny_llama

    path = write_tiny_llama(tmp_path / "untied.gguf", TinyLlama(tie_embeddings=False, quant="F32"))
    whole = run_chain([backend(path, 0, 4)], "s", TINY_PROMPT, n_decode=2)
    split = run_chain([backend(path, 0, 3), backend(path, 3, 4)], "s", TINY_PROMPT, n_decode=2)
    for w, s in zip(whole, split):
        np.testing.assert_allclose(s, w, rtol=0, atol=1e-5)


def test_unsupported_architecture(gemma3_path):
    with pytest.raises(UnsupportedModel, match="embedding scale"):
        TorchBackend(gemma3_path, 0, 4)


def test_bad_construction(tiny_f32):
    with pytest.raises(BadInput):
        backend(tiny_f32, 2, 5)
    with pytest.raises(BadInput):
        backend(tiny_f32, 0, 4, "float16")


def test_close_backend(tiny_f32):
    b = backend(tiny_f32, 0, 4)
    b.open_session("a", 8)
    b.close()
    assert b.sessions() == {}
    with pytest.raises(UnknownSession):
        b.prefill("a", 0, TINY_PROMPT[:1])
