"""neuron-bus: GGUF models split into layer ranges across machines, wired by NATS JetStream.

Subpackages, from the wire up:
- messages.py, subjects.py, codec.py, errors.py, timing.py: the wire contract (msgspec Structs,
  subjects, activation bodies and their state-key headers), typed errors, coupled timings
- artifacts/: GGUF models, where they may be cut, their layers' work, slices, manifests, the shard swarm
- execution.py: the one door to the backends in workers/ (which owns that interface)
- worker/: a node serving a layer range (an engine with no I/O, and the shell around it)
- tracker/: the node registry, route planning, the coverage map
- client.py, generation.py, repair.py, session_events.py: one generation, from route to last token
- gateway/: HTTP, WebSocket, the OpenAI-compatible API, the web page
- trust/: route policies, permissions, validation events, replay, fraud flags, the ledger
- cli/: the `neuron-bus` commands; local_swarm.py and supervisor.py: `neuron-bus up`
"""

__version__ = "0.1.0"
