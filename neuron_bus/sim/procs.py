"""The simulator's processes: a nats-server, tracker processes and the node pool, each started
on this machine, measured with psutil and stopped by PID."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from neuron_bus.errors import NeuronBusError
from neuron_bus.natsserver import NatsServer, ServerConfig, free_port
from workers.errors import Reason

ONE_THREAD = {"OMP_NUM_THREADS": "1", "NEURON_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class SimError(NeuronBusError):
    """The simulator could not run: a process that did not start, or stopped early."""


def start_server(workdir: Path) -> NatsServer:
    cfg = ServerConfig(store_dir=workdir / "nats", port=free_port(), http_port=free_port(), server_name="swarm-sim")
    return NatsServer(cfg).start()


def varz(server: NatsServer) -> dict:
    """The server's counters (monitoring endpoint): messages, bytes, CPU, memory."""
    return server.monitor("varz")


@dataclass
class Proc:
    """A child process with its output lines queued (read by a thread, so the pipe never fills)."""

    name: str
    popen: subprocess.Popen
    lines: queue.Queue = field(default_factory=queue.Queue)

    @classmethod
    def start(cls, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
        env = {**os.environ, **ONE_THREAD, **(env or {})}
        err = open(log, "ab")
        popen = subprocess.Popen(  # run from the work dir: `python -m` puts its directory first on the path
            argv,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
            cwd=log.parent,
        )
        err.close()
        proc = cls(name, popen)
        threading.Thread(target=proc._read, daemon=True).start()
        return proc

    def _read(self) -> None:
        assert self.popen.stdout is not None, "started with stdout=PIPE"
        for line in self.popen.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_line(self, pred, timeout: float) -> str:
        """The first output line satisfying ``pred``; SimError if the process ends or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SimError(Reason.NOT_READY, f"{self.name} did not get ready within {timeout:.0f}s")
            try:
                line = self.lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                raise SimError(Reason.EXITED, f"{self.name} exited with code {self.popen.wait()} before it was ready")
            if pred(line):
                return line

    def stop(self, timeout: float = 15.0) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)

    def kill(self) -> None:
        """SIGKILL: the process dies without a word (a crashed tracker)."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(5)


def tracker_argv(url: str, expiry: float, extra: list[str], profile: Path | None = None) -> list[str]:
    """``neuron-bus tracker``; under cProfile (stats written to ``profile`` when it stops) if asked."""
    prefix = ["-m", "cProfile", "-o", str(profile)] if profile else []
    return [sys.executable, *prefix, "-m", "neuron_bus", "tracker", "--nats", url, "--expiry", str(expiry), *extra]


def start_tracker(
    index: int,
    url: str,
    expiry: float,
    extra: list[str],
    workdir: Path,
    profile_dir: Path | None = None,
    pythonpath: str | None = None,
) -> Proc:
    """``pythonpath``: run the tracker of another checkout (to compare versions)."""
    profile = profile_dir / f"tracker-{index}.prof" if profile_dir else None
    argv = tracker_argv(url, expiry, extra, profile)
    env = {"PYTHONPATH": pythonpath} if pythonpath else None
    proc = Proc.start(f"tracker {index}", argv, workdir / f"tracker-{index}.log", env)
    proc.wait_line(lambda line: "tracker ready" in line, 60)
    return proc


class Usage:
    """CPU seconds and memory of a set of processes between ``start`` and ``stop``."""

    def __init__(self, pids: dict[str, int]):
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.cpu0: dict[str, tuple[float, float]] = {}
        self.peak_rss: dict[str, int] = dict.fromkeys(self.procs, 0)
        self.t0 = 0.0

    @staticmethod
    def _cpu(p: psutil.Process) -> tuple[float, float]:
        """Its own CPU and its reaped children's (a tracker's forked coverage builds)."""
        t = p.cpu_times()
        return t.user + t.system, t.children_user + t.children_system

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.cpu0 = {name: self._cpu(p) for name, p in self.procs.items()}
        self.sample()

    def sample(self) -> None:
        for name, p in self.procs.items():
            try:
                self.peak_rss[name] = max(self.peak_rss[name], p.memory_info().rss)
            except psutil.Error:
                pass

    def stop(self) -> dict[str, dict[str, float]]:
        """name -> {"cpu_share": CPU seconds per second (1.0 = one core), its children included,
        "children_cpu_share": the children's part, "rss_mb": peak}."""
        elapsed = max(time.monotonic() - self.t0, 1e-6)
        out = {}
        for name, p in self.procs.items():
            try:
                own, children = (now - then for now, then in zip(self._cpu(p), self.cpu0[name]))
            except psutil.Error:
                own = children = float("nan")  # it died (killed on purpose)
            out[name] = {
                "cpu_share": round((own + children) / elapsed, 4),
                "children_cpu_share": round(children / elapsed, 4),
                "rss_mb": round(self.peak_rss[name] / 2**20, 1),
            }
        return out
