"""The worker: serves one backend's layer range on every route assigned to it.

An engine with no I/O, and a thin shell around it that does all of it (as vLLM splits its engine
core from the process around it):
- engine.py         admission (decode + check against the session table), compute, outcomes
- session_table.py  what a hop knows of each session, and the state-key check
- tail.py           the tail's decoder: sampling, stop strings, text, the generation's telemetry
- drafting.py       drafts for speculative ring steps, and how many are worth sending
- waves.py          which queued decode steps (and prompt chunks) run together as one backend call
- service.py        the shell: lifecycle, the consumers' queues, the processing loop, reaping
- consumers.py      the JetStream consumers bound per route
- holds.py          the inputs delivered and not yet settled, kept alive at the server while held
- runner.py         where backend calls run (its thread, or inline) and what they cost
- outbox.py         publishing outcomes, acknowledging inputs, rejections, fatal failures
- deliveries.py     each session's output delivery in flight (a route's last close waits for them)
- lifecycle.py      open / resume / close a session (backend cache work, consumers, ledger)
- control.py        the control requests, one handler each, concurrently (in order per session)
- mover.py          a self-placed worker changing its range when the tracker asks (drain, load, announce)
- source.py         what a worker serves and where the bytes come from (a file, the shard swarm, placement)
- heartbeat.py      the heartbeat and its measured telemetry (node_telemetry.py: disk, failures, pings)
- snapshots.py      KV snapshots for route repair; audit_trail.py: ledger entries, validation events
- metrics.py        Prometheus metrics
"""
