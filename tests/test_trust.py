"""Trust acceptance on real processes: a NATS server enforcing generated role permissions, a
tracker sampling every session for replay, an auditor replaying on single-process llama.cpp, and
four SmolLM2 workers with trust tiers (an uneven 0-19 / 20-29 split, two replicas of each range),
one of which perturbs its outputs (``--fault perturb``).

- private/paid-trusted routes only use trusted nodes (mixed tiers);
- the tail's validation event reproduces the route and output (`neuron-bus audit replay` agrees);
- the faulty worker is caught by sampled replays, flagged and excluded; honest nodes are not;
- the heavier shard (20 layers) earns more than the lighter one (10 layers + head) for the same
  tokens; a seeding-only node earns no inference reward.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pytest

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm, cli
from neuron_bus.topology import connect
from neuron_bus.trust.events import stored, validation_event
from neuron_bus.trust.permissions import new_passwords
from tests.waiting import wait_for

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

PROMPT = "The three primary colors are"
TRUSTED = {"worker-0", "worker-1"}
FAULTY = "worker-3"


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    s = LocalSwarm(
        smollm2_path,
        workdir=tmp_path_factory.mktemp("trust"),
        ranges=[(0, 20), (20, 30), (0, 20), (20, 30)],
        worker_extra={
            0: ["--trust-tier", "trusted"],
            1: ["--trust-tier", "trusted"],
            2: ["--trust-tier", "untrusted"],
            3: ["--trust-tier", "untrusted", "--fault", "perturb"],
        },
        tracker_extra=["--audit-rate", "1.0"],
        auditor_extra=[],
        credentials=new_passwords(),
    )
    s.start(timeout=300)
    yield s
    s.stop()


def run(coro):
    return asyncio.run(coro)


async def generate(url: str, policy: str = "public", max_tokens: int = 8):
    async with await NeuronClient.connect(url) as c:
        return await c.complete(
            PROMPT, policy=policy, sampling=M.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )


async def routes(url: str, policy: str, n: int) -> list[M.RouteAssignment]:
    async with await NeuronClient.connect(url) as c:
        return [await c.route("smollm2-135m", policy=policy) for _ in range(n)]


async def read(url: str, fn):
    nc = await connect(url)
    try:
        return await fn(nc.jetstream())
    finally:
        await nc.close()


async def flags(js) -> dict[str, M.NodeTrust]:
    """Every node's trust record in KV neuron-flags; an entry that is not one (fuzzed) is left out."""
    kv = await js.key_value(S.KV_FLAGS)
    try:
        keys = await kv.keys()
    except Exception:  # NoKeysError: nobody flagged yet
        return {}
    out = {}
    for k in keys:
        try:
            out[k] = M.decode((await kv.get(k)).value, M.NodeTrust)
        except Exception:
            continue
    return out


async def verdicts(js) -> list[M.AuditVerdict]:
    return [v async for v in stored(js, S.STREAM_AUDIT, f"{S.ROOT}.audit.verdict.>", M.AuditVerdict)]


async def ledger_entries(js) -> list[M.LedgerEntry]:
    return [e async for e in stored(js, S.STREAM_LEDGER, S.LEDGER_ALL, M.LedgerEntry)]


def test_private_and_paid_trusted_routes_use_only_trusted_nodes(swarm):
    client = swarm.role_url("client")
    for policy in ("private", "paid-trusted"):
        for r in run(routes(client, policy, 6)):
            assert {h.node_id for h in r.hops} <= TRUSTED, r.hops
            assert all(h.trust_tier in ("trusted", "paid-trusted") for h in r.hops)
            assert r.policy == policy
    public = run(routes(client, "public", 8))
    assert any({h.node_id for h in r.hops} - TRUSTED for r in public), "public routes may use untrusted nodes"


def test_private_generation_records_a_reproducible_validation_event(swarm):
    """Generation under the client role; event read back; `neuron-bus audit replay` agrees."""
    g = run(generate(swarm.role_url("client"), "private", max_tokens=8))
    assert {h.node_id for h in g.route.hops} <= TRUSTED and len(g.tokens) == 8
    event = wait_for(
        lambda: _try(lambda: run(read(swarm.url, lambda js: validation_event(js, g.session_id)))),
        30,
        "the validation event",
    )
    assert event.policy == "private" and event.route_id == g.route.route_id
    assert [(m.node_id, m.layer_start, m.layer_end, m.trust_tier) for m in event.route] == [
        (h.node_id, h.layer_start, h.layer_end, h.trust_tier) for h in g.route.hops
    ]
    assert all(m.backend_id == "llama-cpp" and m.cache_abi for m in event.route)
    assert event.prompt_tokens == g.prompt_tokens and event.output_tokens == g.tokens
    assert len(event.prompt_sha256) == 64 and event.sampling.max_tokens == 8
    assert [s.index for s in event.logit_samples] == [0, 1, 2, 3] and len(event.logit_samples[0].logits) == 8
    assert event.model_revision == g.route.model_revision and event.tail_node_id == g.route.hops[-1].node_id
    done = subprocess.run(
        cli() + ["audit", "replay", g.session_id, "--nats", swarm.url, "--json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    verdict = json.loads(done.stdout.strip().splitlines()[-1])
    assert verdict["verdict"] == "agree", verdict
    assert verdict["compared_tokens"] == 8 and verdict["max_logit_diff"] <= verdict["tolerance"]
    # the event id works as well as the session id
    by_id = subprocess.run(
        cli() + ["audit", "replay", event.event_id, "--nats", swarm.url], capture_output=True, text=True, timeout=180
    )
    assert by_id.returncode == 0 and "agree" in by_id.stdout, by_id.stdout + by_id.stderr


def _try(fn):
    try:
        return fn()
    except Exception:
        return None


def test_faulty_worker_is_caught_by_sampled_replays_and_excluded(swarm):
    client = swarm.role_url("client")
    deadline = time.monotonic() + 240
    flagged = {}
    used = []
    while time.monotonic() < deadline:
        g = run(generate(client, "public", max_tokens=6))
        used.append([h.node_id for h in g.route.hops])
        time.sleep(1.0)  # let the auditor catch up
        flagged = {n: t for n, t in run(read(swarm.url, flags)).items() if t.flagged}
        if FAULTY in flagged:
            break
    assert FAULTY in flagged, (used, run(read(swarm.url, flags)), swarm.log_tail("auditor", 20))
    assert set(flagged) == {FAULTY}, flagged  # honest nodes are not flagged
    records = run(read(swarm.url, flags))
    assert records[FAULTY].attributed >= 2 and records[FAULTY].agreements == 0
    vs = run(read(swarm.url, verdicts))
    assert all(v.verdict == "disagree" for v in vs if FAULTY in v.members)
    assert all(v.verdict == "agree" for v in vs if FAULTY not in v.members)
    # the tracker excludes it from later routes (it reads the flags every second)
    time.sleep(2.5)
    later = run(routes(client, "public", 8))
    assert all(FAULTY not in {h.node_id for h in r.hops} for r in later)
    g = run(generate(client, "public", max_tokens=4))
    assert FAULTY not in {h.node_id for h in g.route.hops}


def test_heavier_shard_earns_more_and_seeding_is_not_inference(swarm, tiny_gguf):
    g = run(generate(swarm.role_url("client"), "private", max_tokens=8))
    session = g.session_id

    def entries():
        es = [e for e in run(read(swarm.url, ledger_entries)) if e.session_id == session]
        return es if len(es) == 2 else None

    es = {e.node_id: e for e in wait_for(entries, 30, "two ledger entries")}
    head, tail = es["worker-0"], es["worker-1"]
    assert (head.layer_start, head.layer_end, tail.layer_start, tail.layer_end) == (0, 20, 20, 30)
    assert head.prefill_tokens == tail.prefill_tokens == len(g.prompt_tokens)
    assert head.decode_tokens == tail.decode_tokens == 7  # the last token is not fed back
    assert head.owned_layer_work > tail.owned_layer_work > 0
    assert head.reward_weight > tail.reward_weight
    assert head.reward_weight == pytest.approx(head.owned_layer_work * (head.prefill_tokens + head.decode_tokens))
    pub = subprocess.run(
        cli() + ["artifact", "publish", str(tiny_gguf), "--node-id", "seeder", "--nats", swarm.url],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert pub.returncode == 0, pub.stdout + pub.stderr
    out = subprocess.run(cli() + ["ledger", "--json", "--nats", swarm.url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    totals = json.loads(out.stdout)
    assert totals["seeder"]["inference_weight"] == 0 and totals["seeder"]["seeding_bytes"] > 0

    def per_token(node):  # nodes served different numbers of sessions in this module: compare per token
        t = totals[node]
        return t["inference_weight"] / (t["prefill_tokens"] + t["decode_tokens"])

    assert per_token("worker-0") == pytest.approx(head.owned_layer_work)
    assert per_token("worker-0") > per_token("worker-1") > 0
    assert totals["worker-0"]["seeding_bytes"] == 0
