"""Routes over the seed's target architectures: real nats-server, tracker and worker processes
(LocalSwarm, `neuron-bus up`) serving synthetic models (artifacts/synthetic.py) generate the same
greedy tokens as the whole model in one process; a hybrid model's route is not repaired from a
snapshot, because its surviving hop cannot take its recurrent state back, and says so."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess

import numpy as np
import pytest

from neuron_bus import messages as M
from neuron_bus.artifacts.cuts import is_moe, layer_kinds
from neuron_bus.artifacts.gguf_model import GGUFModel
from neuron_bus.artifacts.synthetic import write_model
from neuron_bus.artifacts.work import head_weights, owned_layer_work
from neuron_bus.client import NeuronClient, RouteError
from neuron_bus.execution import open_reference
from neuron_bus.local_swarm import LocalSwarm, WorkerSpec, cli
from neuron_bus.split import model_split
from tests.test_reliability import node_alive
from tests.test_trust import ledger_entries, read
from tests.test_up import running_up
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(600)

TEXT = "the quick brown fox jumps over the lazy dog"


def reference_tokens(path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the whole model in this process (EOS ignored)."""
    full = open_reference(path, n_ctx=len(prompt) + n + 8, max_sessions=1, threads=1, benchmark=False)
    try:
        full.open_session("ref", len(prompt) + n + 8)
        logits = full.prefill("ref", 0, np.array(prompt, dtype=np.int32))
        out = []
        for i in range(n):
            out.append(int(logits.argmax()))
            logits = full.decode_step("ref", len(prompt) + i, np.array(out[-1:], dtype=np.int32))
        return out
    finally:
        full.close()


def prompt_tokens(path) -> list[int]:
    full = open_reference(path, n_ctx=64, max_sessions=1, threads=1, benchmark=False)
    try:
        return full.tokenize(TEXT)
    finally:
        full.close()


async def complete(url: str, preset: str, ids: list[int], n: int):
    async with await NeuronClient.connect(url) as c:
        return await c.complete(
            prompt_tokens=ids,
            model_preset=preset,
            sampling=M.SamplingParams(max_tokens=n, ignore_eos=True),
            chunk_size=8,
        )


@pytest.mark.parametrize("arch", ["deepseek2", "qwen35", "nemotron_h"])
def test_a_two_hop_route_generates_the_whole_models_tokens(arch, tmp_path):
    """DeepSeek-2 (MLA + MoE with a dense first layer), Qwen3.5 (gated delta net + gated attention,
    M-RoPE) and Nemotron-H (Mamba-2 + attention + MLP blocks) over two worker processes."""
    path = write_model(tmp_path / f"{arch}.gguf", arch)
    model = GGUFModel(path)
    ids, n = prompt_tokens(path), 32
    with LocalSwarm(path, 2, workdir=tmp_path / "swarm") as swarm:
        assert [w.layers for w in swarm.workers] == model_split(model, 2)
        g = asyncio.run(complete(swarm.url, swarm.preset, ids, n))

        def entries():
            es = [e for e in asyncio.run(read(swarm.url, ledger_entries)) if e.session_id == g.session_id]
            return es if len(es) == 2 else None

        ledger = {e.layer_start: e for e in wait_for(entries, 30, "two ledger entries")}
    assert len(g.route.hops) == 2
    assert g.tokens == reference_tokens(path, ids, n)
    # the ledger credits each hop the weights its tokens multiply: for MoE layers the active experts
    for (a, b), entry in zip(model_split(model, 2), (ledger[h.layer_start] for h in g.route.hops)):
        assert entry.owned_layer_work == pytest.approx(owned_layer_work(model, a, b), rel=1e-6)
        stored = sum(math.prod(t.shape) for t in model.layer_tensors(a, b)) / 1e6
        stored += head_weights(model) / 1e6 if b == model.n_layers else 0
        if any(is_moe(k) for k in layer_kinds(model)[a:b]):
            assert entry.owned_layer_work < 0.95 * stored
        else:
            assert entry.owned_layer_work == pytest.approx(stored, rel=1e-6)


def test_up_serves_a_synthetic_moe_model_with_the_whole_models_output(tmp_path):
    path = write_model(tmp_path / "qwen3moe.gguf", "qwen3moe")
    with running_up(tmp_path / "up", "--model", str(path)) as (_up, port, _gateway):
        out = subprocess.run(
            cli()
            + ["generate", TEXT, "--nats", f"nats://127.0.0.1:{port}", "--model", "qwen3moe", "--max-tokens", "24"]
            + ["--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["nodes"] == ["worker-0", "worker-1"]
    tokens = result["tokens"]
    assert tokens and tokens == reference_tokens(path, prompt_tokens(path), len(tokens))


def test_a_hybrid_route_is_not_repaired_from_a_snapshot_and_says_why(tmp_path):
    """Snapshots of a Qwen3.5 session restore (tests/test_architectures.py), but repair also needs
    the surviving hop to go back to the snapshot's position, which recurrent state cannot."""
    path = write_model(tmp_path / "qwen35.gguf", "qwen35")
    ranges = model_split(GGUFModel(path), 2)
    snap = ["--snapshot-every", "4"]
    swarm = LocalSwarm(path, workdir=tmp_path / "swarm", ranges=ranges, worker_extra={0: snap, 1: snap})
    swarm.start()
    try:
        replica = WorkerSpec(ranges[1], "worker-2", list(snap))
        swarm.workers.append(replica)
        swarm.start_worker(replica)
        asyncio.run(node_alive(swarm.url, "worker-2"))
        ids = prompt_tokens(path)

        async def generate_and_kill():
            tokens, error = [], None
            async with await NeuronClient.connect(swarm.url) as c:
                route = await c.route(swarm.preset)
                victim = route.hops[1].node_id
                try:
                    async for ev in c.generate(
                        prompt_tokens=ids,
                        route=route,
                        model_preset=swarm.preset,
                        sampling=M.SamplingParams(max_tokens=3000, ignore_eos=True),
                    ):
                        if isinstance(ev, M.TokenDelta):
                            tokens.append(ev.token_id)
                            if len(tokens) == 12:
                                await asyncio.to_thread(swarm.kill, victim)
                except RouteError as exc:
                    error = exc
            return tokens, error

        tokens, error = asyncio.run(generate_and_kill())
    finally:
        swarm.stop()
    assert error is not None, "the session went on without its tail"
    assert "no_rollback" in str(error) and "recurrent state" in str(error), str(error)
    assert 12 <= len(tokens) < 3000
    assert tokens == reference_tokens(path, ids, len(tokens))  # nothing wrong was emitted before the end
