"""The gateway's aiohttp application: routes, OpenAI-style errors for every failure, and serving.

GET  /                      the web page (static/index.html, talks to /ws)
GET  /ws                    WebSocket: generate, attach, coverage (ws.py)
GET  /v1/models             POST /v1/completions   POST /v1/chat/completions   (openai_api.py)
GET  /metrics               Prometheus (own registry)
GET  /healthz               NATS connected, tracker answering

With ``--api-keys FILE`` every ``/v1/*`` and ``/ws`` request needs a valid key and is rate limited
per key (access.py). A request body must arrive within ``Limits.body_timeout_s`` (408 otherwise:
a client sending a byte a second holds nothing but its own connection), and a client that hangs
up cancels its handler, which closes its generation on every hop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from importlib import resources
from pathlib import Path

from aiohttp import web

from neuron_bus.client import NeuronClient
from neuron_bus.gateway import openai_api
from neuron_bus.gateway.access import ACCESS, Access, require_key
from neuron_bus.gateway.bus import DEFAULT_CHUNK, Bus
from neuron_bus.gateway.metrics import GatewayMetrics
from neuron_bus.gateway.openai_api import BUS
from neuron_bus.gateway.validation import ApiError, Limits
from neuron_bus.gateway.ws import websocket

log = logging.getLogger("neuron_bus.gateway")

PAGE = resources.files("neuron_bus.gateway").joinpath("static/index.html")


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    """Count every request; answer every failure with an OpenAI-style error body."""
    metrics = request.app[BUS].metrics
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    metrics.requests.labels(endpoint).inc()
    try:
        resp = await handler(request)
    except ApiError as exc:
        resp = exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        resp = ApiError(exc.status, exc.text or exc.reason, type=kind, code=code).response()
    except Exception as exc:  # a bug: say so, keep serving
        log.exception("gateway: %s %s failed", request.method, request.path)
        resp = ApiError(
            500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal_error"
        ).response()
    if resp.status >= 400:
        metrics.errors.labels(endpoint, str(resp.status)).inc()
    return resp


async def page(request: web.Request) -> web.Response:
    return web.Response(text=PAGE.read_text(encoding="utf-8"), content_type="text/html")


async def healthz(request: web.Request) -> web.Response:
    health = await request.app[BUS].health()
    return web.json_response(health, status=200 if health["status"] == "ok" else 503)


async def metrics(request: web.Request) -> web.Response:
    m = request.app[BUS].metrics
    return web.Response(body=m.render(), headers={"Content-Type": m.content_type})


def create_app(
    client: NeuronClient, limits: Limits = Limits(), chunk_size: int = DEFAULT_CHUNK, api_keys: Path | None = None
) -> web.Application:
    app = web.Application(middlewares=[errors, require_key], client_max_size=limits.max_body_bytes)
    counters = GatewayMetrics()
    app[BUS] = Bus(client, limits, counters, chunk_size)
    app[ACCESS] = Access(api_keys, counters)  # ValueError for a bad keys file
    app.router.add_get("/", page)
    app.router.add_get("/ws", websocket)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", openai_api.list_models)
    app.router.add_post("/v1/completions", openai_api.completions)
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions)
    return app


async def serve(
    nats_url: str,
    host: str,
    port: int,
    limits: Limits = Limits(),
    chunk_size: int = DEFAULT_CHUNK,
    on_ready=None,
    api_keys: Path | None = None,
    tracker_wait: float = 10.0,
    encrypt_activations: bool | None = None,
) -> None:
    """Connect to the bus, serve HTTP until SIGINT/SIGTERM, then stop cleanly (the CLI has read the
    keys file once already: a bad one fails before anything connects)."""
    client = await NeuronClient.connect(
        nats_url, queue_limit=limits.max_queue, tracker_wait=tracker_wait, encrypt_activations=encrypt_activations
    )
    app = create_app(client, limits, chunk_size, api_keys)
    # handler_cancellation: a client that hangs up cancels its handler, and with it its generation
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        if on_ready:
            on_ready(f"http://{host}:{port}")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
        await client.close()
