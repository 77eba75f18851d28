"""What a GGUF can do here, and why not when it cannot (`neuron-bus audit model PATH`).

Questions, each answered by running the model rather than by reading tables:
1. artifact: can the GGUF be read (metadata, every layer's tensors, expert counts)? What is each
   layer's kind, and which ranges can a slice hold (artifacts/cuts.py)?
2. local full inference: does the whole model load in llama.cpp and produce finite logits?
   What are its cache ABI and cache bytes per position (and the fixed state that does not grow)?
3. distributed layer-boundary execution, per backend: 2- and 3-way splits (even where the cut
   rules allow, else work-balanced), hidden states passed across every seam, compared with the
   whole model over a prompt and greedy decode steps (llama-cpp: logits must be bit-identical to
   the whole model on llama.cpp; torch: the split must agree with torch's own whole range).
4. snapshots: the split's cache state exported mid-decode and imported into fresh sessions goes
   on to the same logits; and truncating a session back to that position and replaying does too,
   or the backend says it cannot (recurrent state), which is what repair checks before using one.

Backends are opened through neuron_bus.execution (llama.cpp and torch load only when a check runs).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from neuron_bus.artifacts.cuts import cut_problem, layer_kinds, loadable
from neuron_bus.artifacts.gguf_model import GGUFModel, format_layers
from neuron_bus.artifacts.work import layer_work, stored_parameters
from neuron_bus.execution import open_range, open_reference
from neuron_bus.split import balanced_split

PROMPT = "The quick brown fox jumps over the lazy dog because it wants to reach the river before the sun sets"
BACKENDS = ("llama-cpp", "torch")
N_PROMPT = 16
N_DECODE = 4
N_CTX = 256
TORCH_TOLERANCE = 1e-4  # max |logit difference| between torch split and torch whole range
TRUNCATION_UNSUPPORTED = "truncation is unsupported (recurrent state)"


@dataclass
class Check:
    ok: bool
    detail: str  # what was shown when ok, the reason when not


@dataclass
class CacheFacts:
    cache_abi: str
    bytes_per_token: int  # what one session's cache (and snapshot) grows by per position
    fixed_bytes: int  # per-session state that does not grow (recurrent layers; plus a header)
    supports_truncate: bool


@dataclass
class SplitResult:
    ranges: list[tuple[int, int]]
    bit_exact: bool
    max_diff: float | None  # max |logit difference| from the whole model; None when it did not run
    detail: str

    @property
    def where(self) -> str:
        return "split " + " | ".join(format_layers(a, b) for a, b in self.ranges)


@dataclass
class ModelAudit:
    path: str
    arch: str | None = None
    n_layers: int | None = None
    hidden_size: int | None = None
    layer_kinds: list[str] = field(default_factory=list)
    active_parameters: float | None = None  # millions of weights a token multiplies (whole model)
    total_parameters: float | None = None  # millions of weights the blocks and head store
    artifact: Check | None = None
    full_inference: Check | None = None
    cache: CacheFacts | None = None
    layer_boundary: dict[str, Check] = field(default_factory=dict)
    splits: list[SplitResult] = field(default_factory=list)  # llama-cpp's, one per split tried
    snapshot: Check | None = None

    @property
    def summary(self) -> str:
        if self.artifact is None or not self.artifact.ok:
            return f"artifact unreadable: {self.artifact.detail if self.artifact else 'not checked'}"
        parts = ["artifact available"]
        if self.full_inference is None:
            parts.append("local full inference not checked")
        elif self.full_inference.ok:
            parts.append("local full inference works")
        else:
            parts.append(f"local full inference fails: {self.full_inference.detail}")
        works = [k for k, c in self.layer_boundary.items() if c.ok]
        broken = {k: c.detail for k, c in self.layer_boundary.items() if not c.ok}
        if works and not broken:
            parts.append(f"distributed layer-boundary works ({', '.join(works)})")
        elif works:
            why = "; ".join(f"{k}: {r}" for k, r in broken.items())
            parts.append(f"distributed layer-boundary works ({', '.join(works)}), unsupported on {why}")
        elif broken:
            why = "; ".join(f"{k}: {r}" for k, r in broken.items())
            parts.append(f"distributed layer-boundary unsupported: {why}")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["summary"] = self.summary
        return d


# -- the checks ------------------------------------------------------------------------------------


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def kinds_summary(kinds: list[str]) -> str:
    """'1 mla, 3 mla+moe': each kind with its count, in order of appearance."""
    counts: dict[str, int] = {}
    for k in kinds:
        counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in counts.items())


def check_artifact(audit: ModelAudit) -> GGUFModel | None:
    try:
        model = GGUFModel(Path(audit.path))
        audit.layer_kinds = layer_kinds(model)
    except Exception as exc:  # ArtifactError for every known way a GGUF is broken
        audit.artifact = Check(False, _reason(exc))
        return None
    audit.arch = model.arch
    audit.n_layers = model.n_layers
    hidden = model.field(f"{model.arch}.embedding_length")
    audit.hidden_size = int(hidden) if hidden is not None else None
    audit.active_parameters = round(sum(layer_work(model)), 6)
    audit.total_parameters = round(stored_parameters(model), 6)
    audit.artifact = Check(
        True,
        f"{model.arch}, {model.n_layers} layers, hidden {audit.hidden_size}, {len(model.tensors)} tensors; "
        f"layers: {kinds_summary(audit.layer_kinds)}",
    )
    return model


def _greedy(run, prompt: np.ndarray, n_decode: int, tokens: list[int] | None = None) -> list[np.ndarray]:
    """Logits after the prompt and after each decode step; ``run(position, x)`` -> logits.

    The steps feed the greedy token of the previous logits, or ``tokens`` when given (a
    teacher-forced run that follows another run's choices)."""
    out = [run(0, prompt)]
    for k in range(n_decode):
        token = int(out[-1].argmax()) if tokens is None else tokens[k]
        out.append(run(len(prompt) + k, np.array([token], dtype=np.int32)))
    return out


def _through(backends, sid: str, open_session: bool = True):
    def run(pos, x):
        for b in backends:
            x = b.prefill(sid, pos, x) if x.shape[0] > 1 else b.decode_step(sid, pos, x)
        return x

    if open_session:
        for b in backends:
            b.open_session(sid, N_CTX)
    return run


def check_full_inference(
    audit: ModelAudit, model: GGUFModel, threads: int, n_prompt: int = N_PROMPT, n_decode: int = N_DECODE
) -> tuple[np.ndarray, list[np.ndarray]] | None:
    """Run the whole model on llama.cpp; return (prompt ids, reference logits) when it works."""
    full = None
    try:
        full = open_reference(model, n_ctx=N_CTX, max_sessions=2, threads=threads)
        cap = full.capability
        audit.cache = CacheFacts(
            cap.cache_abi, cap.cache_bytes_per_token_estimate, cap.cache_fixed_bytes, cap.supports_truncate
        )
        ids = full.tokenize(PROMPT)[:n_prompt] or [max(full.bos_id, 0)]
        prompt = np.array(ids, dtype=np.int32)
        logits = _greedy(_through([full], "audit"), prompt, n_decode)
        if not all(np.isfinite(x).all() for x in logits):
            audit.full_inference = Check(False, "the logits are not finite")
            return None
        text = full.detokenize([int(x.argmax()) for x in logits])
        audit.full_inference = Check(True, f"{len(prompt)} prompt tokens, greedy continuation {text!r}")
        return prompt, logits
    except Exception as exc:
        audit.full_inference = Check(False, _reason(exc))
        return None
    finally:
        if full is not None:
            full.close()


def choose_splits(
    model: GGUFModel, kinds: list[str], ways: tuple[int, ...] = (2, 3)
) -> dict[int, list[tuple[int, int]] | str]:
    """Per number of shards: the even split when every range of it loads, else the work-balanced
    split of loadable ranges, else the reason no split exists."""
    n = model.n_layers
    out: dict[int, list[tuple[int, int]] | str] = {}
    work: list[float] | None = None  # derived once, for the first split that needs it
    for k in ways:
        if k > n:
            out[k] = f"a {n}-layer model has no {k}-way split"
            continue
        bounds = [round(i * n / k) for i in range(k + 1)]
        even = list(zip(bounds[:-1], bounds[1:]))
        if all(loadable(kinds, a, b) for a, b in even):
            out[k] = even
            continue
        work = work or layer_work(model)
        try:
            out[k] = balanced_split(work, k, allowed=lambda a, b: loadable(kinds, a, b))
        except ValueError:
            problems = {p for a, b in even if (p := cut_problem(kinds, a, b))}
            out[k] = "; ".join(sorted(problems)) or f"no {k}-way split has only ranges that can be loaded"
    return out


def _open_hops(model: GGUFModel, ranges, tmp, threads):
    hops = []
    try:
        for start, end in ranges:
            hops.append(
                open_range(
                    "llama-cpp",
                    model,
                    start,
                    end,
                    cache_dir=tmp,
                    n_ctx=N_CTX,
                    max_sessions=2,
                    threads=threads,
                    benchmark=False,
                )
            )
    except BaseException:
        for h in hops:
            h.close()
        raise
    return hops


def run_split(model: GGUFModel, ranges, reference, tmp: str, threads: int) -> tuple[SplitResult, list]:
    """One split against the reference logits; returns the result and its (open) hops."""
    prompt, expected = reference
    hops = _open_hops(model, ranges, tmp, threads)
    got = _greedy(_through(hops, "audit"), prompt, len(expected) - 1)
    diffs = [float(np.abs(a - b).max()) for a, b in zip(got, expected)]
    exact = all(np.array_equal(a, b) for a, b in zip(got, expected))
    n = f"{len(prompt)} prompt + {len(expected) - 1} decode positions"
    result = SplitResult(list(ranges), exact, max(diffs), "")
    if exact:
        result.detail = f"{result.where}: logits bit-identical to the whole model over {n}"
    else:
        result.detail = f"{result.where}: logits differ from the whole model (max |diff| {max(diffs):.3g} over {n})"
    return result, hops


def check_snapshot(hops, reference) -> Check:
    """Export every hop's state of session "audit" mid-way, import it as a new session, go on;
    then truncate "audit" back to the same position and replay: both must give the same logits."""
    prompt, expected = reference
    tokens = [int(x.argmax()) for x in expected[:-1]]
    n_decode = len(expected) - 1
    if n_decode < 2:
        return Check(False, "not checked: needs 2 decode steps")
    k = n_decode // 2  # snapshot after the prompt and k decode steps
    position = len(prompt) + k
    for h in hops:
        h.close_session("audit")
    first = _through(hops, "audit")
    first(0, prompt)
    for j in range(k):
        first(len(prompt) + j, np.array([tokens[j]], dtype=np.int32))
    blobs = [h.export_state("audit") for h in hops]
    for h, blob in zip(hops, blobs):
        h.import_state("restored", N_CTX, position, blob)
    restored = _through(hops, "restored", open_session=False)
    for j in range(k, n_decode):
        out = restored(len(prompt) + j, np.array([tokens[j]], dtype=np.int32))
        if not np.array_equal(out, expected[j + 1]):
            diff = float(np.abs(out - expected[j + 1]).max())
            return Check(False, f"a restored snapshot of position {position} diverges (max |diff| {diff:.3g})")
    size = sum(len(b) for b in blobs)
    detail = f"a snapshot at position {position} ({size} bytes, {len(hops)} hop(s)) restores to the same logits"
    if not all(h.capability.supports_truncate for h in hops):
        return Check(
            True, detail + f"; {TRUNCATION_UNSUPPORTED}: llama.cpp cannot cut its state back, so repair refuses routes"
        )
    for j in range(k, n_decode):  # run "audit" on, then back to the snapshot's position and replay
        first(len(prompt) + j, np.array([tokens[j]], dtype=np.int32))
    for h in hops:
        h.truncate("audit", position)
    for j in range(k, n_decode):
        out = first(len(prompt) + j, np.array([tokens[j]], dtype=np.int32))
        if not np.array_equal(out, expected[j + 1]):
            diff = float(np.abs(out - expected[j + 1]).max())
            return Check(
                True, detail + f"; but truncating back to {position} and replaying diverges (max |diff| {diff:.3g})"
            )
    return Check(True, detail + "; truncating back to it and replaying does too")


def check_llama_cpp(audit: ModelAudit, model: GGUFModel, reference, threads: int) -> Check:
    if reference is None:
        audit.snapshot = Check(False, "not checked: local full inference fails")
        return Check(False, "not checked: local full inference fails")
    if (audit.n_layers or 0) < 2:
        return Check(False, "a one-layer model has no layer boundary")
    plans = choose_splits(model, audit.layer_kinds)
    reasons: dict[str, list[str]] = {}
    for k, plan in plans.items():
        if isinstance(plan, str):
            reasons.setdefault(plan, []).append(f"{k}-way")
    refused = [f"{' or '.join(ways)} split: {why}" for why, ways in reasons.items()]
    with tempfile.TemporaryDirectory(prefix="neuron-bus-audit-") as tmp:
        snapshot_hops = None
        try:
            for plan in plans.values():
                if isinstance(plan, str):
                    continue
                try:
                    result, hops = run_split(model, plan, reference, tmp, threads)
                except Exception as exc:
                    audit.splits.append(SplitResult(list(plan), False, None, _reason(exc)))
                    continue
                audit.splits.append(result)
                if snapshot_hops is None:
                    snapshot_hops = hops
                else:
                    for h in hops:
                        h.close()
            if snapshot_hops is None:  # no split ran: the whole model's own snapshot
                snapshot_hops = _open_hops(model, [(0, audit.n_layers)], tmp, threads)
                _greedy(_through(snapshot_hops, "audit"), reference[0], 0)
            try:
                audit.snapshot = check_snapshot(snapshot_hops, reference)
            except Exception as exc:
                audit.snapshot = Check(False, _reason(exc))
        finally:
            for h in snapshot_hops or []:
                h.close()
    if not audit.splits:
        return Check(False, "; ".join(refused))
    details = [s.detail for s in audit.splits] + [f"no {r}" for r in refused]
    return Check(all(s.bit_exact for s in audit.splits) and not refused, "; ".join(details))


def check_torch_boundary(audit: ModelAudit, model: GGUFModel, reference, threads: int) -> Check:
    n = audit.n_layers or 0
    if n < 2:
        return Check(False, "a one-layer model has no layer boundary")
    split = n // 2
    backends = []
    try:
        whole = open_range("torch", model, 0, n, threads=threads, benchmark=False)
        backends.append(whole)
        for start, end in ((0, split), (split, n)):
            backends.append(open_range("torch", model, start, end, threads=threads, benchmark=False))
        prompt = reference[0] if reference is not None else np.array([1, 2, 3, 4], dtype=np.int32)
        expected = _greedy(_through([whole], "audit"), prompt, N_DECODE)
        got = _greedy(_through(backends[1:], "audit"), prompt, N_DECODE)
    except Exception as exc:  # UnsupportedModel names the architecture feature it lacks
        return Check(False, _reason(exc))
    finally:
        for b in backends:
            b.close()
    diff = max(float(np.abs(a - b).max()) for a, b in zip(got, expected))
    where = f"split {0}-{split - 1} | {split}-{n - 1}"
    if diff > TORCH_TOLERANCE:
        return Check(False, f"{where}: logits differ from torch's whole range (max |diff| {diff:.3g})")
    detail = f"{where}: logits match torch's whole range (max |diff| {diff:.3g})"
    if reference is not None:
        same = sum(int(a.argmax()) == int(b.argmax()) for a, b in zip(got, reference[1]))
        detail += f"; greedy token equals llama.cpp's at {same}/{len(got)} positions"
    return Check(True, detail)


def audit_model(
    path: str | Path,
    backends: tuple[str, ...] = BACKENDS,
    threads: int = 1,
    n_prompt: int = N_PROMPT,
    n_decode: int = N_DECODE,
) -> ModelAudit:
    audit = ModelAudit(path=str(path))
    model = check_artifact(audit)
    if model is None:
        return audit
    reference = check_full_inference(audit, model, threads, n_prompt, n_decode)
    for kind in backends:
        if kind == "llama-cpp":
            audit.layer_boundary[kind] = check_llama_cpp(audit, model, reference, threads)
        elif kind == "torch":
            audit.layer_boundary[kind] = check_torch_boundary(audit, model, reference, threads)
    return audit
