"""The nodes a client saw answer a control request with something other than its reply (a faulty
build, a foreign responder on a node's subject): the client asks the tracker to route around them
(`RouteRequest.avoid`, a soft avoid: through them only when nothing else covers their layers) for
``SUSPECT_S``, so that every new generation does not meet such a node first and pay a failed try.

The memory is the client's own (the gateway's serves all of its requests): the tracker hears no
client's accusations, which would let any client turn the swarm against a node it dislikes.
"""

from __future__ import annotations

import time

SUSPECT_S = 600.0  # a node that answered nonsense is avoided this long after its last such answer
MAX_SUSPECTS = 1024  # the oldest are forgotten first


class Suspects:
    def __init__(self, keep_s: float = SUSPECT_S, clock=time.monotonic):
        self.keep_s = keep_s
        self._clock = clock
        self._until: dict[str, float] = {}  # node id -> when it is forgotten, oldest first

    def add(self, node_id: str) -> bool:
        """Suspect ``node_id`` from now on; returns whether it was not suspected already."""
        new = node_id not in self.current()
        self._until.pop(node_id, None)
        self._until[node_id] = self._clock() + self.keep_s
        while len(self._until) > MAX_SUSPECTS:
            del self._until[next(iter(self._until))]
        return new

    def current(self) -> set[str]:
        now = self._clock()
        for node_id in [n for n, until in self._until.items() if until <= now]:
            del self._until[node_id]
        return set(self._until)
