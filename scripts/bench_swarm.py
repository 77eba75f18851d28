"""The self-organizing swarm's two figures for scripts/bench (issue 17), on real processes:

- ``swarm_time_to_coverage_s``: three workers started with ``--layers auto --max-layers 20``,
  from the moment they are spawned (the tracker and the shard swarm already up) until the
  tracker's coverage map has every layer covered by a ready node;
- ``swarm_recovery_s``: the only worker holding the tail layers killed, until the map is whole
  again without it (a replica moved there: drained, fetched its slice, loaded, announced).
"""

from __future__ import annotations

import time
from pathlib import Path

from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.tracker.layers import uncovered_runs

POLL_S = 0.25


def measure(model_path: Path, threads: int, work: Path, n_layers: int = 30, timeout: float = 300) -> dict:
    extra = {i: ["--max-layers", "20"] for i in range(3)}
    swarm = LocalSwarm(model_path, workdir=work / "swarm", threads=threads, auto_workers=3, worker_extra=extra)
    spawned: list[float] = []
    swarm.start(
        on_step=lambda text: spawned.append(time.monotonic()) if text.startswith("worker") and not spawned else None
    )
    try:
        deadline = time.monotonic() + timeout
        while not swarm.covered(n_layers):
            if time.monotonic() > deadline:
                raise RuntimeError(f"3 auto workers did not cover the model within {timeout:.0f}s")
            time.sleep(POLL_S)
        covered = time.monotonic() - spawned[0]
        held = swarm.ready_ranges()
        tail = next(node for node, (a, b) in held.items() if b == n_layers)
        killed = time.monotonic()
        swarm.kill(tail)
        deadline = killed + timeout
        while time.monotonic() < deadline:
            now = swarm.ready_ranges()
            if tail not in now and not uncovered_runs(now.values(), n_layers):
                break
            time.sleep(POLL_S)
        recovered = time.monotonic() - killed
    finally:
        swarm.stop()
    return {"swarm_time_to_coverage_s": covered, "swarm_recovery_s": recovered}
