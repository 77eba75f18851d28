"""Artifact manifests, plans, proofs by hash and slices: the tiny synthetic model and SmolLM2-135M."""

from __future__ import annotations

import hashlib
import random
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from neuron_bus.artifacts.gguf_model import ArtifactError, GGUFModel, needed_shared
from neuron_bus.artifacts.manifest import build_manifest, load_manifest, save_manifest
from neuron_bus.artifacts.plan import plan
from neuron_bus.artifacts.slicing import slice_gguf
from neuron_bus.artifacts.verify import verify
from tests.gguf_factory import TinyLlama, write_tiny_llama

CLI = str(Path(sys.executable).parent / "neuron-bus")
PIECE = 4096  # small pieces so the tiny model has many
TINY = TinyLlama()  # Q8_0 blocks


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, "artifact", *map(str, args)], capture_output=True, text=True, timeout=120)


def assert_one_line_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    assert res.returncode != 0, res.stdout
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def write_split(model_path: Path, out_dir: Path, max_tensors: int) -> list[Path]:
    """Rewrite a GGUF as a gguf-split set with gguf's own writer (split.* keys, one header per file)."""
    reader = gguf.GGUFReader(model_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(out_dir / model_path.name, arch, split_max_tensors=max_tensors)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(out_dir.glob("*-of-*.gguf"))


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_manifest(tiny_gguf):
    return build_manifest(tiny_gguf, piece_size=PIECE)


@pytest.fixture(scope="module")
def smol_model(smollm2_path) -> GGUFModel:
    """Opened once: parsing SmolLM2's tokenizer metadata takes seconds."""
    return GGUFModel(smollm2_path)


@pytest.fixture(scope="module")
def smol_manifest(smol_model):
    return build_manifest(smol_model)


# ------------------------------------------------------------------------------------------
# Manifest


def test_manifest_fields_and_hashes(tiny_gguf, tiny_manifest, tmp_path):
    m = tiny_manifest
    model = GGUFModel(tiny_gguf)
    size = tiny_gguf.stat().st_size
    assert m.file_hashes[0].name == tiny_gguf.name and m.file_hashes[0].size == size
    assert m.file_hashes[0].sha256 == file_sha(tiny_gguf)
    assert m.model_preset == "tiny-llama" and m.runtime_backend == "llama.cpp"
    assert m.quantization == "Q8_0" and m.context_cap == 512 and m.piece_size == PIECE
    cd = m.cache_descriptor
    assert (cd.architecture, cd.n_layers, cd.n_kv_heads, cd.head_dim, cd.hidden_size) == ("llama", 4, 2, 16, 64)
    assert cd.kv_bytes_per_token_per_layer == 2 * 16 * 2 * 2  # K and V, 2 heads x 16, f16
    assert "tokenizer.ggml.tokens" in m.tokenizer_artifacts
    assert set(m.layer_to_artifact_map) == {"0", "1", "2", "3"}

    # Pieces tile the file exactly, never exceed piece_size, and hash what they cover.
    data = tiny_gguf.read_bytes()
    offset = 0
    for i, p in enumerate(m.piece_hashes):
        assert p.index == i and p.offset == offset and 0 < p.length <= PIECE
        assert hashlib.sha256(data[p.offset : p.offset + p.length]).hexdigest() == p.sha256
        offset += p.length
    assert offset == size
    assert m.header_pieces == [p.index for p in m.piece_hashes if p.region == "header"]
    assert m.piece_hashes[m.header_pieces[-1]].offset + m.piece_hashes[m.header_pieces[-1]].length == min(
        t.offset for t in model.tensors
    )

    # Every tensor is mapped, with its layer, its pieces and its own hash.
    assert {t.name for t in m.tensor_to_layer_map} == set(model.by_name)
    for e in m.tensor_to_layer_map:
        t = model.by_name[e.name]
        assert (e.offset, e.nbytes, e.layer, e.ggml_type) == (t.offset, t.nbytes, t.layer, t.ggml_type.name)
        assert e.sha256 == hashlib.sha256(data[e.offset : e.offset + e.nbytes]).hexdigest()
        covered = [m.piece_hashes[i] for i in e.pieces]
        assert covered[0].offset <= e.offset and covered[-1].offset + covered[-1].length >= e.offset + e.nbytes
        # A piece never straddles two regions: block pieces belong to one layer.
        assert {p.region for p in covered} == {f"blk.{e.layer}" if e.layer is not None else e.name}

    # Content-derived id; JSON round trip.
    assert build_manifest(tiny_gguf, piece_size=PIECE).artifact_id == m.artifact_id
    assert build_manifest(tiny_gguf, piece_size=2 * PIECE).artifact_id != m.artifact_id
    path = save_manifest(m, tmp_path / "m.json")
    assert load_manifest(path) == m
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_manifest_smollm2_maps_all_layers(smollm2_path, smol_manifest):
    m = smol_manifest
    assert m.cache_descriptor.n_layers == 30
    assert m.cache_descriptor.kv_bytes_per_token_per_layer == 3 * 64 * 2 * 2
    assert m.model_preset == "smollm2-135m" and m.upstream_repo == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert m.quantization == "Q4_1" and m.context_cap == 8192
    assert sorted(map(int, m.layer_to_artifact_map)) == list(range(30))
    assert all(m.layer_to_artifact_map[str(i)] for i in range(30))
    layers = {e.layer for e in m.tensor_to_layer_map if e.layer is not None}
    assert layers == set(range(30))


# ------------------------------------------------------------------------------------------
# Plan


def test_plan_halves_of_smollm2(smol_manifest):
    m = smol_manifest
    head, tail = plan(m, 0, 15), plan(m, 15, 30)
    assert head.block_pieces and tail.block_pieces
    assert not set(head.block_pieces) & set(tail.block_pieces)  # disjoint block pieces
    # Both halves carry the shared tensors they need (tied embeddings: the tail's lm_head is token_embd).
    assert set(head.shared_pieces) == {"token_embd.weight", "output_norm.weight"}
    assert set(tail.shared_pieces) == {"token_embd.weight", "output_norm.weight"}
    assert head.header_pieces == tail.header_pieces == m.header_pieces
    # Together they cover every tensor of the file.
    union = set(head.pieces) | set(tail.pieces)
    for e in m.tensor_to_layer_map:
        assert set(e.pieces) <= union, e.name
    assert head.nbytes == sum(m.piece_hashes[i].length for i in head.pieces)
    assert head.nbytes < m.file_hashes[0].size


def test_plan_middle_range_needs_no_embedding(smol_manifest):
    m = smol_manifest
    pl = plan(m, 5, 10)
    embd = next(e for e in m.tensor_to_layer_map if e.name == "token_embd.weight")
    assert pl.placeholders == ["token_embd.weight"]
    assert not set(embd.pieces) & set(pl.pieces)
    assert set(pl.shared_pieces) == {"output_norm.weight"}
    assert pl.nbytes < m.file_hashes[0].size // 5
    own = {e.name for e in m.tensor_to_layer_map if e.layer is not None and 5 <= e.layer < 10}
    for e in m.tensor_to_layer_map:
        if e.name in own:
            assert set(e.pieces) <= set(pl.block_pieces)


def test_plan_untied_tail_needs_output(tmp_path):
    path = write_tiny_llama(tmp_path / "untied.gguf", TinyLlama(tie_embeddings=False))
    m = build_manifest(path, piece_size=PIECE)
    assert set(plan(m, 2, 4).shared_pieces) == {"output_norm.weight", "output.weight"}
    assert set(plan(m, 0, 2).shared_pieces) == {"output_norm.weight", "token_embd.weight"}
    assert needed_shared(["token_embd.weight", "output_norm.weight"], 4, 2, 4)[0] == [
        "output_norm.weight",
        "token_embd.weight",
    ]


@pytest.mark.parametrize("start,end", [(0, 5), (3, 3), (-1, 2), (2, 1)])
def test_plan_rejects_ranges_outside_the_model(tiny_manifest, start, end):
    with pytest.raises(ArtifactError, match="outside the model"):
        plan(tiny_manifest, start, end)


# ------------------------------------------------------------------------------------------
# Slices and proofs


def all_ranges(n: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(n) for b in range(a + 1, n + 1)]


def load_in_llama_cpp(path: Path) -> int:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, n_batch=32, verbose=False)
    try:
        return llm.n_embd()
    finally:
        llm.close()


def test_every_tiny_range_slices_loads_and_proves_itself(tiny_gguf, tiny_manifest, tmp_path):
    for start, end in all_ranges(4):
        d = tmp_path / f"r{start}-{end}"
        path = slice_gguf(tiny_gguf, start, end, d / "slice.gguf", tiny_manifest.artifact_id)
        assert load_in_llama_cpp(path) == 64
        report = verify(d, tiny_manifest)
        assert report.ranges == [(start, end)], (start, end, report.problem)
        assert report.sources[0].kind == "slice" and report.sources[0].ok


@pytest.mark.slow
@pytest.mark.parametrize("start,end", [(0, 15), (15, 30), (5, 10), (0, 30), (29, 30)])
def test_smollm2_slices_load_and_prove_themselves(smol_model, smol_manifest, tmp_path, start, end):
    path = slice_gguf(smol_model, start, end, tmp_path / "s.gguf", smol_manifest.artifact_id)
    assert load_in_llama_cpp(path) == 576
    assert verify(tmp_path, smol_manifest).ranges == [(start, end)]


@pytest.mark.slow
def test_verify_original_and_slice_directories(smollm2_path, smol_model, smol_manifest, tmp_path):
    m = smol_manifest
    assert verify(smollm2_path, m).ranges == [(0, 30)]
    tail = tmp_path / "tail"
    slice_gguf(smol_model, 15, 30, tail / "s.gguf", m.artifact_id)
    assert verify(tail, m).ranges == [(15, 30)]
    # A head slice beside it: the directory proves the whole model between them.
    both = tmp_path / "both"
    shutil.copytree(tail, both)
    slice_gguf(smol_model, 0, 15, both / "head.gguf", m.artifact_id)
    assert verify(both, m).ranges == [(0, 30)]
    # Two middle slices with a gap.
    gap = tmp_path / "gap"
    slice_gguf(smol_model, 2, 5, gap / "a.gguf", m.artifact_id)
    slice_gguf(smol_model, 8, 10, gap / "b.gguf", m.artifact_id)
    assert verify(gap, m).ranges == [(2, 5), (8, 10)]


def test_verify_sparse_reassembly_proves_only_its_pieces(tiny_gguf, tiny_manifest, tmp_path):
    """A copy holding only the pieces of layers 1-2 (holes elsewhere) proves exactly 1-2."""
    m = tiny_manifest
    pl = plan(m, 1, 3)
    data = tiny_gguf.read_bytes()
    sparse = tmp_path / tiny_gguf.name
    with open(sparse, "wb") as f:
        f.truncate(len(data))
        for i in pl.pieces:
            p = m.piece_hashes[i]
            f.seek(p.offset)
            f.write(data[p.offset : p.offset + p.length])
    report = verify(tmp_path, m)
    assert report.ranges == [(1, 3)]
    assert not report.sources[0].ok and "do not match" in report.problem


def test_verify_rejects_tampered_and_foreign_slices(tiny_gguf, tiny_manifest, tmp_path):
    m = tiny_manifest
    # One flipped byte inside block 1's tensors: layer 1 is no longer proven.
    path = slice_gguf(tiny_gguf, 0, 4, tmp_path / "t" / "s.gguf", m.artifact_id)
    t = GGUFModel(path).by_name["blk.1.ffn_up.weight"]
    with open(path, "r+b") as f:
        f.seek(t.offset + 7)
        b = f.read(1)
        f.seek(t.offset + 7)
        f.write(bytes([b[0] ^ 0xFF]))
    report = verify(tmp_path / "t", m)
    assert report.ranges == [(0, 1), (2, 4)]
    assert "blk.1.ffn_up.weight" in report.problem
    # A slice recorded as another artifact's.
    slice_gguf(tiny_gguf, 0, 2, tmp_path / "o" / "s.gguf", "0" * 32)
    report = verify(tmp_path / "o", m)
    assert report.ranges == [] and "not " + m.artifact_id in report.problem
    # A slice of different weights (same shapes and metadata) without an artifact id.
    (tmp_path / "w").mkdir()
    other = write_tiny_llama(tmp_path / "w" / "tiny-llama.gguf", TinyLlama(seed=1))
    slice_gguf(other, 1, 3, tmp_path / "x" / "s.gguf")
    report = verify(tmp_path / "x", m)
    assert report.ranges == [] and "tensors do not match" in report.problem
    # The different model itself, with the same name and header: no piece of its weights matches.
    report = verify(other, m)
    assert report.ranges == [] and "do not match" in report.problem


def test_verify_file_of_another_model(tiny_gguf, smol_manifest):
    report = verify(tiny_gguf, smol_manifest)
    assert report.ranges == [] and f"not a file of artifact {smol_manifest.artifact_id}" in report.problem


# ------------------------------------------------------------------------------------------
# gguf-split models


def test_split_model_manifest_plan_slice_verify(tiny_gguf, tiny_manifest, tmp_path):
    files = write_split(tiny_gguf, tmp_path / "split", max_tensors=10)
    assert len(files) >= 3
    shuffled = files[:]
    random.Random(0).shuffle(shuffled)
    m = build_manifest(shuffled, piece_size=PIECE)  # given out of order: put in split order
    assert [f.name for f in m.file_hashes] == [f.name for f in files]
    assert {e.file for e in m.tensor_to_layer_map} == {f.name for f in files}
    # Every file's header is needed to read the set; the tensors are the same as the single file's.
    assert {m.piece_hashes[i].file for i in m.header_pieces} == {f.name for f in files}
    single = {e.name: e.sha256 for e in tiny_manifest.tensor_to_layer_map}
    assert {e.name: e.sha256 for e in m.tensor_to_layer_map} == single
    assert m.metadata_sha256 == tiny_manifest.metadata_sha256
    assert m.artifact_id != tiny_manifest.artifact_id
    for start, end in [(0, 2), (2, 4), (1, 3)]:
        pl = plan(m, start, end)
        files_touched = {m.piece_hashes[i].file for i in pl.block_pieces}
        assert files_touched <= {f.name for f in files}
    assert verify(tmp_path / "split", m).ranges == [(0, 4)]
    # A slice of the split set is the slice of the single file, and proves itself against either.
    s1 = slice_gguf(GGUFModel(files), 1, 3, tmp_path / "a" / "s.gguf")
    s2 = slice_gguf(tiny_gguf, 1, 3, tmp_path / "b" / "s.gguf")
    assert file_sha(s1) == file_sha(s2)
    assert verify(tmp_path / "a", m).ranges == [(1, 3)]
    assert load_in_llama_cpp(s1) == 64
    # One file of the set missing: the manifest command names the problem.
    res = run_cli("manifest", files[0], files[1], "-o", tmp_path / "m.json")
    assert_one_line_error(res, "pass all of them")
    assert not (tmp_path / "m.json").exists()


# ------------------------------------------------------------------------------------------
# CLI, including bad input: one line on stderr, non-zero exit, nothing half-written


def test_cli_manifest_plan_slice_verify(tiny_gguf, tmp_path):
    res = run_cli("manifest", tiny_gguf, "-o", tmp_path / "m.json", "--piece-size", PIECE, "--revision", "r1")
    assert res.returncode == 0, res.stderr
    m = load_manifest(tmp_path / "m.json")
    assert m.upstream_revision == "r1" and m.artifact_id in res.stdout
    res = run_cli("plan", tmp_path / "m.json", "--layers", "1-2", "--json")
    assert res.returncode == 0, res.stderr
    import json

    assert json.loads(res.stdout)["pieces"] == plan(m, 1, 3).pieces
    res = run_cli(
        "slice", tiny_gguf, "--layers", "1-2", "-o", tmp_path / "d" / "s.gguf", "--manifest", tmp_path / "m.json"
    )
    assert res.returncode == 0, res.stderr
    res = run_cli("verify", tmp_path / "d", "--manifest", tmp_path / "m.json", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["ranges"] == ["1-2"]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["s.gguf"]


def test_cli_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a model\n" * 100)
    out = tmp_path / "out"
    assert_one_line_error(run_cli("manifest", bad, "-o", out / "m.json"), "not a GGUF")
    assert_one_line_error(run_cli("slice", bad, "--layers", "0-1", "-o", out / "s.gguf"), "not a GGUF")
    assert not out.exists()


def test_cli_truncated_gguf(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    out = tmp_path / "out"
    for cut in (len(data) - 100, 2000, 10):  # inside the tensor data, inside the header, in the preamble
        bad = tmp_path / "truncated.gguf"
        bad.write_bytes(data[:cut])
        assert_one_line_error(run_cli("manifest", bad, "-o", out / "m.json"), "truncated")
        assert_one_line_error(run_cli("slice", bad, "--layers", "0-1", "-o", out / "s.gguf"), "truncated")
    assert not out.exists()


def test_cli_layer_range_outside_the_model(tiny_gguf, tmp_path):
    out = tmp_path / "out"
    assert_one_line_error(
        run_cli("slice", tiny_gguf, "--layers", "2-4", "-o", out / "s.gguf"), "outside the model", "0-3"
    )
    assert_one_line_error(run_cli("slice", tiny_gguf, "--layers", "3-1", "-o", out / "s.gguf"), "bad layer range")
    save_manifest(build_manifest(tiny_gguf, piece_size=PIECE), tmp_path / "m.json")
    assert_one_line_error(run_cli("plan", tmp_path / "m.json", "--layers", "0-9"), "outside the model")
    assert not out.exists()


def test_cli_manifest_for_a_different_file(tiny_gguf, tmp_path):
    save_manifest(build_manifest(tiny_gguf, piece_size=PIECE), tmp_path / "m.json")
    (tmp_path / "other").mkdir()
    other = write_tiny_llama(tmp_path / "other" / tiny_gguf.name, TinyLlama(seed=7))
    assert_one_line_error(run_cli("verify", other, "--manifest", tmp_path / "m.json"), "do not match")
    out = tmp_path / "out"
    err = assert_one_line_error(
        run_cli("slice", other, "--layers", "0-1", "-o", out / "s.gguf", "--manifest", tmp_path / "m.json"),
        "different file",
    )
    assert "Traceback" not in err
    assert not out.exists()
    other2 = write_tiny_llama(tmp_path / "other2.gguf", TinyLlama(n_layers=2))
    assert_one_line_error(run_cli("verify", other2, "--manifest", tmp_path / "m.json"), "not a file of artifact")
    (tmp_path / "junk.json").write_text('{"hello": 1}')
    assert_one_line_error(
        run_cli("verify", tiny_gguf, "--manifest", tmp_path / "junk.json"), "not an artifact manifest"
    )


@pytest.mark.parametrize("which", ["tiny", "smollm2-135m", "gemma3-270m"])
def test_the_fast_reader_reads_what_ggufs_own_reader_reads(which, tmp_path):
    """workers.gguf_reader parses through a plain view of the mapping (several times faster on a
    large vocabulary): every field's parts, indices and types, and every tensor, equal the stock
    reader's."""
    from neuron_bus import models
    from workers.gguf_reader import GGUFReader

    path = write_tiny_llama(tmp_path / "tiny.gguf", TINY) if which == "tiny" else models.resolve(which)
    stock, fast = gguf.GGUFReader(path), GGUFReader(path)
    assert list(fast.fields) == list(stock.fields) and len(fast.fields) > 10
    for name, want in stock.fields.items():
        got = fast.fields[name]
        assert (got.offset, got.name, got.data, got.types) == (want.offset, want.name, want.data, want.types), name
        assert [(p.dtype, p.tobytes()) for p in got.parts] == [(p.dtype, p.tobytes()) for p in want.parts], name
        assert got.contents() == want.contents(), name
    assert len(fast.tensors) == len(stock.tensors) > 0
    for got, want in zip(fast.tensors, stock.tensors):
        assert (got.name, got.tensor_type, list(got.shape), got.data_offset, got.n_bytes) == (
            want.name,
            want.tensor_type,
            list(want.shape),
            want.data_offset,
            want.n_bytes,
        )
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
        assert got.data.ravel()[:1024].tobytes() == want.data.ravel()[:1024].tobytes()
        assert not got.data.flags.writeable  # a view of the read-only mapping, as the stock reader's
