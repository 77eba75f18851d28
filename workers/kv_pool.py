"""A worker's KV pool: sessions are admitted by the positions they need, not by fixed slots.

Stock llama.cpp offers two cache layouts (measured in docs/bench.md, "KV pool"):

- one buffer for every sequence (``kv_unified``): any mix of session sizes fits, but every
  attention row scans every cell in use (decode and prefill slow down as the pool fills), and
  results depend on where a sequence's cells land (flash attention walks the cache in tiles of 64
  cells), so a session no longer gives the same tokens alone and beside others;
- one stream per sequence, every stream of one size (what the fixed slots were): a session's cells
  start at cell 0 of its own stream wherever and beside whomever it runs (bit-identical results),
  and its attention reads its own stream only.

The pool keeps the second layout and gets the first one's flexibility from *lanes*: llama.cpp
contexts sharing the loaded weights, each with streams of one size. A session takes a stream of
the smallest size class that holds it (256 positions doubled up to the largest session the worker
takes); a lane of that class is made when none has a free stream, and lanes without sessions are
dropped when their memory is wanted for another class. Sessions of one lane with neighbouring
stream ids run in one ``llama_decode``.

A new lane takes as many streams as the free budget holds, less the room for one more lane with a
session of the largest size (so that a long session still finds room beside a lane of short ones):
with the default budget, sessions of the largest size get one lane of exactly the fixed slots of
before, and short sessions one lane of many streams (every lane costs its buffers once more).

This module is the accounting, in positions (KV cells): a lane costs its streams' positions plus
``overhead`` (its compute and output buffers, counted in positions). The budget is the KV the
worker may hold plus one lane's overhead: what the fixed slots cost (their KV and one context).
Making and freeing contexts is the caller's (``open_lane`` and ``close_lane``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from workers.errors import BadInput, NoFreeSlot

GRANULE = 256  # llama.cpp sizes a stream in multiples of 256 cells
DEFAULT_MAX_STREAMS = 64  # streams per lane (llama.cpp takes up to 256 sequences per context)

# open_lane(lane index, streams, positions per stream) -> positions per stream llama.cpp made
OpenLane = Callable[[int, int, int], int]
CloseLane = Callable[[int], None]


def round_up(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclass
class Lane:
    index: int
    stream_positions: int
    streams: int
    overhead: int
    free: list[int]  # free stream (sequence) ids, lowest first
    idle_since: int = 0  # the pool's release count when its last session left

    @property
    def cost(self) -> int:
        return self.streams * self.stream_positions + self.overhead

    @property
    def in_use(self) -> int:
        return self.streams - len(self.free)


@dataclass(frozen=True)
class Slot:
    """Where a session's cache lives: a stream (llama.cpp sequence id) of a lane."""

    lane: int
    seq: int
    positions: int  # the stream's size: the most positions the session can hold


class KvPool:
    def __init__(
        self,
        budget: int,
        max_positions: int,
        *,
        overhead: int = 0,
        max_streams: int = DEFAULT_MAX_STREAMS,
    ):
        if max_positions <= 0 or overhead < 0 or max_streams <= 0:
            raise BadInput("a KV pool needs positive sizes")
        self.max_positions = round_up(max_positions, GRANULE)
        if budget < self.max_positions:
            raise BadInput(
                f"a KV budget of {budget} positions cannot hold one session of {self.max_positions} positions"
            )
        self.overhead = overhead
        self.budget = budget + overhead
        self.max_streams = max_streams
        self.lanes: dict[int, Lane] = {}
        self._next_lane = 0
        self._releases = 0

    # -- what it holds -----------------------------------------------------------------------

    @property
    def reserved(self) -> int:
        """Positions the lanes take (streams and overhead), used or not."""
        return sum(lane.cost for lane in list(self.lanes.values()))  # read from other threads (gauges)

    @property
    def sessions(self) -> int:
        return sum(lane.in_use for lane in list(self.lanes.values()))

    def size_class(self, need: int) -> int:
        """The stream size a session of ``need`` positions gets."""
        if not 0 < need <= self.max_positions:
            raise BadInput(f"a session needs 1 to {self.max_positions} positions here, not {need}")
        size = GRANULE
        while size < need:
            size *= 2
        return min(size, self.max_positions)

    # -- admission ---------------------------------------------------------------------------

    def admit(self, need: int, open_lane: OpenLane, close_lane: CloseLane) -> Slot:
        """A stream for a session of ``need`` positions; raises NoFreeSlot when none can be had.

        In order: a free stream of the session's class; a new lane of that class, in free budget
        and in what idle lanes of other classes give up (as many as it takes for the new lane to
        get all the streams the budget allows it: a workload that moved from long sessions to
        short ones gets short streams, not the few long ones idle lanes would hold); a free
        stream of another class that holds it.
        """
        size = self.size_class(need)
        lane = (
            self._free_lane(lambda ln: ln.stream_positions == size)
            or self._new_lane(size, open_lane, close_lane)
            or self._free_lane(lambda ln: ln.stream_positions >= need)
        )
        if lane is None:
            raise NoFreeSlot(
                f"the KV pool has no room for a session of {need} positions: {self.sessions} sessions hold "
                f"{self.reserved} of its {self.budget} positions (retry when one ends)"
            )
        return Slot(lane.index, lane.free.pop(0), lane.stream_positions)

    def release(self, slot: Slot) -> None:
        lane = self.lanes[slot.lane]
        if slot.seq in lane.free or not 0 <= slot.seq < lane.streams:
            raise BadInput(f"stream {slot.seq} of lane {slot.lane} is not held")
        lane.free.append(slot.seq)
        lane.free.sort()
        self._releases += 1
        if not lane.in_use:
            lane.idle_since = self._releases

    def _free_lane(self, fits: Callable[[Lane], bool]) -> Lane | None:
        lanes = [ln for ln in self.lanes.values() if ln.free and fits(ln)]
        return min(lanes, key=lambda ln: (ln.stream_positions, ln.index)) if lanes else None

    def _streams_that_fit(self, size: int, freed: int = 0) -> int:
        """Streams of ``size`` a new lane gets now, or once lanes costing ``freed`` are dropped (0: none fits)."""
        room = self.budget - self.reserved + freed - self.overhead  # left once the new lane's buffers are paid
        if room < size:
            return 0
        keep = self.max_positions + self.overhead if size < self.max_positions else 0
        streams = (room - keep) // size if room - keep >= size else room // size
        return min(self.max_streams, streams)

    def _new_lane(self, size: int, open_lane: OpenLane, close_lane: CloseLane) -> Lane | None:
        # make room: drop lanes without sessions, the longest idle first, as far as the new lane gains
        idle = sorted((ln for ln in self.lanes.values() if not ln.in_use), key=lambda ln: ln.idle_since)
        best = self._streams_that_fit(size, sum(ln.cost for ln in idle))
        for lane in idle:
            if self._streams_that_fit(size) >= best:
                break
            close_lane(lane.index)
            del self.lanes[lane.index]
        streams = self._streams_that_fit(size)
        if streams < 1:
            return None
        index = self._next_lane
        made = open_lane(index, streams, size)  # may raise: then nothing is recorded
        self._next_lane += 1
        lane = Lane(index, made, streams, self.overhead, list(range(streams)))
        self.lanes[index] = lane
        return lane
