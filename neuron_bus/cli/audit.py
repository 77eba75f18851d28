"""`neuron-bus audit model PATH`: what a GGUF can do here, and why not when it cannot (model_audit.py).
`neuron-bus audit replay SESSION`: re-run a stored validation event on a reference (trust/replay.py).
"""

from __future__ import annotations

import json

import typer

from neuron_bus.cli.app import fail
from neuron_bus.model_audit import BACKENDS, Check, audit_model

audit_app = typer.Typer(
    no_args_is_help=True,
    help="Audit what a model artifact supports: readable, local inference, layer-boundary execution per backend.",
)

# -- the command -----------------------------------------------------------------------------------


def _line(label: str, check: Check) -> str:
    state = "works" if check.ok else "unsupported"
    if label in ("artifact",):
        state = "available" if check.ok else "unreadable"
    elif label == "full inference":
        state = "works" if check.ok else "fails"
    return f"{label:<20}{state}: {check.detail}"


@audit_app.command("model")
def model(
    path: str = typer.Argument(..., help="A GGUF file, or a preset name (smollm2-135m, gemma3-270m)."),
    backend: list[str] = typer.Option(list(BACKENDS), "--backend", "-b", help="Backends to check (repeat)."),
    threads: int = typer.Option(1, "--threads", help="Threads per backend."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
) -> None:
    """Say whether PATH is readable, runs whole, and runs split at a layer boundary (per backend)."""
    from neuron_bus import models

    unknown = [b for b in backend if b not in BACKENDS]
    if unknown:
        fail(f"unknown backend {unknown[0]!r}: use {', '.join(BACKENDS)}")
    try:
        resolved = models.resolve(path)
    except LookupError as exc:
        fail(str(exc))
    audit = audit_model(resolved, tuple(backend), threads)
    if as_json:
        typer.echo(json.dumps(audit.as_dict(), indent=2))
    else:
        typer.echo(f"{'model':<20}{audit.path}")
        typer.echo(_line("artifact", audit.artifact))
        if audit.full_inference is not None:
            typer.echo(_line("full inference", audit.full_inference))
        for kind, check in audit.layer_boundary.items():
            typer.echo(_line(f"boundary {kind}", check))
        typer.echo(f"{'summary':<20}{audit.summary}")
    if not audit.artifact.ok:
        raise typer.Exit(1)


# -- replay of a validation event ------------------------------------------------------------------


@audit_app.command("replay")
def replay(
    key: str = typer.Argument(..., help="Session id or event id of a stored validation event."),
    nats: str = typer.Option(
        None, "--nats", help="NATS server (default: env NEURON_NATS_URL or nats://127.0.0.1:4222)."
    ),
    reference: str = typer.Option(
        "single", "--reference", help="single (whole model in this process) | route (a fresh route)."
    ),
    model: str = typer.Option(None, "--model", help="Reference GGUF path or preset (default: the event's preset)."),
    threads: int = typer.Option(1, "--threads"),
    as_json: bool = typer.Option(False, "--json", help="Print the AuditVerdict as JSON."),
) -> None:
    """Re-run a generation from its validation event and compare tokens and logits: agree, disagree or unverifiable."""
    import asyncio

    from neuron_bus import messages as M
    from neuron_bus.cli.app import DEFAULT_NATS_URL
    from neuron_bus.errors import NeuronBusError
    from neuron_bus.topology import connect
    from neuron_bus.trust.events import validation_event
    from neuron_bus.trust.replay import replay_route, replay_single

    url = nats or DEFAULT_NATS_URL
    if reference not in ("single", "route"):
        fail("--reference must be single or route")

    async def fetch():
        nc = await connect(url, name="neuron-bus-audit", max_reconnect_attempts=1)
        try:
            return await validation_event(nc.jetstream(), key)
        finally:
            await nc.close()

    try:
        event = asyncio.run(fetch())
        if reference == "route":
            verdict = asyncio.run(replay_route(event, url))
        else:
            from neuron_bus import models

            verdict = replay_single(event, models.resolve(model) if model else None, threads)
    except NeuronBusError as exc:
        fail(str(exc))
    except (OSError, LookupError) as exc:
        fail(f"cannot replay {key}: {exc}")
    if as_json:
        typer.echo(M.encode(verdict).decode())
    else:
        route = " -> ".join(f"{m.node_id}[{m.layer_start}-{m.layer_end - 1}]" for m in event.route)
        typer.echo(
            f"session {event.session_id} ({event.model_preset}, route {route}, {len(event.output_tokens)} tokens)"
        )
        typer.echo(f"{verdict.verdict}: {verdict.detail}")
    if verdict.verdict == "disagree":
        raise typer.Exit(2)
