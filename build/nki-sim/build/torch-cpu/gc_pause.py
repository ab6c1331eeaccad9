"""Pausing Python's cyclic garbage collector while a simulation or a schedule builds its records.

A simulated run keeps about ten objects per instruction alive until it returns (its trace), and the
cost model's scheduler as many per instruction it places. CPython's collector runs whenever
allocations outnumber deallocations by a threshold, and each run traverses the objects of the
generations it collects, so on a long run it traverses the growing trace again and again, although
the simulator leaves no reference cycle behind (``tests/sim/test_gc_pause.py``) and everything it
allocates is freed by reference counting. Measured on this project's bench cases: full collections
took a quarter to a third of a trace-only simulation's time and about half of the scheduler's
(``moe-fwd/qwen3-30b-a3b/2048-tokens-top8``: 7.0 s and 1.4 s of CPU with them, 4.7 s and 0.87 s with
them put off); the young generations' collections, which were left running, still took about 6%
(``moe-fwd/mixtral-8x7b/2048-tokens-top2``: 0.39 s of the simulation and 0.16 s of the scheduling).

So the collector is off while a launch or a schedule runs. A reference cycle a kernel itself makes
is freed by the first collection after the outermost paused block ends, as it would have been by a
later one. (A caller that models a trace right after simulating it, as the bench does, holds one
pause over both, so that the collector never traverses the trace.)
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = True


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """Run the block with the garbage collector off (see the module docstring).

    Blocks nest and may run in several threads: the first to enter turns the collector off and the
    last to leave turns it back on, if it was on."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
