"""Where one session's decode token goes on a route: per hop and stage, next to the single process.

    scripts/token_profile [--hops 2] [--tokens 128] [--pairs 3] [--json PATH] [--model PRESET|PATH]

Alternately (single process, route, single process, route, ...) one greedy session decodes
``--tokens`` tokens on the whole model in this process, and on a local route of ``--hops``
llama.cpp workers (one thread each). For each route run the workers' metrics are read before and
after, and the token's time is split into:

- per hop, per decode wave (one session: one wave per token), the stages of the worker's loop
  (``neuron_step_seconds_total``): wait (the step's arrival to the loop taking it), admit,
  the backend call itself (``neuron_backend_call_seconds_sum``), its hand-off to and from the backend
  thread (compute minus the call: zero when the call runs inline), advance, send (outputs started);
- bus: what is left of the client's time per token: the publishes through nats-server, the
  pushes to the next hop's consumer, nats-py's parsing and dispatch, and the wake-ups of idle
  processes in between.

The single process's time per token stands beside it, and the hops' calls summed against it (the
split's own compute cost). Every figure is the median over the pairs, with its range.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neuron_bus import models  # noqa: E402
from neuron_bus.client import NeuronClient  # noqa: E402
from neuron_bus.execution import open_reference, open_tokenizer  # noqa: E402
from neuron_bus.local_swarm import LocalSwarm  # noqa: E402
from neuron_bus.natsserver import free_port  # noqa: E402
from scripts.bench import decode_rate, generation, prompt_ids, scrape, single_decode_rate  # noqa: E402

STAGES = ("wait", "admit", "handoff", "call", "advance", "send")


def hop_counters(port: int) -> dict[str, float]:
    """A hop's decode counters: seconds per loop stage, the backend call's seconds, waves."""
    out = {
        s: scrape(port, "neuron_step_seconds_total", phase="decode", stage=s)
        for s in ("wait", "admit", "compute", "advance", "send")
    }
    out["call"] = scrape(port, "neuron_backend_call_seconds_sum", phase="decode")
    out["waves"] = scrape(port, "neuron_backend_call_seconds_count", phase="decode")
    return out


def per_wave_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k: after[k] - before[k] for k in after}
    waves = max(d.pop("waves"), 1.0)
    d["handoff"] = max(0.0, d.pop("compute") - d["call"])
    return {s: 1000 * d[s] / waves for s in STAGES}


async def route_run(url: str, ports: list[int], ids: list[int], n_decode: int) -> dict:
    async with await NeuronClient.connect(url) as client:
        route = await client.route()
        before = [hop_counters(p) for p in ports]
        run = await generation(client, route, ids, n_decode)
        after = [hop_counters(p) for p in ports]
    # decode-phase counters: n_decode waves per hop in this run, the steps of the client's n_decode
    # intervals between its n_decode + 1 tokens (the first comes from the prefill)
    hops = [per_wave_ms(b, a) for b, a in zip(before, after, strict=True)]
    token_ms = 1000 / decode_rate(run)
    return {"token_ms": token_ms, "hops": hops, "bus_ms": token_ms - sum(sum(h.values()) for h in hops)}


def profile(model_path: Path, hops: int, n_decode: int, pairs: int, workdir: Path) -> dict:
    ids = prompt_ids(open_tokenizer(model_path), 64)
    ports = [free_port() for _ in range(hops)]
    backend = open_reference(model_path, threads=1, n_ctx=len(ids) + n_decode + 8, max_sessions=1)
    single, routes = [], []
    try:
        extra = {i: ["--metrics-port", str(p)] for i, p in enumerate(ports)}
        with LocalSwarm(model_path, hops, threads=1, workdir=workdir, worker_extra=extra) as swarm:
            asyncio.run(route_run(swarm.url, ports, ids, 16))  # warm-up
            for i in range(pairs):
                single.append(1000 / single_decode_rate(backend, ids, n_decode))
                routes.append(asyncio.run(route_run(swarm.url, ports, ids, n_decode)))
                print(
                    f"  pair {i + 1}: single {single[-1]:.2f} ms/token, route {routes[-1]['token_ms']:.2f}", flush=True
                )
    finally:
        backend.close()
    return {"hops": hops, "decode_tokens": n_decode, "single_ms": single, "routes": routes}


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(raw: dict) -> dict:
    routes = raw["routes"]
    hops = [{s: spread([r["hops"][h][s] for r in routes]) for s in STAGES} for h in range(raw["hops"])]
    calls = [sum(h["call"] for h in r["hops"]) for r in routes]
    return {
        "single_ms_per_token": spread(raw["single_ms"]),
        "route_ms_per_token": spread([r["token_ms"] for r in routes]),
        "route_vs_single_paired": spread([s / r["token_ms"] for s, r in zip(raw["single_ms"], routes, strict=True)]),
        "hops": hops,
        "calls_ms_per_token": spread(calls),
        "calls_vs_single": spread([c / s for c, s in zip(calls, raw["single_ms"], strict=True)]),
        "bus_ms_per_token": spread([r["bus_ms"] for r in routes]),
        "raw": raw,
    }


def fmt(x: dict[str, float]) -> str:
    return f"{x['median']:6.2f} ({x['min']:.2f}-{x['max']:.2f})"


def report(s: dict) -> list[str]:
    lines = [
        f"single process      {fmt(s['single_ms_per_token'])} ms/token",
        f"route               {fmt(s['route_ms_per_token'])} ms/token   single/route paired {fmt(s['route_vs_single_paired'])}",
    ]
    for i, h in enumerate(s["hops"]):
        lines.append(f"hop {i}")
        lines += [f"  {stage:<17} {fmt(h[stage])} ms" for stage in STAGES]
    lines += [
        f"bus and wake-ups    {fmt(s['bus_ms_per_token'])} ms  (the rest of the client's time per token)",
        f"hops' calls summed  {fmt(s['calls_ms_per_token'])} ms = {fmt(s['calls_vs_single'])}x the single process's token",
    ]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hops", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="decode tokens per run")
    ap.add_argument("--pairs", type=int, default=3, help="single-process and route runs, alternately")
    ap.add_argument("--model", default=models.DEFAULT_PRESET)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model_path = models.resolve(args.model)
    print(f"model {model_path.name}; {args.hops} hops; {args.tokens} decode tokens; {args.pairs} pairs", flush=True)
    raw = profile(model_path, args.hops, args.tokens, args.pairs, Path(tempfile.mkdtemp(prefix="neuron-profile-")))
    s = summarize(raw)
    print("\n".join(report(s)))
    if args.json:
        args.json.write_text(json.dumps(s, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
