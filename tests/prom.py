"""Reading a worker's Prometheus metrics (its `--metrics-port`) in tests."""

from __future__ import annotations

import urllib.request


def metric(port: int, name: str, **labels: str) -> float:
    """The value of the series ``name{labels}`` on the worker's metrics endpoint (0 when absent)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # the exposition sorts them too
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return 0.0


def counter(port: int, name: str, phase: str = "decode") -> float:
    """The value of ``name{phase="..."}`` (0 when absent)."""
    return metric(port, name, phase=phase)
