"""The architecture matrix (`neuron-bus audit architectures`): every architecture the synthetic
builder knows (artifacts/synthetic.py), audited on stock llama-cpp-python like any GGUF
(model_audit.py), one row each: does it load, does whole-model inference run, do 2- and 3-way
layer-range splits give the whole model's logits (bit-exact, within tolerance, or unsupported with
the reason), do snapshots restore, what do cache and state cost per position.

Each architecture is audited in a child process (`neuron-bus audit model --json`): an abort inside
llama.cpp (a GGML_ASSERT) ends that child and becomes the row's reason instead of ending the matrix.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from neuron_bus.artifacts.synthetic import ARCHITECTURES, write_model
from neuron_bus.model_audit import TRUNCATION_UNSUPPORTED, kinds_summary

N_PROMPT = 40
N_DECODE = 32
SPLIT_TOLERANCE = 1e-3  # max |logit difference| still called "within tolerance"
TIMEOUT_S = 600.0


@dataclass
class ArchRow:
    arch: str
    n_layers: int | None = None
    layers: str = ""  # the layer kinds, counted
    loads: bool = False
    full_inference: bool = False
    split: str = "not run"  # bit-exact | within tolerance | differs | unsupported | not run
    split_detail: str = ""
    max_diff: float | None = None
    snapshot: str = "not run"  # restores | restores, no truncation | fails | not run
    snapshot_detail: str = ""
    cache_abi: str | None = None
    cache_bytes_per_token: int | None = None
    cache_fixed_bytes: int | None = None
    active_parameters: float | None = None  # millions of weights a token multiplies
    total_parameters: float | None = None  # millions of weights stored
    detail: str = ""  # why it did not load or run, when it did not

    def as_dict(self) -> dict:
        return asdict(self)


def row_from_audit(arch: str, audit: dict) -> ArchRow:
    """The matrix row of one architecture, from `neuron-bus audit model --json`'s report."""
    row = ArchRow(arch, audit.get("n_layers"), kinds_summary(audit.get("layer_kinds") or []))
    row.active_parameters, row.total_parameters = audit.get("active_parameters"), audit.get("total_parameters")
    artifact, full = audit.get("artifact") or {}, audit.get("full_inference") or {}
    if not artifact.get("ok"):
        row.detail = f"artifact unreadable: {artifact.get('detail', '')}"
        return row
    cache = audit.get("cache")
    row.loads = cache is not None  # the whole model loaded and a context exists
    row.full_inference = bool(full.get("ok"))
    if not row.full_inference:
        row.detail = full.get("detail", "")
    if cache:
        row.cache_abi = cache["cache_abi"]
        row.cache_bytes_per_token, row.cache_fixed_bytes = cache["bytes_per_token"], cache["fixed_bytes"]
    boundary = (audit.get("layer_boundary") or {}).get("llama-cpp")
    splits = [s for s in audit.get("splits") or [] if s.get("max_diff") is not None]
    if splits:
        row.max_diff = max(s["max_diff"] for s in splits)
        if all(s["bit_exact"] for s in splits):
            row.split = "bit-exact"
        elif row.max_diff <= SPLIT_TOLERANCE:
            row.split = "within tolerance"
        else:
            row.split = "differs"
    elif boundary is not None and row.full_inference:
        row.split = "unsupported"
    if boundary is not None:
        row.split_detail = boundary["detail"]
    snapshot = audit.get("snapshot")
    if snapshot:
        row.snapshot_detail = snapshot["detail"]
        if not snapshot["ok"]:
            row.snapshot = "fails"
        elif TRUNCATION_UNSUPPORTED in snapshot["detail"]:
            row.snapshot = "restores, no truncation"
        else:
            row.snapshot = "restores"
    return row


def audit_architecture(arch: str, workdir: Path, threads: int = 1, timeout: float = TIMEOUT_S) -> ArchRow:
    """Write ``arch``'s synthetic model into ``workdir`` and audit it in a child process."""
    path = write_model(Path(workdir) / f"{arch}.gguf", arch)
    cmd = [sys.executable, "-m", "neuron_bus", "audit", "model", str(path), "--json", "--backend", "llama-cpp"]
    cmd += ["--prompt-tokens", str(N_PROMPT), "--decode", str(N_DECODE), "--threads", str(threads)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return ArchRow(arch, detail=f"the audit did not finish within {timeout:.0f}s")
    try:
        return row_from_audit(arch, json.loads(done.stdout))
    except (json.JSONDecodeError, KeyError, TypeError):
        said = [line for line in done.stderr.splitlines() if "GGML_ASSERT" in line or "error" in line.lower()]
        why = (said or done.stderr.strip().splitlines() or ["no output"])[-1]
        return ArchRow(arch, detail=f"the audit process ended with {done.returncode}: {why.strip()}")


def architecture_matrix(archs: list[str] | None = None, threads: int = 1, on_row=None) -> list[ArchRow]:
    """One row per architecture (default: every one the synthetic builder knows)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="neuron-bus-archs-") as tmp:
        for arch in archs or list(ARCHITECTURES):
            rows.append(audit_architecture(arch, Path(tmp), threads))
            if on_row is not None:
                on_row(rows[-1])
    return rows


COLUMNS = (
    "arch",
    "layers",
    "loads",
    "full inference",
    "layer split",
    "snapshot",
    "cache B/token (fixed)",
    "active/stored M",
)


def table_cells(row: ArchRow) -> list[str]:
    def yes(ok: bool) -> str:
        return "yes" if ok else "no"

    split = row.split if row.max_diff is None or row.split == "bit-exact" else f"{row.split} ({row.max_diff:.3g})"
    cache = "" if row.cache_bytes_per_token is None else f"{row.cache_bytes_per_token} ({row.cache_fixed_bytes})"
    work = "" if row.active_parameters is None else f"{row.active_parameters:.3f}/{row.total_parameters:.3f}"
    return [row.arch, row.layers, yes(row.loads), yes(row.full_inference), split, row.snapshot, cache, work]


def markdown_table(rows: list[ArchRow]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(table_cells(r)) + " |" for r in rows]
    return "\n".join(lines)
