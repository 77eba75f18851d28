"""Deliberate faults, for testing that audits and the meter catch them (``neuron-bus worker --fault F``).

``perturb`` adds Gaussian noise of half the output's own standard deviation to every activation
(or, at the tail, every logit) a node emits: the node stays fast and healthy-looking while its
route's output drifts away from the model's.

``inflate-ledger`` computes honestly but reports twice the positions it computed in its ledger
entries (the meter pays it what the swarm observed and flags the claim: trust/meter.py).

``hang``: a backend call on real work never returns (until the worker stops), as a deadlocked
or swapping backend's would; the node's heartbeats and control requests go on as before.
"""

from __future__ import annotations

import threading

import numpy as np

FAULTS = ("perturb", "inflate-ledger", "hang")
INFLATE = 2  # inflate-ledger: the factor on the positions a node claims
_released = threading.Event()  # hang: set when the worker stops


def check(fault: str | None) -> str | None:
    if fault not in (None, "", *FAULTS):
        raise ValueError(f"unknown fault {fault!r}: use one of {', '.join(FAULTS)}")
    return fault or None


def before_call(fault: str | None) -> None:
    """Backend thread, before a call on real work: ``hang`` waits here until ``release``."""
    if fault == "hang":
        _released.wait()


def release() -> None:
    """The worker stops: a hung call returns (and the backend thread with it)."""
    _released.set()


def apply(fault: str | None, out: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if fault != "perturb":
        return out
    scale = 0.5 * float(np.std(out)) or 1.0
    return (out + rng.normal(0.0, scale, size=out.shape)).astype(out.dtype, copy=False)
