"""Publishing into JetStream with backpressure.

Prefill subjects hold at most a window of messages (the stream's per-subject limit with
discard-new). A publish into a full subject is refused by the server; the sender waits and
retries, holding its own input un-acknowledged, so a slow hop stalls its upstream hop by hop
back to the sender of the prompt, and no buffer anywhere grows past the window.
"""

from __future__ import annotations

import asyncio
import time

from nats.js import JetStreamContext
from nats.errors import ConnectionReconnectingError, NoRespondersError, TimeoutError as NatsTimeout
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from neuron_bus.errors import NeuronBusError

MAX_WAIT_S = 120.0


def _is_full(exc: APIError) -> bool:
    text = f"{exc.description or ''}".lower()
    return "maximum messages per subject" in text or "maximum messages exceeded" in text or exc.err_code in (10077, 10078)


async def publish(
    js: JetStreamContext,
    subject: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    *,
    max_wait: float = MAX_WAIT_S,
    on_wait=None,
) -> int:
    """Publish and wait for the stream's acknowledgement; retry while the subject is full.

    Returns how many times the publish had to wait. ``on_wait(n)`` is called on each wait.
    Transient failures of a clustered bus (a server died, a stream leader is being elected, the
    connection moves to a surviving server) are retried the same way within ``max_wait``.
    """
    waits = 0
    delay = 0.002
    deadline = time.monotonic() + max_wait
    while True:
        try:
            await js.publish(subject, body, headers=headers)
            return waits
        except (NatsTimeout, NoRespondersError, NoStreamResponseError, ServiceUnavailableError,
                ConnectionReconnectingError, asyncio.TimeoutError) as exc:
            if time.monotonic() > deadline:
                raise NeuronBusError("bus_unavailable", f"{subject}: no stream answered for {max_wait:.0f}s") from exc
            waits += 1
            await asyncio.sleep(0.1)
            continue
        except APIError as exc:
            if not _is_full(exc):
                raise
            if time.monotonic() > deadline:
                raise NeuronBusError("backpressure_timeout", f"{subject} stayed full for {max_wait:.0f}s") from exc
            waits += 1
            if on_wait:
                on_wait(waits)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
