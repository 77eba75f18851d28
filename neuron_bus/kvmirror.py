"""A live local copy of a KV bucket, kept by one watcher for the life of its reader.

Reading a bucket with ``kv.keys()`` and a ``get`` per key costs a new server-side consumer on
every read, each left for nats-py's 5-minute inactivity threshold: polled every second (as the
tracker polled ``neuron-flags``), that is some 300 consumers and 1,500 server subscriptions
lingering at any time. A `KVMirror` watches the bucket once (an ordered consumer), applies every
update as it comes, and starts over every ``refresh_s`` (deleting its old consumer) so that a
watcher a failover left silent costs at most that much staleness. Values that do not decode as
``kind`` are skipped (anyone who may write the bucket may write garbage).
"""

from __future__ import annotations

import asyncio
import logging

import nats
import nats.js.errors as jserr

from neuron_bus import messages as M
from neuron_bus.errors import MalformedMessage
from neuron_bus.tasks import cancel_and_wait

log = logging.getLogger("neuron_bus.kv")

REFRESH_S = 300.0
RETRY_S = 1.0


class KVMirror:
    def __init__(self, js, bucket: str, kind, refresh_s: float = REFRESH_S):
        self.js = js
        self.bucket = bucket
        self.kind = kind
        self.refresh_s = refresh_s
        self.values: dict[str, object] = {}
        self.version = 0  # bumped on every change: readers cache what they derive from the values
        self.ready = asyncio.Event()  # the bucket's values as of the first watch are in
        self._task: asyncio.Task | None = None

    async def start(self, wait: float = 5.0) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-mirror-{self.bucket}")
        try:
            await asyncio.wait_for(self.ready.wait(), wait)
        except TimeoutError:
            log.warning("KV %s: not read within %.0fs; going on without it for now", self.bucket, wait)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while True:
            try:
                await self._watch()
            except asyncio.CancelledError:
                raise
            except (nats.errors.Error, jserr.Error, OSError) as exc:
                log.debug("KV %s watch failed: %s", self.bucket, exc)
                await asyncio.sleep(RETRY_S)

    async def _watch(self) -> None:
        """One watcher: the current values, then every update, for ``refresh_s``."""
        kv = await self.js.key_value(self.bucket)
        watcher = await kv.watchall()
        seen: dict[str, object] = {}
        initial = True
        loop = asyncio.get_running_loop()
        until = loop.time() + self.refresh_s
        try:
            while (left := until - loop.time()) > 0:
                try:
                    entry = await watcher.updates(timeout=min(left, 5.0))
                except nats.errors.TimeoutError:
                    continue
                if entry is None:  # the end of the values present when the watch began
                    if initial:
                        self._replace(seen)
                        initial = False
                    continue
                self._apply(seen if initial else None, entry)
        finally:
            await self._close(watcher)

    def _apply(self, into: dict | None, entry) -> None:
        target = self.values if into is None else into
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            target.pop(entry.key, None)
        else:
            try:
                target[entry.key] = M.decode(entry.value, self.kind)
            except MalformedMessage:
                target.pop(entry.key, None)
        if into is None:
            self.version += 1

    def _replace(self, values: dict) -> None:
        self.values = values
        self.version += 1
        self.ready.set()

    async def _close(self, watcher) -> None:
        name = getattr(watcher._sub, "_consumer", None)
        try:
            await watcher.stop()
            if name:
                await self.js.delete_consumer(f"KV_{self.bucket}", name)
        except Exception:  # already gone, or the connection is
            pass
