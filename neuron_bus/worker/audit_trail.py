"""What a worker records for trust: its ledger entries, and at the tail the validation event.

- Every hop counts the positions it actually computed per session and phase (`worked`); when the
  session closes it publishes a `LedgerEntry` of kind ``inference`` on ``neuron.ledger.<node>``
  with its owned layer work (artifacts/work.py) and ``reward_weight = owned_layer_work ×
  prefill_tokens + owned_layer_work × decode_tokens``. That is the node's claim: what it is paid
  is metered from what the swarm observed (trust/meter.py), and a claim above it is flagged.
- The tail keeps the top logits of the first `LOGIT_SAMPLES` generated tokens (`observe`) and,
  when the generation finishes, makes the session's `ValidationEvent` before the last token goes
  out (`validation_event`) and publishes it after on
  ``neuron.validation.<session>`` (stream NEURON_VALIDATION): model and revision, route members
  with their ranges, backend, cache ABI and trust tier, prompt hash and tokens (sent to the tail
  in SessionOpen.prompt), output tokens, sampling parameters and seed, wire format and chunk size.

Publishing never fails a session: a bus error is logged and counted.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid

import numpy as np

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.flow import publish
from neuron_bus.sampling import top_indices
from neuron_bus.trust import fault as faults
from neuron_bus.trust.meter import inference_weight

log = logging.getLogger("neuron_bus.worker.trust")

LOGIT_SAMPLES = 4  # generated tokens whose top logits go into the validation event
TOP_LOGITS = 8


def prompt_sha256(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


class AuditTrail:
    def __init__(self, js, report: M.CapabilityReport, owned_layer_work: float = 0.0, fault: str | None = None):
        self.js = js
        self.inflate = faults.INFLATE if fault == "inflate-ledger" else 1  # a deliberate fault (trust/fault.py)
        self.report = report
        self.owned_layer_work = owned_layer_work
        self.failures = 0
        self._work: dict[str, dict[str, int]] = {}
        self._samples: dict[str, list[M.LogitSample]] = {}

    def worked(self, session_id: str, phase: str, positions: int) -> None:
        w = self._work.setdefault(session_id, {"prefill": 0, "decode": 0})
        w[phase] = w.get(phase, 0) + positions

    def observe(self, session_id: str, index: int, logits: np.ndarray) -> None:
        if index >= LOGIT_SAMPLES:
            return
        top = top_indices(logits, TOP_LOGITS)
        self._samples.setdefault(session_id, []).append(
            M.LogitSample(index=index, token_ids=[int(t) for t in top], logits=[float(logits[t]) for t in top])
        )

    async def _publish(self, subject: str, msg) -> None:
        try:
            await publish(self.js, subject, M.encode(msg), max_wait=10.0)
        except Exception as exc:  # trust records must never break serving
            self.failures += 1
            log.warning("worker %s: could not publish on %s: %s", self.report.node_id, subject, exc)

    def validation_event(self, open_: M.SessionOpen, generated: list[int], finish: str | None) -> M.ValidationEvent:
        """The tail's validation event for a finished generation, its logit samples taken now: the
        client may close the session (`close` drops them) as soon as it has the last token, before
        the event is published."""
        route = open_.route
        prompt = list(open_.prompt or [])
        return M.ValidationEvent(
            event_id=uuid.uuid4().hex,
            session_id=open_.session_id,
            route_id=route.route_id,
            model_preset=route.model_preset,
            model_revision=route.model_revision,
            route=[
                M.RouteMember(
                    node_id=h.node_id,
                    layer_start=h.layer_start,
                    layer_end=h.layer_end,
                    backend_id=h.backend_id,
                    cache_abi=h.cache_abi,
                    trust_tier=h.trust_tier,
                )
                for h in route.hops
            ],
            prompt_sha256=prompt_sha256(prompt),
            prompt_tokens=prompt,
            output_tokens=list(generated),
            owner=open_.owner,
            sampling=open_.sampling,
            policy=route.policy,
            created_at=time.time(),
            logit_samples=self._samples.pop(open_.session_id, []),
            wire_dtype=route.wire_dtype,
            encoding=route.encoding,
            chunk_size=open_.chunk_size,
            finish_reason=finish,
            tail_node_id=self.report.node_id,
            activation_auth="aead" if open_.encrypt else "mac" if open_.input_key else "none",
        )

    async def validation(self, event: M.ValidationEvent) -> None:
        await self._publish(S.validation(event.session_id), event)

    async def close(self, open_: M.SessionOpen) -> None:
        """The ledger entry for the work this node did for a session, at its close."""
        self._samples.pop(open_.session_id, None)
        w = self._work.pop(open_.session_id, None)
        if not w or not (w["prefill"] or w["decode"]):
            return
        hop = open_.route.hops[open_.hop_index]
        prefill, decode = w["prefill"] * self.inflate, w["decode"] * self.inflate
        entry = M.LedgerEntry(
            entry_id=uuid.uuid4().hex,
            node_id=self.report.node_id,
            kind="inference",
            ts=time.time(),
            session_id=open_.session_id,
            layer_start=hop.layer_start,
            layer_end=hop.layer_end,
            owned_layer_work=self.owned_layer_work,
            prefill_tokens=prefill,
            decode_tokens=decode,
            reward_weight=inference_weight(self.owned_layer_work, prefill, decode),
        )
        await self._publish(S.ledger(self.report.node_id), entry)
