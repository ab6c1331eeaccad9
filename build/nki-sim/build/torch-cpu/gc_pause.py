"""Pausing Python's full garbage collections while a simulation or a schedule builds its records.

A simulated run keeps about ten objects per instruction alive until it returns (its trace), and the
cost model's scheduler as many per instruction it places. CPython starts a full collection, which
traverses every live object of the process, each time the survivors of the younger generations grow
by a quarter, so on a long run the collector traverses the growing trace again and again. Measured
on this project's bench cases: a quarter to a third of a trace-only simulation's time and about
half of the scheduler's went there (``moe-fwd/qwen3-30b-a3b/2048-tokens-top8``, 114,703
instructions: 7.0 s and 1.4 s of CPU, against 4.7 s and 0.87 s with full collections paused).

The young generations keep collecting, so short-lived reference cycles are freed as before; only
the oldest generation's collections are put off until the outermost paused block ends. A caller that
drops what it made before its block ends can turn the collector off altogether
(:func:`collections_paused`).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

# Full collections while paused: one per this many young-generation (gen 1) collections, i.e. about
# one per 7 million allocations with CPython's default thresholds (700, 10, 10).
PAUSED_FULL_COLLECTION_INTERVAL = 1000

_lock = threading.Lock()
_depth = 0
_saved_threshold: tuple[int, ...] = gc.get_threshold()


@contextlib.contextmanager
def full_collections_paused() -> Iterator[None]:
    """Run the block with the oldest generation's collections put off (see the module docstring).

    Blocks nest and may run in several threads: the first to enter saves the collector's thresholds
    and the last to leave restores them."""
    global _depth, _saved_threshold
    with _lock:
        if _depth == 0:
            _saved_threshold = gc.get_threshold()
            young, middle = _saved_threshold[:2]
            gc.set_threshold(young, middle, max(_saved_threshold[2], PAUSED_FULL_COLLECTION_INTERVAL))
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.set_threshold(*_saved_threshold)


_off_depth = 0
_was_enabled = True


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """Run the block with the collector off altogether, young generations included: for a caller that
    drops what the block made before the block ends, as the bench drops a case's traces once it has
    modelled them. The collector then never traverses those objects; the young generations'
    collections during a paused run took about 6% more (``moe-fwd/mixtral-8x7b/2048-tokens-top2``:
    0.39 s of the simulation, 0.16 s of the scheduling). (Objects the block leaves alive all go to
    the first collection after it, at once: for a launch whose trace its caller keeps, that costs
    about what the young collections would have, so launches themselves pause only full collections.)

    Blocks nest and may run in several threads: the first to enter turns the collector off and the last
    to leave turns it back on, if it was on."""
    global _off_depth, _was_enabled
    with _lock:
        if _off_depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _off_depth += 1
    try:
        yield
    finally:
        with _lock:
            _off_depth -= 1
            if _off_depth == 0 and _was_enabled:
                gc.enable()
