"""Bus permissions: one NATS user per role, each allowed only the subjects its role uses.

`render(passwords)` returns an ``authorization { users = [...] }`` block for the nats-server
configuration (``neuron-bus permissions --out nats-auth.conf``; ``neuron-bus server --auth``
appends it to the server's config). Processes connect as their role with
``nats://<role>:<password>@host:port`` (`role_url`).

Everything not allowed is refused by the server: a publish outside the allow list is dropped
and reported to the client as a permissions violation; a subscription outside it never receives.
Replies to requests (``_INBOX.*``) are allowed per request with ``allow_responses``.

Roles:
- worker:   its data plane (activations, tokens, telemetry, errors), node announcements and
            heartbeats, control requests, validation events and ledger entries, KV/object
            buckets and the JetStream API (its consumers)
- tracker:  node reports and heartbeats in, route assignments and the heartbeats it took out (and
            in: other trackers'), route/coverage requests, validation events (sampling) and
            audit requests, KV buckets
- auditor:  audit requests and validation events in, verdicts and KV ``neuron-flags`` out
- client:   route and coverage requests, control requests to nodes, prompt chunks into hop 0,
            its own tokens, errors and telemetry, route nodes' heartbeats
- gateway:  what a client may do, plus replaying a session's stored tokens (ordered consumers)
- observer: reads telemetry (``neuron.telemetry.>``, live or stored) and nothing else
- admin:    everything (provisioning streams and buckets, operators)
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from urllib.parse import quote, urlparse, urlunparse

from neuron_bus import subjects as S

R = S.ROOT
INBOX = "_INBOX.>"
JS_ALL = "$JS.API.>"
JS_ACK = "$JS.ACK.>"


def _js_read(stream: str) -> list[str]:
    """The JetStream API calls needed to read one stream with ephemeral/ordered consumers."""
    return [
        "$JS.API.INFO",
        f"$JS.API.STREAM.INFO.{stream}",
        "$JS.API.STREAM.NAMES",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.DELETE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.>",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.ACK.{stream}.>",
    ]


ROLES: dict[str, dict[str, list[str]]] = {
    "worker": {
        "publish": [
            f"{R}.node.*.caps",
            f"{R}.node.*.heartbeat",
            f"{R}.node.*.ctl",
            S.TRACKER_PLACE,  # a --layers auto worker asks for its range
            f"{R}.act.>",
            f"{R}.session.>",
            f"{R}.telemetry.>",
            f"{R}.validation.>",
            f"{R}.ledger.>",
            JS_ALL,
            JS_ACK,
            "$KV.>",
            "$O.>",
            INBOX,
        ],
        "subscribe": [f"{R}.node.*.ctl", f"{R}.node.*.move", f"{R}.node.*.heartbeat", f"{R}.act.>", INBOX],
    },
    "tracker": {
        "publish": [
            f"{R}.route.assign.>",
            f"{R}.node.*.ctl",
            f"{R}.node.*.move",  # MoveRange: trackers alone may ask a node to move
            S.TRACKER_HEARTBEATS,  # the heartbeats each tracker took, for the others
            S.PLACEMENT_DECISIONS,
            S.AUDIT_REQUEST,
            JS_ALL,
            JS_ACK,
            "$KV.>",
            INBOX,
        ],
        "subscribe": [
            f"{R}.node.*.caps",
            f"{R}.node.*.heartbeat",
            S.ROUTE_REQUEST,
            S.ROUTE_ASSIGN_ALL,  # the other trackers' assignments count as load
            S.TRACKER_HEARTBEATS,
            S.TRACKER_COVERAGE,
            S.TRACKER_PLACE,  # answered by the holder of the placement lease
            S.VALIDATION_ALL,
            INBOX,
        ],
    },
    "auditor": {
        "publish": [f"{R}.audit.verdict.>", JS_ALL, JS_ACK, "$KV.>", INBOX],
        "subscribe": [S.AUDIT_REQUEST, f"{R}.audit.verdict.>", S.VALIDATION_ALL, INBOX],
    },
    "client": {
        "publish": [
            S.ROUTE_REQUEST,
            S.TRACKER_COVERAGE,
            f"{R}.node.*.ctl",
            f"{R}.act.*.*.0.prefill.*",
            f"{R}.session.*.*.error",
            f"{R}.telemetry.>",
            "$JS.API.INFO",
            "$JS.API.STREAM.INFO.*",
            INBOX,
        ],
        "subscribe": [f"{R}.session.>", f"{R}.telemetry.>", f"{R}.node.*.heartbeat", INBOX],
    },
    "observer": {
        "publish": [*_js_read(S.STREAM_TELEMETRY), INBOX],
        "subscribe": [f"{R}.telemetry.>", INBOX],
    },
    "admin": {"publish": [">"], "subscribe": [">"]},
}
ROLES["gateway"] = {
    "publish": ROLES["client"]["publish"] + _js_read(S.STREAM_TOKENS) + _js_read(S.STREAM_TELEMETRY),
    "subscribe": ROLES["client"]["subscribe"],
}


# --------------------------------------------------------------------------------------------
# Per-identity grants (decentralized auth, identity.py): each credential is allowed its role's
# subjects *for its own name* only.


def _consume(stream: str, filter_subject: str) -> list[str]:
    """Create, delete and acknowledge push consumers of ``stream`` whose filter is under
    ``filter_subject`` (consumer names are unguessable MACs: consumers.py)."""
    return [
        f"$JS.API.CONSUMER.CREATE.{stream}.*.{filter_subject}",
        f"$JS.API.CONSUMER.DELETE.{stream}.*",
        f"$JS.ACK.{stream}.>",
    ]


def _bucket(stream: str) -> list[str]:
    """Read and write an object bucket (snapshots: MAC'd, and sealed with --encrypt-activations)."""
    return [*_js_read(stream), f"$JS.API.STREAM.PURGE.{stream}"]


_META = ["$JS.API.INFO", "$JS.API.STREAM.INFO.*", "$JS.API.STREAM.NAMES"]


def _worker(n: str) -> dict[str, list[str]]:
    return {
        "publish": [
            S.node_caps(n),
            S.node_heartbeat(n),
            f"{R}.node.*.ctl",  # pings of its route neighbours
            S.TRACKER_PLACE,  # --layers auto: its range
            f"{R}.act.>",  # into the next hop (and the ring into hop 0): MAC'd with the link key
            f"{R}.session.*.*.tokens",
            f"{R}.session.*.*.error",
            f"{R}.telemetry.>",
            f"{R}.validation.>",
            S.ledger(n),
            f"$KV.{S.KV_NODES}.{n}",
            "$O.neuron-snapshots.>",
            *_META,
            *_consume(S.STREAM_PREFILL, S.node_inputs(n)),
            *_consume(S.STREAM_DECODE, S.node_inputs(n)),
            *_bucket("OBJ_neuron-snapshots"),
            *_js_read("OBJ_neuron-artifacts"),
            *_js_read(f"KV_{S.KV_NODES}"),
        ],
        "subscribe": [S.node_control(n), S.node_move(n), f"_INBOX.{n}.>"],
    }


def _client(n: str) -> dict[str, list[str]]:
    return {
        "publish": [
            S.ROUTE_REQUEST,
            S.TRACKER_COVERAGE,
            f"{R}.node.*.ctl",
            f"{R}.act.*.*.0.prefill.*",  # prompt chunks into hop 0 only
            f"{R}.session.{n}.*.error",
            f"{R}.telemetry.{n}.>",
            *_META,
            *_js_read(S.STREAM_TELEMETRY),  # telemetry is public
            *_js_read(f"KV_{S.KV_NODES}"),  # capability reports (repair)
            f"$JS.API.CONSUMER.CREATE.{S.STREAM_TOKENS}.*.{S.owner_sessions(n)}",  # replaying its own tokens
            f"$JS.API.CONSUMER.DELETE.{S.STREAM_TOKENS}.*",
        ],
        "subscribe": [S.owner_sessions(n), f"{R}.telemetry.>", f"{R}.node.*.heartbeat", f"_INBOX.{n}.>"],
    }


def _infra(role: str, n: str) -> dict[str, list[str]]:
    """The operator's own processes (tracker, auditor) keep their role's lists, with a private inbox."""
    base = ROLES[role]
    return {
        "publish": [p for p in base["publish"] if p != INBOX] + [f"_INBOX.{n}.>"],
        "subscribe": [p for p in base["subscribe"] if p != INBOX] + [f"_INBOX.{n}.>"],
    }


def grants(role: str, name: str) -> dict[str, list[str]]:
    """The subjects credential ``name`` of ``role`` may publish and subscribe (subjects.md, Permissions)."""
    S.check_token(name, "name")
    if role == "worker":
        return _worker(name)
    if role in ("client", "gateway"):
        return _client(name)
    if role in ("tracker", "auditor"):
        return _infra(role, name)
    if role == "observer":
        return {"publish": [*_js_read(S.STREAM_TELEMETRY)], "subscribe": [f"{R}.telemetry.>", f"_INBOX.{name}.>"]}
    if role == "admin":
        return {"publish": [">"], "subscribe": [">"]}
    raise ValueError(f"unknown role {role!r}: one of worker, tracker, auditor, client, gateway, observer, admin")


def new_passwords(roles=tuple(ROLES)) -> dict[str, str]:
    return {role: secrets.token_urlsafe(24) for role in roles}


def load_or_create_passwords(path: Path) -> dict[str, str]:
    """Role -> password from ``path`` (JSON), creating it (mode 0600) with new passwords for missing roles."""
    path = Path(path)
    have = json.loads(path.read_text()) if path.is_file() else {}
    missing = [r for r in ROLES if r not in have]
    if missing or not path.is_file():
        have.update(new_passwords(missing))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600, exist_ok=True)
        path.chmod(0o600)
        path.write_text(json.dumps(have, indent=2) + "\n")
    return have


def _list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def render(passwords: dict[str, str]) -> str:
    """The nats-server ``authorization`` block for these role passwords."""
    lines = [
        "# neuron-bus: one user per role (neuron-bus permissions); keep this file private",
        "authorization {",
        "  users = [",
    ]
    for role, password in passwords.items():
        perms = ROLES[role]
        lines += [
            "    {",
            f"      user: {json.dumps(role)}",
            f"      password: {json.dumps(password)}",
            "      permissions: {",
            f"        publish: {{ allow: {_list(perms['publish'])} }}",
            f"        subscribe: {{ allow: {_list(perms['subscribe'])} }}",
            "        allow_responses: true",
            "      }",
            "    }",
        ]
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def role_url(url: str, role: str, password: str) -> str:
    """``url`` (comma-separated servers) with ``role:password@`` in every server."""
    out = []
    for server in (u.strip() for u in url.split(",") if u.strip()):
        p = urlparse(server if "://" in server else f"nats://{server}")
        netloc = f"{quote(role, safe='')}:{quote(password, safe='')}@{p.hostname}:{p.port or 4222}"
        out.append(urlunparse(p._replace(netloc=netloc)))
    return ",".join(out)


def tls_block(cert: Path, key: Path, ca: Path | None = None) -> str:
    """A nats-server ``tls`` block serving ``cert``/``key`` (clients then connect with tls://)."""
    lines = [
        "tls {",
        f"  cert_file: {json.dumps(str(Path(cert).resolve()))}",
        f"  key_file: {json.dumps(str(Path(key).resolve()))}",
    ]
    if ca:
        lines.append(f"  ca_file: {json.dumps(str(Path(ca).resolve()))}")
    lines.append("}")
    return "\n".join(lines) + "\n"
