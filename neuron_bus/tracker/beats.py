"""Heartbeats shared by the trackers: each heartbeat reaches one tracker, which passes it on.

Every tracker used to subscribe to every node's heartbeats. At 10,000 nodes that is 10,000
deliveries a second to each tracker, each parsed by nats-py, decoded, checked and compared with
the node's state (registry.py), so three trackers cost the server 30,000 deliveries a second and
each tracker about 30 % of a core before any request: a third tracker took route throughput away
instead of adding it (docs/tracker-scale.md).

Now the trackers take heartbeats as a queue group (``neuron-tracker``: each heartbeat reaches one
of them), apply each at once, and pass what they took on to the others as one ``HeartbeatRelay``
on ``neuron.tracker.heartbeats`` every RELAY_INTERVAL_S (sooner once RELAY_MAX_BYTES wait). Most
heartbeats only say that their node is alive (the registry finds the same state: throughput
within noise, the same sessions and status); the relay carries those as the node's id, which the
others apply as liveness alone (``Registry.touch``, O(1)), and the rest whole, applied as if
taken from the bus. A relay of k heartbeats is one message: one decode in msgspec's C code and k
updates, nothing per heartbeat in nats-py.

Consistency. A whole heartbeat is applied as a direct one is: the registry drops a heartbeat sent
before the one it has (seq and ts both behind), so one overtaken by the node's next heartbeat
through another tracker changes nothing. Liveness is read on the receiving tracker's clock, at
most RELAY_INTERVAL_S and a bus trip later than the tracker that took it: small against the
expiry (5 s). A tracker that stops sends the batch it holds once it has left the queue group
(``hand_over``), in a relay marked ``leaving``: the others stop passing heartbeats on to it at
once instead of PEER_TIMEOUT_S later, and it sends nothing after it. One that dies loses its
batch: those nodes look up to a second older on the others until their next heartbeat, which the
queue group gives to a live tracker; a change of state lost with it is sent again with the node's
next whole heartbeat.
Every WHOLE_EVERY-th heartbeat of a node (by its seq) goes whole whatever it says, so what the id
alone leaves out (memory pressure on the map, throughput drifting within the noise) is at most
that many heartbeats old on the other trackers, and a tracker that missed a change catches up.
A node id the receiving tracker does not hold alive with a heartbeat is left for its next whole
heartbeat (counted: ``unknown``).

Who is there. A tracker passes heartbeats on only while it has heard another tracker in the last
PEER_TIMEOUT_S: a lone tracker (the queue group of one gives it every heartbeat) sends nothing
but a beacon, an empty relay every BEACON_S. A tracker that hears one it did not know (started,
or back from a partition) sends its own beacon at once, so the newcomer knows the others within a
bus round trip, and sends every heartbeat whole for WHOLE_FOR_NEW_S, so the newcomer learns every
node's state within a heartbeat interval. A tracker of an older version subscribes to every
heartbeat without the group: it misses nothing, and the relays are lost on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import nats

from neuron_bus import messages
from neuron_bus import subjects as S
from neuron_bus.errors import MalformedMessage
from neuron_bus.messages import HeartbeatRelay, NodeHeartbeat
from neuron_bus.timing import HEARTBEAT_INTERVAL_S

log = logging.getLogger("neuron_bus.tracker")

RELAY_INTERVAL_S = 0.2  # a heartbeat waits at most this long to be passed on
RELAY_MAX_BYTES = 256 * 1024  # ... or until this much waits (a relay stays far under max_payload)
ALIVE_BYTES = 24  # what a node id in ``alive`` adds to a relay, about
WHOLE_EVERY = 10  # a node's heartbeats whose seq is a multiple of this are passed on whole
WHOLE_FOR_NEW_S = 2 * HEARTBEAT_INTERVAL_S  # every heartbeat whole, after a tracker appeared
BEACON_S = 1.0  # a tracker with nothing to pass on says it is there this often
PEER_TIMEOUT_S = 3.5  # a tracker not heard for this long is gone: nothing is passed on for it
APPLY_YIELD = 256  # relayed heartbeats applied in a row before other callbacks get a turn


async def _in_turns(items):
    """``items`` one by one, other callbacks getting a turn every APPLY_YIELD: a large relay does
    not hold up requests and pongs."""
    for i, item in enumerate(items, 1):
        yield item
        if i % APPLY_YIELD == 0:
            await asyncio.sleep(0)


class HeartbeatShare:
    """The heartbeats this tracker took, passed on in batches while other trackers are there; and
    theirs, applied here: ``ingest`` (what the tracker does with a heartbeat it took itself) for
    whole ones, ``touch(node_id, now)`` (liveness alone, Registry.touch: False if the node is not
    held alive here) for ids, ``now`` on ``clock``."""

    def __init__(
        self,
        nc: nats.NATS,
        tracker_id: str,
        ingest: Callable[[NodeHeartbeat], object],
        touch: Callable[[str, float], bool],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.nc = nc
        self.tracker_id = tracker_id
        self._ingest = ingest
        self._touch = touch
        self._clock = clock
        self._whole: list[NodeHeartbeat] = []
        self._alive: list[str] = []
        self._bytes = 0
        self._sent_at = float("-inf")
        self._whole_until = float("-inf")
        self._left = False  # the leaving relay went: nothing more is sent
        self._peers: dict[str, float] = {}  # the other trackers -> when last heard
        self.passed_on = 0  # heartbeats sent to the other trackers (whole or as ids)
        self.applied = 0  # heartbeats the other trackers took, applied here (whole or as ids)
        self.touched = 0  # ... of which ids: liveness alone
        self.unknown = 0  # ids of nodes not held alive here: left for their next whole heartbeat
        self.bad_relays = 0

    def peers(self) -> list[str]:
        """The other trackers heard in the last PEER_TIMEOUT_S."""
        now = self._clock()
        for tracker_id, heard in list(self._peers.items()):
            if now - heard > PEER_TIMEOUT_S:
                del self._peers[tracker_id]
                log.info(
                    "tracker %s not heard for %.1f s: heartbeats are no longer passed on to it", tracker_id, now - heard
                )
        return list(self._peers)

    async def take(self, hb: NodeHeartbeat, new: bool, size: int) -> None:
        """A heartbeat this tracker took from the bus and applied (``new``: it told the registry
        something new); the others get it with the next relay. ``size``: its encoded bytes."""
        if not self._peers:
            return
        if new or hb.seq % WHOLE_EVERY == 0 or self._clock() < self._whole_until:
            self._whole.append(hb)
            self._bytes += size
        else:
            self._alive.append(hb.node_id)
            self._bytes += ALIVE_BYTES
        if self._bytes >= RELAY_MAX_BYTES:
            await self.flush()

    async def flush(self, leaving: bool = False) -> None:
        """Send what waits (an empty relay is the beacon)."""
        if self._left:
            return
        self._left = leaving
        relay = HeartbeatRelay(tracker_id=self.tracker_id, heartbeats=self._whole, alive=self._alive, leaving=leaving)
        self._whole, self._alive, self._bytes = [], [], 0
        try:
            await self.nc.publish(S.TRACKER_HEARTBEATS, messages.encode(relay))
        except nats.errors.Error as exc:  # closed or draining: those nodes' next heartbeats reach a live tracker
            log.warning(
                "could not pass %d heartbeat(s) on to the other trackers: %s",
                len(relay.heartbeats) + len(relay.alive),
                exc,
            )
            return
        self._sent_at = self._clock()
        self.passed_on += len(relay.heartbeats) + len(relay.alive)

    async def hand_over(self) -> None:
        """At a graceful stop, once no more heartbeats are taken here: what waits goes to the others
        now, where the next relay would never go (a changed heartbeat would reach them only with
        the node's next change or next whole one, up to WHOLE_EVERY beats later), with word that
        this tracker leaves. Nothing is sent after it, not even a beacon."""
        await self.flush(leaving=True)

    async def run(self) -> None:
        """The relays' timer and the beacon; the first beacon at once."""
        while True:
            if not self.peers():
                self._whole, self._alive, self._bytes = [], [], 0  # the last peer went: nobody to send them to
            if self._bytes or self._clock() - self._sent_at >= BEACON_S:
                await self.flush()
            await asyncio.sleep(RELAY_INTERVAL_S)

    async def on_relay(self, msg) -> None:
        try:
            relay = messages.decode(msg.data, HeartbeatRelay)
        except MalformedMessage as exc:
            self.bad_relays += 1
            log.warning("ignored a heartbeat relay on %s: %s", msg.subject, exc)
            return
        if relay.tracker_id == self.tracker_id:
            return
        now = self._clock()
        new = relay.tracker_id not in self._peers and not relay.leaving
        if relay.leaving:
            if self._peers.pop(relay.tracker_id, None) is not None:
                log.info("tracker %s stops: heartbeats are no longer passed on to it", relay.tracker_id)
        else:
            self._peers[relay.tracker_id] = now
        if new:
            log.info("tracker %s is there: heartbeats taken here are passed on to it", relay.tracker_id)
            self._whole_until = now + WHOLE_FOR_NEW_S  # it learns every node's state from them
            await self.flush()  # and of this tracker now, not a beacon later
        async for hb in _in_turns(relay.heartbeats):
            self._ingest(hb)
        touch, unknown = self._touch, 0
        async for node_id in _in_turns(relay.alive):
            unknown += not touch(node_id, now)
        self.unknown += unknown
        self.touched += len(relay.alive)
        self.applied += len(relay.heartbeats) + len(relay.alive)
