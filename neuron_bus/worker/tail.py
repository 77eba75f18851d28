"""The tail of a route: what happens to a session's logits after the last layer.

A `TailDecoder` belongs to one session on the node that holds the route's last layers. It owns
the tail-only state — the tokens generated so far, their text, the incremental UTF-8 decoder and
the generation's telemetry — and turns each position's logits into a `TokenStep`: the sampled
token (seeded, so it can be replayed), its text delta, whether and why the generation finished
(end-of-generation token, a stop string, max_tokens), and the top log-probabilities when asked.
A speculative session (``SessionOpen.speculative`` > 0) sends hop 0 its last token with drafts
(`Speculation`, drafting.py) and gets back the logits of every row: `verify` samples row after row
exactly as plain decoding would (the same draws: sampling depends only on the seed and the token's
index) and keeps going while the choice equals the draft, so the output is plain decoding's.

No I/O: the worker's shell publishes what it returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from neuron_bus import messages as M
from neuron_bus.errors import SessionMismatch
from neuron_bus.sampling import sample
from neuron_bus.telemetry import GenerationProgress
from neuron_bus.worker.drafting import DraftBudget, NgramDrafter
from workers.errors import Reason

TOP_LOGPROBS = 5


@dataclass
class TokenStep:
    """One generated token: the delta for the client and, unless finished, the next ring step."""

    delta: M.TokenDelta  # its index: which generated token this is (0 = first)

    @property
    def finished(self) -> bool:
        return self.delta.finished


class Speculation:
    """A speculative session's drafting at the tail: the drafter over the prompt and the tokens
    generated, the draft budget, and the drafts of the ring step in flight."""

    def __init__(self, k_max: int, hops: int, context: list[int], adaptive: bool = True):
        self.drafter = NgramDrafter(context)
        self.budget = DraftBudget(k_max, hops, adaptive)
        self.in_flight: list[int] = []  # the drafts the ring step in flight carries after its token
        self._sent_at: float | None = None
        self._sent_rows = 0
        self.drafted = 0  # drafts sent, and how many of them the tail accepted
        self.accepted = 0

    def generated(self, token: int) -> None:
        self.drafter.extend([token])
        self.budget.acceptance.generated(token)

    def row_compute(self, seconds: float, rows: int) -> None:
        """The tail's backend computed ``rows`` rows of this session in ``seconds``."""
        self.budget.cost.row_compute(seconds / max(rows, 1), self.budget.hops)

    def next_drafts(self, room: int, now: float) -> list[int]:
        """The drafts for the next ring step (at most ``room``), sent at ``now``."""
        if self._sent_at is not None:  # the previous step's period: its ring and every hop's compute
            self.budget.cost.observe(self._sent_rows, now - self._sent_at)
        draft = self.drafter.draft(self.budget.k_max)
        self.budget.acceptance.proposed(draft)
        drafts = draft.tokens[: self.budget.choose(draft, room)]
        self._sent_at, self._sent_rows, self.in_flight = now, 1 + len(drafts), drafts
        self.drafted += len(drafts)
        return drafts


class TailDecoder:
    def __init__(
        self,
        open_: M.SessionOpen,
        tokenizer,
        generated: list[int] | None = None,
        ring_seq_base: int | None = None,
        adaptive_drafts: bool = True,
        reused: int = 0,
    ):
        self.open = open_
        self.tokenizer = tokenizer
        self.decoder = tokenizer.stream_decoder()
        route = open_.route
        self.progress = GenerationProgress(
            open_.session_id,
            route.route_id,
            route.model_preset,
            [h.node_id for h in route.hops],
            open_.prompt_tokens,
            owner=open_.owner,
        )
        self.generated: list[int] = []
        self.text = ""  # the text the client has been sent
        self._held = ""  # decoded text not sent yet: it may begin a stop string
        # hop 0's input seq of ring step i is base + i: after the prompt's chunks (those past a
        # reused prefix), or after a repaired route's replay chunks
        self.ring_seq_base = (
            math.ceil((open_.prompt_tokens - reused) / open_.chunk_size) if ring_seq_base is None else ring_seq_base
        )
        if reused:
            self.progress.prefill(reused)
            self.progress.prefill_reused = reused
        self.ring_steps = 0  # ring steps sent
        self.ring_position: int | None = None  # where the ring step in flight starts
        if generated:  # a repaired route: the tokens the client already has
            self.generated = list(generated)
            self.text = "".join(self.decoder.push(t) for t in self.generated)
            self.progress.prefill(open_.prompt_tokens)
            self.progress.generated = len(self.generated)
        self.spec: Speculation | None = None
        if open_.speculative:
            context = list(open_.prompt or []) + self.generated
            self.spec = Speculation(open_.speculative, len(route.hops), context, adaptive_drafts)

    def ring_seq(self) -> int:
        """Hop 0's input seq of the next ring step."""
        return self.ring_seq_base + self.ring_steps

    def ring_step(self, position: int, now: float) -> list[int]:
        """The token ids of the next ring step, at ``position``: the last token and any drafts."""
        room = min(self.open.sampling.max_tokens - len(self.generated), self.open.n_ctx - position) - 1
        drafts: list[int] = []
        if self.spec is not None:
            drafts = self.spec.next_drafts(room, now)
            self.progress.draft_tokens = self.spec.drafted
        self.ring_steps += 1
        self.ring_position = position
        return [self.generated[-1], *drafts]

    def check_step(self, position: int, rows: int) -> None:
        """A decode step reaching the tail must be the ring step it sent, with every draft."""
        if self.ring_position is None:
            return
        want = 1 + (len(self.spec.in_flight) if self.spec is not None else 0)
        if (position, rows) != (self.ring_position, want):
            raise SessionMismatch(
                Reason.POSITION_GAP,
                f"session {self.open.session_id}: decode step of {rows} positions at {position}, "
                f"the ring step in flight has {want} at {self.ring_position}",
            )

    def prefilled(self, end: int) -> bool:
        """A prefill chunk ending at ``end`` went through; True when that is news for telemetry."""
        if end > self.open.prompt_tokens:  # a repair's replay of generated tokens: no progress to show
            return False
        self.progress.prefill(end)
        return True

    def token(self, logits: np.ndarray) -> TokenStep:
        """Sample the next token from ``logits`` and say what it means for the generation."""
        params = self.open.sampling
        index = len(self.generated)
        pick = sample(logits, params, index, TOP_LOGPROBS if params.logprobs else 0)
        self.generated.append(pick.token_id)
        if self.spec is not None:
            self.spec.generated(pick.token_id)
        self.progress.token()
        text, finish = self._text_and_finish(pick.token_id)
        self.text += text
        top = None
        if pick.top_logprobs is not None:
            top = {self.tokenizer.piece(t).decode("utf-8", "replace"): lp for t, lp in pick.top_logprobs.items()}
        delta = M.TokenDelta(
            session_id=self.open.session_id,
            index=index,
            token_id=pick.token_id,
            text=text,
            logprob=pick.logprob,
            top_logprobs=top,
            finished=finish is not None,
            finish_reason=finish,
        )
        if finish is not None:
            self.progress.finish("done")
        return TokenStep(delta=delta)

    def verify(self, rows: np.ndarray, observe=None) -> list[TokenStep]:
        """The tokens one decode step yields from the logits of its rows [n, vocab].

        Row j holds the logits after the step's token and its first j drafts: the token chosen
        there is plain decoding's next token; while it equals draft j + 1 the next row is valid
        too. ``observe(index, logits)`` sees each row before its token is chosen (the audit trail).
        """
        drafts = self.spec.in_flight if self.spec is not None else []
        if rows.shape[0] != 1 + len(drafts):
            raise ValueError(f"{rows.shape[0]} rows of logits for a step of {1 + len(drafts)} positions")
        steps: list[TokenStep] = []
        for j, row in enumerate(rows):
            if observe is not None:
                observe(len(self.generated), row)
            steps.append(self.token(row))
            agreed = j < len(drafts) and steps[-1].delta.token_id == drafts[j]
            if self.spec is not None and agreed:
                self.spec.accepted += 1
            if steps[-1].finished or not agreed:
                break
        if self.spec is not None:
            self.progress.accepted_draft_tokens = self.spec.accepted
        return steps

    def _text_and_finish(self, token_id: int) -> tuple[str, M.FinishReason | None]:
        """The text this token lets out, and the finish reason if it ends the generation.

        Text that could be the start of a stop string is held back until the next tokens show
        whether it is one, so a stop string never reaches the client, even when it spans tokens.
        """
        params = self.open.sampling
        pending = self._held + self.decoder.push(token_id)
        self._held = ""
        if not params.ignore_eos and self.tokenizer.is_end_of_generation(token_id):
            return pending + self.decoder.flush(), "stop"
        cuts = [i for i in (pending.find(stop) for stop in params.stop if stop) if i >= 0]
        if cuts:
            return pending[: min(cuts)], "stop"
        if len(self.generated) >= params.max_tokens:
            return pending + self.decoder.flush(), "length"
        keep = max((_overlap(pending, stop) for stop in params.stop if stop), default=0)
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep], None


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
