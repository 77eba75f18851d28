"""Generation telemetry: phase, prefill progress, generated tokens, rolling and average tok/s.

`GenerationProgress` keeps the numbers for one session and produces
:class:`~neuron_bus.messages.GenerationTelemetry` snapshots; whoever drives a phase (the client
while queued/loading, the route's tail during prefill and decode) publishes them on
``neuron.telemetry.<owner>.<session_id>``, where the stream keeps the latest one for late readers.
"""

from __future__ import annotations

import time
from collections import deque

from neuron_bus import messages as M
from neuron_bus import subjects as S

ROLLING_WINDOW_S = 2.0
MIN_INTERVAL_S = 0.1  # between two decode-progress messages of one session


class GenerationProgress:
    def __init__(
        self,
        session_id: str,
        route_id: str,
        model_preset: str,
        nodes: list[str],
        prompt_tokens: int,
        owner: str = S.PUBLIC_OWNER,
    ):
        self.session_id = session_id
        self.owner = owner  # the client that opened the session: its telemetry subject
        self.route_id = route_id
        self.model_preset = model_preset
        self.nodes = nodes
        self.phase: M.Phase = "queued"
        self.prefill_total = prompt_tokens
        self.prefill_done = 0
        self.generated = 0
        self.failure_reason: str | None = None
        self.failure_phase: M.Phase | None = None
        self.failure_node: str | None = None
        self.queue_position: int | None = None
        self.draft_tokens = 0
        self.accepted_draft_tokens = 0
        self.prefill_reused = 0  # prompt positions attached from the hops' prefix caches
        self._first_token_at: float | None = None
        self._recent: deque[float] = deque()
        self._last_sent = 0.0

    def queued(self, position: int) -> None:
        """Waiting for a free session slot, ``position`` generations ahead in the queue."""
        self.phase = "queued"
        self.queue_position = position

    def prefill(self, done: int) -> None:
        self.queue_position = None
        self.phase = "prefill"
        self.prefill_done = done

    def token(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.phase = "decode"
        self.prefill_done = self.prefill_total
        self.generated += 1
        if self._first_token_at is None:
            self._first_token_at = now
        self._recent.append(now)
        while self._recent and now - self._recent[0] > ROLLING_WINDOW_S:
            self._recent.popleft()

    def finish(self, phase: M.Phase = "done", reason: str | None = None) -> None:
        self.phase = phase
        if reason:
            self.failure_reason = reason

    def fail(self, reason: str, phase: M.Phase | None = None, node_id: str | None = None) -> None:
        """The session failed: remember the last real phase and the node it failed at."""
        self.failure_phase = phase if phase and phase != "failed" else self.phase
        self.failure_node = node_id
        self.finish("failed", reason)

    def rolling_tps(self, now: float) -> float:
        if len(self._recent) < 2:
            return 0.0
        span = max(now - self._recent[0], 1e-6)
        return (len(self._recent) - 1) / span

    def average_tps(self, now: float) -> float:
        if self._first_token_at is None or self.generated < 2:
            return 0.0
        return (self.generated - 1) / max(now - self._first_token_at, 1e-6)

    def due(self, now: float | None = None) -> bool:
        """Rate limit for decode progress: at most one message per MIN_INTERVAL_S."""
        now = time.monotonic() if now is None else now
        if now - self._last_sent >= MIN_INTERVAL_S:
            self._last_sent = now
            return True
        return False

    def snapshot(self) -> M.GenerationTelemetry:
        now = time.monotonic()
        return M.GenerationTelemetry(
            session_id=self.session_id,
            route_id=self.route_id,
            model_preset=self.model_preset,
            phase=self.phase,
            prefill_tokens_done=self.prefill_done,
            prefill_tokens_total=self.prefill_total,
            generated_tokens=self.generated,
            rolling_tokens_per_second=round(self.rolling_tps(now), 3),
            average_tokens_per_second=round(self.average_tps(now), 3),
            active_route_nodes=self.nodes,
            failure_reason=self.failure_reason,
            failure_phase=self.failure_phase,
            failure_node=self.failure_node,
            queue_position=self.queue_position,
            draft_tokens=self.draft_tokens,
            accepted_draft_tokens=self.accepted_draft_tokens,
            prefill_tokens_reused=self.prefill_reused,
            ts=time.time(),
        )

    @property
    def subject(self) -> str:
        return S.telemetry(self.owner, self.session_id)
