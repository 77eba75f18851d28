"""The shard swarm against a real nats-server: publish, fetch only a range's pieces, verify, resolve."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_bus.artifacts.gguf_model import ArtifactError
from neuron_bus.artifacts.manifest import build_manifest, save_manifest
from neuron_bus.artifacts.plan import plan
from neuron_bus.artifacts.slicing import slice_gguf
from neuron_bus.artifacts.swarm import (
    artifact_store,
    fetch,
    fetch_manifest,
    piece_object,
    publish,
    resolve_artifact,
)
from neuron_bus.artifacts.verify import verify
from neuron_bus.topology import connect
from tests.gguf_factory import TinyLlama, write_tiny_llama
from tests.test_artifacts import PIECE, TINY, assert_one_line_error, load_in_llama_cpp, write_split

CLI = str(Path(sys.executable).parent / "neuron-bus")


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def tiny(tmp_path) -> Path:
    (tmp_path / "model").mkdir()
    return write_tiny_llama(tmp_path / "model" / "tiny-llama.gguf", TINY)


async def test_publish_fetch_tiny_every_range_loads(nats_server, tiny, tmp_path):
    nc = await connect(nats_server.url)
    try:
        js = nc.jetstream()
        m = build_manifest(tiny, piece_size=PIECE)
        seen = []
        res = await publish(js, [tiny], m, progress=lambda done, total: seen.append((done, total)))
        assert res.pieces_put == len(m.piece_hashes) and res.pieces_present == 0
        assert seen[-1] == (tiny.stat().st_size, tiny.stat().st_size)
        again = await publish(js, [tiny], m)  # seeding again sends nothing
        assert again.pieces_put == 0 and again.pieces_present == len(m.piece_hashes)
        assert await fetch_manifest(js, m.artifact_id) == m
        for start, end in [(0, 4), (0, 1), (1, 3), (3, 4)]:
            out = tmp_path / f"out-{start}-{end}"
            r = await fetch(js, m.artifact_id, start, end, out)
            assert r.bytes_downloaded == plan(m, start, end).nbytes
            assert verify(out, m).ranges == [(start, end)]
            # The fetched slice is exactly the slice cut from the whole file.
            assert sha(r.path) == sha(slice_gguf(tiny, start, end, tmp_path / "ref.gguf", m.artifact_id))
            assert load_in_llama_cpp(r.path) == 64
            assert [p.name for p in out.iterdir()] == [r.path.name]  # no temp left behind
    finally:
        await nc.close()


@pytest.mark.slow
async def test_smollm2_fetch_range_downloads_fewer_bytes(nats_server, smollm2_path, tmp_path):
    size = smollm2_path.stat().st_size
    nc = await connect(nats_server.url)
    try:
        js = nc.jetstream()
        m = build_manifest(smollm2_path)
        await publish(js, [smollm2_path], m)
        # The tail half, over a fresh connection so its byte counters are this fetch's alone.
        nc2 = await connect(nats_server.url)
        try:
            out = tmp_path / "tail"
            r = await fetch(nc2.jetstream(), m.artifact_id, 15, 30, out)
            received = nc2.stats["in_bytes"]
        finally:
            await nc2.close()
        pl = plan(m, 15, 30)
        assert r.bytes_downloaded == pl.nbytes
        assert r.bytes_downloaded < 0.7 * size  # the head's blocks never travel
        assert pl.nbytes <= received < pl.nbytes + size // 10  # what actually crossed the wire
        # Acceptance: a directory holding only the fetched 15-29 slice proves exactly 15-29.
        assert [p.name for p in out.iterdir()] == [r.path.name]
        assert verify(out, m).ranges == [(15, 30)]
        assert sha(r.path) == sha(slice_gguf(smollm2_path, 15, 30, tmp_path / "ref.gguf", m.artifact_id))
        # A middle range downloads far less: no embedding table, no neighbours' blocks.
        mid = await fetch(js, m.artifact_id, 5, 10, tmp_path / "mid")
        assert mid.bytes_downloaded == plan(m, 5, 10).nbytes < size // 5
        assert load_in_llama_cpp(mid.path) == 576
    finally:
        await nc.close()


async def test_corrupt_piece_in_store_fails_fetch_and_leaves_nothing(nats_server, tiny, tmp_path):
    nc = await connect(nats_server.url)
    try:
        js = nc.jetstream()
        m = build_manifest(tiny, piece_size=PIECE)
        await publish(js, [tiny], m)
        victim = plan(m, 1, 3).block_pieces[0]
        p = m.piece_hashes[victim]
        obs = await artifact_store(js)
        await obs.put(piece_object(m.artifact_id, victim), b"\x00" * p.length)  # a valid object, wrong bytes
        out = tmp_path / "out"
        with pytest.raises(ArtifactError, match=f"piece {victim} of artifact {m.artifact_id}.*hash check"):
            await fetch(js, m.artifact_id, 1, 3, out)
        assert not out.exists()
        # Ranges that do not need the corrupt piece still fetch.
        r = await fetch(js, m.artifact_id, 3, 4, tmp_path / "ok")
        assert verify(r.path, m).ranges == [(3, 4)]
    finally:
        await nc.close()
    # The CLI: one line naming the piece, non-zero exit, no output directory.
    res = subprocess.run(
        [CLI, "artifact", "fetch", "--model", m.artifact_id, "--layers", "1-2", "-o", out, "--nats", nats_server.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(res, f"piece {victim}", "hash check")
    assert not out.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    res = subprocess.run(
        [
            CLI,
            "artifact",
            "fetch",
            "--model",
            m.artifact_id,
            "--layers",
            "0-3",
            "-o",
            existing,
            "--nats",
            nats_server.url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(res, f"piece {victim}")
    assert list(existing.iterdir()) == []


async def test_resolve_artifact_reuses_a_verified_cache(nats_server, tiny, tmp_path):
    nc = await connect(nats_server.url)
    try:
        js = nc.jetstream()
        m = build_manifest(tiny, piece_size=PIECE)
        await publish(js, [tiny], m)
        cache = tmp_path / "cache"
        path = await resolve_artifact(js, m.artifact_id, 1, 3, cache)
        assert verify(path, m).ranges == [(1, 3)]
        stamp = path.stat().st_mtime_ns
        assert await resolve_artifact(js, m.artifact_id, 1, 3, cache) == path
        assert path.stat().st_mtime_ns == stamp  # reused, not fetched again
        # A damaged cached slice no longer proves itself: it is fetched again.
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
        assert await resolve_artifact(js, m.artifact_id, 1, 3, cache) == path
        assert verify(path, m).ranges == [(1, 3)]
        with pytest.raises(ArtifactError, match="not in the store"):
            await resolve_artifact(js, "f" * 32, 0, 1, cache)
    finally:
        await nc.close()


async def test_split_model_through_the_store(nats_server, tiny, tmp_path):
    files = write_split(tiny, tmp_path / "split", max_tensors=10)
    nc = await connect(nats_server.url)
    try:
        js = nc.jetstream()
        res = await publish(js, files)  # builds the manifest itself
        m = await fetch_manifest(js, res.artifact_id)
        assert len(m.file_hashes) == len(files)
        r = await fetch(js, m.artifact_id, 2, 4, tmp_path / "out")
        assert r.bytes_downloaded == plan(m, 2, 4).nbytes < sum(f.size for f in m.file_hashes)
        assert verify(tmp_path / "out", m).ranges == [(2, 4)]
        assert load_in_llama_cpp(r.path) == 64
    finally:
        await nc.close()


def test_cli_publish_fetch_and_bad_input(nats_server, tiny, tmp_path):
    def cli(*args):
        return subprocess.run(
            [CLI, "artifact", *map(str, args), "--nats", nats_server.url], capture_output=True, text=True, timeout=120
        )

    m = build_manifest(tiny, piece_size=PIECE)
    save_manifest(m, tmp_path / "m.json")
    # A manifest for a different file: refused before anything is put.
    (tmp_path / "other").mkdir()
    other = write_tiny_llama(tmp_path / "other" / tiny.name, TinyLlama(seed=3))
    assert_one_line_error(cli("publish", other, "--manifest", tmp_path / "m.json"), "different file")
    assert_one_line_error(
        cli("fetch", "--model", m.artifact_id, "--layers", "0-1", "-o", tmp_path / "o"), "not in the store"
    )

    res = cli("publish", tiny, "--piece-size", PIECE)
    assert res.returncode == 0, res.stderr
    assert m.artifact_id in res.stdout
    assert_one_line_error(
        cli("fetch", "--model", m.artifact_id, "--layers", "2-7", "-o", tmp_path / "o"), "outside the model"
    )
    assert not (tmp_path / "o").exists()
    res = cli("fetch", "--model", m.artifact_id, "--layers", "2-3", "-o", tmp_path / "o")
    assert res.returncode == 0, res.stderr
    assert f"{plan(m, 2, 4).nbytes} of {tiny.stat().st_size} bytes" in res.stdout
    res = subprocess.run(
        [CLI, "artifact", "verify", tmp_path / "o", "--manifest", tmp_path / "m.json"], capture_output=True, text=True
    )
    assert res.returncode == 0 and "proven layer ranges: 2-3" in res.stdout
