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
from collections.abc import Callable, Iterator
from typing import Any

# Full collections while paused: one per this many young-generation (gen 1) collections, i.e. about
# one per 7 million allocations with CPython's default thresholds (700, 10, 10).
PAUSED_FULL_COLLECTION_INTERVAL = 1000


class _SharedSetting:
    """A process-wide collector setting that nested blocks, in any threads, share: the first block to
    enter applies it (``apply`` returns what ``restore`` takes back) and the last to leave restores it."""

    def __init__(self, apply: Callable[[], Any], restore: Callable[[Any], None]) -> None:
        self._apply, self._restore = apply, restore
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: Any = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._saved = self._apply()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._restore(self._saved)


def _put_off_full_collections() -> tuple[int, ...]:
    saved = gc.get_threshold()
    gc.set_threshold(saved[0], saved[1], max(saved[2], PAUSED_FULL_COLLECTION_INTERVAL))
    return saved


def _turn_off() -> bool:
    was_enabled = gc.isenabled()
    gc.disable()
    return was_enabled


_FULL_COLLECTIONS_PUT_OFF = _SharedSetting(_put_off_full_collections, lambda saved: gc.set_threshold(*saved))
_COLLECTOR_OFF = _SharedSetting(_turn_off, lambda was_enabled: gc.enable() if was_enabled else None)


@contextlib.contextmanager
def full_collections_paused() -> Iterator[None]:
    """Run the block (or, as a decorator, the function) with the oldest generation's collections put off
    (see the module docstring); the young generations keep collecting. Blocks nest and may run in
    several threads: the first to enter puts them off and the last to leave restores the thresholds."""
    with _FULL_COLLECTIONS_PUT_OFF():
        yield


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """Run the block (or the function) with the collector off altogether, young generations included: for
    a caller that drops what the block made before the block ends, as the bench drops a case's traces once
    it has modelled them. The collector then never traverses those objects; the young generations'
    collections during a run took about 6% more (``moe-fwd/mixtral-8x7b/2048-tokens-top2``: 0.39 s of
    the simulation, 0.16 s of the scheduling). Objects the block leaves alive all go to the first
    collection after it, at once: for a launch whose trace its caller keeps, that costs about what the
    young collections would have, so launches themselves pause only full collections. Nests as
    :func:`full_collections_paused` does; a collector that was off stays off."""
    with _COLLECTOR_OFF():
        yield
