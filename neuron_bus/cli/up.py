"""`neuron-bus up`: a local swarm on the embedded default, until interrupted."""

from __future__ import annotations

import asyncio
import signal
import tempfile
import threading
from pathlib import Path

import typer
from rich.console import Console

from neuron_bus import messages as M
from neuron_bus import models
from neuron_bus.cli.app import app, fail
from neuron_bus.cli.generate import run_generation
from neuron_bus.errors import NeuronBusError
from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.supervisor import Supervisor

CHECK_EVERY_S = 0.5


@app.command()
def up(
    model: str = typer.Option(models.DEFAULT_PRESET, help="GGUF path or preset."),
    shards: int = typer.Option(
        2, min=1, help="Workers; the layers are split so each does about the same work per token."
    ),
    backend: str = typer.Option("llama-cpp", help="llama-cpp | torch"),
    threads: int = typer.Option(1, min=1, help="Threads per worker."),
    nats_port: int = typer.Option(4222, help="Client port of the embedded nats-server."),
    http_port: int = typer.Option(8222, help="Monitoring port of the embedded nats-server."),
    port: int = typer.Option(
        8080, min=0, max=65535, help="HTTP port of the gateway (web page, OpenAI API); 0: no gateway."
    ),
    workdir: Path = typer.Option(None, help="Store and logs (default: a temporary directory)."),
    prompt: str = typer.Option(None, help="Once up, stream one generation of this prompt."),
    max_tokens: int = typer.Option(48, help="Tokens for --prompt."),
    api_keys: Path = typer.Option(
        None, "--api-keys", help="The gateway's API keys file (`neuron-bus api-key add`): /v1 and /ws need a key."
    ),
    link_delay_ms: float = typer.Option(
        0.0,
        min=0.0,
        help="A WAN on this machine: every worker, the tracker and the gateway reach the nats-server over an "
        "emulated link of this one-way delay (neuron_bus/wan/linkem.py).",
    ),
) -> None:
    """Start nats-server, a tracker, N workers and the gateway on this machine; stop them all on Ctrl-C."""
    console = Console(stderr=True)
    try:
        swarm = make_swarm(
            model, shards, backend, threads, nats_port, http_port, port, workdir, api_keys, link_delay_ms
        )
    except (NeuronBusError, ValueError) as exc:  # an unknown or bad model file, or no loadable split into --shards
        fail(str(exc))
    start(swarm, console, link_delay_ms)
    stop = stop_requested()
    try:
        if prompt:
            asyncio.run(
                run_generation(
                    swarm.url,
                    prompt,
                    chat=True,
                    sampling=M.SamplingParams(max_tokens=max_tokens),
                    model=swarm.preset,
                    wire_dtype="f32",
                    encoding="raw",
                    chunk_size=256,
                    as_json=False,
                )
            )
        supervise(swarm, console, stop)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        console.print("stopping the swarm")
        swarm.stop()


def make_swarm(
    model, shards, backend, threads, nats_port, http_port, port, workdir, api_keys, link_delay_ms=0.0
) -> LocalSwarm:
    """The swarm `up` starts (a star of emulated links with ``link_delay_ms``); a bad keys file is
    refused (ValueError) before anything starts."""
    if api_keys:
        from neuron_bus.gateway.access import Access

        Access(api_keys)
    kind, delayed = LocalSwarm, {}
    if link_delay_ms:
        from neuron_bus.wan.topologies import StarSwarm

        kind, delayed = StarSwarm, {"delay_ms": link_delay_ms}
    return kind(
        models.resolve(model),
        shards,
        **delayed,
        backend=backend,
        threads=threads,
        workdir=workdir or Path(tempfile.mkdtemp(prefix="neuron-bus-up-")),
        nats_port=nats_port,
        http_port=http_port,
        gateway_port=port or None,
        gateway_extra=["--api-keys", str(Path(api_keys).resolve())] if api_keys else None,
    )


def start(swarm: LocalSwarm, console: Console, link_delay_ms: float = 0.0) -> None:
    """Start every process (a progress line per step) and say what is up where."""
    try:
        with console.status("starting the swarm") as status:
            swarm.start(on_step=lambda text: status.update(f"starting: {text}"))
    except NeuronBusError as exc:
        swarm.stop()
        fail(f"{exc} (logs in {swarm.workdir})")
    except BaseException:
        swarm.stop()
        raise
    console.print(
        f"[green]swarm up[/green]: {swarm.preset}, {len(swarm.workers)} workers on {swarm.url}; logs in {swarm.workdir}"
    )
    for w in swarm.workers:
        if w.layers:
            console.print(f"  {w.node_id}: layers {w.layers[0]}-{w.layers[1] - 1}")
    if link_delay_ms:
        console.print(
            f"links: the workers, the tracker and the gateway each reach the nats-server over an emulated link of "
            f"{link_delay_ms:g} ms one way (a token crosses two per hop); {swarm.url} is the server itself"
        )
    if swarm.gateway_url:
        console.print(
            f"gateway: {swarm.gateway_url}  (web page; OpenAI API at {swarm.gateway_url}/v1; /metrics, /healthz)"
        )
    console.print(
        f'try: neuron-bus generate "Tell me about the sea" --nats {swarm.url}    (Ctrl-C here stops the swarm)'
    )


def stop_requested() -> threading.Event:
    """An event set by Ctrl-C or SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _sig, _frame: stop.set())
    return stop


def supervise(swarm: LocalSwarm, console: Console, stop: threading.Event) -> None:
    """Report every child that exits and restart the ones that can be, until ``stop`` (or a fatal exit)."""
    supervisor = Supervisor(swarm)
    while not stop.wait(CHECK_EVERY_S):
        for report in supervisor.check():
            console.print(f"[red]{report.message}[/red]" if report.fatal else f"[yellow]{report.message}[/yellow]")
            if report.fatal:
                raise typer.Exit(1)
