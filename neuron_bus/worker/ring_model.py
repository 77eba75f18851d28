"""How many decode waves keep a ring busy: a head hop's model of its ring, from what it measures.

A wave of ``s`` steps costs a hop ``c(s) = fixed + per_row * s`` seconds (`CallCost`, fitted to
the decode calls the hop has run). A wave's trip around the ring takes the links' latency ``L``
(`RingLinks`, measured at the head: how long a step is away, less the other hops' compute) plus
each hop's compute. With ``n`` sessions in ``W`` waves of ``s = ceil(n / W)``, one round of every
wave takes the longer of

- a wave's trip, ``L + hops * c(s)`` (a hop is idle while waves are on the links), and
- a hop's work for all waves, ``W * c(s)`` (waves queue at a saturated hop),

and that round yields ``n`` tokens. `best_wave_count` takes, among the counts whose round is
within 5% of the shortest, the current one or else the fewest.
On one machine (``L`` near 0) that is one wave per hop, the biggest batches; on 25 ms links, where
a trip is 100 ms of links, more and smaller waves: the hops compute while the other waves travel.
Measured on SmolLM2 with 16 sessions over 2 hops at 25 ms per link: 2 waves of 8 give 8.4-9.6x
one session, 4 waves of 4 10.8-11.1x, 8 waves of 2 10.3-11.8x (docs/wan.md).

Each hop is assumed to cost what this one does (routes split a model into near-equal ranges).
"""

from __future__ import annotations

from collections import deque

COST_SMOOTHING = 0.2  # weight of a new call in its size's running mean
LINK_SAMPLES = 64  # the links' latency is the least of the last this many trips (queueing only adds)
KEEP_WITHIN = 1.05  # counts whose rounds are within 5% of the shortest are as good: keep the current, or the fewest


class CallCost:
    """Seconds of one decode call by its rows: a running mean per size, and a line through them."""

    def __init__(self) -> None:
        self.mean_s: dict[int, float] = {}
        self._line: tuple[float, float] | None = None  # fitted once per call observed, read per plan

    def observe(self, rows: int, seconds: float) -> None:
        old = self.mean_s.get(rows)
        self.mean_s[rows] = seconds if old is None else old + COST_SMOOTHING * (seconds - old)
        self._line = self._fit()

    def line(self) -> tuple[float, float] | None:
        return self._line

    def _fit(self) -> tuple[float, float] | None:
        """(fixed, per_row) seconds by least squares over the sizes seen; with one size seen, its
        cost split evenly between the fixed part and its rows (a guess the next size corrects)."""
        if not self.mean_s:
            return None
        if len(self.mean_s) == 1:
            ((rows, s),) = self.mean_s.items()
            return s / (rows + 1), s / (rows + 1)
        xs, ys = list(self.mean_s), list(self.mean_s.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        per_row = max(slope, 1e-6)
        return max(my - per_row * mx, 0.0), per_row

    def __call__(self, rows: int) -> float | None:
        line = self.line()
        return None if line is None else line[0] + line[1] * rows


class RingLinks:
    """The ring's latency without compute, seen from a head hop: for each of its sessions, when the
    wave's output left and when the session's next step came back, less the other hops' compute."""

    def __init__(self) -> None:
        self._left: dict[str, tuple[float, float]] = {}  # session -> (when it left, the others' compute)
        self._samples: deque[float] = deque(maxlen=LINK_SAMPLES)

    def left(self, session_ids: list[str], when: float, others_compute_s: float) -> None:
        for sid in session_ids:
            self._left[sid] = (when, others_compute_s)

    def returned(self, session_id: str | None, when: float) -> None:
        sent = self._left.pop(session_id or "", None)
        if sent is not None:
            self._samples.append(max(0.0, when - sent[0] - sent[1]))

    def forget(self, keep: set[str]) -> None:
        """Drop sessions that no longer decode here (closed, finished, moved)."""
        for sid in [s for s in self._left if s not in keep]:
            del self._left[sid]

    def latency(self) -> float | None:
        return min(self._samples) if self._samples else None


def wave_size(n: int, waves: int) -> int:
    """Steps in each of ``waves`` waves of ``n`` sessions (the last may be short)."""
    return -(-n // waves)


def round_s(n: int, waves: int, hops: int, links_s: float, cost) -> float:
    """One round of ``n`` sessions' steps in ``waves`` waves (see the module's docstring)."""
    size = wave_size(n, waves)
    c = cost(size)
    return max(links_s + hops * c, -(-n // size) * c)


def best_wave_count(n: int, hops: int, max_batch: int, links_s: float | None, cost: CallCost, current: int) -> int:
    """The number of waves for ``n`` decoding sessions over ``hops`` hops: one per hop until the
    ring and the calls are measured, then among the counts whose round is within 5% of the
    shortest ``current`` if it is one, else the fewest (each backend call also costs the hop's
    shell a pass of admission and publishing, which the call's cost does not show: when compute
    is negligible, as with no-op hops, every count's round is the links' and batching stays);
    never waves bigger than ``max_batch``.

    With calls of one size measured, the line is a guess (``CallCost``): a count that would run
    that size again is not taken on it, or the guess could never be corrected (a lone session's
    calls of one row made a guess in which batching cost as much as it saves; eight sessions
    then ran in eight waves of one, for good). One wave per hop is run instead, a second size."""
    fewest = max(1, -(-n // max(1, max_batch)))
    default = max(fewest, min(n, hops))
    if n <= hops or links_s is None or cost.line() is None:
        return default
    counts = sorted({-(-n // s) for s in range(1, -(-n // fewest) + 1)})  # one count per wave size
    rounds = {w: round_s(n, w, hops, links_s, cost) for w in counts if w >= default}
    shortest = min(rounds.values())
    near = [w for w in rounds if rounds[w] <= KEEP_WITHIN * shortest]  # as good, give or take 5%
    best = current if current in near else min(near)  # else the fewest: calls cost the shell too
    if len(cost.mean_s) == 1 and wave_size(n, best) in cost.mean_s:
        return default
    return best
