"""What a worker serves and where the bytes come from.

- a model on this machine and a range typed by hand (``--model M --layers A-B``);
- a published artifact and a range typed by hand (``--artifact ID --layers A-B``): the verified
  slice, fetched from the shard swarm (or the local cache);
- ``--layers auto``: the worker states what it can hold (NodeFit), the tracker's placement gives
  it a model and a range (tracker/placer.py), and the slice is fetched as above. Refused before
  anything loads: a model with no published artifact, a budget too small for even one layer.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from pathlib import Path

from nats.errors import Error as NatsError

from neuron_bus import messages as M
from neuron_bus import models
from neuron_bus import subjects as S
from neuron_bus.artifacts.catalog import Catalog
from neuron_bus.artifacts.cuts import check_cut, layer_kinds
from neuron_bus.artifacts.footprint import footprint
from neuron_bus.artifacts.gguf_model import META_PREFIX, ArtifactError, GGUFModel, format_layers, parse_layers
from neuron_bus.artifacts.manifest import n_layers
from neuron_bus.artifacts.swarm import fetch_manifest, resolve_artifact
from neuron_bus.errors import MalformedMessage
from neuron_bus.topology import connect
from workers.errors import Reason

PLACEMENT_WAIT_S = 60.0  # how long a joining node waits for a tracker to place it
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


@dataclass
class Source:
    """The file to load, its range, and what the bus calls it."""

    path: Path
    start: int
    end: int
    preset: str
    revision: str
    artifact_id: str
    kinds: list[str]  # the whole model's layer kinds ([] unknown)
    gguf: GGUFModel | None = None  # the whole model, when it is on this machine


def parse_size(text: str) -> int:
    """'650M', '2G', '1.5GiB', '4096' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"bad size {text!r}: write it like 650M or 2G")
    return int(float(m.group(1)) * 1024 ** "bkmgt".index((m.group(2) or "b").lower()))


def local_source(model: str, layers: str) -> Source:
    """A model on this machine (a preset or a path), and the range of it to serve."""
    path = models.resolve(model)
    gguf = GGUFModel(path)
    start, end = parse_layers(layers, gguf.n_layers)
    kinds = [] if gguf.field(META_PREFIX + "layer_start") is not None else layer_kinds(gguf)  # a slice: unknown
    check_cut(kinds, start, end)
    return Source(path, start, end, models.preset_for(path), models.revision(path), "", kinds, gguf)


async def fetch_range(js, artifact_id: str, start: int, end: int) -> Source:
    """The verified slice [start, end) of an artifact, from the local cache or the shard swarm."""
    manifest = await fetch_manifest(js, artifact_id)
    kinds = manifest.cache_descriptor.layer_kinds
    check_cut(kinds, start, end)  # before fetching a slice llama.cpp could not load
    path = await resolve_artifact(js, artifact_id, start, end, models.cache_dir() / "artifacts")
    return Source(path, start, end, manifest.model_preset, artifact_id, artifact_id, kinds)


async def fetch_slice(url: str, artifact_id: str, layers: str) -> Source:
    """``--artifact ID --layers A-B``."""
    nc = await connect(url, name="neuron-worker-fetch", max_reconnect_attempts=3)
    try:
        js = nc.jetstream()
        start, end = parse_layers(layers, n_layers(await fetch_manifest(js, artifact_id)))
        return await fetch_range(js, artifact_id, start, end)
    finally:
        await nc.close()


def check_fit(manifests: list[M.ArtifactManifest], fit: M.NodeFit) -> None:
    """Refuse a budget that cannot hold even one layer of any of the models."""
    if not fit.memory_budget:
        return
    needs = {m.model_preset: footprint(m, fit.kv_positions).smallest() for m in manifests}
    if all(need > fit.memory_budget for need in needs.values()):
        least = min(needs.values())
        raise ArtifactError(
            Reason.TOO_SMALL,
            f"--max-memory {fit.memory_budget} bytes cannot hold even one layer: the smallest needs {least} "
            f"(weights + KV for {fit.kv_positions} positions); give more memory or fewer --max-sessions/--n-ctx",
        )


async def ask_for_range(nc, req: M.PlacementRequest, wait_s: float = PLACEMENT_WAIT_S) -> M.PlacementDecision:
    """The tracker's placement for this node (asked again until a tracker answers, up to ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            msg = await nc.request(S.TRACKER_PLACE, M.encode(req), timeout=5.0)
            reply = M.decode(msg.data, M.PlacementReply)
        except (TimeoutError, NatsError, MalformedMessage) as exc:  # no tracker (yet), or not the lease holder
            if time.monotonic() > deadline:
                raise ArtifactError(
                    Reason.NO_TRACKER, f"no tracker placed this node within {wait_s:.0f}s ({exc})"
                ) from None
            await asyncio.sleep(1.0)
            continue
        if isinstance(reply, M.PlacementRejection):
            raise ArtifactError(Reason.NOT_PLACED, "the tracker placed this node nowhere: " + "; ".join(reply.reasons))
        return reply


async def auto_source(url: str, model: str, fit: M.NodeFit, node_id: str, backend_id: str, tier: M.TrustTier) -> Source:
    """``--layers auto``: a model and a range from the tracker, within ``fit``; its slice fetched."""
    preset = (
        model if model == "any" else (model if model in models.PRESETS else models.preset_for(models.resolve(model)))
    )
    nc = await connect(url, name=f"neuron-worker-{node_id}-placement", max_reconnect_attempts=3)
    try:
        js = nc.jetstream()
        manifests = await Catalog(js).models(preset, fresh=True)
        if not manifests:
            what = "any model" if preset == "any" else f"model {preset}"
            raise ArtifactError(
                Reason.NO_ARTIFACT, f"no published artifact of {what}: publish it first (`neuron-bus artifact publish`)"
            )
        check_fit(manifests, fit)
        req = M.PlacementRequest(node_id=node_id, model_preset=preset, fit=fit, backend_id=backend_id, trust_tier=tier)
        d = await ask_for_range(nc, req)
        print(f"placed on {d.model_preset} layers {format_layers(d.layer_start, d.layer_end)}: {d.reason}", flush=True)
        return await fetch_range(js, d.artifact_id, d.layer_start, d.layer_end)
    finally:
        await nc.close()
