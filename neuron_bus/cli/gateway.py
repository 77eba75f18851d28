"""`neuron-bus gateway`: the HTTP/WebSocket front door of a running bus."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer

from neuron_bus.admission import DEFAULT_LIMIT as DEFAULT_QUEUE_LIMIT
from neuron_bus.cli.app import NatsOption, app, fail
from neuron_bus.gateway.bus import DEFAULT_CHUNK


@app.command()
def gateway(
    nats: str = NatsOption,
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, min=1, max=65535, help="HTTP port."),
    max_context: int = typer.Option(4096, min=2, help="Prompt + generated tokens per request at most (413 beyond)."),
    chunk_size: int = typer.Option(DEFAULT_CHUNK, min=1, help="Prefill chunk size in tokens (progress granularity)."),
    max_queue: int = typer.Option(
        DEFAULT_QUEUE_LIMIT, min=0, help="Requests that may wait for a free session slot (429 beyond; 0: 503 at once)."
    ),
    encrypt_activations: bool = typer.Option(
        False, "--encrypt-activations", help="Seal every session's activation bodies and snapshots (AEAD)."
    ),
    api_keys: Path = typer.Option(
        None,
        "--api-keys",
        help="API keys file (JSON: id, sha256, requests_per_minute, burst; `neuron-bus api-key add`): "
        "/v1 and /ws then need 'Authorization: Bearer <key>' (401 without, 429 past the key's rate).",
    ),
    tracker_wait: float = typer.Option(
        10.0, min=0.0, help="Seconds a request waits for a tracker that is not answering (503 no_tracker beyond)."
    ),
    body_timeout: float = typer.Option(
        30.0, min=0.1, help="Seconds a request body may take to arrive (408 beyond: slow clients)."
    ),
) -> None:
    """Serve the OpenAI-compatible API, the WebSocket /ws, the web page, /metrics and /healthz."""
    from neuron_bus.errors import ServerError
    from neuron_bus.gateway.access import Access
    from neuron_bus.gateway.app import serve
    from neuron_bus.gateway.validation import Limits
    from neuron_bus.natsserver import check_ports_free

    try:
        check_ports_free(host, [("gateway port", port, "--port")])
        if api_keys:
            Access(api_keys)  # read now: a bad file is one clear line, before anything starts
    except ServerError as exc:
        fail(f"gateway cannot start: {exc}")
    except ValueError as exc:  # never names a key, only the file and the entry's id
        fail(f"gateway cannot start: {exc}")

    def ready(url: str) -> None:
        typer.echo(f"gateway on {url} (OpenAI API {url}/v1, WebSocket {url.replace('http', 'ws', 1)}/ws)", err=True)

    try:
        limits = Limits(max_context=max_context, max_queue=max_queue, body_timeout_s=body_timeout)
        asyncio.run(
            serve(
                nats,
                host,
                port,
                limits,
                chunk_size,
                on_ready=ready,
                api_keys=api_keys,
                tracker_wait=tracker_wait,
                encrypt_activations=encrypt_activations or None,
            )
        )
    except OSError as exc:  # no NATS server, or the port is taken
        fail(f"gateway cannot start: {exc}")


api_key_app = typer.Typer(no_args_is_help=True, help="The gateway's API keys (`neuron-bus gateway --api-keys FILE`).")
app.add_typer(api_key_app, name="api-key")


@api_key_app.command("add")
def api_key_add(
    key_id: str = typer.Argument(..., help="The key's id: what logs and metrics name (1-64 of A-Z a-z 0-9 _ . -)."),
    file: Path = typer.Option(..., "--file", help="The keys file (created, mode 0600)."),
    rpm: float = typer.Option(60.0, "--rpm", min=0.0, help="Requests per minute (0: no limit)."),
    burst: int = typer.Option(10, min=1, help="Requests at once before the rate applies."),
) -> None:
    """Create a key: its hash goes into the file, the key is printed once (a running gateway picks it up)."""
    from neuron_bus.gateway.access import add_key

    try:
        key = add_key(file, key_id, rpm, burst)
    except ValueError as exc:
        fail(str(exc))
    typer.echo(key)
    typer.echo(
        f"key {key_id} added to {file} ({rpm:g} requests/minute, burst {burst}); it is not stored: keep it", err=True
    )


@api_key_app.command("revoke")
def api_key_revoke(
    key_id: str = typer.Argument(..., help="The id of the key to remove."),
    file: Path = typer.Option(..., "--file", help="The keys file."),
) -> None:
    """Remove a key from the file (a running gateway refuses it within seconds)."""
    from neuron_bus.gateway.access import load_keys, save_keys

    try:
        keys = load_keys(file)
    except ValueError as exc:
        fail(str(exc))
    if not any(k.key_id == key_id for k in keys):
        fail(f"no key {key_id} in {file}")
    save_keys(file, [k for k in keys if k.key_id != key_id])
    typer.echo(f"key {key_id} revoked", err=True)


@api_key_app.command("list")
def api_key_list(file: Path = typer.Option(..., "--file", help="The keys file.")) -> None:
    """The ids and rate limits of the keys in a file (never the keys: the file has only their hashes)."""
    from neuron_bus.gateway.access import load_keys

    try:
        keys = load_keys(file)
    except ValueError as exc:
        fail(str(exc))
    for k in keys:
        typer.echo(f"{k.key_id}\t{k.requests_per_minute:g}/min\tburst {k.burst}")
