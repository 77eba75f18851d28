"""Activation codec: property tests for round trips and for rejection of malformed input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import zstandard
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from neuron_bus import codec
from neuron_bus.errors import MalformedMessage
from neuron_bus.messages import ActivationHeader
from tests import wire


def header(**kw) -> ActivationHeader:
    base = dict(
        session_id="s1",
        route_id="r1",
        model_preset="smollm2-135m",
        model_revision="abc",
        backend_id="llama-cpp",
        cache_abi="abi-1",
        layer_start=0,
        layer_end=15,
        position=0,
        phase="prefill",
        seq=0,
        dtype="f32",
        shape=[],
        encoding="raw",
    )
    base.update(kw)
    return ActivationHeader(**base)


floats = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=16),
    elements=st.floats(width=32, allow_nan=False, allow_infinity=False),
)


@settings(max_examples=150, deadline=None)
@given(arr=floats, encoding=st.sampled_from(["raw", "zstd"]), position=st.integers(0, 10**6), seq=st.integers(0, 10**6))
def test_f32_round_trip_is_exact(arr, encoding, position, seq):
    h = header(encoding=encoding, position=position, seq=seq)
    headers, body = codec.encode(h, arr)
    h2, out = codec.decode(headers, body)
    assert h2 == h
    assert out.dtype == np.float32 and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


@settings(max_examples=150, deadline=None)
@given(arr=floats, encoding=st.sampled_from(["raw", "zstd"]))
def test_bf16_round_trip_keeps_8_bits_of_mantissa(arr, encoding):
    headers, body = codec.encode(header(dtype="bf16", encoding=encoding), arr)
    if encoding == "raw":
        assert len(body) == arr.size * 2
    _, out = codec.decode(headers, body)
    assert out.dtype == np.float32
    finite = np.isfinite(out)
    np.testing.assert_allclose(out[finite], arr[finite], rtol=2**-8, atol=1e-38)
    # re-encoding a bf16 value is exact
    _, again = codec.decode(*codec.encode(header(dtype="bf16"), out))
    np.testing.assert_array_equal(again, out)


@given(ids=hnp.arrays(np.int32, st.integers(1, 64), elements=st.integers(0, 2**31 - 1)))
def test_token_ids_round_trip(ids):
    _, out = codec.decode(*codec.encode(header(dtype="i32", phase="decode"), ids))
    np.testing.assert_array_equal(out, ids)


def test_bf16_rounds_to_nearest_even_and_keeps_nan():
    x = np.array([1.0, 1.00390625, 1.01171875, np.nan, -0.0, np.inf], dtype=np.float32)
    out = codec.bf16_to_f32(codec.f32_to_bf16(x))
    assert out[0] == 1.0 and out[1] == 1.0 and out[2] == 1.015625
    assert np.isnan(out[3]) and out[5] == np.inf


def good() -> tuple[dict[str, str], bytes]:
    return codec.encode(header(), np.ones((2, 4), dtype=np.float32))


@settings(max_examples=200, deadline=None)
@given(drop=st.sampled_from([f for f in ActivationHeader.__struct_fields__ if f not in ("encoding", "mac")]))
def test_missing_header_rejected(drop):
    headers, body = good()
    with pytest.raises(MalformedMessage) as e:
        codec.decode(wire.edit(headers, **{drop: None}), body)
    assert e.value.reason == "missing_header" and drop in str(e.value)


def test_the_header_is_one_json_header_without_its_mac():
    h = header(mac="ab" * 16)
    headers, _ = codec.encode(h, np.ones((2, 4), dtype=np.float32))
    assert list(headers) == [codec.HEADER]
    assert wire.fields(headers)["mac"] == "" and wire.fields(headers)["shape"] == [2, 4]
    headers[codec.MAC_HEADER] = h.mac
    assert codec.decode_header(headers).mac == h.mac  # the MAC comes from its own header
    with pytest.raises(MalformedMessage) as e:
        codec.decode_header({"session_id": "s1"})  # the old one-header-per-field form
    assert e.value.reason == "missing_header"


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", "null", '"s1"'])
def test_a_header_that_is_not_a_json_object_is_rejected(text):
    with pytest.raises(MalformedMessage) as e:
        codec.decode_header({codec.HEADER: text})
    assert e.value.reason in {"bad_header", "missing_header"}
    assert codec.session_of({codec.HEADER: text}) == ""


@settings(max_examples=200, deadline=None)
@given(
    field=st.sampled_from(["layer_start", "layer_end", "position", "seq", "shape", "phase", "session_id"]),
    garbage=st.one_of(
        st.text(min_size=1, max_size=12),
        st.integers(-(2**40), -1),
        st.floats(),
        st.booleans(),
        st.none(),
        st.lists(st.integers(-3, 3), max_size=3),
    ),
)
def test_garbled_header_rejected(field, garbage):
    assume(not (field == "phase" and garbage in ("prefill", "decode")))  # the other phase is no garbage
    assume(not (field == "session_id" and isinstance(garbage, str)))  # any text is a session id here
    assume(garbage is not None)  # None drops the field: test_missing_header_rejected
    assume(not (field == "shape" and isinstance(garbage, list) and all(d >= 0 for d in garbage)))
    headers, body = good()
    with pytest.raises(MalformedMessage) as e:
        codec.decode(wire.edit(headers, **{field: garbage}), body)
    assert e.value.reason in {"bad_header", "size_mismatch"}
    readable = not (isinstance(garbage, float) and not math.isfinite(garbage))  # json.dumps writes NaN: not JSON
    expected = "s1" if field != "session_id" and readable else ""
    assert codec.session_of(wire.edit(headers, **{field: garbage})) == expected


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(0, 31), extra=st.binary(min_size=1, max_size=8))
def test_body_size_mismatch_rejected(cut, extra):
    headers, body = good()
    for bad in (body[:cut], body + extra):
        with pytest.raises(MalformedMessage) as e:
            codec.decode(headers, bad)
        assert e.value.reason == "size_mismatch"
        assert "needs 32" in str(e.value)


@given(dtype=st.text(min_size=1, max_size=8).filter(lambda s: s not in codec.DTYPES))
def test_unknown_dtype_rejected(dtype):
    headers, body = good()
    headers = wire.edit(headers, dtype=dtype)
    with pytest.raises(MalformedMessage) as e:
        codec.decode(headers, body)
    assert e.value.reason == "unknown_dtype"


@given(enc=st.text(min_size=1, max_size=8).filter(lambda s: s not in codec.ENCODINGS))
def test_unknown_encoding_rejected(enc):
    headers, body = good()
    headers = wire.edit(headers, encoding=enc)
    with pytest.raises(MalformedMessage) as e:
        codec.decode(headers, body)
    assert e.value.reason == "unknown_encoding"


@settings(max_examples=200, deadline=None)
@given(junk=st.binary(min_size=0, max_size=64))
def test_corrupt_zstd_rejected(junk):
    headers, _ = codec.encode(header(encoding="zstd"), np.ones((2, 4), dtype=np.float32))
    with pytest.raises(MalformedMessage) as e:
        codec.decode(headers, junk)
    assert e.value.reason in {"corrupt_zstd", "size_mismatch"}


def test_zstd_bomb_is_bounded_by_the_declared_shape():
    headers, _ = codec.encode(header(encoding="zstd"), np.ones((2, 4), dtype=np.float32))
    bomb = zstandard.ZstdCompressor().compress(b"\0" * 10_000_000)
    with pytest.raises(MalformedMessage) as e:
        codec.decode(headers, bomb)
    assert e.value.reason == "size_mismatch"  # refused from the frame header, never inflated


def test_oversized_payloads_rejected():
    headers, body = good()
    with pytest.raises(MalformedMessage) as e:
        codec.decode(headers, body, max_body=16)
    assert e.value.reason == "oversized"
    with pytest.raises(MalformedMessage) as e:
        codec.decode(wire.edit(headers, shape=[100000, 100000]), body)
    assert e.value.reason == "oversized"
    with pytest.raises(MalformedMessage) as e:
        codec.encode(header(), np.zeros((100, 100), dtype=np.float32), max_body=1000)
    assert e.value.reason == "oversized"


def test_no_headers_rejected():
    with pytest.raises(MalformedMessage) as e:
        codec.decode(None, b"")
    assert e.value.reason == "missing_header"


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    fields=st.dictionaries(st.sampled_from(list(ActivationHeader.__struct_fields__) + ["x"]), _json),
    text=st.text(max_size=40),
    body=st.binary(max_size=64),
)
def test_arbitrary_input_is_either_decoded_or_rejected_cleanly(fields, text, body):
    for headers in ({codec.HEADER: json.dumps(fields)}, {codec.HEADER: text}, dict.fromkeys(fields, text)):
        _decoded_or_refused(headers, body)
        assert isinstance(codec.session_of(headers), str)


def _decoded_or_refused(headers, body):
    try:
        h, arr = codec.decode(headers, body)
    except MalformedMessage:
        return
    assert arr.shape == tuple(h.shape)
    assert arr.dtype == (np.int32 if h.dtype == "i32" else np.float32)
