"""llama.cpp's two KV layouts for a worker's sessions, measured (docs/bench.md, "KV pool"):
one stream per sequence (kv_unified off, what workers/kv_pool.py keeps) against one buffer for
every sequence (kv_unified on). 8 sessions of P prompt tokens (default 450: cells that do not start
on a multiple of flash attention's 64-cell tiles), then 16 decode steps of all 8 in one call: the
times, and whether each of 4 sessions gives the logits (and greedy tokens) it gives alone.

    .venv/bin/python scripts/kv_layout.py [P]
"""

import sys
import time
from pathlib import Path

import llama_cpp as L
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from neuron_bus import models  # noqa: E402
from workers import llama_cpp_common as C  # noqa: E402
from workers.tokenizer import Tokenizer  # noqa: E402

path = models.resolve("smollm2-135m")
UNIFIED = {"on": False}
_orig = L.llama_init_from_model


def patched(model, cparams):
    cparams.kv_unified = UNIFIED["on"]
    return _orig(model, cparams)


C.L.llama_init_from_model = patched

tok = Tokenizer(path)
text = " ".join(
    f"Entry {i}: the {['red', 'blue', 'green', 'grey'][i % 4]} boat {i % 17} left at {i % 24}h." for i in range(2000)
)
ids = tok.encode(text)
N, P, D = 8, int(sys.argv[1]) if len(sys.argv) > 1 else 450, 16
prompts = [np.array(ids[9 * k : 9 * k + P], np.int32) for k in range(N)]


def run(unified: bool, sessions: list[int], n_slots: int):
    UNIFIED["on"] = unified
    w = C.Weights(path)
    m = C.LlamaCppModel(
        w, n_ctx_slot=512, n_slots=n_slots, n_batch=512, n_threads=1, config=C.ContextConfig(), tap_output=False
    )
    out = {k: [] for k in sessions}
    t0 = time.perf_counter()
    last = {}
    for j, k in enumerate(sessions):  # prefill one by one (seq id j)
        lg = m.decode([C.Rows(j, 0, prompts[k])], "logits")[0]
        last[k] = int(np.argmax(lg))
        out[k].append(lg)
    t1 = time.perf_counter()
    for step in range(D):
        parts = [C.Rows(j, P + step, np.array([last[k]], np.int32)) for j, k in enumerate(sessions)]
        lgs = m.decode(parts, "logits")
        for k, lg in zip(sessions, lgs):
            last[k] = int(np.argmax(lg))
            out[k].append(lg)
    t2 = time.perf_counter()
    m.close()
    w.close()
    return out, (t1 - t0), (t2 - t1) / D


for unified in (False, True):
    both, pre, dec = run(unified, list(range(N)), N)
    same = 0
    tokens_same = 0
    for k in range(N):
        solo, _, _ = run(unified, [k], 1) if k < 4 else (None, 0, 0)
        if solo is None:
            continue
        same += all(np.array_equal(a, b) for a, b in zip(both[k], solo[k]))
        tokens_same += all(int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(both[k], solo[k]))
    print(
        f"kv_unified={unified}: prefill {N}x{P} {pre:.2f}s, batched decode of {N} {1000 * dec:.1f} ms/step; "
        f"of 4 sessions checked, logits bit-identical to solo: {same}, greedy tokens equal: {tokens_same}",
        flush=True,
    )
