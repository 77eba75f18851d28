"""WebSocket ``/ws``: start or attach to a generation and follow it live.

Client -> server (JSON text frames):
  {"type": "generate", "prompt": "..." | "messages": [...], "max_tokens", "temperature", "top_p", "top_k",
   "seed", "stop", "logprobs", "ignore_eos", "model", "speculative"}   (one generation at a time per socket)
  {"type": "attach", "session_id": "..."}               follow an existing session
  {"type": "coverage"}                                   the swarm's coverage and routable models
Server -> client:
  {"type": "telemetry", ...GenerationTelemetry}          queued, loading, prefill progress, decode tok/s
  {"type": "token", ...TokenDelta}
  {"type": "done", "session_id", "finish_reason", "text", "usage", "nodes", "telemetry"}
  {"type": "error", "request", "reason", "message", "phase", "node_id", "session_id", "status", "error_type", "code", "param"}
      (request: the message type it answers; for generate/attach it is the final message)
  {"type": "coverage", "models": [...], "report": CoverageReport}
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing

import msgspec
from aiohttp import WSMsgType, web

from neuron_bus import messages as M
from neuron_bus.client import RouteError
from neuron_bus.gateway.access import ACCESS
from neuron_bus.gateway.bus import Bus, Tally, routable, route_api_error, route_error_body
from neuron_bus.gateway.openai_api import BUS
from neuron_bus.gateway.validation import ApiError, ws_request


async def websocket(request: web.Request) -> web.WebSocketResponse:
    # "bearer": a browser offers its API key as the subprotocols "bearer, <key>" (access.py); the
    # server answers with "bearer" alone
    ws = web.WebSocketResponse(heartbeat=30, protocols=("bearer",))
    await ws.prepare(request)
    access = request.app[ACCESS]
    key = request.get("api_key")
    await Socket(ws, request.app[BUS], (lambda: access.admit(key)) if key is not None else None).serve()
    return ws


class Socket:
    """One WebSocket client: at most one generation (or attachment) at a time."""

    def __init__(self, ws: web.WebSocketResponse, bus: Bus, admit=None):
        self.ws = ws
        self.bus = bus
        self.admit = admit  # with API keys: counts a generate/attach against the key's rate (429 past it)

    async def serve(self) -> None:
        task: asyncio.Task | None = None
        try:
            async for msg in self.ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                try:
                    data = json.loads(msg.data)
                    kind = data.get("type") if isinstance(data, dict) else None
                except ValueError as exc:
                    await self.error(ApiError(400, f"not JSON: {exc}", code="invalid_json"))
                    continue
                if kind == "coverage":
                    await self.guard(self.coverage(), "coverage")
                elif kind in ("generate", "attach"):
                    if task and not task.done():
                        await self.error(ApiError(409, "a generation is already running on this socket", code="busy"))
                        continue
                    self.bus.metrics.requests.labels(f"/ws {kind}").inc()
                    try:
                        if self.admit:
                            self.admit()
                    except ApiError as exc:
                        await self.error(exc, kind)
                        continue
                    run = self.generate(data) if kind == "generate" else self.attach(data)
                    task = asyncio.create_task(self.guard(run, kind))
                else:
                    await self.error(
                        ApiError(400, f"unknown message type {kind!r}", param="type", code="invalid_value")
                    )
        except ConnectionResetError:
            pass  # the client left while its last message was answered
        finally:
            if task and not task.done():
                task.cancel()  # the client left: closing the generation closes its route session
                await asyncio.gather(task, return_exceptions=True)

    async def guard(self, coro, request: str) -> None:
        """Run one request; a refused request becomes an error message, never a closed socket."""
        try:
            try:
                await coro
            except ApiError as exc:
                await self.error(exc, request)
        except ConnectionResetError:
            pass  # the client left

    async def error(self, exc: ApiError, request: str | None = None) -> None:
        self.bus.metrics.errors.labels("/ws", str(exc.status)).inc()
        await self.send(self._error_message(exc.body()["error"], request, exc.status, phase="queued", reason=exc.code))

    @staticmethod
    def _error_message(body: dict, request: str | None, status: int, **defaults) -> dict:
        """An error body (OpenAI shape, plus phase/node/reason) as a final WebSocket message."""
        msg = {"node_id": None, "session_id": None, **defaults, **body}
        return {**msg, "type": "error", "error_type": body["type"], "request": request, "status": status}

    async def send(self, obj: dict) -> None:
        """Send ``obj``; raises ConnectionResetError once the client has left, so a generation it
        followed is closed at its next event. The serving loop cancels the generation when the
        client leaves, but that cancellation can be lost (most likely in Python 3.11's
        asyncio.wait_for, which nats-py's requests use: it returns a result that arrives together
        with a cancellation and drops the cancellation): 1 in 6 to 1 in 12 such generations ran to
        their end."""
        if self.ws.closed:
            raise ConnectionResetError("the WebSocket client left")
        await self.ws.send_str(json.dumps(obj))

    async def follow(self, events, tally: Tally) -> None:
        try:
            async with aclosing(events):
                async for event in events:
                    tally.add(event)
                    kind = "telemetry" if isinstance(event, M.GenerationTelemetry) else "token"
                    await self.send({"type": kind, **msgspec.to_builtins(event)})
        except RouteError as exc:  # the final word of a failed route: reason, phase, node
            status = route_api_error(exc).status  # 429 (queue full), 503 (not now) or 502 (a node failed)
            self.bus.metrics.errors.labels("/ws", str(status)).inc()
            await self.send(self._error_message(route_error_body(exc, tally.session_id), "generate", status))
            return
        await self.send(
            {
                "type": "done",
                "session_id": tally.session_id,
                "finish_reason": tally.finish_reason,
                "text": tally.text,
                "usage": tally.usage(),
                "nodes": tally.telemetry.active_route_nodes if tally.telemetry else [],
                "telemetry": msgspec.to_builtins(tally.telemetry) if tally.telemetry else None,
            }
        )

    async def generate(self, data: dict) -> None:
        prepared = await self.bus.prepare(ws_request(data, self.bus.limits))
        await self.follow(self.bus.stream(prepared), Tally(len(prepared.prompt_tokens)))

    async def attach(self, data: dict) -> None:
        session_id = data.get("session_id")
        if not isinstance(session_id, str):
            raise ApiError(
                400, "missing required parameter 'session_id'", param="session_id", code="missing_required_parameter"
            )
        tally = Tally(0, session_id=session_id)
        await self.follow(self.bus.attach(session_id), tally)

    async def coverage(self) -> None:
        report = await self.bus.coverage()
        await self.send({"type": "coverage", "models": routable(report), "report": msgspec.to_builtins(report)})
