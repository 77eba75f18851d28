"""Time to first token of many prompts sent at once to one route, next to its first-come bound.

    scripts/ttft_bench [--sessions 16] [--prompt 480] [--runs 3] [--model PRESET|PATH] [--json PATH]

A 2-hop llama.cpp route (LocalSwarm, one thread per process) gets ``--sessions`` prompts of
``--prompt`` tokens at the same moment, through the client with the gateway's chunk size, and each
session's time to first token is taken. The prompts' prefill is the same work whatever the order:
what the order decides is who waits. The bound is first come, first served at the rate the route
showed in the same run: the last first token came after all N prompts were prefilled, so the k-th
prompt could have had its first token after k/N of that time, a mean of (N+1)/(2N) of it. Sharing
every batch among all waiting prompts instead puts every first token near the end (mean about 2x
the bound); the hop's prompt turns (neuron_bus/worker/waves.py) aim at the bound.

Figures per run, then medians with their range over the runs: mean, p50 and p90 TTFT, the first
and the last, and ``ttft_mean_vs_first_come_bound``.

Then, once per run, a short prompt (about 32 tokens, sent as text for the route's head to
tokenize, as the gateway's requests are) sent a second after 4 long ones (2x ``--prompt`` tokens
each): its time to first token against its time alone on the idle route
(``short_behind_long_vs_alone``). First come, first served alone would hold it until a long prompt
is in; the hop gives one place in each batch to the prompt with the fewest positions left.
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
from neuron_bus.execution import open_tokenizer  # noqa: E402
from neuron_bus.gateway.bus import DEFAULT_CHUNK  # noqa: E402
from neuron_bus.local_swarm import LocalSwarm  # noqa: E402
from scripts import bench_kv, bench_record  # noqa: E402

NEW_TOKENS = 8


def prompts(tokenizer, sessions: int, length: int) -> list[list[int]]:
    """``sessions`` different prompts of ``length`` tokens (windows of one long text)."""
    text = " ".join(
        f"Note {i}: the harbour master logged ship {i * 7 % 31} arriving from port {i * 13 % 17} with cargo of "
        f"{['grain', 'timber', 'salt', 'wool', 'iron'][i % 5]} and {i * 3 % 11} passengers."
        for i in range(40 + length // 4 + sessions)
    )
    ids = tokenizer.encode(text)
    if len(ids) < length + 4 * sessions:
        raise ValueError(f"the text gives {len(ids)} tokens, fewer than {length + 4 * sessions}")
    return [ids[4 * k : 4 * k + length] for k in range(sessions)]


async def _first_token(c: NeuronClient, prompt: list[int] | str, chunk: int) -> float:
    first, _, _ = await bench_kv.first_token(c, prompt, NEW_TOKENS, chunk_size=chunk, prefix_reuse=False)
    return first


def figures(ttfts: list[float]) -> dict:
    t = sorted(ttfts)
    n = len(t)
    bound = (n + 1) / (2 * n) * t[-1]
    return {
        "ttft_mean_s": statistics.mean(t),
        "ttft_p50_s": statistics.median(t),
        "ttft_p90_s": t[min(n - 1, (9 * n) // 10)],
        "ttft_first_s": t[0],
        "ttft_last_s": t[-1],
        "first_come_bound_mean_s": bound,
        "ttft_mean_vs_first_come_bound": statistics.mean(t) / bound,
    }


SHORT = 32  # tokens of the short prompt sent behind long ones
LONG = 4  # long prompts it is sent behind


def run_once(url: str, batch: list[list[int]], chunk: int, long: list[list[int]], short: str) -> dict:
    async def go() -> tuple[list[float], float, float]:
        async with await NeuronClient.connect(url, queue_limit=0) as c:
            await _first_token(c, batch[0][:SHORT], chunk)  # warm: consumers bound, links up
            alone = await _first_token(c, short, chunk)
            ttfts = list(await asyncio.gather(*(_first_token(c, ids, chunk) for ids in batch)))
            longs = [asyncio.create_task(_first_token(c, ids, chunk)) for ids in long]
            await asyncio.sleep(1.0)
            behind = await _first_token(c, short, chunk)
            await asyncio.gather(*longs)
            return ttfts, alone, behind

    ttfts, alone, behind = asyncio.run(go())
    return figures(ttfts) | {
        "short_alone_ttft_s": alone,
        "short_behind_long_ttft_s": behind,
        "short_behind_long_vs_alone": behind / alone,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=480, help="tokens per prompt")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="prompt chunk size (the gateway's by default)")
    ap.add_argument("--model", default=models.DEFAULT_PRESET)
    ap.add_argument("--json", type=Path, help="write the runs and their medians here")
    args = ap.parse_args()

    model_path = models.resolve(args.model)
    tokenizer = open_tokenizer(model_path)
    batch = prompts(tokenizer, args.sessions, args.prompt)
    long = prompts(tokenizer, LONG, 2 * args.prompt)
    short = tokenizer.decode(batch[-1][-SHORT:])  # text: the head tokenizes it, as it does the gateway's
    print(
        f"model {model_path.name}; {args.sessions} prompts of {args.prompt} tokens at once on a 2-hop route, "
        f"chunks of {args.chunk}; 1 thread per process; {args.runs} run(s)",
        flush=True,
    )
    runs = []
    with LocalSwarm(model_path, 2, workdir=Path(tempfile.mkdtemp(prefix="neuron-ttft-"))) as swarm:
        for i in range(args.runs):
            r = run_once(swarm.url, batch, args.chunk, long, short)
            runs.append(r)
            print(
                f"run {i + 1}: TTFT mean {r['ttft_mean_s']:.1f} s, p50 {r['ttft_p50_s']:.1f}, p90 {r['ttft_p90_s']:.1f}, "
                f"first {r['ttft_first_s']:.1f}, last {r['ttft_last_s']:.1f}; first-come bound for the mean "
                f"{r['first_come_bound_mean_s']:.1f} s: {r['ttft_mean_vs_first_come_bound']:.2f}x; a {SHORT}-token prompt "
                f"behind {LONG} of {2 * args.prompt}: {r['short_behind_long_ttft_s']:.2f} s, alone "
                f"{r['short_alone_ttft_s']:.2f} s: {r['short_behind_long_vs_alone']:.1f}x",
                flush=True,
            )
    summary = bench_record.spread(runs)
    if args.runs > 1:
        print("medians [range] over the runs:")
        for k, v in summary.items():
            print(f"  {k}: {v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "model": model_path.name,
                    "sessions": args.sessions,
                    "prompt_tokens": args.prompt,
                    "chunk": args.chunk,
                    "runs": runs,
                    "summary": summary,
                },
                indent=2,
            )
            + "\n"  # fmt: skip
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
