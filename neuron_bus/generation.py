"""One generation's lifecycle on the client side: route, open, prompt, events, retry, repair, close.

`GenerationRun.events()` is what `NeuronClient.generate` yields:

- start: a route from the tracker (around the nodes lost or found faulty so far), the prompt
  tokenized by hop 0, a session opened on every hop, the prompt streamed into hop 0 in chunks;
- events: telemetry and token deltas as the route publishes them; the route nodes' heartbeats are
  watched so a dead or stuck node ends the wait within seconds, not at the stall timeout;
- recovery: a failure before the first token restarts from scratch on a new route; a node lost
  during decode is replaced from a snapshot when possible (repair.py); anything else is final;
- failure: the last phase, node and reason go to the session's telemetry, then RouteError;
- close: every hop that opened the session frees it; a node lost or unreachable is told without
  waiting for its answer, so a failure reaches the caller within the liveness bound rather than
  after a control request's timeout (a held link delivers the close once it heals).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import msgspec
import numpy as np

from neuron_bus import codec, session_events
from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.errors import MalformedMessage, RouteError
from neuron_bus.flow import publish
from neuron_bus.ping import ping
from neuron_bus.prefix import block_hashes
from neuron_bus.quiet import QuietSpell, busy_nodes, keep_alive_every
from neuron_bus.repair import repair as repair_route
from neuron_bus.routes import hop_header
from neuron_bus.tasks import cancel_and_wait
from neuron_bus.telemetry import GenerationProgress
from neuron_bus.timing import heartbeat_loss_s
from neuron_bus.trust import sealing
from workers.errors import Reason

CATCH_UP_S = 1.0  # this long without an event, the session's stored tokens are read for missed ones
PREFILL_RETRIES = 1  # a route failing before the first token is retried from scratch this often
MAX_REPAIRS = 2  # dead hops replaced in one generation (needs snapshots: see repair.py)
SILENT = {Reason.NODE_LOST, Reason.NODE_UNREACHABLE}  # failures of a node that may not answer a close
RETRYABLE = {
    Reason.DRAINING,  # the node moves to other layers (the tracker routes around it within a heartbeat)
    Reason.NODE_LOST,
    Reason.NODE_UNREACHABLE,
    Reason.PREFILL_FAILED,
    Reason.STALLED,
    Reason.STUCK,  # the node's backend is stuck in a call (the tracker routes around it within a heartbeat)
    Reason.BACKEND_ERROR,
    Reason.ROUTE_FAILED,
    Reason.UNKNOWN_SESSION,
}
LIVENESS_CHECK_S = 0.5


def says_stuck(heartbeat: bytes) -> bool:
    """Whether a node's heartbeat says a backend call of its is far overdue (worker/runner.py)."""
    try:
        return M.decode(heartbeat, M.NodeHeartbeat).status == "stuck"
    except MalformedMessage:
        return False


def retryable(exc: RouteError) -> bool:
    """Whether a failure before the first token is worth a new route: a node's, or the route's.
    A node that answered nonsense (a faulty build, a foreign responder on its subject) is avoided
    on the next route as a lost one is; the tracker's nonsense is not retried."""
    return exc.reason in RETRYABLE or (exc.reason == Reason.BAD_REPLY and exc.node_id is not None)


class GenerationRun:
    def __init__(
        self,
        client,
        *,
        sampling: M.SamplingParams,
        model_preset: str,
        wire_dtype: M.WireDtype,
        encoding: M.Encoding,
        chunk_size: int,
        policy: str,
        route: M.RouteAssignment | None,
        prompt: str | None,
        messages: list[dict[str, str]] | None,
        prompt_tokens: list[int] | None,
        prefill_retries: int = PREFILL_RETRIES,
        repair: bool = True,
        speculative: int = 0,
        prefix_reuse: bool = True,
        on_route: Callable[[M.RouteAssignment], None] | None = None,
    ):
        self.client = client
        self.sampling = sampling
        self.model_preset, self.wire_dtype, self.encoding = model_preset, wire_dtype, encoding
        self.chunk_size, self.policy = chunk_size, policy
        self.route = route
        self.prompt, self.messages, self.prompt_tokens = prompt, messages, prompt_tokens
        self.prefill_retries, self.repair = prefill_retries, repair
        self.on_route = on_route  # told every route the session runs on: the first, a retry's, a repair's
        self.speculative = speculative  # draft tokens a decode step may carry (SessionOpen.speculative)
        self.prefix_reuse = prefix_reuse  # the head may attach a cached prompt prefix (neuron_bus/prefix.py)
        self.reused = 0  # prompt positions every hop attached from its prefix cache
        self.prefix_fallbacks = 0  # opens where a hop lacked the head's prefix: the route computed the whole prompt
        self.session_id = uuid.uuid4().hex
        self.owner = client.owner
        self.progress = GenerationProgress(self.session_id, "", model_preset, [], 0, owner=self.owner)
        self.keys: list[str] = []  # link key of each hop's input, fresh for this session (trust/sealing.py)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.subs: list = []
        self.opened: list[str] = []  # nodes holding the session
        self.sender: asyncio.Task | None = None
        self.watcher: asyncio.Task | None = None
        self.heartbeat_subs: list = []  # the current route's nodes' heartbeats (the watcher's)
        self.last_beats: dict[str, bytes] = {}  # node -> its last heartbeat, encoded (read when the route is quiet)
        self.generated: list[int] = []  # token ids delivered, in order
        self.lost: set[str] = set()
        self.idle_timeouts: dict[str, float] = {}  # node -> the idle timeout it announced when the session opened there
        self.rtt: dict[str, float] = {}  # node -> seconds: a ping's round trip, once the session opened there
        self.retries = self.repairs = 0
        self.stream_seq: dict[str, int] = {}  # NEURON_TOKENS read up to here (catch-up reads)

    @property
    def live_route(self) -> M.RouteAssignment:
        """The route the session runs on (once it has started)."""
        assert self.route is not None, "the generation has not started"
        return self.route

    @property
    def tokens(self) -> list[int]:
        """The prompt's token ids (once it has started)."""
        assert self.prompt_tokens is not None, "the generation has not started"
        return self.prompt_tokens

    # ------------------------------------------------------------------ the whole run

    async def events(self) -> AsyncGenerator[M.TokenDelta | M.GenerationTelemetry, None]:
        nc = self.client.nc
        for kind, subject in session_events.SUBJECTS:
            self.subs.append(await nc.subscribe(subject(self.owner, self.session_id), cb=self._into_queue(kind)))
        try:
            await self._publish_progress()  # comes back through the subscription
            need_start = True
            while True:
                try:
                    if need_start:
                        async for queued in self._start():  # "queued" telemetry while the swarm is full
                            yield queued
                        need_start = False
                    async for event in self._in_order(self._route_events()):
                        yield event
                        if isinstance(event, M.TokenDelta) and event.finished:
                            return
                except RouteError as exc:
                    need_start = await self._recover(exc)
        except RouteError as exc:
            await self._report_failure(exc)
            raise
        finally:
            await self._close()

    async def _in_order(self, events: AsyncIterator[M.TokenDelta | M.GenerationTelemetry]):
        """Token deltas in index order, each once: a repaired route re-sends tokens already
        delivered, and a speculative step's several tokens may overtake each other on the way."""
        early: dict[int, M.TokenDelta] = {}
        async for event in events:
            if not isinstance(event, M.TokenDelta):
                yield event
                continue
            if event.index > len(self.generated):
                early[event.index] = event
                continue
            delta: M.TokenDelta | None = event
            while delta is not None and delta.index == len(self.generated):
                self.generated.append(delta.token_id)
                yield delta
                delta = early.pop(len(self.generated), None)

    def _into_queue(self, kind: str):
        async def cb(msg) -> None:
            self.queue.put_nowait((kind, msg.data))

        return cb

    # ------------------------------------------------------------------ start

    async def _start(self) -> AsyncIterator[M.GenerationTelemetry]:
        """Route, tokenize and open every hop; when no slot is free, wait in the client's queue
        (admission.py), yielding where in it this generation stands.

        Nobody waiting: start at once, beside every other generation starting (each start costs
        round trips to the tracker and the hops; one after another, 8 sessions over 25 ms links
        reached their first tokens 0.3 s apart each). Refused for want of a slot, or others
        already waiting: join the queue, behind them."""
        admission = self.client.admission
        if not admission.queues:
            await self._try_start()
            return
        if not len(admission) and await self._started():
            return
        ticket = admission.enter()
        try:
            while True:
                yield await self._queued(admission.position(ticket))
                await admission.changed(admission.retry_s)
                if admission.position(ticket) == 0 and await self._started():
                    return
        finally:
            admission.leave(ticket)

    async def _started(self) -> bool:
        """Start; False when a hop had no free slot (the hops that had one then give it back)."""
        try:
            await self._try_start()
            return True
        except RouteError as exc:
            if exc.reason != Reason.NO_FREE_SLOT:
                raise
            await self._close_sessions()
            return False

    async def _queued(self, position: int) -> M.GenerationTelemetry:
        self.progress.queued(position)
        await self._publish_progress()
        return self.progress.snapshot()

    async def _try_start(self) -> None:
        prepared = await self.client.prepare(
            self.model_preset,
            prompt=self.prompt,
            messages=self.messages,
            prompt_tokens=self.prompt_tokens,
            route=self.route,
            policy=self.policy,
            wire_dtype=self.wire_dtype,
            encoding=self.encoding,
            avoid=self.lost,
        )
        self.route, self.prompt_tokens = prepared.route, prepared.prompt_tokens
        await self._follow_route()
        self.progress.finish("loading")
        await self._publish_progress()
        self.progress.prefill_total = len(self.tokens)
        await self._open_hops()
        self.progress.prefill(self.reused)
        self.progress.prefill_reused = self.reused
        await self._publish_progress()
        self.sender = asyncio.create_task(self._send_prompt(self.tokens, start=self.reused))

    async def _open_hops(self) -> None:
        """Open the session on every hop at once (a WAN makes each request cost a round trip).

        With prefix reuse, the head first: it attaches the longest prefix of the prompt it holds and
        says which (SessionOpened.prefix); every other hop is asked for exactly that one. When one
        of them lacks it (prefix_missing), the session is closed everywhere and opened again on the
        whole route without reuse: the whole prompt is computed, never a mix."""
        hops = self.live_route.hops
        blocks = block_hashes(self.tokens) if self.prefix_reuse else []  # off: nothing attached, nothing kept
        self.reused = 0
        prefix = None
        if blocks:
            opened = await self._open_hop(0, blocks, reuse=True)
            self.opened.append(hops[0].node_id)
            prefix = opened.prefix
        rest = range(1 if blocks else 0, len(hops))
        try:
            await self._open_each(rest, blocks, prefix)
        except RouteError as exc:
            if prefix is None or exc.reason != Reason.PREFIX_MISSING:
                raise
            self.prefix_fallbacks += 1
            await self._close_sessions()
            await self._open_each(range(len(hops)), blocks, None)
            prefix = None
        self.reused = prefix.positions if prefix is not None else 0

    async def _open_hop(self, i: int, blocks: list[str], reuse: bool = False, prefix: M.PrefixReuse | None = None):
        hops = self.live_route.hops
        node = hops[i].node_id
        req = self._session_open(i, prompt=list(self.tokens) if i == len(hops) - 1 else None)
        req.prefix_blocks, req.reuse_prefix, req.prefix = blocks, reuse, prefix
        reply = await self.client.control(node, req)
        await self._met(node, reply.idle_timeout_s)
        return reply

    async def _met(self, node: str, idle_timeout_s: float) -> None:
        """A node the session opened on (or moved to in a repair): its announced idle timeout (the
        keep-alives), and the round trip to it, measured once per node of the run (its liveness watch)."""
        self.idle_timeouts[node] = idle_timeout_s
        if node not in self.rtt:
            self.rtt[node] = await ping(self.client.nc, node, timeout=5.0) or 0.0

    async def _open_each(self, indexes: range, blocks: list[str], prefix: M.PrefixReuse | None) -> None:
        hops = self.live_route.hops
        results = await asyncio.gather(
            *(self._open_hop(i, blocks, prefix=prefix) for i in indexes), return_exceptions=True
        )
        self.opened += [hops[i].node_id for i, r in zip(indexes, results) if not isinstance(r, BaseException)]
        for r in results:
            if isinstance(r, BaseException):
                raise r

    def key(self, hop_index: int) -> str:
        """The link key into hop ``hop_index`` ("" for an unauthenticated session)."""
        if not self.client.authenticate:
            return ""
        while len(self.keys) <= hop_index:
            self.keys.append(sealing.new_key())
        return self.keys[hop_index]

    def hop_keys(self, route: M.RouteAssignment, hop_index: int) -> dict:
        """The keys a hop's SessionOpen carries: its input link's, and the link it feeds (the ring at the tail)."""
        out = (hop_index + 1) % len(route.hops)
        return {
            "input_key": self.key(hop_index),
            "output_key": self.key(out),
            "encrypt": self.client.encrypt_activations,
        }

    def _session_open(self, hop_index: int, prompt: list[int] | None) -> M.SessionOpen:
        n = len(self.tokens)
        return M.SessionOpen(
            session_id=self.session_id,
            route=self.live_route,
            hop_index=hop_index,
            prompt_tokens=n,
            n_ctx=n + self.sampling.max_tokens,
            chunk_size=self.chunk_size,
            sampling=self.sampling,
            prompt=prompt,  # the tail writes it into the validation event
            owner=self.owner,
            speculative=self.speculative,
            **self.hop_keys(self.live_route, hop_index),
        )

    async def _follow_route(self) -> None:
        """Point telemetry and the liveness watch at the current route."""
        await cancel_and_wait(self.watcher)
        await self._unsubscribe(self.heartbeat_subs)
        self.progress.route_id = self.live_route.route_id
        self.progress.nodes = [h.node_id for h in self.live_route.hops]
        self.watcher = await self._watch_nodes(self.progress.nodes)
        if self.on_route:
            self.on_route(self.live_route)

    async def _watch_nodes(self, nodes: list[str]) -> asyncio.Task:
        """Follow the route nodes' heartbeats; queue ("lost", (node, why)) when one falls silent,
        or says its backend is stuck (a call far overdue: worker/runner.py), once per node."""
        seen = {node: time.monotonic() for node in nodes}
        beats = self.last_beats = {}
        stuck: set[str] = set()

        def beat(node: str):
            async def cb(msg) -> None:
                seen[node] = time.monotonic()
                beats[node] = msg.data
                if node not in stuck and says_stuck(msg.data):
                    stuck.add(node)
                    self.queue.put_nowait(("lost", (node, "says its backend is stuck (a call far past its time)")))

            return cb

        for node in seen:
            self.heartbeat_subs.append(await self.client.nc.subscribe(S.node_heartbeat(node), cb=beat(node)))

        async def watch() -> None:
            while True:
                await asyncio.sleep(LIVENESS_CHECK_S)
                now = time.monotonic()
                for node, at in seen.items():
                    if now - at > heartbeat_loss_s(self.rtt.get(node)):
                        self.queue.put_nowait(("lost", (node, f"sent no heartbeat for {now - at:.1f}s")))
                        return

        return asyncio.create_task(watch())

    async def _send_prompt(self, tokens: list[int], start: int = 0) -> None:
        """Send positions [start, len(tokens)) to hop 0 in chunks (the prompt, or a repair's replay)."""
        ids = np.asarray(tokens, dtype=np.int32)
        route = self.live_route
        subject = S.hop_input(route.hops[0].node_id, route.route_id, 0, "prefill", self.session_id)
        key, encrypt = self.key(0), self.client.encrypt_activations
        for seq, lo in enumerate(range(start, len(ids), self.chunk_size)):
            header = hop_header(route, 0, self.session_id, lo, "prefill", seq, "i32")
            headers, body = codec.encode(header, ids[lo : lo + self.chunk_size])
            if key:
                headers, body = sealing.seal(header, headers, body, key, encrypt)
            await publish(self.client.js, subject, body, headers)

    # ------------------------------------------------------------------ events

    async def _route_events(self):
        last_phase = "prefill"
        quiet = QuietSpell(keep_alive_every(self.idle_timeouts.get(h.node_id, 0.0) for h in self.live_route.hops))
        last: M.GenerationTelemetry | None = None  # the session's last telemetry (the route's or this client's)
        while True:
            if self.sender.done() and self.sender.exception():
                raise RouteError(
                    Reason.PREFILL_FAILED, f"sending the prompt failed: {self.sender.exception()}", phase="prefill"
                )
            try:
                kind, data = await asyncio.wait_for(self.queue.get(), CATCH_UP_S)
            except TimeoutError:
                due = quiet.grow(CATCH_UP_S, lambda: busy_nodes(self.last_beats))
                if due.stalled:
                    raise RouteError(
                        Reason.STALLED,
                        f"no progress from route {self.live_route.route_id} {due.stalled}",
                        phase=last_phase,
                    ) from None
                if due.notice:
                    await self._publish_waiting(last, due.notice)  # comes back through the subscription
                if due.keep_alive:
                    await self._keep_alive()
                await self._catch_up()  # a quiet route, or a subscription that missed messages
                continue
            if kind == "catch_up":
                quiet.progress()
                await self._catch_up()
                continue
            if kind == "lost":
                node, why = data
                raise RouteError(Reason.NODE_LOST, f"node {node} {why}", phase=last_phase, node_id=node)
            event = session_events.read(kind, data, last_phase)
            if event is None or (isinstance(event, M.TokenDelta) and not self._next_token(event)):
                continue  # a rejected stray message, a token already delivered, or not this session's
            if isinstance(event, M.GenerationTelemetry):
                last = event
                if event.waiting_at:  # this client's own notice: no progress of the route
                    yield event
                    continue
            quiet.progress()
            last_phase = event.phase if isinstance(event, M.GenerationTelemetry) else "decode"
            yield event

    async def _publish_waiting(self, last: M.GenerationTelemetry | None, busy: list[str]) -> None:
        """Say on the session's telemetry that it waits its turn at ``busy`` (its last telemetry, so a
        reader keeps the progress it had)."""
        base = last if last is not None else self.progress.snapshot()
        notice = msgspec.structs.replace(base, waiting_at=busy, ts=time.time())
        try:
            await self.client.js.publish(self.progress.subject, M.encode(notice))
        except Exception:  # a word to the reader, not the session's work: the stall rule judges the bus
            pass

    async def _keep_alive(self) -> None:
        """Tell every hop of the route that this session, waiting its turn, is still wanted (a hop
        that computed nothing of it for its idle timeout would free it)."""
        route = self.live_route
        for i, hop in enumerate(route.hops):
            req = M.SessionKeepAlive(session_id=self.session_id, route_id=route.route_id)
            req.proof = sealing.prove(self.key(i), sealing.keep_alive_parts(req))
            try:
                await self.client.tell(hop.node_id, req)
            except Exception:  # the bus did not take it: the stall rule judges the bus
                pass

    def _next_token(self, event: M.TokenDelta) -> bool:
        """Is ``event`` a token still to deliver? One already delivered (a repaired route, or read
        again from the stream) is not; one past a gap is (`_in_order` holds it back), and the
        stream is read for the ones missing in between."""
        if event.session_id != self.session_id or event.index < len(self.generated):
            return False
        if event.index > len(self.generated):
            self.queue.put_nowait(("catch_up", None))
        return True

    async def _catch_up(self) -> None:
        """Queue the session's token deltas and errors that NEURON_TOKENS holds past what was read
        from it so far: the core subscription misses whatever the route published while this
        client's connection moved to another server (a server died); the stream kept it."""
        for kind, subject in (("token", S.session_tokens), ("error", S.session_error)):
            seq = self.stream_seq.get(kind, 1)
            while True:
                try:
                    raw = await self.client.js.get_msg(
                        S.STREAM_TOKENS, seq=seq, subject=subject(self.owner, self.session_id), next=True
                    )
                except Exception:  # nothing more (NotFound), or the bus is away: the next quiet spell retries
                    break
                seq = (raw.seq or seq) + 1
                self.queue.put_nowait((kind, raw.data))
            self.stream_seq[kind] = seq

    # ------------------------------------------------------------------ recovery, failure, close

    async def _recover(self, exc: RouteError) -> bool:
        """Retry or repair after ``exc``, or raise it. Returns whether the run must start again."""
        if exc.node_id and exc.reason in SILENT:
            self.lost.add(exc.node_id)  # avoided from now on, and closing its session does not wait for it
        if not self.generated:  # before the first token: retry from scratch on a new route
            if not retryable(exc) or self.retries >= self.prefill_retries:
                raise exc
            self.retries += 1
            if exc.node_id:
                self.lost.add(exc.node_id)
            await cancel_and_wait(self.sender, self.watcher)
            await self._close_sessions()
            while not self.queue.empty():
                self.queue.get_nowait()
            self.route = None
            return True
        if not (self.repair and exc.reason == Reason.NODE_LOST and exc.node_id and self.repairs < MAX_REPAIRS):
            raise exc
        self.repairs += 1
        spec = self._session_open(0, prompt=list(self.tokens))
        try:
            self.route, resumed, node = await repair_route(
                self.client,
                self.live_route,
                exc.node_id,
                spec,
                list(self.generated),
                self.repairs,
                self.lost,
                keys=self.hop_keys,
            )
        except RouteError as failed:
            raise RouteError(
                exc.reason, f"{exc}; route repair failed ({failed.reason}): {failed}", exc.phase, exc.node_id
            ) from None
        self.opened[:] = [n for n in self.opened if n != exc.node_id] + [node.node_id]
        await self._met(node.node_id, resumed.idle_timeout_s)
        await self._follow_route()
        self.sender = asyncio.create_task(self._send_prompt(self.tokens + self.generated, start=resumed.position))
        return False

    async def _report_failure(self, exc: RouteError) -> None:
        if exc.phase == "queued":  # raised outside the event loop (route, tokenize, open): the client's phase
            exc.phase = self.progress.phase
        where = f" at node {exc.node_id}" if exc.node_id else ""
        self.progress.fail(f"{exc.reason} in phase {exc.phase}{where}: {exc}", exc.phase, exc.node_id)
        await self._publish_progress()

    async def _close_sessions(self) -> None:
        """Free the session on every hop that holds it, all at once; a node that is gone took its cache with it."""
        if not self.opened:
            return
        route = self.live_route
        index = {h.node_id: i for i, h in enumerate(route.hops)}
        # the blocks of the prompt and the answer, for the hops to keep (a chat's next turn starts so)
        keep = block_hashes(self.tokens + self.generated) if self.prefix_reuse and self.generated else []

        def close(node: str) -> M.SessionClose:  # proven with the hop's input key: only this client can close it
            key = self.key(index[node]) if node in index else ""
            req = M.SessionClose(session_id=self.session_id, route_id=route.route_id, keep_blocks=keep)
            req.proof = sealing.prove(key, sealing.close_parts(req))
            return req

        silent = [n for n in self.opened if n in self.lost]  # may never answer: told, not waited for
        await asyncio.gather(
            *(self.client.tell(n, close(n)) for n in silent),
            *(self.client.control(n, close(n), timeout=5) for n in self.opened if n not in self.lost),
            return_exceptions=True,
        )
        self.opened.clear()
        self.client.admission.released()  # a generation waiting for a slot may try now

    async def _close(self) -> None:
        """Free the session on every hop first (what matters), then drop the subscriptions."""
        await cancel_and_wait(self.sender, self.watcher)
        await self._close_sessions()
        await self._unsubscribe(self.subs)
        await self._unsubscribe(self.heartbeat_subs)

    @staticmethod
    async def _unsubscribe(subs: list) -> None:
        while subs:
            try:
                await subs.pop().unsubscribe()
            except Exception:  # the connection is closing or gone: nothing more to drop
                pass

    async def _publish_progress(self) -> None:
        await self.client.js.publish(self.progress.subject, M.encode(self.progress.snapshot()))
