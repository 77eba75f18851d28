"""A worker's control plane: the requests on ``neuron.node.<id>.ctl``, one handler each.

Ping (latency probes), SessionsQuery (`neuron-bus sessions`), TokenizeRequest (the head tokenizes
prompts and applies the chat template, or checks a prompt's token ids against its vocabulary), SessionOpen / SessionResume / SessionClose
(lifecycle.py; closing and moving a session need its client's proof, engine.py), SessionKeepAlive
(a client whose session waits its turn upstream: not idle; proven too), MoveRange (the
tracker moves a self-placed node: mover.py).
Every failure is an explicit `ControlError` reply naming its reason, never silence.

Requests run concurrently, those naming one session in the order they arrived: over a WAN an
open or a close waits on round trips to the server (consumers, the ledger), and sixteen sessions
opened together must not wait for each other's (a subscription's callbacks would run one at a
time). At most `CONCURRENT` run at once; beyond that the subscription's own queue holds them.

The tokenizer runs on a thread of its own, one call at a time, never behind the backend's: a head
busy with a prompt batch (seconds) would otherwise hold every new request's tokenizing that long.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from nats.aio.msg import Msg

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.errors import MalformedMessage, NeuronBusError
from neuron_bus.tasks import InOrder
from workers.errors import Reason

log = logging.getLogger("neuron_bus.worker")

CONCURRENT = 64  # control requests handled at once


def session_of(req) -> object:
    """The key that orders a request: its session, or none (a key of its own)."""
    if isinstance(req, (M.SessionOpen, M.SessionClose, M.SessionKeepAlive)):
        return req.session_id
    if isinstance(req, M.SessionResume):
        return req.open.session_id
    return object()


class ControlPlane:
    def __init__(self, node_id: str, lifecycle, tokenizer, metrics, mover):
        self.node_id = node_id
        self.lifecycle = lifecycle
        self.tokenizer = tokenizer
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix=f"tokenizer-{node_id}")
        self.metrics = metrics
        self.mover = mover
        self._running = InOrder()
        self._slots = asyncio.Semaphore(CONCURRENT)

    async def stop(self) -> None:
        await self._running.cancel_all()
        self._tokenizing.shutdown(wait=False)

    async def on_message(self, msg: Msg) -> None:
        try:
            req = M.decode(msg.data, M.ControlRequest)
        except Exception as exc:
            await self._reply(msg, self._error(exc))
            return
        await self._slots.acquire()  # released when the request is answered
        self._running.spawn(session_of(req), self._answer(msg, self.handle, req))

    async def on_move(self, msg: Msg) -> None:
        """``neuron.node.<id>.move``: only trackers may publish there (trust/permissions.py)."""
        reply: M.MoveAccepted | M.ControlError
        try:
            reply = await self.move(M.decode(msg.data, M.ControlRequest))
        except Exception as exc:
            reply = self._error(exc)
        await self._reply(msg, reply)

    async def _answer(self, msg: Msg, handler, req) -> None:
        """Run ``handler`` on a request and reply: every failure is an explicit reply."""
        try:
            try:
                reply = await handler(req)
            except Exception as exc:
                reply = self._error(exc)
            await self._reply(msg, reply)
        except Exception as exc:  # the connection is closing: nobody to answer
            log.warning("%s: control reply not sent: %s", self.node_id, exc)
        finally:
            self._slots.release()

    async def _on_tokenizer_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

    def _error(self, exc: Exception) -> M.ControlError:
        if isinstance(exc, MalformedMessage):
            self.metrics.reject(Reason.BAD_CONTROL)
        return M.ControlError(code=getattr(exc, "reason", Reason.ERROR), message=str(exc))

    @staticmethod
    async def _reply(msg: Msg, reply) -> None:
        if msg.reply:
            await msg.respond(M.encode(reply))

    async def move(self, req) -> M.MoveAccepted:
        if not isinstance(req, M.MoveRange):
            raise MalformedMessage(Reason.BAD_CONTROL, f"only MoveRange is taken here, not {type(req).__name__}")
        return self.mover.accept(req)

    async def handle(self, req):
        if isinstance(req, M.Ping):
            return M.Pong(node_id=self.node_id, sent_at=req.sent_at)
        if isinstance(req, M.SessionsQuery):
            return self.lifecycle.report(self.metrics.rejected_by_reason, self.metrics.redelivered_copies)
        if isinstance(req, M.TokenizeRequest):
            return await self.tokenize(req)
        if isinstance(req, M.SessionOpen):
            return await self.lifecycle.open(req)
        if isinstance(req, M.SessionResume):
            return await self.lifecycle.resume(req)
        if isinstance(req, M.MoveRange):  # anyone may publish on .ctl; moves come from a tracker on .move
            raise NeuronBusError(
                Reason.NOT_PERMITTED, f"{self.node_id}: MoveRange is taken on {S.node_move(self.node_id)} only"
            )
        if isinstance(req, M.SessionKeepAlive):
            self.lifecycle.engine.keep_alive(req)
            return M.SessionKeptAlive(session_id=req.session_id, node_id=self.node_id)
        if isinstance(req, M.SessionClose):
            self.lifecycle.engine.check_close(req)
            freed = await self.lifecycle.close(req.session_id, keep=req.keep_blocks)
            return M.SessionClosed(session_id=req.session_id, node_id=self.node_id, freed_bytes=freed)
        raise ValueError(f"unsupported control request {type(req).__name__}")

    async def tokenize(self, req: M.TokenizeRequest) -> M.TokenizeReply:
        if req.tokens is not None:  # already token ids: are they this model's?
            n = getattr(self.tokenizer, "vocab_size", None)
            bad = [t for t in req.tokens if t < 0 or (n is not None and t >= n)]
            if bad:
                raise NeuronBusError(Reason.BAD_INPUT, f"token id {bad[0]} is outside the vocabulary of {n} tokens")
            return M.TokenizeReply(tokens=list(req.tokens), text="")
        if req.messages is not None:
            text, tokens = await self._on_tokenizer_thread(
                self.tokenizer.encode_chat, req.messages, req.add_generation_prompt
            )
        elif req.text is not None:
            text = req.text
            tokens = await self._on_tokenizer_thread(self.tokenizer.encode, text)
        else:
            raise ValueError("tokenize needs text or messages")
        return M.TokenizeReply(tokens=tokens, text=text)
