"""A leader lease on a JetStream KV key: one holder at a time, handed over when it stops renewing.

The key lives in a bucket whose entries expire ``ttl`` seconds after they were written (the
bucket's max age: KV ``neuron-leases``, created by topology.py). A contender takes the lease
with ``create`` (succeeds only if the key does not exist: nobody holds it, or the holder let it
expire); the holder renews it every ``ttl / 3`` with ``update`` at the revision it last wrote
(fails if anyone else wrote since). The server is the arbiter; no clocks are compared.

The holder counts its lease as valid until ``ttl`` after it *sent* its last successful write:
the server expires the key ``ttl`` after it *stored* it, later, so no two holders overlap while
their clocks run at the same rate. A holder that cannot reach the server loses the lease at
that deadline, whatever it believes. ``token`` (the revision of the holder's last write) grows
with every write and every change of holder: a fencing token for decisions made under the
lease. Stopping releases the key at once (a delete at the held revision), so another contender
takes over within one retry instead of waiting for the expiry.

Use it for decisions that must be made by one process at a time (placement, issue 17):

    lease = Lease(js, S.KV_LEASES, "placement", holder="tracker-3f2a")
    await lease.start()
    ...
    if lease.held:
        decide(fencing=lease.token)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import nats.errors
import nats.js.errors as jserr
from nats.js.kv import KeyValue

from neuron_bus import messages
from neuron_bus.errors import NeuronBusError
from neuron_bus.messages import LeaseRecord
from neuron_bus.tasks import cancel_and_wait
from workers.errors import Reason

log = logging.getLogger("neuron_bus.lease")


class LeaseError(NeuronBusError):
    """The lease cannot be used: its bucket is missing or has no expiry."""


class Lease:
    def __init__(
        self,
        js,
        bucket: str,
        key: str,
        holder: str,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.js, self.bucket, self.key, self.holder = js, bucket, key, holder
        self.on_change = on_change
        self.clock = clock
        self.ttl = 0.0
        self.token: int | None = None  # revision of our last successful write while we hold it
        self._valid_until = 0.0
        self._since = 0.0
        self._kv: KeyValue | None = None
        self._task: asyncio.Task | None = None
        self._busy = asyncio.Lock()

    @property
    def held(self) -> bool:
        return self.token is not None and self.clock() < self._valid_until

    @property
    def kv(self) -> KeyValue:
        assert self._kv is not None, "the lease has not been opened"
        return self._kv

    async def open(self) -> None:
        try:
            self._kv = await self.js.key_value(self.bucket)
            status = await self.kv.status()
        except (jserr.BucketNotFoundError, jserr.NotFoundError) as exc:
            raise LeaseError(
                Reason.MISSING_BUCKET, f"lease bucket {self.bucket} not found: provision the server"
            ) from exc
        self.ttl = status.ttl or 0.0
        if self.ttl <= 0:
            raise LeaseError(Reason.NO_TTL, f"lease bucket {self.bucket} has no max age: a lease would never expire")

    async def start(self) -> None:
        """Open the bucket, try once at once, then keep trying (or renewing) in the background."""
        await self.open()
        await self.step()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            await self.step()

    def _value(self, now_wall: float) -> bytes:
        since = self._since if self.token is not None else now_wall
        return messages.encode(LeaseRecord(holder=self.holder, since=since, renewed=now_wall))

    async def step(self) -> bool:
        """One attempt: renew the lease if we hold it, else try to take it. Returns ``held``."""
        async with self._busy:  # one write at a time; stop() waits for it (the token must be ours)
            return await self._step()

    async def _step(self) -> bool:
        if self._kv is None:
            await self.open()
        was = self.held
        sent = self.clock()
        wall = time.time()
        try:
            if self.token is not None:
                self.token = await self.kv.update(self.key, self._value(wall), last=self.token)
            else:
                self.token = await self.kv.create(self.key, self._value(wall))
                self._since = wall
            self._valid_until = sent + self.ttl
        except jserr.KeyWrongLastSequenceError:
            self.token = None  # someone else holds it (or took it after ours expired)
        except (jserr.Error, nats.errors.Error, TimeoutError) as exc:
            log.debug("lease %s/%s: no answer from the server (%s)", self.bucket, self.key, exc)
            if not self.held:
                self.token = None  # past our deadline: whatever we wrote has expired
        now = self.held
        if now != was:
            log.info("lease %s/%s %s by %s", self.bucket, self.key, "taken" if now else "lost", self.holder)
            if self.on_change:
                self.on_change(now)
        return now

    async def holder_now(self) -> LeaseRecord | None:
        """Who holds the lease according to the bucket (None: nobody)."""
        try:
            entry = await self.kv.get(self.key)
        except (jserr.KeyNotFoundError, jserr.KeyDeletedError):
            return None
        if not entry.value:
            return None
        return messages.decode(entry.value, LeaseRecord)

    async def stop(self) -> None:
        """Stop renewing and release the lease if we hold it."""
        async with self._busy:  # not in the middle of a renewal: our token is the key's revision
            await cancel_and_wait(self._task)
            self._task = None
            await self._release()

    async def _release(self) -> None:
        if self.token is not None and self.held:
            try:
                await self.kv.delete(self.key, last=self.token)
            except (jserr.Error, nats.errors.Error, TimeoutError):
                pass  # it expires by itself
        was = self.held
        self.token = None
        if was and self.on_change:
            self.on_change(False)
