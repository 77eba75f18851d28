"""The transport's own floor: what one hop costs when it does nothing but relay.

Two Python processes pass one 2304-byte message (a SmolLM2 decode activation) back and forth
through JetStream, exactly the way a hop does: a push consumer with explicit acks on a memory
stream, the output published with its stream acknowledgement awaited, then the input acked.
There is no codec, session check or model call; the p50 time per leg is the least a Python hop on
nats-py can cost on this machine, against which the per-hop overhead of the no-op route compares.
With ``--think-ms T`` each relay first waits T ms on a worker thread, the way a hop's backend
computes, so the processes go idle between messages as in a real route; T is subtracted.

Over emulated links (``--delay-ms D``: each relay reaches the server through its own link of D ms
one way, as in the star topology) the ring shows what the acknowledgement costs a hop, with
``--inflight K`` messages circling at once (K sessions' decode steps) and ``--mode``:

- ``js-await``: publish, await the stream's acknowledgement, ack the input, then take the next
  message (what a hop does today; nats-py runs one subscription's callbacks one at a time);
- ``js-pipelined``: publish and take the next message at once; the input is acked when the
  publish acknowledgement arrives (in the background);
- ``core``: core NATS publish and subscribe, no stream, no acknowledgements.

    scripts/jetstream_floor.py [--legs N] [--think-ms T] [--delay-ms D] [--inflight K] [--mode M]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import nats
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neuron_bus.natsserver import NatsServer, ServerConfig, free_port  # noqa: E402
from neuron_bus.tasks import Background  # noqa: E402

STREAM = "FLOOR"
BODY = b"\0" * 2304
MODES = ("js-await", "js-pipelined", "core")


class Ring(msgspec.Struct, kw_only=True):
    mode: str
    delay_ms: float
    inflight: int
    legs: int
    leg_ms_p50: float  # one message's time from one relay to the other (inflight 1: the latency)
    legs_per_s: float  # legs completed per second by the whole ring (inflight > 1: the throughput)
    cpu_ms_per_leg: float  # CPU time (user and system) of one relay per message it relayed


async def relay(
    url: str,
    me: str,
    other: str,
    legs: int,
    start: bool,
    think_ms: float = 0.0,
    mode: str = "js-await",
    inflight: int = 1,
    cpu: list[float] | None = None,
) -> list[float]:
    """Relay until ``legs`` messages arrived here; the arrival times (and in ``cpu`` this thread's
    CPU seconds at the first and at the last arrival)."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    stamps: list[float] = []
    done = asyncio.Event()
    background = Background()

    async def forward(msg) -> None:
        if mode == "core":
            await nc.publish(f"floor.{other}", BODY)
        elif mode == "js-await":
            await js.publish(f"floor.{other}", BODY)
            await msg.ack()
        else:  # js-pipelined: the publish leaves now, its acknowledgement is awaited beside the loop
            ack = asyncio.ensure_future(js.publish(f"floor.{other}", BODY))

            async def ack_input() -> None:
                await ack
                await msg.ack()

            background.spawn(ack_input())

    async def on_msg(msg) -> None:
        if done.is_set():  # the other side's last leg: nothing more to relay
            return
        stamps.append(time.perf_counter())
        if cpu is not None and len(stamps) in (1, legs):
            cpu.append(time.thread_time())
        if len(stamps) >= legs:
            done.set()
        if think_ms:
            await asyncio.get_running_loop().run_in_executor(None, time.sleep, think_ms / 1000)
        await forward(msg)

    if mode == "core":
        await nc.subscribe(f"floor.{me}", cb=on_msg)
    else:
        await js.subscribe(
            f"floor.{me}",
            stream=STREAM,
            cb=on_msg,
            manual_ack=True,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=256),
        )
    await nc.flush()
    if start:
        await asyncio.sleep(1.0)  # the other side subscribes meanwhile
        for _ in range(inflight):
            if mode == "core":
                await nc.publish(f"floor.{other}", BODY)
            else:
                await js.publish(f"floor.{other}", BODY)
    await asyncio.wait_for(done.wait(), 300)
    await asyncio.sleep(0.2 + 4 * think_ms / 1000)
    await nc.close()
    return stamps


async def _make_stream(url: str) -> None:
    nc = await nats.connect(url)
    await nc.jetstream().add_stream(StreamConfig(name=STREAM, subjects=["floor.>"], storage=StorageType.MEMORY))
    await nc.close()


def ring(
    legs: int = 2000, think_ms: float = 0.0, *, mode: str = "js-await", inflight: int = 1, delay_ms: float = 0.0
) -> Ring:
    """Run the two-process relay on a fresh nats-server; with ``delay_ms`` each relay reaches it
    through its own emulated link (in the link emulator's process)."""
    from neuron_bus.wan.linkem import EmulatorProcess

    with tempfile.TemporaryDirectory() as store:
        server = NatsServer(ServerConfig(store_dir=Path(store), port=free_port(), http_port=free_port()))
        server.start()
        links = EmulatorProcess() if delay_ms else None
        try:
            direct = server.url
            asyncio.run(_make_stream(direct))
            url_a, url_b = (
                (f"nats://127.0.0.1:{links.add_link(side, server.config.port, delay_ms=delay_ms)}" for side in "ab")
                if links
                else (direct, direct)
            )
            me = [sys.executable, __file__, "--relay", url_b]
            args = ["b", "a", str(legs), "0", str(think_ms), mode, str(inflight)]
            other = subprocess.Popen(me + args, stdout=subprocess.DEVNULL)
            cpu: list[float] = []
            try:
                stamps = asyncio.run(relay(url_a, "a", "b", legs, True, think_ms, mode, inflight, cpu))
            finally:
                other.wait(timeout=300)
        finally:
            if links:
                links.close()
            server.stop()
    round_trips = [b - a for a, b in zip(stamps, stamps[1:])]  # inflight 1: one message's round
    return Ring(
        mode=mode,
        delay_ms=delay_ms,
        inflight=inflight,
        legs=legs,
        leg_ms_p50=1000 * statistics.median(round_trips) / 2 - think_ms if inflight == 1 else float("nan"),
        legs_per_s=2 * (len(stamps) - 1) / (stamps[-1] - stamps[0]),
        cpu_ms_per_leg=1000 * (cpu[-1] - cpu[0]) / max(len(stamps) - 1, 1),
    )


def measure(legs: int = 2000, think_ms: float = 0.0) -> float:
    """p50 milliseconds per leg of a two-process JetStream relay on a fresh nats-server."""
    return ring(legs, think_ms).leg_ms_p50


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--legs", type=int, default=2000)
    ap.add_argument("--think-ms", type=float, default=0.0, help="backend time per leg to mimic (subtracted)")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of each relay's link to the server")
    ap.add_argument("--inflight", type=int, default=1, help="messages circling at once")
    ap.add_argument("--mode", choices=MODES, default="js-await")
    ap.add_argument("--relay", nargs=8, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.relay:
        url, me, other, legs, start, think, mode, inflight = args.relay
        asyncio.run(relay(url, me, other, int(legs), start == "1", float(think), mode, int(inflight)))
        return 0
    r = ring(args.legs, args.think_ms, mode=args.mode, inflight=args.inflight, delay_ms=args.delay_ms)
    print(
        f"{r.mode} relay, {r.inflight} in flight, links of {r.delay_ms:g} ms: p50 {r.leg_ms_p50:.3f} ms per leg"
        + (f" beyond {args.think_ms:g} ms of backend time" if args.think_ms else "")
        + f"; {r.legs_per_s:.1f} legs/s; {r.cpu_ms_per_leg:.3f} ms of CPU per leg in a relay"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
