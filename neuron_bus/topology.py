"""The project's JetStream streams, KV buckets and object buckets, created idempotently.

subjects.md is the prose version of this table; `ensure_topology` is what makes it real.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import weakref
from dataclasses import dataclass
from urllib.parse import urlparse

import nats
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError

from neuron_bus import subjects as S
from neuron_bus.trust.meter import KV_METER

log = logging.getLogger("neuron_bus.nats")

DAY = 24 * 3600.0


@dataclass(frozen=True)
class Topology:
    streams: tuple[StreamConfig, ...]
    kv: tuple[KeyValueConfig, ...]
    objects: tuple[ObjectStoreConfig, ...]


DEFAULT_PREFILL_WINDOW = 4
PENDING_PLACEMENT_S = 300.0  # a node given a range has this long to fetch, load and announce it


def topology(replicas: int = 1, prefill_window: int = DEFAULT_PREFILL_WINDOW) -> Topology:
    """Every stream and bucket, with ``replicas`` copies (3 on a 3-server cluster).

    ``prefill_window`` is how many prefill chunks may wait for one hop: a slow hop makes its
    upstream hold (and retry) instead of any buffer growing.
    """
    r = replicas
    streams = (
        StreamConfig(
            name=S.STREAM_PREFILL,
            description="prefill chunks into route hops; at most `prefill_window` waiting per hop",
            subjects=[S.PREFILL_ALL],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.MEMORY,
            max_msgs_per_subject=prefill_window,
            discard=DiscardPolicy.NEW,
            discard_new_per_subject=True,
            max_age=600.0,
            max_bytes=1 << 30,
            num_replicas=r,
        ),
        StreamConfig(
            name=S.STREAM_DECODE,
            description="decode steps into route hops (one position each)",
            subjects=[S.DECODE_ALL],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.MEMORY,
            max_age=600.0,
            max_bytes=256 << 20,
            num_replicas=r,
        ),
        StreamConfig(
            name=S.STREAM_ROUTES,
            description="route assignments published by the tracker",
            subjects=[f"{S.ROOT}.route.assign.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_msgs_per_subject=1,
            max_age=DAY,
            num_replicas=r,
        ),
        StreamConfig(
            name=S.STREAM_TELEMETRY,
            description="generation telemetry; the last message per session is kept for late readers",
            subjects=[f"{S.ROOT}.telemetry.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.MEMORY,
            max_msgs_per_subject=1,
            max_age=3600.0,
            num_replicas=r,
        ),
        StreamConfig(
            name=S.STREAM_TOKENS,
            description="token deltas and session errors, replayable by a reconnecting client",
            subjects=[f"{S.ROOT}.session.*.*.tokens", f"{S.ROOT}.session.*.*.error"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.MEMORY,
            max_age=900.0,
            max_bytes=256 << 20,
            num_replicas=r,
        ),
        StreamConfig(
            name=S.STREAM_VALIDATION,
            description="validation events (route membership, prompt hash, output, seed)",
            subjects=[f"{S.ROOT}.validation.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=30 * DAY,
            num_replicas=r,
        ),
        StreamConfig(
            name=S.STREAM_LEDGER,
            description="reward ledger entries (inference and, separately, seeding)",
            subjects=[f"{S.ROOT}.ledger.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=r,
        ),
        StreamConfig(
            name=S.STREAM_AUDIT,
            description="replay requests sampled by the tracker and the auditor's verdicts",
            subjects=[f"{S.ROOT}.audit.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=30 * DAY,
            num_replicas=r,
        ),
    )

    def bucket(name: str, description: str, ttl: float | None = None) -> KeyValueConfig:
        return KeyValueConfig(
            bucket=name, description=description, history=1, ttl=ttl, storage=StorageType.FILE, replicas=r
        )

    kv = (
        bucket(S.KV_NODES, "node_id -> CapabilityReport"),
        bucket(S.KV_FLAGS, "node_id -> NodeTrust (audit record; flagged nodes are excluded from routes)"),
        bucket(
            S.KV_PLACEMENTS,
            "node_id -> PlacementDecision not yet announced by its node (tracker placement)",
            PENDING_PLACEMENT_S,
        ),
        bucket(
            S.KV_LEASES,
            "lease name -> holder; entries expire: a holder that stops renewing loses the lease",
            S.LEASE_TTL_S,
        ),
        bucket(KV_METER, "session_id -> SessionMeter (metered rewards: what the swarm observed each node compute)"),
        bucket(S.KV_ROUTES, "route_id -> RouteAssignment", DAY),
    )
    objects = (
        ObjectStoreConfig(
            bucket=S.OBJ_ARTIFACTS,
            description="artifact manifests and their hashed pieces",
            storage=StorageType.FILE,
            replicas=r,
        ),
        ObjectStoreConfig(
            bucket=S.OBJ_SNAPSHOTS,
            description="KV-cache snapshots for route repair",
            storage=StorageType.FILE,
            replicas=r,
        ),
    )
    return Topology(streams, kv, objects)


async def ensure_topology(
    js: JetStreamContext, replicas: int = 1, prefill_window: int = DEFAULT_PREFILL_WINDOW, update: bool = False
) -> Topology:
    """Create what is missing; safe to call repeatedly.

    With ``update`` (the operator's `neuron-bus server`), existing streams also take this config;
    without it (workers, clients), streams an operator configured are left as they are.
    """
    topo = topology(replicas, prefill_window)
    for cfg in topo.streams:
        assert cfg.name is not None
        try:
            await js.stream_info(cfg.name)
        except NotFoundError:
            await js.add_stream(cfg)
        else:
            if not update:
                continue
            try:
                await js.update_stream(cfg)
            except BadRequestError:
                pass  # an immutable field (storage, retention) differs: keep the operator's stream
    for kv in topo.kv:
        try:
            await js.key_value(kv.bucket)
        except (NotFoundError, nats.js.errors.BucketNotFoundError):
            await js.create_key_value(kv)
    for obj in topo.objects:
        assert obj.bucket is not None
        await object_store(js, obj.bucket)
    return topo


async def object_store(js: JetStreamContext, bucket: str, create: bool = True):
    """One of the project's object buckets, created with its topology config when missing
    (``create=False``: the bucket's absence raises ``BucketNotFoundError``)."""
    try:
        return await js.object_store(bucket)
    except (NotFoundError, nats.js.errors.BucketNotFoundError):
        if not create:
            raise nats.js.errors.BucketNotFoundError from None
    cfg = next(o for o in topology().objects if o.bucket == bucket)
    return await js.create_object_store(bucket, config=cfg)


def _reachable(servers: list[str], timeout: float = 3.0) -> bool:
    for server in servers:
        parsed = urlparse(server if "://" in server else f"nats://{server}")
        try:
            with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 4222), timeout=timeout):
                return True
        except OSError:
            continue
    return False


async def _log_error(exc: Exception) -> None:
    log.warning("nats: %s", exc)


CREDS_ENV = "NEURON_NATS_CREDS"


async def connect(url: str, name: str = "neuron-bus", creds: str | None = None, **kwargs) -> nats.NATS:
    """Connect to a server or cluster (comma-separated URLs).

    ``creds`` (default: env ``NEURON_NATS_CREDS``) is this process's own credential
    (`neuron-bus credentials issue`): the connection then signs in with it and takes its private
    inbox prefix (`identity_of` tells who it is). Fails at once with ConnectionRefusedError when no
    server answers; once connected, it reconnects to surviving servers forever (by default).
    """
    from neuron_bus.trust.identity import read_identity

    creds = creds or os.environ.get(CREDS_ENV) or None
    identity = read_identity(creds) if creds else None
    if identity is not None:
        kwargs.setdefault("user_credentials", str(identity.creds))
        kwargs.setdefault("inbox_prefix", identity.inbox)
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not await asyncio.to_thread(_reachable, servers):
        raise ConnectionRefusedError(f"no NATS server reachable at {url}")
    opts = dict(
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        allow_reconnect=True,
        error_cb=_log_error,
    )
    opts.update(kwargs)
    nc = await nats.connect(servers=servers, **opts)
    _WHO[nc] = (identity, _url_user(servers[0]))
    return nc


_WHO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # connection -> (identity, URL user)


def identity_of(nc):
    """The `Identity` a connection signed in with (None: no credential file)."""
    return _WHO.get(nc, (None, None))[0]


def owner_of(nc) -> str:
    """The name a connection's sessions are owned by: its credential's name, else its URL's user (a
    role), else ``public``."""
    identity = identity_of(nc)
    if identity is not None:
        return identity.name
    return _WHO.get(nc, (None, None))[1] or S.PUBLIC_OWNER


def _url_user(server: str) -> str | None:
    user = urlparse(server if "://" in server else f"nats://{server}").username
    return user if user and S._TOKEN.match(user) else None
