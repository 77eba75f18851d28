"""`neuron-bus` command line: one module per command group, all registered on one app."""

from __future__ import annotations

from neuron_bus.cli import gateway as _gateway  # noqa: F401  (registers gateway)
from neuron_bus.cli import generate, server, up, worker  # noqa: F401  (registers commands)
from neuron_bus.cli import tracker as _tracker  # noqa: F401  (registers tracker, coverage)
from neuron_bus.cli import trust as _trust  # noqa: F401  (registers permissions, auditor, ledger)
from neuron_bus.cli.app import app
from neuron_bus.cli.artifact import artifact_app

app.add_typer(artifact_app, name="artifact")
from neuron_bus.cli.audit import audit_app  # noqa: E402

app.add_typer(audit_app, name="audit")


def main() -> None:
    app()
