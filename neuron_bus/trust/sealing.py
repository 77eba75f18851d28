"""Per-session link keys: MACs over every activation, optional AEAD bodies, control proofs, sealed snapshots.

A client opening a session draws one fresh 256-bit key per hop of its route: *link key i*
protects everything that flows into hop i (prompt chunks from the client, hidden states from hop
i-1, and at hop 0 the tail's ring tokens). `SessionOpen` hands hop i its input key and its output
key (link i+1, or link 0 at the tail) over the hop's own control subject, which only that node's
credential may read. So a node can verify what it receives and sign what it sends, and cannot
forge into any link but the one it feeds anyway.

- MAC: keyed BLAKE2b (16 bytes) over the activation header exactly as carried (the bytes of the
  codec's ``activation`` header: every `ActivationHeader` field but ``mac``) and the body as sent.
  It is carried in the ``mac`` header and checked after the header's state key and before any
  model work (reason ``bad_mac``). What is checked is what was parsed: there is no canonical form
  to rebuild, nor one that two encoders could disagree on. A copy replayed is refused by seq/position (``replayed``); a copy moved
  to another session, route, hop or position no longer matches its MAC.
- Encryption (``SessionOpen.encrypt``, ``--encrypt-activations``): the body becomes
  ``nonce(24) || XChaCha20-Poly1305(body, aad=header bytes)`` under a subkey; the MAC covers
  the sealed body, so refusal comes before decryption; a body that does not open is ``bad_seal``.
- Control proofs: closing or resuming a session on a hop needs a MAC of the request with that
  hop's input key: only the client that opened it (and the hop itself) has it.
- Snapshots: a hop's exported KV state is MAC'd (and sealed with ``encrypt``) under a subkey of
  its input key, which the replacement of a repaired route receives with its `SessionResume`.

Subkeys are derived with BLAKE2b personalisation, one per purpose. No I/O.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from functools import lru_cache

from nacl import bindings as sodium
from nacl.exceptions import CryptoError

from neuron_bus import codec
from neuron_bus import messages as M
from neuron_bus.errors import SessionMismatch
from workers.errors import Reason

KEY_BYTES = 32
MAC_BYTES = 16
NONCE_BYTES = sodium.crypto_aead_xchacha20poly1305_ietf_NPUBBYTES  # 24: random nonces never collide


def new_key() -> str:
    """A fresh 256-bit link key, as text (base64url, no padding) for the JSON control messages."""
    return base64.urlsafe_b64encode(os.urandom(KEY_BYTES)).decode().rstrip("=")


def _raw(text: str) -> bytes:
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError):
        raise ValueError("a session key must be base64url") from None
    if len(raw) != KEY_BYTES:
        raise ValueError(f"a session key has {KEY_BYTES} bytes, got {len(raw)}")
    return raw


def _sub(raw: bytes, purpose: bytes) -> bytes:
    return hashlib.blake2b(b"", key=raw, person=purpose, digest_size=KEY_BYTES).digest()


@dataclass(frozen=True)
class LinkKey:
    """One link's key and its subkeys (MAC, AEAD, control proofs, snapshots)."""

    mac: bytes
    enc: bytes
    ctl: bytes
    snap: bytes
    snap_enc: bytes

    @classmethod
    def parse(cls, text: str) -> LinkKey:
        return _parse(text)

    def tag(self, head: bytes, body: bytes) -> str:
        """The MAC of an activation: its header's wire bytes ``head`` and its body as sent."""
        return _mac(self.mac, head, body)

    def proof(self, *parts: object) -> str:
        """A control request's proof: a MAC of its parts (op, session, route, positions)."""
        return _mac(self.ctl, "\n".join(str(p) for p in parts).encode(), b"")


@lru_cache(maxsize=4096)
def _parse(text: str) -> LinkKey:
    raw = _raw(text)
    return LinkKey(
        *(_sub(raw, p) for p in (b"nb-act-mac", b"nb-act-aead", b"nb-control", b"nb-snap-mac", b"nb-snap-aead"))
    )


def _mac(key: bytes, head: bytes, body: bytes) -> str:
    h = hashlib.blake2b(key=key, digest_size=MAC_BYTES)
    h.update(struct.pack("<I", len(head)))
    h.update(head)
    h.update(body)
    return h.hexdigest()


def head_of(headers: dict[str, str]) -> bytes:
    """The bytes an activation's MAC covers: its codec header as carried (b"" when it has none:
    such a message is refused by the codec first)."""
    return headers.get(codec.HEADER, "").encode()


def seal(
    header: M.ActivationHeader, headers: dict[str, str], body: bytes, key: str, encrypt: bool
) -> tuple[dict[str, str], bytes]:
    """Sign (and with ``encrypt`` first seal) an encoded activation with link key ``key``."""
    k = LinkKey.parse(key)
    head = head_of(headers)
    if encrypt:
        nonce = os.urandom(NONCE_BYTES)
        body = nonce + sodium.crypto_aead_xchacha20poly1305_ietf_encrypt(body, head, nonce, k.enc)
    header.mac = k.tag(head, body)
    headers[codec.MAC_HEADER] = header.mac
    return headers, body


def verify(header: M.ActivationHeader, head: bytes, body: bytes, key: str, encrypt: bool) -> bytes:
    """Check an activation's MAC (``header.mac``) over its header bytes ``head`` (`head_of`) and
    ``body`` against link key ``key``; return its body (opened with ``encrypt``).

    Raises `SessionMismatch` ``bad_mac`` (missing or wrong MAC) or ``bad_seal`` (a body that does
    not open) before anything reads the body.
    """
    k = LinkKey.parse(key)
    if not header.mac:
        raise SessionMismatch(Reason.BAD_MAC, f"session {header.session_id}: activation carries no MAC")
    if not hmac.compare_digest(header.mac, k.tag(head, body)):
        raise SessionMismatch(Reason.BAD_MAC, f"session {header.session_id}: activation MAC does not match")
    if not encrypt:
        return body
    if len(body) < NONCE_BYTES:
        raise SessionMismatch(Reason.BAD_SEAL, f"session {header.session_id}: sealed body too short")
    try:
        return sodium.crypto_aead_xchacha20poly1305_ietf_decrypt(body[NONCE_BYTES:], head, body[:NONCE_BYTES], k.enc)
    except CryptoError:
        raise SessionMismatch(Reason.BAD_SEAL, f"session {header.session_id}: sealed body does not open") from None


def close_parts(req: M.SessionClose) -> tuple:
    """What a close's proof covers: the session, and the blocks the hops are to keep of it (a
    forged close cannot make a hop keep KV under hashes the client never named)."""
    return ("close", req.session_id) + ((",".join(req.keep_blocks),) if req.keep_blocks else ())


def keep_alive_parts(req: M.SessionKeepAlive) -> tuple:
    """What a keep-alive's proof covers: the session and its route (nobody else may hold a session
    its client left, taking a hop's memory)."""
    return ("keep_alive", req.session_id, req.route_id)


def resume_parts(req: M.SessionResume) -> tuple:
    """What a resume's proof covers: the session, the route it moves to and where."""
    o = req.open
    return ("resume", o.session_id, o.route.route_id, req.position, req.replay_end)


def check_proof(key: str, proof: str, *parts: object) -> bool:
    return bool(proof) and hmac.compare_digest(proof, LinkKey.parse(key).proof(*parts))


def prove(key: str, parts: tuple) -> str:
    """A client's proof of a request about its session (close, keep-alive, resume) with the hop's
    input key; none for a session opened without keys."""
    return LinkKey.parse(key).proof(*parts) if key else ""


def proven(key: str, proof: str, parts: tuple) -> bool:
    """Does ``proof`` show the request comes from the session's client? A session opened without
    keys takes anyone's word, as it takes anyone's activations."""
    return not key or check_proof(key, proof, *parts)


# ---------------------------------------------------------------------------------------------- snapshots


def _snapshot_head(meta: M.SnapshotMeta) -> bytes:
    fields = [f for f in M.SnapshotMeta.__struct_fields__ if f not in ("mac", "created_at", "generation_id")]
    return "\n".join(f"{f}={getattr(meta, f)}" for f in fields).encode()


def seal_snapshot(meta: M.SnapshotMeta, blob: bytes, key: str, encrypt: bool) -> bytes:
    """Protect a snapshot under its hop's input key: seal the blob with ``encrypt``, then MAC it
    with its metadata (``meta.mac``, ``meta.nbytes`` and ``meta.sealed`` are set here)."""
    k = LinkKey.parse(key)
    if encrypt:
        nonce = os.urandom(NONCE_BYTES)
        blob = nonce + sodium.crypto_aead_xchacha20poly1305_ietf_encrypt(blob, b"snapshot", nonce, k.snap_enc)
    meta.sealed, meta.nbytes = encrypt, len(blob)
    meta.mac = _mac(k.snap, _snapshot_head(meta), blob)
    return blob


def open_snapshot(meta: M.SnapshotMeta, blob: bytes, key: str) -> bytes:
    """The snapshot's state, once its MAC matched (ValueError otherwise)."""
    k = LinkKey.parse(key)
    if not meta.mac or not hmac.compare_digest(meta.mac, _mac(k.snap, _snapshot_head(meta), blob)):
        raise ValueError(f"snapshot of session {meta.session_id} at {meta.position}: MAC does not match")
    if not meta.sealed:
        return blob
    try:
        return sodium.crypto_aead_xchacha20poly1305_ietf_decrypt(
            blob[NONCE_BYTES:], b"snapshot", blob[:NONCE_BYTES], k.snap_enc
        )
    except CryptoError:
        raise ValueError(f"snapshot of session {meta.session_id}: sealed state does not open") from None
