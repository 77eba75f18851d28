"""Files written whole: a reader (another process among them) finds the old file or the new one,
never part of one. Used by both packages (model files, slices, manifests, API keys, the tap).

``atomic_output(path)`` names a file beside ``path`` for the block to write, private to this call
(pid and a random part), and renames it onto ``path`` when the block ends without an error; on an
error it is removed and ``path`` is left as it was. Only a process killed mid-write leaves its
partial file behind: the next write of the same path removes those whose process is gone and that
nobody has written to for ``STALE_PARTIAL_S`` (both, so a shared directory's writer on another
host, whose pid means nothing here, is not disturbed while it writes).
"""

from __future__ import annotations

import glob
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STALE_PARTIAL_S = 3600.0
SUFFIX = ".partial"


@contextmanager
def atomic_output(path: Path | str) -> Iterator[Path]:
    """A name to write ``path``'s new content to; renamed onto ``path`` when the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{SUFFIX}")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def remove_stale_partials(path: Path, now: float | None = None) -> list[Path]:
    """Remove the partial files of ``path`` left by processes killed while writing it; returns them."""
    now = time.time() if now is None else now
    removed = []
    for name in glob.glob(glob.escape(str(path.with_name(f".{path.name}."))) + f"*{SUFFIX}"):
        partial = Path(name)
        pid = partial.name[len(path.name) + 2 :].split(".")[0]
        try:
            stale = now - partial.stat().st_mtime > STALE_PARTIAL_S
        except FileNotFoundError:
            continue  # renamed into place or removed meanwhile
        if stale and pid.isdigit() and not _running(int(pid)):
            partial.unlink(missing_ok=True)
            removed.append(partial)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
