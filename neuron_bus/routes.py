"""Helpers over a route assignment shared by the client and the workers."""

from __future__ import annotations

from neuron_bus import messages as M


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
