"""Gateway access: API keys (``neuron-bus gateway --api-keys FILE``) and per-key rate limits.

With keys configured, every request to ``/v1/*`` and ``/ws`` needs ``Authorization: Bearer <key>``
(a browser's WebSocket, which cannot set headers, offers the subprotocols ``bearer, <key>``
instead): without a valid key the answer is 401; past the key's rate, 429 with Retry-After (a
token bucket per key: ``requests_per_minute``, up to ``burst`` at once; a WebSocket's every
``generate`` or ``attach`` counts as a request). ``/``, ``/healthz`` and ``/metrics`` stay open.

The keys file (JSON, mode 0600) holds no keys, only their SHA-256 and an id:

    {"keys": [{"id": "alice", "sha256": "<hex>", "requests_per_minute": 60, "burst": 10}]}

``"key": "<the key itself>"`` is accepted in place of ``sha256`` for quick setups.
``neuron-bus api-key add ID --file FILE`` writes an entry and prints the new key once. The file is
read again when it changes (a revoked key stops working within seconds, no restart). A key never
appears in logs, error bodies or metrics: they name its id.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from aiohttp import web

from neuron_bus.gateway.validation import ApiError
from workers.files import atomic_output

KEY_PREFIX = "nb-"
PROTECTED = ("/v1/", "/ws")
RELOAD_CHECK_S = 1.0
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_HEX = re.compile(r"^[0-9a-f]{64}$")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    sha256: str
    requests_per_minute: float = 60.0  # 0: no limit
    burst: int = 10

    def as_entry(self) -> dict:
        d = asdict(self)
        return {"id": d.pop("key_id"), **d}


def _entry(raw, i: int) -> ApiKey:
    if not isinstance(raw, dict):
        raise ValueError(f"keys[{i}] must be an object")
    key_id = raw.get("id")
    if not isinstance(key_id, str) or not _ID.match(key_id):
        raise ValueError(f"keys[{i}].id must be 1-64 of A-Z a-z 0-9 _ . -")
    sha = raw.get("sha256")
    if sha is None and isinstance(raw.get("key"), str) and raw["key"]:
        sha = digest(raw["key"])
    if not isinstance(sha, str) or not _HEX.match(sha):
        raise ValueError(f"key {key_id}: needs 'sha256' (64 lowercase hex digits) or 'key'")
    rpm = raw.get("requests_per_minute", 60)
    burst = raw.get("burst", max(1, math.ceil(rpm / 6)) if isinstance(rpm, int | float) else 1)
    if not isinstance(rpm, int | float) or isinstance(rpm, bool) or rpm < 0 or not math.isfinite(rpm):
        raise ValueError(f"key {key_id}: requests_per_minute must be a number >= 0 (0: no limit)")
    if not isinstance(burst, int) or isinstance(burst, bool) or burst < 1:
        raise ValueError(f"key {key_id}: burst must be an integer >= 1")
    return ApiKey(key_id, sha, float(rpm), burst)


def load_keys(path: Path) -> list[ApiKey]:
    """The keys of ``path``; ValueError naming the problem (never a key) when it is not valid."""
    try:
        body = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the API keys file {path}: {type(exc).__name__}") from None
    raw = body.get("keys") if isinstance(body, dict) else None
    if not isinstance(raw, list):
        raise ValueError(f'{path}: expected {{"keys": [...]}}')
    keys = [_entry(r, i) for i, r in enumerate(raw)]
    ids = [k.key_id for k in keys]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: key ids must be unique")
    return keys


def add_key(path: Path, key_id: str, requests_per_minute: float = 60.0, burst: int = 10) -> str:
    """Create a key, store its hash under ``key_id`` in ``path`` (created, mode 0600) and return it."""
    path = Path(path)
    keys = load_keys(path) if path.exists() else []
    if any(k.key_id == key_id for k in keys):
        raise ValueError(f"{path}: a key with id {key_id} exists; revoke it first")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    entry = {"id": key_id, "sha256": digest(key), "requests_per_minute": requests_per_minute, "burst": burst}
    keys.append(_entry(entry, len(keys)))
    save_keys(path, keys)
    return key


def save_keys(path: Path, keys: list[ApiKey]) -> None:
    with atomic_output(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"keys": [k.as_entry() for k in keys]}, f, indent=2)


class Bucket:
    """A token bucket: ``burst`` requests at once, refilled at ``rate`` per second."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.at = time.monotonic()

    def take(self) -> float:
        """0 when a request may go now (and it is counted), else the seconds until one may."""
        now = time.monotonic()
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


def presented_key(request: web.Request) -> str | None:
    """The key of a request: ``Authorization: Bearer <key>``, or a WebSocket's ``bearer, <key>``."""
    auth = request.headers.get("Authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
    if "bearer" in offered[:-1]:
        return offered[offered.index("bearer") + 1] or None
    return None


class Access:
    """Who may use the gateway: none configured, everyone; else the keys of the file."""

    def __init__(self, path: Path | None, metrics=None):
        self.path = Path(path) if path else None
        self.metrics = metrics
        self.keys: dict[str, ApiKey] = {}
        self.buckets: dict[str, Bucket] = {}
        self._mtime = 0.0
        self._checked = 0.0
        if self.path:
            self._load()

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def _load(self) -> None:
        assert self.path is not None
        self._mtime = self.path.stat().st_mtime
        self.keys = {k.sha256: k for k in load_keys(self.path)}
        self.buckets = {k: b for k, b in self.buckets.items() if k in {v.key_id for v in self.keys.values()}}

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if self.path is None or now - self._checked < RELOAD_CHECK_S:
            return
        self._checked = now
        try:
            if self.path.stat().st_mtime != self._mtime:
                self._load()
        except (OSError, ValueError):
            pass  # a file being rewritten, or broken: keep the keys already loaded

    def _count(self, name: str, label: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, name).labels(label).inc()

    def authenticate(self, request: web.Request) -> ApiKey:
        """The request's key, or a 401 ApiError (the body never repeats what was presented)."""
        self._maybe_reload()
        presented = presented_key(request)
        key = self.keys.get(digest(presented)) if presented else None
        if key is None:
            self._count("auth_failures", "missing" if presented is None else "invalid")
            raise ApiError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>'"
                if presented is None
                else "the API key is not valid (or was revoked)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": 'Bearer realm="neuron-bus"'},
            )
        return key

    def admit(self, key: ApiKey) -> None:
        """Count one request of ``key``; a 429 ApiError with Retry-After past its rate."""
        self._count("key_requests", key.key_id)
        if key.requests_per_minute <= 0:
            return
        bucket = self.buckets.get(key.key_id)
        if bucket is None or bucket.burst != key.burst or bucket.rate != key.requests_per_minute / 60.0:
            bucket = self.buckets[key.key_id] = Bucket(key.requests_per_minute / 60.0, key.burst)
        wait = bucket.take()
        if wait > 0:
            self._count("rate_limited", key.key_id)
            raise ApiError(
                429,
                f"rate limit of key {key.key_id} reached ({key.requests_per_minute:g} requests per minute, "
                f"{key.burst} at once): retry in {math.ceil(wait)}s",
                type="rate_limit_exceeded",
                code="rate_limit_exceeded",
                retry_after=max(1, math.ceil(wait)),
            )


ACCESS = web.AppKey("access", Access)


@web.middleware
async def require_key(request: web.Request, handler) -> web.StreamResponse:
    """With keys configured: a valid key on every protected path, counted against its rate."""
    access = request.app[ACCESS]
    if access.enabled and request.path.startswith(PROTECTED):
        key = access.authenticate(request)
        access.admit(key)
        request["api_key"] = key
    return await handler(request)
