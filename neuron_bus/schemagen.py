"""Generate schemas/ (JSON Schema, one file per message) from the msgspec Structs.

python -m neuron_bus.schemagen          # write schemas/
python -m neuron_bus.schemagen --check  # exit 1 if schemas/ is stale
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec

from neuron_bus.messages import ALL_MESSAGES

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"


def render() -> dict[str, str]:
    """File name -> JSON text, for every message Struct."""
    files = {}
    for kind in ALL_MESSAGES:
        schema = msgspec.json.schema(kind)
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": kind.__name__, **schema}
        files[f"{kind.__name__}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return files


def stale(schema_dir: Path = SCHEMA_DIR) -> list[str]:
    """Names of files that are missing, different, or no longer generated."""
    want = render()
    have = {p.name for p in schema_dir.glob("*.json")} if schema_dir.is_dir() else set()
    out = [
        name
        for name, text in want.items()
        if not (schema_dir / name).is_file() or (schema_dir / name).read_text() != text
    ]
    out += sorted(have - set(want))
    return out


def write(schema_dir: Path = SCHEMA_DIR) -> None:
    schema_dir.mkdir(parents=True, exist_ok=True)
    want = render()
    for p in schema_dir.glob("*.json"):
        if p.name not in want:
            p.unlink()
    for name, text in want.items():
        (schema_dir / name).write_text(text)


def main(argv: list[str]) -> int:
    if "--check" in argv:
        bad = stale()
        if bad:
            print("schemas/ is stale: " + ", ".join(bad) + " (run python -m neuron_bus.schemagen)")
            return 1
        return 0
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
