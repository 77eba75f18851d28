"""What a client does about a route that has gone quiet: no token, telemetry or error of its
session for a while.

A quiet route is dead after STALL_TIMEOUT_S, unless a node of it said in its last heartbeat that it
has other sessions or queued work: then the session is waiting its turn behind them (a prompt at a
busy head hop shows no progress until it is computed), for at most timing.BUSY_WAIT_S. While it
waits, the client says where (a notice on the session's telemetry, whenever the busy nodes change)
and keeps its hops from freeing it as idle (a keep-alive every KEEP_ALIVE_EVERY_S, or sooner for a
hop with a shorter idle timeout).

`QuietSpell` is the rule alone, without I/O; generation.py does what it says is due.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from neuron_bus import messages as M
from neuron_bus import timing
from neuron_bus.errors import MalformedMessage

STALL_TIMEOUT_S = 60.0  # quiet this long with no route node busy (busy_nodes): the route is dead
# This long without progress, while a route node is busy (busy_nodes), the client republishes the
# session's last telemetry naming those nodes (``waiting_at``): the page says it waits its turn.
WAIT_NOTICE_S = 2.0
# As long as it waits so, every this long, it tells its route's hops that it still wants the session:
# a hop frees a session nothing reached for its idle timeout (300 s by default; keep_alive_every).
KEEP_ALIVE_EVERY_S = 60.0


def keep_alive_every(idle_timeouts: Iterable[float]) -> float:
    """How often a waiting session's client tells its hops it still wants the session, given the
    idle timeouts they announced when it opened there (SessionOpened.idle_timeout_s; 0: not said):
    every KEEP_ALIVE_EVERY_S, or a third of the shortest, if that is sooner. A hop counts the
    session idle from its own last step of it, which may lie well before the client's last news of
    the route (the step still had the rest of the route to pass)."""
    return min([KEEP_ALIVE_EVERY_S, *(t / 3 for t in idle_timeouts if t > 0)])


def busy_nodes(beats: Mapping[str, bytes]) -> list[str]:
    """The nodes whose last heartbeat (``beats``: node -> encoded NodeHeartbeat) counts sessions
    besides this one, or queued work. With this session alone, queued work is its own: a hop slow
    enough to take longer than STALL_TIMEOUT_S over a prompt chunk is still working through it
    (the tail reports progress once a chunk has passed every hop). A hop whose call hangs says so
    in its heartbeats (status stuck: worker/runner.py), and the client leaves it at once."""
    busy = []
    for node, data in beats.items():
        try:
            beat = M.decode(data, M.NodeHeartbeat)
        except MalformedMessage:
            continue
        if beat.sessions_active > 1 or beat.queue_depth > 0:
            busy.append(node)
    return sorted(busy)


@dataclass
class Due:
    """What the client owes a quiet route after a spell has grown."""

    stalled: str | None = None  # the route is dead: for how long it was quiet, and why waiting ended
    notice: list[str] | None = None  # say the session waits its turn at these nodes
    keep_alive: bool = False  # tell the hops the session is still wanted


@dataclass
class QuietSpell:
    keep_alive_every: float = KEEP_ALIVE_EVERY_S  # seconds between keep-alives (keep_alive_every)
    seconds: float = 0.0
    named: list[str] = field(default_factory=list)  # the busy nodes the last notice named
    keep_alive_at: float = 0.0  # quiet this long while waiting: the hops are told the session is wanted

    def __post_init__(self) -> None:
        self.progress()

    def progress(self) -> None:
        """The route showed progress: the spell is over."""
        self.seconds, self.named, self.keep_alive_at = 0.0, [], self.keep_alive_every

    def grow(self, seconds: float, busy: Callable[[], list[str]]) -> Due:
        """The route stayed quiet ``seconds`` more; ``busy`` tells the route's nodes busy with other
        sessions (asked only once a notice or a keep-alive may be due)."""
        self.seconds += seconds
        nodes = busy() if self.seconds >= min(WAIT_NOTICE_S, self.keep_alive_at) else []
        if self.seconds >= STALL_TIMEOUT_S and not nodes:
            return Due(stalled=f"for {self.seconds:.0f}s")
        if self.seconds >= timing.BUSY_WAIT_S:
            return Due(stalled=f"for {self.seconds:.0f}s (its nodes busy with other sessions all along)")
        due = Due()
        if nodes and nodes != self.named and self.seconds >= WAIT_NOTICE_S:
            self.named = due.notice = nodes
        if nodes and self.seconds >= self.keep_alive_at:
            self.keep_alive_at = self.seconds + self.keep_alive_every
            due.keep_alive = True
        return due
