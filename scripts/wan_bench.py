"""WAN benchmark: the project's routes over emulated links, each figure next to its bound.

    scripts/wan_bench [--quick] [--json PATH] [--model PRESET|PATH] [--topologies star,regions]

In one run, on this machine (links from neuron_bus/wan/linkem.py, in its own process):
- the emulator's own cost: small NATS request/replies through a 0 ms link against direct;
- for both topologies (star: every process behind its own link to one nats-server; regions: one
  nats-server per region in a gateway supercluster, streams in the home region) and routes of 2
  and 3 hops: single-session greedy decode tok/s at one-way link delays of 0, 5, 25 and 50 ms,
  each next to its bound (the hops' compute per token, measured in the same run from the workers'
  backend seconds, plus the one-way link crossings of one trip around the ring);
- 8 and then 16 sessions started together at 25 ms (workers with 16 KV slots), 2 hops: aggregate decode
  tok/s over the run, the spread of their first tokens, and the aggregate's compute ceiling (the
  tokens over the busiest hop's decode backend seconds in the run: how fast the decoding could be
  had no hop waited for anything);
- time to first token of a 1024-token prompt at 25 ms and 50 Mbit/s per link, 2 hops, with the
  f32, bf16 and bf16+zstd wires, next to the pipeline bound (docs/wan.md derives it);
- the JetStream ring floor at 25 ms: what awaiting each publish acknowledgement costs a hop with
  1 and 8 messages in flight, against a pipelined acknowledgement and core NATS;
- replication at 25 ms: publish + acknowledgement into R1 and R3 streams of a cluster stretched
  over the three regions, from the leader's region and from another.

Crossings per token (trip around the ring): star, 2 per seam (into the server, out of it): 2H for
H hops. Regions: a message from region P to a consumer in region C through a stream in the home
region S crosses [P != S] + [S != C] WAN links; hops in regions a, b (2 hops) or a, b, c (3 hops)
with S = a: 2 and 4 crossings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neuron_bus import models  # noqa: E402
from neuron_bus.client import NeuronClient  # noqa: E402
from neuron_bus.natsserver import NatsServer, ServerConfig, free_port  # noqa: E402
from neuron_bus.wan.linkem import EmulatorProcess, Shape  # noqa: E402
from neuron_bus.wan.probe import emulator_overhead  # noqa: E402
from neuron_bus.wan.topologies import RegionSwarm, StarSwarm  # noqa: E402
from scripts import jetstream_floor  # noqa: E402
from scripts.bench import decode_backend_seconds, decode_rate, generation, prompt_ids, scrape  # noqa: E402

DELAYS_MS = (0.0, 5.0, 25.0, 50.0)
WAN_MS = 25.0
RATE_MBIT = 50.0
TTFT_PROMPT = 1024
CHUNK = 256  # the client's default prompt chunk
WIRES = (("f32", "raw"), ("bf16", "raw"), ("bf16", "zstd"))
SESSIONS = 16
SPEC_K = 4  # draft tokens a speculative step may carry
SPEC_DELAYS_MS = (0.0, WAN_MS)
QUOTED = (
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, "
    "the members agreed to fund the reading room, the children's corner and the archive, but not the "
    "café. The vote was seven to two, and the work will begin in the spring."
)
SPEC_PROMPTS = {  # prompt lookup drafts from the prompt: a quote pays, free text hardly drafts
    "repetitive": f"Repeat the following text exactly.\n\nText: {QUOTED}\n\nRepeated text: {QUOTED[:40]}",
    "free": "Write a short story about a lighthouse keeper who finds a map:",
}
REGIONS = ("a", "b", "c")
HOME = "a"


def log(text: str) -> None:
    print(text, flush=True)


# ------------------------------------------------------------------------------ bounds


def hop_regions(hops: int) -> list[str]:
    return list(REGIONS[:hops])


def seam_crossings(kind: str, src: str | None, dst: str | None) -> int:
    """WAN links one message crosses from a process in region ``src`` to one in ``dst``."""
    if kind == "star":
        return 2
    return int(src != HOME) + int(HOME != dst)


def ring_crossings(kind: str, hops: int) -> int:
    r = hop_regions(hops)
    return sum(seam_crossings(kind, r[i], r[(i + 1) % hops]) for i in range(hops))


def decode_bound_tok_s(compute_ms: float, crossings: int, delay_ms: float) -> float:
    return 1000.0 / (compute_ms + crossings * delay_ms)


class Stage(msgspec.Struct):
    what: str
    busy_ms: float  # how long one chunk occupies the stage (compute, or serialization at the rate)
    latency_ms: float  # what the stage adds without occupying it (propagation)


def ttft_bound_ms(stages: list[Stage], chunks: int, open_rtt_ms: float) -> float:
    """A flow shop of ``chunks`` equal chunks through serial stages: the first chunk's way through
    every stage, plus the other chunks at the pace of the busiest stage; plus one parallel round of
    session opens before the first chunk leaves."""
    return open_rtt_ms + sum(s.busy_ms + s.latency_ms for s in stages) + (chunks - 1) * max(s.busy_ms for s in stages)


def ttft_stages(
    kind: str, delay_ms: float, rate_mbit: float, in_bytes: float, hop_bytes: list[float], compute_ms: list[float]
) -> list[Stage]:
    """Stages of one prompt chunk from the client (in the home region) to the tail's first token.

    ``in_bytes``: a chunk of token ids into hop 0; ``hop_bytes[h]``: a chunk of hop h's output;
    ``compute_ms[h]``: hop h's backend time per chunk."""
    wire = (lambda n: 8 * n / (rate_mbit * 1e3)) if rate_mbit else (lambda n: 0.0)  # ms at the cap
    regions = hop_regions(len(compute_ms))
    stages: list[Stage] = []

    def crossing(what: str, nbytes: float, src: str, dst: str) -> None:
        for i in range(seam_crossings(kind, src, dst)):
            stages.append(Stage(f"{what} link {i}", wire(nbytes), delay_ms))

    crossing("prompt", in_bytes, HOME, regions[0])
    for h, c in enumerate(compute_ms):
        stages.append(Stage(f"hop {h} compute", c, 0.0))
        if h + 1 < len(compute_ms):
            crossing(f"hop {h} output", hop_bytes[h], regions[h], regions[h + 1])
    crossing("first token", 64, regions[-1], HOME)
    return stages


def open_rtt_ms(kind: str, hops: int, delay_ms: float) -> float:
    """One control round trip from the client to the farthest hop (opens sent in parallel)."""
    return max(2 * seam_crossings(kind, HOME, r) for r in hop_regions(hops)) * delay_ms


# ------------------------------------------------------------------------------ swarms


def make_swarm(kind: str, model: Path, hops: int, workdir: Path, ports: list[int]):
    extra = {
        i: ["--metrics-port", str(p), "--max-sessions", str(SESSIONS), "--n-ctx", str(TTFT_PROMPT + 256)]
        for i, p in enumerate(ports)
    }
    if kind == "star":
        return StarSwarm(model, hops, workdir=workdir / f"star{hops}", worker_extra=extra)
    return RegionSwarm(
        model,
        hops,
        regions=REGIONS,
        worker_regions=hop_regions(hops),
        home=HOME,
        workdir=workdir / f"regions{hops}",
        worker_extra=extra,
    )


def client_url(swarm) -> str:
    return swarm.link_url("client") if isinstance(swarm, StarSwarm) else swarm.region_url(HOME)


def shape(swarm, delay_ms: float, rate_mbit: float = 0.0) -> None:
    swarm.shape_all(delay_ms=delay_ms, rate_mbit=rate_mbit)


def busy(ports: list[int], phase: str) -> list[float]:
    return [scrape(p, "neuron_backend_call_seconds_sum", phase=phase) for p in ports]


async def single_decode(url: str, ids: list[int], n: int, ports: list[int]) -> tuple[float, float]:
    """(decode tok/s of one greedy session, the hops' backend ms per token during it)."""
    async with await NeuronClient.connect(url) as client:
        route = await client.route()
        await generation(client, route, ids[:16], 2)  # warm-up at this delay
        busy0, steps0 = decode_backend_seconds(ports)
        run = await generation(client, route, ids, n)
        busy1, steps1 = decode_backend_seconds(ports)
    return decode_rate(run), 1000 * (busy1 - busy0) / max(steps1 - steps0, 1)


async def sessions_together(url: str, prompts: list[list[int]], n: int, ports: list[int]) -> dict:
    """Sessions started together on one route: aggregate decode from the first token to the last,
    and the compute ceiling of that aggregate: the tokens over the busiest hop's decode backend
    seconds in the run, as fast as the decoding could be if no hop ever waited (prefill, mostly
    before the first token, is left out of both)."""
    async with await NeuronClient.connect(url) as client:
        route = await client.route()
        before = busy(ports, "decode")
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(generation(client, route, p, n) for p in prompts))
        after = busy(ports, "decode")
    stamps = [r["stamps"] for r in runs]
    first, last = min(s[0] for s in stamps), max(s[-1] for s in stamps)
    tokens = sum(len(s) - 1 for s in stamps)
    overlap = max(sum(1 for s in stamps if s[0] <= t <= s[-1]) for t in (x[0] for x in stamps))
    busiest = max(b - a for a, b in zip(before, after))
    aggregate = tokens / (last - first)
    return {
        "aggregate_decode_tok_s": aggregate,
        "first_token_s": sorted(s[0] - t0 for s in stamps),
        "first_token_spread_s": max(s[0] for s in stamps) - first,
        "max_decoding_at_once": overlap,
        "wall_s": last - t0,
        "busiest_hop_backend_s": busiest,
        "busiest_hop_busy_fraction": busiest / (last - first),
        "compute_ceiling_tok_s": tokens / busiest,
        "vs_compute_ceiling": aggregate / (tokens / busiest),
    }


async def spec_vs_plain(url: str, ids: list[int], n: int) -> dict:
    """One greedy session plain, then with speculative steps of up to SPEC_K drafts: tok/s of each
    and whether the tokens are the same (they must be: the tail accepts only its own choices)."""
    async with await NeuronClient.connect(url) as client:
        route = await client.route()
        await generation(client, route, ids[:16], 2)  # warm-up at this delay
        plain = await generation(client, route, ids, n)
        spec = await generation(client, route, ids, n, speculative=SPEC_K)
    return {
        "plain_tok_s": decode_rate(plain),
        "spec_tok_s": decode_rate(spec),
        "vs_plain": decode_rate(spec) / decode_rate(plain),
        "identical": plain["tokens"] == spec["tokens"],
    }


async def ttft_once(url: str, ids: list[int], wire: str, encoding: str, ports: list[int]) -> dict:
    async with await NeuronClient.connect(url) as client:
        route = await client.route(wire_dtype=wire, encoding=encoding)
        await generation(client, route, ids[:32], 1)  # warm-up: the route's consumers, this wire
        b0 = busy(ports, "prefill")
        out0 = [scrape(p, "neuron_seam_bytes_total", phase="prefill", direction="out") for p in ports]
        run = await generation(client, route, ids, 1, chunk_size=CHUNK)
        b1 = busy(ports, "prefill")
        out1 = [scrape(p, "neuron_seam_bytes_total", phase="prefill", direction="out") for p in ports]
    chunks = -(-len(ids) // CHUNK)
    return {
        "ttft_ms": 1000 * (run["stamps"][0] - run["t0"]),
        "chunks": chunks,
        "compute_ms_per_chunk": [1000 * (b - a) / chunks for a, b in zip(b0, b1)],
        "out_bytes_per_chunk": [(b - a) / chunks for a, b in zip(out0, out1)],
    }


def bench_topology(kind: str, model: Path, hops: int, work: Path, tok, quick: bool) -> dict:
    ports = [free_port() for _ in range(hops)]
    swarm = make_swarm(kind, model, hops, work, ports)
    n_decode = 24 if quick else 64
    ids = prompt_ids(tok, 64)
    out: dict = {"crossings_per_token": ring_crossings(kind, hops), "decode": {}}
    t = time.time()
    with swarm:
        url = client_url(swarm)
        for d in DELAYS_MS:
            shape(swarm, d)
            rate, compute = asyncio.run(single_decode(url, ids, n_decode, ports))
            bound = decode_bound_tok_s(compute, out["crossings_per_token"], d)
            out["decode"][d] = {
                "tok_s": rate,
                "bound_tok_s": bound,
                "vs_bound": rate / bound,
                "compute_ms_per_token": compute,
            }
            log(
                f"  {kind} {hops} hops, {d:g} ms: {rate:.1f} tok/s, bound {bound:.1f} "
                f"({rate / bound:.2f}x; compute {compute:.1f} ms + {out['crossings_per_token']} x {d:g} ms)"
            )
        if hops == 2:
            shape(swarm, WAN_MS)
            topics = ["the sea", "a mountain", "the moon", "coffee", "a library", "winter", "the desert", "a violin"]
            prompts = [tok.encode(f"Write one sentence about {topics[i % 8]} number {i}:") for i in range(SESSIONS)]
            one = out["decode"][WAN_MS]["tok_s"]
            for n in (SESSIONS // 2, SESSIONS):  # the two targets: 8 sessions and 16
                together = asyncio.run(sessions_together(url, prompts[:n], 16 if quick else 32, ports))
                out[f"sessions{n}"] = together
                log(
                    f"  {kind}: {n} sessions at {WAN_MS:g} ms: aggregate {together['aggregate_decode_tok_s']:.1f} "
                    f"tok/s ({together['aggregate_decode_tok_s'] / one:.2f}x one session); first tokens spread over "
                    f"{together['first_token_spread_s']:.1f} s; at most {together['max_decoding_at_once']} decoding at once; "
                    f"compute ceiling {together['compute_ceiling_tok_s']:.1f} tok/s "
                    f"({together['vs_compute_ceiling']:.2f}x of it; the busiest hop decoded "
                    f"{100 * together['busiest_hop_busy_fraction']:.0f}% of the time from first token to last)"
                )
            if kind == "star":
                out["speculative"] = {}
                for d in SPEC_DELAYS_MS:
                    shape(swarm, d)
                    for workload, text in SPEC_PROMPTS.items():
                        r = asyncio.run(spec_vs_plain(url, tok.encode(text), 32 if quick else 96))
                        out["speculative"][f"{workload}_{d:g}ms"] = r
                        log(
                            f"  {kind}: speculative (k={SPEC_K}) vs plain, {workload}, {d:g} ms: "
                            f"{r['spec_tok_s']:.1f} vs {r['plain_tok_s']:.1f} tok/s ({r['vs_plain']:.2f}x), "
                            f"tokens {'identical' if r['identical'] else 'DIFFERENT'}"
                        )
            shape(swarm, WAN_MS, RATE_MBIT)
            long_ids = prompt_ids(tok, TTFT_PROMPT)
            out["ttft1024"] = {}
            if isinstance(swarm, RegionSwarm):  # regions' TTFT is slow with the meta leader in the tail's region
                out["meta_leader"] = swarm.meta_leader()
                log(f"  {kind}: the JetStream meta leader is {out['meta_leader']}")
            for wire, encoding in WIRES:
                r = asyncio.run(ttft_once(url, long_ids, wire, encoding, ports))
                stages = ttft_stages(
                    kind, WAN_MS, RATE_MBIT, 4 * CHUNK, r["out_bytes_per_chunk"], r["compute_ms_per_chunk"]
                )
                bound = ttft_bound_ms(stages, r["chunks"], open_rtt_ms(kind, hops, WAN_MS))
                name = wire + ("+zstd" if encoding == "zstd" else "")
                out["ttft1024"][name] = r | {"bound_ms": bound, "vs_bound": r["ttft_ms"] / bound}
                log(
                    f"  {kind}: TTFT {TTFT_PROMPT} tokens at {WAN_MS:g} ms / {RATE_MBIT:g} Mbit/s, {name}: "
                    f"{r['ttft_ms']:.0f} ms, bound {bound:.0f} ms ({r['ttft_ms'] / bound:.2f}x; "
                    f"compute {'/'.join(f'{c:.0f}' for c in r['compute_ms_per_chunk'])} ms per chunk, "
                    f"hop 0 sends {r['out_bytes_per_chunk'][0] / 1e3:.0f} kB per chunk)"
                )
    log(f"  {kind} {hops} hops done ({time.time() - t:.0f}s)")
    return out


# ------------------------------------------------------------------------------ the run


def overhead() -> dict:
    with tempfile.TemporaryDirectory() as store:
        srv = NatsServer(ServerConfig(store_dir=Path(store), port=free_port(), http_port=free_port())).start()
        try:
            with EmulatorProcess() as em:
                return msgspec.structs.asdict(emulator_overhead(em, srv.config.port))
        finally:
            srv.stop()


def fidelity() -> dict:
    """Measured one-way delay of a 25 ms link (NATS PING/PONG round trips through it, halved)."""
    from neuron_bus.topology import connect

    async def rtts(url: str) -> list[float]:
        nc = await connect(url)
        try:
            out = []
            for _ in range(50):
                t0 = time.perf_counter()
                await nc.flush()
                out.append(1000 * (time.perf_counter() - t0))
            return out
        finally:
            await nc.close()

    with tempfile.TemporaryDirectory() as store:
        srv = NatsServer(ServerConfig(store_dir=Path(store), port=free_port(), http_port=free_port())).start()
        try:
            with EmulatorProcess() as em:
                port = em.add_link("fidelity", srv.config.port, up=Shape(delay_ms=WAN_MS), down=Shape(delay_ms=WAN_MS))
                r = asyncio.run(rtts(f"nats://127.0.0.1:{port}"))
        finally:
            srv.stop()
    return {"set_one_way_ms": WAN_MS, "measured_one_way_ms_p50": statistics.median(r) / 2, "max_ms": max(r) / 2}


def replication(quick: bool) -> dict:
    """Publish + acknowledgement of a 2304-byte message at 25 ms between regions: R1 and R3 streams
    of a cluster stretched over three regions, from a client on the stream leader's server and
    from one on another region's server (the supercluster's streams are R1, like the first)."""
    from nats.js.api import StorageType, StreamConfig

    from neuron_bus.natsserver import start_all
    from neuron_bus.topology import connect
    from neuron_bus.wan.topologies import stretched_cluster

    n = 20 if quick else 60
    out: dict = {}
    with tempfile.TemporaryDirectory() as store, EmulatorProcess() as em:
        servers = stretched_cluster(em, Path(store), REGIONS, WAN_MS)
        start_all(servers, 60)
        by_name = {s.config.server_name: s for s in servers}

        async def acks(url: str, subject: str) -> float:
            nc = await connect(url)
            try:
                js, lat = nc.jetstream(), []
                deadline = time.monotonic() + 20
                while True:  # the stream's interest reaches this server over the WAN first
                    try:
                        await js.publish(subject, b"\0" * 2304)
                        break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.5)
                for _ in range(n + 5):
                    t0 = time.perf_counter()
                    await js.publish(subject, b"\0" * 2304)
                    lat.append(1000 * (time.perf_counter() - t0))
                return statistics.median(lat[5:])
            finally:
                await nc.close()

        async def run() -> None:
            nc = await connect(servers[0].url)
            js = nc.jetstream()
            deadline = time.monotonic() + 60
            for replicas in (1, 3):
                while True:  # the stretched meta group elects its leader over the WAN
                    try:
                        await js.add_stream(
                            StreamConfig(
                                name=f"R{replicas}",
                                subjects=[f"r{replicas}.>"],
                                storage=StorageType.MEMORY,
                                num_replicas=replicas,
                            )
                        )
                        break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(1)
                leader = (await js.stream_info(f"R{replicas}")).cluster.leader
                other = next(s for name, s in by_name.items() if name != leader)
                out[f"R{replicas}"] = {
                    "from_leader_ms_p50": await acks(by_name[leader].url, f"r{replicas}.x"),
                    "from_other_region_ms_p50": await acks(other.url, f"r{replicas}.x"),
                }
            await nc.close()

        try:
            asyncio.run(run())
        finally:
            for s in servers:
                s.stop()
    for name, r in out.items():
        log(
            f"  stretched cluster at {WAN_MS:g} ms, {name}: publish + ack {r['from_leader_ms_p50']:.1f} ms from the "
            f"leader's region, {r['from_other_region_ms_p50']:.1f} ms from another"
        )
    return out


def ring_floor(quick: bool) -> dict:
    legs = 60 if quick else 200
    out = {}
    for mode in jetstream_floor.MODES:
        for inflight in (1, 8):
            r = jetstream_floor.ring(legs * inflight, mode=mode, inflight=inflight, delay_ms=WAN_MS)
            out[f"{mode}_inflight{inflight}"] = msgspec.structs.asdict(r)
            log(
                f"  ring at {WAN_MS:g} ms, {mode}, {inflight} in flight: "
                + (f"{r.leg_ms_p50:.1f} ms per leg, " if inflight == 1 else "")
                + f"{r.legs_per_s:.1f} legs/s"
            )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer tokens per figure")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--model", default=models.DEFAULT_PRESET)
    ap.add_argument("--topologies", default="star,regions")
    args = ap.parse_args()

    from workers.tokenizer import Tokenizer

    model = models.resolve(args.model)
    tok = Tokenizer(model)
    work = Path(tempfile.mkdtemp(prefix="neuron-wan-bench-"))
    started = time.time()
    log(f"model {model.name}; one thread per process; work dir {work}")
    result: dict = {"model": model.name, "quick": args.quick, "delays_ms": list(DELAYS_MS)}
    log("emulator overhead at 0 ms (NATS request/reply through a link vs direct)")
    result["emulator"] = overhead() | {"fidelity": fidelity()}
    e = result["emulator"]
    log(
        f"  direct {e['direct_rtt_ms_p50']:.3f} ms, through a 0 ms link {e['relayed_rtt_ms_p50']:.3f} ms p50: "
        f"{e['overhead_ms_p50']:.3f} ms per round trip; a 25 ms link measures "
        f"{e['fidelity']['measured_one_way_ms_p50']:.2f} ms one way"
    )
    log(f"JetStream ring floor at {WAN_MS:g} ms per link")
    result["ring25"] = ring_floor(args.quick)
    log(f"replication across regions at {WAN_MS:g} ms (a stretched cluster, the alternative to the supercluster)")
    result["replication25"] = replication(args.quick)
    for kind in args.topologies.split(","):
        for hops in (2, 3):
            log(f"{kind}, {hops} hops")
            result[f"{kind}_route{hops}"] = bench_topology(kind, model, hops, work, tok, args.quick)

    result["emulator_overhead_ms_p50"] = e["overhead_ms_p50"]
    for kind in args.topologies.split(","):
        prefix = "" if kind == "star" else f"{kind}_"
        r2 = result[f"{kind}_route2"]
        result[f"{prefix}wan25_route2_decode_vs_bound"] = r2["decode"][WAN_MS]["vs_bound"]
        result[f"{prefix}wan25_route3_decode_vs_bound"] = result[f"{kind}_route3"]["decode"][WAN_MS]["vs_bound"]
        for n in (SESSIONS // 2, SESSIONS):
            result[f"{prefix}wan25_route2_sessions{n}_vs_one"] = (
                r2[f"sessions{n}"]["aggregate_decode_tok_s"] / r2["decode"][WAN_MS]["tok_s"]
            )
            result[f"{prefix}wan25_route2_sessions{n}_vs_compute_ceiling"] = r2[f"sessions{n}"]["vs_compute_ceiling"]
        result[f"{prefix}wan25_ttft1024_vs_bound"] = min(w["vs_bound"] for w in r2["ttft1024"].values())
        for name, r in r2.get("speculative", {}).items():  # issue 20's spec_decode_vs_plain, star only
            result[f"spec_decode_vs_plain_{name}"] = r["vs_plain"]
    result["elapsed_s"] = time.time() - started

    log("")
    log(f"{'topology':9} {'hops':>4} " + " ".join(f"{f'{d:g} ms tok/s (bound)':>22}" for d in DELAYS_MS))
    for kind in args.topologies.split(","):
        for hops in (2, 3):
            dec = result[f"{kind}_route{hops}"]["decode"]
            cells = [
                f"{dec[d]['tok_s']:6.1f} ({dec[d]['bound_tok_s']:5.1f}) {dec[d]['vs_bound']:4.2f}x" for d in DELAYS_MS
            ]
            log(f"{kind:9} {hops:>4} " + " ".join(f"{c:>22}" for c in cells))
    for key in sorted(k for k in result if "wan25" in k or k.startswith("spec_") or k == "emulator_overhead_ms_p50"):
        log(f"{key}: {result[key]:.3f}")
    log(f"took {result['elapsed_s'] / 60:.1f} min")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
