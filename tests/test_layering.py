"""The package boundaries and the one set of failure reasons, checked over the source tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from workers.errors import Reason

ROOT = Path(__file__).resolve().parents[1]


def _imports(package: str):
    """(file, imported top-level module) for every import anywhere in ``package``, function bodies too."""
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield path.relative_to(ROOT), alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield path.relative_to(ROOT), node.module.split(".")[0]


@pytest.mark.parametrize(
    "package, forbidden",
    [("neuron_bus", {"torch", "llama_cpp"}), ("workers", {"nats", "neuron_bus"})],
)
def test_packages_import_only_down_the_layers(package, forbidden):
    wrong = [f"{path}: imports {module}" for path, module in _imports(package) if module in forbidden]
    assert not wrong, "\n".join(wrong)


# A snake_case literal as the first argument of an error, or assigned to / compared with a reason.
_LITERAL_REASON = re.compile(
    r"\b\w*(?:Error|Rejection|Mismatch|MalformedMessage|Failed)\(\s*\"[a-z]+_[a-z_]+\""
    r"|\breason\s*(?:=|==|!=)\s*\"[a-z_]+\""
    r"|\.fail\([^,()]+,\s*\"[a-z]+_[a-z_]+\""  # a session failed with a code: outbox.fail(s, code, …)
)


def test_failure_reasons_are_members_of_the_one_reason_set():
    found = []
    for package in ("neuron_bus", "workers"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "messages.py":  # wire defaults (``reason: str = "finished"``) are not failures
                continue
            found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in _LITERAL_REASON.finditer(path.read_text())]
    assert not found, "use workers.errors.Reason:\n" + "\n".join(found)


def test_a_reason_read_from_the_wire_never_raises():
    assert Reason.of("no_route") is Reason.NO_ROUTE
    assert Reason.of("something a newer peer invented") is Reason.REMOTE_ERROR
    assert f"{Reason.NO_FREE_SLOT}" == "no_free_slot" and Reason.NO_FREE_SLOT == "no_free_slot"
