"""Route repair: replace a dead hop of a decoding session, restore its snapshot, replay the rest.

Orchestrated by the client (it knows the prompt and every token already emitted):

1. The tracker's coverage map names a live replacement with the dead hop's exact layer range,
   model revision, backend and cache ABI (anything else is never used).
2. Every surviving hop must be able to go back to the snapshot's position: a hop whose cache
   holds recurrent state (its capability report says ``supports_truncate`` false: llama.cpp keeps
   only a sequence's newest recurrent state) ends the repair before any snapshot is used. Every
   surviving hop reports its position for the session; a hop that lost it (restarted) ends the
   repair.
3. The repaired route is the old one under a new route id with the replacement in the dead hop's
   place (stray messages of the old route are rejected as wrong_route; its subjects are purged).
4. The replacement imports the newest compatible snapshot at or before the lowest surviving
   position (``SessionResume(restore=True)``), every survivor truncates to that snapshot's
   position, and the caller replays positions [snapshot, prompt + generated) from hop 0 as
   prefill-like chunks; the tail emits the next token and the ring goes on.

Any step that cannot be done raises RouteError with the reason, the phase and the node.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.errors import NeuronBusError, RouteError
from neuron_bus.routes import TRUSTED_TIERS, hop_subject, repaired_route_id
from neuron_bus.trust import sealing
from workers.errors import Reason

REPAIR_TIMEOUT_S = 20.0


def repaired_route(route: M.RouteAssignment, hop_index: int, node: M.TrackedNode, attempt: int) -> M.RouteAssignment:
    """The route under a new id with ``node`` serving hop ``hop_index``."""
    route_id = repaired_route_id(route.route_id, attempt)
    hops = []
    for i, h in enumerate(route.hops):
        if i == hop_index:
            h = M.RouteHop(
                node_id=node.node_id,
                layer_start=node.layer_start,
                layer_end=node.layer_end,
                subject="",
                backend_id=node.backend_id,
                cache_abi=node.cache_abi,
                trust_tier=node.trust_tier,
            )
        hops.append(msgspec.structs.replace(h, subject=hop_subject(route_id, i, h.node_id)))
    return msgspec.structs.replace(route, route_id=route_id, hops=hops, created_at=time.time())


def pick_replacement(
    report: M.CoverageReport,
    route: M.RouteAssignment,
    hop: M.RouteHop,
    exclude: set[str],
    suspects: set[str] | frozenset[str] = frozenset(),
) -> M.TrackedNode | None:
    """A live node of the same model revision, backend, cache ABI and exact layer range, that the
    route's policy admits (trusted tiers unless public) and that audits have not flagged; one of
    the client's ``suspects`` (suspects.py) only when no other qualifies."""
    groups = [
        m
        for m in report.models
        if (m.model_preset, m.model_revision, m.backend_id, m.cache_abi)
        == (route.model_preset, route.model_revision, hop.backend_id, hop.cache_abi)
    ]
    live = {n for m in groups for n in m.nodes_live}
    candidates = [
        n
        for n in report.nodes
        if n.node_id in live
        and n.alive
        and n.node_id not in exclude
        and n.status == "ready"
        and (n.layer_start, n.layer_end) == (hop.layer_start, hop.layer_end)
        and not n.flagged
        and (route.policy == "public" or n.trust_tier in TRUSTED_TIERS)
    ]
    if not candidates:
        return None
    return min(
        candidates, key=lambda n: (n.node_id in suspects, n.slow, n.sessions_active + n.recently_assigned, n.node_id)
    )


def rollback_problem(reports: dict[str, M.CapabilityReport], route: M.RouteAssignment, dead_index: int) -> str | None:
    """Why the hops surviving ``route.hops[dead_index]`` cannot go back to a snapshot's position,
    or None when they can. ``reports`` are the nodes' capability reports by node id (a node
    without one is assumed to truncate, as every backend did before reports said so)."""
    for i, h in enumerate(route.hops):
        report = reports.get(h.node_id)
        if i != dead_index and report is not None and not report.supports_truncate:
            return (
                f"surviving hop {h.node_id} (layers {h.layer_start}-{h.layer_end - 1}, {report.model_arch}) keeps "
                "recurrent state that cannot be truncated back to a snapshot's position: the session cannot be repaired"
            )
    return None


async def capability_reports(js, node_ids: list[str]) -> dict[str, M.CapabilityReport]:
    """The capability reports of ``node_ids`` from the ``neuron-nodes`` KV bucket (missing ones left out)."""
    out: dict[str, M.CapabilityReport] = {}
    try:
        kv = await js.key_value(S.KV_NODES)
    except Exception:
        return out
    for node_id in node_ids:
        try:
            entry = await kv.get(node_id)
            out[node_id] = M.decode(entry.value, M.CapabilityReport)
        except Exception:  # no report (or an unreadable one): nothing known about this node
            continue
    return out


async def repair(
    client,
    route: M.RouteAssignment,
    dead: str,
    session: M.SessionOpen,
    generated: list[int],
    attempt: int,
    exclude: set[str],
    keys=None,
) -> tuple[M.RouteAssignment, M.SessionResumed, M.TrackedNode]:
    """Repair ``route`` around ``dead`` (``session``: hop 0's open request): (new route, the
    replacement's answer (its position is where the replay starts), the replacement).

    ``keys(route, hop_index)`` gives each hop's link keys (the session's, unchanged); a survivor's
    resume carries the proof that this client opened the session (trust/sealing.py)."""

    def fail(reason: Reason, message: str, node: str | None = dead) -> RouteError:
        return RouteError(reason, message, phase="decode", node_id=node)

    index = next((i for i, h in enumerate(route.hops) if h.node_id == dead), None)
    if index is None:
        raise fail(Reason.REPAIR_FAILED, f"node {dead} is not on route {route.route_id}")
    node = await replacement(client, route, index, exclude)
    replay_end = session.prompt_tokens + len(generated)
    limit = min([*await surviving_positions(client, route, index, session.session_id), replay_end - 1])
    new = repaired_route(route, index, node, attempt)

    def resume(i: int, position: int, restore: bool) -> M.SessionResume:
        opened = msgspec.structs.replace(session, route=new, hop_index=i, **(keys(new, i) if keys else {}))
        req = M.SessionResume(
            open=opened, position=position, replay_end=replay_end, generated=generated, restore=restore
        )
        if not restore:  # a replacement holds no session of it yet
            req.proof = sealing.prove(opened.input_key, sealing.resume_parts(req))
        return req

    try:
        restored = await client.control(node.node_id, resume(index, limit, True), timeout=REPAIR_TIMEOUT_S)
    except RouteError as exc:
        raise fail(
            exc.reason, f"replacement {node.node_id} cannot take over from {dead}: {exc}", node.node_id
        ) from None
    survivors = [(i, h) for i, h in enumerate(route.hops) if i != index]
    results = await asyncio.gather(
        *(
            client.control(h.node_id, resume(i, restored.position, False), timeout=REPAIR_TIMEOUT_S)
            for i, h in survivors
        ),
        return_exceptions=True,
    )
    for (_, h), result in zip(survivors, results):
        if isinstance(result, RouteError):
            raise fail(result.reason, f"surviving hop {h.node_id} cannot resume: {result}", h.node_id)
        if isinstance(result, BaseException):
            raise result
    await purge(client.js, route)
    return new, restored, node


async def replacement(client, route: M.RouteAssignment, index: int, exclude: set[str]) -> M.TrackedNode:
    """The node to take over hop ``index`` of ``route`` (whose node died), or RouteError saying why none can."""
    dead, h = route.hops[index].node_id, route.hops[index]
    reports = await capability_reports(client.js, [x.node_id for x in route.hops if x.node_id != dead])
    problem = rollback_problem(reports, route, index)
    if problem:
        raise RouteError(Reason.NO_ROLLBACK, problem, "decode", dead)
    try:
        report = await client.coverage(route.model_preset, timeout=10)
    except NeuronBusError as exc:
        raise RouteError(
            Reason.NO_TRACKER, f"no coverage map for a replacement of {dead}: {exc}", "decode", dead
        ) from None
    node = pick_replacement(report, route, h, exclude | {dead}, client.suspects.current())
    if node is None:
        raise RouteError(
            Reason.NO_REPLACEMENT,
            f"no live node with layers [{h.layer_start}, {h.layer_end}), revision {route.model_revision}, "
            f"backend {h.backend_id} and cache ABI {h.cache_abi} can replace {dead}",
            "decode",
            dead,
        )
    return node


async def surviving_positions(client, route: M.RouteAssignment, dead_index: int, session_id: str) -> list[int]:
    """Where the session stands on every hop but the dead one (asked of all at once)."""
    hops = [h for i, h in enumerate(route.hops) if i != dead_index]
    reports = await asyncio.gather(*(client.sessions(h.node_id) for h in hops))
    positions = []
    for h, report in zip(hops, reports):
        held = [s for s in report.sessions if s.session_id == session_id]
        if not held:
            raise RouteError(
                Reason.HOT_KV_LOST,
                f"node {h.node_id} no longer holds session {session_id} (restarted?)",
                "decode",
                h.node_id,
            )
        positions.append(held[0].position)
    return positions


async def purge(js, route: M.RouteAssignment) -> None:
    """Drop what is left on the old route's hop subjects (best effort)."""
    for i, h in enumerate(route.hops):
        for phase, stream in (("prefill", S.STREAM_PREFILL), ("decode", S.STREAM_DECODE)):
            try:
                await js.purge_stream(stream, subject=S.hop_inputs(h.node_id, route.route_id, i, phase))
            except Exception:
                pass
