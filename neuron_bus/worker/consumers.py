"""The JetStream consumers a worker binds for each route it serves: the hop's prefill and decode
subjects, each a push consumer with explicit acks.

Decode steps may be many in flight (one per decoding session); prefill chunks few (the prefill
subject's window, topology.py, by default): that window, and the acknowledgement of an input only
once its output was accepted downstream, are what hold a slow hop's upstream. A
work-queue stream allows one consumer per subject: binding first deletes consumers left on it by
an earlier binding or a previous run of this node. Every received message becomes an `Incoming`
on the phase's queue, its handle held (holds.py) until the worker settles it.

With a per-node credential (``secret``: derived from the node's key) a consumer's name is a MAC of
its subject: the node finds its own leftovers again after a restart without listing the stream's
consumers (its credential may not), and no other node can guess the name to delete or ack it.
Without one, consumers are named by the server and leftovers are found by listing.

Over a WAN each JetStream API call is a round trip to the server: a binding creates both phases'
consumers at once and looks for leftovers only when the server refuses one (a work-queue stream's
subject already taken), an unbinding deletes both at once; so a session open pays one round trip
here, not four. Bindings and unbindings of one route run one at a time (a close's unbinding must
not delete what a concurrent open on the same route has just bound).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.timing import ACK_WAIT_S
from neuron_bus.worker.engine import Incoming
from neuron_bus.worker.holds import Holds

INACTIVE_S = 30.0  # the server removes a consumer nobody is bound to after this long
SUBJECT_TAKEN = 10100  # JSConsumerWQConsumerNotUniqueErr: another consumer filters the subject


class RouteConsumers:
    def __init__(
        self,
        js,
        deliver: Callable[[str, Incoming], None],
        decode_ack_pending: int,
        prefill_ack_pending: int,
        holds: Holds,
        secret: bytes | None = None,
        ack_wait: float = ACK_WAIT_S,
    ):
        self.js = js
        self.secret = secret
        self.holds = holds  # what was delivered and is not settled
        self.ack_wait = ack_wait
        self.deliver = deliver  # (phase, message): queue it for the engine
        self.decode_ack_pending = decode_ack_pending
        self.prefill_ack_pending = prefill_ack_pending
        self._bound: dict[
            str, list[tuple[JetStreamContext.PushSubscription, str, str]]
        ] = {}  # route -> (subscription, stream, subject)
        self._locks: dict[str, asyncio.Lock] = {}  # route -> its bindings and unbindings, one at a time

    async def bind(self, route: M.RouteAssignment, hop_index: int) -> None:
        async with self._lock(route.route_id):
            if route.route_id in self._bound:
                return
            phases = (
                ("decode", S.STREAM_DECODE, self.decode_ack_pending),
                ("prefill", S.STREAM_PREFILL, self.prefill_ack_pending),
            )
            node = route.hops[hop_index].node_id
            results = await asyncio.gather(
                *(
                    self._consume(phase, stream, S.hop_inputs(node, route.route_id, hop_index, phase), pending)
                    for phase, stream, pending in phases
                ),
                return_exceptions=True,
            )
            subs = [r for r in results if not isinstance(r, BaseException)]
            if len(subs) < len(results):  # all or nothing: a half-bound route would take one phase only
                await self._release(subs)
                raise next(r for r in results if isinstance(r, BaseException))
            self._bound[route.route_id] = subs

    async def unbind(self, route_id: str, unless: Callable[[], bool] | None = None) -> None:
        """Delete the route's consumers, unless ``unless()`` (asked once this route's other bindings
        and unbindings are done: has a session on it been opened meanwhile?)."""
        lock = self._lock(route_id)
        async with lock:
            if unless is not None and unless():
                return
            await self._release(self._bound.pop(route_id, []))
        if not lock.locked() and route_id not in self._bound and self._locks.get(route_id) is lock:
            del self._locks[route_id]  # nobody waits for it: the route is gone here

    async def unbind_all(self) -> None:
        for route_id in list(self._bound):
            await self.unbind(route_id)

    def name(self, subject: str) -> str | None:
        """The consumer's name: a MAC of its subject under the node's secret (None: the server names it)."""
        if self.secret is None:
            return None
        return hashlib.blake2b(subject.encode(), key=self.secret, digest_size=12).hexdigest()

    def _lock(self, route_id: str) -> asyncio.Lock:
        return self._locks.setdefault(route_id, asyncio.Lock())

    async def _consume(
        self, phase: str, stream: str, subject: str, pending: int
    ) -> tuple[JetStreamContext.PushSubscription, str, str]:
        """A push consumer on ``subject`` and this node's subscription to it."""

        async def received(msg: Msg) -> None:
            self.deliver(phase, Incoming(self.holds.hold(msg), msg.headers, msg.data))

        name = self.name(subject)
        config = ConsumerConfig(
            name=name,
            filter_subject=subject,
            deliver_subject=self.js._nc.new_inbox(),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            max_ack_pending=pending,
            ack_wait=self.ack_wait,
            inactive_threshold=INACTIVE_S,
        )
        try:
            info = await self.js.add_consumer(stream, config)
        except APIError as exc:
            if exc.err_code != SUBJECT_TAKEN:
                raise
            await self._drop(stream, subject, name)
            info = await self.js.add_consumer(stream, config)
        sub = await self.js.subscribe_bind(
            stream, config, info.name, cb=received, manual_ack=True, pending_msgs_limit=-1
        )
        return sub, stream, subject

    async def _release(self, subs: list[tuple[JetStreamContext.PushSubscription, str, str]]) -> None:
        async def one(sub, stream: str, subject: str) -> None:
            try:
                await sub.unsubscribe()
                await self._drop(stream, subject, self.name(subject))
            except Exception:  # connection already closing
                pass

        await asyncio.gather(*(one(*s) for s in subs))

    async def _drop(self, stream: str, subject: str, name: str | None) -> None:
        """Delete consumers left on ``subject`` (by an earlier binding or a previous run of this node)."""
        if name is not None:
            try:
                await self.js.delete_consumer(stream, name)
            except Exception:  # none left
                pass
            return
        for info in await self.js.consumers_info(stream):
            if info.config.filter_subject == subject:
                try:
                    await self.js.delete_consumer(stream, info.name)
                except Exception:  # already gone
                    pass
