"""Helpers over a route assignment shared by the client, the workers and the tracker.

The client (repair) needs these without loading the tracker: they live here, below both.
"""

from __future__ import annotations

from neuron_bus import messages as M
from neuron_bus import subjects as S

# Trust tiers a route of policy ``private`` or ``paid-trusted`` may use (``public`` takes any).
TRUSTED_TIERS = ("trusted", "paid-trusted")


def base_route_id(route_id: str) -> str:
    """The tracker's route id behind a repaired one (``<route>-r<n>``, `repaired_route_id`)."""
    return route_id.split("-r")[0]


def repaired_route_id(route_id: str, attempt: int) -> str:
    return f"{base_route_id(route_id)[:100]}-r{attempt}"


def hop_subject(route_id: str, index: int, node_id: str) -> str:
    """The base subject of a hop, keyed by the node serving it; workers append ``.prefill`` /
    ``.decode`` (subjects.hop_input)."""
    return S.hop_base(node_id, route_id, index)


def hop_header(
    route: M.RouteAssignment,
    hop_index: int,
    session_id: str,
    position: int,
    phase: M.ActivationPhase,
    seq: int,
    dtype: M.WireDtype,
) -> M.ActivationHeader:
    """The session state key of a message into hop ``hop_index`` of ``route``."""
    hop = route.hops[hop_index]
    return M.ActivationHeader(
        session_id=session_id,
        route_id=route.route_id,
        model_preset=route.model_preset,
        model_revision=route.model_revision,
        backend_id=hop.backend_id,
        cache_abi=hop.cache_abi,
        layer_start=hop.layer_start,
        layer_end=hop.layer_end,
        position=position,
        phase=phase,
        seq=seq,
        dtype=dtype,
        shape=[],
        encoding=route.encoding,
    )
