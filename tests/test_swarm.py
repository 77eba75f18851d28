"""A swarm that organizes itself (issue 17), with real processes: workers started with ``--layers
auto`` get their ranges from the tracker's placement, fetch them from the shard swarm, move when
the tracker asks (draining first: no session lost), and a gap left by a lost node is filled."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.artifacts.footprint import footprint
from neuron_bus.artifacts.manifest import build_manifest
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm, WorkerSpec, cli
from neuron_bus.tracker.placement import Fit
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GREEDY = M.SamplingParams(max_tokens=16, ignore_eos=True)
LONG = 240  # tokens: seconds of decode, long enough to be running when its node is asked to move


def ranges(swarm: LocalSwarm) -> dict[str, tuple[int, int]]:
    return swarm.ready_ranges()


def covered(swarm: LocalSwarm, n_layers: int = 30) -> bool:
    return swarm.covered(n_layers)


def generate(swarm: LocalSwarm, ids: list[int]) -> list[int]:
    async def run():
        async with await NeuronClient.connect(swarm.url) as c:
            return (await c.complete(prompt_tokens=ids, sampling=GREEDY)).tokens

    return asyncio.run(run())


def prompt(reference, text: str = "The history of the printing press begins") -> list[int]:
    return reference.tokenizer.encode(text)


@pytest.mark.parametrize("budget", [["--max-layers", "20"], ["--max-memory", "650M"]], ids=["max-layers", "max-memory"])
def test_three_auto_workers_cover_the_model_and_generate_the_reference(smollm2_path, tmp_path, reference, budget):
    swarm = LocalSwarm(smollm2_path, workdir=tmp_path, auto_workers=3, worker_extra={i: budget for i in range(3)})
    with swarm:
        held = ranges(swarm)
        assert len(held) == 3 and covered(swarm)
        fp = footprint(build_manifest(smollm2_path), 8 * 4608)
        fit = Fit(20 if "--max-layers" in budget else 1 << 20, 650 << 20, fp.layer_bytes, fp.head_bytes, fp.embd_bytes)
        # each range fits: at most 20 layers, or (650 MiB) the weights and KV of 8 slots of 4608 positions
        assert all(fit.fits(a, b, 30) for a, b in held.values()), held
        ids = prompt(reference)
        assert generate(swarm, ids) == reference(ids, 16)


def test_a_lost_tail_is_covered_by_a_move_and_a_node_asked_to_move_finishes_its_session(
    smollm2_path, tmp_path, reference
):
    swarm = LocalSwarm(
        smollm2_path, workdir=tmp_path, auto_workers=3, worker_extra={i: ["--max-layers", "15"] for i in range(3)}
    )
    with swarm:
        held = ranges(swarm)
        tails = [n for n, (a, b) in held.items() if b == 30]
        heads = [n for n, (a, b) in held.items() if b < 30]
        assert len(tails) == 1 and len(heads) == 2  # two replicas of 0-14, one of 15-29
        ids = prompt(reference)

        # a session decoding on a node the tracker asks to move: the node drains, the session finishes undisturbed
        async def session_through_a_move():
            async with await NeuronClient.connect(swarm.url) as c:
                route = await c.route(swarm.preset)
                mover = route.hops[0].node_id
                sampling = M.SamplingParams(max_tokens=LONG, ignore_eos=True)
                run = asyncio.create_task(c.complete(prompt_tokens=ids, route=route, sampling=sampling))
                # decoding on the mover before it is asked (a fixed 0.5 s was too short under the full suite's load)
                deadline = time.monotonic() + 30
                while not any(x.position > len(ids) for x in (await c.sessions(mover)).sessions):
                    assert time.monotonic() < deadline and not run.done(), "the session never decoded on its head"
                    await asyncio.sleep(0.05)
                other = next(n for n in heads if n != mover) if mover in heads else None
                move = M.MoveRange(
                    model_preset=swarm.preset, artifact_id=swarm.artifact_id, layer_start=0, layer_end=15, reason="test"
                )
                # as the tracker's placer asks: on the node's .move subject (trackers alone may publish there)
                answer = await c.nc.request(S.node_move(mover), M.encode(move), timeout=10)
                reply = M.decode(answer.data, M.ControlReply)
                assert isinstance(reply, M.MoveAccepted) and reply.sessions_draining >= 1
                return (await run).tokens, other

        tokens, _ = asyncio.run(session_through_a_move())
        assert tokens == reference(ids, LONG)

        # the only tail dies: a head replica moves there, and the swarm serves again
        lost_at = time.monotonic()
        swarm.kill(tails[0])
        wait_for(lambda: covered(swarm) and tails[0] not in ranges(swarm), 60, "a node covering the lost tail")
        assert time.monotonic() - lost_at < 60
        assert generate(swarm, ids) == reference(ids, 16)


def weakest(swarm: LocalSwarm, candidates: list[tuple[int, int]]) -> tuple[tuple[int, int], dict]:
    """Of ``candidates``, the range whose layers carry the least decode tok/s in the tracker's
    coverage map (the summed measured rates of the live replicas), and every candidate's figure."""
    (group,) = swarm.coverage(swarm.preset).models
    per_layer = {c.layer: c.capacity_tokens_per_second for c in group.layers}
    carried = {r: min(per_layer[i] for i in range(*r)) for r in candidates}
    return min(candidates, key=carried.__getitem__), carried


def test_a_fourth_worker_takes_the_weakest_range_and_the_slow_replica_is_the_one_that_moves(smollm2_path, tmp_path):
    extra = {i: ["--max-layers", "15"] for i in range(2)}
    swarm = LocalSwarm(smollm2_path, workdir=tmp_path, auto_workers=2, worker_extra=extra)
    with swarm:
        halves = [(0, 15), (15, 30)]
        assert sorted(ranges(swarm).values()) == halves

        def join(node: str, *args: str) -> tuple[int, int]:
            spec = WorkerSpec(None, node, ["--max-layers", "15", *args])
            swarm.workers.append(spec)
            swarm.start_worker(spec)
            return wait_for(lambda: ranges(swarm).get(node), 120, f"{node} to take a range")

        slow = join("slow", "--slow-ms", "40")  # a second replica of one of the two halves
        # a fourth joins a covered swarm: the half whose layers carry the least per second. Which
        # one that is depends on the measured rates: the slow replica adds little to its half, so
        # when it joined the tail's half (the output head makes it the slower one) that half can
        # still be the weakest.
        expected, carried = weakest(swarm, halves)
        assert join("fourth") == expected, (ranges(swarm), carried)
        # the fourth goes, then the other half's nodes: the slow replica and a faster one hold the
        # slow one's half, either would serve the gap as well as the other keeps the half (the
        # bottleneck is the slow one's rate both ways), and the slow one moves. (The fourth first,
        # and gone from the map: while the tracker still counts a dead fourth in the slow one's
        # half, moving the faster one there raises the bottleneck more, and it is the one asked.)
        other = halves[1 - halves.index(slow)]
        swarm.kill("fourth")
        wait_for(lambda: "fourth" not in ranges(swarm), 60, "the fourth to leave the coverage map")
        gone = {node for node, r in ranges(swarm).items() if r == other}
        for node in gone:
            swarm.kill(node)
        wait_for(lambda: not gone & set(ranges(swarm)) and covered(swarm), 90, "the gap to be covered again")
        assert ranges(swarm)["slow"] == other, ranges(swarm)


def test_two_trackers_never_hand_the_same_gap_to_two_nodes(smollm2_path, tmp_path):
    extra = {i: ["--max-layers", "15"] for i in range(2)}
    swarm = LocalSwarm(smollm2_path, workdir=tmp_path, auto_workers=2, trackers=2, worker_extra=extra)
    with swarm:  # the two workers joined at the same time, each asking whichever tracker answers
        # the coverage map comes from either tracker, and the one that answers may hear of a
        # worker's readiness a little later (relayed heartbeats): wait until it lists both
        def both_ready() -> dict[str, tuple[int, int]] | None:
            held = ranges(swarm)
            return held if len(held) == 2 else None

        held = wait_for(both_ready, 30, "both workers ready")
        assert len(held) == 2 and held["worker-0"] != held["worker-1"] and covered(swarm)


def test_a_worker_for_any_model_serves_the_published_model_that_needs_it_most(smollm2_path, tmp_path):
    from neuron_bus.artifacts.synthetic import write_model

    synthetic = write_model(tmp_path / "llama.gguf", "llama")
    swarm = LocalSwarm(smollm2_path, workdir=tmp_path / "swarm", auto_workers=1)  # covers SmolLM2 whole
    with swarm:
        assert ranges(swarm) == {"worker-0": (0, 30)}
        artifact = swarm.publish(synthetic)
        spec = WorkerSpec(None, "any-model", model="any")
        swarm.workers.append(spec)
        swarm.start_worker(spec)

        def groups() -> dict[str, M.ModelCoverage]:
            return {g.model_preset: g for g in swarm.coverage().models}

        def covering() -> M.ModelCoverage | None:
            group = groups().get("llama")
            return group if group and all(c.replicas == ["any-model"] for c in group.layers) else None

        # of the two published models SmolLM2 is covered and the synthetic one has no node: it takes that one, whole
        group = wait_for(covering, 120, "the any-model worker to cover the synthetic model")
        assert len(group.layers) == group.n_layers_total
        assert groups()["smollm2-135m"].layers[0].replicas == ["worker-0"]
        decisions = swarm.coverage().placements
        assert any(d.node_id == "any-model" and d.artifact_id == artifact for d in decisions), decisions


def test_bad_input_is_refused_before_anything_loads(smollm2_path, tmp_path):
    swarm = LocalSwarm(smollm2_path, workdir=tmp_path, auto_workers=1)
    with swarm:

        def worker(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                cli() + ["worker", "--nats", swarm.url, "--threads", "1", *args],
                capture_output=True,
                text=True,
                timeout=120,
            )

        small = worker("--model", swarm.preset, "--layers", "auto", "--max-memory", "1M")
        assert small.returncode == 1 and "cannot hold even one layer" in small.stderr, small.stderr
        unknown = worker("--model", "no-such-model", "--layers", "auto")
        assert unknown.returncode == 1 and "no-such-model" in unknown.stderr and "Traceback" not in unknown.stderr
        unpublished = worker("--model", "gemma3-270m", "--layers", "auto")
        assert unpublished.returncode == 1 and "no published artifact" in unpublished.stderr, unpublished.stderr
