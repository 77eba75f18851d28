"""schemas/ is generated from the msgspec Structs and must be kept in sync."""

from __future__ import annotations

import json

import msgspec

from neuron_bus import messages, schemagen


def test_schemas_dir_is_in_sync_with_structs():
    assert schemagen.stale() == [], "run: .venv/bin/python -m neuron_bus.schemagen"


def test_every_struct_has_a_schema_file():
    names = {p.name for p in schemagen.SCHEMA_DIR.glob("*.json")}
    assert names == {f"{k.__name__}.json" for k in messages.ALL_MESSAGES}


def test_stale_detection_notices_a_changed_struct(tmp_path):
    schemagen.write(tmp_path)
    assert schemagen.stale(tmp_path) == []
    victim = tmp_path / "TokenDelta.json"
    doc = json.loads(victim.read_text())
    doc["$defs"]["TokenDelta"]["properties"].pop("text")
    victim.write_text(json.dumps(doc))
    (tmp_path / "Gone.json").write_text("{}")
    assert sorted(schemagen.stale(tmp_path)) == ["Gone.json", "TokenDelta.json"]


def test_messages_round_trip_through_json():
    t = messages.GenerationTelemetry(
        session_id="s", route_id="r", model_preset="m", phase="prefill", prefill_tokens_done=3
    )
    assert messages.decode(messages.encode(t), messages.GenerationTelemetry) == t
    assert isinstance(msgspec.json.decode(messages.encode(t)), dict)  # plain JSON for any client
