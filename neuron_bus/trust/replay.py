"""Replay a validation event on a reference and compare: the audit behind a verdict.

Reference ``single``: the whole model in this process on llama.cpp (workers' ``llama-cpp-full``
backend, imported lazily). The event's prompt is prefilled in the route's chunk size, then the
observed output tokens are fed back one by one (teacher forcing), so every generated position is
checked even after a divergence would have changed a free-running replay:
- greedy: the observed token's reference logit must be within the tolerance of the best one
  (exactly the argmax when the route is bit-identical, as llama.cpp routes with an f32 wire are)
- sampled: the reference logits, sampled with the event's parameters and seed (the draw depends
  only on seed and index, see sampling.py), must pick the observed token
- logit samples: the tail's recorded top logits of the first tokens must be within the tolerance
Reference ``route``: the same prompt and sampling on a fresh route of the swarm; tokens must match.

Tolerances are per model and wire dtype (TOLERANCES): llama.cpp routes with an f32 wire are
bit-identical to the whole model, so the f32 tolerance only absorbs print-level noise; a bf16
wire rounds every seam's activations and needs a real margin.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from neuron_bus import messages as M
from neuron_bus import models
from neuron_bus.execution import DEFAULT_N_CTX
from neuron_bus.sampling import sample

# model preset -> wire dtype -> max |logit difference| accepted
TOLERANCES: dict[str, dict[str, float]] = {
    "smollm2-135m": {"f32": 1e-3, "bf16": 0.75},
    "gemma3-270m": {"f32": 1e-3, "bf16": 1.5},
}
DEFAULT_TOLERANCE = {"f32": 1e-2, "bf16": 1.5}
REFERENCE_N_CTX = DEFAULT_N_CTX  # the workers' context: the same kernels' shapes as the route
REPLAYABLE_BACKENDS = ("llama-cpp", "llama-cpp-full")


def tolerance(event: M.ValidationEvent) -> float:
    table = TOLERANCES.get(event.model_preset, DEFAULT_TOLERANCE)
    return table.get(event.wire_dtype, max(table.values()))


def make_verdict(
    event: M.ValidationEvent, reference: str, verdict: M.AuditOutcome, detail: str, **kw
) -> M.AuditVerdict:
    return M.AuditVerdict(
        session_id=event.session_id,
        event_id=event.event_id,
        verdict=verdict,
        reference=reference,
        members=[m.node_id for m in event.route],
        detail=detail,
        ts=time.time(),
        **kw,
    )


def _chunks(tokens: list[int], size: int):
    for lo in range(0, len(tokens), max(1, size)):
        yield lo, np.asarray(tokens[lo : lo + size], dtype=np.int32)


def replay_single(
    event: M.ValidationEvent, model_path: str | Path | None = None, threads: int = 1, backend=None
) -> M.AuditVerdict:
    """Replay on the whole model in this process; ``backend`` reuses an open llama-cpp-full backend."""
    tol = tolerance(event)
    if not event.output_tokens:
        return make_verdict(event, "single", "unverifiable", "the event has no output tokens", tolerance=tol)
    other = sorted({m.backend_id for m in event.route} - set(REPLAYABLE_BACKENDS))
    if other:
        return make_verdict(
            event,
            "single",
            "unverifiable",
            f"backend {', '.join(other)} is not bit-comparable with llama.cpp: use --reference route",
            tolerance=tol,
        )
    path = Path(model_path) if model_path else models.resolve(event.model_preset)
    if models.revision(path) != event.model_revision:
        return make_verdict(
            event,
            "single",
            "unverifiable",
            f"reference {path.name} is revision {models.revision(path)}, the event ran {event.model_revision}",
            tolerance=tol,
        )
    own = backend is None
    if own:
        backend = reference_backend(event, path, threads)
    sid = f"replay-{event.session_id}"[:128]
    needed = len(event.prompt_tokens) + len(event.output_tokens)
    try:
        backend.open_session(sid, max(needed, 1))
        try:
            return _compare(event, backend, sid, tol)
        finally:
            backend.close_session(sid)
    finally:
        if own:
            backend.close()


def reference_backend(event: M.ValidationEvent, path: Path, threads: int):
    """The whole model on llama.cpp with the event's flash-attention setting (part of its cache ABI)."""
    from neuron_bus.execution import open_reference

    flash = all("-fa0-" not in m.cache_abi for m in event.route)
    return open_reference(
        path, threads=threads, n_ctx=REFERENCE_N_CTX, max_sessions=1, flash_attn=flash, benchmark=False
    )


def _compare(event: M.ValidationEvent, backend, sid: str, tol: float) -> M.AuditVerdict:
    logits = None
    for lo, chunk in _chunks(event.prompt_tokens, event.chunk_size):
        logits = backend.prefill(sid, lo, chunk)
    samples = {s.index: s for s in event.logit_samples}
    pos = len(event.prompt_tokens)
    first, worst, why = None, 0.0, ""
    params = event.sampling
    for i, token in enumerate(event.output_tokens):
        ref = np.asarray(logits, dtype=np.float64)
        if params.temperature <= 0.0:
            gap = float(ref.max() - ref[token])
            if gap > tol and first is None:
                first, why = (
                    i,
                    f"token {i}: observed {token}, reference argmax {int(ref.argmax())} (logit gap {gap:.4g})",
                )
        else:
            pick = sample(ref.astype(np.float32), params, i).token_id
            if pick != token and first is None:
                first, why = i, f"token {i}: observed {token}, the reference samples {pick} with the same seed"
        if i in samples:
            s = samples[i]
            diff = (
                float(np.abs(ref[np.asarray(s.token_ids, dtype=np.int64)] - np.asarray(s.logits)).max())
                if s.token_ids
                else 0.0
            )
            worst = max(worst, diff)
            if diff > tol and first is None:
                first, why = i, f"token {i}: top logits differ from the reference by {diff:.4g} (tolerance {tol:g})"
        if i + 1 < len(event.output_tokens):
            logits = backend.decode_step(sid, pos, np.array([token], dtype=np.int32))
            pos += 1
    n = len(event.output_tokens)
    if first is None:
        return make_verdict(
            event,
            "single",
            "agree",
            f"{n} tokens match the single-process model (max logit diff {worst:.3g})",
            compared_tokens=n,
            max_logit_diff=worst,
            tolerance=tol,
        )
    return make_verdict(
        event, "single", "disagree", why, compared_tokens=n, first_divergence=first, max_logit_diff=worst, tolerance=tol
    )


async def replay_route(event: M.ValidationEvent, url: str) -> M.AuditVerdict:
    """Replay on a fresh route of the swarm (same policy, prompt and sampling); tokens must match."""
    from neuron_bus.client import NeuronClient

    sampling = _with_max(event.sampling, len(event.output_tokens))
    async with await NeuronClient.connect(url) as client:
        g = await client.complete(
            prompt_tokens=list(event.prompt_tokens),
            sampling=sampling,
            model_preset=event.model_preset,
            wire_dtype=event.wire_dtype,
            encoding=event.encoding,
            chunk_size=event.chunk_size,
        )
    n = min(len(g.tokens), len(event.output_tokens))
    first = next((i for i in range(n) if g.tokens[i] != event.output_tokens[i]), None)
    if first is None and len(g.tokens) != len(event.output_tokens):
        first = n
    via = " -> ".join(h.node_id for h in g.route.hops)
    if first is None:
        return make_verdict(event, "route", "agree", f"{n} tokens match route {via}", compared_tokens=n)
    return make_verdict(
        event, "route", "disagree", f"token {first} differs from route {via}", compared_tokens=n, first_divergence=first
    )


def _with_max(params: M.SamplingParams, n: int) -> M.SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, max_tokens=n)
