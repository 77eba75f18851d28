"""KV figures of scripts/bench: the shared KV pool and prefix reuse.

    scripts/bench --only kv     (these two figures alone, a few minutes)

- ``sessions_admitted_512``: sessions of 512 positions (prompt + new tokens) one worker admits in
  the default memory (the KV of today's 8 fixed slots of 4608 positions, --max-sessions 8): the
  fewest any hop of a 2-hop llama.cpp split admits, against the 8 the fixed slots took.
- ``prefix2k_ttft_vs_cold``: the second turn of a chat whose 2048 first tokens are shared with the
  first turn, on a 2-hop route: its time to first token over the same prompt's cold time to first
  token (prefix reuse off), and whether the two gave the same tokens (target <= 0.15, identical).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from neuron_bus import messages as M
from neuron_bus.artifacts.gguf_model import GGUFModel
from neuron_bus.client import NeuronClient
from neuron_bus.execution import open_range
from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.split import model_split
from workers.errors import NoFreeSlot

FIXED_SLOTS = 8  # what the worker took before the pool: 8 slots of 4608 positions
N_CTX = 4608
PREFIX = 2048
NEW_TOKENS = 16


def sessions_admitted(model_path: Path, threads: int, positions: int = 512, cache_dir: Path | None = None) -> dict:
    """Sessions of ``positions`` each hop of a 2-hop split admits with the worker's default memory."""
    per_hop = []
    for start, end in model_split(GGUFModel(model_path), 2):  # the split LocalSwarm (and up) runs
        backend = open_range(
            "llama-cpp", model_path, start, end, threads=threads, n_ctx=N_CTX, max_sessions=FIXED_SLOTS,
            benchmark=False, cache_dir=cache_dir,
        )  # fmt: skip
        admitted = 0
        try:
            while admitted < 1024:
                backend.open_session(f"s{admitted}", positions)
                admitted += 1
        except NoFreeSlot:
            pass
        finally:
            backend.close()
        per_hop.append(admitted)
    return {f"sessions_admitted_{positions}": min(per_hop), f"sessions_admitted_{positions}_per_hop": per_hop}


async def first_token(
    c: NeuronClient, prompt: list[int] | str, new_tokens: int = NEW_TOKENS, **kw
) -> tuple[float, list[int], int]:
    """Time to first token of one generation of ``new_tokens`` (greedy), its tokens, and the prompt
    positions its route reused; ``prompt``: token ids, or text for the route's head to tokenize (as
    the gateway's requests are); ``kw`` goes to `NeuronClient.generate`."""
    t0 = time.perf_counter()
    first, tokens, reused = None, [], 0
    sampling = M.SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    given = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_tokens": prompt}
    async for ev in c.generate(**given, sampling=sampling, **kw):
        if isinstance(ev, M.TokenDelta):
            first = first if first is not None else time.perf_counter() - t0
            tokens.append(ev.token_id)
        else:
            reused = max(reused, ev.prefill_tokens_reused)
    assert first is not None
    return first, tokens, reused


def prefix_ttft(model_path: Path, threads: int, workdir: Path, tokenizer) -> dict:
    """Second turn's TTFT with a reused 2048-token prefix over its cold TTFT, on a 2-hop route."""
    text = " ".join(f"Line {i}: the keeper noted wind {i % 9}, tide {i % 5} and {i % 13} gulls." for i in range(600))
    shared = tokenizer.encode("You are a careful assistant. Here is the log:\n" + text)[:PREFIX]
    turn1 = shared + tokenizer.encode("\nUser: how many lines mention tide 3?\nAssistant:")
    turn2 = shared + tokenizer.encode("\nUser: and how windy was line 40?\nAssistant:")

    async def run(url: str) -> dict:
        async with await NeuronClient.connect(url) as c:
            await first_token(c, turn1[:300], prefix_reuse=False)  # warm the route (consumers, connections)
            cold, cold_tokens, _ = await first_token(c, turn2, prefix_reuse=False)
            await first_token(c, turn1)  # the first turn: computed, its prefix kept by every hop
            warm, warm_tokens, reused = await first_token(c, turn2)
        return {
            "prefix2k_ttft_vs_cold": warm / cold,
            "prefix2k_cold_ttft_s": cold,
            "prefix2k_second_turn_ttft_s": warm,
            "prefix2k_tokens_reused": reused,
            "prefix2k_identical_output": warm_tokens == cold_tokens,
        }

    with LocalSwarm(model_path, 2, threads=threads, workdir=workdir / "prefix2k") as swarm:
        return asyncio.run(run(swarm.url))


def measure(model_path: Path, threads: int, workdir: Path, tokenizer) -> dict:
    return sessions_admitted(model_path, threads, cache_dir=workdir / "slices") | prefix_ttft(
        model_path, threads, workdir, tokenizer
    )


def report(r: dict) -> list[str]:
    return [
        f"sessions_admitted_512: {r['sessions_admitted_512']} sessions of 512 positions per worker in the default "
        f"memory (per hop {r['sessions_admitted_512_per_hop']}) vs {FIXED_SLOTS} fixed slots: "
        f"{r['sessions_admitted_512'] / FIXED_SLOTS:.1f}x (target >= 4x)",
        f"prefix2k_ttft_vs_cold: {r['prefix2k_ttft_vs_cold']:.3f} (second turn {r['prefix2k_second_turn_ttft_s']:.3f} s "
        f"with {r['prefix2k_tokens_reused']} positions reused, cold {r['prefix2k_cold_ttft_s']:.3f} s; identical "
        f"output: {'yes' if r['prefix2k_identical_output'] else 'NO'}; target <= 0.15)",
    ]
