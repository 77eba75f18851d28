"""A route of one hop over a tiny model, and a session on it, for tests of the worker's parts in process."""

from __future__ import annotations

from neuron_bus import messages as M
from neuron_bus.worker.session_table import HopSession


def one_hop_route(node_id: str = "n") -> M.RouteAssignment:
    hop = M.RouteHop(node_id=node_id, layer_start=0, layer_end=4, subject="", backend_id="llama-cpp", cache_abi="a")
    return M.RouteAssignment(route_id="r", model_preset="tiny", model_revision="v1", n_layers_total=4, hops=[hop])


def one_hop_session(node_id: str = "n", session_id: str = "s1", position: int = 0) -> HopSession:
    req = M.SessionOpen(
        session_id=session_id, route=one_hop_route(node_id), hop_index=0, prompt_tokens=3, n_ctx=8, chunk_size=4,
        sampling=M.SamplingParams(max_tokens=4),
    )  # fmt: skip
    return HopSession(open=req, node_id=node_id, position=position)
