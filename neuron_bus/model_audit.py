"""What a GGUF can do here, and why not when it cannot (`neuron-bus audit model PATH`).

Three questions, each answered by running the model rather than by reading tables:
1. artifact: can the GGUF be read (metadata, every layer's tensors)?
2. local full inference: does the whole model load in llama.cpp and produce finite logits?
3. distributed layer-boundary execution, per backend: split at the middle layer, pass the hidden
   states across the seam, and compare with the whole model over a short prompt and a few greedy
   decode steps (llama-cpp: logits must be bit-identical to the whole model on llama.cpp; torch:
   the split must agree with torch's own whole range).

Backends are opened through neuron_bus.execution (llama.cpp and torch load only when a check runs).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from neuron_bus.execution import open_range, open_reference

PROMPT = "The quick brown fox jumps over the lazy dog because it wants to reach the river before the sun sets"
BACKENDS = ("llama-cpp", "torch")
N_PROMPT = 16
N_DECODE = 4
N_CTX = 256
TORCH_TOLERANCE = 1e-4  # max |logit difference| between torch split and torch whole range


@dataclass
class Check:
    ok: bool
    detail: str  # what was shown when ok, the reason when not


@dataclass
class ModelAudit:
    path: str
    arch: str | None = None
    n_layers: int | None = None
    hidden_size: int | None = None
    artifact: Check | None = None
    full_inference: Check | None = None
    layer_boundary: dict[str, Check] = field(default_factory=dict)

    @property
    def summary(self) -> str:
        if not self.artifact.ok:
            return f"artifact unreadable: {self.artifact.detail}"
        parts = ["artifact available"]
        if self.full_inference.ok:
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


def check_artifact(audit: ModelAudit) -> None:
    from neuron_bus.artifacts.gguf_model import GGUFModel

    try:
        model = GGUFModel(Path(audit.path))
    except Exception as exc:  # ArtifactError for every known way a GGUF is broken
        audit.artifact = Check(False, _reason(exc))
        return
    audit.arch = model.arch
    audit.n_layers = model.n_layers
    hidden = model.field(f"{model.arch}.embedding_length")
    audit.hidden_size = int(hidden) if hidden is not None else None
    audit.artifact = Check(
        True, f"{model.arch}, {model.n_layers} layers, hidden {audit.hidden_size}, {len(model.tensors)} tensors"
    )


def _greedy(run, prompt: np.ndarray, n_decode: int) -> list[np.ndarray]:
    """Logits after the prompt and after each greedy token; ``run(position, x)`` -> logits."""
    out = [run(0, prompt)]
    for k in range(n_decode):
        token = np.array([int(out[-1].argmax())], dtype=np.int32)
        out.append(run(len(prompt) + k, token))
    return out


def _through(backends, sid: str):
    def run(pos, x):
        for b in backends:
            x = b.prefill(sid, pos, x) if x.shape[0] > 1 else b.decode_step(sid, pos, x)
        return x

    for b in backends:
        b.open_session(sid, N_CTX)
    return run


def check_full_inference(audit: ModelAudit, threads: int) -> tuple[np.ndarray, list[np.ndarray]] | None:
    """Run the whole model on llama.cpp; return (prompt ids, reference logits) when it works."""
    full = None
    try:
        full = open_reference(audit.path, n_ctx=N_CTX, max_sessions=1, threads=threads)
        ids = full.tokenize(PROMPT)[:N_PROMPT] or [max(full.bos_id, 0)]
        prompt = np.array(ids, dtype=np.int32)
        logits = _greedy(_through([full], "audit"), prompt, N_DECODE)
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


def _split_point(n_layers: int) -> int:
    return n_layers // 2


def check_llama_cpp_boundary(audit: ModelAudit, reference, threads: int) -> Check:
    if reference is None:
        return Check(False, "not checked: local full inference fails")
    if audit.n_layers < 2:
        return Check(False, "a one-layer model has no layer boundary")
    prompt, expected = reference
    split = _split_point(audit.n_layers)
    hops = []
    with tempfile.TemporaryDirectory(prefix="neuron-bus-audit-") as tmp:
        try:
            for start, end in ((0, split), (split, audit.n_layers)):
                hops.append(
                    open_range(
                        "llama-cpp",
                        audit.path,
                        start,
                        end,
                        cache_dir=tmp,
                        n_ctx=N_CTX,
                        max_sessions=1,
                        threads=threads,
                        benchmark=False,
                    )
                )
            got = _greedy(_through(hops, "audit"), prompt, N_DECODE)
        except Exception as exc:
            return Check(False, _reason(exc))
        finally:
            for h in hops:
                h.close()
    where = f"split {0}-{split - 1} | {split}-{audit.n_layers - 1}"
    diffs = [float(np.abs(a - b).max()) for a, b in zip(got, expected)]
    if all(np.array_equal(a, b) for a, b in zip(got, expected)):
        return Check(
            True,
            f"{where}: logits bit-identical to the whole model over {len(prompt)} prompt + {N_DECODE} decode positions",
        )
    return Check(False, f"{where}: logits differ from the whole model (max |diff| {max(diffs):.3g})")


def check_torch_boundary(audit: ModelAudit, reference, threads: int) -> Check:
    if audit.n_layers < 2:
        return Check(False, "a one-layer model has no layer boundary")
    split, n = _split_point(audit.n_layers), audit.n_layers
    backends = []
    try:
        whole = open_range("torch", audit.path, 0, n, threads=threads, benchmark=False)
        backends.append(whole)
        for start, end in ((0, split), (split, n)):
            backends.append(open_range("torch", audit.path, start, end, threads=threads, benchmark=False))
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


def audit_model(path: str | Path, backends: tuple[str, ...] = BACKENDS, threads: int = 1) -> ModelAudit:
    audit = ModelAudit(path=str(path))
    check_artifact(audit)
    if not audit.artifact.ok:
        return audit
    reference = check_full_inference(audit, threads)
    for kind in backends:
        if kind == "llama-cpp":
            audit.layer_boundary[kind] = check_llama_cpp_boundary(audit, reference, threads)
        elif kind == "torch":
            audit.layer_boundary[kind] = check_torch_boundary(audit, reference, threads)
    return audit
