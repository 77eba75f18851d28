"""Metered rewards on real processes (every one on its role's credentials): a worker that claims
twice the positions it computed (``--fault inflate-ledger``) is paid what the swarm observed and
flagged; its honest neighbour is paid its claim; a session the client abandons mid-decode is
metered from the tokens delivered, with its step in flight allowed."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm, cli
from neuron_bus.topology import connect
from neuron_bus.trust.meter import KV_METER
from neuron_bus.trust.permissions import new_passwords
from tests.waiting import wait_for

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PROMPT = "The three primary colors are"
LIAR = "worker-1"


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    s = LocalSwarm(
        smollm2_path,
        2,
        workdir=tmp_path_factory.mktemp("meter"),
        worker_extra={1: ["--fault", "inflate-ledger"]},
        credentials=new_passwords(),
    )
    s.start(timeout=300)
    yield s
    s.stop()


async def _read(url: str, session_id: str):
    nc = await connect(url)
    try:
        js = nc.jetstream()
        kv = await js.key_value(KV_METER)
        try:
            meter = M.decode((await kv.get(session_id)).value, M.SessionMeter)
        except Exception:
            meter = None
        nodes = await js.key_value(S.KV_NODES)
        reports = {n: M.decode((await nodes.get(n)).value, M.CapabilityReport) for n in ("worker-0", "worker-1")}
        return meter, reports
    finally:
        await nc.close()


def meter_of(swarm, session_id: str) -> M.SessionMeter:
    return wait_for(lambda: asyncio.run(_read(swarm.url, session_id))[0], 30, f"the meter of {session_id}")


def ledger(swarm) -> dict:
    out = subprocess.run(cli() + ["ledger", "--json", "--nats", swarm.url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_worker_claiming_twice_its_work_is_paid_the_metered_figure_and_flagged(swarm):
    async def generate():
        async with await NeuronClient.connect(swarm.role_url("client")) as c:
            return await c.complete(PROMPT, sampling=M.SamplingParams(max_tokens=8, ignore_eos=True))

    g = asyncio.run(generate())
    meter = meter_of(swarm, g.session_id)
    _, reports = asyncio.run(_read(swarm.url, g.session_id))
    assert meter.status == "finished" and meter.route_id == g.route.route_id
    assert meter.prompt_tokens == len(g.prompt_tokens) and meter.delivered_tokens == 8
    assert {"assignment", "token-deltas", "validation", "layer-work"} <= set(meter.sources)
    for m in meter.members:  # every hop computed the prompt and the 7 tokens fed back; work from the reports
        assert (m.prefill_tokens, m.decode_tokens) == (len(g.prompt_tokens), 7)
        assert m.owned_layer_work == pytest.approx(sum(reports[m.node_id].active_parameters_per_layer))
    rows = ledger(swarm)
    liar, honest = rows[LIAR], rows["worker-0"]
    metered = {m.node_id: m.reward_weight for m in meter.members}
    assert liar["flagged"] and liar["inference_weight"] == pytest.approx(metered[LIAR])
    assert liar["claimed_weight"] == pytest.approx(2 * metered[LIAR])
    assert (liar["claimed_prefill_tokens"], liar["claimed_decode_tokens"]) == (2 * len(g.prompt_tokens), 14)
    assert liar["flags"][0]["session_id"] == g.session_id and "claimed" in liar["flags"][0]["reason"]
    assert not honest["flagged"] and honest["inference_weight"] == pytest.approx(honest["claimed_weight"])
    assert honest["inference_weight"] == pytest.approx(metered["worker-0"])
    table = subprocess.run(cli() + ["ledger", "--nats", swarm.url], capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "flagged" in table.stdout and LIAR in table.stdout, table.stdout
    assert f"flagged {LIAR} session {g.session_id}" in " ".join(table.stdout.split())
    assert "is flagged" in swarm.log_tail("tracker", 40)  # the meter says so as it meters


def test_an_abandoned_session_is_metered_from_the_tokens_delivered(swarm):
    async def abandon() -> tuple[str, int]:
        got = 0
        async with await NeuronClient.connect(swarm.role_url("client")) as c:
            gen = c.generate(PROMPT, sampling=M.SamplingParams(max_tokens=200, ignore_eos=True))
            async for ev in gen:
                if isinstance(ev, M.TokenDelta):
                    got += 1
                    if got == 6:
                        break
            await gen.aclose()  # closes the session on every hop
            return ev.session_id, got

    session_id, _ = asyncio.run(abandon())
    meter = meter_of(swarm, session_id)
    assert meter.status == "unfinished" and meter.delivered_tokens >= 6
    for m in meter.members:
        assert m.decode_tokens == meter.delivered_tokens - 1 and m.max_decode_tokens == meter.delivered_tokens
    honest = ledger(swarm)["worker-0"]
    assert not honest["flagged"], honest["flags"]
