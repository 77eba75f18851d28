"""A swarm on this machine: the embedded nats-server, a tracker, N workers and optionally the
gateway, as real processes.

Used by `neuron-bus up`, the benchmarks and the integration tests alike. Layers are split so every
worker does about the same work per token (`neuron_bus.split`); each worker gets its own thread budget (one by default: several processes share few cores).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from neuron_bus import messages as M
from neuron_bus.artifacts.cuts import check_cut, layer_kinds
from neuron_bus.artifacts.gguf_model import GGUFModel, format_layers
from neuron_bus.errors import NeuronBusError
from neuron_bus.models import preset_for
from neuron_bus.natsserver import NatsServer, ServerConfig, check_ports_free, free_port, log_tail, start_all
from neuron_bus.split import model_split
from neuron_bus.topology import connect, ensure_topology
from neuron_bus.trust.identity import Authority
from workers.errors import Reason


def cli() -> list[str]:
    return [sys.executable, "-m", "neuron_bus"]


@dataclass
class WorkerSpec:
    layers: tuple[int, int] | None  # None: --layers auto (the tracker places it)
    node_id: str
    extra: list[str] = field(default_factory=list)
    model: str | None = None  # for --layers auto: the model it asks for ("any": the tracker picks); None: the swarm's


def nats_servers(workdir: Path, cluster: int, port: int | None, http_port: int | None, extra: str) -> list[NatsServer]:
    """One nats-server, or a cluster of ``cluster`` (streams and buckets then get as many replicas)."""
    if cluster == 1:
        cfg = ServerConfig(
            store_dir=workdir / "nats", port=port or free_port(), http_port=http_port or free_port(), extra=extra
        )
        return [NatsServer(cfg)]
    routes = [free_port() for _ in range(cluster)]
    return [
        NatsServer(
            ServerConfig(
                store_dir=workdir / f"nats-{i}",
                port=free_port(),
                http_port=free_port(),
                server_name=f"nats-{i}",
                cluster_name="neuron",
                cluster_port=p,
                routes=[f"nats-route://127.0.0.1:{r}" for r in routes],
                extra=extra,
            )
        )
        for i, p in enumerate(routes)
    ]


def worker_ranges(model: GGUFModel, shards: int, ranges: list[tuple[int, int]] | None) -> list[tuple[int, int]]:
    """The ranges given (each checked to load), or the work-balanced split into ``shards``."""
    if not ranges:
        return model_split(model, shards)
    kinds = layer_kinds(model)
    for a, b in ranges:
        check_cut(kinds, a, b)
    return ranges


class LocalSwarm:
    def __init__(
        self,
        model_path: Path,
        shards: int = 2,
        *,
        backend: str = "llama-cpp",
        threads: int = 1,
        workdir: Path,
        nats_port: int | None = None,
        http_port: int | None = None,
        ranges: list[tuple[int, int]] | None = None,
        worker_extra: dict[int, list[str]] | None = None,
        tracker_extra: list[str] | None = None,
        prefill_window: int | None = None,
        gateway_port: int | None = None,
        gateway_extra: list[str] | None = None,
        from_store: bool = False,
        cluster: int = 1,
        credentials: dict[str, str] | None = None,
        auditor_extra: list[str] | None = None,
        auto_workers: int = 0,
        trackers: int = 1,
        identity: bool = False,
    ):
        self.model_path = Path(model_path)
        self.preset = preset_for(self.model_path)
        model = GGUFModel(self.model_path)
        self.backend = backend
        self.threads = threads
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # role -> password: the server enforces `neuron-bus permissions`' users; every process connects as its role
        self.credentials = credentials
        self.authority: Authority | None = None
        self.creds: dict[str, Path] = {}  # process or client name -> its .creds file
        self.servers = self._make_servers(cluster, nats_port, http_port, self._server_auth(identity, cluster))
        self.replicas = len(self.servers)  # copies of every stream and bucket
        self.prefill_window = prefill_window
        self.from_store = from_store  # publish the model to the shard swarm; workers fetch their range
        self.artifact_id: str | None = None
        extra = worker_extra or {}
        if auto_workers:  # self-placing workers fetch their range from the shard swarm
            self.from_store = True
            self.workers = [WorkerSpec(None, f"worker-{i}", list(extra.get(i, []))) for i in range(auto_workers)]
        else:
            self.workers = [
                WorkerSpec(r, f"worker-{i}", list(extra.get(i, [])))
                for i, r in enumerate(worker_ranges(model, shards, ranges))
            ]
        self.tracker_extra = tracker_extra or []
        self.trackers = trackers
        self.auditor_extra = auditor_extra  # None: no auditor process
        self.gateway_port = gateway_port
        self.gateway_extra = gateway_extra or []
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, list[str]] = {}  # name -> the arguments it was started with

    def _server_auth(self, identity: bool, cluster: int) -> str:
        """The servers' authorization block: role users (``credentials``), or per-process
        credentials (``identity``: decentralized auth, every process its own, the servers trusting
        the operator), or none."""
        if identity:
            return self._init_authority(cluster)
        if self.credentials:
            from neuron_bus.trust.permissions import render

            return render(self.credentials)
        return ""

    def _make_servers(self, cluster: int, nats_port: int | None, http_port: int | None, auth: str) -> list[NatsServer]:
        """The swarm's nats-servers (a hook: wan/topologies.py builds other topologies)."""
        return nats_servers(self.workdir, cluster, nats_port, http_port, auth)

    def process_url(self, name: str, role: str) -> str:
        """The bus URL the process ``name`` (a worker's node id, tracker, auditor, gateway) is started
        with, as ``role``. Here every process reaches the servers directly; wan/topologies.py puts
        emulated links in between."""
        return self.role_url(role)

    @property
    def plain_url(self) -> str:
        return ",".join(srv.url for srv in self.servers)

    @property
    def url(self) -> str:
        """The bus for this process (as admin when the swarm runs with credentials)."""
        return self.role_url("admin")

    def _init_authority(self, cluster: int) -> str:
        """An operator for this swarm, its admin credential, and the server config trusting it."""
        if cluster != 1:
            raise ValueError("LocalSwarm(identity=True) runs one server")
        self.authority = Authority(self.workdir / "authority").init()
        self.creds["admin"] = self.authority.issue("admin", "admin")
        return self.authority.server_config(self.workdir / "jwt")

    def issue(self, name: str, role: str) -> Path:
        """A credential of its own for ``name`` (a node id, a client's name) in ``role`` (identity swarms)."""
        assert self.authority is not None, "LocalSwarm(identity=True) issues credentials"
        self.creds[name] = self.authority.issue(name, role)
        return self.creds[name]

    @property
    def admin(self) -> dict:
        """Connection options of this process (the operator): admin credentials on an identity swarm."""
        return {"creds": str(self.creds["admin"])} if self.authority else {}

    def role_url(self, role: str) -> str:
        """The bus as ``role`` (worker, tracker, auditor, client, gateway, observer, admin)."""
        if not self.credentials:
            return self.plain_url
        from neuron_bus.trust.permissions import role_url

        return role_url(self.plain_url, role, self.credentials[role])

    @property
    def gateway_url(self) -> str | None:
        return f"http://127.0.0.1:{self.gateway_port}" if self.gateway_port else None

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), PYTHONUNBUFFERED="1")
        if self.authority is not None:
            env["NEURON_NATS_CREDS"] = str(self.creds[name])
        proc = subprocess.Popen(cli() + args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        log.close()
        self.procs[name] = proc
        self.commands[name] = args
        return proc

    def respawn(self, name: str) -> subprocess.Popen:
        """Start child ``name`` again, as it was started the first time."""
        return self._spawn(name, self.commands[name])

    def start_worker(self, spec: WorkerSpec) -> subprocess.Popen:
        if spec.layers is None:
            what = ["--model", spec.model or self.preset, "--layers", "auto"]
        elif self.artifact_id:
            what = ["--artifact", self.artifact_id, "--layers", format_layers(*spec.layers)]
        else:
            what = ["--model", str(self.model_path), "--layers", format_layers(*spec.layers)]
        return self._spawn(
            spec.node_id,
            [
                "worker",
                *what,
                "--backend",
                self.backend,
                "--nats",
                self.process_url(spec.node_id, "worker"),
                "--threads",
                str(self.threads),
                "--node-id",
                spec.node_id,
                *spec.extra,
            ],
        )

    def ports(self) -> list[tuple[str, int, str]]:
        """Every port this swarm binds, with the `neuron-bus up` option that moves it."""
        if len(self.servers) == 1:
            cfg = self.servers[0].config
            out = [
                ("nats-server client port", cfg.port, "--nats-port"),
                ("nats-server monitoring port", cfg.http_port, "--http-port"),
            ]
        else:
            out = [p for srv in self.servers for p in srv.ports()]
        if self.gateway_port:
            out.append(("gateway port", self.gateway_port, "--port"))
        return out

    def start(self, timeout: float = 180.0, on_step=None) -> LocalSwarm:
        step = on_step or (lambda text: None)
        check_ports_free("127.0.0.1", self.ports())  # before anything starts
        step(f"nats-server on {self.plain_url}")
        self._start_servers(timeout)
        kw = {"prefill_window": self.prefill_window} if self.prefill_window else {}
        asyncio.run(self._provision(**kw))
        if self.from_store:
            step("publishing the model to the shard swarm")
            self.artifact_id = self.publish(self.model_path)
        trackers = ["tracker" if i == 0 else f"tracker-{i}" for i in range(self.trackers)]
        if self.authority is not None:
            for name, role in [*((t, "tracker") for t in trackers), ("auditor", "auditor"), ("gateway", "gateway")]:
                self.issue(name, role)
            for spec in self.workers:
                self.issue(spec.node_id, "worker")
        for name in trackers:
            step(name)
            self._spawn(name, ["tracker", "--nats", self.process_url(name, "tracker"), *self.tracker_extra])
        if self.auditor_extra is not None:
            step("auditor")
            self._spawn("auditor", ["auditor", "--nats", self.process_url("auditor", "auditor"), *self.auditor_extra])
        for spec in self.workers:
            step(
                f"worker {spec.node_id}: layers {format_layers(*spec.layers) if spec.layers else 'chosen by the tracker'}"
            )
            self.start_worker(spec)
        step("waiting for a complete route")
        self.wait_ready(timeout)
        if self.gateway_port:
            step(f"gateway on {self.gateway_url}")
            self._spawn(
                "gateway",
                [
                    "gateway",
                    "--nats",
                    self.process_url("gateway", "gateway"),
                    "--port",
                    str(self.gateway_port),
                    *self.gateway_extra,
                ],
            )
            self.wait_gateway(timeout)
        return self

    def wait_gateway(self, timeout: float) -> None:
        """Block until the gateway answers /healthz with 200 (NATS connected, tracker answering)."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            proc = self.procs["gateway"]
            if proc.poll() is not None:
                raise NeuronBusError(
                    Reason.SWARM_FAILED, f"gateway exited with {proc.returncode}: {self.log_tail('gateway')}"
                )
            try:
                with urllib.request.urlopen(f"{self.gateway_url}/healthz", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.3)
        raise NeuronBusError(Reason.SWARM_NOT_READY, f"gateway not ready after {timeout:.0f}s: {last}")

    def _start_servers(self, timeout: float) -> None:
        start_all(self.servers, min(timeout, 60.0))

    async def _provision(self, **kw) -> None:
        nc = await connect(self.url, max_reconnect_attempts=3, **self.admin)
        try:
            deadline = time.monotonic() + 60.0
            while True:  # a fresh cluster may still be electing its meta leader
                try:
                    await ensure_topology(nc.jetstream(), replicas=self.replicas, update=True, **kw)
                    return
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
        finally:
            await nc.close()

    def publish(self, model_path: Path) -> str:
        """Seed a model into this swarm's shard swarm (the swarm's own, or another for --model any); its artifact id."""
        from neuron_bus.artifacts.swarm import publish

        async def seed() -> str:
            nc = await connect(self.url, max_reconnect_attempts=3, **self.admin)
            try:
                return (await publish(nc.jetstream(), [model_path])).artifact_id
            finally:
                await nc.close()

        return asyncio.run(seed())

    def wait_ready(self, timeout: float) -> M.RouteAssignment:
        """Block until the tracker sees every worker alive and hands out a complete route."""
        deadline = time.monotonic() + timeout
        want = {s.node_id for s in self.workers}
        last = "no answer"
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise NeuronBusError(
                        Reason.SWARM_FAILED, f"{name} exited with {proc.returncode}: {self.log_tail(name)}"
                    )
            try:
                alive, route = asyncio.run(self._probe())
                if want <= alive:
                    return route
                last = f"alive: {sorted(alive)}"
            except Exception as exc:
                last = str(exc)
            time.sleep(0.5)
        raise NeuronBusError(Reason.SWARM_NOT_READY, f"swarm not ready after {timeout:.0f}s: {last}")

    def coverage(self, model: str | None = None) -> M.CoverageReport:
        """The tracker's coverage map (of ``model``; None: every model), asked as admin."""
        from neuron_bus.client import NeuronClient

        async def probe() -> M.CoverageReport:
            async with await NeuronClient.connect(self.url, **self.admin) as client:
                return await client.coverage(model)

        return asyncio.run(probe())

    def ready_ranges(self) -> dict[str, tuple[int, int]]:
        """The layer range of every live, ready node, as the tracker's coverage map has it."""
        report = self.coverage(self.preset)
        return {n.node_id: (n.layer_start, n.layer_end) for n in report.nodes if n.alive and n.status == "ready"}

    def covered(self, n_layers: int) -> bool:
        """Whether the ready nodes hold every one of the model's ``n_layers`` layers."""
        from neuron_bus.tracker.layers import uncovered_runs

        return not uncovered_runs(self.ready_ranges().values(), n_layers)

    async def _probe(self) -> tuple[set[str], M.RouteAssignment]:
        from neuron_bus.client import NeuronClient

        async with await NeuronClient.connect(self.url, **self.admin) as client:
            report = await client.coverage(self.preset)
            alive = {n.node_id for n in report.nodes if n.alive}
            return alive, await client.route(self.preset)

    def log_tail(self, name: str, n: int = 8) -> str:
        return log_tail(self.workdir / f"{name}.log", n)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.get(name)
        if proc and proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for srv in self.servers:
            srv.stop()

    def __enter__(self) -> LocalSwarm:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
