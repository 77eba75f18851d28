"""`neuron-bus audit model PATH`: what a GGUF can do here, and why not when it cannot (model_audit.py).
`neuron-bus audit architectures`: the same for every architecture the synthetic builder knows (arch_matrix.py).
`neuron-bus audit replay SESSION`: re-run a stored validation event on a reference (trust/replay.py).
"""

from __future__ import annotations

import json

import typer

from neuron_bus.cli.app import fail
from neuron_bus.model_audit import BACKENDS, N_DECODE, N_PROMPT, Check, audit_model

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
    prompt_tokens: int = typer.Option(N_PROMPT, "--prompt-tokens", min=1, help="Prompt positions compared."),
    decode: int = typer.Option(N_DECODE, "--decode", min=0, help="Greedy decode steps compared."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
) -> None:
    """Say whether PATH is readable, runs whole, runs split at layer boundaries (per backend), and
    restores snapshots; with its layer kinds and cache bytes per position."""
    from neuron_bus import models

    unknown = [b for b in backend if b not in BACKENDS]
    if unknown:
        fail(f"unknown backend {unknown[0]!r}: use {', '.join(BACKENDS)}")
    try:
        resolved = models.resolve(path)
    except LookupError as exc:
        fail(str(exc))
    audit = audit_model(resolved, tuple(backend), threads, prompt_tokens, decode)
    if as_json:
        typer.echo(json.dumps(audit.as_dict(), indent=2))
    else:
        typer.echo(f"{'model':<20}{audit.path}")
        if audit.artifact is not None:
            typer.echo(_line("artifact", audit.artifact))
        if audit.full_inference is not None:
            typer.echo(_line("full inference", audit.full_inference))
        if audit.cache is not None:
            c = audit.cache
            typer.echo(
                f"{'cache':<20}{c.cache_abi}: {c.bytes_per_token} bytes per position, {c.fixed_bytes} fixed"
                f"{'' if c.supports_truncate else ', cannot be truncated (recurrent state)'}"
            )
        if audit.active_parameters is not None:
            typer.echo(
                f"{'work per token':<20}{audit.active_parameters:.3f}M weights multiplied of "
                f"{audit.total_parameters:.3f}M stored"
            )
        for kind, check in audit.layer_boundary.items():
            typer.echo(_line(f"boundary {kind}", check))
        if audit.snapshot is not None:
            typer.echo(_line("snapshot", audit.snapshot))
        typer.echo(f"{'summary':<20}{audit.summary}")
    if audit.artifact is None or not audit.artifact.ok:
        raise typer.Exit(1)


@audit_app.command("architectures")
def architectures(
    arch: list[str] = typer.Option(None, "--arch", "-a", help="Only these architectures (repeat)."),
    threads: int = typer.Option(1, "--threads", help="Threads per backend."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON rows instead of a table."),
    markdown: bool = typer.Option(False, "--markdown", help="Print a Markdown table."),
) -> None:
    """Audit a small synthetic model of every architecture the builder knows: one row each (loads,
    full inference, layer split, snapshot, cache bytes per position, work per token)."""
    from neuron_bus.arch_matrix import COLUMNS, architecture_matrix, markdown_table, table_cells
    from neuron_bus.artifacts.synthetic import ARCHITECTURES

    unknown = [a for a in arch or [] if a not in ARCHITECTURES]
    if unknown:
        fail(f"no synthetic model of {unknown[0]!r}: known are {', '.join(ARCHITECTURES)}")
    widths = (12, 44, 7, 16, 18, 25, 23, 16)
    live = not (as_json or markdown)
    if live:
        typer.echo("".join(f"{c:<{w}}" for c, w in zip(COLUMNS, widths)))

    def show(row) -> None:
        if live:
            typer.echo("".join(f"{c:<{w}}" for c, w in zip(table_cells(row), widths)))
            for label, why in (("split", row.split_detail), ("snapshot", row.snapshot_detail), ("why", row.detail)):
                if why and (label == "why" or (label == "split" and row.split != "bit-exact")):
                    typer.echo(f"    {label}: {why}")

    rows = architecture_matrix(list(arch) if arch else None, threads, on_row=show)
    if as_json:
        typer.echo(json.dumps([r.as_dict() for r in rows], indent=2))
    elif markdown:
        typer.echo(markdown_table(rows))


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
