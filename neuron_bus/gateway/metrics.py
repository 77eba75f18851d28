"""The gateway's Prometheus metrics, in a registry of its own (served on ``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "neuron_gateway_requests", "HTTP and WebSocket requests by endpoint.", ["endpoint"], registry=self.registry
        )
        self.errors = Counter(
            "neuron_gateway_errors",
            "Requests answered with an error, by endpoint and status (or route failure reason).",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.active = Gauge("neuron_gateway_active_generations", "Generations running now.", registry=self.registry)
        self.tokens = Counter(
            "neuron_gateway_tokens",
            "Tokens: prompt (sent into routes) and completion (streamed back).",
            ["kind"],
            registry=self.registry,
        )

        # access (access.py): labelled by key id, never by key
        self.key_requests = Counter(
            "neuron_gateway_key_requests", "Requests admitted per API key id.", ["key_id"], registry=self.registry
        )
        self.rate_limited = Counter(
            "neuron_gateway_rate_limited", "Requests refused (429) per API key id.", ["key_id"], registry=self.registry
        )
        self.auth_failures = Counter(
            "neuron_gateway_auth_failures",
            "Requests refused (401): key missing or invalid.",
            ["reason"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
