"""Per-node and per-client identity: NATS decentralized auth (operator → account → user JWTs, nkeys).

An *authority* directory (``neuron-bus credentials init``) holds the operator's, the swarm
account's and the system account's keys and JWTs. Every node, client, gateway, tracker and
auditor gets its own user credential (``neuron-bus credentials issue``): a user JWT signed by the
account key, carrying the subject permissions of its role *for its own name* (permissions.py,
`grants`), and its nkey seed, in a ``.creds`` file.

The servers trust the operator and resolve accounts with the ``full`` resolver
(`server_config`): a credential is verified by signature, so admitting a node needs no server
change at all, and revoking one is an updated account JWT pushed over the bus
(``$SYS.REQ.CLAIMS.UPDATE``, as the system account): every server applies it and drops the
node's connections, without a restart (docs/security.md says why this and not per-node users).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import nkeys

from neuron_bus import subjects as S

ACCOUNT = "neuron"
ROLES_WITH_IDENTITY = ("worker", "tracker", "auditor", "client", "gateway", "observer", "admin")
_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
_NO_LIMITS = {"subs": -1, "data": -1, "payload": -1}
_ACCOUNT_LIMITS = {
    **_NO_LIMITS,
    "imports": -1,
    "exports": -1,
    "wildcards": True,
    "conn": -1,
    "leaf": -1,
}
_JETSTREAM = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1, "max_ack_pending": -1}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_seed(prefix: int) -> bytes:
    return nkeys.encode_seed(os.urandom(32), prefix)


def public_key(seed: bytes) -> str:
    return nkeys.from_seed(bytearray(seed)).public_key.decode()


def sign_jwt(claims: dict, issuer_seed: bytes) -> str:
    """A NATS JWT (v2): ``claims`` issued (``iss``) and signed by ``issuer_seed``."""
    kp = nkeys.from_seed(bytearray(issuer_seed))
    body = dict(claims, iss=kp.public_key.decode(), iat=int(claims.get("iat") or time.time()))
    body.pop("jti", None)
    digest = hashlib.new("sha512_256", json.dumps(body, separators=(",", ":")).encode()).digest()
    body["jti"] = base64.b32encode(digest).decode().rstrip("=")
    signing_input = f"{_b64(json.dumps(_HEADER).encode())}.{_b64(json.dumps(body, separators=(',', ':')).encode())}"
    return f"{signing_input}.{_b64(kp.sign(signing_input.encode()))}"


def jwt_claims(token: str) -> dict:
    """The claims of a JWT (not verified: the servers verify)."""
    return json.loads(_unb64(token.split(".")[1]))


def creds_text(user_jwt: str, seed: bytes) -> str:
    return (
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )


@dataclass(frozen=True)
class Identity:
    """What a process knows of its own credential: its name (subject token), role and seed."""

    name: str
    role: str
    creds: Path
    seed: bytes

    @property
    def inbox(self) -> str:
        """Its inbox prefix: replies and push deliveries to it, which no other credential may read."""
        return f"_INBOX.{self.name}"

    @property
    def secret(self) -> bytes:
        """A secret only this credential's holder can compute (names of its JetStream consumers)."""
        return hashlib.blake2b(self.seed, person=b"nb-node-secret", digest_size=32).digest()


def read_identity(creds: str | Path) -> Identity:
    """The identity in a ``.creds`` file written by `Authority.issue`."""
    path = Path(creds)
    lines = path.read_text().splitlines()
    token = lines[lines.index("-----BEGIN NATS USER JWT-----") + 1].strip()
    seed = lines[lines.index("-----BEGIN USER NKEY SEED-----") + 1].strip().encode()
    claims = jwt_claims(token)
    tags = claims.get("nats", {}).get("tags", [])
    role = next((t.split(":", 1)[1] for t in tags if t.startswith("role:")), "")
    return Identity(name=claims["name"], role=role, creds=path, seed=seed)


class Authority:
    """The operator's directory: keys, account JWTs, issued and revoked credentials."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    # -- files -----------------------------------------------------------------------------------

    def _path(self, *parts: str) -> Path:
        return self.root.joinpath(*parts)

    def _seed(self, name: str) -> bytes:
        return self._path("keys", f"{name}.nk").read_bytes().strip()

    def _write(self, path: Path, text: str, private: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if private:
            path.touch(mode=0o600, exist_ok=True)
            path.chmod(0o600)
        path.write_text(text)

    def _registry(self) -> dict:
        p = self._path("issued.json")
        return json.loads(p.read_text()) if p.is_file() else {"issued": {}, "revoked": {}}

    def _save_registry(self, reg: dict) -> None:
        self._write(self._path("issued.json"), json.dumps(reg, indent=2) + "\n", private=True)

    def creds_path(self, name: str) -> Path:
        return self._path("creds", f"{S.check_token(name, 'name')}.creds")

    @property
    def exists(self) -> bool:
        return self._path("operator.jwt").is_file()

    # -- keys and JWTs ---------------------------------------------------------------------------

    def init(self) -> Authority:
        """Create the operator, the system account and the swarm account (idempotent)."""
        if self.exists:
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        for name, prefix in (
            ("operator", nkeys.PREFIX_BYTE_OPERATOR),
            ("system", nkeys.PREFIX_BYTE_ACCOUNT),
            (ACCOUNT, nkeys.PREFIX_BYTE_ACCOUNT),
        ):
            self._write(self._path("keys", f"{name}.nk"), new_seed(prefix).decode() + "\n", private=True)
        op = self._seed("operator")
        sys_pub = public_key(self._seed("system"))
        operator: dict = {"name": "neuron-operator", "sub": public_key(op)}
        operator["nats"] = {"system_account": sys_pub, "type": "operator", "version": 2}
        self._write(self._path("operator.jwt"), sign_jwt(operator, op))
        system = {"name": "SYS", "sub": sys_pub, "nats": {"limits": _ACCOUNT_LIMITS, "type": "account", "version": 2}}
        self._write(self._path("accounts", "system.jwt"), sign_jwt(system, op))
        self._save_registry({"issued": {}, "revoked": {}})
        self._sign_account()
        self.issue("sys", "system")  # pushes account updates (revocations) to the servers
        return self

    def _sign_account(self) -> str:
        """The swarm account's JWT, with every revocation so far."""
        revoked = {pub: ts for pub, ts in self._registry()["revoked"].items()}
        claims = {
            "name": ACCOUNT,
            "sub": public_key(self._seed(ACCOUNT)),
            "nats": {
                "limits": {**_ACCOUNT_LIMITS, **_JETSTREAM},
                "default_permissions": {"pub": {}, "sub": {}},
                "revocations": revoked,
                "type": "account",
                "version": 2,
            },
        }
        token = sign_jwt(claims, self._seed("operator"))
        self._write(self._path("accounts", f"{ACCOUNT}.jwt"), token)
        return token

    def account_jwt(self) -> str:
        return self._path("accounts", f"{ACCOUNT}.jwt").read_text().strip()

    def issue(self, name: str, role: str) -> Path:
        """A new credential for ``name`` in ``role``: a user JWT with the role's permissions for that
        name, signed by the account (system: a system-account user). Admitting a node is this."""
        from neuron_bus.trust.permissions import grants

        S.check_token(name, "name")
        seed = new_seed(nkeys.PREFIX_BYTE_USER)
        account = "system" if role == "system" else ACCOUNT
        nats: dict = {**_NO_LIMITS, "type": "user", "version": 2, "tags": [f"role:{role}"]}
        if role != "system":
            perms = grants(role, name)
            nats.update(pub={"allow": perms["publish"]}, sub={"allow": perms["subscribe"]}, resp={"max": 1, "ttl": 0})
        token = sign_jwt({"name": name, "sub": public_key(seed), "nats": nats}, self._seed(account))
        path = self.creds_path(name)
        self._write(path, creds_text(token, seed), private=True)
        reg = self._registry()
        reg["issued"].setdefault(name, []).append({"role": role, "key": public_key(seed), "at": time.time()})
        self._save_registry(reg)
        return path

    def revoke(self, name: str) -> str:
        """Revoke every credential issued to ``name``; return the account JWT to push to the servers."""
        reg = self._registry()
        issued = reg["issued"].get(name)
        if not issued:
            raise ValueError(f"no credential was issued to {name!r}")
        now = int(time.time()) + 1  # covers a credential issued within this second
        for entry in issued:
            reg["revoked"][entry["key"]] = now
        self._save_registry(reg)
        return self._sign_account()

    def issued(self) -> dict[str, list[dict]]:
        return self._registry()["issued"]

    def revoked_keys(self) -> set[str]:
        return set(self._registry()["revoked"])

    def server_config(self, resolver_dir: str | Path) -> str:
        """The nats-server configuration that trusts this operator (full resolver, accounts preloaded)."""
        accounts = {
            public_key(self._seed("system")): self._path("accounts", "system.jwt").read_text().strip(),
            public_key(self._seed(ACCOUNT)): self.account_jwt(),
        }
        preload = "\n".join(f"    {pub}: {json.dumps(token)}" for pub, token in accounts.items())
        return (
            "# neuron-bus: decentralized auth (neuron-bus credentials); accounts resolved and updated over the bus\n"
            f"operator: {json.dumps(str(self._path('operator.jwt').resolve()))}\n"
            f"system_account: {public_key(self._seed('system'))}\n"
            "resolver: {\n  type: full\n"
            f"  dir: {json.dumps(str(Path(resolver_dir).resolve()))}\n"
            '  allow_delete: false\n  interval: "2m"\n  timeout: "3s"\n}\n'
            f"resolver_preload: {{\n{preload}\n}}\n"
        )


async def push_account(url: str, authority: Authority) -> str:
    """Send the swarm account's current JWT to the servers (``$SYS.REQ.CLAIMS.UPDATE``, as the system
    account); every server of a cluster applies it at once. Returns the server's answer."""
    from neuron_bus.topology import connect

    nc = await connect(url, name="neuron-bus-credentials", creds=str(authority.creds_path("sys")))
    try:
        reply = await nc.request("$SYS.REQ.CLAIMS.UPDATE", authority.account_jwt().encode(), timeout=10)
        return reply.data.decode()
    finally:
        await nc.close()
