"""A self-placed worker changing its layer range when the tracker asks (MoveRange).

The move never costs a running session: the worker stops taking new ones (its heartbeats say
``draining``, so routes avoid it, and a session open is refused with ``draining``), lets the
running ones finish, and only then fetches and loads the new range, switches every part of its
shell over (WorkerService.take_range), announces its new capability report and serves again. A
session still open after `DRAIN_TIMEOUT_S` is failed explicitly (``node_moving``) before the
move, never dropped silently. A pinned worker (``--layers A-B``) refuses moves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from neuron_bus import messages as M
from neuron_bus.errors import NeuronBusError
from neuron_bus.tasks import Background
from workers.errors import Reason

log = logging.getLogger("neuron_bus.worker")

DRAIN_TIMEOUT_S = 600.0
DRAIN_POLL_S = 0.25

# (the move) -> (backend, tokenizer, capability report, owned layer work): fetch and load the new range
Reload = Callable[[M.MoveRange], Awaitable[tuple[object, object, M.CapabilityReport, float]]]


class Mover:
    def __init__(self, service, reload: Reload | None, drain_timeout: float = DRAIN_TIMEOUT_S):
        self.service = service
        self.reload = reload
        self.drain_timeout = drain_timeout
        self.moving: M.MoveRange | None = None
        self._task = Background()

    def accept(self, req: M.MoveRange) -> M.MoveAccepted:
        s = self.service
        if s.report.placement != "auto" or self.reload is None:
            raise NeuronBusError(
                Reason.PINNED, f"{s.node_id} serves layers given by its operator (--layers): it does not move"
            )
        if self.moving is not None:
            raise NeuronBusError(
                Reason.MOVING,
                f"{s.node_id} is already moving to layers {self.moving.layer_start}-{self.moving.layer_end - 1}",
            )
        self.moving = req
        s.engine.draining = True
        self._task.spawn(self._move(req), name="move")
        return M.MoveAccepted(
            node_id=s.node_id, layer_start=req.layer_start, layer_end=req.layer_end, sessions_draining=len(s.sessions)
        )

    async def _move(self, req: M.MoveRange) -> None:
        s = self.service
        try:
            await s.heartbeat.send(s.queue_depth)  # say "draining" now, not at the next beat
            await self._drain()
            assert self.reload is not None
            backend, tokenizer, report, work = await self.reload(req)
            old = s.engine.backend
            s.take_range(backend, tokenizer, report, work)
            await s.announce()
            await s.runner.call(old.close)  # after whatever the backend thread still runs on it (a self-benchmark)
            log.info(
                "worker %s: now serving %s layers %d-%d",
                s.node_id,
                report.model_preset,
                req.layer_start,
                req.layer_end - 1,
            )
        except Exception:
            log.exception(
                "worker %s: the move to layers %d-%d failed; serving the old range",
                s.node_id,
                req.layer_start,
                req.layer_end - 1,
            )
        finally:
            s.engine.draining = False
            self.moving = None
            await s.heartbeat.send(s.queue_depth)

    async def _drain(self) -> None:
        s, deadline = self.service, time.monotonic() + self.drain_timeout
        while len(s.sessions) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        for left in list(s.sessions):
            await s.outbox.fail(
                left, Reason.NODE_MOVING, "the node moves to other layers and its sessions did not finish"
            )

    async def stop(self) -> None:
        await self._task.cancel_all()
