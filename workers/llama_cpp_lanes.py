"""The llama.cpp side of a worker's KV pool (kv_pool.py): one context per lane, all of them on one
loaded GGUF, and which lane and stream (llama.cpp sequence id) each session holds.

Sessions of one lane run together in one ``llama_decode``; a batch spanning lanes runs as one call
per lane (`groups`). `rank` orders sessions so that neighbours share a lane and hold consecutive
sequence ids: llama.cpp runs such a batch in one pass.
"""

from __future__ import annotations

from collections.abc import Callable

from workers.errors import UnknownSession
from workers.kv_pool import KvPool, Slot
from workers.llama_cpp_common import LlamaCppError, LlamaCppModel

RANK_STRIDE = 1024  # > streams per lane: ranks of one lane are consecutive, lanes follow each other

MakeContext = Callable[[int, int], LlamaCppModel]  # (streams, positions per stream) -> a context


class Lanes:
    def __init__(self, pool: KvPool, make_context: MakeContext):
        self.pool = pool
        self._make = make_context
        self.contexts: dict[int, LlamaCppModel] = {}
        self.slots: dict[str, Slot] = {}

    def take(self, session_id: str, need: int) -> Slot:
        """A stream for the session (cleared), from the pool; raises NoFreeSlot when there is none."""
        slot = self.pool.admit(need, self._open_lane, self._close_lane)
        self.contexts[slot.lane].clear(slot.seq)
        self.slots[session_id] = slot
        return slot

    def release(self, session_id: str) -> None:
        slot = self.slot(session_id)
        self.contexts[slot.lane].clear(slot.seq)
        del self.slots[session_id]
        self.pool.release(slot)

    def slot(self, session_id: str) -> Slot:
        try:
            return self.slots[session_id]
        except KeyError:
            raise UnknownSession(f"session {session_id} holds no KV stream") from None

    def context(self, session_id: str) -> LlamaCppModel:
        return self.contexts[self.slot(session_id).lane]

    def seq(self, session_id: str) -> int:
        return self.slot(session_id).seq

    def rank(self, session_id: str) -> int:
        slot = self.slot(session_id)
        return slot.lane * RANK_STRIDE + slot.seq

    def groups(self, session_ids: list[str]) -> list[list[int]]:
        """Indexes into ``session_ids`` by lane (lanes in order), each group in sequence-id order."""
        by_lane: dict[int, list[int]] = {}
        for k, sid in enumerate(session_ids):
            by_lane.setdefault(self.slot(sid).lane, []).append(k)
        return [sorted(ks, key=lambda k: self.seq(session_ids[k])) for _, ks in sorted(by_lane.items())]

    def close(self) -> None:
        for index in list(self.contexts):
            self._close_lane(index)
        self.slots.clear()

    # -- the pool's callbacks ----------------------------------------------------------------

    def _open_lane(self, index: int, streams: int, positions: int) -> int:
        ctx = self._make(streams, positions)
        if ctx.n_ctx_slot < positions:
            ctx.close()
            raise LlamaCppError(f"llama.cpp made streams of {ctx.n_ctx_slot} positions, not {positions}")
        self.contexts[index] = ctx
        return ctx.n_ctx_slot

    def _close_lane(self, index: int) -> None:
        self.contexts.pop(index).close()
