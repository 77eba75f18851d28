"""The gateway's side of the bus: models and coverage from the tracker, routes, prompts, sessions.

One :class:`NeuronClient` (one NATS connection) serves every request; generations run through
``NeuronClient.generate`` and attached sessions are followed on their JetStream subjects.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from neuron_bus import messages as M
from neuron_bus import session_events
from neuron_bus import subjects as S
from neuron_bus.client import NeuronClient, RouteError
from neuron_bus.gateway.metrics import GatewayMetrics
from neuron_bus.gateway.validation import ApiError, GenRequest, Limits
from workers.errors import Reason

TRACKER_TIMEOUT_S = 3.0
# A follower that hears nothing for this long asks whether the session's run still goes on in this
# gateway: then it waits on (the run bounds its own quiet, the stall rule in generation.py, and
# publishes how it ended); once the run is gone, what the stream holds has been replayed.
ATTACH_CHECK_S = 2.0


@dataclass
class Prepared:
    """A request with its route and prompt tokens, checked against the context limit. ``route``
    is the one the generation runs on: a retry's or a repair's replaces the first (``stream``)."""

    req: GenRequest
    route: M.RouteAssignment
    prompt_tokens: list[int]

    @property
    def model(self) -> str:
        assert self.req.model is not None  # prepare() chose it
        return self.req.model

    def runs_on(self, route: M.RouteAssignment) -> None:
        self.route = route


@dataclass
class Tally:
    """What a generation produced so far (for non-streaming answers and final messages)."""

    prompt_tokens: int
    session_id: str = ""
    deltas: list[M.TokenDelta] = field(default_factory=list)
    telemetry: M.GenerationTelemetry | None = None
    finish_reason: str | None = None
    started: float = field(default_factory=time.monotonic)

    def add(self, event) -> None:
        self.session_id = event.session_id
        if isinstance(event, M.GenerationTelemetry):
            self.telemetry = event
            return
        self.deltas.append(event)
        if event.finished:
            self.finish_reason = event.finish_reason

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    def usage(self) -> dict:
        """OpenAI's usage object; ``cached_tokens``: prompt positions the route attached from its
        hops' prefix caches instead of computing them (a chat's next turn, a shared system prompt)."""
        n = len(self.deltas)
        cached = self.telemetry.prefill_tokens_reused if self.telemetry is not None else 0
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def routable(report: M.CoverageReport) -> list[str]:
    """Presets with at least one live replica on every layer: the tracker can route them now."""
    return sorted({m.model_preset for m in report.models if m.layers and all(row.replicas for row in m.layers)})


# Route failures that mean "not now" and when to try again: the queue of generations waiting for a
# free session slot is full (HTTP 429), or the swarm is full with queueing off, or a part of it is
# not reachable yet (503). Any other failure is a fault of a node upstream (502).
RETRY_AFTER_S = {
    Reason.QUEUE_FULL: 5,
    Reason.NO_FREE_SLOT: 2,
    Reason.NO_ROUTE: 5,
    Reason.NO_TRACKER: 5,
    Reason.BUS_UNREACHABLE: 5,
    Reason.NATS: 5,  # the bus did not take a write (a route assignment, a hop's output): a new try gets a new one
    Reason.NODE_UNREACHABLE: 5,
    Reason.NODE_LOST: 5,  # a dead node: the tracker stops routing to it within seconds
    Reason.DRAINING: 5,  # a node moving to other layers: the tracker routes around it within a heartbeat
    Reason.STUCK: 5,  # a node stuck in a backend call: the tracker stops routing to it within a heartbeat
}


def route_api_error(exc: RouteError, session_id: str | None = None) -> ApiError:
    """The HTTP answer to a failed route: 503 with Retry-After for our own limits, else 502."""
    fields = route_error_body(exc, session_id)
    message = fields.pop("message")
    if exc.reason == Reason.QUEUE_FULL:
        fields["type"] = "rate_limit_exceeded"
        return ApiError(429, message, retry_after=RETRY_AFTER_S[exc.reason], **fields)
    if exc.reason in RETRY_AFTER_S:
        fields["type"] = "service_unavailable"
        return ApiError(503, message, retry_after=RETRY_AFTER_S[exc.reason], **fields)
    return ApiError(502, message, **fields)


def route_error_body(exc: RouteError, session_id: str | None = None) -> dict:
    """The final error of a failed generation, for every channel: reason, phase, node."""
    return {
        "message": str(exc),
        "type": "route_error",
        "param": None,
        "code": exc.reason,
        "reason": exc.reason,
        "phase": exc.phase,
        "node_id": exc.node_id,
        "session_id": session_id,
    }


DEFAULT_CHUNK = 128  # prompt tokens per prefill chunk: the page's progress steps, and each hop's share of a batch


class Bus:
    def __init__(self, client: NeuronClient, limits: Limits, metrics: GatewayMetrics, chunk_size: int = DEFAULT_CHUNK):
        self.client = client
        self.limits = limits
        self.metrics = metrics
        self.chunk_size = chunk_size
        self.running: set[str] = set()  # sessions whose generation runs in this gateway now (attach follows them)

    # ------------------------------------------------------------------ tracker

    async def coverage(self, model_preset: str | None = None, wait: float | None = None) -> M.CoverageReport:
        """The tracker's coverage map; a request waits for a restarting tracker (the client's
        ``tracker_wait``), a health check (``wait=0``) does not."""
        try:
            return await self.client.coverage(model_preset, timeout=TRACKER_TIMEOUT_S, wait=wait)
        except RouteError as exc:
            raise route_api_error(exc) from None

    async def models(self, wait: float | None = None) -> list[str]:
        return routable(await self.coverage(wait=wait))

    async def health(self) -> dict:
        nats_ok = self.client.nc.is_connected
        try:
            models = await self.models(wait=0) if nats_ok else []
            tracker_ok = True
        except ApiError:
            models, tracker_ok = [], False
        return {
            "status": "ok" if nats_ok and tracker_ok else "degraded",
            "nats": nats_ok,
            "tracker": tracker_ok,
            "models": models,
        }

    # ------------------------------------------------------------------ generation

    async def prepare(self, req: GenRequest) -> Prepared:
        """Route the request's model and tokenize its prompt on the route's head (chat template there)."""
        report = await self.coverage()
        ready = routable(report)
        model = req.model or (ready[0] if ready else None)
        if model not in ready:
            if model is not None and model not in {m.model_preset for m in report.models}:
                raise ApiError(
                    404,
                    f"the model '{model}' does not exist on this swarm; models: {', '.join(ready) or 'none'}",
                    param="model",
                    code="model_not_found",
                )
            raise ApiError(
                503,
                f"the model '{model}' has no complete route right now (layers without a live node)",
                type="service_unavailable",
                param="model",
                code="no_route",
                retry_after=RETRY_AFTER_S[Reason.NO_ROUTE],
            )
        req.model = model
        try:
            p = await self.client.prepare(
                model,
                prompt=req.prompt,
                messages=req.messages,
                prompt_tokens=req.prompt_tokens,
                policy=req.policy,
                check_tokens=True,
            )
        except RouteError as exc:
            if exc.reason == Reason.EMPTY_PROMPT:
                raise ApiError(422, "the prompt has no tokens", param="prompt", code="empty_prompt") from None
            if exc.reason == Reason.BAD_INPUT:  # a token id the model does not have
                raise ApiError(422, str(exc), param="prompt", code="invalid_token") from None
            raise route_api_error(exc) from None
        route, tokens = p.route, p.prompt_tokens
        if len(tokens) + req.sampling.max_tokens > self.limits.max_context:
            raise ApiError(
                413,
                f"the prompt has {len(tokens)} tokens and max_tokens is {req.sampling.max_tokens}: more than this "
                f"gateway's context of {self.limits.max_context} tokens",
                param="messages" if req.messages else "prompt",
                code="context_length_exceeded",
            )
        return Prepared(req, route, tokens)

    async def stream(self, p: Prepared) -> AsyncGenerator[M.TokenDelta | M.GenerationTelemetry, None]:
        """The generation's telemetry and token deltas; raises RouteError when the route fails."""
        self.metrics.active.inc()
        self.metrics.tokens.labels("prompt").inc(len(p.prompt_tokens))
        session_id = ""
        gen = self.client.generate(
            prompt_tokens=p.prompt_tokens,
            route=p.route,
            sampling=p.req.sampling,
            model_preset=p.model,
            chunk_size=self.chunk_size,
            policy=p.req.policy,
            speculative=p.req.speculative,
            on_route=p.runs_on,
        )
        try:
            async with aclosing(gen):
                async for event in gen:
                    if not session_id:
                        session_id = event.session_id
                        self.running.add(session_id)
                    if isinstance(event, M.TokenDelta):
                        self.metrics.tokens.labels("completion").inc()
                    yield event
        except RouteError as exc:
            self.metrics.errors.labels("generation", exc.reason).inc()
            raise
        finally:
            self.running.discard(session_id)
            self.metrics.active.dec()

    async def attach(self, session_id: str) -> AsyncIterator[M.TokenDelta | M.GenerationTelemetry]:
        """Follow an existing session: its latest telemetry, then every token (replayed) and update."""
        try:
            S.check_token(session_id, "session id")
        except ValueError as exc:
            raise ApiError(422, str(exc), param="session_id", code="invalid_value") from None
        js, owner = self.client.js, self.client.owner  # only sessions this gateway opened: they are its own
        try:
            await js.get_last_msg(S.STREAM_TELEMETRY, S.telemetry(owner, session_id))
        except NotFoundError:
            raise ApiError(
                404, f"no session {session_id} on the bus", param="session_id", code="unknown_session"
            ) from None
        events: asyncio.Queue = asyncio.Queue()

        def into(kind: str):
            async def cb(msg) -> None:
                events.put_nowait((kind, msg.data))

            return cb

        # the latest telemetry, then every token and error from the start: the stream keeps them
        subs = [
            await js.subscribe(
                subject(owner, session_id),
                cb=into(kind),
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.LAST if kind == "telemetry" else DeliverPolicy.ALL,
                config=ConsumerConfig(name=uuid.uuid4().hex),  # named: its filter is in the API subject
            )
            for kind, subject in session_events.SUBJECTS
        ]
        last_phase: M.Phase = "queued"
        try:
            while True:
                try:
                    kind, data = await asyncio.wait_for(events.get(), ATTACH_CHECK_S)
                except TimeoutError:
                    if session_id in self.running:
                        continue  # quiet, but its run goes on: it ends with a token, or publishes its failure
                    if last_phase == "done":
                        return  # done, and the final token is no longer on the bus
                    raise ApiError(
                        410,
                        f"session {session_id} ended without finishing: its generation no longer runs in this "
                        "gateway (the client that started it left, or the gateway restarted)",
                        param="session_id",
                        code="session_ended",
                    ) from None
                event = session_events.read(kind, data, last_phase)
                if event is None:
                    continue
                if isinstance(event, M.GenerationTelemetry):
                    last_phase = event.phase
                    yield event
                    continue
                last_phase = "decode"
                yield event
                if event.finished:
                    return
        finally:
            for sub in subs:
                await sub.unsubscribe()
