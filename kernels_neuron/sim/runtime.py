"""State of one simulated kernel run: target, memory accounting, trace and engine registers."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from . import dtypes
from .errors import NoActiveKernel
from .memory import ON_CHIP, OnChipMemory, Placement, TileUsage
from .targets import Target
from .trace import Instruction, Operand, Trace

if TYPE_CHECKING:
    from .tensor import Tensor

# What last wrote each PSUM element: nc_matmul tells overwrite from accumulate by it, and warns when
# it accumulates on NeuronCore-v2/v3 onto a value another instruction wrote (undefined there, by the docs).
# Ordered, so that a tile's maximum code answers both questions at once.
PSUM_UNWRITTEN, PSUM_BY_MATMUL, PSUM_BY_OTHER = 0, 1, 2
HBM_KINDS = ("hbm", "shared_hbm", "private_hbm")


class Buffer:
    """One allocation: its storage, where it lives, and (for PSUM) which elements were written.

    A tile placed with an explicit address keeps its own storage, but its regions (for the trace and
    the hardware rules) are those of the physical memory, so tiles sharing an address alias there."""

    __slots__ = (
        "id",
        "kind",
        "dtype",
        "data",
        "address",
        "name",
        "on_chip",
        "partition_bytes",
        "written",
        "uniform_writer",
        "origin",
        "placement",
        "written_bytes",
        "usage",
        "__weakref__",
    )

    def __init__(self, buffer_id: int, kind: str, dtype: dtypes.DType, data: np.ndarray, name: str) -> None:
        self.id = buffer_id
        self.kind = kind
        self.dtype = dtype
        self.data = data
        # Where the storage starts: trace-only runs track which memory holds uncomputed values by it.
        self.address: int = data.__array_interface__["data"][0]
        self.name = name
        self.on_chip = on_chip = kind in ON_CHIP
        self.partition_bytes = (data.nbytes // data.shape[0]) if on_chip and data.ndim else data.nbytes
        # PSUM remembers which instruction kind last wrote each element (PSUM_UNWRITTEN ...).
        self.written = np.zeros(data.shape, dtype=np.uint8) if kind == "psum" else None
        # The code every element of ``written`` holds, or None once they may differ: a matmul into a whole
        # tile (the usual accumulation loop) then reads it instead of reducing the codes of its view.
        self.uniform_writer: int | None = PSUM_UNWRITTEN if kind == "psum" else None
        # Set by nl.matmul so that ``psum_tile += nl.matmul(...)`` can accumulate in place.
        self.origin: tuple | None = None
        self.placement: Placement | None = None
        # For a placed tile: which of its bytes it has written (see memory.OnChipMemory).
        self.written_bytes: np.ndarray | None = None
        self.usage: TileUsage | None = None  # an on-chip tile's span of instructions (memory.py)


class Run:
    """A kernel run in progress. Instructions and allocations report here."""

    def __init__(
        self,
        target: Target,
        *,
        capacity: str = "error",
        program_id: tuple[int, ...] = (0,),
        grid: tuple[int, ...] = (1,),
        trace: Trace | None = None,
        shared: dict[int, Buffer] | None = None,
        seed: int = 0,
        explicit_grid: bool = False,
        numerics: bool = True,
        uncomputed: set[int] | None = None,
        rank: int = 0,
        ranks: int = 1,
    ) -> None:
        if capacity not in ("error", "warn"):
            raise ValueError(f"capacity must be 'error' or 'warn', got {capacity!r}")
        self.target = target
        self.capacity = capacity
        self.program_id = program_id
        self.grid = grid
        self.explicit_grid = explicit_grid  # launched as kernel[grid] (so nl.program_ndim counts it)
        # Which rank of a multi-rank launch (sim.run_ranks) this program belongs to, and how many ranks
        # the launch has: nki.collectives exchanges data between them.
        self.rank = rank
        self.ranks = ranks
        self.trace = trace if trace is not None else Trace(target.name)
        # Buffer ids, shared with the memory model; a counter's own method, so that the memory model holds
        # no reference back to the run (a cycle would keep each finished run's trace alive until a full
        # garbage collection).
        self._new_id = itertools.count(1).__next__
        self.memory = OnChipMemory(target, self.trace, capacity, self._new_id)
        self._shared = shared if shared is not None else {}
        self._shared_seq = 0
        self.seed = seed
        # False: a trace-only run. Instructions check their operands and record the trace as
        # always, but skip their arithmetic; what they would have written is "uncomputed".
        self.numerics = numerics
        # The storage addresses (Buffer.address) of buffers some instruction wrote without
        # computing the values (numerics=False), shared by the launch's programs.
        self.uncomputed = uncomputed if uncomputed is not None else set()
        self.rng = np.random.default_rng(seed)
        # Per-lane generator state of nisa.rand_set_state / rand_get_state, by engine (see prng.py).
        self.prng_states: dict[str, np.ndarray] = {}
        self.prng_seeded: set[str] = set()
        # The launch's program scheduler (cores.Programs) when it runs several programs, for the
        # cross-core instructions; None for a single program.
        self.cores: Any = None
        # ScalarE reduce registers and VectorE accumulators: one fp32 value per partition lane.
        self.scalar_accumulator = np.zeros(target.partitions, dtype=np.float32)
        self.vector_accumulator = np.zeros(target.partitions, dtype=np.float32)

    # -- allocation -------------------------------------------------------------------------
    def allocate(
        self,
        shape: tuple[int, ...],
        dtype: dtypes.DType,
        kind: str,
        name: str = "",
        fill: Any = None,
        address: tuple[int, int] | None = None,
    ) -> Buffer:
        """A new buffer; ``address`` (partition, byte) places an on-chip tile in physical memory."""
        storage = dtypes.storage(dtype)
        if kind == "shared_hbm" and self.grid != (1,):
            # All SPMD programs see one shared_hbm tensor per allocation site (in program order).
            seq = self._shared_seq
            self._shared_seq += 1
            existing = self._shared.get(seq)
            if existing is not None and existing.data.shape == shape and existing.dtype == dtype:
                return existing
        if fill is None and not self.numerics:
            # A trace-only run computes no values, so fresh memory needs no "uninitialized" pattern:
            # zeroed pages are mapped on first touch, and most never are (4-8% of such a run's time).
            data = np.zeros(shape, dtype=storage)
        else:
            data = np.full(shape, dtypes.uninitialized_fill(dtype) if fill is None else fill, dtype=storage)
        buf = Buffer(self._new_id(), kind, dtype, data, name)
        self.uncomputed.discard(buf.address)  # fresh memory, perhaps where a freed uncomputed buffer was
        if kind == "shared_hbm" and self.grid != (1,):
            self._shared[seq] = buf
        if buf.on_chip:
            self.memory.allocate(buf, address, f"{name or kind + ' tensor'} {shape}")
        return buf

    def wrap_hbm(self, array: np.ndarray, name: str) -> Buffer:
        """An HBM buffer backed by the caller's own memory, so in-place writes reach them."""
        return Buffer(self._new_id(), "shared_hbm", dtypes.canonical(array.dtype), array, name)

    # -- trace-only runs ----------------------------------------------------------------------
    def computed(self, buf: Buffer) -> bool:
        """Whether ``buf`` holds the values a full simulation would (always, unless numerics=False)."""
        return buf.address not in self.uncomputed

    def mark_uncomputed(self, buf: Buffer) -> None:
        """Some instruction wrote ``buf`` without computing the values (a trace-only run)."""
        self.uncomputed.add(buf.address)

    # -- tracing ----------------------------------------------------------------------------
    def record(
        self,
        engine: str,
        op: str,
        *,
        reads: Iterable[tuple[str, Tensor]] = (),
        writes: Iterable[tuple[str, Tensor]] = (),
        bytes_moved: int = 0,
        flops: int = 0,
        **attrs: Any,
    ) -> Instruction:
        reads = [(role, t) for role, t in reads if t is not None]
        writes = [(role, t) for role, t in writes if t is not None]
        streamed = writes + reads
        partitions = free = 0
        new_operand = tuple.__new__  # Operand(...) without its keyword-handling constructor: hot path
        name = dtypes.name
        operands = []
        indirect = False
        for role, t in streamed:
            view = t._view
            size = view.size
            if size > partitions * free:  # the widest operand the engine streams
                partitions = t.partition_size
                free = size // max(partitions, 1)
            operands.append(new_operand(Operand, (role, view.shape, name(t._dtype), t._buf.kind)))
            indirect = indirect or t._columns is not None or t._indirect is not None
        if indirect:
            # The offsets of an .indirect() view, and the vector_offset rows of a DMA gather or scatter, are
            # inputs of the instruction that uses them.
            indexes = [(f"{role}_index", t._columns.index) for role, t in streamed if t._columns is not None]
            indexes += [(f"{role}_vector_offset", t._indirect.index) for role, t in streamed if t._indirect is not None]
            reads += indexes
            operands += [
                new_operand(Operand, (role, t._view.shape, name(t._dtype), t._buf.kind)) for role, t in indexes
            ]
        if not self.numerics:
            uncomputed = self.uncomputed
            for _, t in reads:
                if t._buf.address in uncomputed:
                    # Whatever an instruction computes from an uncomputed operand is uncomputed too
                    # (the instructions that still run their arithmetic in a trace-only run rely on this).
                    for _, written in writes:
                        self.mark_uncomputed(written._buf)
                    break
        self.memory.touch(op, reads, writes, len(self.trace.instructions))
        hbm_read = hbm_written = 0
        read_regions = []
        for _, t in reads:
            if t._buf.kind in HBM_KINDS:
                hbm_read += t.nbytes
            read_regions.append(t._region or t.region())  # mostly cached by the operand checks
        write_regions = []
        for _, t in writes:
            if t._buf.kind in HBM_KINDS:
                hbm_written += t.nbytes
            write_regions.append(t._region or t.region())
        inst = Instruction(
            len(self.trace.instructions),
            engine,
            op,
            tuple(operands),
            tuple(read_regions),
            tuple(write_regions),
            partitions,
            free,
            bytes_moved,
            hbm_read,
            hbm_written,
            flops,
            self.program_id,
            self.rank,
            attrs,
        )
        self.trace.instructions.append(inst)
        return inst


_state = threading.local()


def current() -> Run:
    run = getattr(_state, "run", None)
    if run is None:
        raise NoActiveKernel(
            "NKI calls only work inside a running kernel: decorate the function with @nki.jit and call it"
        )
    return run


def active() -> Run | None:
    return getattr(_state, "run", None)


class activate:
    """Make ``run`` the current kernel run for the duration of a ``with`` block."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def __enter__(self) -> Run:
        self.previous = getattr(_state, "run", None)
        _state.run = self.run
        return self.run

    def __exit__(self, *exc: object) -> None:
        _state.run = self.previous
