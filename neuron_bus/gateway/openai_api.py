"""OpenAI-compatible endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

Streaming answers are server-sent events (``data: {...}``, ending ``data: [DONE]``); telemetry
rides along as SSE comments (``: telemetry {...}``), which OpenAI clients ignore. A route that
fails mid-stream ends the stream with ``data: {"error": {...}}`` naming the reason, the phase and
the node (OpenAI clients raise it), then ``data: [DONE]``. A stream's status is sent only once the
session is open on every hop, so a route that cannot start (every KV slot in use, no route, the
bus down) is an HTTP error like a non-streaming request's: 503 with Retry-After for the swarm's
own limits, 502 for a node's fault (bus.route_api_error).
"""

from __future__ import annotations

import json
import time
from contextlib import aclosing

from aiohttp import web

from neuron_bus import messages as M
from neuron_bus.client import RouteError
from neuron_bus.gateway.bus import Bus, Prepared, Tally, route_api_error, route_error_body
from neuron_bus.gateway.validation import GenRequest, chat_request, completion_request, parse_json, read_body

BUS = web.AppKey("bus", Bus)


async def list_models(request: web.Request) -> web.Response:
    bus = request.app[BUS]
    created = int(time.time())
    data = [{"id": m, "object": "model", "created": created, "owned_by": "neuron-bus"} for m in await bus.models()]
    return web.json_response({"object": "list", "data": data})


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    bus = request.app[BUS]
    body = parse_json(await read_body(request, bus.limits))
    req = (chat_request if chat else completion_request)(body, bus.limits)
    prepared = await bus.prepare(req)
    shape = Shape(prepared, chat)
    if req.stream:
        return await _stream(request, bus, prepared, shape)
    tally = Tally(len(prepared.prompt_tokens))
    try:
        async with aclosing(bus.stream(prepared)) as events:
            async for event in events:
                tally.add(event)
    except RouteError as exc:
        raise route_api_error(exc, tally.session_id) from None
    return web.json_response(shape.whole(tally))


async def _stream(request: web.Request, bus: Bus, prepared: Prepared, shape: Shape) -> web.StreamResponse:
    async with aclosing(bus.stream(prepared)) as events:  # a client that hangs up closes the session
        try:  # the first event comes once every hop holds the session: until then, errors are HTTP errors
            opened = await anext(events, None)
        except RouteError as exc:
            raise route_api_error(exc) from None
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await resp.prepare(request)
        await _relay(resp, prepared, shape, opened, events)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _relay(resp: web.StreamResponse, prepared: Prepared, shape: Shape, opened, events) -> None:
    """Write the session's events as SSE chunks, ``opened`` first; a route failure is the last chunk."""

    async def send(obj) -> None:
        await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    tally = Tally(len(prepared.prompt_tokens))
    event, first = opened, True
    try:
        while event is not None:
            tally.add(event)
            if isinstance(event, M.GenerationTelemetry):
                await resp.write(b": telemetry " + M.encode(event) + b"\n\n")
            else:
                if first:
                    shape.session_id = event.session_id
                    if shape.chat:
                        await send(shape.chunk({"role": "assistant", "content": ""}, None, None))
                    first = False
                await send(shape.chunk(event.text, shape.logprobs([event]), event.finish_reason))
            event = await anext(events, None)
        if prepared.req.include_usage:
            await send({**shape.head("chunk"), "choices": [], "usage": tally.usage()})
    except RouteError as exc:
        await send({"error": route_error_body(exc, tally.session_id)})


class Shape:
    """OpenAI response objects for one generation: chat or text completion, whole or chunked."""

    def __init__(self, prepared: Prepared, chat: bool):
        self.req: GenRequest = prepared.req
        self.chat = chat
        self.prepared = prepared  # its route: the one the tokens came from, once they came
        self.session_id = ""
        self.created = int(time.time())

    def head(self, kind: str) -> dict:
        obj = {"chat": "chat.completion", "chunk": "chat.completion.chunk"}[kind] if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {
            "id": prefix + self.session_id,
            "object": obj,
            "created": self.created,
            "model": self.req.model,
            "system_fingerprint": self.prepared.route.model_revision,
        }

    def chunk(self, delta, logprobs, finish_reason) -> dict:
        if self.chat:
            content = delta if isinstance(delta, dict) else ({"content": delta} if delta or not finish_reason else {})
            choice = {"index": 0, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self.head("chunk"), "choices": [choice]}

    def whole(self, tally: Tally) -> dict:
        self.session_id = tally.session_id
        logprobs = self.logprobs(tally.deltas)
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": tally.text},
                "logprobs": logprobs,
                "finish_reason": tally.finish_reason,
            }
        else:
            choice = {"index": 0, "text": tally.text, "logprobs": logprobs, "finish_reason": tally.finish_reason}
        route = {
            "route_id": self.prepared.route.route_id,
            "nodes": [h.node_id for h in self.prepared.route.hops],
            "session_id": tally.session_id,
        }
        return {**self.head("chat"), "choices": [choice], "usage": tally.usage(), "neuron_route": route}

    def logprobs(self, deltas: list[M.TokenDelta]) -> dict | None:
        if not self.req.sampling.logprobs:
            return None
        n = self.req.top_logprobs
        if self.chat:
            return {
                "content": [
                    {
                        "token": d.text,
                        "logprob": d.logprob,
                        "bytes": list(d.text.encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in _top(d, n)
                        ],
                    }
                    for d in deltas
                ]
            }
        offsets, at = [], 0
        for d in deltas:
            offsets.append(at)
            at += len(d.text)
        return {
            "tokens": [d.text for d in deltas],
            "token_logprobs": [d.logprob for d in deltas],
            "top_logprobs": [dict(_top(d, n)) for d in deltas],
            "text_offset": offsets,
        }


def _top(delta: M.TokenDelta, n: int) -> list[tuple[str, float]]:
    return sorted((delta.top_logprobs or {}).items(), key=lambda kv: -kv[1])[:n]
