"""Watching a local swarm's children (`neuron-bus up`): nothing dies silently.

A child that exits is reported at once, with its name, how it ended and the last lines of its
log. Workers and the tracker are restarted, with a backoff that doubles while they keep dying
soon after a start (a worker rejoins the swarm and announces itself again; the tracker rebuilds
its registry from the KV bucket and heartbeats). A dead nats-server or gateway cannot be
replaced under the clients that use it: the swarm stops, saying why.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

RESTARTABLE = ("worker", "tracker", "auditor")
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 30.0  # a child up this long has recovered: its backoff starts over


def how_it_ended(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


@dataclass
class Report:
    """What happened to one child; ``fatal``: the swarm cannot go on."""

    message: str
    fatal: bool = False


@dataclass
class _Restart:
    backoff: float = FIRST_BACKOFF_S
    due: float = 0.0  # when to start it again (0: not waiting)
    started: float = field(default_factory=time.monotonic)


class Supervisor:
    def __init__(self, swarm):
        self.swarm = swarm
        self._restarts: dict[str, _Restart] = {}

    def check(self) -> list[Report]:
        """Look at every child once: report the ones that exited, restart the ones that are due."""
        now = time.monotonic()
        out = [
            Report(
                f"nats-server {srv.url} {how_it_ended(srv.proc.returncode)}: {srv.log_tail()}; the swarm stops", True
            )
            for srv in self.swarm.servers
            if srv.proc is not None and srv.proc.poll() is not None
        ]
        for name, proc in list(self.swarm.procs.items()):
            r = self._restarts.setdefault(name, _Restart())
            if proc.poll() is None:
                if now - r.started > STABLE_S:
                    r.backoff = FIRST_BACKOFF_S
                continue
            if r.due == 0.0:
                out.append(self._exited(name, proc.returncode, r, now))
            elif now >= r.due:
                self.swarm.respawn(name)
                r.due, r.started = 0.0, now
                out.append(Report(f"{name} restarted"))
        return out

    def _exited(self, name: str, returncode: int, r: _Restart, now: float) -> Report:
        tail = self.swarm.log_tail(name, 5)
        ended = f"{name} {how_it_ended(returncode)}; last log lines: {tail or '(none)'}"
        if not name.startswith(RESTARTABLE):
            return Report(f"{ended}; the swarm stops", True)
        r.due = now + r.backoff
        wait, r.backoff = r.backoff, min(r.backoff * 2, MAX_BACKOFF_S)
        return Report(f"{ended}; restarting it in {wait:.0f}s")
