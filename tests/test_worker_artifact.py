"""A worker can start from the shard swarm (JetStream Object Store) instead of a local file."""

from __future__ import annotations

import asyncio

import pytest

from neuron_bus import messages as M
from neuron_bus.artifacts.gguf_model import GGUFModel
from neuron_bus.artifacts.slicing import slice_info
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_workers_fetch_only_their_range_and_the_route_matches_the_local_file(smollm2_path, tmp_path, monkeypatch):
    from workers.tokenizer import Tokenizer

    ids = Tokenizer(smollm2_path).encode("Three facts about whales:")
    sampling = M.SamplingParams(max_tokens=12, ignore_eos=True)

    async def generate(url):
        async with await NeuronClient.connect(url) as c:
            return await c.complete(prompt_tokens=ids, sampling=sampling)

    with LocalSwarm(smollm2_path, 2, workdir=tmp_path / "local") as local:
        expected = asyncio.run(generate(local.url)).tokens

    cache = tmp_path / "cache"
    monkeypatch.setenv("NEURON_BUS_CACHE", str(cache))  # an empty cache: workers must fetch
    with LocalSwarm(smollm2_path, 2, workdir=tmp_path / "store", from_store=True) as swarm:
        got = asyncio.run(generate(swarm.url)).tokens
        artifact = swarm.artifact_id
    assert got == expected
    slices = sorted((cache / "artifacts" / artifact).glob("*.gguf"))
    ranges = sorted((slice_info(p)["layer_start"], slice_info(p)["layer_end"]) for p in slices)
    assert ranges == [(0, 19), (19, 30)]  # the work-balanced split (neuron_bus.split)
    full = GGUFModel(smollm2_path)
    for p in slices:
        info = slice_info(p)
        assert GGUFModel(p).n_layers == info["layer_end"] - info["layer_start"] < full.n_layers
