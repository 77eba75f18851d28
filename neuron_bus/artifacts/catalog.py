"""The models a self-placing node can be given: every artifact published in the shard swarm.

Manifests are content-addressed (an artifact id names exactly one), so each is read from the
object store once and kept; the list of artifacts is read again when asked ``fresh`` (for every
joining node: a model published a moment ago must be there for it) and at most every `REFRESH_S`
otherwise (the placer's periodic rebalancing).
"""

from __future__ import annotations

import time

from neuron_bus import subjects as S
from neuron_bus.artifacts.swarm import fetch_manifest
from neuron_bus.messages import ArtifactManifest

REFRESH_S = 30.0
MANIFEST = "/manifest.json"


class Catalog:
    def __init__(self, js):
        self.js = js
        self._manifests: dict[str, ArtifactManifest] = {}  # artifact id -> manifest
        self._listed = 0.0

    async def _refresh(self) -> None:
        try:
            store = await self.js.object_store(S.OBJ_ARTIFACTS)
            names = [i.name for i in await store.list(ignore_deletes=True)]
        except Exception:  # no bucket, or an empty one: nothing published
            names = []
        for name in names:
            artifact_id = name[: -len(MANIFEST)] if name.endswith(MANIFEST) else None
            if artifact_id and artifact_id not in self._manifests:
                self._manifests[artifact_id] = await fetch_manifest(self.js, artifact_id)
        self._listed = time.monotonic()

    async def models(self, preset: str | None = None, fresh: bool = False) -> list[ArtifactManifest]:
        """The published artifacts (of ``preset``; None or "any": all), newest listing first."""
        want = None if preset in (None, "any") else preset
        if fresh or time.monotonic() - self._listed > REFRESH_S:
            await self._refresh()
        return self._of(want) if want else list(self._manifests.values())

    def _of(self, preset: str) -> list[ArtifactManifest]:
        return [m for m in self._manifests.values() if m.model_preset == preset]
