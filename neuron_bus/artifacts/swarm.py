"""The shard swarm over a JetStream Object Store bucket (``neuron-artifacts``).

Objects: ``<artifact_id>/manifest.json`` and ``<artifact_id>/piece/<index>``. `publish` puts every
piece, then the manifest last (a manifest in the store means its pieces are there). `fetch`
downloads only the pieces a layer range's plan lists, checks each against the manifest's sha256,
writes them at their offsets into sparse copies of the original files (holes elsewhere) and cuts
the slice from those; everything happens in a hidden temp directory that is renamed into place
or removed, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, DigestMismatchError, NotFoundError
from nats.js.object_store import ObjectStore

from neuron_bus import subjects as S
from neuron_bus.artifacts.gguf_model import ArtifactError, GGUFModel
from neuron_bus.artifacts.manifest import (
    Progress,
    build_manifest,
    decode_manifest,
    encode_manifest,
    load_manifest,
    save_manifest,
)
from neuron_bus.artifacts.plan import Plan, plan
from neuron_bus.artifacts.slicing import slice_gguf
from neuron_bus.artifacts.verify import verify
from neuron_bus.messages import ArtifactManifest, PieceHash
from neuron_bus.topology import object_store
from workers.errors import Reason
from workers.files import atomic_output


def manifest_object(artifact_id: str) -> str:
    return f"{S.check_token(artifact_id, 'artifact id')}/manifest.json"


def piece_object(artifact_id: str, index: int) -> str:
    return f"{S.check_token(artifact_id, 'artifact id')}/piece/{int(index)}"


def slice_name(manifest: ArtifactManifest, start: int, end: int) -> str:
    return f"{manifest.model_preset}-{manifest.artifact_id[:12]}-layers-{start}-{end - 1}.gguf"


async def artifact_store(js: JetStreamContext, create: bool = True) -> ObjectStore:
    """The artifacts bucket, created with the project's topology config when missing."""
    try:
        return await object_store(js, S.OBJ_ARTIFACTS, create)
    except BucketNotFoundError:
        raise ArtifactError(Reason.NO_STORE, f"the object bucket {S.OBJ_ARTIFACTS} does not exist") from None


def _object_digest(sha256_hex: str) -> str:
    return "SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(sha256_hex)).decode()


def _read_piece(f, p: PieceHash) -> bytes:
    f.seek(p.offset)
    data = f.read(p.length)
    if len(data) != p.length or hashlib.sha256(data).hexdigest() != p.sha256:
        raise ArtifactError(
            Reason.WRONG_MANIFEST,
            f"{f.name}: piece {p.index} ({p.region}) does not match the manifest; "
            "the file changed or the manifest is for a different file",
        )
    return data


@dataclass(frozen=True)
class PublishResult:
    artifact_id: str
    pieces_put: int
    pieces_present: int  # already in the store with the same digest: not sent again
    bytes_put: int


def _files_for(paths: list[Path], manifest: ArtifactManifest) -> dict[str, Path]:
    """Map each manifest file to the given path with its name, checking size and full hash."""
    by_name = {Path(p).name: Path(p) for p in paths}
    files = {}
    for fh in manifest.file_hashes:
        path = by_name.get(fh.name)
        if path is None:
            raise ArtifactError(
                Reason.WRONG_MANIFEST, f"manifest {manifest.artifact_id} needs {fh.name}; it was not given"
            )
        if not path.is_file():
            raise ArtifactError(Reason.MISSING, f"{path}: no such file")
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for buf in iter(lambda: f.read(1 << 20), b""):
                h.update(buf)
        if path.stat().st_size != fh.size or h.hexdigest() != fh.sha256:
            raise ArtifactError(
                Reason.WRONG_MANIFEST,
                f"{path} does not match manifest {manifest.artifact_id} (a manifest for a different file?)",
            )
        files[fh.name] = path
    return files


async def publish(
    js: JetStreamContext,
    paths: list[Path],
    manifest: ArtifactManifest | None = None,
    progress: Progress | None = None,
) -> PublishResult:
    """Seed a model: every piece, then its manifest. Pieces already present are skipped."""
    paths = [Path(p) for p in paths]
    if manifest is None:
        manifest = await asyncio.to_thread(build_manifest, paths)
    files = await asyncio.to_thread(_files_for, paths, manifest)
    obs = await artifact_store(js)
    total = sum(p.length for p in manifest.piece_hashes)
    done = put = present = sent = 0
    handles = {name: open(path, "rb") for name, path in files.items()}
    try:
        for p in manifest.piece_hashes:
            name = piece_object(manifest.artifact_id, p.index)
            try:
                info = await obs.get_info(name)
            except NotFoundError:
                info = None
            if info is not None and info.size == p.length and info.digest == _object_digest(p.sha256):
                present += 1
            else:
                await obs.put(name, _read_piece(handles[p.file], p))
                put += 1
                sent += p.length
            done += p.length
            if progress:
                progress(done, total)
    finally:
        for f in handles.values():
            f.close()
    await obs.put(manifest_object(manifest.artifact_id), encode_manifest(manifest))
    return PublishResult(manifest.artifact_id, put, present, sent)


async def fetch_manifest(js: JetStreamContext, artifact_id: str) -> ArtifactManifest:
    try:
        obs = await artifact_store(js, create=False)
    except ArtifactError:
        raise ArtifactError(
            Reason.NOT_FOUND,
            f"artifact {artifact_id} is not in the store (no {S.OBJ_ARTIFACTS} bucket yet: publish it first)",
        ) from None
    try:
        name = manifest_object(artifact_id)
    except ValueError as exc:
        raise ArtifactError(Reason.BAD_ID, str(exc)) from None
    try:
        res = await obs.get(name)
    except NotFoundError:
        raise ArtifactError(
            Reason.NOT_FOUND, f"artifact {artifact_id} is not in the store (publish it first)"
        ) from None
    except DigestMismatchError:
        raise ArtifactError(
            Reason.HASH_MISMATCH, f"the manifest of artifact {artifact_id} is corrupt in the store"
        ) from None
    manifest = decode_manifest(res.data or b"", f"manifest of artifact {artifact_id}")
    if manifest.artifact_id != artifact_id:
        raise ArtifactError(Reason.BAD_MANIFEST, f"the store's manifest {name} names artifact {manifest.artifact_id}")
    return manifest


async def _get_piece(obs: ObjectStore, manifest: ArtifactManifest, p: PieceHash) -> bytes:
    what = f"piece {p.index} of artifact {manifest.artifact_id} ({p.file} bytes {p.offset}-{p.offset + p.length}, {p.region})"
    try:
        data = (await obs.get(piece_object(manifest.artifact_id, p.index))).data or b""
    except NotFoundError:
        raise ArtifactError(Reason.MISSING_PIECE, f"{what} is missing from the store") from None
    except DigestMismatchError:
        raise ArtifactError(Reason.HASH_MISMATCH, f"{what} is corrupt in the store") from None
    got = hashlib.sha256(data).hexdigest()
    if len(data) != p.length or got != p.sha256:
        raise ArtifactError(
            Reason.HASH_MISMATCH,
            f"{what} failed its hash check: expected sha256 {p.sha256[:16]}..., got {got[:16]}... ({len(data)} bytes)",
        )
    return data


@dataclass(frozen=True)
class FetchResult:
    path: Path
    bytes_downloaded: int
    pieces: int
    plan: Plan
    manifest: ArtifactManifest


def _cut_slice(sparse: list[Path], manifest: ArtifactManifest, start: int, end: int, out: Path) -> None:
    """Slice the sparse reassembly, then prove the slice by hash before it may be kept."""
    slice_gguf(GGUFModel(sparse), start, end, out, manifest.artifact_id)
    report = verify(out, manifest)
    if report.ranges != [(start, end)]:
        raise ArtifactError(Reason.BAD_SLICE, f"the assembled slice does not verify: {report.problem or report.ranges}")


async def fetch(
    js: JetStreamContext,
    artifact_id: str,
    start: int,
    end: int,
    out_dir: Path,
    progress: Progress | None = None,
    manifest: ArtifactManifest | None = None,
) -> FetchResult:
    """Download only the pieces layers [start, end) need, verify them, and write their slice into out_dir."""
    if manifest is None:
        manifest = await fetch_manifest(js, artifact_id)
    pl = plan(manifest, start, end)
    obs = await artifact_store(js, create=False)
    out_dir = Path(out_dir)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=out_dir))  # same filesystem: rename is atomic
    ok = False
    try:
        sparse = [tmp / fh.name for fh in manifest.file_hashes]
        handles = {}
        for fh, path in zip(manifest.file_hashes, sparse):
            handles[fh.name] = f = open(path, "wb")
            f.truncate(fh.size)  # holes where no piece is written
        downloaded = 0
        try:
            for i in pl.pieces:
                p = manifest.piece_hashes[i]
                data = await _get_piece(obs, manifest, p)
                os.pwrite(handles[p.file].fileno(), data, p.offset)
                downloaded += len(data)
                if progress:
                    progress(downloaded, pl.nbytes)
        finally:
            for f in handles.values():
                f.close()
        name = slice_name(manifest, start, end)
        with atomic_output(out_dir / name) as part:
            await asyncio.to_thread(_cut_slice, sparse, manifest, start, end, part)
        ok = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if created and not ok and not any(out_dir.iterdir()):
            out_dir.rmdir()
    return FetchResult(out_dir / name, downloaded, len(pl.pieces), pl, manifest)


async def resolve_artifact(
    js: JetStreamContext,
    artifact_id: str,
    start: int,
    end: int,
    cache_dir: Path,
    progress: Progress | None = None,
) -> Path:
    """A verified slice of layers [start, end) for a worker: from cache_dir if it proves itself, else fetched."""
    home = Path(cache_dir) / S.check_token(artifact_id, "artifact id")
    manifest_path = home / "manifest.json"
    manifest = None
    if manifest_path.is_file():
        try:
            manifest = load_manifest(manifest_path)
        except ArtifactError:
            manifest = None
        if manifest is not None and manifest.artifact_id != artifact_id:
            manifest = None
    if manifest is None:
        manifest = await fetch_manifest(js, artifact_id)
        save_manifest(manifest, manifest_path)
    cached = home / slice_name(manifest, start, end)
    if cached.is_file():
        report = await asyncio.to_thread(verify, cached, manifest)
        if report.ranges == [(start, end)]:
            return cached
    result = await fetch(js, artifact_id, start, end, home, progress=progress, manifest=manifest)
    return result.path
