"""`neuron-bus gateway`: the HTTP/WebSocket front door of a running bus."""

from __future__ import annotations

import asyncio
import os

import typer

from neuron_bus.admission import DEFAULT_LIMIT as DEFAULT_QUEUE_LIMIT
from neuron_bus.cli.app import NatsOption, app, fail


@app.command()
def gateway(
    nats: str = NatsOption,
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, min=1, max=65535, help="HTTP port."),
    max_context: int = typer.Option(4096, min=2, help="Prompt + generated tokens per request at most (413 beyond)."),
    chunk_size: int = typer.Option(128, min=1, help="Prefill chunk size in tokens (progress granularity)."),
    max_queue: int = typer.Option(
        DEFAULT_QUEUE_LIMIT, min=0, help="Requests that may wait for a free session slot (429 beyond; 0: 503 at once)."
    ),
    encrypt_activations: bool = typer.Option(
        False, "--encrypt-activations", help="Seal every session's activation bodies and snapshots (AEAD)."
    ),
) -> None:
    """Serve the OpenAI-compatible API, the WebSocket /ws, the web page, /metrics and /healthz."""
    if encrypt_activations:
        os.environ["NEURON_ENCRYPT_ACTIVATIONS"] = "1"
    from neuron_bus.errors import ServerError
    from neuron_bus.gateway.app import serve
    from neuron_bus.gateway.validation import Limits
    from neuron_bus.natsserver import check_ports_free

    try:
        check_ports_free(host, [("gateway port", port, "--port")])
    except ServerError as exc:
        fail(f"gateway cannot start: {exc}")

    def ready(url: str) -> None:
        typer.echo(f"gateway on {url} (OpenAI API {url}/v1, WebSocket {url.replace('http', 'ws', 1)}/ws)", err=True)

    try:
        limits = Limits(max_context=max_context, max_queue=max_queue)
        asyncio.run(serve(nats, host, port, limits, chunk_size, on_ready=ready))
    except OSError as exc:  # no NATS server, or the port is taken
        fail(f"gateway cannot start: {exc}")
