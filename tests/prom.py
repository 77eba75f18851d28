"""Reading a worker's Prometheus metrics (its `--metrics-port`) in tests."""

from __future__ import annotations

import urllib.request


def counter(port: int, name: str, phase: str = "decode", **labels: str) -> float:
    """The value of ``name{phase="...",...}`` on the worker's metrics endpoint (0 when absent;
    ``labels`` in the order the metric declares them)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in {"phase": phase, **labels}.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
