"""The Python client: ask the tracker for a route, open a session on every hop, stream the
prompt in chunks, and yield telemetry and token deltas until the tail says it is finished.

    async with await NeuronClient.connect("nats://127.0.0.1:4222") as client:
        async for event in client.generate(prompt="Hello", sampling=SamplingParams(max_tokens=16)):
            if isinstance(event, TokenDelta):
                print(event.text, end="")

The client is only in the loop for the prompt: decode runs as a ring (tail -> hop 0) without it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.admission import DEFAULT_LIMIT as DEFAULT_QUEUE_LIMIT
from neuron_bus.admission import Admission
from neuron_bus.errors import MalformedMessage, RouteError
from neuron_bus.generation import PREFILL_RETRIES, GenerationRun, retryable
from neuron_bus.models import DEFAULT_PRESET
from neuron_bus.suspects import Suspects
from neuron_bus.timing import AVOID_LOST_S
from neuron_bus.topology import connect, owner_of
from workers.errors import Reason

log = logging.getLogger("neuron_bus.client")


@dataclass
class Prepared:
    """A route for a model, and the prompt's token ids as the route's head tokenized them."""

    route: M.RouteAssignment
    prompt_tokens: list[int]


@dataclass
class Generation:
    """What one finished generation produced."""

    session_id: str
    route: M.RouteAssignment
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    ttft_s: float
    elapsed_s: float


CONTROL_TIMEOUT_S = 30.0
ENCRYPT_ENV = "NEURON_ENCRYPT_ACTIVATIONS"
TRACKER_WAIT_S = 15.0  # a tracker that is restarting (`up` restarts it within seconds): new requests wait this long
TRACKER_RETRY_S = 0.5


class NeuronClient:
    """``authenticate``: give every session fresh link keys (MACs on every activation, proofs for
    close and resume; trust/sealing.py); ``encrypt_activations``: seal activation bodies and
    snapshots too (AEAD). The client's sessions are owned by its credential's name (`owner`).
    ``tracker_wait``: how long a route or coverage request waits for a tracker to answer."""

    def __init__(
        self,
        nc,
        url: str = "",
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
        tracker_wait: float = TRACKER_WAIT_S,
        *,
        authenticate: bool = True,
        encrypt_activations: bool = False,
    ):
        self.nc = nc
        self.js = nc.jetstream()
        self.url = url
        self.admission = Admission(queue_limit)  # generations waiting for a free session slot
        self.owner = owner_of(nc)
        self.authenticate = authenticate or encrypt_activations
        self.encrypt_activations = encrypt_activations
        self.tracker_wait = tracker_wait
        self.suspects = Suspects()  # nodes that answered nonsense: routed around for a while

    @classmethod
    async def connect(
        cls,
        url: str,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
        creds: str | None = None,
        tracker_wait: float = TRACKER_WAIT_S,
        **security,
    ) -> NeuronClient:
        """``security``: ``authenticate``, ``encrypt_activations`` (None or left out: env
        ``NEURON_ENCRYPT_ACTIVATIONS=1``; ``generate`` and ``gateway --encrypt-activations`` pass True)."""
        if security.get("encrypt_activations") is None:
            security["encrypt_activations"] = os.environ.get(ENCRYPT_ENV, "") == "1"
        nc = await connect(url, name="neuron-bus-client", creds=creds)
        return cls(nc, url, queue_limit, tracker_wait, **security)

    async def close(self) -> None:
        await self.nc.drain()

    async def __aenter__(self) -> NeuronClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ requests

    async def ask(self, subject: str, req, timeout: float, unanswered: str, reason: Reason, node_id: str | None = None):
        """One request/reply. When nothing answers, the error names the part that failed: the bus
        itself when this client has lost its NATS connection, else the responder (``unanswered``)."""
        if not self.nc.is_connected:
            raise self.bus_down()
        try:
            return await self.nc.request(subject, M.encode(req), timeout=timeout)
        except Exception as exc:  # timeout or no responders
            if not self.nc.is_connected:
                raise self.bus_down() from None
            raise RouteError(reason, f"{unanswered}: {type(exc).__name__}", node_id=node_id) from None

    @staticmethod
    def reply(msg, kind, who: str, node_id: str | None = None):
        """A reply decoded as ``kind``; one that is not (a responder that answers garbage) is a
        RouteError ``bad_reply`` naming who answered, never an unexplained crash."""
        try:
            return M.decode(msg.data, kind)
        except MalformedMessage as exc:
            raise RouteError(
                Reason.BAD_REPLY, f"{who} answered with a malformed reply: {exc}", node_id=node_id
            ) from None

    def bus_down(self) -> RouteError:
        where = f" at {self.url}" if self.url else ""
        return RouteError(
            Reason.BUS_UNREACHABLE,
            f"the bus is unreachable: no connection to the NATS server{where} (is nats-server running?)",
        )

    async def control(self, node_id: str, req, timeout: float = CONTROL_TIMEOUT_S):
        msg = await self.ask(
            S.node_control(node_id), req, timeout, f"node {node_id} did not answer", Reason.NODE_UNREACHABLE, node_id
        )
        try:
            reply = self.reply(msg, M.ControlReply, f"node {node_id}", node_id)
            answer = M.CONTROL_ANSWERS[type(req)]
            if not isinstance(reply, (answer, M.ControlError)):
                raise RouteError(
                    Reason.BAD_REPLY,
                    f"node {node_id} answered {type(req).__name__} with {type(reply).__name__}, not {answer.__name__}",
                    node_id=node_id,
                )
        except RouteError as exc:
            if self.suspects.add(node_id):
                log.warning("%s; routes avoid it for %.0f s", exc, self.suspects.keep_s)
            raise
        if isinstance(reply, M.ControlError):
            raise RouteError(Reason.of(reply.code), f"{node_id}: {reply.message}", node_id=node_id)
        return reply

    async def tell(self, node_id: str, req) -> None:
        """A control request that asks for no reply (for a node that may never answer again)."""
        await self.nc.publish(S.node_control(node_id), M.encode(req))

    async def ask_tracker(self, subject: str, req, timeout: float, wait: float | None = None):
        """A request to the tracker. While none answers (it is restarting: no responders, or no
        reply within ``timeout``) ask again for up to ``wait`` seconds (default ``tracker_wait``),
        then fail with ``no_tracker``, saying for how long."""
        wait = self.tracker_wait if wait is None else wait
        deadline = time.monotonic() + wait
        while True:
            try:
                return await self.ask(subject, req, timeout, f"no tracker answered on {subject}", Reason.NO_TRACKER)
            except RouteError as exc:
                if exc.reason != Reason.NO_TRACKER:
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    if wait <= 0:
                        raise
                    raise RouteError(
                        Reason.NO_TRACKER,
                        f"no tracker answered on {subject} for {wait:.0f}s (is `neuron-bus tracker` running?)",
                    ) from None
            await asyncio.sleep(min(TRACKER_RETRY_S, left))

    async def coverage(
        self, model_preset: str | None = None, timeout: float = CONTROL_TIMEOUT_S, wait: float | None = None
    ) -> M.CoverageReport:
        """The tracker's coverage map (every model, or one); ``wait``: see `ask_tracker`."""
        req = M.CoverageRequest(model_preset=model_preset)
        msg = await self.ask_tracker(S.TRACKER_COVERAGE, req, timeout, wait)
        reply = self.reply(msg, M.CoverageReport | M.ControlError, f"the tracker on {S.TRACKER_COVERAGE}")
        if isinstance(reply, M.ControlError):
            raise RouteError(Reason.of(reply.code), reply.message)
        return reply

    async def prepare(
        self,
        model_preset: str = DEFAULT_PRESET,
        *,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        prompt_tokens: list[int] | None = None,
        route: M.RouteAssignment | None = None,
        policy: str = "public",
        wire_dtype: M.WireDtype = "f32",
        encoding: M.Encoding = "raw",
        avoid: set[str] | frozenset[str] = frozenset(),
        check_tokens: bool = False,
    ) -> Prepared:
        """A route (``route``, or one from the tracker avoiding the nodes in ``avoid``) and the
        prompt's tokens: ``prompt_tokens`` as given (``check_tokens``: checked by the head against
        its vocabulary first), else ``prompt`` or ``messages`` tokenized by the route's head (which
        applies the model's chat template to messages). A head of the tracker's route that fails
        to answer (gone, draining, a reply of another kind) is avoided on a new route, as often as
        a generation retries a failed route (``PREFILL_RETRIES``)."""
        avoid, retries = set(avoid), 0
        while True:
            chosen = route or await self.route(model_preset, wire_dtype, encoding, policy=policy, avoid=avoid)
            try:
                return Prepared(
                    chosen, await self._prompt_tokens(chosen, prompt, messages, prompt_tokens, check_tokens)
                )
            except RouteError as exc:
                if route is not None or exc.node_id is None or not retryable(exc) or retries >= PREFILL_RETRIES:
                    raise
                retries += 1
                avoid.add(exc.node_id)

    async def _prompt_tokens(
        self,
        route: M.RouteAssignment,
        prompt: str | None,
        messages: list[dict[str, str]] | None,
        prompt_tokens: list[int] | None,
        check_tokens: bool,
    ) -> list[int]:
        """The prompt's tokens: tokenized by the route's head, or as given (checked there: see prepare)."""
        head = route.hops[0].node_id
        if prompt_tokens is None:
            prompt_tokens = (await self.control(head, M.TokenizeRequest(text=prompt, messages=messages))).tokens
        elif check_tokens and prompt_tokens:  # ids from an untrusted caller: the head checks them (bad_input)
            await self.control(head, M.TokenizeRequest(tokens=list(prompt_tokens)))
        if not prompt_tokens:
            raise RouteError(Reason.EMPTY_PROMPT, "the prompt has no tokens")
        return list(prompt_tokens)

    async def route(
        self,
        model_preset: str = DEFAULT_PRESET,
        wire_dtype: M.WireDtype = "f32",
        encoding: M.Encoding = "raw",
        avoid: set[str] | frozenset[str] = frozenset(),
        **pins,
    ) -> M.RouteAssignment:
        """A route from the tracker, which plans around the nodes in ``avoid`` and this client's
        suspects (suspects.py) while others cover their layers. One through a node in ``avoid``
        (nothing else covers its layers, and a lost node may still be listed for a few seconds) is
        asked again until the tracker has expired them, then taken (a lost node that came back)."""
        deadline = time.monotonic() + AVOID_LOST_S
        while True:
            around = sorted(avoid | self.suspects.current())
            route = await self._route(model_preset, wire_dtype, encoding, avoid=around, **pins)
            if not avoid & {h.node_id for h in route.hops} or time.monotonic() > deadline:
                return route
            await asyncio.sleep(0.5)

    async def _route(
        self, model_preset: str, wire_dtype: M.WireDtype, encoding: M.Encoding, avoid: list[str], **pins
    ) -> M.RouteAssignment:
        req = M.RouteRequest(
            request_id=uuid.uuid4().hex,
            model_preset=model_preset,
            wire_dtype=wire_dtype,
            encoding=encoding,
            avoid=avoid,
            **pins,
        )
        msg = await self.ask_tracker(S.ROUTE_REQUEST, req, CONTROL_TIMEOUT_S)
        reply = self.reply(msg, M.RouteReply, f"the tracker on {S.ROUTE_REQUEST}")
        if isinstance(reply, M.RouteRejection):
            raise RouteError(Reason.of(reply.code), "no route: " + "; ".join(reply.reasons))
        return reply

    async def sessions(self, node_id: str) -> M.SessionsReport:
        return await self.control(node_id, M.SessionsQuery())

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        prompt_tokens: list[int] | None = None,
        sampling: M.SamplingParams | None = None,
        model_preset: str = DEFAULT_PRESET,
        wire_dtype: M.WireDtype = "f32",
        encoding: M.Encoding = "raw",
        chunk_size: int = 256,
        route: M.RouteAssignment | None = None,
        prefill_retries: int = PREFILL_RETRIES,
        repair: bool = True,
        policy: str = "public",
        speculative: int = 0,
        prefix_reuse: bool = True,
        on_route: Callable[[M.RouteAssignment], None] | None = None,
    ) -> AsyncGenerator[M.TokenDelta | M.GenerationTelemetry, None]:
        """Yield telemetry and token deltas; raise RouteError on a failed route.

        A route that fails before the first token is retried from scratch on a new route
        (``prefill_retries`` times); a hop lost during decode is replaced when a compatible
        replacement and snapshot exist (``repair``, see repair.py), otherwise the session fails.
        ``policy`` (public, private, paid-trusted) is asked of the tracker for every route it plans.
        ``speculative`` k > 0: decode steps carry up to k draft tokens that every hop checks in one
        call (the output is plain decoding's, greedy or seeded; see worker/drafting.py).
        ``prefix_reuse``: the hops attach the KV of a prompt prefix a finished session left them
        (neuron_bus/prefix.py) and compute only the rest; off: the whole prompt is computed.
        ``on_route`` is told every route the session runs on: ``route`` (or the tracker's), then
        the new one of a retry or a repair; the last one told is where the tokens came from.
        """
        run = GenerationRun(
            self,
            sampling=sampling or M.SamplingParams(),
            model_preset=model_preset,
            wire_dtype=wire_dtype,
            encoding=encoding,
            chunk_size=chunk_size,
            policy=policy,
            route=route,
            prompt=prompt,
            messages=messages,
            prompt_tokens=prompt_tokens,
            prefill_retries=prefill_retries,
            repair=repair,
            speculative=speculative,
            prefix_reuse=prefix_reuse,
            on_route=on_route,
        )
        async with aclosing(run.events()) as events:  # a caller that stops early closes the session at once
            async for event in events:
                yield event

    async def complete(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        model_preset: str = DEFAULT_PRESET,
        wire_dtype: M.WireDtype = "f32",
        encoding: M.Encoding = "raw",
        route: M.RouteAssignment | None = None,
        **kwargs,
    ) -> Generation:
        """Run a generation to its end and collect it."""
        start = time.monotonic()
        prepared = await self.prepare(
            model_preset,
            prompt=prompt,
            messages=messages,
            prompt_tokens=kwargs.pop("prompt_tokens", None),
            route=route,
            policy=kwargs.get("policy", "public"),
            wire_dtype=wire_dtype,
            encoding=encoding,
        )
        routes, prompt_ids = [prepared.route], prepared.prompt_tokens
        first = None
        session_id = ""
        tokens, logprobs, tops, text = [], [], [], []
        finish = None
        gen = self.generate(
            prompt_tokens=prompt_ids, route=routes[0], model_preset=model_preset, on_route=routes.append, **kwargs
        )
        async for ev in gen:
            session_id = ev.session_id
            if isinstance(ev, M.TokenDelta):
                first = first or time.monotonic()
                tokens.append(ev.token_id)
                logprobs.append(ev.logprob)
                tops.append(ev.top_logprobs)
                text.append(ev.text)
                finish = ev.finish_reason
        now = time.monotonic()
        return Generation(
            session_id=session_id,
            route=routes[-1],  # the one the tokens came from
            prompt_tokens=list(prompt_ids),
            tokens=tokens,
            text="".join(text),
            finish_reason=finish,
            logprobs=logprobs,
            top_logprobs=tops,
            ttft_s=(first or now) - start,
            elapsed_s=now - start,
        )
