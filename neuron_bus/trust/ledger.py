"""The reward ledger: per node, the metered reward next to what the node claimed.

Workers publish one `LedgerEntry` of kind ``inference`` per session they served, at session
close, on ``neuron.ledger.<node>`` (stream NEURON_LEDGER): their claim, ``owned_layer_work ×
prefill_tokens + owned_layer_work × decode_tokens`` (artifacts/work.py: millions of weights
multiplied per token, output head included at the tail). What a node is paid is the meter's
figure instead (trust/meter.py: from the route assignment, the token deltas the tail delivered,
the validation event and the model's layer work; KV ``neuron-meter``); a claim above it is
flagged and not paid. `neuron-bus artifact publish --node-id N` records kind ``seeding`` with the
bytes it served: seeding is kept in its own column and never counts as inference reward.
"""

from __future__ import annotations

from nats.js import JetStreamContext

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.trust.events import stored, stored_on
from neuron_bus.trust.meter import KV_METER, NodeLedger, inference_weight, reconcile

__all__ = ["NodeLedger", "inference_weight", "ledger", "read_ledger", "read_meters"]


async def read_ledger(js: JetStreamContext) -> list[M.LedgerEntry]:
    """Every ledger entry (claim) published under the node id it names (per-node credentials let a node
    publish on ``neuron.ledger.<its id>`` only; an entry claiming another node is left out)."""
    return [
        e
        async for subject, e in stored_on(js, S.STREAM_LEDGER, S.LEDGER_ALL, M.LedgerEntry, skip_malformed=True)
        if S.is_own_ledger(subject, e.node_id)
    ]


async def read_meters(js: JetStreamContext) -> list[M.SessionMeter]:
    """Every metered session record (the KV bucket's stream, in order; none while no meter ran)."""
    meters = stored(js, f"KV_{KV_METER}", f"$KV.{KV_METER}.>", M.SessionMeter, skip_malformed=True)
    return [m async for m in meters]


async def ledger(js: JetStreamContext) -> dict[str, NodeLedger]:
    """Per node: paid (metered), claimed, flagged claims, pending and unmetered sessions, seeding."""
    return reconcile(await read_ledger(js), await read_meters(js))
