"""Which node a disagreeing replay is pinned on, and when a node is flagged.

A replay only says that a route's output differs from the model's: any of its nodes could be at
fault. Attribution by exoneration across routes:

- every node of an agreeing replay is exonerated (it computed its layers right at least once);
- a disagreeing replay is pinned on a member that is already flagged, else on its only member
  that was never exonerated; with several unexonerated members it stays pending and is
  re-examined after each new verdict (another route through the same nodes settles it);
- a node is flagged once ``threshold`` disagreeing replays are pinned on it.

An honest node sharing routes with a faulty one is never flagged: its disagreements always have
the faulty member (never exonerated) next to it, and its agreeing replays on other routes clear
it. Limits: a node that cheats only sometimes can be exonerated by its honest replays; its
disagreements then stay unpinned (all members exonerated) and are reported as such. The state is
pure and rebuilt from the stored verdicts (auditor.py), so an auditor restart loses nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from neuron_bus import messages as M

DEFAULT_THRESHOLD = 2


@dataclass
class _Replay:
    session_id: str
    members: list[str]
    pinned: str | None = None


@dataclass
class Attribution:
    threshold: int = DEFAULT_THRESHOLD
    nodes: dict[str, M.NodeTrust] = field(default_factory=dict)
    disagreeing: list[_Replay] = field(default_factory=list)

    def _node(self, node_id: str) -> M.NodeTrust:
        return self.nodes.setdefault(node_id, M.NodeTrust(node_id=node_id))

    def add(self, verdict: M.AuditVerdict) -> list[str]:
        """Take a verdict into account; return the node ids whose record changed."""
        if verdict.verdict == "unverifiable":
            return []
        now = verdict.ts or time.time()
        for n in verdict.members:
            rec = self._node(n)
            if verdict.verdict == "agree":
                rec.agreements += 1
            else:
                rec.disagreements += 1
            rec.updated_at = now
        if verdict.verdict == "disagree":
            self.disagreeing.append(_Replay(verdict.session_id, list(verdict.members)))
        return sorted(set(verdict.members) | set(self._settle(now)))

    def pinned_on(self, session_id: str) -> list[str]:
        return [r.pinned for r in self.disagreeing if r.session_id == session_id and r.pinned]

    def _suspect(self, replay: _Replay) -> str | None:
        flagged = [n for n in replay.members if self.nodes[n].flagged]
        if flagged:
            return flagged[0]
        never_agreed = [n for n in replay.members if self.nodes[n].agreements == 0]
        return never_agreed[0] if len(never_agreed) == 1 else None

    def _settle(self, now: float) -> list[str]:
        changed = []
        progress = True
        while progress:  # a new flag may settle other pending replays
            progress = False
            for r in self.disagreeing:
                if r.pinned:
                    continue
                suspect = self._suspect(r)
                if suspect is None:
                    continue
                r.pinned = suspect
                rec = self.nodes[suspect]
                rec.attributed += 1
                rec.sessions.append(r.session_id)
                rec.updated_at = now
                changed.append(suspect)
                if not rec.flagged and rec.attributed >= self.threshold:
                    rec.flagged = True
                    rec.reason = (
                        f"{rec.attributed} replays disagreeing with the reference are pinned on this node "
                        f"(sessions {', '.join(rec.sessions[-5:])})"
                    )
                    progress = True
        return changed

    def unpinned(self) -> list[str]:
        """Sessions whose disagreement is not pinned on anyone yet."""
        return [r.session_id for r in self.disagreeing if not r.pinned]
