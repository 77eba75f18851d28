"""Prefix KV reuse (neuron_bus/prefix.py): block hashes, the hop's LRU cache, and the acceptance
tests on a real route (nats-server, tracker and two SmolLM2 worker processes, one thread each):
a second session sharing a 2048-token prefix prefills only its suffix on every hop and gives a
cold run's greedy tokens; with the prefix evicted on one hop the route computes the whole prompt,
with the same output.
"""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from neuron_bus import messages as M
from neuron_bus.client import NeuronClient
from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.natsserver import free_port
from neuron_bus.prefix import PrefixCache, block_hashes
from neuron_bus.worker.engine import HopEngine

B = M.PREFIX_BLOCK


def test_block_hashes_name_prefixes_and_leave_the_last_token_out():
    a = list(range(1000, 1000 + 3 * B + 1))
    assert len(block_hashes(a)) == 3  # 3 full blocks before the last token
    assert len(block_hashes(a[:-1])) == 2  # 3 blocks exactly: the third holds the last token
    longer = a + [7] * B
    assert block_hashes(longer)[:3] == block_hashes(a)  # a hash names its whole prefix
    other = [a[0] + 1] + a[1:]
    assert all(x != y for x, y in zip(block_hashes(other), block_hashes(a)))  # ... not just its own block
    assert block_hashes([]) == [] and block_hashes(list(range(B))) == []


def test_the_cache_finds_the_longest_prefix_held_and_forgets_the_least_recently_used():
    x, y = block_hashes(list(range(5 * B + 1))), block_hashes(list(range(9, 9 + 3 * B + 1)))
    cache = PrefixCache(budget=250)
    assert cache.put(x[:2], b"a" * 100)
    assert cache.longest(x) == (2 * B, x[1]) and cache.get(x[0], B) == b"a" * 100
    assert cache.put(x[:4], b"b" * 100)  # holds every prefix of the shorter one: that one is dropped
    assert len(cache) == 1 and cache.longest(x) == (4 * B, x[3]) and cache.get(x[1], 2 * B) == b"b" * 100
    assert cache.get(x[1], 3 * B) is None  # not that prefix's length
    assert cache.put(y, b"c" * 100) and len(cache) == 2
    cache.get(x[3], 4 * B)  # x used last: y goes first
    assert cache.put(block_hashes(list(range(50, 50 + B + 1))), b"d" * 100)
    assert cache.longest(y) is None and cache.longest(x) == (4 * B, x[3]) and cache.evicted == 1
    assert not cache.put(x[:1], b"e" * 300)  # larger than the whole budget
    assert cache.nbytes <= cache.budget


def test_a_hop_refuses_prefix_fields_that_disagree_before_any_cache_work():
    route = M.RouteAssignment(
        route_id="r", model_preset="m", model_revision="rev", n_layers_total=2,
        hops=[M.RouteHop(node_id="n", layer_start=0, layer_end=2, subject="s", backend_id="b", cache_abi="abi")],
    )  # fmt: skip
    blocks = block_hashes(list(range(3 * B + 5)))

    def open_(**kw) -> M.SessionOpen:
        return M.SessionOpen(session_id="s", route=route, hop_index=0, prompt_tokens=3 * B + 5, n_ctx=4096, **kw)

    HopEngine._check_prefix(open_(prefix_blocks=blocks, prefix=M.PrefixReuse(2 * B, blocks[1])))
    for bad in [
        dict(prefix_blocks=blocks + blocks[:1]),  # more blocks than the prompt has before its last token
        dict(prefix_blocks=["x" * 7]),
        dict(prefix_blocks=blocks, prefix=M.PrefixReuse(2 * B, blocks[0])),  # not that prefix's hash
        dict(prefix_blocks=blocks, prefix=M.PrefixReuse(B + 1, blocks[0])),  # not a whole block
        dict(prefix_blocks=blocks, prefix=M.PrefixReuse(4 * B, blocks[2])),  # past the blocks
        dict(prefix_blocks=blocks, prefix=M.PrefixReuse(B, blocks[0]), reuse_prefix=True),  # both
    ]:
        with pytest.raises(ValueError):
            HopEngine._check_prefix(open_(**bad))


# -- the acceptance tests on a real route ---------------------------------------------------------

PREFIX = 2048
TAIL_CACHE = "30M"  # holds one 2048-position prefix of the tail's 11 layers (17.3 MB), not two
NEW = 24


def _metric(port: int, series: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    ports = [free_port(), free_port()]
    extra = {0: ["--metrics-port", str(ports[0])], 1: ["--metrics-port", str(ports[1]), "--prefix-cache", TAIL_CACHE]}
    with LocalSwarm(smollm2_path, 2, workdir=tmp_path_factory.mktemp("prefix"), worker_extra=extra) as s:
        s.metrics_ports = ports
        yield s


def _texts(tok):
    def doc(seed: int) -> list[int]:
        words = ["river", "lamp", "copper", "orchard", "signal", "harbour", "violet", "engine", "meadow", "glass"]
        text = " ".join(f"{words[(i * seed) % 10]} {i % 97}" for i in range(3000))
        ids = tok.encode(text)
        assert len(ids) >= PREFIX
        return ids[:PREFIX]

    return doc(3), doc(7)


class Hops:
    """The route's per-hop counters, read before and after a generation."""

    SERIES = {
        "prefill": 'neuron_tokens_total{phase="prefill"}',
        "reused": "neuron_prefill_tokens_reused_total",
        "missing": 'neuron_prefix_cache_total{event="missing"}',
    }

    def __init__(self, ports: list[int]):
        self.ports = ports

    def read(self) -> dict[str, list[float]]:
        return {k: [_metric(p, s) for p in self.ports] for k, s in self.SERIES.items()}

    @staticmethod
    def delta(before, after) -> dict[str, list[int]]:
        return {k: [int(a - b) for a, b in zip(after[k], before[k])] for k in before}


async def _run(c: NeuronClient, ids: list[int], **kw) -> tuple[list[int], M.GenerationTelemetry]:
    tokens, last = [], None
    sampling = M.SamplingParams(max_tokens=NEW, ignore_eos=True)
    async for ev in c.generate(prompt_tokens=ids, sampling=sampling, **kw):
        if isinstance(ev, M.TokenDelta):
            tokens.append(ev.token_id)
        else:
            last = ev
    assert last is not None
    return tokens, last


@pytest.mark.timeout(1500)
def test_a_shared_2048_token_prefix_is_prefilled_once_and_its_eviction_makes_the_route_compute_it(swarm, reference):
    tok = reference.tokenizer
    x, y = _texts(tok)
    first = x + tok.encode(" Question one: which word comes first?")
    second = x + tok.encode(" Question two: which number comes last, and why?")
    other = y + tok.encode(" Question three: count the words.")
    third = x + tok.encode(" Question four: name a colour.")
    hops = Hops(swarm.metrics_ports)
    expected = {"second": reference.soon(second, NEW), "third": reference.soon(third, NEW)}  # while the route works

    async def scenario():
        async with await NeuronClient.connect(swarm.url) as c:
            out = {}
            for name, ids, kw in [
                ("cold", second, {"prefix_reuse": False}),  # reuse off: nothing attached, nothing kept
                ("first", first, {}),
                ("second", second, {}),
                ("other", other, {}),  # the tail's small cache keeps y's prefix now, not x's
                ("third", third, {}),
            ]:
                before = hops.read()
                tokens, telemetry = await _run(c, ids, **kw)
                out[name] = tokens, telemetry, Hops.delta(before, hops.read())
            return out

    out = asyncio.run(scenario())
    cold, one, two, three, four = (out[k] for k in ("cold", "first", "second", "other", "third"))

    # a cold run (reuse off) and the first session compute their whole prompts on both hops
    assert cold[2]["prefill"] == [len(second)] * 2 and cold[2]["reused"] == [0, 0]
    assert one[2]["prefill"] == [len(first)] * 2 and one[1].prefill_tokens_reused == 0

    # the second attaches the 2048 positions on every hop and computes only its suffix there,
    # giving the cold run's tokens (and the single process's)
    assert two[2]["reused"] == [PREFIX, PREFIX]
    assert two[2]["prefill"] == [len(second) - PREFIX] * 2
    assert two[1].prefill_tokens_reused == PREFIX
    assert two[0] == cold[0] == expected["second"].result()

    # another prefix evicted x's on the tail: the head attaches x, the tail says it lacks it, and
    # the whole route computes the whole prompt, giving the same tokens as a cold run
    assert three[2]["reused"] == [0, 0] and three[2]["missing"] == [0, 0]
    assert four[2]["missing"] == [0, 1]
    assert four[2]["reused"][1] == 0 and four[1].prefill_tokens_reused == 0
    assert four[2]["prefill"] == [len(third)] * 2
    assert four[0] == expected["third"].result()


@pytest.mark.timeout(900)
def test_a_chats_next_turn_reuses_the_previous_answer_too(swarm, reference):
    """The client names the blocks of the prompt and the answer at close: a next turn made of the
    first turn's prompt, its answer and a new question attaches the block the answer completed."""
    tok = reference.tokenizer
    words = " ".join(f"stone {i % 41} fell near tree {i % 23}." for i in range(2000))
    turn1 = tok.encode(words)[: 7 * B - 12]  # 6 whole blocks; the answer completes the 7th
    hops = Hops(swarm.metrics_ports)

    async def scenario():
        async with await NeuronClient.connect(swarm.url) as c:
            answer, _ = await _run(c, turn1)
            turn2 = turn1 + answer + tok.encode(" And then?")
            expected = reference.soon(turn2, NEW)  # while the route works
            before = hops.read()
            tokens, telemetry = await _run(c, turn2)
            return turn2, tokens, telemetry, Hops.delta(before, hops.read()), expected

    turn2, tokens, telemetry, delta, expected = asyncio.run(scenario())
    assert len(block_hashes(turn1)) == 6 and len(turn1) + NEW - 1 >= 7 * B
    assert delta["reused"] == [7 * B, 7 * B] and telemetry.prefill_tokens_reused == 7 * B
    assert delta["prefill"] == [len(turn2) - 7 * B] * 2
    assert tokens == expected.result()


@pytest.mark.timeout(900)
def test_a_prefix_kept_in_another_size_class_is_attached_or_computed_never_an_error(swarm, reference):
    """A session needing many more positions lands in a lane of another stream size, whose
    sequence state llama.cpp may refuse (its layout differs): the head then opens the session
    without the prefix and the route computes the whole prompt; either way the tokens are right."""
    tok = reference.tokenizer
    z = tok.encode(" ".join(f"pebble {i % 53} under bridge {i % 29}." for i in range(2000)))[:PREFIX]
    small = z + tok.encode(" Which bridge?")
    large = z + tok.encode(" Which pebble?")
    hops = Hops(swarm.metrics_ports)
    expected = reference.soon(large, NEW)  # while the route works
    unattachable = 'neuron_prefix_cache_total{event="unattachable"}'

    async def scenario():
        async with await NeuronClient.connect(swarm.url) as c:
            await _run(c, small)  # keeps z's prefix in a lane of its size (about 2100 positions)
            before, refused = hops.read(), _metric(swarm.metrics_ports[0], unattachable)
            tokens, telemetry = [], None
            # room for 4608 positions: a lane of the largest class; only the first NEW tokens are read
            sampling = M.SamplingParams(max_tokens=4608 - len(large), ignore_eos=True)
            async for ev in c.generate(prompt_tokens=large, sampling=sampling):
                if isinstance(ev, M.TokenDelta):
                    tokens.append(ev.token_id)
                    if len(tokens) == NEW:
                        break  # the client closes the session on every hop
                else:
                    telemetry = ev
            delta = Hops.delta(before, hops.read())
            return tokens, telemetry, delta, _metric(swarm.metrics_ports[0], unattachable) - refused

    tokens, telemetry, delta, refused = asyncio.run(scenario())
    assert tokens == expected.result()
    if refused:  # not attachable in that lane: computed whole on both hops
        assert delta["reused"] == [0, 0] and delta["prefill"] == [len(large)] * 2, delta
    else:  # the lanes agree on their layout: attached on both hops
        assert delta["reused"] == [PREFIX, PREFIX], delta
