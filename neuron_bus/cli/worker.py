"""`neuron-bus worker`: load a layer range of a model and serve it on the bus."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import cast, get_args

import msgspec
import typer

from neuron_bus import messages as M
from neuron_bus import models
from neuron_bus.artifacts.cuts import check_cut, layer_kinds
from neuron_bus.artifacts.gguf_model import META_PREFIX, ArtifactError, GGUFModel, parse_layers
from neuron_bus.artifacts.work import owned_layer_work
from neuron_bus.cli.app import NatsOption, app, fail
from neuron_bus.execution import DEFAULT_N_CTX, BackendError, open_range, open_tokenizer
from neuron_bus.subjects import check_token
from neuron_bus.topology import connect, ensure_topology
from neuron_bus.trust import fault as faults
from neuron_bus.worker.service import WorkerOptions


def slowed(tokens_per_second: float, positions_per_call: int, slow_ms: float) -> float:
    """Throughput once every backend call takes ``slow_ms`` longer (injected slowness)."""
    if not slow_ms or tokens_per_second <= 0:
        return tokens_per_second
    return positions_per_call / (positions_per_call / tokens_per_second + slow_ms / 1000.0)


def build_report(
    node_id: str,
    backend,
    preset: str,
    revision: str,
    artifact_id: str,
    trust_tier: M.TrustTier,
    slow_ms: float = 0.0,
    layer_kinds: list[str] | None = None,
    active_parameters: list[float] | None = None,
) -> M.CapabilityReport:
    cap = msgspec.structs.asdict(backend.capability)
    cap["prefill_tokens_per_second"] = slowed(cap["prefill_tokens_per_second"], 256, slow_ms)
    cap["decode_tokens_per_second"] = slowed(cap["decode_tokens_per_second"], 1, slow_ms)
    return M.CapabilityReport(
        node_id=node_id,
        model_preset=preset,
        model_revision=revision,
        artifact_id=artifact_id,
        backend_id=backend.backend_id,
        layer_start=backend.layer_start,
        layer_end=backend.layer_end,
        n_layers_total=backend.n_layers,
        hidden_size=backend.hidden_size,
        trust_tier=trust_tier,
        started_at=time.time(),
        layer_kinds=list(layer_kinds or []),
        active_parameters_per_layer=[round(w, 6) for w in active_parameters or []],
        **cap,
    )


def load(backend: str, src: Source, threads: int, opts: dict):
    """The backend for ``src``, the tokenizer, and the work of each of its layers (artifacts/work.py)."""
    be = open_range(backend, src.path, src.start, src.end, threads=threads, **opts)
    tok = open_tokenizer(src.path)
    owned = src.gguf or GGUFModel(src.path)  # a slice counts its own (renumbered) blocks
    per_layer = [owned_layer_work(owned, i, i + 1, be.n_layers) for i in range(be.layer_start, be.layer_end)]
    return be, tok, per_layer


def trust_tiers(tier: str) -> M.TrustTier:
    if tier not in get_args(M.TrustTier):
        raise ValueError(f"--trust-tier must be one of {', '.join(get_args(M.TrustTier))}, not {tier!r}")
    return cast(M.TrustTier, tier)


@dataclass
class Source:
    """What a worker serves: the file to load, its range, and what the bus calls it."""

    path: Path
    start: int
    end: int
    preset: str
    revision: str
    artifact_id: str
    kinds: list[str]  # the whole model's layer kinds ([] unknown)
    gguf: GGUFModel | None = None  # the whole model, when it is on this machine


def local_source(model: str, layers: str) -> Source:
    """A model on this machine (a preset or a path), and the range of it to serve."""
    path = models.resolve(model)
    gguf = GGUFModel(path)
    start, end = parse_layers(layers, gguf.n_layers)
    kinds = [] if gguf.field(META_PREFIX + "layer_start") is not None else layer_kinds(gguf)  # a slice: unknown
    check_cut(kinds, start, end)
    return Source(path, start, end, models.preset_for(path), models.revision(path), "", kinds, gguf)


async def fetch_slice(url: str, artifact_id: str, layers: str) -> Source:
    """The verified slice of ``layers`` of an artifact, from the local cache or the shard swarm."""
    from neuron_bus.artifacts.manifest import n_layers
    from neuron_bus.artifacts.swarm import fetch_manifest, resolve_artifact

    nc = await connect(url, name="neuron-worker-fetch", max_reconnect_attempts=3)
    try:
        js = nc.jetstream()
        manifest = await fetch_manifest(js, artifact_id)
        start, end = parse_layers(layers, n_layers(manifest))
        kinds = manifest.cache_descriptor.layer_kinds
        check_cut(kinds, start, end)  # before fetching a slice llama.cpp could not load
        path = await resolve_artifact(js, artifact_id, start, end, models.cache_dir() / "artifacts")
    finally:
        await nc.close()
    return Source(path, start, end, manifest.model_preset, artifact_id, artifact_id, kinds)


async def serve(url: str, backend, tokenizer, report: M.CapabilityReport, options, metrics_port: int | None) -> None:
    from neuron_bus.worker.service import WorkerService

    nc = await connect(url, name=f"neuron-worker-{report.node_id}")
    await ensure_topology(nc.jetstream())
    service = WorkerService(nc, backend, tokenizer, report, options)
    if metrics_port:
        service.metrics.serve(metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    print(
        f"worker {report.node_id} ready: layers {report.layer_start}-{report.layer_end - 1} of "
        f"{report.n_layers_total} ({report.backend_id}, {report.cache_abi}) on {url}",
        flush=True,
    )
    await stop.wait()
    await service.stop()
    await nc.close()


@app.command()
def worker(
    model: str = typer.Option(None, help="GGUF path or preset (smollm2-135m, gemma3-270m)."),
    artifact: str = typer.Option(None, help="Start from the shard swarm: fetch this artifact id's range."),
    layers: str = typer.Option(..., help="Layer range to serve, inclusive: 0-14."),
    backend: str = typer.Option("llama-cpp", help="llama-cpp | torch"),
    nats: str = NatsOption,
    threads: int = typer.Option(int(os.environ.get("NEURON_THREADS", "0")) or 1, help="Compute threads."),
    metrics_port: int = typer.Option(None, help="Serve Prometheus metrics on this port."),
    node_id: str = typer.Option(None, help="Unique node id (default: host-pid-random)."),
    trust_tier: str = typer.Option("untrusted", help="untrusted | trusted | paid-trusted (operator-assigned)."),
    idle_timeout: float = typer.Option(300.0, help="Free sessions idle this long (seconds)."),
    max_decode_batch: int = typer.Option(8, help="Decode steps of different sessions run together."),
    slow_ms: float = typer.Option(0.0, hidden=True, help="Fault injection: delay every backend call."),
    fault: str | None = typer.Option(
        None, hidden=True, help="Fault injection: perturb (noisy outputs), inflate-ledger (claims twice its work)."
    ),
    dtype: str = typer.Option("float32", help="torch backend compute dtype: float32 | bfloat16."),
    n_ctx: int = typer.Option(DEFAULT_N_CTX, help="llama-cpp: positions per session (prompt + generated)."),
    max_sessions: int = typer.Option(8, help="llama-cpp: concurrent sessions (KV slots) per worker."),
    flash_attn: bool = typer.Option(
        True, help="llama-cpp: flash attention (part of the cache ABI: every hop of a route must agree)."
    ),
    snapshot_every: int = typer.Option(
        0, help="Write a KV snapshot of every decoding session each N positions (0: off)."
    ),
    snapshot_nats: str = typer.Option(
        None, help="Cache server holding the neuron-snapshots bucket (default: the bus)."
    ),
) -> None:
    """Load a layer range of a GGUF model and serve every route assigned to it."""
    if (model is None) == (artifact is None):
        fail("give exactly one of --model or --artifact")
    node_id = node_id or f"{socket.gethostname().split('.')[0]}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    try:  # the cheap checks first: loading the model takes seconds
        fault = faults.check(fault)
        check_token(node_id, "node id")
        tier = trust_tiers(trust_tier)
    except ValueError as exc:
        fail(str(exc))
    if snapshot_every < 0:
        fail("--snapshot-every must be 0 (off) or positive")
    opts = (
        {"dtype": dtype}
        if backend == "torch"
        else {"n_ctx": n_ctx, "max_sessions": max_sessions, "flash_attn": flash_attn}
    )
    try:
        src = asyncio.run(fetch_slice(nats, artifact, layers)) if artifact else local_source(model, layers)
        be, tok, per_layer = load(backend, src, threads, opts)
    except (ArtifactError, models.UnknownModel, ValueError, BackendError) as exc:
        fail(str(exc))
    report = build_report(node_id, be, src.preset, src.revision, src.artifact_id, tier, slow_ms, src.kinds, per_layer)
    options = WorkerOptions(
        idle_timeout=idle_timeout, max_decode_batch=max_decode_batch, slow_ms=slow_ms, snapshot_every=snapshot_every,
        snapshot_url=snapshot_nats, owned_layer_work=sum(per_layer), fault=fault,
    )  # fmt: skip
    try:
        asyncio.run(serve(nats, be, tok, report, options, metrics_port))
    finally:
        be.close()
