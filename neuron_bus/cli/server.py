"""`neuron-bus server`: the embedded nats-server with JetStream and the project's topology."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import typer

from neuron_bus.cli.app import app, fail
from neuron_bus.errors import ServerError
from neuron_bus.natsserver import DEFAULT_MAX_PAYLOAD, NatsServer, ServerConfig
from neuron_bus.topology import DEFAULT_PREFILL_WINDOW, connect, ensure_topology


async def provision(url: str, replicas: int, prefill_window: int = DEFAULT_PREFILL_WINDOW, **connect_opts) -> list[str]:
    """Create the streams and buckets on a running server; return their names."""
    nc = await connect(url, name="neuron-bus-provision", max_reconnect_attempts=3, **connect_opts)
    try:
        topo = await ensure_topology(nc.jetstream(), replicas=replicas, prefill_window=prefill_window, update=True)
    finally:
        await nc.close()
    return (
        [str(c.name) for c in topo.streams] + [str(k.bucket) for k in topo.kv] + [str(o.bucket) for o in topo.objects]
    )


def wait_for_signal() -> int:
    """Block until SIGINT or SIGTERM; return the signal number."""
    received: list[int] = []

    def handler(signum, _frame):
        received.append(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not received:
            signal.pause()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return received[0]


def security(
    auth: Path | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    tls_ca: Path | None,
    operator: Path | None = None,
    store_dir: Path = Path("data/nats"),
):
    """The config blocks for --auth or --operator and TLS, and the options provisioning connects with."""
    from neuron_bus.trust.permissions import tls_block

    extra: list[str] = []
    connect_opts: dict = {}
    if operator is not None:
        if auth is not None:
            fail("give --auth (users per role) or --operator (per-node credentials), not both")
        extra.append(operator_config(operator, store_dir))
        connect_opts["creds"] = str(operator / "creds" / "admin.creds")
    if auth is not None:
        if not auth.is_file():
            fail(f"no such auth file: {auth}")
        extra.append(auth.read_text())
    if (tls_cert is None) != (tls_key is None):
        fail("--tls-cert and --tls-key go together")
    if tls_cert is not None and tls_key is not None:
        import ssl

        extra.append(tls_block(tls_cert, tls_key))
        connect_opts["tls"] = ssl.create_default_context(cafile=str(tls_ca or tls_cert))
    return extra, connect_opts


def operator_config(authority: Path, store_dir: Path) -> str:
    """The server config trusting ``authority``'s operator, its resolver beside the JetStream store."""
    from neuron_bus.trust.identity import Authority

    a = Authority(authority)
    if not a.exists:
        fail(f"no authority in {authority}: run `neuron-bus credentials init --dir {authority}` first")
    return a.server_config(store_dir.resolve() / "jwt")


def admin_url(url: str, password_file: Path | None) -> str:
    """With --auth, provisioning connects as the admin role."""
    import json

    from neuron_bus.trust.permissions import role_url

    if password_file is None or not password_file.is_file():
        fail("with --auth, provisioning connects as admin: give --password-file (or --no-provision)")
    return role_url(url, "admin", json.loads(password_file.read_text())["admin"])


def start_server(cfg: ServerConfig, url: str, replicas: int, prefill_window: int | None, connect_opts: dict):
    """Start the server and (unless ``prefill_window`` is None) create the topology; fail in one line."""
    srv = NatsServer(cfg)
    try:
        srv.start()
        # In a cluster, JetStream needs a quorum of peers before streams can be created.
        names = asyncio.run(provision(url, replicas, prefill_window, **connect_opts)) if prefill_window else []
    except ServerError as exc:
        srv.stop()
        fail(str(exc))
    except Exception as exc:  # provisioning failed: do not leave the server running
        srv.stop()
        fail(f"could not create streams and buckets: {exc}")
    return srv, names


@app.command()
def server(
    host: str = typer.Option("127.0.0.1", help="Address to bind (client, monitoring, cluster)."),
    port: int = typer.Option(4222, help="Client port."),
    http_port: int = typer.Option(8222, help="Monitoring port (/healthz, /varz, /jsz)."),
    store_dir: Path = typer.Option(Path("data/nats"), help="JetStream store directory."),
    server_name: str = typer.Option("neuron-1", help="Unique server name (required in a cluster)."),
    max_payload: int = typer.Option(DEFAULT_MAX_PAYLOAD, help="Largest message in bytes."),
    cluster_name: str = typer.Option(None, help="Join a cluster of this name."),
    cluster_port: int = typer.Option(None, help="Port for cluster routes."),
    routes: str = typer.Option("", help="Comma-separated cluster routes, nats-route://host:port."),
    replicas: int = typer.Option(1, help="Replicas for streams and buckets (3 on a 3-server cluster)."),
    prefill_window: int = typer.Option(
        DEFAULT_PREFILL_WINDOW, help="Prefill chunks that may wait for one hop before its upstream holds."
    ),
    provision_topology: bool = typer.Option(
        True, "--provision/--no-provision", help="Create the project's streams and buckets."
    ),
    auth: Path = typer.Option(None, "--auth", help="Users and subject permissions (from `neuron-bus permissions`)."),
    password_file: Path = typer.Option(
        None, "--password-file", help="Role passwords (from `neuron-bus permissions`): the admin user provisions."
    ),
    tls_cert: Path = typer.Option(None, "--tls-cert", help="Serve TLS with this certificate (PEM)."),
    tls_key: Path = typer.Option(None, "--tls-key", help="The certificate's private key (PEM)."),
    tls_ca: Path = typer.Option(
        None, "--tls-ca", help="CA to verify the server with when provisioning (default: the cert)."
    ),
    operator: Path = typer.Option(
        None,
        "--operator",
        help="Per-node credentials: trust this authority (`neuron-bus credentials init`); admit and revoke without restarts.",
    ),
) -> None:
    """Start the embedded nats-server with JetStream; stop cleanly on SIGINT/SIGTERM."""
    extra, connect_opts = security(auth, tls_cert, tls_key, tls_ca, operator, store_dir)
    cfg = ServerConfig(
        store_dir=store_dir.resolve(),
        host=host,
        port=port,
        http_port=http_port,
        server_name=server_name,
        max_payload=max_payload,
        cluster_name=cluster_name,
        cluster_port=cluster_port,
        routes=[r for r in routes.split(",") if r],
        extra="\n".join(extra),
    )
    url = cfg.client_url.replace("nats://", "tls://") if tls_cert else cfg.client_url
    if auth is not None and provision_topology:
        url = admin_url(url, password_file)
    srv, names = start_server(cfg, url, replicas, prefill_window if provision_topology else None, connect_opts)
    typer.echo(f"nats-server ready on {srv.url} (pid {srv.pid}, monitoring http://{host}:{http_port})")
    if names:
        typer.echo("topology: " + ", ".join(names))
    try:
        wait_for_signal()
    finally:
        srv.stop()
        typer.echo("nats-server stopped")
