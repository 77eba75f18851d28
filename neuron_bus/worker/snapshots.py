"""KV snapshots of a worker's sessions, for route repair.

Every ``every`` positions (when a session's position crosses a multiple of ``every`` in decode;
every hop sees every position, so all hops of a route snapshot at the same positions) the worker
exports the session's cache and writes it to the object bucket ``neuron-snapshots`` on the cache
server (``--snapshot-nats``, default the bus) as ``<session>/<layer_start>-<layer_end>/<position>``,
with a :class:`~neuron_bus.messages.SnapshotMeta` as the object's description.

Writes never block decode: the export is one quick backend call, the upload runs in the
background with a timeout, at most one per session at a time; any failure (cache server down,
its disk full, timeout, busy) is counted by reason and forgotten. The newest two snapshots of a
session are kept; closing the session deletes them (an upload still in flight finishes or fails,
counted, within its timeout, and what it wrote is deleted).

Restoring (the replacement node of a repaired route) picks the newest snapshot of the session at
or before a position whose metadata matches this node's model revision, backend, cache ABI and
layer range exactly; anything else is refused with a reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque

from nats.js.api import ObjectMeta
from nats.js.object_store import ObjectStore

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.errors import NeuronBusError
from neuron_bus.tasks import Background, cancel_and_wait
from neuron_bus.topology import connect, object_store
from neuron_bus.trust import sealing
from workers.errors import Reason

log = logging.getLogger("neuron_bus.worker.snapshots")

UPLOAD_TIMEOUT_S = 10.0
CONNECT_RETRY_S = 2.0
KEEP = 2  # newest snapshots kept per session and layer range
MAX_UPLOADS = 4  # concurrent uploads per worker


def object_prefix(session_id: str, layer_start: int, layer_end: int) -> str:
    return f"{S.check_token(session_id, 'session id')}/{layer_start}-{layer_end}/"


def object_name(meta: M.SnapshotMeta) -> str:
    return f"{object_prefix(meta.session_id, meta.layer_start, meta.layer_end)}{meta.position}"


class SnapshotStore:
    """Writes and restores one worker's snapshots; ``every`` 0 writes none (restores still work)."""

    def __init__(self, nc, report: M.CapabilityReport, metrics, *, url: str | None = None):
        self.report = report
        self.metrics = metrics
        self.url = url  # None: the bus connection ``nc``
        self._nc = None if url else nc
        self._store: ObjectStore | None = None
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._inflight: dict[str, asyncio.Task] = {}
        self._closed: set[str] = set()  # sessions closed while an upload of theirs is in flight
        self._kept: dict[str, deque[str]] = {}
        self._background = Background()
        self.written = 0
        self.failures: dict[str, int] = {}

    @property
    def store(self) -> ObjectStore:
        assert self._store is not None, "used before the snapshot store is ready"
        return self._store

    async def start(self) -> None:
        self._task = asyncio.create_task(self._open(), name="snapshot-store")

    async def stop(self) -> None:
        await cancel_and_wait(self._task, *self._inflight.values())
        await self._background.cancel_all()
        if self.url and self._nc is not None:
            try:
                await self._nc.close()
            except Exception:
                pass

    async def _open(self) -> None:
        """Connect (a separate cache server: retry until it answers) and make sure the bucket exists."""
        while True:
            try:
                if self._nc is None:
                    assert self.url is not None  # no bus connection given: a cache server's URL was
                    self._nc = await connect(self.url, name=f"neuron-snapshots-{self.report.node_id}")
                self._store = await object_store(self._nc.jetstream(), S.OBJ_SNAPSHOTS)
                self._ready.set()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("worker %s: snapshot store %s unavailable: %s", self.report.node_id, self.url or "bus", exc)
                await asyncio.sleep(CONNECT_RETRY_S)

    # ------------------------------------------------------------------ writing

    def failed(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1
        self.metrics.snapshot_failures.labels(reason).inc()

    def busy(self, session_id: str) -> bool:
        """True (and counted) when a write for this session cannot start now."""
        if not self._ready.is_set():
            self.failed("unavailable")
            return True
        if session_id in self._inflight or len(self._inflight) >= MAX_UPLOADS:
            self.failed("busy")
            return True
        return False

    def write(self, s, blob: bytes) -> None:
        """Upload ``blob`` (the session's exported cache) in the background, as the cache of the
        positions the tail chose (``s.verified``: a speculative step's drafts above it are dropped
        when the snapshot is restored)."""
        hop = s.hop
        meta = M.SnapshotMeta(
            generation_id=uuid.uuid4().hex,
            session_id=s.session_id,
            route_id=s.route.route_id,
            node_id=self.report.node_id,
            model_preset=s.route.model_preset,
            model_revision=self.report.model_revision,
            backend_id=self.report.backend_id,
            cache_abi=self.report.cache_abi,
            layer_start=hop.layer_start,
            layer_end=hop.layer_end,
            position=s.verified,
            n_ctx=s.open.n_ctx,
            nbytes=len(blob),
            created_at=time.time(),
        )
        if s.open.input_key:  # MAC'd (and sealed) under the hop's input key: trust/sealing.py
            blob = sealing.seal_snapshot(meta, blob, s.open.input_key, s.open.encrypt)
        task = asyncio.create_task(self._upload(meta, blob))
        sid = s.session_id
        self._inflight[sid] = task
        task.add_done_callback(lambda _t: self._uploaded(sid))

    def _uploaded(self, session_id: str) -> None:
        self._inflight.pop(session_id, None)
        self._closed.discard(session_id)

    async def _upload(self, meta: M.SnapshotMeta, blob: bytes) -> None:
        name = object_name(meta)
        try:
            await asyncio.wait_for(
                self.store.put(name, blob, meta=ObjectMeta(name=name, description=M.encode(meta).decode())),
                UPLOAD_TIMEOUT_S,
            )
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            self.failed("timeout")
            return
        except Exception as exc:
            log.info("worker %s: snapshot %s not written: %s", self.report.node_id, name, exc)
            self.failed("error")
            return
        self.written += 1
        self.metrics.snapshots_written.inc()
        if meta.session_id in self._closed:  # the session closed meanwhile: nothing will restore it
            self._background.spawn(self._delete(name))
            return
        kept = self._kept.setdefault(meta.session_id, deque())
        kept.append(name)
        while len(kept) > KEEP:
            self._background.spawn(self._delete(kept.popleft()))

    def forget(self, session_id: str) -> None:
        """The session closed: delete its snapshots (in the background, softly). An upload in
        flight is left to finish within its timeout, so a store that fails it is counted; what it
        wrote is deleted then."""
        if session_id in self._inflight:
            self._closed.add(session_id)
        for name in self._kept.pop(session_id, ()):
            self._background.spawn(self._delete(name))

    async def _delete(self, name: str) -> None:
        try:
            await asyncio.wait_for(self.store.delete(name), UPLOAD_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception:
            pass  # the bucket's max age removes it eventually

    # ------------------------------------------------------------------ restoring

    async def find(self, session_id: str, max_position: int, min_position: int = 0) -> tuple[M.SnapshotMeta, bytes]:
        """The newest compatible snapshot of ``session_id`` for this node's range in
        [min_position, max_position], with its blob; NeuronBusError(Reason.NO_SNAPSHOT) otherwise."""
        try:
            await asyncio.wait_for(self._ready.wait(), UPLOAD_TIMEOUT_S)
        except TimeoutError:
            raise NeuronBusError(
                Reason.NO_SNAPSHOT, f"snapshot store {self.url or 'on the bus'} is unavailable"
            ) from None
        r = self.report
        prefix = object_prefix(session_id, r.layer_start, r.layer_end)
        try:
            infos = await asyncio.wait_for(self.store.list(ignore_deletes=True), UPLOAD_TIMEOUT_S)
        except Exception:  # NotFoundError: an empty bucket
            infos = []
        found, refused = [], []
        for info in infos:
            if not info.name.startswith(prefix) or not info.description:
                continue
            try:
                meta = M.decode(info.description.encode(), M.SnapshotMeta)
            except NeuronBusError:
                refused.append(f"{info.name}: unreadable metadata")
                continue
            mismatch = [
                f"{k} {getattr(meta, k)!r} (this node: {want!r})"
                for k, want in (
                    ("model_revision", r.model_revision),
                    ("backend_id", r.backend_id),
                    ("cache_abi", r.cache_abi),
                    ("layer_start", r.layer_start),
                    ("layer_end", r.layer_end),
                )
                if getattr(meta, k) != want
            ]
            if mismatch:
                refused.append(f"{info.name}: {', '.join(mismatch)}")
            elif min_position <= meta.position <= max_position:
                found.append((meta.position, info.name, meta))
        if not found:
            why = f"; refused: {'; '.join(refused)}" if refused else ""
            raise NeuronBusError(
                Reason.NO_SNAPSHOT,
                f"no compatible snapshot of session {session_id} layers [{r.layer_start}, {r.layer_end}) "
                f"at positions {min_position}..{max_position}{why}",
            )
        _, name, meta = max(found, key=lambda f: f[0])
        result = await asyncio.wait_for(self.store.get(name), UPLOAD_TIMEOUT_S)
        blob = result.data or b""
        if len(blob) != meta.nbytes:
            raise NeuronBusError(
                Reason.NO_SNAPSHOT, f"snapshot {name} holds {len(blob)} bytes, its metadata says {meta.nbytes}"
            )
        return meta, blob
