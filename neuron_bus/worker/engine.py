"""A hop's engine: admission, compute and outputs for the activation messages of every session a
worker serves. No I/O: the shell (service.py) hands it what its consumers received and
publishes, acknowledges and reports what it returns (the split vLLM makes between its engine
core and the process around it).

One batch goes through three calls:
- `admit(batch, phase)`: decode each message (codec) and check its session state key against the
  session table, then its MAC with the session's input link key (trust/sealing.py; a sealed body
  is opened only then), before any model work; a mismatch is a typed `Rejection`, never a silent
  continuation; a second step of one session in one batch is a replay.
- `compute(steps, phase)`: the backend call — one batched call for a decode wave, one call for a
  prefill chunk; a batch that fails as a whole is re-run step by step, so only the bad session
  fails. A speculative step first drops the previous step's rejected drafts from the cache (it
  starts where the tail's accepted tokens end), then runs all its positions in one call. Touches
  only the backend: the shell may run it on the backend's thread.
- `advance(steps, results)`: the bookkeeping after compute (positions, sequence numbers, the audit
  trail's counts) and each step's outcome: an `Output` (hidden states for the next hop, or at the
  tail the sampled token's delta and the ring step back to hop 0; whether a snapshot is due), a
  `Failed` step, or `Gone` (the session closed or moved while it computed).

The session table's lifecycle (open, resume, close) is checked and recorded here too; the backend
work and the bus side of it are the shell's (lifecycle.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from neuron_bus import codec
from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.errors import MalformedMessage, NeuronBusError, SessionMismatch
from neuron_bus.trust import fault as faults
from neuron_bus.trust import sealing
from neuron_bus.worker.session_table import HopSession, SessionTable
from neuron_bus.worker.tail import TailDecoder, TokenStep
from workers.errors import Reason

BENCH_PREFILL_POSITIONS = 256  # positions per prefill call a slowed self-benchmark is reckoned for


def slowed(prefill_tps: float, decode_tps: float, slow_ms: float) -> tuple[float, float]:
    """A self-benchmark's (prefill, decode) tokens/s once every backend call takes ``slow_ms``
    longer (injected slowness): a prefill call of ``BENCH_PREFILL_POSITIONS``, a decode call of one."""

    def one(tokens_per_second: float, positions_per_call: int) -> float:
        if not slow_ms or tokens_per_second <= 0:
            return tokens_per_second
        return positions_per_call / (positions_per_call / tokens_per_second + slow_ms / 1000.0)

    return one(prefill_tps, BENCH_PREFILL_POSITIONS), one(decode_tps, 1)


@dataclass
class EngineOptions:
    max_body: int = codec.DEFAULT_MAX_BODY
    slow_ms: float = 0.0  # add this much delay per backend call (fault injection for tests)
    snapshot_every: int = 0  # a snapshot is due whenever a decoding session crosses a multiple of this
    fault: str | None = None  # fault injection for tests: "perturb", "hang" (trust/fault.py)
    require_keys: bool = False  # refuse sessions opened without link keys (a worker with a credential does)
    adaptive_drafts: bool = True  # speculative sessions: send the drafts that pay (False: every draft found)


@dataclass
class Incoming:
    """An activation message as a consumer received it."""

    handle: Any  # the transport's message: the shell acknowledges or terminates it
    headers: dict[str, str] | None
    data: bytes
    arrived: float = field(default_factory=time.monotonic)  # when the consumer handed it over
    _header: M.ActivationHeader | MalformedMessage | None = field(default=None, init=False, repr=False)

    def header(self) -> M.ActivationHeader:
        """Its decoded header, decoded once (waves and admission both read it); MalformedMessage if it is not one."""
        if self._header is None:
            try:
                self._header = codec.decode_header(self.headers)
            except MalformedMessage as exc:
                self._header = exc
        if isinstance(self._header, MalformedMessage):
            raise self._header.with_traceback(None)  # the same refusal each time, not a traceback grown by each raise
        return self._header

    @property
    def session_id(self) -> str | None:
        try:
            return self.header().session_id
        except MalformedMessage:
            return codec.session_of(self.headers) or None

    @property
    def route_id(self) -> str:
        try:
            return self.header().route_id
        except MalformedMessage:
            return ""

    @property
    def rows(self) -> int:
        """The positions it carries, by its header's shape (1 when that is malformed: the engine
        refuses such a message)."""
        try:
            shape = self.header().shape
        except MalformedMessage:
            return 1
        return max(1, shape[0]) if shape else 1


@dataclass
class Step:
    """An admitted message: its session, its state key and its input."""

    handle: Any
    session: HopSession
    header: M.ActivationHeader
    x: np.ndarray
    compute_s: float = 0.0  # this step's share of its backend call

    @property
    def positions(self) -> int:
        return int(self.x.shape[0])


@dataclass
class Rejection:
    """A message refused before any model work, and why (``reason`` is the metrics label)."""

    handle: Any
    reason: Reason
    message: str
    session_id: str  # as the message's headers say it (may be empty or invalid)
    route_id: str


@dataclass
class Send:
    """One message for the bus; ``seam`` names the activation phase it carries ("" for others)."""

    subject: str
    body: bytes
    headers: dict[str, str] | None = None
    seam: str = ""


@dataclass
class Output:
    """A computed step: what to publish (all of it accepted before the input is acknowledged)."""

    step: Step
    sends: list[Send] = field(default_factory=list)
    telemetry: M.GenerationTelemetry | None = None
    token: TokenStep | None = None  # the tail's sampled token (a speculative step's last one)
    snapshot: bool = False  # export the session's cache once the sends are accepted

    @property
    def finished(self) -> bool:
        return self.token is not None and self.token.finished


@dataclass
class Failed:
    """A step the backend refused (``fatal`` False: only this message) or failed on (the session fails)."""

    step: Step
    reason: Reason
    message: str
    fatal: bool


@dataclass
class Gone:
    """The step's session closed or moved to a repaired route while it computed: drop the result."""

    step: Step


Outcome = Output | Failed | Gone


def snapshot_due(every: int, before: int, after: int, prompt_tokens: int) -> bool:
    """A session moved from position ``before`` to ``after``: is a snapshot due (whenever it crosses a
    multiple of ``every`` once its prompt is in; 0: never)? Every hop sees every position, so all
    hops of a route snapshot at the same positions."""
    return bool(every) and after >= prompt_tokens and before // every != after // every


def _input_of(route: M.RouteAssignment, hop_index: int, phase: str, session_id: str) -> str:
    return S.hop_input(route.hops[hop_index].node_id, route.route_id, hop_index, phase, session_id)


class HopEngine:
    def __init__(self, node_id: str, cache_abi: str, backend, tokenizer, trail, options: EngineOptions | None = None):
        self.node_id = node_id
        self.cache_abi = cache_abi
        self.backend = backend
        self.tokenizer = tokenizer
        self.trail = trail  # the audit trail's bookkeeping (worked, observe): no I/O
        self.opts = options or EngineOptions()
        self.sessions = SessionTable()
        self.draining = False  # moving to other layers: no new sessions (mover.py)
        self.stuck = False  # a backend call far overdue, as of the last heartbeat: no new sessions
        self._fault_rng = np.random.default_rng()

    # ------------------------------------------------------------------ admission

    def admit(self, batch: list[Incoming], phase: str) -> tuple[list[Step], list[Rejection]]:
        steps: list[Step] = []
        rejected: list[Rejection] = []
        seen: set[str] = set()
        for m in batch:
            try:
                s, header, x = self._admit(m, phase)
                if s.session_id in seen:  # a copy of a step already in this batch
                    raise SessionMismatch(Reason.REPLAYED, f"a second step for session {s.session_id} in one batch")
            except (MalformedMessage, SessionMismatch) as exc:
                rejected.append(Rejection(m.handle, exc.reason, str(exc), m.session_id or "", m.route_id))
                continue
            seen.add(s.session_id)
            steps.append(Step(m.handle, s, header, x))
        return steps, rejected

    def _admit(self, m: Incoming, phase: str) -> tuple[HopSession, M.ActivationHeader, np.ndarray]:
        """Header, (plain) body, state key, MAC, (sealed) body: each refused with its reason in that order."""
        header = m.header()
        held = self.sessions.get(header.session_id)
        sealed = held is not None and held.open.encrypt
        x = None if sealed else codec.decode_body(header, m.data, max_body=self.opts.max_body)
        if header.phase != phase:
            raise SessionMismatch(Reason.WRONG_PHASE, f"{header.phase} message on the {phase} subject")
        s = self.sessions.check(header)
        if s.tail is not None and header.phase == "decode":
            s.tail.check_step(header.position, header.shape[0] if header.shape else 0)
        if s.open.input_key:  # an authenticated session: nothing unsigned reaches the model
            body = sealing.verify(header, sealing.head_of(m.headers or {}), m.data, s.open.input_key, s.open.encrypt)
            if s.open.encrypt:
                x = codec.decode_body(header, body, max_body=self.opts.max_body)
        if x is None:  # the session was sealed when the body arrived and is not now (closed, reopened)
            raise SessionMismatch(Reason.BAD_SEAL, f"session {s.session_id}: sealed body for an unsealed session")
        return s, header, x

    # ------------------------------------------------------------------ compute

    def benchmark(self) -> tuple[float, float]:
        """The backend's self-benchmark taken again (on the backend thread: it computes), as
        slow as this engine makes every call (``slow_ms``, fault injection)."""
        prefill, decode = self.backend.benchmark()
        return slowed(prefill, decode, self.opts.slow_ms)

    def compute(self, steps: list[Step], phase: str) -> list[np.ndarray | Exception]:
        """Each step's backend output, or the exception it failed with."""
        try:
            return self._call(steps, phase)
        except Exception as exc:
            if len(steps) == 1:
                return [exc]
        return [self.compute([st], phase)[0] for st in steps]  # a batch failed as a whole: one by one

    def _call(self, steps: list[Step], phase: str) -> list[np.ndarray | Exception]:
        if self.opts.slow_ms:
            time.sleep(self.opts.slow_ms / 1000.0)
        faults.before_call(self.opts.fault)
        b = self.backend
        t0 = time.perf_counter()
        batch = [(st.session.session_id, st.header.position, st.x) for st in steps]
        if phase == "decode" and any(st.session.open.speculative for st in steps):
            for sid, position, _ in batch:  # back to where the tail's accepted tokens end
                if position < b.session_position(sid):
                    b.truncate(sid, position)
            outs: list[np.ndarray] = b.decode_rows(batch)
        elif phase == "decode" and len(steps) > 1:
            outs = b.decode_batch(batch)
        elif len(steps) > 1:
            outs = b.prefill_batch(batch)
        else:
            run = b.decode_step if phase == "decode" else b.prefill
            outs = [run(*batch[0])]
        took, rows = time.perf_counter() - t0, sum(st.positions for st in steps)
        for st in steps:
            st.compute_s = took * st.positions / rows
        if self.opts.fault:
            outs = [faults.apply(self.opts.fault, out, self._fault_rng) for out in outs]
        return list(outs)

    # ------------------------------------------------------------------ outcomes

    def advance(self, steps: list[Step], results: list[np.ndarray | Exception]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for st, result in zip(steps, results):
            s = st.session
            if not self.is_current(s):
                outcomes.append(Gone(st))
            elif isinstance(result, Exception):
                refused = getattr(result, "reason", None) == Reason.BAD_INPUT  # refused before any model work
                reason = Reason.BAD_INPUT if refused else Reason.BACKEND_ERROR
                # a prompt chunk the head refuses (a token the model does not have) cannot be sent again
                # right: the session ends, explicitly, instead of waiting for it
                prompt = s.hop_index == 0 and st.header.phase == "prefill"
                outcomes.append(Failed(st, reason, str(result), fatal=not refused or prompt))
            else:
                before = st.header.position
                s.position = before + st.positions  # a speculative step may start below the last one's end
                s.drafts_held = st.positions - 1 if st.header.phase == "decode" else 0
                s.seq += 1
                s.last_used = time.monotonic()
                self.trail.worked(s.session_id, st.header.phase, st.positions)
                snap = snapshot_due(self.opts.snapshot_every, before, s.position, s.open.prompt_tokens)
                outcomes.append(self._output(st, result, snap))
        return outcomes

    def _output(self, st: Step, out: np.ndarray, snapshot: bool) -> Output:
        s, h = st.session, st.header
        if s.tail is None:  # hidden states on to the next hop
            nxt = s.header(s.hop_index + 1, h.position, h.phase, s.out_seq, s.route.wire_dtype)
            headers, body = self._pack(s, nxt, out)
            s.out_seq += 1
            send = Send(_input_of(s.route, s.hop_index + 1, h.phase, s.session_id), body, headers, seam=h.phase)
            return Output(st, [send], snapshot=snapshot)
        end = h.position + st.positions
        if end < s.prefill_end:  # a prefill (or repair replay) chunk that is not the last: progress only
            news = s.tail.prefilled(end)
            return Output(st, telemetry=s.tail.progress.snapshot() if news else None, snapshot=snapshot)
        return self._token(st, out, end, snapshot)

    def _token(self, st: Step, logits: np.ndarray, end: int, snapshot: bool) -> Output:
        """The tail's tokens from a step's logits (its last row's, or a speculative step's every
        row), and the ring step that feeds the next ones to hop 0."""
        s, tail = st.session, st.session.tail
        assert tail is not None
        rows = logits.reshape(-1, logits.shape[-1])
        if tail.spec is not None and st.header.phase == "decode":
            tail.spec.row_compute(st.compute_s, st.positions)
            tokens = tail.verify(rows, lambda index, row: self.trail.observe(s.session_id, index, row))
        else:
            self.trail.observe(s.session_id, len(tail.generated), rows[-1])
            tokens = [tail.token(rows[-1])]
        last = tokens[-1]
        sends = []
        if last.finished:
            s.finished = True
        else:  # the ring step first: it is the critical path of the next token
            position = end - rows.shape[0] + len(tokens)  # where the last token goes
            head = s.header(0, position, "decode", tail.ring_seq(), "i32")
            ids = tail.ring_step(position, time.monotonic())
            headers, body = self._pack(s, head, np.array(ids, dtype=np.int32))
            sends.append(Send(_input_of(s.route, 0, "decode", s.session_id), body, headers, seam="decode"))
        deltas = S.session_tokens(s.open.owner, s.session_id)
        sends += [Send(deltas, M.encode(t.delta)) for t in tokens]
        telemetry = tail.progress.snapshot() if last.finished or tail.progress.due() else None
        return Output(st, sends, telemetry=telemetry, token=last, snapshot=snapshot and not last.finished)

    def _pack(self, s: HopSession, header: M.ActivationHeader, array: np.ndarray) -> tuple[dict[str, str], bytes]:
        """Encode an output and, on an authenticated session, sign (and seal) it with the output link key."""
        headers, body = codec.encode(header, array, max_body=self.opts.max_body)
        if not s.open.output_key:
            return headers, body
        return sealing.seal(header, headers, body, s.open.output_key, s.open.encrypt)

    def is_current(self, s: HopSession) -> bool:
        """Is ``s`` still this node's session (not closed, not replaced by a repaired route's)?"""
        return self.sessions.get(s.session_id) is s

    # ------------------------------------------------------------------ session table lifecycle

    def check_open(self, req: M.SessionOpen) -> M.RouteHop:
        """Is this node the hop ``req`` names, with the same layers and cache ABI, and does it fit?"""
        S.check_token(req.session_id, "session id")
        if self.draining:
            raise NeuronBusError(Reason.DRAINING, f"{self.node_id} is moving to other layers and takes no new sessions")
        if self.stuck:  # the session's calls would queue behind the stuck one
            raise NeuronBusError(Reason.STUCK, f"{self.node_id}'s backend is stuck in a call and takes no new sessions")
        route = req.route
        if why := M.protocol_mismatch(self.node_id, f"route {route.route_id} was assigned under", route.protocol):
            raise NeuronBusError(Reason.PROTOCOL, why)
        if not 0 <= req.hop_index < len(route.hops):
            raise ValueError(f"hop index {req.hop_index} is outside route {route.route_id}")
        hop = route.hops[req.hop_index]
        if hop.node_id != self.node_id:
            raise ValueError(f"hop {req.hop_index} of route {route.route_id} is node {hop.node_id}, not {self.node_id}")
        b = self.backend
        if (hop.layer_start, hop.layer_end) != (b.layer_start, b.layer_end):
            raise ValueError(
                f"this node serves layers [{b.layer_start}, {b.layer_end}), "
                f"the route asks for [{hop.layer_start}, {hop.layer_end})"
            )
        if hop.cache_abi != self.cache_abi:
            raise ValueError(f"cache ABI {hop.cache_abi} does not match this node's {self.cache_abi}")
        if req.prompt_tokens <= 0 or req.prompt_tokens + req.sampling.max_tokens > req.n_ctx:
            raise ValueError(
                f"prompt of {req.prompt_tokens} tokens + {req.sampling.max_tokens} new ones exceeds n_ctx {req.n_ctx}"
            )
        if req.chunk_size <= 0:
            raise ValueError("chunk size must be positive")
        self._check_speculative(req)
        self._check_prefix(req)
        self._check_keys(req)
        return hop

    @staticmethod
    def _check_prefix(req: M.SessionOpen) -> None:
        """Prefix reuse fields that agree with each other and with the prompt (neuron_bus/prefix.py)."""
        if len(req.prefix_blocks) > (req.prompt_tokens - 1) // M.PREFIX_BLOCK:
            raise ValueError(
                f"{len(req.prefix_blocks)} prefix blocks of {M.PREFIX_BLOCK} tokens do not fit before the last "
                f"of {req.prompt_tokens} prompt tokens"
            )
        if any(len(h) != 32 for h in req.prefix_blocks):
            raise ValueError("prefix block hashes are 32 hex digits")
        p = req.prefix
        if p is None:
            return
        k = p.positions // M.PREFIX_BLOCK
        if req.reuse_prefix or p.positions % M.PREFIX_BLOCK or not 0 < k <= len(req.prefix_blocks):
            raise ValueError(f"a prefix of {p.positions} positions is not one of the session's prefix blocks")
        if req.prefix_blocks[k - 1] != p.block_hash:
            raise ValueError(f"prefix {p.block_hash} is not the session's prefix of {p.positions} positions")

    def _check_speculative(self, req: M.SessionOpen) -> None:
        """Speculative steps need a cache that can drop rejected drafts (not recurrent state)."""
        if not 0 <= req.speculative <= M.MAX_SPECULATIVE:
            raise ValueError(
                f"speculative must be between 0 and {M.MAX_SPECULATIVE} draft tokens, got {req.speculative}"
            )
        cap = self.backend.capability
        if req.speculative and not cap.supports_truncate:
            raise NeuronBusError(
                Reason.CANNOT_SPECULATE,
                f"{self.node_id}: {cap.model_arch} layers [{self.backend.layer_start}, {self.backend.layer_end}) keep "
                "a recurrent state that cannot drop rejected drafts; open the session without speculative",
            )

    def _check_keys(self, req: M.SessionOpen) -> None:
        """The session's owner and link keys: required when this node requires them, well formed,
        and an open of a session this node holds must come from the client that holds its key."""
        S.check_token(req.owner, "owner")
        if self.opts.require_keys and not (req.input_key and req.output_key):
            raise NeuronBusError(
                Reason.UNAUTHENTICATED, f"{self.node_id} requires session keys (SessionOpen.input_key)"
            )
        for key in (req.input_key, req.output_key):
            if key:
                sealing.LinkKey.parse(key)
        old = self.sessions.get(req.session_id)
        if old is not None and old.open.input_key and old.open.input_key != req.input_key:
            raise NeuronBusError(
                Reason.SESSION_EXISTS, f"{self.node_id} holds session {req.session_id} for another client"
            )

    def check_close(self, req: M.SessionClose) -> None:
        """Only the client that opened a session (it holds the hop's input key) may close it."""
        s = self.sessions.get(req.session_id)
        if s is not None and not sealing.proven(s.open.input_key, req.proof, sealing.close_parts(req)):
            raise NeuronBusError(Reason.NOT_OWNER, f"closing session {req.session_id} needs its client's proof")

    def keep_alive(self, req: M.SessionKeepAlive) -> None:
        """The session's client still wants it: not idle from now (only that client may say so)."""
        s = self.sessions.get(req.session_id)
        if s is None or s.route.route_id != req.route_id:
            raise NeuronBusError(
                Reason.UNKNOWN_SESSION, f"{self.node_id} holds no session {req.session_id} on route {req.route_id}"
            )
        if not sealing.proven(s.open.input_key, req.proof, sealing.keep_alive_parts(req)):
            raise NeuronBusError(Reason.NOT_OWNER, f"keeping session {req.session_id} needs its client's proof")
        s.last_used = time.monotonic()

    def check_resume(self, req: M.SessionResume) -> HopSession | None:
        """The session a resume replaces here (None: a new replacement node), after checking ``req``."""
        o = req.open
        self.check_open(o)
        if not 0 <= req.position < req.replay_end <= o.n_ctx:
            raise ValueError(
                f"resume at {req.position} with replay up to {req.replay_end} does not fit n_ctx {o.n_ctx}"
            )
        old = self.sessions.get(o.session_id)
        if old is not None and not sealing.proven(old.open.input_key, req.proof, sealing.resume_parts(req)):
            raise NeuronBusError(Reason.NOT_OWNER, f"moving session {o.session_id} needs its client's proof")
        if req.restore and old is not None:
            raise ValueError(f"session {o.session_id} is already open here; only a replacement restores")
        if not req.restore and old is None:  # e.g. this node restarted: its hot KV is gone
            raise NeuronBusError(Reason.UNKNOWN_SESSION, f"{self.node_id} holds no session {o.session_id}")
        return old

    def add(self, req: M.SessionOpen, reused: int = 0) -> HopSession:
        """Record a newly opened session (its cache is allocated, holding ``reused`` prompt positions
        attached from the prefix cache: its prompt arrives from there)."""
        s = HopSession(open=req, node_id=self.node_id, position=reused)
        if s.is_tail:
            s.tail = TailDecoder(req, self.tokenizer, adaptive_drafts=self.opts.adaptive_drafts, reused=reused)
        self.sessions.add(s)
        return s

    def add_resumed(self, req: M.SessionResume, position: int) -> HopSession:
        """Record a session moved onto a repaired route at ``position`` (replacing any old entry:
        the old route's stray messages are now ``wrong_route``)."""
        o = req.open
        s = HopSession(open=o, node_id=self.node_id, position=position, replay_end=req.replay_end)
        if s.is_tail:
            replay_chunks = -(-(req.replay_end - position) // o.chunk_size)
            s.tail = TailDecoder(
                o, self.tokenizer, list(req.generated), replay_chunks, adaptive_drafts=self.opts.adaptive_drafts
            )
        self.sessions.add(s)
        return s
