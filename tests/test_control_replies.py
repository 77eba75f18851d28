"""A node's control subject answered by something other than a neuron-bus node of this protocol
(a faulty build, a foreign responder): the client names the node and says what it got, as a
``bad_reply`` route error, instead of failing later on a missing attribute. Real nats-server."""

from __future__ import annotations

import pytest

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.client import NeuronClient, RouteError
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
async def test_a_reply_of_the_wrong_kind_is_a_bad_reply_naming_the_node(client, req, wrong):
    await answer_with(client, "odd", wrong)
    with pytest.raises(RouteError) as err:
        await client.control("odd", req, timeout=5)
    assert err.value.reason == Reason.BAD_REPLY
    assert err.value.node_id == "odd"
    assert f"node odd answered {type(req).__name__} with {type(wrong).__name__}" in str(err.value)


async def test_every_control_request_has_its_answer(client):
    """Each request the node's control subject takes has one reply kind, and the client accepts it."""
    requests = set(M.ControlRequest.__args__)  # type: ignore[attr-defined]
    assert set(M.CONTROL_ANSWERS) == requests
    await answer_with(client, "good", M.Pong(node_id="good", sent_at=1.0))
    assert await client.control("good", M.Ping(sent_at=1.0), timeout=5) == M.Pong(node_id="good", sent_at=1.0)
