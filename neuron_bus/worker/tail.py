"""The tail of a route: what happens to a session's logits after the last layer.

A `TailDecoder` belongs to one session on the node that holds the route's last layers. It owns
the tail-only state — the tokens generated so far, their text, the incremental UTF-8 decoder and
the generation's telemetry — and turns each position's logits into a `TokenStep`: the sampled
token (seeded, so it can be replayed), its text delta, whether and why the generation finished
(end-of-generation token, a stop string, max_tokens), and the top log-probabilities when asked.
No I/O: the worker's shell publishes what it returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from neuron_bus import messages as M
from neuron_bus.sampling import sample
from neuron_bus.telemetry import GenerationProgress

TOP_LOGPROBS = 5


@dataclass
class TokenStep:
    """One generated token: the delta for the client and, unless finished, the next ring step."""

    delta: M.TokenDelta
    index: int  # which generated token this is (0 = first)

    @property
    def finished(self) -> bool:
        return self.delta.finished


class TailDecoder:
    def __init__(
        self, open_: M.SessionOpen, tokenizer, generated: list[int] | None = None, ring_seq_base: int | None = None
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
        # hop 0's input seq of the ring step feeding token i is base + i: after the prompt's chunks,
        # or after a repaired route's replay chunks
        self.ring_seq_base = (
            math.ceil(open_.prompt_tokens / open_.chunk_size) if ring_seq_base is None else ring_seq_base
        )
        if generated:  # a repaired route: the tokens the client already has
            self.generated = list(generated)
            self.text = "".join(self.decoder.push(t) for t in self.generated)
            self.progress.prefill(open_.prompt_tokens)
            self.progress.generated = len(self.generated)

    def ring_seq(self, index: int) -> int:
        """Hop 0's input seq of the decode step that feeds generated token ``index``."""
        return self.ring_seq_base + index

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
        return TokenStep(delta=delta, index=index)

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
