"""The tracker's placement service: which layers a joining node serves, and which node moves.

- A worker started with ``--layers auto`` asks on ``neuron.tracker.place`` (PlacementRequest: its
  model or "any", and what it can hold). Of the published models (catalog.py) it is given the
  one whose weakest layer needs it most, and in it the range that raises the swarm's bottleneck
  most within what fits its memory and loads (placement.py, artifacts/cuts.py).
- Every `RECHECK_S` the swarm is looked at again: at once when a layer has no live node (a node
  was lost), every `REBALANCE_S` otherwise, the node whose move helps most is asked to move
  (MoveRange on its control subject); it drains, loads the new range and announces it.
- One decision at a time: only the holder of the ``placement`` lease (neuron_bus/lease.py)
  answers requests and plans moves, so two trackers never hand the same gap to two nodes.
  Decisions not yet announced by their node are kept in KV ``neuron-placements`` (they expire
  after the bucket's max age), so a tracker that restarts, or takes the lease over, sees them.
- Every decision and its reason is published on ``neuron.placement.decisions`` and kept for the
  coverage map (the last `KEEP_DECISIONS`).

Complexity: a request costs O(models · n²) for n layers (placement.choose_range); a rebalancing
check O(models · auto nodes · n²).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from nats.js.kv import KeyValue

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.artifacts import cuts
from neuron_bus.artifacts.catalog import Catalog
from neuron_bus.artifacts.footprint import footprint
from neuron_bus.errors import MalformedMessage
from neuron_bus.lease import Lease
from neuron_bus.tasks import cancel_and_wait
from neuron_bus.tracker.placement import (
    UNMEASURED_SECONDS_PER_LAYER,
    Fit,
    Picture,
    Placed,
    bottleneck,
    choose_range,
    plan_move,
)
from neuron_bus.tracker.view import NodeView

log = logging.getLogger("neuron_bus.tracker.placer")

RECHECK_S = 2.0
REBALANCE_S = 15.0
KEEP_DECISIONS = 20
MOVE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PlacementParams:
    recheck_s: float = RECHECK_S
    rebalance_s: float = REBALANCE_S
    min_stay_s: float = 60.0
    gain: float = 1.25


def node_fit(manifest: M.ArtifactManifest, fit: M.NodeFit) -> Fit:
    fp = footprint(manifest, fit.kv_positions)
    return Fit(fit.max_layers, fit.memory_budget, fp.layer_bytes, fp.head_bytes, fp.embd_bytes)


def loadable_in(manifest: M.ArtifactManifest) -> Callable[[int, int], bool]:
    """Whether a range of this model loads as a slice (artifacts/cuts.py)."""
    return functools.partial(cuts.loadable, manifest.cache_descriptor.layer_kinds)


def picture_of(
    views: Sequence[NodeView], manifest: M.ArtifactManifest, pending: dict[str, M.PlacementDecision]
) -> Picture:
    """The model's live nodes, each at the range it serves or has been given and not announced yet."""
    n = manifest.cache_descriptor.n_layers
    mine = [v for v in views if v.caps.model_preset == manifest.model_preset and v.caps.n_layers_total == n]
    measured = sorted(1.0 / (v.decode_tps * v.n_layers) for v in mine if v.decode_tps and v.usable)
    default = measured[len(measured) // 2] if measured else UNMEASURED_SECONDS_PER_LAYER

    def spl(v: NodeView) -> float:  # seconds per layer per token; a node not measured yet costs the median
        return 1.0 / (v.decode_tps * v.n_layers) if v.decode_tps else default

    pic, seen = Picture(n), set()
    for v in mine:
        d = pending.get(v.node_id)
        if d is not None and d.model_preset == manifest.model_preset and v.alive:
            pic.nodes.append(Placed(v.node_id, d.layer_start, d.layer_end, spl(v), d.decided_at))
            seen.add(v.node_id)
        elif v.usable:
            pic.nodes.append(Placed(v.node_id, v.layer_start, v.layer_end, spl(v), v.caps.started_at))
            seen.add(v.node_id)
    for d in pending.values():  # given a range, still loading: it will be there
        if d.node_id not in seen and d.model_preset == manifest.model_preset:
            pic.nodes.append(Placed(d.node_id, d.layer_start, d.layer_end, default, d.decided_at))
    return pic


class Placer:
    def __init__(
        self,
        nc,
        views: Callable[[], Sequence[NodeView]],
        tracker_id: str,
        lease: Lease,
        params: PlacementParams | None = None,
        self_placed: Callable[[], bool] = lambda: True,
    ):
        self.nc, self.js = nc, nc.jetstream()
        self.views = views
        self.self_placed = self_placed  # whether any node places itself (False: no views to build for moves)
        self.tracker_id = tracker_id
        self.params = params or PlacementParams()
        self.catalog = Catalog(self.js)
        self.lease = lease  # started and stopped by its owner (the tracker service)
        self.decisions: deque[M.PlacementDecision] = deque(maxlen=KEEP_DECISIONS)
        self._lock = asyncio.Lock()
        self._kv: KeyValue | None = None
        self._sub = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._kv = await self.js.key_value(S.KV_PLACEMENTS)
        self._sub = await self.nc.subscribe(S.TRACKER_PLACE, cb=self._on_request)
        self._task = asyncio.create_task(self._loop(), name="placement")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        if self._sub is not None:
            await self._sub.unsubscribe()

    # ------------------------------------------------------------------ joining nodes

    async def _on_request(self, msg) -> None:
        if not self.lease.held:
            return  # the lease holder answers
        try:
            reply: M.PlacementReply = await self.place(M.decode(msg.data, M.PlacementRequest))
        except MalformedMessage as exc:
            reply = M.PlacementRejection(node_id="", reasons=[f"malformed placement request: {exc}"])
        if msg.reply:
            await msg.respond(M.encode(reply))

    async def place(self, req: M.PlacementRequest) -> M.PlacementReply:
        if why := M.protocol_mismatch("this tracker", "the node", req.protocol):  # it would load a range never routed
            return M.PlacementRejection(node_id=req.node_id, reasons=[why])
        async with self._lock:
            manifests = await self.catalog.models(req.model_preset, fresh=True)
            if not manifests:
                what = "any model" if req.model_preset == "any" else f"model {req.model_preset}"
                why = f"no published artifact of {what}: publish one with `neuron-bus artifact publish`"
                return M.PlacementRejection(node_id=req.node_id, reasons=[why])
            views = self.views()
            pending = await self.pending(views)
            options = []
            for m in manifests:
                pic = picture_of(views, m, pending)
                d = choose_range(pic, req.node_id, node_fit(m, req.fit), loadable_in(m))
                if d is not None:
                    options.append((bottleneck(pic.capacity()), m, d))
            if not options:
                return M.PlacementRejection(
                    node_id=req.node_id, reasons=["no layer range of a published model fits this node"]
                )
            _, m, d = min(options, key=lambda o: o[0])  # the model whose weakest layer needs it most
            return await self._record(m, d.node_id, d.layer_start, d.layer_end, d.reason, "join", d)

    # ------------------------------------------------------------------ moves

    async def _loop(self) -> None:
        last_full = 0.0
        while True:
            await asyncio.sleep(self.params.recheck_s)
            if not self.lease.held:
                continue
            now = time.monotonic()
            full = now - last_full >= self.params.rebalance_s
            try:
                await self.rebalance(full)
            except Exception:
                log.exception("placement: rebalancing failed")
            last_full = now if full else last_full

    async def rebalance(self, full: bool = True) -> M.PlacementDecision | None:
        """Ask one node to move when that helps (at once when a layer is uncovered; else if ``full``)."""
        if not self.self_placed():  # O(1): a swarm of 10,000 nodes placed by hand builds no views
            return None
        async with self._lock:
            views = self.views()
            movable = {v.node_id: v.caps.fit for v in views if v.caps.placement == "auto" and v.caps.fit and v.usable}
            if not movable:  # only self-placed nodes move: nothing to plan, nothing to read
                return None
            pending = await self.pending(views)
            for m in await self.catalog.models():
                pic = picture_of(views, m, pending)
                gaps = any(c <= 0 for c in pic.capacity())
                if not pic.nodes or not (gaps or full):
                    continue
                fits = {node: node_fit(m, fit) for node, fit in movable.items() if node not in pending}
                move = plan_move(
                    pic, fits, time.time(), loadable_in(m), self.params.gain, 0.0 if gaps else self.params.min_stay_s
                )
                if move is not None and await self._ask(move.node_id, m, move.layer_start, move.layer_end, move.reason):
                    return await self._record(
                        m, move.node_id, move.layer_start, move.layer_end, move.reason, "move", move
                    )
        return None

    async def _ask(self, node_id: str, m: M.ArtifactManifest, start: int, end: int, reason: str) -> bool:
        req = M.MoveRange(
            model_preset=m.model_preset, artifact_id=m.artifact_id, layer_start=start, layer_end=end, reason=reason
        )
        try:
            msg = await self.nc.request(S.node_move(node_id), M.encode(req), timeout=MOVE_TIMEOUT_S)
            reply = M.decode(msg.data, M.ControlReply)
        except Exception as exc:
            log.warning("placement: %s did not take the move to %d-%d: %s", node_id, start, end - 1, exc)
            return False
        if not isinstance(reply, M.MoveAccepted):
            log.warning("placement: %s refused the move to %d-%d: %s", node_id, start, end - 1, reply)
            return False
        return True

    # ------------------------------------------------------------------ the record

    @property
    def kv(self) -> KeyValue:
        assert self._kv is not None, "the placer has not started"
        return self._kv

    async def pending(self, views: Sequence[NodeView]) -> dict[str, M.PlacementDecision]:
        """Decisions whose node has not announced its range yet (KV neuron-placements); the ones
        a node of ``views`` announced are deleted."""
        out: dict[str, M.PlacementDecision] = {}
        try:
            keys = await self.kv.keys()
        except Exception:  # an empty bucket
            return out
        announced = {(v.node_id, v.layer_start, v.layer_end) for v in views if v.alive}
        for key in keys:
            try:
                entry = await self.kv.get(key)
                d = M.decode(entry.value, M.PlacementDecision)
            except Exception:
                continue
            if (d.node_id, d.layer_start, d.layer_end) in announced:
                await self.kv.delete(key)  # done: the node serves it
            else:
                out[d.node_id] = d
        return out

    async def _record(
        self, m: M.ArtifactManifest, node_id: str, start: int, end: int, reason: str, kind: Literal["join", "move"], d
    ) -> M.PlacementDecision:
        decision = M.PlacementDecision(
            node_id=node_id, model_preset=m.model_preset, artifact_id=m.artifact_id, layer_start=start, layer_end=end,
            reason=reason, kind=kind, bottleneck_before=round(d.bottleneck_before, 3),
            bottleneck_after=round(d.bottleneck_after, 3), decided_at=time.time(), tracker_id=self.tracker_id,
        )  # fmt: skip
        await self.kv.put(node_id, M.encode(decision))
        self.decisions.append(decision)
        await self.nc.publish(S.PLACEMENT_DECISIONS, M.encode(decision))
        log.info("placement: %s -> %s layers %d-%d (%s)", node_id, m.model_preset, start, end - 1, reason)
        return decision
