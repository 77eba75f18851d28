"""A link emulator: an asyncio userspace TCP relay that gives each link a one-way delay per
direction, jitter that keeps byte order, a bandwidth cap and a partition switch.

This kernel has no netem qdisc, so emulated WAN links are relays: a process that should sit behind
a link connects to the link's port on 127.0.0.1 instead of its target, and the relay forwards the
bytes after the link's delay. ``up`` is the direction from the connecting side to the target (a
worker's bytes into nats-server), ``down`` the way back.

- Delay and jitter: a chunk read at ``t`` leaves at ``max(t + delay + U(0, jitter), previous
  release)``: jitter never lets a chunk overtake an earlier one (TCP keeps byte order; so does
  this).
- Bandwidth: a token bucket of one packet, i.e. serialization: a chunk of ``n`` bytes occupies
  the direction for ``8 n / rate`` seconds after the previous one left the wire, then travels
  for ``delay``. At most ``BUFFER_BYTES`` wait per direction; past that the relay stops reading
  its source, so a sender feels the bottleneck through TCP as it would on a real link.
- Partition: ``hold`` keeps every byte (nothing arrives; reading goes on up to the buffer) and
  releases them in order when healed; ``cut`` aborts the link's connections and refuses new ones
  until healed.
- At zero delay, jitter and rate a chunk is written straight through, without a timer.

Three ways to drive it, one API (:class:`Emulator`): :class:`LinkEmulator` on the caller's event
loop (async tests), :class:`EmulatorThread` on a thread of the caller's process, and
:class:`EmulatorProcess`, a separate process (``python -m neuron_bus.wan.linkem``) controlled over a
small JSON-lines TCP channel on 127.0.0.1, so relaying never competes with the caller for its
interpreter lock. Every control operation is one :data:`Control` message handled by
``LinkEmulator.apply``, whichever way it arrives.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import subprocess
import sys
import threading
from collections import deque
from typing import Literal

import msgspec

BUFFER_BYTES = 32 << 20  # per direction of a connection: what a link may hold before its sender blocks
TIMER_SLACK_S = 0.0005  # the event loop's timers wake up to 1 ms late (epoll's resolution): aim half early
PartitionMode = Literal["none", "hold", "cut"]


# ------------------------------------------------------------------------------ control messages


class Shape(msgspec.Struct, kw_only=True):
    """One direction of a link."""

    delay_ms: float = 0.0  # one-way propagation delay
    jitter_ms: float = 0.0  # extra delay, uniform in [0, jitter_ms); byte order is kept
    rate_mbit: float = 0.0  # bandwidth cap in Mbit/s (0: none)

    @property
    def shaped(self) -> bool:
        return bool(self.delay_ms or self.jitter_ms or self.rate_mbit)


class AddLink(msgspec.Struct, tag="add", kw_only=True):
    """A new link: a listener on 127.0.0.1 (``port`` 0: any free one) relaying to the target."""

    name: str
    target_host: str = "127.0.0.1"
    target_port: int
    port: int = 0
    up: Shape = msgspec.field(default_factory=Shape)
    down: Shape = msgspec.field(default_factory=Shape)


class SetLink(msgspec.Struct, tag="set", kw_only=True):
    """New shapes for a link (``None``: unchanged); they apply to bytes read from now on."""

    name: str
    up: Shape | None = None
    down: Shape | None = None


class Partition(msgspec.Struct, tag="partition", kw_only=True):
    name: str
    mode: PartitionMode  # "none" heals


class Stats(msgspec.Struct, tag="stats", kw_only=True):
    name: str | None = None  # None: every link


class RemoveLink(msgspec.Struct, tag="remove", kw_only=True):
    name: str


Control = AddLink | SetLink | Partition | Stats | RemoveLink


class LinkStats(msgspec.Struct, kw_only=True):
    name: str
    port: int
    partition: PartitionMode
    up: Shape
    down: Shape
    connections: int  # open now
    accepted: int  # since the link was added
    refused: int  # connections turned away by a cut
    bytes_up: int
    bytes_down: int
    queued_bytes: int  # held or in flight right now


class Reply(msgspec.Struct, kw_only=True):
    ok: bool = True
    error: str | None = None
    port: int = 0
    links: list[LinkStats] = msgspec.field(default_factory=list)


# ------------------------------------------------------------------------------ the relay


class _Pipe:
    """One direction of one relayed connection: a FIFO of (release time, bytes)."""

    def __init__(self, link: Link, direction: str, src: _Side, dst: _Side):
        self.link, self.direction, self.src, self.dst = link, direction, src, dst
        self.loop = asyncio.get_running_loop()
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued = 0
        self.last_release = 0.0
        self.wire_free = 0.0  # when the bandwidth cap lets the next byte onto the wire
        self.timer: asyncio.TimerHandle | None = None
        self.rng = random.Random()
        self.draining = False  # the source closed: close the destination once the queue is sent

    def feed(self, data: bytes) -> None:
        link = self.link
        shape = link.up if self.direction == "up" else link.down
        if self.direction == "up":
            link.bytes_up += len(data)
        else:
            link.bytes_down += len(data)
        if not shape.shaped and not self.queue and link.mode != "hold":
            self.dst.write(data)
            return
        now = self.loop.time()
        leave = now
        if shape.rate_mbit:
            leave = max(self.wire_free, now) + len(data) * 8 / (shape.rate_mbit * 1e6)
            self.wire_free = leave
        release = leave + shape.delay_ms / 1000.0
        if shape.jitter_ms:
            release += self.rng.random() * shape.jitter_ms / 1000.0
        release = max(release, self.last_release)  # never overtake an earlier chunk
        self.last_release = release
        self.queue.append((release, data))
        self.queued += len(data)
        if self.queued > BUFFER_BYTES:
            self.src.pause()
        self.arm()

    def arm(self) -> None:
        if self.timer is not None or not self.queue or self.link.mode == "hold":
            return
        delay = self.queue[0][0] - self.loop.time() - TIMER_SLACK_S
        if delay <= 0:
            self.flush()
        else:
            self.timer = self.loop.call_later(delay, self.flush)

    def flush(self) -> None:
        self.timer = None
        if self.link.mode == "hold":
            return
        horizon = self.loop.time() + TIMER_SLACK_S
        out = []
        while self.queue and self.queue[0][0] <= horizon:
            _, data = self.queue.popleft()
            self.queued -= len(data)
            out.append(data)
        if out:
            self.dst.write(b"".join(out))
        if self.queued <= BUFFER_BYTES // 2:
            self.src.resume()
        if self.draining and not self.queue:
            self.dst.close()
        self.arm()

    def drain(self) -> None:
        """The source closed (its FIN travels behind its last bytes)."""
        self.draining = True
        if not self.queue:
            self.dst.close()

    def drop(self) -> None:
        if self.timer:
            self.timer.cancel()
            self.timer = None
        self.queue.clear()
        self.queued = 0


class _Side(asyncio.Protocol):
    """One socket of a relayed connection: the accepted one (``accepted``) or the one to the target."""

    def __init__(self, conn: _Connection, accepted: bool):
        self.conn = conn
        self.accepted = accepted
        self.transport: asyncio.Transport | None = None
        self.pipe: _Pipe | None = None  # where bytes read here go
        self._paused_by: set[str] = set()

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.accepted:  # read nothing before the target is connected
            transport.pause_reading()
            self.conn.opening = asyncio.get_running_loop().create_task(self.conn.open())

    def data_received(self, data: bytes) -> None:
        assert self.pipe is not None  # reading starts only once both sides are connected
        self.pipe.feed(data)

    def connection_lost(self, exc) -> None:
        self.conn.lost(self)

    # flow control: a pipe out of room, or a destination socket's full buffer, pauses reading here
    def pause(self, why: str = "queue") -> None:
        if not self._paused_by and self.transport and not self.transport.is_closing():
            self.transport.pause_reading()
        self._paused_by.add(why)

    def resume(self, why: str = "queue") -> None:
        if why in self._paused_by:
            self._paused_by.discard(why)
            if not self._paused_by and self.transport and not self.transport.is_closing():
                self.transport.resume_reading()

    def pause_writing(self) -> None:  # our socket is full: stop reading the other side
        other = self.conn.other(self)
        if other:
            other.pause("socket")

    def resume_writing(self) -> None:
        other = self.conn.other(self)
        if other:
            other.resume("socket")

    def write(self, data: bytes) -> None:
        if self.transport and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        if self.transport and not self.transport.is_closing():
            self.transport.close()


class _Connection:
    def __init__(self, link: Link):
        self.link = link
        self.client = _Side(self, accepted=True)
        self.server: _Side | None = None
        self.opening: asyncio.Task | None = None
        self.closed = False

    def other(self, side: _Side) -> _Side | None:
        return self.server if side is self.client else self.client

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, self.server = await loop.create_connection(
                lambda: _Side(self, accepted=False), self.link.target_host, self.link.target_port
            )
        except OSError:
            self.abort()
            return
        assert self.server.transport is not None and self.client.transport is not None
        if self.closed:  # cut, or the client left, while connecting
            self.server.transport.abort()
            return
        self.client.pipe = _Pipe(self.link, "up", self.client, self.server)
        self.server.pipe = _Pipe(self.link, "down", self.server, self.client)
        self.client.transport.resume_reading()

    @property
    def queued(self) -> int:
        return sum(s.pipe.queued for s in (self.client, self.server) if s and s.pipe)

    def release(self) -> None:
        """A partition healed: send what was held."""
        for side in (self.client, self.server):
            if side and side.pipe:
                side.pipe.arm()

    def lost(self, side: _Side) -> None:
        """One socket closed: the other closes once the bytes in flight toward it were sent."""
        self.closed = True
        self.link.connections.discard(self)
        other = self.other(side)
        toward_side = other.pipe if other else None
        if toward_side:
            toward_side.drop()
        if side.pipe:
            side.pipe.drain()
        elif other:
            other.close()

    def abort(self) -> None:
        self.closed = True
        self.link.connections.discard(self)
        for side in (self.client, self.server):
            if side and side.pipe:
                side.pipe.drop()
            if side and side.transport:
                side.transport.abort()


class Link:
    """A listener on 127.0.0.1 relaying every connection it accepts to one target."""

    def __init__(self, spec: AddLink):
        self.name = spec.name
        self.target_host, self.target_port = spec.target_host, spec.target_port
        self.up, self.down = spec.up, spec.down
        self.mode: PartitionMode = "none"
        self.connections: set[_Connection] = set()
        self.server: asyncio.Server | None = None
        self.port = spec.port
        self.accepted = self.refused = self.bytes_up = self.bytes_down = 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(self._accept, "127.0.0.1", self.port, reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]

    def _accept(self) -> asyncio.Protocol:
        conn = _Connection(self)
        if self.mode == "cut":
            self.refused += 1
            conn.closed = True
            return _Refuse()
        self.accepted += 1
        self.connections.add(conn)
        return conn.client

    def partition(self, mode: PartitionMode) -> None:
        before, self.mode = self.mode, mode
        if mode == "cut":
            for conn in list(self.connections):
                conn.abort()
        elif mode == "none" and before == "hold":
            for conn in list(self.connections):
                conn.release()

    def stats(self) -> LinkStats:
        return LinkStats(
            name=self.name,
            port=self.port,
            partition=self.mode,
            up=self.up,
            down=self.down,
            connections=len(self.connections),
            accepted=self.accepted,
            refused=self.refused,
            bytes_up=self.bytes_up,
            bytes_down=self.bytes_down,
            queued_bytes=sum(c.queued for c in self.connections),
        )

    async def close(self) -> None:
        if self.server:
            self.server.close()
        for conn in list(self.connections):
            conn.abort()
        if self.server:
            await self.server.wait_closed()


class _Refuse(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        transport.abort()


class LinkEmulator:
    """Every link of one emulator, on the running event loop."""

    def __init__(self):
        self.links: dict[str, Link] = {}

    async def apply(self, req: Control) -> Reply:
        try:
            return await self._apply(req)
        except Exception as exc:  # every control failure is an explicit reply
            return Reply(ok=False, error=f"{type(exc).__name__}: {exc}")

    async def _apply(self, req: Control) -> Reply:
        if isinstance(req, AddLink):
            if req.name in self.links:
                raise ValueError(f"link {req.name} exists")
            link = Link(req)
            await link.start()
            self.links[req.name] = link
            return Reply(port=link.port)
        if isinstance(req, Stats):
            links = [self.links[req.name]] if req.name else list(self.links.values())
            return Reply(links=[link.stats() for link in links])
        link = self.links[req.name]
        if isinstance(req, SetLink):
            link.up = req.up or link.up
            link.down = req.down or link.down
        elif isinstance(req, Partition):
            link.partition(req.mode)
        elif isinstance(req, RemoveLink):
            await self.links.pop(req.name).close()
        return Reply(port=link.port)

    async def close(self) -> None:
        for link in list(self.links.values()):
            await link.close()
        self.links.clear()


# ------------------------------------------------------------------------------ one API, three homes


def _shape(delay_ms: float = 0.0, jitter_ms: float = 0.0, rate_mbit: float = 0.0) -> Shape:
    return Shape(delay_ms=delay_ms, jitter_ms=jitter_ms, rate_mbit=rate_mbit)


class Emulator:
    """The synchronous API over a running emulator; ``_send`` carries a Control to it."""

    def _send(self, req: Control) -> Reply:
        raise NotImplementedError

    def _checked(self, req: Control) -> Reply:
        reply = self._send(req)
        if not reply.ok:
            raise RuntimeError(f"link emulator: {reply.error}")
        return reply

    def add_link(
        self,
        name: str,
        target_port: int,
        *,
        up: Shape | None = None,
        down: Shape | None = None,
        delay_ms: float = 0.0,
        target_host: str = "127.0.0.1",
        port: int = 0,
    ) -> int:
        """Add a link to ``target_port``; returns the port to connect to instead. ``delay_ms`` sets
        both directions when ``up``/``down`` are not given."""
        req = AddLink(
            name=name,
            target_host=target_host,
            target_port=target_port,
            port=port,
            up=up or _shape(delay_ms),
            down=down or _shape(delay_ms),
        )
        return self._checked(req).port

    def shape(self, name: str, up: Shape | None = None, down: Shape | None = None, **both) -> None:
        """Change a link's shapes: ``up``/``down`` explicitly, or keywords of Shape for both."""
        if both:
            up, down = up or _shape(**both), down or _shape(**both)
        self._checked(SetLink(name=name, up=up, down=down))

    def partition(self, name: str, mode: PartitionMode = "hold") -> None:
        self._checked(Partition(name=name, mode=mode))

    def heal(self, name: str) -> None:
        self._checked(Partition(name=name, mode="none"))

    def remove(self, name: str) -> None:
        self._checked(RemoveLink(name=name))

    def stats(self, name: str | None = None) -> list[LinkStats]:
        return self._checked(Stats(name=name)).links

    def url(self, name: str) -> str:
        """nats:// URL of a link's listener."""
        return f"nats://127.0.0.1:{self.stats(name)[0].port}"

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EmulatorThread(Emulator):
    """The emulator on its own event loop in a thread of this process."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.core = LinkEmulator()
        self.thread = threading.Thread(target=self.loop.run_forever, name="linkem", daemon=True)
        self.thread.start()

    def _send(self, req: Control) -> Reply:
        return asyncio.run_coroutine_threadsafe(self.core.apply(req), self.loop).result(30)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.core.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


_encoder = msgspec.json.Encoder()
_control = msgspec.json.Decoder(Control)
_reply = msgspec.json.Decoder(Reply)


class EmulatorProcess(Emulator):
    """The emulator as a child process (``python -m neuron_bus.wan.linkem``), stopped by PID."""

    def __init__(self, log_path=None):
        log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "neuron_bus.wan.linkem", "--control-port", "0"],
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
        if log_path:
            log.close()
        line = self.proc.stdout.readline().decode().strip()  # "control <port>"
        if not line.startswith("control "):
            self.proc.kill()
            raise RuntimeError(f"link emulator did not start: {line!r}")
        self.sock = socket.create_connection(("127.0.0.1", int(line.split()[1])), timeout=30)
        self.file = self.sock.makefile("rb")
        self.lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _send(self, req: Control) -> Reply:
        with self.lock:
            self.sock.sendall(_encoder.encode(req) + b"\n")
            line = self.file.readline()
        if not line:
            raise RuntimeError(f"link emulator exited ({self.proc.poll()})")
        return _reply.decode(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# ------------------------------------------------------------------------------ the process


async def serve(control_port: int) -> None:
    core = LinkEmulator()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    reply = await core.apply(_control.decode(line))
                except msgspec.DecodeError as exc:
                    reply = Reply(ok=False, error=f"bad control message: {exc}")
                writer.write(_encoder.encode(reply) + b"\n")
                await writer.drain()
        finally:
            writer.close()
            stop.set()  # the controller went away: so does the emulator

    stop = asyncio.Event()
    server = await asyncio.start_server(handle, "127.0.0.1", control_port)
    print(f"control {server.sockets[0].getsockname()[1]}", flush=True)
    await stop.wait()
    server.close()
    await core.close()


def main() -> int:
    ap = argparse.ArgumentParser(description="neuron-bus link emulator (a delaying TCP relay)")
    ap.add_argument("--control-port", type=int, default=0)
    args = ap.parse_args()
    asyncio.run(serve(args.control_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
