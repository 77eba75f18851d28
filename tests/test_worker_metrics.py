"""A worker's metrics: the hot path's cached label children count into the labelled samples that
/metrics exposes (the bench, token_profile and the tests read those)."""

from __future__ import annotations

from neuron_bus.worker.metrics import WorkerMetrics


def test_cached_children_count_into_the_labelled_samples():
    m = WorkerMetrics("node-a")
    m.step("decode", "wait", 0.5)
    m.step("decode", "wait", 0.25)
    m.step("prefill", "wait", 1.0)
    m.seam("decode", "in", 2304)
    m.seam("decode", "in", 2304)
    m.computed("decode", 4, 0.01, inline=True)
    m.computed("decode", 1, 0.02, inline=False)
    assert m.value("neuron_step_seconds_total", phase="decode", stage="wait") == 0.75
    assert m.value("neuron_step_seconds_total", phase="prefill", stage="wait") == 1.0
    assert m.value("neuron_seam_bytes_total", phase="decode", direction="in") == 4608
    assert m.value("neuron_seam_messages_total", phase="decode", direction="in") == 2
    assert m.value("neuron_backend_call_seconds_count", phase="decode") == 2
    assert m.value("neuron_backend_inline_calls_total", phase="decode") == 1
    assert m.value("neuron_tokens_total", phase="decode") == 5
    assert abs(m.value("neuron_backend_call_seconds_sum", phase="decode") - 0.03) < 1e-12
    assert m.value("neuron_backend_call_seconds_bucket", phase="decode", le="0.01") == 1  # a bound is "at most"
    assert m.value("neuron_backend_call_seconds_bucket", phase="decode", le="0.02") == 2
    assert m.child(m.tokens, "decode") is m.tokens.labels("decode")  # the same sample, not a copy
