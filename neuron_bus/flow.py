"""Publishing into JetStream with backpressure.

Prefill subjects hold at most a window of messages (the stream's per-subject limit with
discard-new). A publish into a full subject is refused by the server; the sender waits and
retries, holding its own input un-acknowledged, so a slow hop stalls its upstream hop by hop
back to the sender of the prompt, and no buffer anywhere grows past the window.
"""

from __future__ import annotations

import asyncio
import time

from nats.errors import ConnectionReconnectingError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from neuron_bus import timing
from neuron_bus.errors import NeuronBusError
from workers.errors import Reason


def _is_full(exc: APIError) -> bool:
    text = f"{exc.description or ''}".lower()
    return (
        "maximum messages per subject" in text or "maximum messages exceeded" in text or exc.err_code in (10077, 10078)
    )


async def publish(
    js: JetStreamContext,
    subject: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    *,
    max_wait: float | None = None,
    on_wait=None,
) -> int:
    """Publish and wait for the stream's acknowledgement; retry while the subject is full.

    Returns how many times the publish had to wait. ``on_wait(n)`` is called on each wait (it may
    raise to stop waiting: a hop's output whose session is gone). A full subject is retried for
    ``max_wait`` or by default `timing.BUSY_WAIT_S`, as its next hop may be busy with older
    sessions' inputs. Transient failures of a clustered bus (a server died, a stream leader is being
    elected, the connection moves to a surviving server) are retried for ``max_wait`` or by default
    `timing.PUBLISH_WAIT_S`.
    """
    waits = 0
    delay = 0.002
    started = time.monotonic()
    while True:
        try:
            await js.publish(subject, body, headers=headers)
            return waits
        except (
            TimeoutError,
            APIError,
            NoStreamResponseError,
            NatsTimeout,
            NoRespondersError,
            ConnectionReconnectingError,
        ) as exc:
            full = isinstance(exc, APIError) and _is_full(exc)  # the server answers a full subject with 503
            if not full and isinstance(exc, APIError) and not isinstance(exc, ServiceUnavailableError):
                raise
            limit = max_wait if max_wait is not None else timing.BUSY_WAIT_S if full else timing.PUBLISH_WAIT_S
            if time.monotonic() - started > limit:
                what = f"{subject} stayed full" if full else f"{subject}: no stream answered"
                raise NeuronBusError(
                    Reason.BACKPRESSURE_TIMEOUT if full else Reason.BUS_UNREACHABLE, f"{what} for {limit:.0f}s"
                ) from exc
            waits += 1
            if on_wait:
                on_wait(waits)
            await asyncio.sleep(delay if full else 0.1)
            if full:
                delay = min(delay * 2, 0.1)
