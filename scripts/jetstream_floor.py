"""The transport's own floor: what one hop costs when it does nothing but relay.

Two Python processes pass one 2304-byte message (a SmolLM2 decode activation) back and forth
through JetStream, exactly the way a hop does: a push consumer with explicit acks on a memory
stream, the output published with its stream acknowledgement awaited, then the input acked.
There is no codec, session check or model call; the p50 time per leg is the least a Python hop on
nats-py can cost on this machine, against which the per-hop overhead of the no-op route compares.
With ``--think-ms T`` each relay first waits T ms on a worker thread, the way a hop's backend
computes, so the processes go idle between messages as in a real route; T is subtracted.

    scripts/jetstream_floor.py [--legs N] [--think-ms T]
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

import nats
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neuron_bus.natsserver import NatsServer, ServerConfig, free_port  # noqa: E402

STREAM = "FLOOR"
BODY = b"\0" * 2304


async def relay(url: str, me: str, other: str, legs: int, start: bool, think_ms: float = 0.0) -> list[float]:
    """Relay until ``legs`` messages arrived here; the arrival times."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    stamps: list[float] = []
    done = asyncio.Event()

    async def on_msg(msg) -> None:
        if done.is_set():  # the other side's last leg: nothing more to relay
            return
        stamps.append(time.perf_counter())
        if len(stamps) >= legs:
            done.set()
        if think_ms:
            await asyncio.get_running_loop().run_in_executor(None, time.sleep, think_ms / 1000)
        await js.publish(f"floor.{other}", BODY)
        await msg.ack()

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
        await js.publish(f"floor.{other}", BODY)
    await asyncio.wait_for(done.wait(), 120)
    await asyncio.sleep(0.2)
    await nc.close()
    return stamps


async def _make_stream(url: str) -> None:
    nc = await nats.connect(url)
    await nc.jetstream().add_stream(StreamConfig(name=STREAM, subjects=["floor.>"], storage=StorageType.MEMORY))
    await nc.close()


def measure(legs: int = 2000, think_ms: float = 0.0) -> float:
    """p50 milliseconds per leg of a two-process JetStream relay on a fresh nats-server."""
    with tempfile.TemporaryDirectory() as store:
        server = NatsServer(ServerConfig(store_dir=Path(store), port=free_port(), http_port=free_port()))
        server.start()
        try:
            url = f"nats://127.0.0.1:{server.config.port}"
            asyncio.run(_make_stream(url))
            me = [sys.executable, __file__, "--relay", url]
            other = subprocess.Popen(me + ["b", "a", str(legs), "0", str(think_ms)], stdout=subprocess.DEVNULL)
            try:
                stamps = asyncio.run(relay(url, "a", "b", legs, True, think_ms))
            finally:
                other.wait(timeout=60)
        finally:
            server.stop()
    round_trips = [b - a for a, b in zip(stamps, stamps[1:])]
    return 1000 * statistics.median(round_trips) / 2 - think_ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--legs", type=int, default=2000)
    ap.add_argument("--think-ms", type=float, default=0.0, help="backend time per leg to mimic (subtracted)")
    ap.add_argument(
        "--relay", nargs=6, metavar=("URL", "ME", "OTHER", "LEGS", "START", "THINK"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.relay:
        url, me, other, legs, start, think = args.relay
        asyncio.run(relay(url, me, other, int(legs), start == "1", float(think)))
        return 0
    print(
        f"JetStream relay floor: p50 {measure(args.legs, args.think_ms):.3f} ms per leg"
        + (f" beyond {args.think_ms:g} ms of backend time" if args.think_ms else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
