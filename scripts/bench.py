"""Side-by-side benchmark suite: single-process llama.cpp vs routes of this project, in one run.

    scripts/bench [--quick] [--json PATH] [--model PRESET|PATH] [--threads N]

Contenders, all on this machine in this run, with the same thread budget per process:
- single-process llama.cpp (the whole GGUF through llama-cpp-python: what users compare us with)
- 2-hop and 3-hop routes on the llama.cpp backend, and a 2-hop route on the torch backend
- 2-hop and 3-hop routes of no-op hops (no model work: the bus's own per-hop cost), next to a
  bare two-process JetStream relay (scripts/jetstream_floor.py: the least a Python hop can cost)
- the 2-hop llama.cpp route without session keys (no MACs) and with sealed activations (AEAD):
  every other route runs with MACs, the default; and the three measured alternately on one
  route, back to back (the MAC and AEAD cost figures: trust/sealing.py, docs/security.md)

KV figures (scripts/bench_kv.py; ``--only kv`` runs them alone): sessions of 512 positions one
worker admits in the default memory against the 8 fixed slots before (``sessions_admitted_512``),
and a chat's second turn sharing 2048 tokens with its first: its time to first token over the cold
one's, with the outputs compared (``prefix2k_ttft_vs_cold``).

Figures: decode tok/s, prefill tok/s at 512/2048/4096 tokens, time to first token, seam bytes
per token by phase, per-hop overhead, aggregate decode tok/s at 1/4/8 concurrent sessions (while all
of them decode), peak
RSS per hop. The table prints every figure next to its ratio against single-process llama.cpp.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neuron_bus import messages as M  # noqa: E402
from neuron_bus import models  # noqa: E402
from neuron_bus.client import NeuronClient  # noqa: E402
from neuron_bus.execution import open_reference, open_tokenizer  # noqa: E402
from neuron_bus.local_swarm import LocalSwarm  # noqa: E402
from neuron_bus.natsserver import free_port  # noqa: E402
from scripts import bench_kv, bench_record, bench_swarm, jetstream_floor  # noqa: E402

PREFILL_SIZES = (512, 2048, 4096)


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode("The sea is wide and deep, and the ships sail on it every day. " * (n // 8 + 8))
    return ids[:n]


# ------------------------------------------------------------------------------ single process


def bench_single(model_path: Path, threads: int, ids_by_size: dict[int, list[int]], n_decode: int) -> dict:
    """llama.cpp, whole model, one process."""
    longest = max(ids_by_size)
    backend = open_reference(model_path, threads=threads, n_ctx=longest + n_decode + 8, max_sessions=1)
    out: dict = {"prefill_tok_s": {}, "ttft_s": {}}
    try:
        for n, ids in ids_by_size.items():
            backend.open_session("p", longest + n_decode + 8)
            t0 = time.perf_counter()
            backend.prefill("p", 0, np.asarray(ids, dtype=np.int32))
            dt = time.perf_counter() - t0
            backend.close_session("p")
            out["prefill_tok_s"][n] = n / dt
            out["ttft_s"][n] = dt
        ids = ids_by_size[min(ids_by_size)]
        out["decode_tok_s"] = max(single_decode_rate(backend, ids, n_decode) for _ in range(2))
        out["rss_bytes"] = psutil.Process().memory_info().rss
    finally:
        backend.close()
    return out


def single_decode_rate(backend, ids: list[int], n_decode: int) -> float:
    """Greedy decode tok/s of one session on a whole-model backend, after prefilling ``ids``."""
    backend.open_session("d", len(ids) + n_decode + 8)
    try:
        logits = backend.prefill("d", 0, np.asarray(ids, dtype=np.int32))
        tok = int(np.argmax(logits))
        t0 = time.perf_counter()
        for i in range(n_decode):
            logits = backend.decode_step("d", len(ids) + i, np.array([tok], dtype=np.int32))
            tok = int(np.argmax(logits))
        return n_decode / (time.perf_counter() - t0)
    finally:
        backend.close_session("d")


SECURITY_MODES = {
    "no MAC": {"authenticate": False},
    "MAC": {},
    "AEAD": {"encrypt_activations": True},
}


def paired_security(model_path: Path, threads: int, ids: list[int], n_decode: int, workdir: Path, rounds: int = 3):
    """{mode: [(decode tok/s, prefill tok/s)]}: sessions without keys, with MACs and sealed, taking
    turns on one 2-hop route (the workers accept keyless sessions on an open bus)."""

    async def rates(url: str, security: dict) -> tuple[float, float]:
        async with await NeuronClient.connect(url, **security) as client:
            run = await generation(client, await client.route(), ids, n_decode)
            return decode_rate(run), len(ids) / (run["stamps"][0] - run["t0"])

    out: dict[str, list[tuple[float, float]]] = {m: [] for m in SECURITY_MODES}
    with LocalSwarm(model_path, 2, threads=threads, workdir=workdir / "security") as swarm:
        asyncio.run(rates(swarm.url, {}))  # warm-up
        for _ in range(rounds):
            for mode, security in SECURITY_MODES.items():
                out[mode].append(asyncio.run(rates(swarm.url, security)))
    return out


def security_cost(paired: dict[str, list[tuple[float, float]]]) -> dict:
    """Median decode and prefill cost of MACs and of AEAD against no MACs (fractions; > 0 is slower)."""
    med = {m: [statistics.median(r[i] for r in runs) for i in (0, 1)] for m, runs in paired.items()}
    base = med["no MAC"]
    return {
        m: {
            "decode_tok_s": v[0],
            "prefill_tok_s": v[1],
            "decode_cost": 1 - v[0] / base[0],
            "prefill_cost": 1 - v[1] / base[1],
        }
        for m, v in med.items()
    }


def paired_decode(model_path: Path, threads: int, ids: list[int], n_decode: int, workdir: Path, pairs: int = 3) -> list:
    """[(single-process tok/s, 2-hop route tok/s)], measured alternately, back to back.

    One session's route decode drifts with the machine's state more than the single process
    does; pairs measured seconds apart give a ratio that drift cannot skew.
    """

    async def route_rate(url: str) -> float:
        async with await NeuronClient.connect(url) as client:
            return decode_rate(await generation(client, await client.route(), ids, n_decode))

    backend = open_reference(model_path, threads=threads, n_ctx=len(ids) + n_decode + 8, max_sessions=1)
    try:
        with LocalSwarm(model_path, 2, threads=threads, workdir=workdir / "paired") as swarm:
            asyncio.run(route_rate(swarm.url))  # warm-up
            return [
                (single_decode_rate(backend, ids, n_decode), asyncio.run(route_rate(swarm.url))) for _ in range(pairs)
            ]
    finally:
        backend.close()


# ------------------------------------------------------------------------------ routes


class RssSampler:
    """Peak RSS of some processes, sampled in the background."""

    def __init__(self, pids: dict[str, int]):
        self.peak = {name: 0 for name in pids}
        self._procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, p in self._procs.items():
                try:
                    self.peak[name] = max(self.peak[name], p.memory_info().rss)
                except psutil.Error:
                    pass
            time.sleep(0.05)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def scrape(port: int, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    want = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == want:
            return float(value)
    return 0.0


async def generation(
    client: NeuronClient, route, ids: list[int], n_decode: int, chunk_size: int = 512, speculative: int = 0
) -> dict:
    """One greedy generation of exactly n_decode + 1 tokens; token arrival times and ids. Prefix
    reuse is off: the prompts of the prefill figures share their first blocks, and they measure
    the prompt computed (prefix reuse has its own figure, `prefix2k_ttft_vs_cold`).
    ``speculative`` k: decode steps carry up to k draft tokens (worker/drafting.py)."""
    t0 = time.perf_counter()
    stamps, tokens = [], []
    async for ev in client.generate(
        prompt_tokens=ids,
        route=route,
        chunk_size=chunk_size,
        sampling=M.SamplingParams(max_tokens=n_decode + 1, ignore_eos=True),
        prefix_reuse=False,
        speculative=speculative,
    ):
        if isinstance(ev, M.TokenDelta):
            stamps.append(time.perf_counter())
            tokens.append(ev.token_id)
    return {"t0": t0, "stamps": stamps, "tokens": tokens}


def decode_rate(run: dict) -> float:
    s = run["stamps"]
    return (len(s) - 1) / (s[-1] - s[0])


def steady_decode_rate(stamps: list[list[float]]) -> float:
    """Tokens per second over the window in which every session is decoding.

    Concurrent sessions start with their prefills queued behind each other, and finish one by
    one; counting from the first session's first token to the last one's last token would mix
    prefill and idle tails into a decode figure. The window runs from the moment the last session
    emitted its first token to the moment the first session emitted its last.
    """
    lo, hi = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    if hi - lo < 0.5:
        raise RuntimeError(f"the sessions decoded together for only {hi - lo:.2f}s: too short to measure")
    return sum(1 for s in stamps for t in s if lo < t <= hi) / (hi - lo)


def decode_backend_seconds(ports: list[int]) -> tuple[float, float]:
    """(backend seconds spent on decode summed over the hops, decode steps through the tail)."""
    busy = sum(scrape(p, "neuron_backend_call_seconds_sum", phase="decode") for p in ports)
    return busy, scrape(ports[-1], "neuron_tokens_total", phase="decode")


async def route_figures(
    url: str,
    ids_by_size: dict[int, list[int]],
    n_decode: int,
    concurrency: tuple[int, ...],
    ports: list[int],
    security: dict | None = None,
    pids: list[int] | None = None,
) -> dict:
    """A route's figures; with ``pids`` (its workers) also their CPU time per decoded token and hop."""
    out: dict = {
        "prefill_tok_s": {},
        "ttft_s": {},
        "aggregate_decode_tok_s": {},
        "token_intervals_s": [],
        "backend_ms_per_token": {},
    }
    async with await NeuronClient.connect(url) as client:
        route = await client.route()
        small = ids_by_size[min(ids_by_size)]
        await generation(client, route, small[:32], 4)  # warm-up
        for n, ids in ids_by_size.items():
            run = await generation(client, route, ids, 1)
            out["ttft_s"][n] = run["stamps"][0] - run["t0"]
            out["prefill_tok_s"][n] = n / out["ttft_s"][n]
        workers = [psutil.Process(pid) for pid in pids or []]
        cpu0 = sum(sum(w.cpu_times()[:2]) for w in workers)
        runs = [await generation(client, route, small, n_decode) for _ in range(2)]
        if workers:  # the two runs' prompts are in it too: one chunk per hop, next to 2 x n_decode steps
            cpu = sum(sum(w.cpu_times()[:2]) for w in workers) - cpu0
            out["decode_cpu_ms_per_token_hop"] = 1000 * cpu / sum(len(r["stamps"]) for r in runs) / len(workers)
        best = max(runs, key=decode_rate)
        out["decode_tok_s"] = decode_rate(best)
        out["token_intervals_s"] = list(np.diff(best["stamps"]))
        for k in concurrency:
            busy0, steps0 = decode_backend_seconds(ports)
            runs = await asyncio.gather(
                *(generation(client, route, small[: 64 + i], max(n_decode, 128)) for i in range(k))
            )
            out["aggregate_decode_tok_s"][k] = steady_decode_rate([r["stamps"] for r in runs])
            busy1, steps1 = decode_backend_seconds(ports)
            out["backend_ms_per_token"][k] = 1000 * (busy1 - busy0) / max(steps1 - steps0, 1)
    return out


def bench_route(
    model_path: Path,
    shards: int,
    backend: str,
    threads: int,
    ids_by_size: dict[int, list[int]],
    n_decode: int,
    workdir: Path,
    concurrency: tuple[int, ...] = (),
    security: dict | None = None,
    tag: str = "",
) -> dict:
    ports = [free_port() for _ in range(shards)]
    swarm = LocalSwarm(
        model_path,
        shards,
        backend=backend,
        threads=threads,
        workdir=workdir / f"{backend}-{shards}{tag}",
        worker_extra={i: ["--metrics-port", str(p), "--max-sessions", "8"] for i, p in enumerate(ports)},
    )
    with swarm:
        pids = {n: p.pid for n, p in swarm.procs.items() if n.startswith("worker")}
        seam0 = {
            ph: scrape(ports[0], "neuron_seam_bytes_total", phase=ph, direction="out") for ph in ("prefill", "decode")
        }
        msgs0 = scrape(ports[0], "neuron_seam_messages_total", phase="decode", direction="out")
        prompt0 = scrape(ports[0], "neuron_tokens_total", phase="prefill")
        with RssSampler(pids) as rss:
            out = asyncio.run(
                route_figures(swarm.url, ids_by_size, n_decode, concurrency, ports, security or {}, list(pids.values()))
            )
        seam = {ph: scrape(ports[0], "neuron_seam_bytes_total", phase=ph, direction="out") - seam0[ph] for ph in seam0}
        msgs = scrape(ports[0], "neuron_seam_messages_total", phase="decode", direction="out") - msgs0
        prompt_positions = scrape(ports[0], "neuron_tokens_total", phase="prefill") - prompt0  # every prompt hop 0 took
    out["decode_seam_bytes_per_token"] = seam["decode"] / max(msgs, 1)
    out["prefill_seam_bytes_per_token"] = seam["prefill"] / max(prompt_positions, 1)
    out["peak_rss_bytes"] = rss.peak
    return out


# ------------------------------------------------------------------------------ report


def ratio(a: float, b: float) -> str:
    return f"{a / b:5.2f}x" if b else "  -  "


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer decode tokens (under 5 minutes)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--model", default=models.DEFAULT_PRESET)
    ap.add_argument("--threads", type=int, default=1, help="threads per process (the same for every contender)")
    ap.add_argument(
        "--runs", type=int, default=1, help="run everything this many times; figures are medians with their range"
    )
    ap.add_argument(
        "--record", action="store_true", help="write docs/bench.json and the README's table from this invocation's runs"
    )
    ap.add_argument(
        "--only", choices=["kv"], help="kv: only the KV pool and prefix reuse figures (scripts/bench_kv.py)"
    )
    args = ap.parse_args()

    model_path = models.resolve(args.model)
    tok = open_tokenizer(model_path)
    if args.only == "kv":
        kv = bench_kv.measure(model_path, args.threads, Path(tempfile.mkdtemp(prefix="neuron-bench-kv-")), tok)
        print("\n".join(bench_kv.report(kv)))
        if args.json:
            args.json.write_text(json.dumps(kv, indent=2) + "\n")
        return 0
    ids_by_size = {n: prompt_ids(tok, n) for n in PREFILL_SIZES}
    n_decode = 48 if args.quick else 128
    work = Path(tempfile.mkdtemp(prefix="neuron-bench-"))
    print(
        f"model {model_path.name}; prefill {list(PREFILL_SIZES)} tokens; {n_decode} decode tokens; "
        f"{args.threads} thread(s) per process; {psutil.cpu_count()} cores; {args.runs} run(s)",
        flush=True,
    )
    runs = []
    for i in range(args.runs):
        print(f"run {i + 1} of {args.runs}", flush=True)
        runs.append(run_once(model_path, args.threads, ids_by_size, n_decode, work / f"run{i}", tok))
    result = bench_record.summarize(runs, quick=args.quick)
    if args.runs > 1:
        print("\n" + bench_record.table(result))
    for path in filter(None, (args.json, bench_record.JSON if args.record else None)):
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    if args.record:
        bench_record.write_readme(result)
        print(f"wrote the table in {bench_record.README}")
    return 0


def run_once(model_path: Path, threads: int, ids_by_size: dict[int, list[int]], n_decode: int, work: Path, tok) -> dict:
    """Every contender once, its table printed; the run's figures."""
    sizes = tuple(ids_by_size)
    t = time.time()
    single = bench_single(model_path, threads, ids_by_size, n_decode)
    print(f"  single process done ({time.time() - t:.0f}s)", flush=True)
    contenders = {}
    plan = [
        ("route2 llama.cpp", 2, "llama-cpp", (1, 4, 8), "MAC"),
        ("route2 no MAC", 2, "llama-cpp", (), "no MAC"),
        ("route2 AEAD", 2, "llama-cpp", (), "AEAD"),
        ("route3 llama.cpp", 3, "llama-cpp", (), "MAC"),
        ("route2 torch", 2, "torch", (), "MAC"),
        ("route2 no-op", 2, "noop", (), "MAC"),
        ("route3 no-op", 3, "noop", (), "MAC"),
    ]
    for name, shards, backend, conc, mode in plan:
        t = time.time()
        use_sizes = {min(sizes): ids_by_size[min(sizes)]} if backend == "torch" else ids_by_size
        contenders[name] = bench_route(
            model_path, shards, backend, threads, use_sizes, 16 if backend == "torch" else n_decode, work, conc,
            SECURITY_MODES[mode], tag="" if mode == "MAC" else "-" + mode.replace(" ", ""),
        )  # fmt: skip
        print(f"  {name} done ({time.time() - t:.0f}s)", flush=True)

    swarm = bench_swarm.measure(model_path, threads, work)
    print(f"  self-organizing swarm done: {swarm}", flush=True)
    paired = paired_decode(model_path, threads, ids_by_size[min(sizes)], n_decode, work)
    security = security_cost(paired_security(model_path, threads, ids_by_size[min(sizes)], n_decode, work))
    paired_ratios = [r / s for s, r in paired]
    floor = jetstream_floor.ring()
    floor_ms = floor.leg_ms_p50
    kv = bench_kv.measure(model_path, threads, work, tok)
    think_ms = 1000 / single["decode_tok_s"] / 2  # each hop of a 2-hop route computes about half a token
    floor_think_ms = jetstream_floor.measure(300, think_ms)
    r2, r3 = contenders["route2 llama.cpp"], contenders["route3 llama.cpp"]
    hop_ms = []
    for name, hops in (("route2 no-op", 2), ("route3 no-op", 3)):
        hop_ms += [1000 * dt / hops for dt in contenders[name]["token_intervals_s"]]
    per_hop_p50 = statistics.median(hop_ms)
    noop_cpu_ms = statistics.mean(
        contenders[n]["decode_cpu_ms_per_token_hop"] for n in ("route2 no-op", "route3 no-op")
    )

    print()
    head = f"{'contender':20} {'decode tok/s':>13} {'vs single':>9}"
    for n in sizes:
        head += f" {'prefill ' + str(n):>13} {'vs single':>9}"
    head += f" {'TTFT ms':>8} {'seam B/tok dec':>14} {'seam B/tok pre':>14} {'peak RSS MB/hop':>16}"
    print(head)

    def row(name: str, r: dict, rss: str) -> None:
        line = f"{name:20} {r['decode_tok_s']:13.1f} {ratio(r['decode_tok_s'], single['decode_tok_s']):>9}"
        for n in sizes:
            if n in r["prefill_tok_s"]:
                line += f" {r['prefill_tok_s'][n]:13.1f} {ratio(r['prefill_tok_s'][n], single['prefill_tok_s'][n]):>9}"
            else:
                line += f" {'-':>13} {'-':>9}"
        line += f" {1000 * r['ttft_s'][min(sizes)]:8.1f}"
        line += f" {r.get('decode_seam_bytes_per_token', 0):14.0f} {r.get('prefill_seam_bytes_per_token', 0):14.0f} {rss:>16}"
        print(line)

    row("single llama.cpp", single, f"{single['rss_bytes'] / 2**20:.0f}")
    for name, r in contenders.items():
        row(name, r, "/".join(f"{v / 2**20:.0f}" for v in r["peak_rss_bytes"].values()))
    agg = r2["aggregate_decode_tok_s"]
    print()
    print(
        "aggregate decode tok/s, 2-hop llama.cpp route: "
        + ", ".join(f"{k} sessions {v:.1f}" for k, v in agg.items())
        + f"  (8 vs 1: {agg[8] / agg[1]:.2f}x; 8 vs single process: {agg[8] / single['decode_tok_s']:.2f}x)"
    )
    cost = r2["backend_ms_per_token"]
    cores = psutil.cpu_count()
    ceiling = {k: cores * 1000 / v for k, v in cost.items()}
    print(
        "  backend time per decoded token, all hops: "
        + ", ".join(f"{k} sessions {v:.1f} ms" for k, v in cost.items())
        + f"; at that cost {cores} cores cap 8 sessions at {ceiling[8]:.0f} tok/s ({ceiling[8] / agg[1]:.2f}x one session)"
    )
    print(
        "2-hop decode vs single process, measured alternately: "
        + ", ".join(f"{r:.1f}/{s:.1f} = {r / s:.2f}x" for s, r in paired)
        + f"  (median {statistics.median(paired_ratios):.2f}x)"
    )
    print(
        f"per-hop overhead with no-op hops: p50 {per_hop_p50:.3f} ms, {per_hop_p50 / floor_ms:.2f}x "
        f"a bare two-process JetStream relay on this machine ({floor_ms:.3f} ms per leg; "
        f"{floor_think_ms:.3f} ms when each leg also waits {think_ms:.1f} ms for a backend thread)"
    )
    print(
        f"  CPU per hop and token with no-op hops: {noop_cpu_ms:.3f} ms, {noop_cpu_ms / floor.cpu_ms_per_leg:.2f}x "
        f"the relay's {floor.cpu_ms_per_leg:.3f} ms per message it relays"
    )
    print(
        "session keys on the 2-hop route, measured alternately (cost vs no MACs, decode / prefill "
        f"{min(sizes)}): "
        + ", ".join(
            f"{m} {v['decode_cost']:+.1%} / {v['prefill_cost']:+.1%}" for m, v in security.items() if m != "no MAC"
        )
        + " (target: MACs at most 2% of decode tok/s)"
    )
    big = max(sizes)
    prefill_time_ratio = single["prefill_tok_s"][big] / r2["prefill_tok_s"][big]
    print(f"{big}-token prefill, 2-hop route time / single-process time: {prefill_time_ratio:.2f}")
    for line in bench_kv.report(kv):
        print(line)

    result = {
        "model": model_path.name,
        "threads_per_process": threads,
        "decode_tokens": n_decode,
        "prefill_sizes": list(sizes),
        "single_decode_tok_s": single["decode_tok_s"],
        "single_prefill_tok_s": single["prefill_tok_s"],
        "single_ttft_s": single["ttft_s"],
        "route2_decode_tok_s": r2["decode_tok_s"],
        "route3_decode_tok_s": r3["decode_tok_s"],
        "route2_torch_decode_tok_s": contenders["route2 torch"]["decode_tok_s"],
        "route2_prefill_tok_s": r2["prefill_tok_s"],
        "route3_prefill_tok_s": r3["prefill_tok_s"],
        "route2_ttft_s": r2["ttft_s"],
        "route3_ttft_s": r3["ttft_s"],
        "route2_vs_single_decode_ratio": r2["decode_tok_s"] / single["decode_tok_s"],
        "route3_vs_single_decode_ratio": r3["decode_tok_s"] / single["decode_tok_s"],
        "route2_vs_single_decode_paired": [{"single_tok_s": s, "route2_tok_s": r} for s, r in paired],
        "route2_vs_single_decode_ratio_paired_median": statistics.median(paired_ratios),
        "decode_seam_bytes_per_token": r2["decode_seam_bytes_per_token"],
        "prefill_seam_bytes_per_token": r2["prefill_seam_bytes_per_token"],
        "per_hop_overhead_ms_p50": per_hop_p50,
        "jetstream_relay_floor_ms_p50": floor_ms,
        "noop_hop_vs_relay_floor": per_hop_p50 / floor_ms,  # issue 20's target: at most 1.3
        "noop_hop_cpu_ms_per_token": noop_cpu_ms,
        "jetstream_relay_floor_cpu_ms_per_leg": floor.cpu_ms_per_leg,
        "noop_hop_cpu_vs_relay_floor": noop_cpu_ms / floor.cpu_ms_per_leg,
        "jetstream_relay_floor_with_backend_ms_p50": floor_think_ms,
        "aggregate_decode_tok_s": agg,
        "concurrent8_vs_single_ratio": agg[8] / agg[1],
        "backend_ms_per_decode_token": cost,
        "concurrent8_cpu_ceiling_tok_s": ceiling[8],
        f"prefill{big // 1024}k_route2_vs_single_ratio": prefill_time_ratio,
        "route2_no_mac_decode_tok_s": contenders["route2 no MAC"]["decode_tok_s"],
        "route2_aead_decode_tok_s": contenders["route2 AEAD"]["decode_tok_s"],
        "route2_no_mac_prefill_tok_s": contenders["route2 no MAC"]["prefill_tok_s"],
        "route2_aead_prefill_tok_s": contenders["route2 AEAD"]["prefill_tok_s"],
        "security_paired": security,
        **swarm,
        **kv,
        "peak_rss_bytes": {name: r["peak_rss_bytes"] for name, r in contenders.items()}
        | {"single": single["rss_bytes"]},
    }
    return result


if __name__ == "__main__":
    sys.exit(main())
