"""Prometheus metrics of one worker (own registry, so several workers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from workers.errors import Reason

# bounds of the backend call histogram: they include the runner's inline limits (0.5 ms for any decode
# call, 20 ms for a hop's only session), so an operator sees how many calls were quick enough
CALL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class WorkerMetrics:
    def __init__(self, node_id: str):
        self.registry = CollectorRegistry()
        self.seam_bytes = Counter(
            "neuron_seam_bytes_total",
            "Activation body bytes crossing this node's seams",
            ["phase", "direction"],
            registry=self.registry,
        )
        self.seam_messages = Counter(
            "neuron_seam_messages_total",
            "Activation messages crossing this node's seams",
            ["phase", "direction"],
            registry=self.registry,
        )
        self.sessions_active = Gauge(
            "neuron_sessions_active", "Open route sessions on this node", registry=self.registry
        )
        self.stuck = Gauge(
            "neuron_node_stuck",
            "1 while a backend call runs far past its time (heartbeat status stuck), else 0",
            registry=self.registry,
        )
        self.cache_bytes = Gauge("neuron_cache_bytes", "KV cache bytes held for open sessions", registry=self.registry)
        self.kv_positions = Gauge(
            "neuron_kv_positions",
            "KV pool positions: reserved for sessions (streams and buffers of its lanes), and its budget",
            ["kind"],
            registry=self.registry,
        )
        self.prefill_reused = Counter(
            "neuron_prefill_tokens_reused_total",
            "Prompt positions attached from the prefix cache instead of computed",
            registry=self.registry,
        )
        self.prefix_lookups = Counter(
            "neuron_prefix_cache_total",
            "Prefix cache events: attached, missing (a prefix the head chose is not here), unattachable (held, but "
            "its state does not fit the session's lane), kept, keep_failed",
            ["event"],
            registry=self.registry,
        )
        self.prefix_cache_bytes = Gauge(
            "neuron_prefix_cache_bytes", "KV state bytes the prefix cache holds", registry=self.registry
        )
        self.rejected = Counter(
            "neuron_rejected_messages_total",
            "Messages rejected before any model work",
            ["reason"],
            registry=self.registry,
        )
        self.redelivered = Counter(
            "neuron_redelivered_copies_total",
            "Inputs the server delivered again after its ack wait whose first copy this node had taken: terminated, "
            "neither a rejection nor anything to tell the client",
            registry=self.registry,
        )
        self.backend_calls = Histogram(
            "neuron_backend_call_seconds",
            "Backend forward calls by how long each took, the call alone (_count: calls; _sum: the seconds the "
            "backend spent computing, its utilization)",
            ["phase"],
            buckets=CALL_BUCKETS,
            registry=self.registry,
        )
        self.snapshots_written = Counter(
            "neuron_snapshots_written_total", "KV snapshots written", registry=self.registry
        )
        self.snapshot_failures = Counter(
            "neuron_snapshot_failures_total",
            "KV snapshot writes that failed or were skipped (decode went on)",
            ["reason"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "neuron_tokens_total", "Positions computed by this node", ["phase"], registry=self.registry
        )
        self.inline_calls = Counter(
            "neuron_backend_inline_calls_total",
            "Backend calls quick enough to run on the event loop",
            ["phase"],
            registry=self.registry,
        )
        self.step_seconds = Counter(
            "neuron_step_seconds_total",
            "Seconds of the processing loop per wave (decode) or batch (prefill), by stage: wait (its oldest"
            " message's arrival to the loop taking it), admit, compute (the backend call with its hand-off to and"
            " from the backend thread; the call alone is neuron_backend_call_seconds_sum), advance, send (outputs"
            " started)",
            ["phase", "stage"],
            registry=self.registry,
        )

        self.rejected_by_reason: dict[str, int] = {}  # the same counts, for `neuron-bus sessions`
        self.redelivered_copies = 0  # the same count as the redelivered counter, for `neuron-bus sessions`
        self._children: dict[tuple, object] = {}

    def child(self, metric, *labels: str):
        """``metric.labels(*labels)``, looked up once (the hot path counts every message)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def reject(self, reason: Reason) -> None:
        self.rejected.labels(reason).inc()
        self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1

    def redelivered_copy(self) -> None:
        self.redelivered.inc()
        self.redelivered_copies += 1

    def seam(self, phase: str, direction: str, nbytes: int) -> None:
        self.child(self.seam_bytes, phase, direction).inc(nbytes)
        self.child(self.seam_messages, phase, direction).inc()

    def step(self, phase: str, stage: str, seconds: float) -> None:
        """A stage of the processing loop took ``seconds`` for one wave or batch."""
        self.child(self.step_seconds, phase, stage).inc(seconds)

    def computed(self, phase: str, positions: int, busy: float, inline: bool) -> None:
        """A backend call of ``positions`` positions took ``busy`` seconds (``inline``: on the event loop)."""
        if inline:
            self.child(self.inline_calls, phase).inc()
        self.child(self.backend_calls, phase).observe(busy)
        self.child(self.tokens, phase).inc(positions)

    def value(self, name: str, **labels: str) -> float:
        v = self.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
