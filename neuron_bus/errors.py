"""Typed errors shared by the bus. Each carries a short machine-readable ``reason``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.errors import Reason

if TYPE_CHECKING:
    from neuron_bus.messages import Phase


class NeuronBusError(Exception):
    """Base of every error neuron-bus raises on purpose."""

    reason = Reason.ERROR

    def __init__(self, reason: Reason, message: str):
        super().__init__(message)
        self.reason = reason

    def __str__(self) -> str:  # one line, for CLIs and error messages on the bus
        return self.args[0] if self.args else self.reason


class MalformedMessage(NeuronBusError):
    """A message that cannot be decoded: bad headers, body size mismatch, bad encoding."""


class SessionMismatch(NeuronBusError):
    """A message whose session state key does not match the hop's session table."""


class ServerError(NeuronBusError):
    """The embedded nats-server could not be started or did not become ready."""


class RouteError(NeuronBusError):
    """A generation that could not run or did not finish: carries the phase, node and reason."""

    def __init__(self, reason: Reason, message: str, phase: Phase = "queued", node_id: str | None = None):
        super().__init__(reason, message)
        self.phase = phase
        self.node_id = node_id
