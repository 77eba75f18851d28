"""Side-by-side benchmark: single-process llama.cpp vs 2-hop and 3-hop routes, in one run.

    scripts/bench [--quick] [--json PATH] [--model PRESET|PATH] [--threads N]

Every figure comes from the same machine in the same run; the table prints each route's ratio
to single-process llama.cpp (the reference every user compares us with).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neuron_bus import messages as M  # noqa: E402
from neuron_bus import models  # noqa: E402
from neuron_bus.client import NeuronClient  # noqa: E402
from neuron_bus.local_swarm import LocalSwarm  # noqa: E402
from neuron_bus.natsserver import free_port  # noqa: E402


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode("The sea is wide and deep, and the ships sail on it every day. " * (n // 8 + 8))
    return ids[:n]


def bench_single(model_path: Path, threads: int, n_prompt: int, n_decode: int) -> dict:
    """llama.cpp, whole model, one process: prefill tok/s, TTFT, decode tok/s."""
    from workers.llama_cpp_full import LlamaCppFullBackend
    from workers.tokenizer import Tokenizer

    ids = np.asarray(prompt_ids(Tokenizer(model_path), n_prompt), dtype=np.int32)
    backend = LlamaCppFullBackend(model_path, n_threads=threads, n_ctx=n_prompt + n_decode + 8, max_sessions=1, benchmark=False)
    try:
        backend.open_session("bench", n_prompt + n_decode + 8)
        t0 = time.perf_counter()
        logits = backend.prefill("bench", 0, ids)
        ttft = time.perf_counter() - t0
        tok = int(np.argmax(logits))
        t1 = time.perf_counter()
        for i in range(n_decode):
            logits = backend.decode_step("bench", n_prompt + i, np.array([tok], dtype=np.int32))
            tok = int(np.argmax(logits))
        decode_s = time.perf_counter() - t1
        backend.close_session("bench")
    finally:
        backend.close()
    return {"prefill_tok_s": n_prompt / ttft, "ttft_s": ttft, "decode_tok_s": n_decode / decode_s}


def scrape(port: int, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    want = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == want:
            return float(value)
    return 0.0


async def timed_generation(url: str, ids: list[int], n_decode: int, wire_dtype: str) -> dict:
    async with await NeuronClient.connect(url) as client:
        route = await client.route(wire_dtype=wire_dtype)
        t0 = time.perf_counter()
        stamps = []
        async for ev in client.generate(
            prompt_tokens=ids, route=route, chunk_size=512,
            sampling=M.SamplingParams(max_tokens=n_decode + 1, ignore_eos=True),
        ):
            if isinstance(ev, M.TokenDelta):
                stamps.append(time.perf_counter())
    ttft = stamps[0] - t0
    return {"ttft_s": ttft, "prefill_tok_s": len(ids) / ttft, "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}


def bench_route(model_path: Path, shards: int, threads: int, n_prompt: int, n_decode: int, wire_dtype: str, workdir: Path) -> dict:
    from workers.tokenizer import Tokenizer

    ids = prompt_ids(Tokenizer(model_path), n_prompt)
    ports = [free_port() for _ in range(shards)]
    swarm = LocalSwarm(
        model_path, shards, threads=threads, workdir=workdir / f"route{shards}",
        worker_extra={i: ["--metrics-port", str(p)] for i, p in enumerate(ports)},
    )
    with swarm:
        asyncio.run(timed_generation(swarm.url, ids[:32], 4, wire_dtype))  # warm up the route
        before = (scrape(ports[0], "neuron_seam_bytes_total", phase="decode", direction="out"),
                  scrape(ports[0], "neuron_seam_messages_total", phase="decode", direction="out"))
        runs = [asyncio.run(timed_generation(swarm.url, ids, n_decode, wire_dtype)) for _ in range(2)]
        after = (scrape(ports[0], "neuron_seam_bytes_total", phase="decode", direction="out"),
                 scrape(ports[0], "neuron_seam_messages_total", phase="decode", direction="out"))
    best = max(runs, key=lambda r: r["decode_tok_s"])
    best["decode_seam_bytes_per_token"] = (after[0] - before[0]) / max(after[1] - before[1], 1)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short prompt and decode (under 5 minutes)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--model", default=models.DEFAULT_PRESET)
    ap.add_argument("--threads", type=int, default=1, help="threads per process (same for every contender)")
    ap.add_argument("--wire-dtype", default="f32", choices=["f32", "bf16"])
    args = ap.parse_args()
    model_path = models.resolve(args.model)
    n_prompt, n_decode = (128, 64) if args.quick else (512, 128)
    work = Path(tempfile.mkdtemp(prefix="neuron-bench-"))

    print(f"model {model_path.name}, prompt {n_prompt} tokens, {n_decode} decode tokens, {args.threads} thread(s) per process")
    single = [bench_single(model_path, args.threads, n_prompt, n_decode) for _ in range(2)]
    single = max(single, key=lambda r: r["decode_tok_s"])
    route2 = bench_route(model_path, 2, args.threads, n_prompt, n_decode, args.wire_dtype, work)
    route3 = bench_route(model_path, 3, args.threads, n_prompt, n_decode, args.wire_dtype, work)

    rows = [("single-process llama.cpp", single), ("2-hop route", route2), ("3-hop route", route3)]
    print(f"\n{'':26} {'decode tok/s':>12} {'ratio':>6} {'prefill tok/s':>13} {'ratio':>6} {'TTFT ms':>8} {'seam B/tok':>10}")
    for name, r in rows:
        print(
            f"{name:26} {r['decode_tok_s']:12.1f} {r['decode_tok_s'] / single['decode_tok_s']:6.2f} "
            f"{r['prefill_tok_s']:13.1f} {r['prefill_tok_s'] / single['prefill_tok_s']:6.2f} "
            f"{r['ttft_s'] * 1000:8.1f} {r.get('decode_seam_bytes_per_token', 0):10.0f}"
        )
    result = {
        "model": model_path.name,
        "prompt_tokens": n_prompt,
        "decode_tokens": n_decode,
        "threads_per_process": args.threads,
        "wire_dtype": args.wire_dtype,
        "single_decode_tok_s": single["decode_tok_s"],
        "single_prefill_tok_s": single["prefill_tok_s"],
        "single_ttft_s": single["ttft_s"],
        "route2_decode_tok_s": route2["decode_tok_s"],
        "route2_prefill_tok_s": route2["prefill_tok_s"],
        "route2_ttft_s": route2["ttft_s"],
        "route3_decode_tok_s": route3["decode_tok_s"],
        "route3_prefill_tok_s": route3["prefill_tok_s"],
        "route3_ttft_s": route3["ttft_s"],
        "route2_vs_single_decode_ratio": route2["decode_tok_s"] / single["decode_tok_s"],
        "route3_vs_single_decode_ratio": route3["decode_tok_s"] / single["decode_tok_s"],
        "route2_vs_single_prefill_ratio": route2["prefill_tok_s"] / single["prefill_tok_s"],
        "decode_seam_bytes_per_token": route2["decode_seam_bytes_per_token"],
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
