"""Activation headers as a tamperer on the wire would change them: fields of the codec's JSON header."""

from __future__ import annotations

import json

from neuron_bus import codec


def fields(headers: dict[str, str]) -> dict:
    """The activation header's fields, as carried."""
    return json.loads(headers[codec.HEADER])


def edit(headers: dict[str, str], **changes) -> dict[str, str]:
    """A copy of ``headers`` whose activation header has ``changes`` (a value None drops the field);
    any MAC is kept as it was."""
    raw = fields(headers)
    for name, value in changes.items():
        if value is None:
            raw.pop(name, None)
        else:
            raw[name] = value
    return {**headers, codec.HEADER: json.dumps(raw, separators=(",", ":"))}
