"""Files written whole (workers/files.py): the old file or the new one, never part of one, and no
partial file left by a failed write; those of processes killed mid-write are removed later."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from workers.files import STALE_PARTIAL_S, atomic_output, remove_stale_partials


def test_a_write_that_succeeds_replaces_the_file_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "sub" / "f.json"  # the directory is made
    with atomic_output(path) as tmp:
        assert tmp.parent == path.parent and not path.exists()
        tmp.write_text("new")
    assert path.read_text() == "new"
    assert [p.name for p in path.parent.iterdir()] == ["f.json"]


def test_a_write_that_fails_leaves_the_old_file_and_no_partial(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_output(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("the writer failed")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_two_writes_at_once_use_different_names(tmp_path):
    path = tmp_path / "f"
    with atomic_output(path) as a, atomic_output(path) as b:
        assert a != b
        a.write_text("a")
        b.write_text("b")
    assert path.read_text() == "a"  # the outer block ends last: its content is renamed last
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def _partial_of_dead_process(path, age_s: float):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    partial = path.with_name(f".{path.name}.{int(dead.stdout)}.0badf00d.partial")
    partial.write_text("killed mid-write")
    os.utime(partial, (time.time() - age_s, time.time() - age_s))
    return partial


def test_partials_of_killed_writers_are_removed_once_stale_and_no_others(tmp_path):
    path = tmp_path / "model.gguf"
    stale = _partial_of_dead_process(path, STALE_PARTIAL_S + 60)
    recent = _partial_of_dead_process(path, 60)  # its writer may be on another host, still writing
    live = path.with_name(f".{path.name}.{os.getpid()}.12345678.partial")  # this process: running
    live.write_text("being written")
    os.utime(live, (time.time() - 2 * STALE_PARTIAL_S, time.time() - 2 * STALE_PARTIAL_S))
    other = tmp_path / ".other.gguf.1.abcd.partial"  # another file's
    other.write_text("x")
    os.utime(other, (0, 0))
    with atomic_output(path) as tmp:
        tmp.write_text("whole")
    assert not stale.exists()
    assert recent.exists() and live.exists() and other.exists()
    assert remove_stale_partials(path, now=time.time() + 2 * STALE_PARTIAL_S) == [recent]
