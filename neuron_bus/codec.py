"""Activation codec: header-tagged binary messages.

One NATS header, ``activation``, carries an :class:`~neuron_bus.messages.ActivationHeader` (the
session state key plus phase, seq, dtype, shape, encoding) as compact JSON; its MAC, when the
session is keyed, rides in a second header, ``mac``, and covers these exact header bytes
(trust/sealing.py). One header instead of one per field: nats-py builds and parses every header
line in Python on both sides of each hop, and the fields' text forms had to be rebuilt for the MAC.
The body is the tensor as raw little-endian f32, bf16 (the upper 16 bits of f32, rounded to
nearest even) or i32 (token ids), optionally compressed with zstd level 1.

Anything malformed raises :class:`~neuron_bus.errors.MalformedMessage` with a reason label
(missing_header, bad_header, unknown_dtype, unknown_encoding, corrupt_zstd, size_mismatch,
oversized) and a one-line message; nothing is half-decoded.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import zstandard

from neuron_bus.errors import MalformedMessage
from neuron_bus.messages import ActivationHeader
from workers.errors import Reason

DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype("<f4"),
    "bf16": np.dtype("<u2"),  # bit pattern; numpy has no bfloat16
    "i32": np.dtype("<i4"),
}
ENCODINGS = ("raw", "zstd")
DEFAULT_MAX_BODY = 64 * 1024 * 1024

HEADER = "activation"  # the NATS header holding the ActivationHeader as JSON
MAC_HEADER = "mac"  # its MAC under the session's link key (absent on unauthenticated sessions)
_REQUIRED = [f for f in ActivationHeader.__struct_fields__ if f not in ("encoding", "mac")]
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ActivationHeader)
_compressor = zstandard.ZstdCompressor(level=1)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype="<f4").view("<u4")
    rounded = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype("<u2")
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded).astype("<u2")


def bf16_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype("<u4") << 16).view("<f4")


def _header_to_nats(h: ActivationHeader) -> dict[str, str]:
    wire = h if not h.mac else msgspec.structs.replace(h, mac="")  # the MAC is never inside what it covers
    return {HEADER: _encoder.encode(wire).decode()}


def _header_from_nats(headers: dict[str, str] | None) -> ActivationHeader:
    headers = headers or {}
    text = headers.get(HEADER)
    if text is None:
        raise MalformedMessage(Reason.MISSING_HEADER, f"activation has no {HEADER!r} header")
    try:
        header = _decoder.decode(text)
    except (msgspec.ValidationError, msgspec.DecodeError):
        raise _why_not(text) from None
    header.mac = headers.get(MAC_HEADER, "")
    if any(d < 0 for d in header.shape) or header.position < 0 or header.seq < 0:
        raise MalformedMessage(Reason.BAD_HEADER, "activation header has a negative shape, position or seq")
    if header.layer_start < 0 or header.layer_end <= header.layer_start:
        raise MalformedMessage(
            Reason.BAD_HEADER, f"activation header has an empty layer range {header.layer_start}-{header.layer_end}"
        )
    return header


def _why_not(text: str) -> MalformedMessage:
    """What is wrong with an activation header that did not decode (the slow path: only for refusals)."""
    try:
        raw = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return MalformedMessage(Reason.BAD_HEADER, f"activation header is not JSON: {text[:80]!r}")
    if not isinstance(raw, dict):
        return MalformedMessage(Reason.BAD_HEADER, "activation header is not a JSON object")
    missing = [name for name in _REQUIRED if name not in raw]
    if missing:
        return MalformedMessage(Reason.MISSING_HEADER, f"activation header field {missing[0]!r} is missing")
    dtype, encoding = raw.get("dtype"), raw.get("encoding", "raw")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        return MalformedMessage(
            Reason.UNKNOWN_DTYPE, f"unknown activation dtype {dtype!r} (expected one of {', '.join(DTYPES)})"
        )
    if not isinstance(encoding, str) or encoding not in ENCODINGS:
        return MalformedMessage(
            Reason.UNKNOWN_ENCODING, f"unknown activation encoding {encoding!r} (expected raw or zstd)"
        )
    try:
        msgspec.convert(raw, ActivationHeader)
    except msgspec.ValidationError as exc:
        return MalformedMessage(Reason.BAD_HEADER, f"activation header: {exc}")
    return MalformedMessage(Reason.BAD_HEADER, "activation header does not decode")


def session_of(headers: dict[str, str] | None) -> str:
    """The session an activation names, as far as its header can be read ("" when it cannot): a
    refused message's session is told why."""
    try:
        raw = msgspec.json.decode((headers or {}).get(HEADER, ""))
    except msgspec.DecodeError:
        return ""
    sid = raw.get("session_id") if isinstance(raw, dict) else None
    return sid if isinstance(sid, str) else ""


def encode(
    header: ActivationHeader, array: np.ndarray, *, max_body: int = DEFAULT_MAX_BODY
) -> tuple[dict[str, str], bytes]:
    """Encode ``array`` (float32 hidden states or int32 token ids) as headers + body.

    ``header.dtype`` and ``header.encoding`` choose the wire format; ``header.shape`` is set from
    the array.
    """
    if header.dtype not in DTYPES:
        raise MalformedMessage(Reason.UNKNOWN_DTYPE, f"unknown activation dtype {header.dtype!r}")
    if header.encoding not in ENCODINGS:
        raise MalformedMessage(Reason.UNKNOWN_ENCODING, f"unknown activation encoding {header.encoding!r}")
    header.shape = [int(d) for d in array.shape]
    if header.dtype == "bf16":
        body = f32_to_bf16(array).tobytes()
    else:
        body = np.ascontiguousarray(array, dtype=DTYPES[header.dtype]).tobytes()
    if header.encoding == "zstd":
        body = _compressor.compress(body)
    if len(body) > max_body:
        raise MalformedMessage(
            Reason.OVERSIZED, f"activation body of {len(body)} bytes exceeds the limit of {max_body}"
        )
    return _header_to_nats(header), body


def decode(
    headers: dict[str, str] | None, body: bytes, *, max_body: int = DEFAULT_MAX_BODY
) -> tuple[ActivationHeader, np.ndarray]:
    """Decode and validate; return the header and a float32 (or int32 for i32) array."""
    header = decode_header(headers)
    return header, decode_body(header, body, max_body=max_body)


def decode_header(headers: dict[str, str] | None) -> ActivationHeader:
    """The validated state key and tensor description of an activation (its body untouched)."""
    return _header_from_nats(headers)


def decode_body(header: ActivationHeader, body: bytes, *, max_body: int = DEFAULT_MAX_BODY) -> np.ndarray:
    """The tensor of a body ``header`` describes (after any MAC check and unsealing)."""
    if len(body) > max_body:
        raise MalformedMessage(
            Reason.OVERSIZED, f"activation body of {len(body)} bytes exceeds the limit of {max_body}"
        )
    dtype = DTYPES[header.dtype]
    expected = math.prod(header.shape) * dtype.itemsize
    if expected > max_body:
        raise MalformedMessage(
            Reason.OVERSIZED, f"activation shape {header.shape} needs {expected} bytes, over the limit of {max_body}"
        )
    if header.encoding == "zstd":
        try:
            declared = zstandard.frame_content_size(body)  # -1 when the frame does not say
            if declared >= 0 and declared != expected:
                raise MalformedMessage(
                    Reason.SIZE_MISMATCH,
                    f"activation body decompresses to {declared} bytes but shape {header.shape} x {header.dtype} needs {expected}",
                )
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=max(expected, 1))
        except zstandard.ZstdError as exc:
            raise MalformedMessage(Reason.CORRUPT_ZSTD, f"activation body is not valid zstd: {exc}") from None
    if len(body) != expected:
        raise MalformedMessage(
            Reason.SIZE_MISMATCH,
            f"activation body has {len(body)} bytes but shape {header.shape} x {header.dtype} needs {expected}",
        )
    array = np.frombuffer(body, dtype=dtype).reshape(header.shape)
    if header.dtype == "bf16":
        array = bf16_to_f32(array)
    return array
