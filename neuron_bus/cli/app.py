"""The `neuron-bus` typer application and the options every command shares."""

from __future__ import annotations

import os
from typing import NoReturn

import typer

app = typer.Typer(
    name="neuron-bus",
    no_args_is_help=True,
    add_completion=False,
    help="Run GGUF models across machines, one contiguous layer range per node, over NATS JetStream.",
)

DEFAULT_NATS_URL = os.environ.get("NEURON_NATS_URL", "nats://127.0.0.1:4222")


@app.callback()
def _root() -> None:
    """Run GGUF models across machines, one contiguous layer range per node, over NATS JetStream."""


NatsOption = typer.Option(
    DEFAULT_NATS_URL,
    "--nats",
    help="NATS server or cluster to use (comma-separated URLs); env NEURON_NATS_URL.",
)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print one clear line to stderr and exit non-zero."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
