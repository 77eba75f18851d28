"""Keeping Python's full garbage collections off a busy event loop.

A full collection walks every live object: in a process holding thousands of nodes' state (the
tracker's table, the simulator's pool) it stops the event loop for 100-200 ms whenever survivors
pile up, every few seconds under heartbeats. `freeze_old_objects` leaves the young generations as
they are, freezes what is alive now out of full collections and raises the oldest generation's
threshold so that full collections run only when the process asks (`gc.collect()`).
"""

from __future__ import annotations

import gc


def freeze_old_objects() -> None:
    gen0, gen1, _ = gc.get_threshold()
    gc.set_threshold(gen0, gen1, 1_000_000)  # the oldest generation: collected when asked
    gc.freeze()
