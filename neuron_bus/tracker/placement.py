"""Placement: which layers a node should serve, and which node should move — pure functions.

The picture of one model is its layers' capacity: the decode tokens per second the live replicas
of each layer can carry together (a node holding k layers at t seconds per layer per token adds
1 / (k·t) to each of them), 0 for a gap. A swarm serves a model as fast as its weakest layer, so
placement covers gaps first (leaving as few uncovered runs, then layers, as it can: a node at
the head of an empty model leaves one gap, not two), then raises the bottleneck; the bottleneck
equal, ranges whose ends meet the seams existing ranges already have win (routes then need no
extra hop), then the next weakest layers (the sorted capacities compared lexicographically),
then the lower start.

- `choose_range`: the range a joining node should take, within what fits its memory.
- `plan_move`: whether some node should change its range, and which. Never a move that opens a
  gap; only one that raises the bottleneck by `MOVE_GAIN` (or fills a gap), after the node has
  stayed `MIN_STAY_S` where it is; of equal gains, the slowest node moves (Petals moves servers
  the same way; none of the peers moves a node's running sessions with it: here they finish first).

Complexity: a picture of n layers and m candidate nodes costs O(n³) per node to weigh every one of
its O(n²) ranges (the capacities after each, O(n)), sorting capacities only for the ranges tied on
the rest; O(m·n³) for a move plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MOVE_GAIN = 1.25  # a move must raise the bottleneck at least this much (hysteresis)
MIN_STAY_S = 60.0  # a node stays this long in a range before it may be asked to move
UNMEASURED_SECONDS_PER_LAYER = 0.005  # per layer per token, for a swarm with nothing measured yet
EPS = 1e-9


@dataclass(frozen=True)
class Placed:
    """A live node of the model: its range and what one layer of it costs per token."""

    node_id: str
    layer_start: int
    layer_end: int
    seconds_per_layer: float  # measured (heartbeat decode tok/s → per layer), or its self-benchmark
    placed_at: float = 0.0  # when it took this range (monotonic seconds, the tracker's clock)

    @property
    def capacity(self) -> float:
        """Tokens per second it adds to each layer it holds."""
        return 1.0 / max((self.layer_end - self.layer_start) * self.seconds_per_layer, EPS)


@dataclass(frozen=True)
class Fit:
    """What a node can hold: at most ``max_layers`` layers and ``budget`` bytes (0: no budget)."""

    max_layers: int
    budget: int = 0
    layer_bytes: tuple[int, ...] = ()  # per layer: weights + the KV slots the node will allocate
    head_bytes: int = 0  # the output head, for a range that ends at the last layer
    embd_bytes: int = 0  # the token embeddings, for a range that starts at layer 0

    def need(self, start: int, end: int, n_layers: int) -> int:
        """Bytes layers [start, end) take on this node."""
        edges = (self.embd_bytes if start == 0 else 0) + (self.head_bytes if end == n_layers else 0)
        return sum(self.layer_bytes[start:end]) + edges

    def fits(self, start: int, end: int, n_layers: int) -> bool:
        if end - start > self.max_layers:
            return False
        return not self.budget or not self.layer_bytes or self.need(start, end, n_layers) <= self.budget


@dataclass(frozen=True)
class Decision:
    node_id: str
    layer_start: int
    layer_end: int
    reason: str
    bottleneck_before: float = 0.0
    bottleneck_after: float = 0.0


@dataclass
class Picture:
    """One model's layers as its live nodes cover them."""

    n_layers: int
    nodes: list[Placed] = field(default_factory=list)

    def capacity(self, without: str | None = None) -> list[float]:
        cap = [0.0] * self.n_layers
        for p in self.nodes:
            if p.node_id != without:
                for i in range(p.layer_start, min(p.layer_end, self.n_layers)):
                    cap[i] += p.capacity
        return cap

    def seams(self, without: str | None = None) -> set[int]:
        out = {0, self.n_layers}
        for p in self.nodes:
            if p.node_id != without:
                out |= {p.layer_start, p.layer_end}
        return out

    def seconds_per_layer(self) -> float:
        """What a layer costs a typical node here (the median of the measured ones)."""
        measured = sorted(p.seconds_per_layer for p in self.nodes if p.seconds_per_layer > 0)
        return measured[len(measured) // 2] if measured else UNMEASURED_SECONDS_PER_LAYER


def leximin(capacity: Sequence[float]) -> tuple[float, ...]:
    """The capacities, weakest first, rounded so float noise does not decide."""
    return tuple(round(c, 6) for c in sorted(capacity))


def bottleneck(capacity: Sequence[float]) -> float:
    return min(capacity) if capacity else 0.0


def _best(
    capacity: list[float],
    seams: set[int],
    seconds_per_layer: float,
    fit: Fit,
    loadable: Callable[[int, int], bool],
    exclude: tuple[int, int] | None = None,
) -> tuple[tuple, int, int] | None:
    """The best range the node could take but ``exclude`` (None: none loads): (key, start, end),
    keys compared as tuples. The sorted capacities (leximin) are derived only for the ranges tied
    on everything before them: deriving them for every range made a ranking O(n³ log n)."""
    n = len(capacity)
    top: list[tuple[tuple, int, int, list[float]]] = []  # the ranges tied on the best short key
    for start in range(n):
        for end in range(start + 1, n + 1):
            if (start, end) == exclude or not fit.fits(start, end, n) or not loadable(start, end):
                continue
            add = 1.0 / max((end - start) * seconds_per_layer, EPS)
            after = capacity[:start] + [c + add for c in capacity[start:end]] + capacity[end:]
            meets = (start in seams) + (end in seams)
            gaps = sum(1 for c in after if c <= 0)
            runs = sum(1 for i, c in enumerate(after) if c <= 0 and (i == 0 or after[i - 1] > 0))
            short = (-runs, -gaps, round(min(after), 6), meets)
            if not top or short > top[0][0]:
                top = [(short, start, end, after)]
            elif short == top[0][0]:
                top.append((short, start, end, after))
    if not top:
        return None
    # the first of equal keys wins (the lowest end): max() keeps the first maximum it meets
    key, start, end = max((((short + (leximin(after), -a)), a, b) for short, a, b, after in top), key=lambda r: r[0])
    return key, start, end


def choose_range(
    picture: Picture, node_id: str, fit: Fit, loadable: Callable[[int, int], bool] = lambda a, b: True
) -> Decision | None:
    """The range a joining node should take (None: nothing it can hold loads)."""
    capacity = picture.capacity()
    best = _best(capacity, picture.seams(), picture.seconds_per_layer(), fit, loadable)
    if best is None:
        return None
    (_, _, low, meets, _, _), start, end = best
    gaps = sum(1 for c in capacity[start:end] if c <= 0)
    why = f"covers {gaps} uncovered layers" if gaps else f"raises the weakest layers' capacity to {low:.2f} tok/s"
    if meets == 2:
        why += "; both ends meet existing seams"
    return Decision(node_id, start, end, why, bottleneck(capacity), low)


def plan_move(
    picture: Picture,
    fits: dict[str, Fit],
    now: float,
    loadable: Callable[[int, int], bool] = lambda a, b: True,
    gain: float = MOVE_GAIN,
    min_stay: float = MIN_STAY_S,
) -> Decision | None:
    """The one move that helps the swarm most, or None. ``fits``: what each node can hold."""
    capacity = picture.capacity()
    now_min = bottleneck(capacity)
    gaps = sum(1 for c in capacity if c <= 0)
    best: tuple[tuple, Decision] | None = None
    for p in sorted(picture.nodes, key=lambda p: -p.seconds_per_layer):  # the slowest first: it wins ties
        if now - p.placed_at < min_stay or p.node_id not in fits:
            continue
        without = picture.capacity(without=p.node_id)
        if any(w <= 0 < c for w, c in zip(without, capacity)):
            continue  # moving it would uncover a layer only it serves
        here = (p.layer_start, p.layer_end)
        found = _best(without, picture.seams(without=p.node_id), p.seconds_per_layer, fits[p.node_id], loadable, here)
        if found is None:
            continue
        key, start, end = found
        gaps_after, low = -key[1], key[2]
        if gaps and gaps_after >= gaps:
            continue  # with layers uncovered, only a move that covers some of them
        if not gaps and low < gain * now_min - EPS:
            continue  # hysteresis: not worth a move
        if best is None or key > best[0]:
            why = (
                f"covers {gaps - gaps_after} of {gaps} uncovered layers"
                if gaps
                else f"raises the bottleneck {now_min:.2f} → {low:.2f} tok/s"
            )
            best = (key, Decision(p.node_id, start, end, why, now_min, low))
    return best[1] if best else None
