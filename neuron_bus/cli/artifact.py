"""`neuron-bus artifact ...`: manifests, plans, proofs, slices, and the shard swarm."""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

from neuron_bus import models
from neuron_bus.artifacts.gguf_model import ArtifactError, GGUFModel, format_layers, parse_layers
from neuron_bus.cli.app import NatsOption, fail
from neuron_bus.errors import NeuronBusError
from workers.errors import Reason

artifact_app = typer.Typer(
    no_args_is_help=True,
    help="GGUF artifacts: manifests, layer-range plans and slices, proofs by hash, the shard swarm.",
)

LayersOption = typer.Option(..., "--layers", help="Layer range, inclusive: FIRST-LAST, e.g. 16-29.")
JsonOption = typer.Option(False, "--json", help="Print JSON instead of text.")


@contextmanager
def _errors():
    """Every failure becomes one line on stderr and a non-zero exit."""
    try:
        yield
    except (NeuronBusError, LookupError) as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": "))
    except ValueError as exc:
        fail(str(exc))


@contextmanager
def _progress(description: str):
    """A rich progress bar on stderr; yields the (done, total) callback the library functions take."""
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        transient=True,
        console=Console(stderr=True),
    ) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


async def _with_js(url: str, fn):
    from neuron_bus.topology import connect

    async def quiet(_exc: Exception) -> None:  # a failed connect is reported once, by _run_nats
        pass

    nc = await connect(url, name="neuron-bus-artifact", max_reconnect_attempts=2, error_cb=quiet)
    try:
        return await fn(nc.jetstream())
    finally:
        await nc.close()


def _run_nats(url: str, fn):
    try:
        return asyncio.run(_with_js(url, fn))
    except (NeuronBusError, OSError, ValueError):
        raise
    except Exception as exc:  # nats errors: no server, timeouts...
        raise ArtifactError(Reason.NATS, f"NATS at {url}: {type(exc).__name__} {exc}".rstrip()) from None


@artifact_app.command()
def manifest(
    files: list[Path] = typer.Argument(..., help="The model: one GGUF, or every file of a gguf-split set."),
    out: Path = typer.Option(..., "-o", "--out", help="Where to write the manifest (JSON)."),
    piece_size: int = typer.Option(1 << 20, help="Piece size in bytes."),
    preset: str = typer.Option(None, help="Model preset name (default: from the file name)."),
    upstream_repo: str = typer.Option(None, help="Upstream repository (default: the preset's)."),
    revision: str = typer.Option("", help="Upstream revision."),
    license: str = typer.Option(None, help="License (default: the preset's, else the GGUF's)."),
    context_cap: int = typer.Option(None, help="Context cap (default: the model's context length)."),
) -> None:
    """Hash a model into pieces and map its tensors onto layers; write the manifest."""
    from neuron_bus.artifacts.manifest import build_manifest, save_manifest

    with _errors():
        with _progress("hashing") as update:
            m = build_manifest(
                files,
                piece_size=piece_size,
                model_preset=preset,
                upstream_repo=upstream_repo,
                revision=revision,
                license=license,
                context_cap=context_cap,
                progress=update,
            )
        save_manifest(m, out)
    size = sum(f.size for f in m.file_hashes)
    typer.echo(
        f"{m.artifact_id}: {m.cache_descriptor.n_layers} layers, {len(m.file_hashes)} file(s), "
        f"{len(m.piece_hashes)} pieces, {size} bytes -> {out}"
    )


@artifact_app.command()
def plan(
    manifest_path: Path = typer.Argument(..., metavar="MANIFEST", help="Manifest JSON."),
    layers: str = LayersOption,
    as_json: bool = JsonOption,
) -> None:
    """The exact pieces (and bytes) a node needs to serve a layer range."""
    from neuron_bus.artifacts.manifest import load_manifest, n_layers
    from neuron_bus.artifacts.plan import plan as make_plan

    with _errors():
        m = load_manifest(manifest_path)
        pl = make_plan(m, *parse_layers(layers, n_layers(m)))
    if as_json:
        typer.echo(json.dumps(pl.to_dict()))
        return
    total = sum(f.size for f in m.file_hashes)
    typer.echo(
        f"artifact {m.artifact_id} layers {pl.layers}: {len(pl.pieces)} pieces, {pl.nbytes} bytes "
        f"({100 * pl.nbytes / total:.1f}% of {total})"
    )
    typer.echo(f"  header pieces: {_spans(pl.header_pieces)}")
    typer.echo(f"  block pieces:  {_spans(pl.block_pieces)}")
    for name, pieces in pl.shared_pieces.items():
        typer.echo(f"  {name}: {_spans(pieces)}")
    for name in pl.placeholders:
        typer.echo(f"  {name}: placeholder (zeros, nothing to fetch)")


def _spans(indices: list[int]) -> str:
    """[1,2,3,7] -> '1-3,7'."""
    out: list[str] = []
    run: list[int] = []
    for i in indices:
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "-"


@artifact_app.command("verify")
def verify_cmd(
    path: Path = typer.Argument(..., help="A GGUF file or a directory of them (originals, slices)."),
    manifest_path: Path = typer.Option(..., "--manifest", help="Manifest JSON."),
    as_json: bool = JsonOption,
) -> None:
    """Which layer ranges PATH can prove, by hash, that it serves. Exit 1 if none."""
    from neuron_bus.artifacts.manifest import load_manifest
    from neuron_bus.artifacts.verify import verify

    with _errors():
        report = verify(path, load_manifest(manifest_path))
    if as_json:
        typer.echo(json.dumps(report.to_dict()))
    else:
        for s in report.sources:
            status = "ok" if s.ok else "FAIL"
            extra = f" layers {s.layers}" if s.layers else ""
            typer.echo(f"  {status:4} {s.kind}{extra}: {s.path}")
        ranges = ", ".join(format_layers(a, b) for a, b in report.ranges) or "none"
        typer.echo(f"artifact {report.artifact_id}: proven layer ranges: {ranges}")
    if not report.ranges:
        fail(report.problem or f"{path} proves no layer range of artifact {report.artifact_id}")
    if report.problem:
        typer.echo(f"warning: {report.problem}", err=True)


@artifact_app.command("slice")
def slice_cmd(
    files: list[Path] = typer.Argument(..., help="The model: one GGUF, or every file of a gguf-split set."),
    layers: str = LayersOption,
    out: Path = typer.Option(..., "-o", "--out", help="The slice to write (atomically)."),
    manifest_path: Path = typer.Option(None, "--manifest", help="Record this manifest's artifact id (checked)."),
) -> None:
    """Write a loadable GGUF holding only a layer range."""
    from neuron_bus.artifacts.manifest import build_manifest, load_manifest
    from neuron_bus.artifacts.slicing import slice_gguf

    with _errors():
        model = GGUFModel(files)
        start, end = parse_layers(layers, model.n_layers)
        artifact_id = ""
        if manifest_path is not None:
            m = load_manifest(manifest_path)
            mine = build_manifest(model, piece_size=m.piece_size)
            if mine.artifact_id != m.artifact_id:
                raise ArtifactError(
                    Reason.WRONG_MANIFEST,
                    f"{files[0]} is not artifact {m.artifact_id} (a manifest for a different file?)",
                )
            artifact_id = m.artifact_id
        path = slice_gguf(model, start, end, out, artifact_id)
    typer.echo(f"layers {format_layers(start, end)} of {model.n_layers} -> {path} ({path.stat().st_size} bytes)")


@artifact_app.command()
def publish(
    files: list[str] = typer.Argument(
        ..., help="The model: one GGUF or a preset (smollm2-135m), or every file of a gguf-split set."
    ),
    manifest_path: Path = typer.Option(
        None, "--manifest", help="Publish with this manifest (files are checked against it)."
    ),
    piece_size: int = typer.Option(1 << 20, help="Piece size when building the manifest."),
    nats_url: str = NatsOption,
    node_id: str = typer.Option(
        None, "--node-id", help="Record the bytes seeded in the ledger (kind seeding) for this node."
    ),
) -> None:
    """Seed a model into the JetStream Object Store: every piece, then the manifest."""
    from neuron_bus.artifacts.manifest import build_manifest, load_manifest
    from neuron_bus.artifacts.swarm import publish as do_publish

    with _errors():
        paths = [models.resolve(f) for f in files]
        if manifest_path is not None:
            m = load_manifest(manifest_path)
        else:
            with _progress("hashing") as update:
                m = build_manifest(paths, piece_size=piece_size, progress=update)
        with _progress("publishing") as update:
            res = _run_nats(nats_url, lambda js: do_publish(js, paths, m, progress=update))
        if node_id:
            _run_nats(nats_url, lambda js: _record_seeding(js, node_id, res))
    typer.echo(
        f"published {res.artifact_id}: {res.pieces_put} pieces sent ({res.bytes_put} bytes), "
        f"{res.pieces_present} already present"
    )


async def _record_seeding(js, node_id: str, res) -> None:
    """A seeding ledger entry: bytes put into the shard swarm (never counted as inference)."""
    import time
    import uuid

    from neuron_bus import messages as M
    from neuron_bus import subjects as S
    from neuron_bus.flow import publish as js_publish

    entry = M.LedgerEntry(
        entry_id=uuid.uuid4().hex,
        node_id=S.check_token(node_id, "node id"),
        kind="seeding",
        ts=time.time(),
        bytes_served=res.bytes_put,
        reward_weight=0.0,
    )
    await js_publish(js, S.ledger(node_id), M.encode(entry))


@artifact_app.command()
def fetch(
    model: str = typer.Option(..., "--model", help="Artifact id (as printed by publish)."),
    layers: str = LayersOption,
    out: Path = typer.Option(..., "-o", "--out", help="Directory for the slice."),
    nats_url: str = NatsOption,
) -> None:
    """Download only the pieces a layer range needs, verify each, and assemble its slice."""
    from neuron_bus.artifacts.manifest import n_layers
    from neuron_bus.artifacts.swarm import fetch as do_fetch
    from neuron_bus.artifacts.swarm import fetch_manifest

    async def run(js):
        m = await fetch_manifest(js, model)
        start, end = parse_layers(layers, n_layers(m))
        with _progress(f"fetching layers {layers}") as update:
            return await do_fetch(js, model, start, end, out, progress=update, manifest=m)

    with _errors():
        res = _run_nats(nats_url, run)
    total = sum(f.size for f in res.manifest.file_hashes)
    typer.echo(
        f"layers {res.plan.layers}: {res.pieces} pieces, {res.bytes_downloaded} of {total} bytes downloaded "
        f"-> {res.path}"
    )
