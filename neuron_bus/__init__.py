"""neuron-bus: GGUF models split into layer ranges across machines, wired by NATS JetStream."""

__version__ = "0.1.0"
