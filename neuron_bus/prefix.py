"""Prefix KV reuse: what a route's hops keep of finished sessions, and how a new one finds it.

A prompt is cut into blocks of ``PREFIX_BLOCK`` tokens; block ``i``'s hash chains the hash of
block ``i - 1`` with its own tokens, so one hash names a whole prefix (``block_hashes``). Only the
blocks before the prompt's last token count: the tail needs that token's logits, so at least it is
always computed.

Every hop keeps, in a `PrefixCache` under a memory budget (least recently used out first), the
KV state of finished sessions' prefixes: the prompt's blocks, and the blocks its answer completed
when the client names their hashes at close (``SessionClose.keep_blocks``: a chat's next turn
reuses the answer too). Keys: what makes a hop's state its own (model revision, layer range, cache
ABI), the session's owner (a client reuses only its own prefixes: an attach or a refusal would
otherwise tell it that another client's prompt began so) and the prefix's block hash. The state
is copied (exported at the end of one session, imported into the new session's own stream)
rather than shared: streams are per sequence (workers/kv_pool.py). Hidden states carry no tokens,
so the hashes come with the session open (``SessionOpen.prefix_blocks``) and close, computed where
the tokens are. The head decides what a new session reuses (the longest prefix it holds); every
other hop must attach the same one or refuse, and then the whole route computes the prompt from
position 0: a route never mixes reused and computed positions silently.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from neuron_bus.messages import PREFIX_BLOCK


def block_hashes(tokens: list[int], block: int = PREFIX_BLOCK) -> list[str]:
    """The chained hash of each full block of ``tokens`` before its last token."""
    out: list[str] = []
    h = hashlib.blake2b(f"neuron-prefix-{block}".encode(), digest_size=16).digest()
    usable = (len(tokens) - 1) // block if tokens else 0
    ids = np.asarray(tokens[: usable * block], dtype="<i4")
    for i in range(usable):
        h = hashlib.blake2b(h + ids[i * block : (i + 1) * block].tobytes(), digest_size=16).digest()
        out.append(h.hex())
    return out


@dataclass
class Entry:
    blocks: list[str]  # the chain it holds: prefixes of len(blocks) blocks and every shorter one
    blob: bytes  # the hop's exported state of positions [0, len(blocks) * block)

    @property
    def positions(self) -> int:
        return len(self.blocks) * PREFIX_BLOCK


class PrefixCache:
    """Exported KV states of prompt prefixes, at most ``budget`` bytes, the least recently used out first.

    Not thread-safe: the worker touches it on its event loop only.
    """

    def __init__(self, budget: int):
        self.budget = budget
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # by the hash of its longest prefix; LRU order
        self._index: dict[str, str] = {}  # block hash -> the entry holding that prefix
        self.nbytes = 0
        self.evicted = 0

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, blocks: list[str]) -> tuple[int, str] | None:
        """The longest prefix of ``blocks`` held: (positions, its block hash)."""
        for i in range(len(blocks) - 1, -1, -1):
            if blocks[i] in self._index:
                return (i + 1) * PREFIX_BLOCK, blocks[i]
        return None

    def get(self, block_hash: str, positions: int) -> bytes | None:
        """The state holding the prefix ``block_hash`` of ``positions`` positions (and perhaps more:
        the caller keeps the first ``positions``), marked recently used; None when not held."""
        key = self._index.get(block_hash)
        if key is None:
            return None
        entry = self._entries[key]
        k = positions // PREFIX_BLOCK
        if positions % PREFIX_BLOCK or not 0 < k <= len(entry.blocks) or entry.blocks[k - 1] != block_hash:
            return None
        self._entries.move_to_end(key)
        return entry.blob

    def holds(self, blocks: list[str]) -> bool:
        return bool(blocks) and blocks[-1] in self._index

    def put(self, blocks: list[str], blob: bytes) -> bool:
        """Keep ``blob`` (positions [0, len(blocks) * PREFIX_BLOCK)) under ``blocks``; False when it
        is larger than the whole budget. Entries whose every prefix the new one holds are dropped."""
        if not blocks or len(blob) > self.budget:
            return False
        key = blocks[-1]
        if key in self._index:
            self._entries.move_to_end(self._index[key])
            return True
        entry = Entry(list(blocks), blob)
        for h in blocks:
            old = self._index.get(h)
            self._index[h] = key
            if old is not None and old != key and all(self._index.get(b) != old for b in self._entries[old].blocks):
                self._drop(old, count=False)
        self._entries[key] = entry
        self.nbytes += len(blob)
        while self.nbytes > self.budget:
            oldest = next(iter(self._entries))
            self._drop(oldest)
        return True

    def _drop(self, key: str, count: bool = True) -> None:
        entry = self._entries.pop(key)
        self.nbytes -= len(entry.blob)
        for h in entry.blocks:
            if self._index.get(h) == key:
                del self._index[h]
        self.evicted += count
