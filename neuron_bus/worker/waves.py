"""Decode waves and prefill batches: which queued steps a worker runs together as one backend call.

Each decoding session has one step circling its route's ring. The decoding sessions are spread
over waves, so that while one hop computes a wave the other hops have waves of their own to
compute (pipelining), and each wave is one batched backend call (batching). How many waves is the
head's choice by its measured ring (ring_model.py): one per hop when the links are short (the
biggest batches), more and smaller ones when the links are long (the hops compute while waves
travel). One session, or one per hop, means no batching and no waiting.

The head hop forms the waves: it groups its sessions in `Backend.batch_rank` order, so a wave is
a run of neighbouring slots (llama.cpp runs only consecutive sequence ids in one pass, and
sessions opened together hold the same neighbouring slots on every hop). It takes the wave of the
oldest queued step and waits up to ``wait_ms`` for the rest of its members; steps of other waves
stay queued, in order. Later hops take steps as they come, waiting only a moment for the rest of
a wave. The ring settles into one backend call per hop per wave, waves following each other.

Prompt chunks of several sessions run together too (`next_prefill`): sixteen sessions opened at
once would otherwise prefill one after another, each chunk waiting for the others' and for the
decode waves between them, and the last session's first token would come seconds after the first's.
A batch holds at most one chunk per session (a session's chunks run in order) and about one long
chunk's rows, so the decode waves between batches wait no longer than they did for one chunk.

Which sessions' chunks fill a batch is first come, first served: the sessions this hop took first
(`SessionTable.turn`), not the chunks that arrived first. Sessions sharing a route publish their
chunks as fast as their windows let them, so by arrival every waiting prompt got an equal share of
each batch, and none reached its first token until nearly all of them had been prefilled (32
prompts of 480 tokens on two hops: 23 first tokens after 93-133 s, none between 44 s and 93 s). In
turn, the first sessions finish their prompts at the speed of the hop and start decoding while the
later ones wait, for the same total work (the 32 prompts: a mean 1.03x the first-come bound).
One place in each batch goes out of turn, to the session with the fewest prompt positions left: a
short prompt behind long ones (each takes one chunk of every batch until its prompt is in) gets
in at the next batch instead of after them; prompts of one length are unaffected (the one with
the fewest left is the first in turn), and the long ones keep the rest of every batch.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable

from neuron_bus.worker.engine import Incoming
from neuron_bus.worker.ring_model import CallCost, RingLinks, best_wave_count, wave_size

LATER_HOP_WAIT_MS = 1.0  # a wave's steps leave the previous hop together: a moment is enough
PREFILL_BATCH_ROWS = 512  # prompt positions of one prefill batch (more when its first chunk alone is longer)


def next_prefill(
    queue: deque[Incoming],
    turn: Callable[[str | None], int],
    left: Callable[[str | None], int],
    max_rows: int = PREFILL_BATCH_ROWS,
) -> list[Incoming]:
    """Take the oldest queued chunk of each session while the batch stays within ``max_rows``: first
    that of the session with the fewest prompt positions ``left``, then the others in ``turn``
    order (ties: as their chunks arrived). The first always goes; the rest stay queued in order."""
    oldest: dict[object, Incoming] = {}  # a session's later chunk never overtakes its earlier one
    for m in queue:
        oldest.setdefault(m.session_id or id(m), m)
    if not oldest:
        return []
    in_turn = sorted(oldest.values(), key=lambda m: turn(m.session_id))
    shortest = min(in_turn, key=lambda m: left(m.session_id))
    picked: list[Incoming] = []
    rows = 0
    for m in [shortest, *(m for m in in_turn if m is not shortest)]:
        if picked and rows + m.rows > max_rows:
            continue
        picked.append(m)
        rows += m.rows
    for m in picked:
        queue.remove(m)
    return picked


class DecodeWaves:
    def __init__(self, queue: deque[Incoming], arrived: asyncio.Event, max_batch: int, wait_ms: float):
        self.queue = queue  # decode steps as they arrived
        self.arrived = arrived  # set whenever a step is queued
        self.max_batch = max_batch
        self.wait_ms = wait_ms
        self.cost = CallCost()  # this hop's decode calls
        self.links = RingLinks()  # the ring's links, seen from the sessions this hop heads
        self.count = 1  # waves of the last plan

    def returned(self, step: Incoming, when: float) -> None:
        """A decode step was queued (the ring brought it back, if this hop heads its session)."""
        self.links.returned(step.session_id, when)

    def ran(self, sessions: list, rows: int, seconds: float, when: float) -> None:
        """A decode wave of ``sessions`` (their `HopSession`s) took ``seconds``; its outputs leave now."""
        self.cost.observe(rows, seconds)
        heads = [s for s in sessions if s.is_head]
        if heads:
            hops = max(len(s.route.hops) for s in heads)
            self.links.left([s.session_id for s in heads], when, (hops - 1) * (self.cost(rows) or 0.0))

    def plan(self, sessions: Iterable, backend) -> tuple[int, dict[str, int]]:
        """The wave size, and the wave of each decoding session this node is the head hop for."""
        decoding = [s for s in sessions if s.phase == "decode" and not s.finished]
        self.links.forget({s.session_id for s in decoding})
        if not decoding:
            return 1, {}
        hops = max(len(s.route.hops) for s in decoding)
        n = len(decoding)
        self.count = best_wave_count(n, hops, self.max_batch, self.links.latency(), self.cost, self.count)
        size = max(1, min(self.max_batch, wave_size(n, self.count)))
        heads = sorted((s for s in decoding if s.is_head), key=lambda s: backend.batch_rank(s.session_id))
        return size, {s.session_id: i // size for i, s in enumerate(heads)}

    async def next(self, sessions: Iterable, backend) -> list[Incoming]:
        """Take the next wave off the queue (which must not be empty), waiting briefly for stragglers."""
        size, wave_of = self.plan(sessions, backend)
        mine = wave_of.get(self.queue[0].session_id or "")
        if mine is None:  # not a session this node heads: waves arrive formed from upstream
            target, wait_ms = size, min(LATER_HOP_WAIT_MS, self.wait_ms)
        else:
            target, wait_ms = sum(1 for w in wave_of.values() if w == mine), self.wait_ms

        def wanted(m: Incoming) -> bool:
            return mine is None or wave_of.get(m.session_id or "") == mine

        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_ms / 1000.0
        while True:
            picked = [m for m in self.queue if wanted(m)][:target]
            remaining = deadline - loop.time()
            if len(picked) >= target or remaining <= 0:
                break
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), remaining)
            except TimeoutError:
                pass
        for m in picked:
            self.queue.remove(m)
        return picked
