"""A node's control subject answered by something other than a neuron-bus node of this protocol
(a faulty build, a foreign responder): the client names the node and says what it got, as a
``bad_reply`` route error, instead of failing later on a missing attribute. Real nats-server."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import pytest

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.client import NeuronClient, RouteError
from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.natsserver import free_port
from tests.test_tracker import Node, eventually
from workers.errors import Reason

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def client(nats_server):
    async with await NeuronClient.connect(nats_server.url, tracker_wait=0) as c:
        yield c


async def answer_with(client: NeuronClient, node: str, reply) -> None:
    async def respond(msg) -> None:
        await msg.respond(M.encode(reply))

    await client.nc.subscribe(S.node_control(node), cb=respond)
    await client.nc.flush()


@pytest.mark.parametrize(
    "req, wrong",
    [
        (M.SessionsQuery(), M.Pong(node_id="odd", sent_at=0.0)),
        (M.TokenizeRequest(text="hi"), M.SessionClosed(session_id="s", node_id="odd", freed_bytes=0)),
        (M.Ping(sent_at=0.0), M.TokenizeReply(tokens=[1], text="hi")),
    ],
    ids=["sessions-query", "tokenize", "ping"],
)
async def test_a_reply_of_the_wrong_kind_is_a_bad_reply_naming_the_node(client, req, wrong, caplog):
    await answer_with(client, "odd", wrong)
    for _ in range(2):
        with pytest.raises(RouteError) as err:
            await client.control("odd", req, timeout=5)
    assert err.value.reason == Reason.BAD_REPLY
    assert err.value.node_id == "odd"
    assert f"node odd answered {type(req).__name__} with {type(wrong).__name__}" in str(err.value)
    assert client.suspects.current() == {"odd"}  # its routes go around it from now on
    warned = [r.getMessage() for r in caplog.records if "routes avoid it for 600 s" in r.getMessage()]
    assert len(warned) == 1 and "node odd answered" in warned[0], warned  # once, not at every bad reply


async def test_every_control_request_has_its_answer(client):
    """Each request the node's control subject takes has one reply kind, and the client accepts it."""
    requests = set(M.ControlRequest.__args__)  # type: ignore[attr-defined]
    assert set(M.CONTROL_ANSWERS) == requests
    await answer_with(client, "good", M.Pong(node_id="good", sent_at=1.0))
    assert await client.control("good", M.Ping(sent_at=1.0), timeout=5) == M.Pong(node_id="good", sent_at=1.0)


class Rogue(Node):
    """A node the tracker lists like any other (the workers' own report, but faster, so it is
    routed first) that answers control requests with a Pong, a faulty build: every request but a
    ping, or (``tokenizes``) every one but a ping or a tokenization (then it fails at the open)."""

    def __init__(self, nc, caps: M.CapabilityReport, tokenizes: bool):
        per_layer = caps.active_parameters_per_layer[:1] * caps.n_layers_total
        tps = 10 * caps.decode_tokens_per_second
        fields = msgspec.structs.asdict(caps) | {
            "prefill_tokens_per_second": 10 * caps.prefill_tokens_per_second,
            "decode_tokens_per_second": tps,
            "active_parameters_per_layer": per_layer,
        }
        for name in ("node_id", "layer_start", "layer_end"):
            del fields[name]
        super().__init__(nc, "rogue", 0, caps.n_layers_total, tps=tps, answer_pings=True, **fields)
        self.tokenizes = tokenizes
        self.botched: list[str] = []  # the requests it answered with a Pong

    async def _on_ctl(self, msg):
        req = M.decode(msg.data, M.ControlRequest)
        if isinstance(req, M.TokenizeRequest) and self.tokenizes:
            reply: M.ControlReply = M.TokenizeReply(tokens=req.tokens or [1, 2, 3], text="")
        else:
            reply = M.Pong(node_id=self.node_id, sent_at=getattr(req, "sent_at", 0.0))
        if isinstance(reply, M.Pong) and not isinstance(req, M.Ping):
            self.botched.append(type(req).__name__)
        await msg.respond(M.encode(reply))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fails_at", ["TokenizeRequest", "SessionOpen"])
def test_a_node_that_answers_nonsense_is_routed_around_on_the_retry(smollm2_path, tmp_path, fails_at):
    """The tracker routes through the rogue first: a bad reply naming it, at the head's tokenization
    (before the generation) or at the session's open (in it). The retry asks for a route around it
    and is served by the workers, and the route reported is the one the tokens came from. The
    client's later generations ask for routes around it from the start (suspects.py)."""
    # the workers 20 ms a call (and saying so): the rogue, one hop at ten times their speed, is the
    # cheapest route by far, whatever the seams' measured latencies
    slow = {i: ["--slow-ms", "20"] for i in range(2)}
    swarm = LocalSwarm(smollm2_path, 2, backend="noop", workdir=tmp_path, gateway_port=free_port(), worker_extra=slow)
    workers = ["worker-0", "worker-1"]

    async def run():
        async with await NeuronClient.connect(swarm.url) as c:
            kv = await c.nc.jetstream().key_value(S.KV_NODES)
            caps = M.decode((await kv.get("worker-0")).value, M.CapabilityReport)
            rogue = await Rogue(c.nc, caps, tokenizes=fails_at == "SessionOpen").start()
            try:

                async def listed() -> bool:
                    return "rogue" in (await c.coverage(swarm.preset)).models[0].layers[0].replicas

                await eventually(listed, timeout=30, every=0.2)  # the tracker knows the rogue node
                sampling = M.SamplingParams(max_tokens=5, ignore_eos=True)
                results = [await c.complete("Hello", sampling=sampling) for _ in range(2)]
                tried = list(rogue.botched)
                answers = []
                async with aiohttp.ClientSession() as http:
                    body = {"model": swarm.preset, "prompt": "Hello", "max_tokens": 3}
                    for _ in range(2):
                        async with http.post(f"{swarm.gateway_url}/v1/completions", json=body) as resp:
                            answers.append((resp.status, await resp.json()))
            finally:
                await rogue.stop()
            return results, tried, rogue.botched[len(tried) :], answers

    with swarm:
        results, tried, tried_by_gateway, answers = asyncio.run(run())
    # tried once (it was the cheapest), then avoided, also by the client's next generation
    assert tried == [fails_at], tried
    for result in results:
        assert result.tokens == [0] * 5  # the no-op workers' greedy pick
        assert [h.node_id for h in result.route.hops] == workers
    assert tried_by_gateway == [fails_at], tried_by_gateway  # the gateway's own client: once too
    for status, answer in answers:
        assert status == 200 and answer["neuron_route"]["nodes"] == workers, answer
