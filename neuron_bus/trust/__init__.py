"""Trust: route policies, bus permissions, validation events and replay, fraud flags, rewards.

The reward unit, owned layer work, is counted from the GGUF in neuron_bus/artifacts/work.py.

Modules, one role each:
- permissions.py  NATS users per role with subject allow lists, rendered as a server config block
- fault.py        deliberate faults for tests (``neuron-bus worker --fault perturb``)
- replay.py       re-run a validation event on a reference and compare tokens and logits
- attribution.py  which node a disagreeing replay is pinned on, and when a node is flagged
- auditor.py      the auditor service: sampled replay requests -> verdicts -> KV ``neuron-flags``
- sampler.py      the tracker side: sample sessions for replay, follow the flags
- ledger.py       reading and summing the reward ledger
- events.py       reading validation events from the bus
"""
