"""llama.cpp backends: layer ranges across real processes agree bit for bit with the whole model.

Also pinned here, because they are llama.cpp internals: the boundary node name (``l_out-<n-1>``),
that returning False from the eval callback stops the graph there, and that hidden states
injected through ``batch.embd`` are not rescaled (Gemma 3 scales token embeddings only).
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from neuron_bus.execution import open_range, open_reference
from workers.errors import BadInput, PositionGap, SessionExists, UnknownSession, UnsupportedModel
from workers.llama_cpp_common import LlamaCppError, NoFreeSlot
from workers.llama_cpp_full import LlamaCppFullBackend
from workers.llama_cpp_range import LlamaCppRangeBackend
from workers.registry import open_backend

N_CTX = 256
OPTS = dict(n_ctx=N_CTX, max_sessions=4, n_threads=1, benchmark=False)
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
    "Within fifty years presses were running in more than two hundred European cities, and"
)


def ranged(path, start=None, end=None, *, cache_dir=None, n_threads=1, **opts):
    """A llama.cpp range backend the way the bus opens one (neuron_bus.execution cuts the slice)."""
    return open_range("llama-cpp", path, start, end, threads=n_threads, cache_dir=cache_dir, **opts)


def prompt_ids(full: LlamaCppFullBackend, n: int) -> np.ndarray:
    ids = full.tokenize(PROMPT)
    assert len(ids) >= n
    return np.array(ids[:n], dtype=np.int32)


# -- a pipeline of backends in separate OS processes ----------------------------------------------


def _serve(conn, kind: str, path: str, start, end, cache_dir: str) -> None:
    """Child process: one backend, driven over a pipe."""
    backend = open_range(
        kind, path, start, end, threads=1, n_ctx=N_CTX, max_sessions=1, benchmark=False, cache_dir=cache_dir
    )
    conn.send(("ready", backend.layer_start, backend.layer_end))
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "open":
                conn.send(backend.open_session(*args))
            elif cmd == "run":
                sid, pos, x = args
                conn.send(backend.prefill(sid, pos, x) if x.shape[0] > 1 else backend.decode_step(sid, pos, x))
            elif cmd == "state_size":
                conn.send(len(backend.export_state(*args)))
            elif cmd == "stop":
                backend.close()
                conn.send("bye")
                return
        except Exception as exc:  # report, keep serving
            conn.send(exc)


class Pipeline:
    """Hops in their own processes; ``run`` sends rows hop to hop and returns the tail's logits."""

    def __init__(self, path, bounds: list[tuple[int | None, int | None]], cache_dir, kind="llama-cpp"):
        ctx = mp.get_context("spawn")
        self.hops = []
        for start, end in bounds:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, kind, str(path), start, end, str(cache_dir)))
            proc.start()
            self.hops.append((parent, proc))
        self.ranges = [self._recv(conn)[1:] for conn, _ in self.hops]

    @staticmethod
    def _recv(conn):
        if not conn.poll(180):
            raise TimeoutError("hop process did not answer")
        out = conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def call(self, i, *msg):
        self.hops[i][0].send(msg)
        return self._recv(self.hops[i][0])

    def open(self, sid) -> list[int]:
        return [self.call(i, "open", sid, N_CTX) for i in range(len(self.hops))]

    def run(self, sid, pos, x):
        for i in range(len(self.hops)):
            x = self.call(i, "run", sid, pos, x)
        return x

    def close(self):
        for i, (_conn, proc) in enumerate(self.hops):
            try:
                self.call(i, "stop")
            finally:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()


def _agree_across_processes(path, splits, tmp_path, n_prompt=40, n_decode=32):
    """Whole model in one process, each split in its own processes; logits must be identical."""
    reference = Pipeline(path, [(None, None)], tmp_path, kind="llama-cpp-full")
    pipelines = [Pipeline(path, bounds, tmp_path) for bounds in splits]
    try:
        tok = LlamaCppFullBackend(path, **OPTS)
        ids = prompt_ids(tok, n_prompt)
        tok.close()
        bytes_full = reference.open("s")[0]
        bytes_split = [p.open("s") for p in pipelines]
        ref = reference.run("s", 0, ids)
        for p in pipelines:
            assert np.array_equal(p.run("s", 0, ids), ref)
        pos = n_prompt
        for _ in range(n_decode):
            token = np.array([int(ref.argmax())], dtype=np.int32)
            ref = reference.run("s", pos, token)
            for p in pipelines:  # one position per seam
                assert np.array_equal(p.run("s", pos, token), ref), f"logits differ at position {pos}"
            pos += 1
        states = [[p.call(i, "state_size", "s") for i in range(len(p.hops))] for p in pipelines]
        state_full = reference.call(0, "state_size", "s")
        return bytes_full, bytes_split, [p.ranges for p in pipelines], state_full, states
    finally:
        for p in [reference, *pipelines]:
            p.close()


@pytest.mark.slow
def test_smollm2_split_2_and_3_ways_in_processes_is_bit_identical(smollm2_path, tmp_path):
    bytes_full, bytes_split, ranges, state_full, states = _agree_across_processes(
        smollm2_path, [[(0, 15), (15, 30)], [(0, 10), (10, 20), (20, 30)]], tmp_path
    )
    assert ranges == [[(0, 15), (15, 30)], [(0, 10), (10, 20), (20, 30)]]
    # Each process holds only its own layers' KV: 15 of 30 layers is half, 10 of 30 a third (each
    # hop also keeps its own cell bookkeeping: llama.cpp's 12 bytes per position, a state header).
    for parts, k in zip(bytes_split, (2, 3)):
        assert all(abs(p - bytes_full / k) <= N_CTX * 12 + 1024 for p in parts), (parts, bytes_full)
    # llama.cpp's own count of the sequence state (72 positions) agrees: the parts sum to the
    # whole, up to a per-state header (cell positions and sequence ids, under 1 KiB).
    for parts in states:
        assert abs(sum(parts) - state_full) < 1024 * len(parts)
        assert all(s < state_full * 0.55 for s in parts)


# -- pinned llama.cpp internals --------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["C tap", "Python tap"])
def test_boundary_node_is_last_l_out_and_returning_false_stops_the_graph(tiny_f32, tmp_path, native):
    head = ranged(tiny_f32, 0, 2, cache_dir=tmp_path, native_tap=native, **OPTS)
    head.open_session("a", N_CTX)
    tap = head.lanes.context("a").tap  # the tap of the context (KV pool lane) holding the session
    assert tap.native == native  # this machine has a C compiler (llama-cpp-python needed one)
    tap.trace = []
    hidden = head.prefill("a", 0, np.arange(3, 11, dtype=np.int32))
    trace = tap.trace
    assert hidden.shape == (8, head.hidden_size) and hidden.dtype == np.float32
    assert "l_out-0" in trace and trace[-1] == "l_out-1"  # the residual output of the slice's last layer
    assert "result_norm" not in trace and "result_output" not in trace  # nothing after it ran

    # The same graph, not stopped, goes on to the output norm and lm_head.
    tap.node = b"no-such-node"
    tap.trace = []
    with pytest.raises(LlamaCppError, match="never computed"):
        head.prefill("a", 8, np.array([5], dtype=np.int32))
    assert "result_norm" in tap.trace and "result_output" in tap.trace
    assert head.session_position("a") == 8  # the failed call left the session where it was
    head.close()


def test_the_c_tap_hands_over_the_python_taps_rows_bit_for_bit(smollm2_path, tmp_path):
    """The eval callback in C (workers/native_tap.py) against the Python one, on SmolLM2's first
    19 layers: a prefill, decode steps, and a speculative step's rows of two sessions in one call."""
    native, python = (ranged(smollm2_path, 0, 19, cache_dir=tmp_path, native_tap=n, **OPTS) for n in (True, False))
    ids = np.arange(100, 140, dtype=np.int32)
    for b in (native, python):
        b.open_session("a", N_CTX)
        b.open_session("b", N_CTX)
    assert np.array_equal(native.prefill("a", 0, ids[:30]), python.prefill("a", 0, ids[:30]))
    assert np.array_equal(native.prefill("b", 0, ids[:30]), python.prefill("b", 0, ids[:30]))
    for p in range(30, 33):
        assert np.array_equal(native.decode_step("a", p, ids[p : p + 1]), python.decode_step("a", p, ids[p : p + 1]))
    steps = [("a", 33, ids[33:37]), ("b", 30, ids[30:34])]
    for x, y in zip(native.decode_rows(steps), python.decode_rows(steps)):
        assert np.array_equal(x, y)
    native.close()
    python.close()


def test_tiny_split_matches_whole_model_for_any_prefill_chunking(tiny_f32, tmp_path):
    full = LlamaCppFullBackend(tiny_f32, **OPTS)
    head = ranged(tiny_f32, 0, 1, cache_dir=tmp_path, **OPTS)
    # chunks longer than n_batch run as several llama_decode calls (the tap collects each)
    mid = ranged(tiny_f32, 1, 3, cache_dir=tmp_path, **{**OPTS, "n_batch": 4})
    tail = ranged(tiny_f32, 3, 4, cache_dir=tmp_path, **OPTS)
    ids = np.array([1] + [int(i) for i in np.random.default_rng(1).integers(3, 300, 19)], dtype=np.int32)
    for b in (full, head, mid, tail):
        b.open_session("s", N_CTX)
    ref = full.prefill("s", 0, ids)
    out = None
    for a, b in [(0, 7), (7, 8), (8, 20)]:  # uneven prefill chunks through every hop
        out = tail.prefill("s", a, mid.prefill("s", a, head.prefill("s", a, ids[a:b])))
    assert np.array_equal(out, ref)
    for b in (full, head, mid, tail):
        b.close()


@pytest.mark.slow
def test_gemma3_split_in_processes_is_bit_identical(gemma3_path, tmp_path):
    # 9 is not a multiple of gemma3's sliding-window period (6): the slices carry the pattern.
    # Hidden states enter the tail unscaled: llama.cpp scales token embeddings only.
    bytes_full, bytes_split, _, _, _ = _agree_across_processes(
        gemma3_path, [[(0, 9), (9, 18)], [(0, 5), (5, 11), (11, 18)]], tmp_path, n_prompt=40, n_decode=16
    )
    assert all(abs(p - bytes_full / 2) <= N_CTX * 12 + 1024 for p in bytes_split[0]), (bytes_split, bytes_full)


def test_gemma3_full_model_generates(gemma3_path):
    full = LlamaCppFullBackend(gemma3_path, **OPTS)
    ids = full.tokenize("Question: What is the capital of France?\nAnswer:")
    full.open_session("s", N_CTX)
    logits = full.prefill("s", 0, np.array(ids, dtype=np.int32))
    out = []
    for pos in range(len(ids), len(ids) + 4):
        out.append(int(logits.argmax()))
        logits = full.decode_step("s", pos, np.array(out[-1:], dtype=np.int32))
    assert logits.shape == (full.vocab_size,) and np.isfinite(logits).all()
    assert "Paris" in full.detokenize(out)
    full.close()


# -- sessions --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_split(smollm2_path, tmp_path_factory):
    cache = tmp_path_factory.mktemp("slices")
    head = ranged(smollm2_path, 0, 15, cache_dir=cache, **OPTS)
    tail = ranged(smollm2_path, 15, 30, cache_dir=cache, **OPTS)
    yield head, tail
    head.close()
    tail.close()


def _prompts(n=4):
    rng = np.random.default_rng(7)
    return [rng.integers(20, 40000, size=8 + 3 * i).astype(np.int32) for i in range(n)]


def _solo(head, tail, ids, tokens):
    """Logits after the prompt and after each of ``tokens`` for one session run alone."""
    head.open_session("solo", N_CTX)
    tail.open_session("solo", N_CTX)
    out = [tail.prefill("solo", 0, head.prefill("solo", 0, ids))]
    for k, t in enumerate(tokens):
        pos = len(ids) + k
        out.append(tail.decode_step("solo", pos, head.decode_step("solo", pos, np.array([t], np.int32))))
    head.close_session("solo")
    tail.close_session("solo")
    return out


def test_interleaved_sessions_match_solo_runs(smol_split):
    head, tail = smol_split
    prompts = _prompts(3)
    tokens = [[11, 22, 33], [44, 55, 66], [77, 88, 99]]
    solo = [_solo(head, tail, p, t) for p, t in zip(prompts, tokens)]
    got = {i: [] for i in range(3)}
    for i in range(len(prompts)):
        head.open_session(f"s{i}", N_CTX)
        tail.open_session(f"s{i}", N_CTX)
    for i in (2, 0, 1):
        got[i].append(tail.prefill(f"s{i}", 0, head.prefill(f"s{i}", 0, prompts[i])))
    for k in range(3):
        for i in (1, 2, 0):
            pos = len(prompts[i]) + k
            x = np.array([tokens[i][k]], np.int32)
            got[i].append(tail.decode_step(f"s{i}", pos, head.decode_step(f"s{i}", pos, x)))
    for i in range(3):
        assert all(np.array_equal(a, b) for a, b in zip(got[i], solo[i]))
        head.close_session(f"s{i}")
        tail.close_session(f"s{i}")


def test_batched_decode_of_4_sessions_equals_solo_with_fewer_calls(smol_split):
    head, tail = smol_split
    prompts = _prompts(4)
    tokens = [[101 + i, 202 + i] for i in range(4)]
    solo = [_solo(head, tail, p, t) for p, t in zip(prompts, tokens)]
    for i, p in enumerate(prompts):
        head.open_session(f"b{i}", N_CTX)
        tail.open_session(f"b{i}", N_CTX)
        tail.prefill(f"b{i}", 0, head.prefill(f"b{i}", 0, p))
    calls = (head.forward_calls, tail.forward_calls)
    for k in range(2):
        steps = [(f"b{i}", len(prompts[i]) + k, np.array([tokens[i][k]], np.int32)) for i in (3, 1, 0, 2)]
        hidden = head.decode_batch(steps)
        logits = tail.decode_batch([(sid, pos, h) for (sid, pos, _), h in zip(steps, hidden)])
        for (sid, _, _), out in zip(steps, logits):
            i = int(sid[1:])
            assert np.array_equal(out, solo[i][k + 1])
    assert (head.forward_calls - calls[0], tail.forward_calls - calls[1]) == (2, 2)  # not 8
    for i in range(4):
        head.close_session(f"b{i}")
        tail.close_session(f"b{i}")


def test_prefill_batch_of_4_sessions_equals_solo_prefills_with_fewer_calls(smol_split):
    """Chunks of equal length run in one call (two lengths: two calls); outputs and the KV left
    behind (the next decode step) are a solo run's, bit for bit."""
    head, tail = smol_split
    rng = np.random.default_rng(11)
    prompts = [rng.integers(20, 40000, size=n).astype(np.int32) for n in (8, 11, 8, 11)]
    solo = [_solo(head, tail, p, [123]) for p in prompts]
    for i in range(len(prompts)):
        head.open_session(f"p{i}", N_CTX)
        tail.open_session(f"p{i}", N_CTX)
    calls = head.forward_calls
    order = (3, 0, 1, 2)
    hidden = head.prefill_batch([(f"p{i}", 0, prompts[i]) for i in order])
    assert head.forward_calls - calls == 2  # the 8s, the 11s (not 4)
    logits = tail.prefill_batch([(f"p{i}", 0, h) for i, h in zip(order, hidden)])
    for i, out in zip(order, logits):
        assert np.array_equal(out, solo[i][0]), i
        pos = len(prompts[i])
        x = np.array([123], np.int32)
        assert np.array_equal(tail.decode_step(f"p{i}", pos, head.decode_step(f"p{i}", pos, x)), solo[i][1]), i
    with pytest.raises(BadInput, match="at most once"):
        head.prefill_batch([("p0", pos, x), ("p0", pos, x)])
    for i in range(len(prompts)):
        head.close_session(f"p{i}")
        tail.close_session(f"p{i}")


def test_export_import_round_trip(smol_split, smollm2_path, tmp_path):
    head, tail = smol_split
    ids = _prompts(1)[0]
    solo = _solo(head, tail, ids, [5, 6, 7])
    head.open_session("x", N_CTX)
    tail.open_session("x", N_CTX)
    tail.prefill("x", 0, head.prefill("x", 0, ids))
    n = len(ids)
    tail.decode_step("x", n, head.decode_step("x", n, np.array([5], np.int32)))
    blobs = head.export_state("x"), tail.export_state("x")
    head.close_session("x")
    tail.close_session("x")
    # Import into other backends (other processes would do the same) under another session id.
    head2 = ranged(smollm2_path, 0, 15, cache_dir=tmp_path, **OPTS)
    head2.open_session("other", N_CTX)  # takes slot 0, so the import lands in another sequence
    head2.import_state("y", N_CTX, n + 1, blobs[0])
    tail.import_state("y", N_CTX, n + 1, blobs[1])
    for k, t in enumerate([6, 7]):
        pos = n + 1 + k
        out = tail.decode_step("y", pos, head2.decode_step("y", pos, np.array([t], np.int32)))
        assert np.array_equal(out, solo[k + 2])
    with pytest.raises(BadInput, match="positions"):
        head2.import_state("z", N_CTX, n + 2, blobs[0])  # the blob holds n + 1 positions
    head2.import_state("z", N_CTX, n, blobs[0])  # the last one (a speculative step's draft) dropped
    assert head2.session_position("z") == n and head2.lanes.context("z").seq_pos_max(head2.lanes.seq("z")) == n - 1
    head2.close_session("z")
    with pytest.raises(BadInput):
        head2.import_state("z", N_CTX, n + 1, b"not a llama.cpp state")
    assert set(head2.sessions()) == {"other", "y"}  # failed imports hold no slot
    tail.close_session("y")
    head2.close()


# -- bad input -------------------------------------------------------------------------------------


def test_bad_input_raises_typed_errors_and_leaves_other_sessions_intact(tiny_f32, tmp_path):
    head = ranged(tiny_f32, 0, 2, cache_dir=tmp_path, **OPTS)
    tail = ranged(tiny_f32, 2, 4, cache_dir=tmp_path, **OPTS)
    ids = np.arange(3, 15, dtype=np.int32)
    ref = _solo(head, tail, ids, [7, 8])

    for b in (head, tail):
        b.open_session("good", N_CTX)
        b.open_session("bad", N_CTX)
    tail.prefill("good", 0, head.prefill("good", 0, ids))
    h_bad = head.prefill("bad", 0, ids)
    tail.prefill("bad", 0, h_bad)
    h = head.decode_step("bad", 12, np.array([7], np.int32))
    H = tail.hidden_size

    # tail "bad" expects position 12 next, head "bad" position 13
    with pytest.raises(BadInput, match="shape"):
        tail.decode_step("bad", 12, np.zeros((1, H + 1), np.float32))  # wrong hidden size
    with pytest.raises(BadInput, match="float32"):
        tail.decode_step("bad", 12, h.astype(np.float16))  # wrong dtype
    with pytest.raises(BadInput, match="token ids"):
        head.decode_step("bad", 13, h)  # hidden states to the head
    with pytest.raises(BadInput, match="out of range"):
        head.decode_step("bad", 13, np.array([head.vocab_size], np.int32))
    with pytest.raises(BadInput, match="out of range"):
        head.decode_step("bad", 13, np.array([-1], np.int64))  # a decode step's one token is checked too
    with pytest.raises(BadInput, match="out of range"):
        head.prefill("bad", 13, np.array([3, head.vocab_size + 5, 4], np.int32))  # one bad id among several
    with pytest.raises(BadInput, match="token ids"):
        head.decode_step("bad", 13, np.array([True]))  # bool is no token id
    with pytest.raises(BadInput, match="token ids"):
        head.decode_step("bad", 13, np.array([[7]], np.int32))  # 2-D
    with pytest.raises(PositionGap):
        tail.decode_step("bad", 13, h)  # position gap
    with pytest.raises(PositionGap):
        tail.decode_step("bad", 11, h)  # replay
    with pytest.raises(BadInput, match="n_ctx"):
        tail.prefill("bad", 12, np.zeros((N_CTX, H), np.float32))
    with pytest.raises(UnknownSession):
        tail.decode_step("nobody", 0, h)
    with pytest.raises(SessionExists):
        tail.open_session("good", N_CTX)
    with pytest.raises(BadInput, match="positions per session"):
        tail.open_session("huge", N_CTX * 2)
    tail.close_session("bad")
    with pytest.raises(UnknownSession):
        tail.decode_step("bad", 12, h)  # closed
    with pytest.raises(UnknownSession):
        tail.export_state("bad")

    # The good session continues exactly as if nothing happened.
    out = [
        tail.decode_step("good", 12 + k, head.decode_step("good", 12 + k, np.array([t], dtype)))
        for k, (t, dtype) in enumerate([(7, np.int32), (8, np.uint16)])  # any integer dtype is token ids
    ]
    assert np.array_equal(out[0], ref[1]) and np.array_equal(out[1], ref[2])
    head.close()
    tail.close()


def test_slots_are_limited_and_freed(tiny_f32):
    full = LlamaCppFullBackend(tiny_f32, n_ctx=64, max_sessions=2, benchmark=False)
    full.open_session("a", 64)
    full.open_session("b", 64)
    with pytest.raises(NoFreeSlot):
        full.open_session("c", 64)
    assert full.sessions() == {"a": full.cache_bytes("a"), "b": full.cache_bytes("b")}
    full.close_session("a")
    full.open_session("c", 64)
    full.close()


def test_batch_rank_is_the_slot_so_waves_can_be_runs_of_neighbours(tiny_f32):
    # llama.cpp runs only consecutive sequence ids in one pass; the worker's head groups its
    # decode waves by this rank (neuron_bus.worker.waves)
    full = LlamaCppFullBackend(tiny_f32, n_ctx=64, max_sessions=4, benchmark=False)
    for sid in "abcd":
        full.open_session(sid, 64)
    assert [full.batch_rank(sid) for sid in "abcd"] == [0, 1, 2, 3]
    full.close_session("b")
    full.open_session("e", 64)  # the lowest free slot
    assert full.batch_rank("e") == 1
    with pytest.raises(UnknownSession):
        full.batch_rank("b")
    full.close()


# -- construction, capability, registry ---------------------------------------------------------


def test_capability_and_cache_abi(tiny_f32, tmp_path):
    b = ranged(tiny_f32, 1, 3, cache_dir=tmp_path, n_ctx=N_CTX, max_sessions=2)
    cap = b.capability
    assert cap.model_arch == "llama" and cap.supported_runtime == "llama.cpp"
    assert cap.supports_layer_range and cap.supports_partial_artifacts
    assert cap.prefill_tokens_per_second > 0 and cap.decode_tokens_per_second > 0  # self-benchmark
    assert cap.cache_abi.startswith("llama.cpp-0.3.36-fa1-f16kv")
    # K and V, f16, for this file's 2 layers: 2 kv heads x 16 dims x 2 (K, V) x 2 bytes per layer,
    # plus llama.cpp's own bookkeeping of each cell (position, sequences): 12 bytes.
    assert cap.cache_bytes_per_token_estimate == 2 * (2 * 16 * 2 * 2) + 12
    assert cap.supports_truncate and 0 < cap.cache_fixed_bytes < 1024  # a KV cache: only the state header
    assert b.open_session("s", 100) == N_CTX * cap.cache_bytes_per_token_estimate + cap.cache_fixed_bytes
    assert cap.active_memory_floor > 2 * N_CTX * cap.cache_bytes_per_token_estimate
    assert (b.layer_start, b.layer_end, b.n_layers) == (1, 3, 4) and not b.is_head and not b.is_tail
    b.close()
    nofa = ranged(tiny_f32, 1, 3, cache_dir=tmp_path, flash_attn=False, **OPTS)
    assert "-fa0-" in nofa.cache_abi and nofa.capability.prefill_tokens_per_second == 0.0
    # taken again later (an idle worker does): beside an open session, whose cache it leaves alone
    nofa.open_session("s", 16)
    nofa.prefill("s", 0, np.ones((3, nofa.hidden_size), np.float32))
    prefill, decode = nofa.benchmark()
    assert prefill > 0 and decode > 0
    assert (nofa.capability.prefill_tokens_per_second, nofa.capability.decode_tokens_per_second) == (prefill, decode)
    assert nofa.session_position("s") == 3
    nofa.decode_step("s", 3, np.ones((1, nofa.hidden_size), np.float32))
    nofa.close()


def test_slice_path_is_loaded_with_its_own_range(tiny_f32, tmp_path):
    a = ranged(tiny_f32, 2, 4, cache_dir=tmp_path, **OPTS)
    again = ranged(a.file, **OPTS)  # the cached slice file itself
    assert (again.layer_start, again.layer_end, again.n_layers) == (2, 4, 4) and again.is_tail
    with pytest.raises(BadInput, match="slice"):
        ranged(a.file, 0, 2, **OPTS)
    with pytest.raises(UnsupportedModel, match="slice"):
        open_reference(a.file, **OPTS)
    with pytest.raises(BadInput, match="outside"):
        ranged(tiny_f32, 2, 9, cache_dir=tmp_path, **OPTS)
    with pytest.raises(UnsupportedModel):
        LlamaCppRangeBackend(tmp_path / "missing.gguf", **OPTS)
    a.close()
    again.close()


def test_registry_opens_each_kind(tiny_f32, tmp_path):
    b = open_range("llama-cpp", tiny_f32, 0, 2, threads=1, cache_dir=tmp_path, benchmark=False)
    assert isinstance(b, LlamaCppRangeBackend) and b.backend_id == "llama-cpp" and not b.is_tail
    b.close()
    f = open_backend("llama-cpp-full", tiny_f32, threads=1, benchmark=False)
    assert f.backend_id == "llama-cpp-full" and f.is_head and f.is_tail
    f.close()
    with pytest.raises(BadInput, match="all 4 layers"):
        open_backend("llama-cpp-full", tiny_f32, 0, 2, benchmark=False)
    with pytest.raises(BadInput, match="unknown backend"):
        open_backend("onnx", tiny_f32)


def test_full_backend_text_helpers(smollm2_path):
    full = LlamaCppFullBackend(smollm2_path, **OPTS)
    ids = full.tokenize("Hello world", add_bos=False)
    assert full.detokenize(ids) == "Hello world"
    assert full.tokenize("<|im_start|>user", special=True)[0] == 1  # one special token
    assert len(full.tokenize("<|im_start|>", special=False)) > 1
    assert (full.bos_id, full.eos_id) == (1, 2) and full.is_eog(full.eos_id)
    assert "<|im_start|>" in full.chat_template
    full.close()


def test_chat_without_a_gguf_template_uses_llama_cpps_builtin_one(gemma3_path, smollm2_path):
    """The shipped Gemma 3 GGUF carries no chat template: llama.cpp's gemma turn format stands in."""
    from workers.tokenizer import Tokenizer

    gemma = Tokenizer(gemma3_path)
    assert gemma.chat_template is None and gemma.builtin_template == "gemma"
    text, ids = gemma.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert ids[0] == gemma.bos_id and ids.count(gemma.bos_id) == 1  # Gemma wants its BOS, once
    smol = Tokenizer(smollm2_path)
    text, ids = smol.encode_chat([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system") and ids == smol.encode(text, add_bos=False)
