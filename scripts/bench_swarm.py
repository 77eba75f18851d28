"""The self-organizing swarm's two figures for scripts/bench (issue 17), on real processes:

- ``swarm_time_to_coverage_s``: three workers started with ``--layers auto --max-layers 20``,
  from the moment they are spawned (the tracker and the shard swarm already up) until the
  tracker's coverage map has every layer covered by a ready node;
- ``swarm_recovery_s``: the only worker holding the tail layers killed, until the map is whole
  again without it (a replica moved there: drained, fetched its slice, loaded, announced).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm

POLL_S = 0.25


def ready_ranges(swarm: LocalSwarm) -> dict[str, tuple[int, int]]:
    async def probe():
        async with await NeuronClient.connect(swarm.url) as c:
            report = await c.coverage(swarm.preset)
            return {n.node_id: (n.layer_start, n.layer_end) for n in report.nodes if n.alive and n.status == "ready"}

    return asyncio.run(probe())


def whole(held: dict[str, tuple[int, int]], n_layers: int) -> bool:
    return set().union(*(set(range(a, b)) for a, b in held.values())) >= set(range(n_layers)) if held else False


def measure(model_path: Path, threads: int, work: Path, n_layers: int = 30, timeout: float = 300) -> dict:
    extra = {i: ["--max-layers", "20"] for i in range(3)}
    swarm = LocalSwarm(model_path, workdir=work / "swarm", threads=threads, auto_workers=3, worker_extra=extra)
    spawned: list[float] = []
    swarm.start(
        on_step=lambda text: spawned.append(time.monotonic()) if text.startswith("worker") and not spawned else None
    )
    try:
        while not whole(ready_ranges(swarm), n_layers):
            time.sleep(POLL_S)
        covered = time.monotonic() - spawned[0]
        held = ready_ranges(swarm)
        tail = next(node for node, (a, b) in held.items() if b == n_layers)
        killed = time.monotonic()
        swarm.kill(tail)
        deadline = killed + timeout
        while time.monotonic() < deadline:
            now = ready_ranges(swarm)
            if tail not in now and whole(now, n_layers):
                break
            time.sleep(POLL_S)
        recovered = time.monotonic() - killed
    finally:
        swarm.stop()
    return {"swarm_time_to_coverage_s": covered, "swarm_recovery_s": recovered}
