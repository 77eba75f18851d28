"""Drafts for speculative ring steps, and how many of them are worth sending.

A speculative session's tail sends hop 0 its last sampled token plus up to k draft tokens; every
hop runs them in one call and the tail keeps the drafts its own choices agree with (tail.py). The
drafts come from the session's own text, with no extra model:

- `NgramDrafter` (prompt lookup): the longest suffix of the context (prompt and generated tokens,
  up to `MAX_NGRAM` tokens) that occurred before proposes what followed it then. A continuation
  that runs into the present goes on from the draft itself, so a repeating loop drafts k tokens.
- `Acceptance`: how often a draft's next token turns out right, by the length of the suffix that
  matched. Every proposal is scored against the tokens that really follow, sent or not, so the
  estimate needs no exploration.
- `StepCost`: what a ring step of n rows costs, ``base + (n - 1) * per_row``, fitted to the
  measured time between the tail's ring steps (the links' latency is in ``base``; every row costs
  compute on every hop). Before a multi-row step was seen, a row costs the tail's own compute per
  row on every hop.
- `DraftBudget`: the number of drafts that maximizes expected tokens per second of ring time. Over
  a 25 ms link a step costs ~100 ms and a row ~10 ms: drafts almost always pay. On one machine a
  step costs ~12 ms and a row ~10 (these CPUs gain nothing from batching rows): only near-certain
  drafts do, and a free text rarely drafts at all.

No I/O and no clock: the tail passes the times it measured.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_NGRAM = 4  # the longest suffix looked up
PENDING_SCORES = 8  # proposals being scored against the real continuation at once
COST_DECAY = 0.9  # weight of a step-cost observation after each newer one
PRIOR_WEIGHT = 2.0  # how many observations' worth the prior per-row cost counts in the fit


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    match: int  # length of the suffix that matched (0: nothing matched, no draft)


class NgramDrafter:
    """Prompt-lookup drafting over a growing context, O(MAX_NGRAM) per token."""

    def __init__(self, context: list[int], max_ngram: int = MAX_NGRAM):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be at least 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        # n -> n-gram -> where its latest occurrence that has a next token ends
        self._after: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
        self.extend(context)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            end = len(self.tokens)  # every n-gram ending here gets ``t`` as its next token
            for n in range(1, min(self.max_ngram, end) + 1):
                self._after[n][tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(t))

    def draft(self, k: int) -> Draft:
        """Up to ``k`` tokens that followed the longest earlier occurrence of the context's suffix."""
        size = len(self.tokens)
        if k <= 0:
            return Draft([], 0)
        for n in range(min(self.max_ngram, size), 0, -1):
            j = self._after[n].get(tuple(self.tokens[size - n :]))
            if j is None:
                continue
            out: list[int] = []
            for i in range(j, j + k):  # past the present, the draft continues itself
                out.append(self.tokens[i] if i < size else out[i - size])
            return Draft(out, n)
        return Draft([], 0)


@dataclass
class _Scoring:
    draft: Draft
    checked: int = 0


@dataclass
class Acceptance:
    """P(a draft's next token is right | the ones before it were), per matched suffix length.

    A Beta(1, 1) prior per length; each proposal adds its right tokens as hits and its first wrong
    one as a miss, once the real continuation is known.
    """

    hits: list[float] = field(default_factory=lambda: [0.0] * (MAX_NGRAM + 1))
    misses: list[float] = field(default_factory=lambda: [0.0] * (MAX_NGRAM + 1))
    _pending: deque[_Scoring] = field(default_factory=lambda: deque(maxlen=PENDING_SCORES))

    def rate(self, match: int) -> float:
        m = min(match, MAX_NGRAM)
        return (self.hits[m] + 1.0) / (self.hits[m] + self.misses[m] + 2.0)

    def proposed(self, draft: Draft) -> None:
        """Score ``draft`` against the tokens generated from now on."""
        if draft.tokens:
            self._pending.append(_Scoring(draft))

    def generated(self, token: int) -> None:
        """The next real token: every pending proposal checks its next draft token against it."""
        for p in list(self._pending):
            m = min(p.draft.match, MAX_NGRAM)
            if p.draft.tokens[p.checked] == token:
                self.hits[m] += 1
                p.checked += 1
                if p.checked < len(p.draft.tokens):
                    continue
            else:
                self.misses[m] += 1
            self._pending.remove(p)


class StepCost:
    """A ring step of n rows costs ``base + (n - 1) * per_row`` seconds: a least-squares fit with
    exponential forgetting, the per-row cost pulled towards ``prior_per_row`` (the tail's own
    compute per row on every hop) so that steps all of one length still give an answer."""

    def __init__(self) -> None:
        self.prior_per_row: float | None = None
        self._w = self._x = self._y = self._xx = self._xy = 0.0  # weighted sums over (rows - 1, seconds)

    def observe(self, rows: int, seconds: float) -> None:
        x = float(rows - 1)
        self._w, self._x, self._y = COST_DECAY * self._w + 1, COST_DECAY * self._x + x, COST_DECAY * self._y + seconds
        self._xx, self._xy = COST_DECAY * self._xx + x * x, COST_DECAY * self._xy + x * seconds

    def row_compute(self, seconds_per_row: float, hops: int) -> None:
        """The tail computed a row in ``seconds_per_row``: the prior cost of a row on ``hops`` hops."""
        guess = seconds_per_row * hops
        p = self.prior_per_row
        self.prior_per_row = guess if p is None else 0.8 * p + 0.2 * guess

    def fit(self) -> tuple[float, float] | None:
        """(base, per_row) seconds, or None before any step or row was measured."""
        if self._w == 0 or self.prior_per_row is None:
            return None
        lam, b0 = PRIOR_WEIGHT, self.prior_per_row
        # minimize sum w (y - a - b x)^2 + lam (b - b0)^2 over a, b
        mx, my = self._x / self._w, self._y / self._w
        sxx, sxy = self._xx - self._w * mx * mx, self._xy - self._w * mx * my
        per_row = max(0.0, (sxy + lam * b0) / (sxx + lam))
        return max(0.0, my - per_row * mx), per_row


class DraftBudget:
    """How many drafts to send: the k in [0, k_max] maximizing (1 + a + a^2 + ... + a^k) / (base + k per_row),
    ``a`` the acceptance rate of the draft's match length. ``adaptive`` False: every draft there is
    (a worker's ``--draft-policy all``: to measure what the budget saves)."""

    def __init__(self, k_max: int, hops: int, adaptive: bool = True):
        self.k_max = k_max
        self.hops = hops
        self.adaptive = adaptive
        self.acceptance = Acceptance()
        self.cost = StepCost()

    def choose(self, draft: Draft, room: int) -> int:
        """Drafts of ``draft`` worth sending, at most ``room`` (what the session may still emit)."""
        fit = self.cost.fit()
        k_max = min(self.k_max, len(draft.tokens), room)
        if not self.adaptive:
            return max(k_max, 0)
        if fit is None or k_max <= 0:
            return 0
        base, per_row = fit
        a = self.acceptance.rate(draft.match)
        best_k, best = 0, 1.0 / max(base, 1e-9)
        expected = 1.0
        for k in range(1, k_max + 1):
            expected += a**k
            rate = expected / max(base + k * per_row, 1e-9)
            if rate > best:
                best_k, best = k, rate
        return best_k
