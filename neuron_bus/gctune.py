"""Keeping Python's full garbage collections off a busy event loop.

A full collection walks every live object: in a process holding thousands of nodes' state (the
tracker's table, the simulator's pool) it stops the event loop for 100-200 ms whenever survivors
pile up, every few seconds under heartbeats. `freeze_old_objects` leaves the young generations as
they are, freezes what is alive now out of full collections and raises the oldest generation's
threshold so that full collections run only when the process asks (`gc.collect()`).

A process that forks children to read its state (the tracker's map builds, tracker/forked.py)
freezes what is alive just before each fork (`freeze_before_fork`): a collection writes into the
header of every object it examines, and each page it writes while a child lives is copied first.
At 10,000 nodes the young collections in the 0.3 s after a fork took 20-100 ms instead of 5-10.
Such a process collects everything it froze now and then with `collect_frozen_too`.
"""

from __future__ import annotations

import gc


def freeze_old_objects() -> None:
    gen0, gen1, _ = gc.get_threshold()
    gc.set_threshold(gen0, gen1, 1_000_000)  # the oldest generation: collected when asked
    gc.freeze()


def freeze_before_fork() -> None:
    """What is alive now leaves the collector's generations: the collections that run while a
    forked child shares these pages examine only what is allocated after the fork."""
    gc.freeze()


def collect_frozen_too() -> None:
    """A full collection of everything, frozen objects included (cycles among them are garbage
    like any other), then freeze the survivors again."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
