"""Typed errors raised by backends. A raised error never leaves another session's state changed."""

from __future__ import annotations


class BackendError(Exception):
    """Base class; ``reason`` is a short label (metrics, error messages on the bus)."""

    reason = "backend_error"


class BadInput(BackendError):
    """Wrong hidden size, wrong dtype, wrong number of positions, token id out of range."""

    reason = "bad_input"


class PositionGap(BackendError):
    """The input's position is not the session's next position."""

    reason = "position_gap"


class UnknownSession(BackendError):
    """The session was never opened on this backend, or is already closed."""

    reason = "unknown_session"


class SessionExists(BackendError):
    reason = "session_exists"


class UnsupportedModel(BackendError):
    """The artifact cannot run on this backend (architecture, layer-boundary limits)."""

    reason = "unsupported_model"
