"""`neuron-bus worker`: load a layer range of a model and serve it on the bus."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import cast, get_args

import msgspec
import typer

from neuron_bus import messages as M
from neuron_bus import models
from neuron_bus.artifacts.gguf_model import ArtifactError, GGUFModel
from neuron_bus.artifacts.work import owned_layer_work
from neuron_bus.cli.app import NatsOption, app, fail
from neuron_bus.execution import DEFAULT_N_CTX, BackendError, open_range, open_tokenizer
from neuron_bus.subjects import PUBLIC_OWNER, check_token
from neuron_bus.topology import connect, ensure_topology, identity_of, owner_of
from neuron_bus.trust import fault as faults
from neuron_bus.worker.engine import slowed
from neuron_bus.worker.runner import STUCK_AFTER_S
from neuron_bus.worker.service import WorkerOptions, WorkerService
from neuron_bus.worker.source import Source, auto_source, fetch_range, fetch_slice, local_source, parse_size


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
    fit: M.NodeFit | None = None,
) -> M.CapabilityReport:
    cap = msgspec.structs.asdict(backend.capability)
    cap["prefill_tokens_per_second"], cap["decode_tokens_per_second"] = slowed(
        cap["prefill_tokens_per_second"], cap["decode_tokens_per_second"], slow_ms
    )
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
        placement="auto" if fit else "pinned",
        fit=fit,
        **cap,
    )


def load(backend: str, src: Source, threads: int, opts: dict):
    """The backend for ``src``, the tokenizer, and the work of each of its layers (artifacts/work.py)."""
    owned = src.gguf or GGUFModel(src.path)  # parsed once; a slice counts its own (renumbered) blocks
    be = open_range(backend, owned, src.start, src.end, threads=threads, **opts)
    tok = open_tokenizer(src.path)
    per_layer = [owned_layer_work(owned, i, i + 1, be.n_layers) for i in range(be.layer_start, be.layer_end)]
    return be, tok, per_layer


def trust_tiers(tier: str) -> M.TrustTier:
    if tier not in get_args(M.TrustTier):
        raise ValueError(f"--trust-tier must be one of {', '.join(get_args(M.TrustTier))}, not {tier!r}")
    return cast(M.TrustTier, tier)


@dataclass
class Node:
    """Who this worker is and how it loads a range (for its first range and for every move)."""

    node_id: str
    backend: str
    threads: int
    opts: dict
    tier: M.TrustTier
    slow_ms: float
    fit: M.NodeFit | None = None  # --layers auto: what it can hold

    def load(self, src: Source):
        """(backend, tokenizer, capability report, owned layer work) for ``src``."""
        be, tok, per_layer = load(self.backend, src, self.threads, self.opts)
        report = build_report(
            self.node_id, be, src.preset, src.revision, src.artifact_id, self.tier, self.slow_ms, src.kinds, per_layer,
            self.fit,
        )  # fmt: skip
        return be, tok, report, sum(per_layer)

    def reloader(self, js):
        """What a move loads: the new range's slice from the shard swarm, then the backend (off the loop)."""

        async def reload(move: M.MoveRange):
            src = await fetch_range(js, move.artifact_id, move.layer_start, move.layer_end)
            return await asyncio.to_thread(self.load, src)

        return reload


def first_source(nats: str, model: str | None, artifact: str | None, layers: str | None, node: Node) -> Source:
    if node.fit is not None:
        return asyncio.run(auto_source(nats, model or "any", node.fit, node.node_id, node.backend, node.tier))
    if artifact:
        return asyncio.run(fetch_slice(nats, artifact, layers or ""))
    return local_source(model or "", layers or "")


def kv_budget_opts(text: str | None) -> dict:
    """``--kv-budget``: positions (``36864``) or bytes with a suffix (``400M``, ``2G``), as backend options."""
    if text is None:
        return {}
    if text.strip().isdigit():
        positions = int(text)
        if positions <= 0:
            raise ValueError("--kv-budget must hold at least one position")
        return {"kv_budget": positions}
    return {"kv_budget_bytes": parse_size(text)}


def node_fit(layers: str | None, max_layers: int | None, max_memory: str | None, positions: int) -> M.NodeFit | None:
    """``--layers auto`` (or no --layers): what this node can hold; None for a pinned range."""
    if layers not in (None, "auto"):
        if max_layers or max_memory:
            raise ValueError("--max-layers and --max-memory go with --layers auto")
        return None
    return M.NodeFit(max_layers=max_layers or 1 << 20, memory_budget=parse_size(max_memory) if max_memory else 0,
                     kv_positions=positions)  # fmt: skip


async def serve(url: str, node: Node, loaded, options: WorkerOptions, metrics_port: int | None) -> None:
    backend, tokenizer, report, _ = loaded
    nc = await connect(url, name=f"neuron-worker-{report.node_id}")
    identity = identity_of(nc)
    if identity is not None and identity.name != report.node_id:
        await nc.close()
        raise ValueError(f"this credential is node {identity.name}'s, not {report.node_id}'s (--node-id)")
    if options.require_keys is None:  # auto: a node on an authenticated bus requires session keys
        options.require_keys = identity is not None or owner_of(nc) != PUBLIC_OWNER
    if identity is None:  # a per-node credential may not create streams: `neuron-bus server` provisions
        await ensure_topology(nc.jetstream())
    reload = node.reloader(nc.jetstream()) if node.fit is not None else None  # only a self-placed node moves
    service = WorkerService(nc, backend, tokenizer, report, options, reload)
    if metrics_port:
        service.metrics.serve(metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    told: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _stop_then_exit, sig, told, stop, report.node_id)
    await service.start()
    print(
        f"worker {report.node_id} ready: layers {report.layer_start}-{report.layer_end - 1} of "
        f"{report.n_layers_total} ({report.backend_id}, {report.cache_abi}) on {url}",
        flush=True,
    )
    await stop.wait()
    ended = await service.stop()
    if ended:
        service.engine.backend.close()  # the one it serves now (a move closed the ones before)
    await nc.close()
    if not ended:  # the interpreter's exit would wait for the backend thread, for good
        _exit_now(f"worker {report.node_id} stopped; its backend is {service.runner.in_call()} and is left "
                  "to the process's exit", 1)  # fmt: skip


def _stop_then_exit(sig: signal.Signals, told: list[signal.Signals], stop: asyncio.Event, node_id: str) -> None:
    """SIGINT/SIGTERM: the first stops the worker cleanly; the same signal again, while it stops,
    exits at once. Only the same one: Ctrl-C under `neuron-bus up` sends the worker SIGINT from the
    terminal and SIGTERM from `up`, which is one request to stop."""
    if sig in told:
        _exit_now(f"worker {node_id}: {sig.name} again while stopping; exiting without finishing the stop", 1)
    told.append(sig)
    stop.set()


def _exit_now(message: str, code: int) -> None:
    print(message, file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(code)


@app.command()
def worker(
    model: str = typer.Option(
        None, help="GGUF path or preset (smollm2-135m, gemma3-270m); with --layers auto also any."
    ),
    artifact: str = typer.Option(None, help="Start from the shard swarm: fetch this artifact id's range."),
    layers: str = typer.Option(
        None, help="Layer range to serve, inclusive (0-14); auto or left out: the tracker chooses and may move it."
    ),
    max_layers: int = typer.Option(None, min=1, help="--layers auto: serve at most this many layers."),
    max_memory: str = typer.Option(None, help="--layers auto: memory for weights and KV slots (650M, 2G)."),
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
        None,
        hidden=True,
        help="Fault injection: perturb (noisy outputs), inflate-ledger (claims twice its work), hang (calls "
        "never return).",
    ),
    stuck_after: float = typer.Option(
        STUCK_AFTER_S,
        min=0.1,
        help="A backend call running this long, and 20 times what its positions take at the measured speed, "
        "marks the node stuck: no new routes, and its sessions' clients move them elsewhere.",
    ),
    dtype: str = typer.Option("float32", help="torch backend compute dtype: float32 | bfloat16."),
    n_ctx: int = typer.Option(DEFAULT_N_CTX, help="llama-cpp: positions per session (prompt + generated)."),
    max_sessions: int = typer.Option(
        8, help="llama-cpp: the default KV budget holds this many sessions of --n-ctx positions."
    ),
    kv_budget: str = typer.Option(
        None,
        help="llama-cpp: KV pool in positions (36864) or bytes (400M); sessions are admitted by the positions "
        "they need (default: --max-sessions x --n-ctx).",
    ),
    flash_attn: bool = typer.Option(True, help="llama-cpp: flash attention (part of the cache ABI: all hops agree)."),
    snapshot_every: int = typer.Option(
        0, help="Write a KV snapshot of every decoding session each N positions (0: off)."
    ),
    snapshot_nats: str = typer.Option(
        None, help="Cache server holding the neuron-snapshots bucket (default: the bus)."
    ),
    session_keys: str = typer.Option("auto", help="Sessions without link keys: required | optional | auto."),
    prefix_cache: str = typer.Option(
        "512M", help="Memory for finished sessions' prompt-prefix KV, reused by sessions sharing it (0: off)."
    ),
    draft_policy: str = typer.Option(
        "adaptive", help="Speculative sessions at the tail: adaptive (the drafts that pay) | all (every draft found)."
    ),
) -> None:
    """Load a layer range of a GGUF model (given, or chosen by the tracker) and serve every route assigned to it."""
    if (model is None) == (artifact is None):
        fail("give exactly one of --model or --artifact")
    node_id = node_id or f"{socket.gethostname().split('.')[0]}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    try:  # the cheap checks first: loading the model takes seconds
        budget = kv_budget_opts(kv_budget)
        opts = (
            {"dtype": dtype}
            if backend == "torch"
            else {"n_ctx": n_ctx, "max_sessions": max_sessions, "flash_attn": flash_attn, **budget}
        )
        fault = faults.check(fault)
        prefix_bytes = parse_size(prefix_cache)
        check_token(node_id, "node id")
        # a budget in bytes is counted in positions once the range is known; the fit counts the default
        fit = node_fit(layers, max_layers, max_memory, budget.get("kv_budget", n_ctx * max_sessions))
        node = Node(node_id, backend, threads, opts, trust_tiers(trust_tier), slow_ms, fit)
        if snapshot_every < 0 or session_keys not in ("required", "optional", "auto"):
            raise ValueError("--snapshot-every must be 0 (off) or positive; --session-keys required, optional or auto")
        if draft_policy not in ("adaptive", "all"):
            raise ValueError(f"--draft-policy must be adaptive or all, got {draft_policy!r}")
        if fit is not None and artifact:
            raise ValueError("--layers auto takes --model (a preset, or any), not --artifact")
        loaded = node.load(first_source(nats, model, artifact, layers, node))
    except (ArtifactError, models.UnknownModel, ValueError, BackendError) as exc:
        fail(str(exc))
    options = WorkerOptions(
        idle_timeout=idle_timeout, stuck_after=stuck_after, max_decode_batch=max_decode_batch, slow_ms=slow_ms,
        snapshot_every=snapshot_every, snapshot_url=snapshot_nats, owned_layer_work=loaded[3], fault=fault,
        require_keys={"required": True, "optional": False}.get(session_keys),
        adaptive_drafts=draft_policy == "adaptive", prefix_cache_bytes=prefix_bytes,
    )  # fmt: skip
    try:
        asyncio.run(serve(nats, node, loaded, options, metrics_port))
    except ValueError as exc:  # a credential of another node
        loaded[0].close()
        fail(str(exc))
