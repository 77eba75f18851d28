"""Layer-range arithmetic on half-open ranges [start, end) of a model with ``n`` layers."""

from __future__ import annotations

from collections.abc import Iterable


def spell(start: int, end: int) -> str:
    """Half-open [start, end) spelled inclusively, as people and the CLI do: "15-29" or "7"."""
    return str(start) if end - start == 1 else f"{start}-{end - 1}"


def uncovered_runs(ranges: Iterable[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """Maximal runs of layers in [0, n) that no range covers."""
    covered = [False] * n
    for a, b in ranges:
        for layer in range(max(a, 0), min(b, n)):
            covered[layer] = True
    return runs(covered, lambda c: not c)


def runs(values: list, pred) -> list[tuple[int, int]]:
    """Maximal half-open runs of indices whose value satisfies ``pred``."""
    out, start = [], None
    for i, v in enumerate(values):
        if pred(v) and start is None:
            start = i
        elif not pred(v) and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(values)))
    return out


def reachable_from_start(ranges: Iterable[tuple[int, int]]) -> set[int]:
    """Boundaries a chain of ranges starting at layer 0 can reach (0 included)."""
    ordered = sorted(set(ranges))
    reach = {0}
    for a, b in ordered:  # sorted by start, and start < end: one pass suffices
        if a in reach:
            reach.add(b)
    return reach


def reaching_end(ranges: Iterable[tuple[int, int]], n: int) -> set[int]:
    """Boundaries from which a chain of ranges reaches layer ``n`` (n included)."""
    ordered = sorted(set(ranges), key=lambda r: r[1], reverse=True)
    reach = {n}
    for a, b in ordered:  # sorted by end, descending: one pass suffices
        if b in reach:
            reach.add(a)
    return reach
