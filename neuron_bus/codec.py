"""Activation codec: header-tagged binary messages.

NATS headers carry an :class:`~neuron_bus.messages.ActivationHeader` (the session state key plus
phase, seq, dtype, shape, encoding), one header per field, as text. The body is the tensor as raw
little-endian f32, bf16 (the upper 16 bits of f32, rounded to nearest even) or i32 (token ids),
optionally compressed with zstd level 1.

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

_FIELDS = ActivationHeader.__struct_fields__
_OPTIONAL = {"encoding", "mac"}  # encoding defaults to raw; mac is absent on unauthenticated sessions
_INT_FIELDS = {"layer_start", "layer_end", "position", "seq"}
_compressor = zstandard.ZstdCompressor(level=1)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype="<f4").view("<u4")
    rounded = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype("<u2")
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded).astype("<u2")


def bf16_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype("<u4") << 16).view("<f4")


def _header_to_nats(h: ActivationHeader) -> dict[str, str]:
    out = {}
    for name in _FIELDS:
        value = getattr(h, name)
        if name == "mac" and not value:
            continue
        out[name] = ",".join(str(int(d)) for d in value) if name == "shape" else str(value)
    return out


def _header_from_nats(headers: dict[str, str] | None) -> ActivationHeader:
    if not headers:
        raise MalformedMessage(Reason.MISSING_HEADER, "activation has no headers")
    raw: dict[str, object] = {}
    for name in _FIELDS:
        if name not in headers:
            if name in _OPTIONAL:
                continue
            raise MalformedMessage(Reason.MISSING_HEADER, f"activation header {name!r} is missing")
        value = headers[name]
        try:
            if name in _INT_FIELDS:
                raw[name] = int(value)
            elif name == "shape":
                raw[name] = [int(d) for d in value.split(",")] if value else []
            else:
                raw[name] = value
        except ValueError:
            raise MalformedMessage(Reason.BAD_HEADER, f"activation header {name}={value!r} is not valid") from None
    dtype, encoding = raw.get("dtype"), raw.get("encoding", "raw")
    if dtype not in DTYPES:
        raise MalformedMessage(
            Reason.UNKNOWN_DTYPE, f"unknown activation dtype {dtype!r} (expected one of {', '.join(DTYPES)})"
        )
    if encoding not in ENCODINGS:
        raise MalformedMessage(
            Reason.UNKNOWN_ENCODING, f"unknown activation encoding {encoding!r} (expected raw or zstd)"
        )
    try:
        header = msgspec.convert(raw, ActivationHeader)
    except msgspec.ValidationError as exc:
        raise MalformedMessage(Reason.BAD_HEADER, f"activation header: {exc}") from None
    if any(d < 0 for d in header.shape) or header.position < 0 or header.seq < 0:
        raise MalformedMessage(Reason.BAD_HEADER, "activation header has a negative shape, position or seq")
    if header.layer_start < 0 or header.layer_end <= header.layer_start:
        raise MalformedMessage(
            Reason.BAD_HEADER, f"activation header has an empty layer range {header.layer_start}-{header.layer_end}"
        )
    return header


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
