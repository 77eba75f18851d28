"""Metered rewards: what each node earned for a session, from what the swarm observed.

A node's own ledger entry (a self-report, ``neuron.ledger.<node>``) is never what it is paid.
The meter works out every route member's figure from observations the member does not write:

- the route: the tracker's assignment (KV ``neuron-routes``, stream NEURON_ROUTES) names the
  hops, their nodes and layer ranges; a repaired route (``<route>-r<n>``, the client's) keeps the
  assignment's ranges, and only a range whose node the repair replaced takes the node the
  validation event names;
- the tokens: the token deltas the tail delivered (stream NEURON_TOKENS, what the client
  received), counted by distinct index; ``finished`` from the last one;
- the prompt: the validation event's prompt tokens (the tail's record, replayed by audits) or,
  for a session that never finished, the session's last telemetry;
- the work per token: the model's layer work from the nodes' capability reports, per layer the
  median over every node that reports the layer (one node cannot raise it alone when others
  serve the same layers).

Every hop of a route computes every position: prefill positions = the prompt, decode positions =
tokens delivered - 1 (the last token is never fed back). When the session ended early, a hop may
have computed one more decode step (in flight) or, before the first token, any part of the
prompt: those are the ``max_*`` a claim may reach without a flag. A repaired range is bounded, not
exact (who computed which position is not observed): each of its nodes is paid its claim up to
the range's positions.

`reconcile` joins the metered records with the self-reports: paid = metered; a claim above the
metered figure (positions beyond the ``max_*``, more work per token, a range or a session the
node did not serve) is flagged and not paid.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

from neuron_bus import messages as M
from neuron_bus.routes import base_route_id

WORK_TOLERANCE = 1e-3  # relative: reports round the work per layer to 6 digits
KV_METER = "neuron-meter"  # session id -> SessionMeter


def inference_weight(owned_layer_work: float, prefill_tokens: int, decode_tokens: int) -> float:
    return owned_layer_work * prefill_tokens + owned_layer_work * decode_tokens


# ------------------------------------------------------------------------------------ layer work


def layer_work(reports: list[M.CapabilityReport]) -> dict[str, list[float | None]]:
    """Per model revision, each layer's work per token: the median of what the nodes that hold it
    report (``None``: no node reports it)."""
    seen: dict[str, dict[int, list[float]]] = {}
    totals: dict[str, int] = {}
    for r in reports:
        if len(r.active_parameters_per_layer) != r.layer_end - r.layer_start:
            continue  # no per-layer figures (or a malformed report): says nothing
        totals[r.model_revision] = max(totals.get(r.model_revision, 0), r.n_layers_total, r.layer_end)
        layers = seen.setdefault(r.model_revision, {})
        for i, w in zip(range(r.layer_start, r.layer_end), r.active_parameters_per_layer):
            if w >= 0 and w == w and w != float("inf"):
                layers.setdefault(i, []).append(float(w))
    return {
        rev: [statistics.median(layers[i]) if i in layers else None for i in range(totals[rev])]
        for rev, layers in seen.items()
    }


def range_work(work: list[float | None] | None, start: int, end: int) -> float | None:
    if work is None or end > len(work) or start < 0:
        return None
    values = work[start:end]
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


# ------------------------------------------------------------------------------------ metering


@dataclass
class Evidence:
    """What the swarm observed of one session (any part may be missing)."""

    session_id: str
    assignment: M.RouteAssignment | None = None
    validation: M.ValidationEvent | None = None
    telemetry: M.GenerationTelemetry | None = None
    deltas: list[M.TokenDelta] = field(default_factory=list)
    layer_work: dict[str, list[float | None]] = field(default_factory=dict)


def route_id_of(ev: Evidence) -> str:
    if ev.validation is not None:
        return ev.validation.route_id
    if ev.telemetry is not None:
        return ev.telemetry.route_id
    return ""


def unmetered(ev: Evidence, why: str, route_id: str = "") -> M.SessionMeter:
    return M.SessionMeter(
        session_id=ev.session_id, status="unmetered", route_id=route_id, notes=[why], metered_at=time.time()
    )


def _delivered(ev: Evidence, notes: list[str]) -> tuple[int, bool]:
    """Tokens delivered: the deltas indexed 0..k-1 all present (a stray or forged index beyond a
    gap counts nothing), at most the validation event's output; and whether the last one finished."""
    mine = [d for d in ev.deltas if d.session_id == ev.session_id]
    indices = {d.index for d in mine}
    k = 0
    while k in indices:
        k += 1
    if ev.validation is not None and len(ev.validation.output_tokens) != k:
        notes.append(f"the validation event lists {len(ev.validation.output_tokens)} output tokens, {k} were delivered")
        k = min(k, len(ev.validation.output_tokens))
    finished = any(d.finished and d.index == k - 1 for d in mine)
    return k, finished


def _prompt(ev: Evidence, notes: list[str]) -> tuple[int, int]:
    """(prompt tokens, prompt positions the route is known to have computed)."""
    if ev.validation is not None:
        n = len(ev.validation.prompt_tokens)
        return n, n
    if ev.telemetry is not None:
        t = ev.telemetry
        return max(0, t.prefill_tokens_total), max(0, min(t.prefill_tokens_done, t.prefill_tokens_total))
    notes.append("no validation event or telemetry: prompt length unknown")
    return 0, 0


def _members(ev: Evidence, a: M.RouteAssignment, route_id: str, notes: list[str]) -> list[tuple[int, str, bool]]:
    """(hop index, node id, exact) of every node that served the route: the assignment's, and on a
    repaired route the replacement the validation event names for a range (both bounded)."""
    out = [(i, h.node_id, True) for i, h in enumerate(a.hops)]
    if route_id == a.route_id:
        return out
    final = ev.validation.route if ev.validation is not None else []
    if len(final) != len(a.hops):
        notes.append("repaired route without a matching validation event: only the assigned nodes are metered")
        return [(i, n, False) for i, n, _ in out]
    members = []
    for i, (h, m) in enumerate(zip(a.hops, final)):
        if (m.layer_start, m.layer_end) != (h.layer_start, h.layer_end):
            notes.append(f"hop {i}: the validation event's range differs from the assignment's; not metered for it")
            members.append((i, h.node_id, False))
            continue
        members.append((i, h.node_id, m.node_id == h.node_id))
        if m.node_id != h.node_id:
            members.append((i, m.node_id, False))
    return members


def meter_session(ev: Evidence) -> M.SessionMeter:
    """The metered record of one session from its evidence (pure: no I/O)."""
    route_id = route_id_of(ev)
    if not route_id:
        return unmetered(ev, "no route observed for the session (no validation event, no telemetry)")
    a = ev.assignment
    if a is None or a.route_id != base_route_id(route_id):
        return unmetered(ev, f"route {route_id} was not assigned by the tracker", route_id)
    notes: list[str] = []
    delivered, finished = _delivered(ev, notes)
    prompt, prompt_done = _prompt(ev, notes)
    repaired = route_id != a.route_id
    status: M.MeterStatus = "repaired" if repaired else ("finished" if finished else "unfinished")
    if delivered:  # every hop computed the whole prompt and the decode steps behind the delivered tokens
        prefill, decode = prompt, delivered - 1
        max_prefill, max_decode = prompt, decode + (0 if finished else 1)
    else:
        prefill, decode, max_prefill, max_decode = prompt_done, 0, prompt, 0
    if repaired:  # replayed positions are computed again, as prefill: bounded by the whole sequence
        max_prefill, max_decode = prompt + delivered, decode + 1
    work = ev.layer_work.get(a.model_revision)
    members = []
    for i, node, exact in _members(ev, a, route_id, notes):
        h = a.hops[i]
        w = range_work(work, h.layer_start, h.layer_end)
        if w is None:
            notes.append(f"{node}: no layer work known for layers [{h.layer_start}, {h.layer_end}): metered at 0")
            w = 0.0
        members.append(
            M.MeteredWork(
                node_id=node,
                hop_index=i,
                layer_start=h.layer_start,
                layer_end=h.layer_end,
                owned_layer_work=w,
                prefill_tokens=prefill,
                decode_tokens=decode,
                reward_weight=inference_weight(w, prefill, decode),
                max_prefill_tokens=max_prefill,
                max_decode_tokens=max_decode,
                exact=exact,
            )
        )
    sources = ["assignment", "token-deltas", "layer-work"]
    sources += [name for name, got in (("validation", ev.validation), ("telemetry", ev.telemetry)) if got]
    return M.SessionMeter(
        session_id=ev.session_id,
        status=status,
        route_id=route_id,
        model_preset=a.model_preset,
        model_revision=a.model_revision,
        prompt_tokens=prompt,
        delivered_tokens=delivered,
        members=members,
        sources=sources,
        notes=notes,
        metered_at=time.time(),
    )


# ------------------------------------------------------------------------------------ reconciling


def disagreement(claim: M.LedgerEntry, meter: M.SessionMeter) -> tuple[str | None, M.MeteredWork | None]:
    """Why ``claim`` is above what ``meter`` observed (None: it is not), and the member it is for."""
    mine = [m for m in meter.members if m.node_id == claim.node_id]
    if meter.status == "unmetered":
        return None, None
    if not mine:
        return f"claims session {meter.session_id}, which it did not serve", None
    m = next((m for m in mine if (m.layer_start, m.layer_end) == (claim.layer_start, claim.layer_end)), None)
    if m is None:
        return f"claims layers [{claim.layer_start}, {claim.layer_end}), the route gave it others", mine[0]
    why = []
    if claim.prefill_tokens > m.max_prefill_tokens:
        why.append(f"{claim.prefill_tokens} prefill positions claimed, {m.prefill_tokens} metered")
    if claim.decode_tokens > m.max_decode_tokens:
        why.append(f"{claim.decode_tokens} decode positions claimed, {m.decode_tokens} metered")
    if claim.owned_layer_work > m.owned_layer_work * (1 + WORK_TOLERANCE) + 1e-6:
        why.append(f"{claim.owned_layer_work:.3f}M weights per token claimed, {m.owned_layer_work:.3f}M metered")
    return ("; ".join(why) or None), m


@dataclass
class NodeLedger:
    """One node's rewards: paid (metered) next to what it claimed, and every flagged claim."""

    node_id: str
    inference_weight: float = 0.0  # paid: the metered figure
    sessions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    claimed_weight: float = 0.0
    claimed_sessions: int = 0
    claimed_prefill_tokens: int = 0
    claimed_decode_tokens: int = 0
    flagged: bool = False
    flags: list[dict] = field(default_factory=list)  # {session_id, reason, claimed_weight, metered_weight}
    unmetered_sessions: list[str] = field(default_factory=list)  # claims nothing observed backs: not paid
    pending_sessions: list[str] = field(default_factory=list)  # claims not metered yet
    seeding_bytes: int = 0
    seeding_entries: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _pay(t: NodeLedger, prefill: int, decode: int, weight: float) -> None:
    t.inference_weight += weight
    t.sessions += 1
    t.prefill_tokens += prefill
    t.decode_tokens += decode


def _claim(t: NodeLedger, e: M.LedgerEntry) -> float:
    w = inference_weight(e.owned_layer_work, e.prefill_tokens, e.decode_tokens)
    t.claimed_weight += w
    t.claimed_sessions += 1
    t.claimed_prefill_tokens += e.prefill_tokens
    t.claimed_decode_tokens += e.decode_tokens
    return w


def reconcile(claims: list[M.LedgerEntry], meters: list[M.SessionMeter]) -> dict[str, NodeLedger]:
    """Per node: the metered reward (paid), its claims beside it, and the claims flagged."""
    out: dict[str, NodeLedger] = {}
    node = lambda n: out.setdefault(n, NodeLedger(n))  # noqa: E731
    by_session: dict[str, M.SessionMeter] = {}
    for meter in meters:
        by_session.setdefault(meter.session_id, meter)  # the first record of a session holds
    claimed: dict[tuple[str, str], list[M.LedgerEntry]] = {}
    for e in {e.entry_id: e for e in claims}.values():
        if e.kind == "seeding":  # recorded, never paid as inference
            node(e.node_id).seeding_bytes += e.bytes_served
            node(e.node_id).seeding_entries += 1
        elif e.session_id:
            claimed.setdefault((e.node_id, e.session_id), []).append(e)
    for (node_id, session_id), entries in claimed.items():
        t = node(node_id)
        found = by_session.get(session_id)
        for e in entries:
            w = _claim(t, e)
            if found is None:
                t.pending_sessions.append(session_id)
            elif found.status == "unmetered":
                t.unmetered_sessions.append(session_id)
            else:
                _check(t, e, w, found)
    for meter in by_session.values():  # an exact member is paid what was observed, whatever it claims
        for m in meter.members:
            if m.exact:
                _pay(node(m.node_id), m.prefill_tokens, m.decode_tokens, m.reward_weight)
    return dict(sorted(out.items()))


def _check(t: NodeLedger, e: M.LedgerEntry, w: float, meter: M.SessionMeter) -> None:
    """Flag a claim above the metered figure; pay a bounded member's claim (up to its bound)."""
    why, m = disagreement(e, meter)
    if why:
        t.flagged = True
        t.flags.append(
            {
                "session_id": meter.session_id,
                "reason": why,
                "claimed_weight": w,
                "metered_weight": m.reward_weight if m is not None else 0.0,
            }
        )
    elif m is not None and not m.exact:  # bounded: paid what it claims, up to the range's positions
        _pay(t, e.prefill_tokens, e.decode_tokens, min(w, m.reward_weight))
