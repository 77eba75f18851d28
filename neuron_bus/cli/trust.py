"""`neuron-bus permissions`, `neuron-bus auditor` and `neuron-bus ledger`: the trust commands."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from pathlib import Path

import typer
from nats import errors as nats_errors

from neuron_bus.cli.app import NatsOption, app, fail
from neuron_bus.topology import connect


@app.command()
def permissions(
    out: Path = typer.Option(
        Path("nats-auth.conf"), "--out", help="Server config include to write (authorization block)."
    ),
    password_file: Path = typer.Option(
        Path("nats-passwords.json"), "--password-file", help="Role -> password (JSON, mode 0600); created or completed."
    ),
) -> None:
    """NATS users per role (worker, tracker, auditor, client, gateway, observer, admin) with subject permissions."""
    from neuron_bus.trust.permissions import ROLES, load_or_create_passwords, render

    passwords = load_or_create_passwords(password_file)
    out.write_text(render({r: passwords[r] for r in ROLES}))
    out.chmod(0o600)
    typer.echo(f"wrote {out} ({len(ROLES)} users: {', '.join(ROLES)}); passwords in {password_file}")
    typer.echo(f"start the bus with: neuron-bus server --auth {out} --password-file {password_file}")
    typer.echo("connect as a role with: --nats nats://<role>:<password>@host:4222")


@app.command()
def auditor(
    nats: str = NatsOption,
    model: str = typer.Option(None, help="Reference GGUF path or preset (default: each event's model preset)."),
    threads: int = typer.Option(1, help="Threads for the reference model."),
    threshold: int = typer.Option(2, min=1, help="Disagreeing replays pinned on a node before it is flagged."),
) -> None:
    """Replay the sessions the tracker samples (`tracker --audit-rate`) and flag nodes whose replays disagree."""
    from neuron_bus.trust.auditor import Auditor

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        nc = await connect(nats, name="neuron-bus-auditor")
        service = Auditor(nc, model=model, threads=threads, threshold=threshold)
        try:
            await service.start()
            typer.echo(f"auditor ready on {nats}", err=False)
            await stop.wait()
        finally:
            await service.stop()
            await nc.drain()

    try:
        asyncio.run(serve())
    except (OSError, nats_errors.Error) as exc:
        fail(f"cannot reach NATS at {nats}: {exc}")


@app.command()
def ledger(
    nats: str = NatsOption,
    as_json: bool = typer.Option(False, "--json", help="Print per-node figures as JSON."),
) -> None:
    """Rewards per node: paid (metered from what the swarm observed) next to claimed, with flagged claims."""
    from neuron_bus.trust.ledger import ledger as read

    async def run():
        nc = await connect(nats, name="neuron-bus-ledger", max_reconnect_attempts=1)
        try:
            return await read(nc.jetstream())
        finally:
            await nc.close()

    try:
        rows = asyncio.run(run())
    except (OSError, nats_errors.Error) as exc:
        fail(f"cannot read the ledger at {nats}: {exc}")
    if as_json:
        typer.echo(json.dumps({n: t.as_dict() for n, t in rows.items()}, indent=2))
        return
    render_ledger(rows)


def render_ledger(rows: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title="reward ledger: paid = metered (owned layer work × positions the swarm observed); claimed = self-reported",
        title_justify="left",
    )
    for col in ("node", "paid weight", "claimed weight", "sessions", "metered positions", "claimed positions"):
        table.add_column(col)
    for col in ("flagged", "pending", "seeding bytes"):
        table.add_column(col)
    for t in rows.values():
        table.add_row(
            t.node_id,
            f"{t.inference_weight:.1f}",
            f"{t.claimed_weight:.1f}",
            str(t.sessions),
            f"{t.prefill_tokens} + {t.decode_tokens}",
            f"{t.claimed_prefill_tokens} + {t.claimed_decode_tokens}",
            f"[red]yes ({len(t.flags)})[/red]" if t.flagged else "",
            str(len(t.pending_sessions) + len(t.unmetered_sessions) or ""),
            str(t.seeding_bytes),
        )
    console = Console()
    console.print(table)
    for t in rows.values():
        for f in t.flags:
            console.print(f"[red]flagged[/red] {t.node_id} session {f['session_id']}: {f['reason']}")


credentials_app = typer.Typer(
    no_args_is_help=True,
    help="Per-node and per-client credentials (NATS decentralized auth): admit and revoke without restarting servers.",
)
app.add_typer(credentials_app, name="credentials")
AuthorityOption = typer.Option(
    Path("neuron-authority"), "--dir", help="The operator's authority directory (keep private)."
)


@credentials_app.command("init")
def credentials_init(authority: Path = AuthorityOption) -> None:
    """Create the operator, the swarm account and the system account; print how to start a server."""
    from neuron_bus.trust.identity import Authority

    a = Authority(authority).init()
    a.issue("admin", "admin")  # provisions streams and buckets
    typer.echo(
        f"authority in {authority} (operator, account {a.account_jwt()[:12]}…); admin and sys credentials issued"
    )
    typer.echo(f"start every server with: neuron-bus server --operator {authority}")


@credentials_app.command("issue")
def credentials_issue(
    name: str = typer.Argument(..., help="Node id (worker), or the client's, gateway's, tracker's … name."),
    role: str = typer.Option("worker", help="worker | client | gateway | tracker | auditor | observer | admin"),
    authority: Path = AuthorityOption,
) -> None:
    """Admit a node or client: a credential allowed its role's subjects for its own name only."""
    from neuron_bus.trust.identity import Authority

    a = Authority(authority)
    if not a.exists:
        fail(f"no authority in {authority}: run `neuron-bus credentials init` first")
    try:
        path = a.issue(name, role)
    except ValueError as exc:
        fail(str(exc))
    typer.echo(f"issued {path} ({role} {name}); start it with NEURON_NATS_CREDS={path}")


@credentials_app.command("revoke")
def credentials_revoke(
    name: str = typer.Argument(..., help="The node or client to revoke."),
    authority: Path = AuthorityOption,
    nats: str = NatsOption,
) -> None:
    """Revoke every credential of ``name`` and push the account to the servers: its connections drop at once."""
    from neuron_bus.trust.identity import Authority, push_account

    a = Authority(authority)
    try:
        a.revoke(name)
        answer = asyncio.run(push_account(nats, a))
    except ValueError as exc:
        fail(str(exc))
    except (OSError, nats_errors.Error) as exc:
        fail(f"revoked in {authority}, but the servers at {nats} did not take the update: {exc}")
    typer.echo(f"revoked {name}; servers: {answer}")


@credentials_app.command("list")
def credentials_list(authority: Path = AuthorityOption) -> None:
    """Every credential issued, its role, and whether it is revoked."""
    from neuron_bus.trust.identity import Authority

    a = Authority(authority)
    revoked = a.revoked_keys()
    for name, entries in sorted(a.issued().items()):
        for e in entries:
            typer.echo(f"{name}\t{e['role']}\t{e['key']}\t{'revoked' if e['key'] in revoked else 'valid'}")
