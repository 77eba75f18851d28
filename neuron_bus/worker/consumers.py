"""The JetStream consumers a worker binds for each route it serves: the hop's prefill and decode
subjects, each a push consumer with explicit acks.

Decode steps may be many in flight (one per decoding session); prefill chunks few (the prefill
subject's window, topology.py, by default): that window, and the acknowledgement of an input only
once its output was accepted downstream, are what hold a slow hop's upstream. A
work-queue stream allows one consumer per subject: binding first deletes consumers left on it by
an earlier binding or a previous run of this node. Every received message becomes an `Incoming`
on the phase's queue.

With a per-node credential (``secret``: derived from the node's key) a consumer's name is a MAC of
its subject: the node finds its own leftovers again after a restart without listing the stream's
consumers (its credential may not), and no other node can guess the name to delete or ack it.
Without one, consumers are named by the server and leftovers are found by listing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.timing import ACK_WAIT_S
from neuron_bus.worker.engine import Incoming

INACTIVE_S = 30.0  # the server removes a consumer nobody is bound to after this long


class RouteConsumers:
    def __init__(
        self,
        js,
        deliver: Callable[[str, Incoming], None],
        decode_ack_pending: int,
        prefill_ack_pending: int,
        secret: bytes | None = None,
    ):
        self.js = js
        self.secret = secret
        self.deliver = deliver  # (phase, message): queue it for the engine
        self.decode_ack_pending = decode_ack_pending
        self.prefill_ack_pending = prefill_ack_pending
        self._bound: dict[
            str, list[tuple[JetStreamContext.PushSubscription, str, str]]
        ] = {}  # route -> (subscription, stream, subject)

    async def bind(self, route: M.RouteAssignment, hop_index: int) -> None:
        if route.route_id in self._bound:
            return
        subs = []
        for phase, stream, pending in (
            ("decode", S.STREAM_DECODE, self.decode_ack_pending),
            ("prefill", S.STREAM_PREFILL, self.prefill_ack_pending),
        ):

            async def received(msg: Msg, phase=phase) -> None:
                self.deliver(phase, Incoming(msg, msg.headers, msg.data))

            subject = S.hop_input(route.hops[hop_index].node_id, route.route_id, hop_index, phase)
            name = self.name(subject)
            await self._drop(stream, subject, name)
            sub = await self.js.subscribe(
                subject,
                stream=stream,
                cb=received,
                manual_ack=True,
                pending_msgs_limit=-1,
                config=ConsumerConfig(
                    name=name,
                    ack_policy=AckPolicy.EXPLICIT,
                    deliver_policy=DeliverPolicy.ALL,
                    max_ack_pending=pending,
                    ack_wait=ACK_WAIT_S,
                    inactive_threshold=INACTIVE_S,
                ),
            )
            subs.append((sub, stream, subject))
        self._bound[route.route_id] = subs

    async def unbind(self, route_id: str) -> None:
        for sub, stream, subject in self._bound.pop(route_id, []):
            try:
                await sub.unsubscribe()
                await self._drop(stream, subject, self.name(subject))
            except Exception:  # connection already closing
                pass

    async def unbind_all(self) -> None:
        for route_id in list(self._bound):
            await self.unbind(route_id)

    def name(self, subject: str) -> str | None:
        """The consumer's name: a MAC of its subject under the node's secret (None: the server names it)."""
        if self.secret is None:
            return None
        return hashlib.blake2b(subject.encode(), key=self.secret, digest_size=12).hexdigest()

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
