"""`neuron-bus tracker` (the route planner service) and `neuron-bus coverage` (its coverage map)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time

import msgspec
import typer
from nats import errors as nats_errors

from neuron_bus import messages
from neuron_bus import subjects as S
from neuron_bus.cli.app import NatsOption, app, fail
from neuron_bus.client import NeuronClient, RouteError
from neuron_bus.topology import connect
from neuron_bus.tracker import TrackerParams, TrackerService
from neuron_bus.tracker.coverage import spans
from neuron_bus.tracker.layers import spell
from neuron_bus.tracker.service import TrackerError
from workers.errors import Reason

_DEFAULTS = TrackerParams()


async def _serve(url: str, params: TrackerParams, metering: bool = True) -> None:
    from neuron_bus.trust.metering import Meter

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    nc = await connect(url, name="neuron-bus-tracker", max_reconnect_attempts=-1)
    maps_nc = await connect(url, name="neuron-bus-tracker-maps", max_reconnect_attempts=-1)
    service = TrackerService(nc, params, maps_nc=maps_nc)
    meter = Meter(nc) if metering else None  # metered rewards (trust/metering.py), beside the tracker
    try:
        await service.start()
        service.tune_process()
        if meter:
            await meter.start()
        typer.echo(f"tracker ready on {url} (heartbeat expiry {params.expiry:g}s{', metering' if meter else ''})")
        await stop.wait()
    finally:
        if meter:
            await meter.stop()
        await service.stop()
        await maps_nc.drain()
        await nc.drain()
    typer.echo("tracker stopped")


@app.command()
def tracker(
    nats: str = NatsOption,
    expiry: float = typer.Option(_DEFAULTS.expiry, help="Seconds without a heartbeat before a node is dead."),
    slow_factor: float = typer.Option(
        _DEFAULTS.slow_factor,
        help="A node this many times slower per token than its group's nodes (for as many layers) is avoided.",
    ),
    min_replicas: int = typer.Option(
        _DEFAULTS.min_replicas, help="Coverage: fewer live replicas is under-provisioned."
    ),
    min_capacity: float = typer.Option(
        _DEFAULTS.min_capacity_tokens_per_second, help="Coverage: less summed decode tok/s is under-provisioned."
    ),
    ping_interval: float = typer.Option(_DEFAULTS.ping_interval, help="Seconds between latency pings (0: off)."),
    ping_budget: int = typer.Option(
        _DEFAULTS.ping_budget, min=1, help="Nodes pinged per interval at most (route candidates first)."
    ),
    forget_after: float = typer.Option(
        _DEFAULTS.forget_after,
        help="Seconds after which a dead node (or a stored report with no heartbeat) is forgotten.",
    ),
    audit_rate: float = typer.Option(
        _DEFAULTS.audit_rate, min=0.0, max=1.0, help="Fraction of sessions sent to `neuron-bus auditor` for replay."
    ),
    meter: bool = typer.Option(
        True, "--meter/--no-meter", help="Meter every session's rewards from what the swarm observed (KV neuron-meter)."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every heartbeat problem too."),
) -> None:
    """Keep the node registry from heartbeats and answer route and coverage requests."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
    )
    params = TrackerParams(
        expiry=expiry,
        slow_factor=slow_factor,
        min_replicas=min_replicas,
        min_capacity_tokens_per_second=min_capacity,
        ping_interval=ping_interval,
        ping_budget=ping_budget,
        forget_after=forget_after,
        audit_rate=audit_rate,
    )
    try:
        asyncio.run(_serve(nats, params, meter))
    except TrackerError as exc:
        fail(str(exc))
    except (OSError, nats_errors.Error) as exc:
        fail(f"cannot reach NATS at {nats}: {exc}")


async def fetch_coverage(url: str, model_preset: str | None, timeout: float) -> messages.CoverageReport:
    async with await NeuronClient.connect(url) as client:
        return await client.coverage(model_preset, timeout, wait=0)


@app.command()
def coverage(
    nats: str = NatsOption,
    as_json: bool = typer.Option(False, "--json", help="Print the CoverageReport as JSON."),
    model: str = typer.Option(None, "--model", help="Only this model preset."),
    timeout: float = typer.Option(3.0, help="Seconds to wait for the tracker."),
) -> None:
    """Per layer: live replicas, measured capacity and status; plus where a new node helps most."""
    try:
        report = asyncio.run(fetch_coverage(nats, model, timeout))
    except RouteError as exc:
        if exc.reason == Reason.NO_TRACKER:
            fail(f"no tracker answered on {S.TRACKER_COVERAGE} at {nats} (is `neuron-bus tracker` running?)")
        fail(f"bad coverage reply: {exc}")
    except (OSError, nats_errors.Error) as exc:
        fail(f"cannot reach NATS at {nats}: {exc}")
    if as_json:
        typer.echo(json.dumps(msgspec.to_builtins(report), indent=2))
        return
    render(report, model)


_STYLE = {"covered": "green", "under-provisioned": "yellow", "gap": "bold red"}
_NODE_COLUMNS = ("node", "model", "layers", "state", "decode tok/s", "sessions", "queue", "memory", "rtt ms", "slow")


def render(report: messages.CoverageReport, model: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not report.models:
        console.print(f"no node serves model {model}" if model else "no nodes registered")
    for group in report.models:
        table = Table(
            title=f"{group.model_preset} rev {group.model_revision} · {group.backend_id} · cache ABI {group.cache_abi} "
            f"· {group.n_layers_total} layers",
            title_justify="left",
        )
        for col in ("layers", "status", "replicas", "capacity tok/s", "why"):
            table.add_column(col)
        for a, b, row in spans(group.layers):
            style = _STYLE[row.status]
            table.add_row(
                spell(a, b),
                f"[{style}]{row.status}[/]",
                ", ".join(row.replicas) or "-",
                f"{row.capacity_tokens_per_second:.1f}",
                "; ".join(row.reasons),
            )
        console.print(table)
        if group.nodes_expired:
            console.print(f"expired: {', '.join(group.nodes_expired)}")
        if group.hint:
            console.print(
                f"a joining node helps most on layers {spell(group.hint.layer_start, group.hint.layer_end)}: {group.hint.reason}"
            )
    if report.nodes:
        nodes = Table(title="nodes", title_justify="left")
        for col in _NODE_COLUMNS:
            nodes.add_column(col)
        for n in report.nodes:
            nodes.add_row(
                n.node_id,
                n.model_preset,
                spell(n.layer_start, n.layer_end),
                n.status if n.protocol == report.protocol else f"[red]protocol {n.protocol}: not routed[/]",
                "-" if n.decode_tokens_per_second is None else f"{n.decode_tokens_per_second:.1f}",
                str(max(n.sessions_active, n.recently_assigned)),
                str(n.queue_depth),
                f"{n.memory_pressure:.0%}" if n.memory_pressure > 0 else "-",
                "-" if n.rtt_ms is None else f"{n.rtt_ms:.1f}",
                "yes" if n.slow else "",
            )
        console.print(nodes)
    for d in report.placements[-5:]:
        console.print(
            f"placement ({d.kind}): {d.node_id} -> {d.model_preset} layers {spell(d.layer_start, d.layer_end)}: {d.reason}"
        )
    age = max(time.time() - report.generated_at, 0.0)  # a large swarm's map may be the tracker's last one
    console.print(
        f"map built {age:.1f}s ago · expiry {report.expiry_seconds:g}s · under-provisioned: < {report.min_replicas} replicas, "
        f"only replicas > {report.slow_factor:g}x slower, or < {report.min_capacity_tokens_per_second:g} tok/s"
    )
