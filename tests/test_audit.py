"""`neuron-bus audit model`: readable, local full inference, layer-boundary execution per backend."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_bus.model_audit import audit_model

CLI = Path(sys.executable).parent / "neuron-bus"


def audit_cli(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), "audit", "model", *args], capture_output=True, text=True, timeout=timeout)


def test_tiny_model_runs_everywhere(tiny_f32):
    audit = audit_model(tiny_f32)
    assert audit.artifact.ok and audit.full_inference.ok
    assert audit.layer_boundary["llama-cpp"].ok, audit.layer_boundary["llama-cpp"].detail
    assert "bit-identical" in audit.layer_boundary["llama-cpp"].detail
    assert audit.layer_boundary["torch"].ok, audit.layer_boundary["torch"].detail
    assert audit.summary == (
        "artifact available, local full inference works, distributed layer-boundary works (llama-cpp, torch)"
    )


def test_unreadable_artifact_is_reported_with_its_reason(tmp_path, tiny_f32):
    cut = tmp_path / "truncated.gguf"
    cut.write_bytes(tiny_f32.read_bytes()[: tiny_f32.stat().st_size // 2])
    out = audit_cli(str(cut), "--json")
    assert out.returncode == 1
    report = json.loads(out.stdout)
    assert report["artifact"]["ok"] is False and "truncated" in report["artifact"]["detail"]
    assert report["summary"].startswith("artifact unreadable: ")
    assert report["full_inference"] is None and report["layer_boundary"] == {}

    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all")
    out = audit_cli(str(bogus))
    assert out.returncode == 1 and "unreadable: " in out.stdout and "not a GGUF" in out.stdout


@pytest.mark.slow
def test_audit_cli_smollm2(smollm2_path):
    out = audit_cli(str(smollm2_path), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["arch"], report["n_layers"], report["hidden_size"]) == ("llama", 30, 576)
    assert report["layer_boundary"]["llama-cpp"]["ok"]
    assert "split 0-14 | 15-29: logits bit-identical" in report["layer_boundary"]["llama-cpp"]["detail"]
    assert report["layer_boundary"]["torch"]["ok"]
    assert report["summary"] == (
        "artifact available, local full inference works, distributed layer-boundary works (llama-cpp, torch)"
    )


@pytest.mark.slow
def test_audit_cli_gemma3_text(gemma3_path):
    out = audit_cli(str(gemma3_path))
    assert out.returncode == 0, out.stderr
    lines = {line[:20].strip(): line[20:] for line in out.stdout.splitlines()}  # label column, 20 wide
    assert lines["artifact"].startswith("available: gemma3, 18 layers, hidden 640")
    assert lines["full inference"].startswith("works: ")
    # llama.cpp: slices carry gemma3's sliding-window pattern, and injected hidden states are not
    # rescaled, so the split agrees bit for bit.
    assert lines["boundary llama-cpp"].startswith("works: split 0-8 | 9-17: logits bit-identical")
    # torch implements llama only, and says why not.
    assert lines["boundary torch"].startswith("unsupported: ") and "gemma3" in lines["boundary torch"]
    assert lines["summary"].startswith(
        "artifact available, local full inference works, distributed layer-boundary works (llama-cpp), "
        "unsupported on torch: "
    )


def test_audit_cli_rejects_unknown_backend(tiny_f32):
    out = audit_cli(str(tiny_f32), "--backend", "onnx")
    assert out.returncode != 0 and "unknown backend" in out.stderr
