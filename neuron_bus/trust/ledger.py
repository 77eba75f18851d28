"""The reward ledger: every node's work, summed per node and kind.

Workers publish one `LedgerEntry` of kind ``inference`` per session they served, at session
close, on ``neuron.ledger.<node>``: ``reward_weight = owned_layer_work × prefill_tokens +
owned_layer_work × decode_tokens`` (artifacts/work.py: millions of weights multiplied per token, output
head included at the tail; tokens are the positions the node actually computed).
`neuron-bus artifact publish --node-id N` records kind ``seeding`` with the bytes it served:
seeding is kept in its own column and never counts as inference reward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from nats.js import JetStreamContext

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.trust.events import stored_on


def inference_weight(owned_layer_work: float, prefill_tokens: int, decode_tokens: int) -> float:
    return owned_layer_work * prefill_tokens + owned_layer_work * decode_tokens


@dataclass
class NodeTotals:
    node_id: str
    inference_weight: float = 0.0
    sessions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seeding_bytes: int = 0
    seeding_entries: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def totals(entries: list[M.LedgerEntry]) -> dict[str, NodeTotals]:
    """Per node: inference reward weight (and its tokens), and separately the bytes seeded."""
    out: dict[str, NodeTotals] = {}
    for e in entries:
        t = out.setdefault(e.node_id, NodeTotals(e.node_id))
        if e.kind == "inference":
            t.inference_weight += inference_weight(e.owned_layer_work, e.prefill_tokens, e.decode_tokens)
            t.sessions += 1
            t.prefill_tokens += e.prefill_tokens
            t.decode_tokens += e.decode_tokens
        else:  # seeding: recorded, never paid as inference
            t.seeding_bytes += e.bytes_served
            t.seeding_entries += 1
    return dict(sorted(out.items()))


async def read_ledger(js: JetStreamContext) -> list[M.LedgerEntry]:
    """Every ledger entry published under the node id it names (per-node credentials let a node
    publish on ``neuron.ledger.<its id>`` only; an entry claiming another node is left out)."""
    return [
        e
        async for subject, e in stored_on(js, S.STREAM_LEDGER, S.LEDGER_ALL, M.LedgerEntry)
        if subject == f"{S.ROOT}.ledger.{e.node_id}"
    ]
