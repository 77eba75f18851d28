"""The worker service loop: one backend, every route session assigned to it.

- Announces its capability report (KV ``neuron-nodes`` and ``neuron.node.<id>.caps``) and sends
  heartbeats with measured telemetry.
- Answers control requests on ``neuron.node.<id>.ctl``: open/close sessions, list sessions,
  ping, tokenize.
- For every route it serves, binds JetStream push consumers on the hop's prefill and decode
  subjects. Messages are checked against the session table before any model work; outputs are
  published to the next hop (or, at the tail, sampled into a token that goes straight back to
  hop 0 as the next decode step) and the input is acknowledged only after the next stream
  accepted the output.
- Decode steps of different sessions run in waves, one batched backend call per wave
  (`neuron_bus.worker.waves`).

The backend is driven through `workers.protocol.Backend` in one dedicated thread, so heartbeats
and control requests stay responsive while the model computes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import psutil
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from neuron_bus import codec
from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.errors import MalformedMessage, NeuronBusError, SessionMismatch
from neuron_bus.flow import publish
from neuron_bus.sampling import sample
from neuron_bus.telemetry import GenerationProgress
from neuron_bus.trust import fault as faults
from neuron_bus.worker.audit_trail import AuditTrail
from neuron_bus.worker.metrics import WorkerMetrics
from neuron_bus.worker.node_telemetry import NodeTelemetry, neighbours
from neuron_bus.worker.session_table import HopSession, SessionTable
from neuron_bus.worker.snapshots import SnapshotStore, object_name
from neuron_bus.worker.waves import DecodeWaves

log = logging.getLogger("neuron_bus.worker")

TOP_LOGPROBS = 5
INLINE_STEP_S = 0.0005  # decode calls quicker than this run on the event loop (see _compute)


@dataclass
class WorkerOptions:
    heartbeat_interval: float = 1.0
    idle_timeout: float = 300.0
    max_decode_batch: int = 8
    batch_wait_ms: float = 10.0  # how long hop 0 may hold a decode step for other sessions' steps
    decode_ack_pending: int = 256
    max_body: int = codec.DEFAULT_MAX_BODY
    slow_ms: float = 0.0  # add this much delay per backend call (fault injection for tests)
    snapshot_every: int = 0  # write a KV snapshot whenever a decoding session crosses a multiple of this
    snapshot_url: str | None = None  # the cache server holding neuron-snapshots (None: the bus)
    owned_layer_work: float = 0.0  # millions of weights multiplied per token (artifacts/work.py): the ledger's unit
    fault: str | None = None  # fault injection for audit tests: "perturb" (trust/fault.py)


async def _settle(coro):
    """Await ``coro``; its exception, if any, is returned instead of raised (like gather's)."""
    try:
        return await coro
    except Exception as exc:
        return exc


class WorkerService:
    def __init__(self, nc: NATS, backend, tokenizer, report: M.CapabilityReport, options: WorkerOptions | None = None):
        self.nc = nc
        self.js = nc.jetstream()
        self.backend = backend
        self.tokenizer = tokenizer
        self.report = report
        self.node_id = report.node_id
        self.opts = options or WorkerOptions()
        self.metrics = WorkerMetrics(self.node_id)
        self.sessions = SessionTable()
        self.node_telemetry = NodeTelemetry(self.node_id)
        self._latency_probe: asyncio.Task | None = None
        self._pending: set[asyncio.Task] = set()  # fire-and-forget sends (rejections)
        self.snapshots = SnapshotStore(
            nc, report, self.metrics, every=self.opts.snapshot_every, url=self.opts.snapshot_url
        )
        self.trail = AuditTrail(self.js, report, self.opts.owned_layer_work)
        self._fault_rng = np.random.default_rng()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"backend-{self.node_id}")
        self._backend_jobs = 0  # calls handed to the backend thread and not finished yet
        self._decode_call_s = float("inf")  # how long the last decode call took
        self._decode_q: deque[Msg] = deque()
        self._prefill_q: deque[Msg] = deque()
        self._work = asyncio.Event()
        self.waves = DecodeWaves(self._decode_q, self._work, self.opts.max_decode_batch, self.opts.batch_wait_ms)
        self._route_subs: dict[str, list] = {}
        self._tasks: list[asyncio.Task] = []
        self._subs: list = []
        self._hb_seq = 0
        self._rejected: dict[str, int] = {}
        self._work_window: deque[tuple[float, str, int, float]] = deque()  # (when, phase, positions, busy s)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        kv = await self.js.key_value(S.KV_NODES)
        await kv.put(self.node_id, M.encode(self.report))
        await self.nc.publish(S.node_caps(self.node_id), M.encode(self.report))
        self._subs.append(await self.nc.subscribe(S.node_control(self.node_id), cb=self._on_control))
        await self.snapshots.start()
        self._tasks = [
            asyncio.create_task(self._process_loop(), name="process"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._reap_loop(), name="reaper"),
        ]
        await self._heartbeat()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sub in self._subs:
            await sub.unsubscribe()
        for route_id in list(self._route_subs):
            await self._unbind(route_id)
        for s in list(self.sessions):
            await self._close(s.session_id)
        await self.snapshots.stop()
        self._pool.shutdown(wait=True)

    async def _call(self, fn, *args):
        """Run a backend/tokenizer call on the backend thread (one at a time, in submission order)."""
        self._backend_jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._backend_jobs -= 1

    # ------------------------------------------------------------------ control plane

    async def _on_control(self, msg: Msg) -> None:
        try:
            req = M.decode(msg.data, M.ControlRequest)
            reply = await self._control(req)
        except Exception as exc:  # every failure is an explicit reply, never silence
            if isinstance(exc, MalformedMessage):
                self._count_rejected("bad_control")
            code = getattr(exc, "reason", type(exc).__name__)
            reply = M.ControlError(code=str(code), message=str(exc))
        if msg.reply:
            await msg.respond(M.encode(reply))

    async def _control(self, req):
        if isinstance(req, M.Ping):
            return M.Pong(node_id=self.node_id, sent_at=req.sent_at)
        if isinstance(req, M.SessionsQuery):
            return self._sessions_report()
        if isinstance(req, M.TokenizeRequest):
            return await self._tokenize(req)
        if isinstance(req, M.SessionOpen):
            return await self._open(req)
        if isinstance(req, M.SessionResume):
            return await self._resume(req)
        if isinstance(req, M.SessionClose):
            freed = await self._close(req.session_id)
            return M.SessionClosed(session_id=req.session_id, node_id=self.node_id, freed_bytes=freed)
        raise ValueError(f"unsupported control request {type(req).__name__}")

    async def _tokenize(self, req: M.TokenizeRequest) -> M.TokenizeReply:
        if req.messages is not None:
            text, tokens = await self._call(self.tokenizer.encode_chat, req.messages, req.add_generation_prompt)
        elif req.text is not None:
            text = req.text
            tokens = await self._call(self.tokenizer.encode, text)
        else:
            raise ValueError("tokenize needs text or messages")
        return M.TokenizeReply(tokens=tokens, text=text)

    def _check_hop(self, req: M.SessionOpen) -> M.RouteHop:
        """Is this node the hop ``req`` names, with the same layers and cache ABI?"""
        S.check_token(req.session_id, "session id")
        route = req.route
        if not 0 <= req.hop_index < len(route.hops):
            raise ValueError(f"hop index {req.hop_index} is outside route {route.route_id}")
        hop = route.hops[req.hop_index]
        if hop.node_id != self.node_id:
            raise ValueError(f"hop {req.hop_index} of route {route.route_id} is node {hop.node_id}, not {self.node_id}")
        b = self.backend
        if (hop.layer_start, hop.layer_end) != (b.layer_start, b.layer_end):
            raise ValueError(
                f"this node serves layers [{b.layer_start}, {b.layer_end}), the route asks for [{hop.layer_start}, {hop.layer_end})"
            )
        if hop.cache_abi != self.report.cache_abi:
            raise ValueError(f"cache ABI {hop.cache_abi} does not match this node's {self.report.cache_abi}")
        if req.prompt_tokens <= 0 or req.prompt_tokens + req.sampling.max_tokens > req.n_ctx:
            raise ValueError(
                f"prompt of {req.prompt_tokens} tokens + {req.sampling.max_tokens} new ones exceeds n_ctx {req.n_ctx}"
            )
        if req.chunk_size <= 0:
            raise ValueError("chunk size must be positive")
        return hop

    async def _open(self, req: M.SessionOpen) -> M.SessionOpened:
        route = req.route
        hop = self._check_hop(req)
        cache_bytes = await self._call(self.backend.open_session, req.session_id, req.n_ctx)
        s = HopSession(open=req, node_id=self.node_id)
        if s.is_tail:
            self._start_tail(s)
        self.sessions.add(s)
        await self._bind(route, req.hop_index)
        self._update_gauges()
        return M.SessionOpened(
            session_id=req.session_id,
            route_id=route.route_id,
            node_id=self.node_id,
            hop_index=req.hop_index,
            layer_start=hop.layer_start,
            layer_end=hop.layer_end,
            cache_bytes=cache_bytes,
        )

    def _start_tail(self, s: HopSession) -> None:
        """The tail's own state: the text decoder and the generation's telemetry."""
        o = s.open
        s.decoder = self.tokenizer.stream_decoder()
        s.progress = GenerationProgress(
            o.session_id, o.route.route_id, o.route.model_preset, [h.node_id for h in o.route.hops], o.prompt_tokens
        )

    async def _resume(self, req: M.SessionResume) -> M.SessionResumed:
        """Route repair: move a session onto a new route at a snapshot position (see SessionResume)."""
        o = req.open
        self._check_hop(o)
        old = self.sessions.get(o.session_id)
        if not 0 <= req.position < req.replay_end <= o.n_ctx:
            raise ValueError(
                f"resume at {req.position} with replay up to {req.replay_end} does not fit n_ctx {o.n_ctx}"
            )
        snapshot = None
        if req.restore:
            if old is not None:
                raise ValueError(f"session {o.session_id} is already open here; only a replacement restores")
            meta, blob = await self.snapshots.find(o.session_id, req.position)
            await self._call(self.backend.import_state, o.session_id, o.n_ctx, meta.position, blob)
            position, snapshot = meta.position, object_name(meta)
        else:
            if old is None:  # e.g. this node restarted: its hot KV is gone
                raise NeuronBusError("unknown_session", f"{self.node_id} holds no session {o.session_id}")
            await self._call(self.backend.truncate, o.session_id, req.position)
            position = req.position
        s = HopSession(open=o, node_id=self.node_id, position=position, replay_end=req.replay_end)
        if s.is_tail:
            self._start_tail(s)
            s.generated = list(req.generated)
            s.text = "".join(s.decoder.push(t) for t in s.generated)
            s.ring_seq_base = -(-(req.replay_end - position) // o.chunk_size) - len(s.generated)
            s.progress.prefill(o.prompt_tokens)
            s.progress.generated = len(s.generated)
        self.sessions.add(s)  # replaces the old route's entry: its stray messages are now wrong_route
        await self._bind(o.route, o.hop_index)
        if old is not None and old.route.route_id not in self.sessions.routes():
            await self._unbind(old.route.route_id)
        self._update_gauges()
        return M.SessionResumed(
            session_id=o.session_id,
            route_id=o.route.route_id,
            node_id=self.node_id,
            hop_index=o.hop_index,
            position=position,
            snapshot=snapshot,
        )

    async def _close(self, session_id: str, failed: bool = False) -> int:
        s = self.sessions.pop(session_id)
        if s is None:
            return 0
        self.node_telemetry.session_ended(failed)
        self.snapshots.forget(session_id)
        freed = await self._call(self.backend.cache_bytes, session_id)
        await self._call(self.backend.close_session, session_id)
        await self.trail.close(s.open)
        if s.route.route_id not in self.sessions.routes():
            await self._unbind(s.route.route_id)
        self._update_gauges()
        return freed

    def _sessions_report(self) -> M.SessionsReport:
        now = time.monotonic()
        infos = [
            M.SessionInfo(
                session_id=s.session_id,
                route_id=s.route.route_id,
                hop_index=s.hop_index,
                position=s.position,
                cache_bytes=self.backend.cache_bytes(s.session_id),
                idle_seconds=round(now - s.last_used, 3),
            )
            for s in self.sessions
        ]
        return M.SessionsReport(
            node_id=self.node_id,
            sessions=infos,
            cache_bytes_total=sum(i.cache_bytes for i in infos),
            backend_forward_calls=self.backend.forward_calls,
            rejected=dict(self._rejected),
            snapshots_written=self.snapshots.written,
            snapshot_failures=dict(self.snapshots.failures),
        )

    # ------------------------------------------------------------------ consumers

    async def _bind(self, route: M.RouteAssignment, hop_index: int) -> None:
        if route.route_id in self._route_subs:
            return
        subs = []
        for phase, stream, pending, queue in (
            ("decode", S.STREAM_DECODE, self.opts.decode_ack_pending, self._decode_q),
            ("prefill", S.STREAM_PREFILL, 1, self._prefill_q),
        ):

            async def enqueue(msg: Msg, queue=queue) -> None:
                queue.append(msg)
                self._work.set()

            subject = S.hop_input(route.route_id, hop_index, phase)
            await self._drop_consumers(stream, subject)  # a work queue allows one consumer per subject
            sub = await self.js.subscribe(
                subject,
                stream=stream,
                cb=enqueue,
                manual_ack=True,
                pending_msgs_limit=-1,
                config=ConsumerConfig(
                    ack_policy=AckPolicy.EXPLICIT,
                    deliver_policy=DeliverPolicy.ALL,
                    max_ack_pending=pending,
                    ack_wait=120.0,
                    inactive_threshold=30.0,
                ),
            )
            subs.append((sub, stream, subject))
        self._route_subs[route.route_id] = subs

    async def _drop_consumers(self, stream: str, subject: str) -> None:
        """Delete consumers left on ``subject`` (by an earlier binding or a previous run of this node)."""
        for info in await self.js.consumers_info(stream):
            if info.config.filter_subject == subject:
                try:
                    await self.js.delete_consumer(stream, info.name)
                except Exception:  # already gone
                    pass

    async def _unbind(self, route_id: str) -> None:
        for sub, stream, subject in self._route_subs.pop(route_id, []):
            try:
                await sub.unsubscribe()
                await self._drop_consumers(stream, subject)
            except Exception:  # connection already closing
                pass

    # ------------------------------------------------------------------ data plane

    async def _process_loop(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            while self._decode_q or self._prefill_q:
                try:
                    if self._decode_q:
                        await self._handle(await self.waves.next(self.sessions, self.backend), "decode")
                    else:
                        await self._handle([self._prefill_q.popleft()], "prefill")
                except asyncio.CancelledError:
                    raise
                except Exception:  # never let one message kill the loop
                    log.exception("worker %s: unexpected error while processing", self.node_id)

    def _admit(self, msg: Msg, phase: str) -> tuple[HopSession, M.ActivationHeader, np.ndarray] | None:
        """Decode and check one message; reject (and say so) before any model work."""
        self.metrics.seam(phase, "in", len(msg.data))
        try:
            header, x = codec.decode(msg.headers, msg.data, max_body=self.opts.max_body)
            if header.phase != phase:
                raise SessionMismatch("wrong_phase", f"{header.phase} message on the {phase} subject")
            s = self.sessions.check(header)
            return s, header, x
        except (MalformedMessage, SessionMismatch) as exc:
            self._reject(msg, exc.reason, str(exc))
            return None

    def _count_rejected(self, reason: str) -> None:
        self.metrics.rejected.labels(reason).inc()
        self._rejected[reason] = self._rejected.get(reason, 0) + 1

    def _reject(self, msg: Msg, reason: str, text: str) -> None:
        self._count_rejected(reason)
        sid = (msg.headers or {}).get("session_id", "")
        self._background(msg.term())
        try:
            subject = S.session_error(sid)
        except ValueError:
            return  # no usable session id: counted, nobody to tell
        s = self.sessions.get(sid)
        err = M.SessionError(
            session_id=sid,
            route_id=(msg.headers or {}).get("route_id", ""),
            phase=s.phase if s else "failed",
            code=reason,
            message=f"{self.node_id}: rejected message: {text}",
            node_id=self.node_id,
            fatal=False,
        )
        self._background(self.nc.publish(subject, M.encode(err)))

    def _background(self, coro) -> None:
        """Run ``coro`` without waiting for it, holding a reference until it is done."""
        task = asyncio.create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _handle(self, msgs: list[Msg], phase: str) -> None:
        work, seen = [], set()
        for m in msgs:
            a = self._admit(m, phase)
            if a is None:
                continue
            if a[0].session_id in seen:  # a copy of a step already in this batch
                self._reject(m, "replayed", f"a second step for session {a[0].session_id} in one batch")
                continue
            seen.add(a[0].session_id)
            work.append((m, a))
        if work:
            await self._run(work, phase)

    async def _run(self, work: list[tuple[Msg, tuple]], phase: str) -> None:
        try:
            outs = await self._compute([a for _, a in work], phase)
        except Exception as exc:
            if len(work) > 1:  # a batch failed as a whole: run one by one so only the bad session fails
                for item in work:
                    await self._run([item], phase)
                return
            ((m, (s, _, _)),) = work
            if getattr(exc, "reason", None) == "bad_input":  # the backend refused it before any model work
                self._reject(m, "bad_input", str(exc))
                return
            await self._fail(s, "backend_error", str(exc))
            await m.term()
            return
        live = []
        for (m, (s, header, x)), out in zip(work, outs):
            if self.sessions.get(s.session_id) is not s:  # closed or moved to a repaired route meanwhile
                await m.ack()
                continue
            live.append((m, s, header, x.shape[0], out, s.position))
            s.position += x.shape[0]
            self.trail.worked(s.session_id, phase, x.shape[0])
            s.seq += 1
            s.last_used = time.monotonic()
        # a batch's outputs go on together: their stream acknowledgements overlap instead of queueing
        sends = [self._forward(s, header, n, out) for _, s, header, n, out, _ in live]
        results = [await _settle(sends[0])] if len(sends) == 1 else await asyncio.gather(*sends, return_exceptions=True)
        failure = None
        for (m, s, _, _, _, before), result in zip(live, results):
            if isinstance(result, NeuronBusError) and result.reason == "session_gone":
                await m.term()  # the session closed or moved while its output waited for a full next hop
                continue
            if isinstance(result, BaseException):
                failure = failure or result  # left unacknowledged: redelivered after ack_wait
                continue
            if not s.finished and self.snapshots.due(before, s.position, s.open.prompt_tokens):
                await self._snapshot(s)
            await m.ack()
        if failure is not None:
            raise failure

    def _still_current(self, s: HopSession) -> None:
        """Stop waiting on a full next hop (a dead one, say) once the session closed or moved."""
        if self.sessions.get(s.session_id) is not s:
            raise NeuronBusError("session_gone", f"session {s.session_id} closed or moved to a repaired route")

    async def _snapshot(self, s: HopSession) -> None:
        """Export the session's cache now (it is at a snapshot position) and upload it in the background."""
        if self.snapshots.busy(s.session_id):
            return
        try:
            blob = await self._call(self.backend.export_state, s.session_id)
        except Exception as exc:
            log.warning("worker %s: export of %s failed: %s", self.node_id, s.session_id, exc)
            self.snapshots.failed("export")
            return
        self.snapshots.write(s, blob)

    async def _compute(self, items, phase: str) -> list[np.ndarray]:
        b = self.backend

        def run():
            if self.opts.slow_ms:
                time.sleep(self.opts.slow_ms / 1000.0)
            if phase == "decode" and len(items) > 1:
                return b.decode_batch([(s.session_id, h.position, x) for s, h, x in items])
            s, h, x = items[0]
            fn = b.decode_step if phase == "decode" else b.prefill
            return [fn(s.session_id, h.position, x)]

        took = [0.0]

        def call():
            t0 = time.monotonic()
            try:
                outs = run()
                return (
                    [faults.apply(self.opts.fault, out, self._fault_rng) for out in outs] if self.opts.fault else outs
                )
            finally:
                took[0] = time.monotonic() - t0  # the call alone, without any hand-off

        # A decode call that takes less time than handing it to the backend thread and back runs
        # right here on the event loop. Only when the thread is idle: calls already queued there
        # (a snapshot export, say) must keep their order with this one.
        inline = phase == "decode" and self._decode_call_s < INLINE_STEP_S and self._backend_jobs == 0
        started = time.monotonic()
        outs = call() if inline else await self._call(call)
        busy = took[0]
        if phase == "decode":
            self._decode_call_s = busy
        if inline:
            self.metrics.inline_calls.labels(phase).inc()
        self.metrics.backend_calls.labels(phase).inc()
        self.metrics.backend_seconds.labels(phase).inc(busy)
        n = sum(x.shape[0] for _, _, x in items)
        self.metrics.tokens.labels(phase).inc(n)
        self._work_window.append((started, phase, n, busy))
        return outs

    async def _forward(self, s: HopSession, header: M.ActivationHeader, n: int, out: np.ndarray) -> None:
        """Send a hop's output on: hidden states to the next hop, or a sampled token at the tail."""
        if not s.is_tail:
            nxt = s.header(s.hop_index + 1, header.position, header.phase, s.out_seq, s.route.wire_dtype)
            headers, body = codec.encode(nxt, out, max_body=self.opts.max_body)
            await publish(
                self.js,
                S.hop_input(s.route.route_id, s.hop_index + 1, header.phase),
                body,
                headers,
                on_wait=lambda _n: self._still_current(s),
            )
            s.out_seq += 1
            self.metrics.seam(header.phase, "out", len(body))
            return
        end = header.position + n
        if end < s.prefill_end:  # a prefill (or repair replay) chunk that is not the last: progress only
            if end <= s.open.prompt_tokens:
                s.progress.prefill(end)
                await self._telemetry(s)
            return
        await self._emit_token(s, out, end)

    async def _emit_token(self, s: HopSession, logits: np.ndarray, position: int) -> None:
        params = s.open.sampling
        index = len(s.generated)
        pick = sample(logits, params, index, TOP_LOGPROBS if params.logprobs else 0)
        self.trail.observe(s.session_id, index, logits)
        s.generated.append(pick.token_id)
        s.progress.token()
        text = s.decoder.push(pick.token_id)
        finish = None
        if not params.ignore_eos and self.tokenizer.is_end_of_generation(pick.token_id):
            finish, text = "stop", text + s.decoder.flush()
        else:
            combined = s.text + text
            for stop in params.stop:
                cut = combined.find(stop, max(0, len(s.text) - len(stop)))
                if stop and cut >= 0:
                    finish, text = "stop", combined[:cut][len(s.text) :]
                    break
            if finish is None and len(s.generated) >= params.max_tokens:
                finish, text = "length", text + s.decoder.flush()
        s.text += text
        top = None
        if pick.top_logprobs is not None:
            top = {self.tokenizer.piece(t).decode("utf-8", "replace"): lp for t, lp in pick.top_logprobs.items()}
        delta = M.TokenDelta(
            session_id=s.session_id,
            index=index,
            token_id=pick.token_id,
            text=text,
            logprob=pick.logprob,
            top_logprobs=top,
            finished=finish is not None,
            finish_reason=finish,
        )
        token = publish(self.js, S.session_tokens(s.session_id), M.encode(delta))
        if finish is None:  # the ring first (the next step is the critical path); both acks awaited together
            head = s.header(0, position, "decode", s.ring_seq(index), "i32")
            headers, body = codec.encode(head, np.array([pick.token_id], dtype=np.int32))
            await asyncio.gather(publish(self.js, S.hop_input(s.route.route_id, 0, "decode"), body, headers), token)
            self.metrics.seam("decode", "out", len(body))
            if s.progress.due():
                await self._telemetry(s)
        else:
            await token
            s.finished = True
            await self.trail.validation(s.open, s.generated, finish)
            s.progress.finish("done")
            await self._telemetry(s)

    async def _telemetry(self, s: HopSession) -> None:
        await publish(self.js, s.progress.subject, M.encode(s.progress.snapshot()))

    async def _fail(self, s: HopSession, code: str, message: str) -> None:
        """A fatal session error: tell the client, free this hop's cache."""
        err = M.SessionError(
            session_id=s.session_id,
            route_id=s.route.route_id,
            phase=s.phase,
            code=code,
            message=f"{self.node_id}: {message}",
            node_id=self.node_id,
            position=s.position,
            fatal=True,
        )
        await self.nc.publish(S.session_error(s.session_id), M.encode(err))
        if s.progress:
            s.progress.fail(f"{code}: {message}", s.phase, self.node_id)
            await self._telemetry(s)
        await self._close(s.session_id, failed=True)

    # ------------------------------------------------------------------ heartbeats, reaping

    def _update_gauges(self) -> None:
        self.metrics.sessions_active.set(len(self.sessions))
        self.metrics.cache_bytes.set(sum(self.backend.cache_bytes(s.session_id) for s in self.sessions))

    def _measured_tps(self, phase: str) -> float:
        """Positions per busy second over the last 30 s of real work (capacity, not load)."""
        now = time.monotonic()
        while self._work_window and now - self._work_window[0][0] > 30.0:
            self._work_window.popleft()
        work = [(n, busy) for _, p, n, busy in self._work_window if p == phase]
        n, busy = sum(w[0] for w in work), sum(w[1] for w in work)
        if n < 8 or busy <= 0:  # not enough real work yet: the self-benchmark stands
            return self.report.decode_tokens_per_second if phase == "decode" else self.report.prefill_tokens_per_second
        return n / busy

    async def _heartbeat(self) -> None:
        self._hb_seq += 1
        hb = M.NodeHeartbeat(
            node_id=self.node_id,
            seq=self._hb_seq,
            ts=time.time(),
            layer_start=self.report.layer_start,
            layer_end=self.report.layer_end,
            cache_abi=self.report.cache_abi,
            sessions_active=len(self.sessions),
            cache_bytes=int(self.metrics.value("neuron_cache_bytes")),
            queue_depth=len(self._decode_q) + len(self._prefill_q),
            prefill_tokens_per_second=self._measured_tps("prefill"),
            decode_tokens_per_second=self._measured_tps("decode"),
            memory_pressure=psutil.virtual_memory().percent / 100.0,
            disk_read_bytes_per_second=self.node_telemetry.disk_read_rate(),
            neighbour_latency_ms=dict(self.node_telemetry.latency_ms),
            route_failure_rate=self.node_telemetry.failure_rate(),
            cache_warmth=min(1.0, len(self.sessions) / 8.0),
        )
        await self.nc.publish(S.node_heartbeat(self.node_id), M.encode(hb))
        if self._latency_probe is None or self._latency_probe.done():  # pings run beside the heartbeats
            routes = {s.route.route_id: s.route for s in self.sessions}
            self._latency_probe = asyncio.create_task(
                self.node_telemetry.refresh_latency(self.nc, neighbours(self.node_id, list(routes.values())))
            )

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.opts.heartbeat_interval)
            try:
                await self._heartbeat()
            except Exception:
                log.warning("worker %s: heartbeat failed", self.node_id, exc_info=True)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(min(10.0, max(0.5, self.opts.idle_timeout / 4)))
            now = time.monotonic()
            for s in list(self.sessions):
                if now - s.last_used > self.opts.idle_timeout:
                    await self._fail(
                        s, "idle_timeout", f"session idle for more than {self.opts.idle_timeout:.0f}s; cache freed"
                    )
