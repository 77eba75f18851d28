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
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from neuron_bus import codec
from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.errors import NeuronBusError
from neuron_bus.flow import publish
from neuron_bus.models import DEFAULT_PRESET
from neuron_bus.repair import repair as repair_route
from neuron_bus.routes import hop_header
from neuron_bus.telemetry import GenerationProgress
from neuron_bus.topology import connect


class RouteError(NeuronBusError):
    """A generation that could not run or did not finish: carries the phase, node and reason."""

    def __init__(self, reason: str, message: str, phase: str = "queued", node_id: str | None = None):
        super().__init__(reason, message)
        self.phase = phase
        self.node_id = node_id


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
STALL_TIMEOUT_S = 60.0  # no token, telemetry or error for this long: the route is considered dead
PREFILL_RETRIES = 1  # a route failing before the first token is retried from scratch this often
MAX_REPAIRS = 2  # dead hops replaced in one generation (needs snapshots: see repair.py)
AVOID_LOST_S = 8.0  # how long a new route must avoid the nodes that were lost (the tracker expires them)
RETRYABLE = {"node_lost", "node_unreachable", "prefill_failed", "stalled", "backend_error", "route_failed", "unknown_session"}
HEARTBEAT_LOSS_S = 3.0  # a route node silent this long (workers heartbeat every second) is lost
LIVENESS_CHECK_S = 0.5


class NeuronClient:
    def __init__(self, nc):
        self.nc = nc
        self.js = nc.jetstream()

    @classmethod
    async def connect(cls, url: str) -> "NeuronClient":
        return cls(await connect(url, name="neuron-bus-client"))

    async def close(self) -> None:
        await self.nc.drain()

    async def __aenter__(self) -> "NeuronClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ requests

    async def control(self, node_id: str, req, timeout: float = CONTROL_TIMEOUT_S):
        try:
            msg = await self.nc.request(S.node_control(node_id), M.encode(req), timeout=timeout)
        except Exception as exc:  # timeout or no responders: the node is gone
            raise RouteError("node_unreachable", f"node {node_id} did not answer: {type(exc).__name__}", node_id=node_id) from None
        reply = M.decode(msg.data, M.ControlReply)
        if isinstance(reply, M.ControlError):
            raise RouteError(reply.code, f"{node_id}: {reply.message}", node_id=node_id)
        return reply

    async def coverage(self, model_preset: str | None = None, timeout: float = CONTROL_TIMEOUT_S) -> M.CoverageReport:
        """The tracker's coverage map (every model, or one)."""
        try:
            msg = await self.nc.request(S.TRACKER_COVERAGE, M.encode(M.CoverageRequest(model_preset=model_preset)), timeout=timeout)
        except Exception as exc:
            raise RouteError("no_tracker", f"no tracker answered on {S.TRACKER_COVERAGE}: {type(exc).__name__}") from None
        reply = M.decode(msg.data, M.CoverageReport | M.ControlError)
        if isinstance(reply, M.ControlError):
            raise RouteError(reply.code, reply.message)
        return reply

    async def route(self, model_preset: str = DEFAULT_PRESET, wire_dtype: str = "f32", encoding: str = "raw", **pins) -> M.RouteAssignment:
        req = M.RouteRequest(
            request_id=uuid.uuid4().hex, model_preset=model_preset, wire_dtype=wire_dtype, encoding=encoding, **pins
        )
        try:
            msg = await self.nc.request(S.ROUTE_REQUEST, M.encode(req), timeout=CONTROL_TIMEOUT_S)
        except Exception as exc:
            raise RouteError("no_tracker", f"no tracker answered on {S.ROUTE_REQUEST}: {type(exc).__name__}") from None
        reply = M.decode(msg.data, M.RouteReply)
        if isinstance(reply, M.RouteRejection):
            raise RouteError("no_route", "no route: " + "; ".join(reply.reasons))
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
        wire_dtype: str = "f32",
        encoding: str = "raw",
        chunk_size: int = 256,
        route: M.RouteAssignment | None = None,
        prefill_retries: int = PREFILL_RETRIES,
        repair: bool = True,
        policy: str = "public",
    ) -> AsyncIterator[M.TokenDelta | M.GenerationTelemetry]:
        """Yield telemetry and token deltas; raise RouteError on a failed route.

        A route that fails before the first token is retried from scratch on a new route
        (``prefill_retries`` times); a hop lost during decode is replaced when a compatible
        replacement and snapshot exist (``repair``, see repair.py), otherwise the session fails.
        ``policy`` (public, private, paid-trusted) is asked of the tracker for every route it plans.
        """
        sampling = sampling or M.SamplingParams()
        session_id = uuid.uuid4().hex
        events: asyncio.Queue = asyncio.Queue()

        def into_queue(kind: str):
            async def cb(msg) -> None:
                events.put_nowait((kind, msg.data))

            return cb

        subs = [
            await self.nc.subscribe(S.session_tokens(session_id), cb=into_queue("token")),
            await self.nc.subscribe(S.session_error(session_id), cb=into_queue("error")),
            await self.nc.subscribe(S.telemetry(session_id), cb=into_queue("telemetry")),
        ]
        progress = GenerationProgress(session_id, "", model_preset, [], 0)
        opened: list[str] = []
        sender: asyncio.Task | None = None
        watcher: asyncio.Task | None = None
        route_obj = route
        generated: list[int] = []  # token ids received, in order
        lost: set[str] = set()
        retries = repairs = 0
        need_start = True
        try:
            await self._publish_progress(progress)  # comes back through the subscription
            while True:
                try:
                    if need_start:
                        if route_obj is None:
                            route_obj = await self._route_avoiding(lost, model_preset, wire_dtype, encoding, policy)
                        progress.route_id = route_obj.route_id
                        progress.nodes = [h.node_id for h in route_obj.hops]
                        progress.finish("loading")
                        watcher = await self._watch_nodes(progress.nodes, events, subs)
                        await self._publish_progress(progress)  # comes back through the subscription
                        head = route_obj.hops[0].node_id
                        if prompt_tokens is None:
                            tok = await self.control(head, M.TokenizeRequest(text=prompt, messages=messages))
                            prompt_tokens = tok.tokens
                        if not prompt_tokens:
                            raise RouteError("empty_prompt", "the prompt has no tokens")
                        progress.prefill_total = len(prompt_tokens)
                        n_ctx = len(prompt_tokens) + sampling.max_tokens
                        for i, hop in enumerate(route_obj.hops):
                            await self.control(
                                hop.node_id,
                                M.SessionOpen(
                                    session_id=session_id, route=route_obj, hop_index=i, prompt_tokens=len(prompt_tokens),
                                    n_ctx=n_ctx, chunk_size=chunk_size, sampling=sampling,
                                    prompt=list(prompt_tokens) if i == len(route_obj.hops) - 1 else None,  # validation event
                                ),
                            )
                            opened.append(hop.node_id)
                        progress.prefill(0)
                        await self._publish_progress(progress)  # comes back through the subscription
                        sender = asyncio.create_task(self._send_prompt(route_obj, session_id, prompt_tokens, chunk_size))
                        need_start = False
                    async for event in self._events(events, sender, progress):
                        if isinstance(event, M.TokenDelta):
                            if event.index < len(generated):
                                continue  # a repaired route re-sent a token already delivered
                            generated.append(event.token_id)
                        yield event
                        if isinstance(event, M.TokenDelta) and event.finished:
                            return
                except RouteError as exc:
                    if not generated:  # before the first token: retry from scratch on a new route
                        if exc.reason not in RETRYABLE or retries >= prefill_retries:
                            raise
                        retries += 1
                        if exc.node_id:
                            lost.add(exc.node_id)
                        for task in (sender, watcher):
                            if task:
                                task.cancel()
                        await self._close_sessions(session_id, route_obj, opened)
                        opened.clear()
                        while not events.empty():
                            events.get_nowait()
                        route_obj, need_start = None, True
                        continue
                    if not (repair and exc.reason == "node_lost" and exc.node_id and repairs < MAX_REPAIRS):
                        raise
                    repairs += 1
                    lost.add(exc.node_id)
                    spec = M.SessionOpen(
                        session_id=session_id, route=route_obj, hop_index=0, prompt_tokens=len(prompt_tokens),
                        n_ctx=len(prompt_tokens) + sampling.max_tokens, chunk_size=chunk_size, sampling=sampling,
                        prompt=list(prompt_tokens),
                    )
                    try:
                        route_obj, start, node = await repair_route(self, route_obj, exc.node_id, spec, list(generated), repairs, lost)
                    except RouteError as failed:
                        raise RouteError(
                            exc.reason, f"{exc}; route repair failed ({failed.reason}): {failed}", exc.phase, exc.node_id
                        ) from None
                    opened[:] = [n for n in opened if n != exc.node_id] + [node.node_id]
                    watcher.cancel()
                    progress.route_id = route_obj.route_id
                    progress.nodes = [h.node_id for h in route_obj.hops]
                    watcher = await self._watch_nodes(progress.nodes, events, subs)
                    sender = asyncio.create_task(
                        self._send_prompt(route_obj, session_id, prompt_tokens + generated, chunk_size, start=start)
                    )
        except RouteError as exc:
            if exc.phase == "queued":  # raised outside the event loop (route, tokenize, open): the client's phase
                exc.phase = progress.phase
            where = f" at node {exc.node_id}" if exc.node_id else ""
            progress.fail(f"{exc.reason} in phase {exc.phase}{where}: {exc}", exc.phase, exc.node_id)
            await self._publish_progress(progress)
            raise
        finally:
            for task in (sender, watcher):
                if task:
                    task.cancel()
            for sub in subs:
                await sub.unsubscribe()
            await self._close_sessions(session_id, route_obj, opened)

    async def _close_sessions(self, session_id: str, route: M.RouteAssignment | None, nodes: list[str]) -> None:
        for node in nodes:
            try:
                await self.control(node, M.SessionClose(session_id=session_id, route_id=route.route_id), timeout=5)
            except RouteError:
                pass  # the node is gone; its cache went with it

    async def _route_avoiding(
        self, lost: set[str], model_preset: str, wire_dtype: str, encoding: str, policy: str = "public"
    ) -> M.RouteAssignment:
        """A route without the nodes lost so far, while the tracker may still list them (then any)."""
        deadline = time.monotonic() + AVOID_LOST_S
        while True:
            route = await self.route(model_preset, wire_dtype, encoding, policy=policy)
            if not lost & {h.node_id for h in route.hops} or time.monotonic() > deadline:
                return route
            await asyncio.sleep(0.5)

    async def _watch_nodes(self, nodes: list[str], events: asyncio.Queue, subs: list) -> asyncio.Task:
        """Follow the route nodes' heartbeats; queue ("lost", node) when one falls silent."""
        seen = {node: time.monotonic() for node in nodes}

        def beat(node: str):
            async def cb(msg) -> None:
                seen[node] = time.monotonic()

            return cb

        for node in seen:
            subs.append(await self.nc.subscribe(S.node_heartbeat(node), cb=beat(node)))

        async def watch() -> None:
            while True:
                await asyncio.sleep(LIVENESS_CHECK_S)
                now = time.monotonic()
                for node, at in seen.items():
                    if now - at > HEARTBEAT_LOSS_S:
                        events.put_nowait(("lost", (node, now - at)))
                        return

        return asyncio.create_task(watch())

    async def _events(self, events: asyncio.Queue, sender: asyncio.Task, progress: GenerationProgress):
        last_phase = "prefill"
        while True:
            if sender.done() and sender.exception():
                exc = sender.exception()
                raise RouteError("prefill_failed", f"sending the prompt failed: {exc}", phase="prefill")
            try:
                kind, data = await asyncio.wait_for(events.get(), STALL_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise RouteError(
                    "stalled", f"no progress from route {progress.route_id} for {STALL_TIMEOUT_S:.0f}s", phase=last_phase
                ) from None
            if kind == "lost":
                node, silent = data
                raise RouteError(
                    "node_lost", f"node {node} sent no heartbeat for {silent:.1f}s", phase=last_phase, node_id=node
                )
            if kind == "error":
                err = M.decode(data, M.SessionError)
                if err.fatal:
                    raise RouteError(err.code, err.message, phase=err.phase, node_id=err.node_id)
                continue  # a rejected stray message; the session goes on
            if kind == "telemetry":
                t = M.decode(data, M.GenerationTelemetry)
                if t.phase == "failed":
                    raise RouteError(
                        "route_failed", t.failure_reason or "route failed",
                        phase=t.failure_phase or last_phase, node_id=t.failure_node,
                    )
                last_phase = t.phase
                yield t
                continue
            delta = M.decode(data, M.TokenDelta)
            last_phase = "decode"
            yield delta

    async def _send_prompt(
        self, route: M.RouteAssignment, session_id: str, tokens: list[int], chunk_size: int, start: int = 0
    ) -> None:
        """Send positions [start, len(tokens)) to hop 0 in chunks (the prompt, or a repair's replay)."""
        ids = np.asarray(tokens, dtype=np.int32)
        subject = S.hop_input(route.route_id, 0, "prefill")
        for seq, lo in enumerate(range(start, len(ids), chunk_size)):
            chunk = ids[lo : lo + chunk_size]
            header = hop_header(route, 0, session_id, lo, "prefill", seq, "i32")
            headers, body = codec.encode(header, chunk)
            await publish(self.js, subject, body, headers)

    async def _publish_progress(self, progress: GenerationProgress) -> M.GenerationTelemetry:
        snap = progress.snapshot()
        await self.js.publish(progress.subject, M.encode(snap))
        return snap

    async def complete(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        model_preset: str = DEFAULT_PRESET,
        wire_dtype: str = "f32",
        encoding: str = "raw",
        route: M.RouteAssignment | None = None,
        **kwargs,
    ) -> Generation:
        """Run a generation to its end and collect it."""
        start = time.monotonic()
        route = route or await self.route(model_preset, wire_dtype, encoding, policy=kwargs.get("policy", "public"))
        prompt_ids = kwargs.pop("prompt_tokens", None)
        if prompt_ids is None:
            tok = await self.control(route.hops[0].node_id, M.TokenizeRequest(text=prompt, messages=messages))
            prompt_ids = tok.tokens
        first = None
        session_id = ""
        tokens, logprobs, tops, text = [], [], [], []
        finish = None
        async for ev in self.generate(prompt_tokens=prompt_ids, route=route, model_preset=model_preset, **kwargs):
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
            session_id=session_id, route=route, prompt_tokens=list(prompt_ids), tokens=tokens, text="".join(text),
            finish_reason=finish, logprobs=logprobs, top_logprobs=tops,
            ttft_s=(first or now) - start, elapsed_s=now - start,
        )
