"""A hop's session table: what it expects of the next message of every session it serves.

`SessionTable.check` compares an activation's session state key with the table *before* any
model work; a mismatch raises :class:`~neuron_bus.errors.SessionMismatch` whose reason is the
metrics label (unknown_session, wrong_route, wrong_key, wrong_layers, wrong_phase, replayed,
position_gap, out_of_order, overrun).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from neuron_bus import messages as M
from neuron_bus.errors import SessionMismatch
from neuron_bus.routes import hop_header
from neuron_bus.worker.tail import TailDecoder
from workers.errors import Reason


@dataclass
class HopSession:
    """What one hop knows of one session: where it is, and (at the tail) its decoder."""

    open: M.SessionOpen
    node_id: str
    position: int = 0  # next position this hop expects
    seq: int = 0  # next input sequence number
    out_seq: int = 0  # next sequence number this hop sends downstream
    tail: TailDecoder | None = None  # the route's last hop only
    finished: bool = False  # the tail sampled the last token
    last_used: float = field(default_factory=time.monotonic)
    replay_end: int = 0  # after a route repair: positions below it arrive again as prefill-like replay
    # positions at the end held on trust: the drafts of the last speculative step; the next decode
    # step says how many of them the tail accepted by starting among them (then they are dropped)
    drafts_held: int = 0
    admitted: int = 0  # the order this hop took the session in (SessionTable.add): its prompt's turn

    @property
    def session_id(self) -> str:
        return self.open.session_id

    @property
    def route(self) -> M.RouteAssignment:
        return self.open.route

    @property
    def hop_index(self) -> int:
        return self.open.hop_index

    @property
    def hop(self) -> M.RouteHop:
        return self.route.hops[self.hop_index]

    @property
    def is_head(self) -> bool:
        return self.hop_index == 0

    @property
    def is_tail(self) -> bool:
        return self.hop_index == len(self.route.hops) - 1

    @property
    def prefill_end(self) -> int:
        """Positions below this arrive as prefill chunks: the prompt, and after a repair the replay."""
        return max(self.open.prompt_tokens, self.replay_end)

    @property
    def verified(self) -> int:
        """Positions below this hold tokens the tail chose; the next decode step starts in [verified, position]."""
        return self.position - self.drafts_held

    @property
    def phase(self) -> M.ActivationPhase:
        return "prefill" if self.position < self.prefill_end else "decode"

    def header(
        self, hop_index: int, position: int, phase: M.ActivationPhase, seq: int, dtype: M.WireDtype
    ) -> M.ActivationHeader:
        """The state key for a message this session sends to ``hop_index``."""
        return hop_header(self.route, hop_index, self.session_id, position, phase, seq, dtype)


class SessionTable:
    def __init__(self) -> None:
        self._sessions: dict[str, HopSession] = {}
        self._order = itertools.count(1)
        self.on_change: Callable[[], None] | None = None  # told when a session is added or removed

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self):
        return iter(list(self._sessions.values()))

    def add(self, s: HopSession) -> None:
        """Hold ``s``; a session that replaces its own entry (a route repair) keeps its turn."""
        old = self._sessions.get(s.session_id)
        s.admitted = old.admitted if old is not None else next(self._order)
        self._sessions[s.session_id] = s
        self._changed()

    def get(self, session_id: str) -> HopSession | None:
        return self._sessions.get(session_id)

    def pop(self, session_id: str) -> HopSession | None:
        s = self._sessions.pop(session_id, None)
        if s is not None:
            self._changed()
        return s

    def turn(self, session_id: str | None) -> int:
        """When the session's prompt chunks are due (lower first): the order this hop took it in; 0 for
        a session it does not hold (its message is refused at once, costing no compute)."""
        s = self._sessions.get(session_id or "")
        return s.admitted if s is not None else 0

    def left(self, session_id: str | None) -> int:
        """Prompt (or repair replay) positions still to come for the session; 0 for one this hop does not hold."""
        s = self._sessions.get(session_id or "")
        return max(0, s.prefill_end - s.position) if s is not None else 0

    def routes(self) -> set[str]:
        return {s.route.route_id for s in self._sessions.values()}

    def check(self, h: M.ActivationHeader) -> HopSession:
        s = self._sessions.get(h.session_id)
        if s is None:
            raise SessionMismatch(Reason.UNKNOWN_SESSION, f"unknown or closed session {h.session_id}")
        hop = s.hop
        if h.route_id != s.route.route_id:
            raise SessionMismatch(
                Reason.WRONG_ROUTE,
                f"session {h.session_id} runs on route {s.route.route_id}, message says {h.route_id}",
            )
        for name, want in (
            ("model_preset", s.route.model_preset),
            ("model_revision", s.route.model_revision),
            ("backend_id", hop.backend_id),
            ("cache_abi", hop.cache_abi),
        ):
            if getattr(h, name) != want:
                raise SessionMismatch(
                    Reason.WRONG_KEY, f"session {h.session_id}: {name} is {want!r}, message says {getattr(h, name)!r}"
                )
        if (h.layer_start, h.layer_end) != (hop.layer_start, hop.layer_end):
            raise SessionMismatch(
                Reason.WRONG_LAYERS,
                f"session {h.session_id}: this hop runs layers [{hop.layer_start}, {hop.layer_end}), "
                f"message is for [{h.layer_start}, {h.layer_end})",
            )
        if h.phase != s.phase:
            raise SessionMismatch(Reason.WRONG_PHASE, f"session {h.session_id} is in {s.phase}, message is {h.phase}")
        if h.seq < s.seq:
            raise SessionMismatch(
                Reason.REPLAYED, f"session {h.session_id}: seq {h.seq} was already processed (next is {s.seq})"
            )
        if h.seq > s.seq:
            raise SessionMismatch(Reason.OUT_OF_ORDER, f"session {h.session_id}: seq {h.seq} arrived before {s.seq}")
        self._check_positions(s, h)
        return s

    @staticmethod
    def _check_positions(s: HopSession, h: M.ActivationHeader) -> None:
        """Where the message starts and how many positions it carries, before any model work."""
        lowest = s.verified if h.phase == "decode" else s.position
        if not lowest <= h.position <= s.position:
            reason = Reason.REPLAYED if h.position < lowest else Reason.POSITION_GAP
            expected = f"{s.position}" if lowest == s.position else f"{lowest}..{s.position}"
            raise SessionMismatch(reason, f"session {h.session_id}: position {h.position}, expected {expected}")
        n = h.shape[0] if h.shape else 0
        most = 1 + s.open.speculative
        if h.phase == "decode" and not 1 <= n <= most:
            carries = "one position" if most == 1 else f"1 to {most} positions (a token and its drafts)"
            raise SessionMismatch(
                Reason.WRONG_PHASE, f"session {h.session_id}: a decode step carries {carries}, got {n}"
            )
        if h.phase == "decode" and h.position + n > s.open.n_ctx:
            raise SessionMismatch(
                Reason.OVERRUN, f"session {h.session_id}: decode step runs past the session's n_ctx {s.open.n_ctx}"
            )
        if h.phase == "prefill" and not 0 < n <= s.open.chunk_size:
            raise SessionMismatch(
                Reason.WRONG_PHASE,
                f"session {h.session_id}: prefill chunk of {n} positions (chunk size {s.open.chunk_size})",
            )
        if h.phase == "prefill" and h.position + n > s.prefill_end:
            raise SessionMismatch(
                Reason.OVERRUN, f"session {h.session_id}: prefill chunk runs past position {s.prefill_end}"
            )
