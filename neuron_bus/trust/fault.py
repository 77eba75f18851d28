"""Deliberate faults, for testing that audits and the meter catch them (``neuron-bus worker --fault F``).

``perturb`` adds Gaussian noise of half the output's own standard deviation to every activation
(or, at the tail, every logit) a node emits: the node stays fast and healthy-looking while its
route's output drifts away from the model's.

``inflate-ledger`` computes honestly but reports twice the positions it computed in its ledger
entries (the meter pays it what the swarm observed and flags the claim: trust/meter.py).

``hang``: a backend call on real work never returns, as a deadlocked backend's would; the node's
heartbeats and control requests go on as before, and only the process's exit ends the call (the
worker's stop must not wait for it: cli/worker.py).
"""

from __future__ import annotations

import threading

import numpy as np

FAULTS = ("perturb", "inflate-ledger", "hang")
INFLATE = 2  # inflate-ledger: the factor on the positions a node claims
_never = threading.Event()  # hang: waited on, never set


def check(fault: str | None) -> str | None:
    if fault not in (None, "", *FAULTS):
        raise ValueError(f"unknown fault {fault!r}: use one of {', '.join(FAULTS)}")
    return fault or None


def before_call(fault: str | None) -> None:
    """Backend thread, before a call on real work: ``hang`` waits here for good."""
    if fault == "hang":
        _never.wait()


def apply(fault: str | None, out: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if fault != "perturb":
        return out
    scale = 0.5 * float(np.std(out)) or 1.0
    return (out + rng.normal(0.0, scale, size=out.shape)).astype(out.dtype, copy=False)
