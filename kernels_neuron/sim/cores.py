"""Several NeuronCores in one launch: ``nisa.sendrecv`` and ``nisa.core_barrier``.

With LNC=2 a kernel launched on a grid of 2 runs one program per physical core, and the two exchange
tiles (``sendrecv``) and wait for each other (``core_barrier``). The simulator runs a launch's programs
one at a time, in order, each in its own thread: a program that must wait for another hands over to the
next program that can run, and takes its turn back once what it waits for has happened. Without those
instructions the programs simply run one after another, as before. A wait nothing can satisfy is
reported as a deadlock naming the instruction.

A program's rank is its index along grid axis 0 (0 or 1); programs that differ in other grid axes,
or belong to different ranks of a multi-rank launch (``sim.run_ranks``), belong to different core pairs.
The same scheduler runs every program of every rank of such a launch, so ``nki.collectives`` calls
(collectives.py) wait for each other the same way.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import dtypes, operands, runtime
from .enums import dma_engine as _DmaEngine
from .enums import engine as _Engine
from .errors import NkiValidationError, require_generation, rule
from .tensor import Tensor

LNC_RANKS = (0, 1)
# GpSimd's internal DMA (dma_engine.gpsimd_dma) moves at most this many bytes per partition.
GPSIMD_DMA_MAX_BYTES = {4: 1024, 2: 512, 1: 256}


_DEADLOCK_HINT = (
    "a sendrecv needs its peer's matching sendrecv with the same pipe_id; a core_barrier needs every core; "
    "a collective needs the matching call of every rank of its replica group"
)


class _Aborted(BaseException):
    """Ends a waiting program's thread after another program failed."""


class Programs:
    """Runs a launch's programs one at a time, in program order, handing over at cross-core waits."""

    def __init__(self, bodies: Sequence[Callable[[], None]], labels: Sequence[str] | None = None) -> None:
        """``labels`` name the programs in a deadlock report (default: their indices)."""
        self._bodies = list(bodies)
        self._labels = list(labels) if labels is not None else None
        self._cond = threading.Condition()
        self._started = [False] * len(bodies)
        self._done = [False] * len(bodies)
        self._waiting: dict[int, tuple[Callable[[], bool], str | Callable[[], str]]] = {}
        self._turn: int | None = None
        self._error: BaseException | None = None
        self.mailboxes: defaultdict[tuple, deque] = defaultdict(deque)
        self.barrier_arrivals: defaultdict[tuple, int] = defaultdict(int)
        # What nki.collectives calls have posted and how far each program is (collectives.py).
        self.collectives: dict[tuple, Any] = {}

    def run(self) -> None:
        with self._cond:
            self._hand_over()
            while not all(self._done) and self._error is None:
                self._cond.wait()
        if self._error is not None:
            raise self._error

    def wait(self, ready: Callable[[], bool], what: str | Callable[[], str]) -> None:
        """Called by the running program: block until ``ready()``, letting the others run meanwhile.
        ``what`` names the wait in a deadlock report (a callable is asked only then)."""
        me = self._turn
        assert me is not None
        with self._cond:
            if ready():
                return
            self._waiting[me] = (ready, what)
            self._hand_over()
            while self._turn != me:
                if self._error is not None:
                    raise _Aborted
                self._cond.wait()
            del self._waiting[me]

    def _hand_over(self) -> None:
        """Give the turn to the first program that can run (the lock is held)."""
        for i in range(len(self._bodies)):
            if self._done[i]:
                continue
            waiting = self._waiting.get(i)
            if waiting is not None and not waiting[0]():
                continue
            self._turn = i
            if not self._started[i]:
                self._started[i] = True
                threading.Thread(target=self._program, args=(i,), daemon=True).start()
            self._cond.notify_all()
            return
        self._turn = None
        if not all(self._done):
            self._error = NkiValidationError(
                f"deadlock: {self._stuck()} and no program can continue ({_DEADLOCK_HINT})"
            )
        self._cond.notify_all()

    def _stuck(self) -> str:
        """Who waits where (the lock is held)."""
        described = {i: what if isinstance(what, str) else what() for i, (_, what) in self._waiting.items()}
        if self._labels is None:
            return f"programs {sorted(described)} wait at {', '.join(sorted(set(described.values())))}"
        return "; ".join(f"{self._labels[i]} waits at {described[i]}" for i in sorted(described))

    def _program(self, i: int) -> None:
        with self._cond:
            while self._turn != i and self._error is None:
                self._cond.wait()
            if self._error is not None:
                return
        try:
            self._bodies[i]()
        except _Aborted:
            return
        except BaseException as exc:  # re-raised by run() in the launching thread
            with self._cond:
                if self._error is None:
                    self._error = exc
                self._cond.notify_all()
            return
        with self._cond:
            self._done[i] = True
            self._hand_over()


def _lnc_pair(instr: str, run: runtime.Run) -> tuple[int, tuple[int, ...], Programs]:
    """This program's rank, its core pair's key and the launch's scheduler."""
    require_generation(instr, "target", run.target, 3)
    programs = run.cores
    if programs is None or run.grid[0] != len(LNC_RANKS):
        raise rule(
            instr,
            "launch",
            "needs an LNC=2 launch: a grid of 2 programs along axis 0 (kernel[2](...)), one per core",
            grid=list(run.grid),
        )
    return run.program_id[0], (run.rank, *run.program_id[1:]), programs


def _rank(instr: str, role: str, value: Any) -> int:
    rank = int(value)
    if rank not in LNC_RANKS:
        raise rule(instr, role, "must be 0 or 1 (the two cores of an LNC=2 pair)", value=rank)
    return rank


def sendrecv(
    src: Tensor,
    dst: Tensor,
    send_to_rank: Any,
    recv_from_rank: Any,
    pipe_id: Any,
    dma_engine: _DmaEngine = _DmaEngine.dma,
    name: str | None = None,
) -> None:
    """Send ``src`` to core ``send_to_rank``'s ``dst`` while receiving core ``recv_from_rank``'s ``src``
    into this core's ``dst``; sendrecvs with the same ``pipe_id`` pair up in order."""
    instr = "nisa.sendrecv"
    run = runtime.current()
    rank, pair, programs = _lnc_pair(instr, run)
    send_to, recv_from = _rank(instr, "send_to_rank", send_to_rank), _rank(instr, "recv_from_rank", recv_from_rank)
    src, dst = operands.tile(src, instr, "src"), operands.tile(dst, instr, "dst")
    for role, t in (("src", src), ("dst", dst)):
        operands.where(t, instr, role, ("sbuf",))
    if src.dtype != dst.dtype:
        raise rule(instr, "dst", "must have src's dtype", dst=dtypes.name(dst.dtype), src=dtypes.name(src.dtype))
    if src.shape != dst.shape:
        raise rule(instr, "dst", "must have src's shape", dst=list(dst.shape), src=list(src.shape))
    mode = _DmaEngine(dma_engine)
    per_partition = src.free_size * dtypes.itemsize(src.dtype)
    if mode == _DmaEngine.gpsimd_dma:
        limit = GPSIMD_DMA_MAX_BYTES.get(dtypes.itemsize(src.dtype), 0)
        if per_partition > limit:
            raise rule(
                instr,
                "src",
                "gpsimd_dma moves at most 1 KiB / 512 B / 256 B per partition for 4- / 2- / 1-byte dtypes",
                bytes_per_partition=per_partition,
                limit=limit,
            )
    key = pair + (str(pipe_id),)
    # The values travel with whether they were computed (a trace-only run computes no arithmetic).
    programs.mailboxes[key + (rank, send_to)].append((np.array(src.read(), copy=True), run.computed(src._buf)))
    inbox = programs.mailboxes[key + (recv_from, rank)]
    programs.wait(lambda: bool(inbox), f"{instr}(pipe_id={pipe_id})")
    values, computed = inbox.popleft()
    if computed:
        dst.write(values, instr)
    else:
        dst.write_uncomputed(instr)
    run.record(
        "gpsimd" if mode == _DmaEngine.gpsimd_dma else "dma",
        "sendrecv",
        reads=[("src", src)],
        writes=[("dst", dst)],
        bytes_moved=src.nbytes,
        partitions=src.partition_size,
        bytes_per_partition=per_partition,
        contiguous_bytes=per_partition,
    )


def core_barrier(data: Tensor, cores: Sequence[int], engine: _Engine = _Engine.gpsimd, name: str | None = None) -> None:
    """Wait until every core in ``cores`` has reached its matching barrier on ``data``.

    AWS's reference supports ``cores=(0, 1)``; nki-library also passes ``(0,)`` when a kernel runs on
    one core, a barrier with only itself, which passes at once.
    """
    instr = "nisa.core_barrier"
    run = runtime.current()
    group = tuple(int(c) for c in cores)
    if group not in (LNC_RANKS, (0,)):
        raise rule(instr, "cores", "only (0, 1) is supported (or (0,) on a single core)", cores=tuple(cores))
    data = operands.tile(data, instr, "data")
    if data.buffer != "shared_hbm":
        raise rule(instr, "data", "must be a shared HBM tensor (nl.shared_hbm)", buffer=str(data.buffer))
    eng = operands.engine_for(engine, instr, ("gpsimd", "vector", "scalar"), "gpsimd")
    if group == (0,):
        require_generation(instr, "target", run.target, 3)
        if run.program_id[0] != 0:
            raise rule(instr, "cores", "a one-core barrier (0,) runs on core 0 only", rank=run.program_id[0])
    else:
        rank, pair, programs = _lnc_pair(instr, run)
        arrivals = programs.barrier_arrivals
        arrivals[pair + (rank,)] += 1
        mine = arrivals[pair + (rank,)]
        programs.wait(lambda: all(arrivals[pair + (core,)] >= mine for core in LNC_RANKS), instr)
    run.record(eng, "core_barrier", reads=[("data", data)])
