"""NKI tensors: a view into one buffer, with NKI's indexing, reshaping and access patterns.

A tensor is a NumPy view (``_view``) of a :class:`~.runtime.Buffer`'s storage, so slicing,
stepping, reshaping and permuting never copy: writes through any view land in the buffer.
On-chip tensors (SBUF/PSUM) keep dimension 0 as the partition dimension, and every view is
checked to stay inside its buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from . import dtypes, frontend, runtime
from .errors import NkiValidationError, UncomputedValueError, rule
from .memory import region_of
from .runtime import PSUM_BY_OTHER, PSUM_UNWRITTEN, Buffer
from .trace import Region


@dataclass(frozen=True)
class DynSlice:
    """``nl.ds(start, size)``: ``size`` elements from ``start``, optionally every ``step``."""

    start: int
    size: int
    step: int = 1

    def as_slice(self) -> slice:
        # Stop just past the last element, so a stepped slice ending at the edge stays in bounds.
        return slice(self.start, self.start + (self.size - 1) * self.step + 1, self.step)


def innermost_run(shape: Sequence[int], strides: Sequence[int], unit: int) -> int:
    """The innermost contiguous run of an access pattern, in the strides' units (``unit`` per element):
    its trailing dims while each steps exactly over the ones inside it (size-1 dims skipped)."""
    run = unit
    for n, stride in zip(reversed(shape), reversed(strides)):
        if n == 1:
            continue
        if stride != run:
            break
        run *= n
    return run


@dataclass(frozen=True)
class Indirect:
    """An ``.ap(..., vector_offset=...)`` gather/scatter.

    Element ``(i0, i1, ...)`` of the pattern lives at ``start + sum(i_k * steps_k)`` of the
    allocation, except that along ``dim`` the coordinate ``i`` is replaced by ``index[i]``.
    """

    index: Tensor
    dim: int
    start: int
    steps: tuple[int, ...]
    nums: tuple[int, ...]

    def contiguous_elements(self) -> int:
        """Elements in the innermost contiguous run of the access (inside one indexed row: a run never
        continues across the indirect dim, whose rows land anywhere)."""
        return innermost_run(self.nums[self.dim + 1 :], self.steps[self.dim + 1 :], 1)

    def _rows(self, instruction: str) -> np.ndarray:
        """The indices of the indirect dim's rows, one per row of its extent."""
        # A [P, N] index tile is read column by column (indices.T.flatten()), as a gather-transpose
        # with N > 1 index columns consumes it; for the usual [P, 1] tile the order is the same.
        rows = np.asarray(self.index.computed_values(instruction, "vector_offset")).T.reshape(-1).astype(np.int64)
        if rows.size < self.nums[self.dim]:
            raise rule(
                instruction,
                "vector_offset",
                "fewer indices than the indirect dim's extent",
                indices=rows.size,
                extent=self.nums[self.dim],
            )
        return rows[: self.nums[self.dim]]

    def check_bounds(self, size: int, instruction: str, skip_oob: bool) -> None:
        """The checks of :meth:`flat_offsets` without forming every offset, for an access that moves no
        values (a trace-only run): an offset is a sum of one term per dim, so the extreme terms give
        the extreme offsets. Out of bounds, :meth:`flat_offsets` raises its error naming the indices."""
        rows = self._rows(instruction)
        if skip_oob or 0 in self.nums:
            return
        low = high = self.start
        for dim, (num, step) in enumerate(zip(self.nums, self.steps)):
            ends = (int((rows * step).min()), int((rows * step).max())) if dim == self.dim else (0, (num - 1) * step)
            low, high = low + min(ends), high + max(ends)
        if low < 0 or high >= size:
            self.flat_offsets(size, instruction, skip_oob)

    def flat_offsets(self, size: int, instruction: str, skip_oob: bool) -> tuple[np.ndarray, np.ndarray]:
        """Offsets into the flattened allocation and a mask of the in-bounds ones."""
        rows = self._rows(instruction)
        grids = list(np.meshgrid(*[np.arange(n) for n in self.nums], indexing="ij"))  # NumPy 2 returns a tuple
        grids[self.dim] = rows[grids[self.dim]]
        # Summed onto the first term (nums is never empty): an array, where sum()'s default 0 start would type as int.
        offsets = self.start + sum((g * s for g, s in zip(grids[1:], self.steps[1:])), grids[0] * self.steps[0])
        inside = (offsets >= 0) & (offsets < size)
        if not skip_oob and not inside.all():
            bad = rows[(~inside).any(axis=tuple(d for d in range(len(self.nums)) if d != self.dim))]
            raise rule(
                instruction,
                "vector_offset",
                "indirect index out of bounds (oob_mode=error)",
                indices=bad.tolist()[:8],
                allocation_elements=size,
            )
        return offsets, inside


@dataclass(frozen=True)
class Columns:
    """A tensor-indirection view, ``base.indirect(index, num_elem)`` (NeuronCore-v4): ``num_elem`` columns of
    ``base`` chosen at run time by the offsets in ``index``, gathered when an instruction reads the view and
    scattered when it writes it.

    Offsets count elements along ``base``'s free dims (row-major when it has several). Partitions form groups
    of ``group`` (16 on Vector/Scalar/GpSimd, 32 on TensorE, fixed by the instruction that takes the view):
    in the group starting at partition ``s``, column ``i`` is offset ``index[s + i % group, i // group]``
    (nki.language ``NkiTensor.indirect``; AWS's tensor-indirection tutorial kernel reads a group's rows).
    """

    base: Tensor
    index: Tensor
    num_elem: int
    instruction: str = ""  # the instruction and operand that bound the view, for error messages
    role: str = ""
    group: int = 0  # 0 until an instruction binds the view to its engine

    def offsets(self) -> np.ndarray:
        """The [partitions, num_elem] free-dim offsets, each checked against ``base``'s free size."""
        if not self.group:
            raise rule(
                "indirect",
                repr(self.base),
                "an .indirect() view is resolved by the instruction it is passed to; this one reads it directly",
            )
        parts, free = self.base.partition_size, self.base.free_size
        index = np.asarray(self.index.computed_values(self.instruction, f"{self.role} index"))
        index = index.reshape(self.index.partition_size, -1).astype(np.int64)
        column = np.arange(self.num_elem)
        rows = (np.arange(parts) // self.group * self.group)[:, None] + column % self.group
        offsets = index[rows, np.broadcast_to(column // self.group, rows.shape)]
        outside = (offsets < 0) | (offsets >= free)
        if outside.any():
            raise rule(
                self.instruction,
                f"{self.role} index",
                "tensor-indirection offset outside the data view's free dims",
                offsets=sorted(set(offsets[outside].tolist()))[:8],
                free_elements=free,
            )
        return offsets

    def index_known(self) -> bool:
        """Whether the offsets hold values the run computed (always, unless a trace-only run)."""
        run = runtime.active()
        return run is None or run.computed(self.index._buf)

    def gather(self) -> np.ndarray:
        """The [partitions, num_elem] values the view reads."""
        parts = self.base.partition_size
        if not self.index_known():  # a trace-only run: what the instruction computes from them is uncomputed too
            return np.full(
                (parts, self.num_elem), dtypes.uninitialized_fill(self.base.dtype), dtypes.storage(self.base.dtype)
            )
        values = np.asarray(self.base.read()).reshape(parts, -1)
        return values[np.arange(parts)[:, None], self.offsets()]

    def targets(self) -> tuple[np.ndarray, ...]:
        """NumPy indices of the base view's elements the offsets select, [partitions, num_elem] each."""
        offsets = self.offsets()
        rows = np.broadcast_to(np.arange(self.base.partition_size)[:, None], offsets.shape)
        return (rows,) + np.unravel_index(offsets, self.base.shape[1:])


class Tensor:
    """A tensor in HBM, SBUF or PSUM, as NKI kernels see it."""

    # Views never change after creation, so their offset, region and start partition are cached.
    __slots__ = ("_buf", "_view", "_dtype", "_indirect", "_columns", "_offset", "_region", "_start", "_written")

    def __init__(
        self,
        buf: Buffer,
        view: np.ndarray | None = None,
        dtype: dtypes.DType | None = None,
        indirect: Indirect | None = None,
        columns: Columns | None = None,
    ) -> None:
        self._buf = buf
        self._view = buf.data if view is None else view
        self._dtype = buf.dtype if dtype is None else dtype
        self._indirect = indirect  # a DMA gather/scatter (.ap(vector_offset=...), vector_select)
        self._columns = columns  # a compute-engine gather/scatter (.indirect(index))
        self._offset: int | None = 0 if view is None else None  # see byte_offset()
        self._region: Region | None = None
        self._start: int | None = None
        self._written: np.ndarray | None = None  # the PSUM bookkeeping's view of the same elements

    # -- what it is -------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._view.shape

    @property
    def dtype(self) -> dtypes.DType:
        return self._dtype

    @property
    def buffer(self) -> str:
        return self._buf.kind

    @property
    def name(self) -> str:
        return self._buf.name

    @property
    def ndim(self) -> int:
        return self._view.ndim

    @property
    def size(self) -> int:
        return self._view.size

    @property
    def nbytes(self) -> int:
        return self._view.size * dtypes.itemsize(self._dtype)

    @property
    def strides(self) -> tuple[int, ...]:
        """Element strides of this view within its allocation (0 where broadcast)."""
        item = self._view.itemsize
        return tuple(st // item for st in self._view.strides)

    @property
    def offset(self) -> int:
        """Element offset of this view's first element from the start of its allocation."""
        return self.byte_offset() // self._view.itemsize

    def byte_offset(self) -> int:
        """Bytes from the start of the allocation's storage to this view's first element. Indexing
        derives it from the parent view's (NumPy's own answer costs more than the arithmetic)."""
        if self._offset is None:
            self._offset = self._view.__array_interface__["data"][0] - self._buf.address
        return self._offset

    def get_pattern(self) -> list[list[int]]:
        """This view as an access pattern ``[[step, num], ...]`` (pass it back to ``.ap``)."""
        return [[step, num] for step, num in zip(self.strides, self.shape)]

    def is_contiguous(self) -> bool:
        """Whether the free dims (and, in HBM, all dims) are laid out densely in row-major order."""
        shape, strides = (self.shape[1:], self.strides[1:]) if self.on_chip else (self.shape, self.strides)
        expected = 1
        for n, st in zip(reversed(shape), reversed(strides)):
            if n != 1 and st != expected:
                return False
            expected *= n
        return True

    def is_indirect(self) -> bool:
        """Whether this view's rows (``vector_offset``, ``vector_select``) or columns (``.indirect()``) are
        chosen at run time."""
        return self._indirect is not None or self._columns is not None

    @property
    def on_chip(self) -> bool:
        return self._buf.on_chip

    @property
    def partition_size(self) -> int:
        """Partitions an on-chip tile spans (1 for HBM, whose layout has none)."""
        view = self._view
        return view.shape[0] if (self._buf.on_chip and view.ndim) else 1

    @property
    def free_size(self) -> int:
        """Elements per partition."""
        view = self._view
        if self._buf.on_chip and view.ndim:
            return view.size // max(view.shape[0], 1)
        return view.size

    @property
    def start_partition(self) -> int:
        if self._start is None:
            self._start = self.region().p0 if self.on_chip else 0
        return self._start

    def region(self) -> Region:
        """The partitions and per-partition bytes this view touches (for dependency tracking)."""
        if self._region is None:
            if self._indirect is not None:  # rows known only at run time: the whole allocation
                self._region = Region(self._buf.id, 0, 1, 0, self._buf.data.nbytes)
            elif self._columns is not None:  # columns known only at run time: the view they are chosen from
                self._region = self._columns.base.region()
            else:
                self._region = region_of(self._buf, self._view, self.byte_offset())
        return self._region

    def __repr__(self) -> str:
        name = f" {self.name!r}" if self.name else ""
        return f"<nki tensor{name} {self.buffer} {dtypes.name(self.dtype)}{list(self.shape)}>"

    def __len__(self) -> int:
        return self.shape[0]

    # -- values (for the engines) -----------------------------------------------------------
    def read(self) -> np.ndarray:
        """The stored values (a view; engines widen them before arithmetic; gathered for an ``.indirect()`` view)."""
        if self._columns is not None:
            return self._columns.gather()
        return self._view

    def write(self, values: np.ndarray, instruction: str = "write", psum_writer: int = PSUM_BY_OTHER) -> None:
        """Round ``values`` to this tensor's dtype and store them, shape-matched per partition
        (``psum_writer`` records, for PSUM, which kind of instruction wrote them)."""
        values = np.asarray(values)
        if values.size != self.size:
            raise rule(
                instruction,
                "dst",
                "element count differs from the result",
                dst_shape=self.shape,
                result_shape=values.shape,
            )
        if self._columns is not None:
            self._scatter(values, instruction, psum_writer)
            return
        if not self._view.flags.writeable:
            raise rule(instruction, "dst", "cannot write through a broadcast view", shape=self.shape)
        self._view[...] = dtypes.cast(values, self._dtype).reshape(self.shape)
        if self._buf.written is not None:
            self._mark_written(psum_writer)

    def write_uncomputed(self, instruction: str = "write", psum_writer: int = PSUM_BY_OTHER) -> None:
        """What :meth:`write` does in a trace-only run (``numerics=False``), where the instruction
        skips its arithmetic: the same checks and PSUM bookkeeping, no values; the buffer is marked
        as holding uncomputed values (reading them while tracing raises ``UncomputedValueError``)."""
        columns = self._columns
        if columns is not None:  # the columns it would write, where the offsets are known; else the whole view
            target = columns.base
            if not target._view.flags.writeable:
                raise rule(instruction, "dst", "cannot write through a broadcast view", shape=target.shape)
            if target._buf.written is not None:
                if columns.index_known():
                    target._mark_written_at(columns.targets(), psum_writer)
                else:
                    target._mark_written(psum_writer)
            runtime.current().mark_uncomputed(target._buf)
            return
        # An indirect access (a scatter) is a read-only shape view on purpose; it writes HBM, which keeps
        # no PSUM bookkeeping.
        if self._indirect is None and not self._view.flags.writeable:
            raise rule(instruction, "dst", "cannot write through a broadcast view", shape=self.shape)
        if self._buf.written is not None:
            self._mark_written(psum_writer)
        runtime.current().mark_uncomputed(self._buf)

    def computed_values(self, instruction: str, role: str) -> np.ndarray:
        """The stored values, for a kernel that reads them while it traces (a register load, an
        offset, a gather index): in a trace-only run they must be ones it computed."""
        run = runtime.active()
        if run is not None and not run.computed(self._buf):
            raise UncomputedValueError(
                f"{instruction}: {role}: {self!r} holds values a trace-only run (numerics=False) did not "
                "compute, and the kernel reads them while it traces, so its trace depends on them; "
                "run it with numerics=True"
            )
        return self._view

    def _mark_written(self, psum_writer: int) -> None:
        """Record that ``psum_writer`` wrote every element of this (direct) view of a PSUM tile."""
        buf = self._buf
        if buf.uniform_writer == psum_writer:  # every element holds it already (a matmul group's later steps)
            return
        marks = self._written_view()
        marks[...] = psum_writer
        # A contiguous view with the tile's element count is the whole tile (a strided access pattern can
        # have as many elements and still repeat some and miss others).
        whole = marks.size == buf.written.size and (marks.flags.c_contiguous or marks.flags.f_contiguous)  # type: ignore[union-attr]
        buf.uniform_writer = psum_writer if whole else None

    def _mark_written_at(self, where: Any, psum_writer: int) -> None:
        """Record that ``psum_writer`` wrote the elements ``where`` picks out of this (direct) view of a
        PSUM tile."""
        buf = self._buf
        if buf.uniform_writer == psum_writer:  # every element holds it already
            return
        self._written_view()[where] = psum_writer
        buf.uniform_writer = None  # some elements only: the codes may now differ

    def _written_view(self) -> np.ndarray:
        """A PSUM tile's bookkeeping (``Buffer.written``) for this view's elements; made once per view."""
        view = self._written
        if view is None:
            written = self._buf.written
            assert written is not None, "only PSUM tiles keep write bookkeeping"
            view = self._written = _same_view(written, self._buf, self._view, self.byte_offset())
        return view

    def _scatter(self, values: np.ndarray, instruction: str, psum_writer: int) -> None:
        """An ``.indirect()`` view's write: each partition's values land in the columns its offsets name
        (a later column wins where offsets repeat, as NumPy assigns)."""
        columns = self._columns
        assert columns is not None
        target = columns.base
        if not target._view.flags.writeable:
            raise rule(instruction, "dst", "cannot write through a broadcast view", shape=target.shape)
        if not columns.index_known():  # a trace-only run through offsets it did not compute
            self.write_uncomputed(instruction, psum_writer)
            return
        where = columns.targets()
        target._view[where] = dtypes.cast(values, self._dtype).reshape(where[0].shape)
        if target._buf.written is not None:
            target._mark_written_at(where, psum_writer)

    def was_written(self) -> np.ndarray:
        """For PSUM tiles: which elements some instruction has written."""
        return self.psum_writers() != PSUM_UNWRITTEN

    def uniform_psum_writer(self) -> int | None:
        """For PSUM tiles: the writer code every element of the whole tile holds (so every element of this
        view), or None when they may differ (read :meth:`psum_writers`)."""
        return self._buf.uniform_writer

    def psum_writers(self) -> np.ndarray:
        """For PSUM tiles: what last wrote each element (``runtime.PSUM_UNWRITTEN`` / ``_BY_MATMUL`` / ``_BY_OTHER``)."""
        if self._buf.written is None:
            raise TypeError("only PSUM tensors track writes")
        columns = self._columns
        if columns is not None:
            # The indices are needed even in a trace-only run: whether a matmul accumulates depends on them.
            return columns.base._written_view()[columns.targets()]
        return self._written_view()

    # -- indexing ---------------------------------------------------------------------------
    def _direct(self, what: str) -> None:
        """Views of an indirect access would lose its run-time rows or columns."""
        if self._indirect is not None:
            raise rule(
                what,
                repr(self),
                "an indirect (vector_offset) access pattern cannot be viewed further; "
                "put the whole access in the .ap() pattern",
            )
        if self._columns is not None:
            raise rule(
                what,
                repr(self),
                "an .indirect() view cannot be viewed further; slice or reshape the data view before .indirect()",
            )

    def __getitem__(self, key: Any) -> Tensor:
        if self._indirect is not None or self._columns is not None:
            self._direct("index")
        index, skipped = self._index(key)
        # The trailing Ellipsis keeps an all-integer index a 0-d *view* (NumPy would return a
        # detached scalar, and writes through it would be lost).
        view = Tensor(self._buf, self._view[index + (Ellipsis,)], self._dtype)
        view._offset = self.byte_offset() + skipped
        return view

    def __setitem__(self, key: Any, value: Any) -> None:
        frontend.language()._assign(self[key], value)  # a real instruction: copy or memset

    def _index(self, key: Any) -> tuple[tuple, int]:
        """The NumPy index of an NKI key (checked), and how many bytes past this view's first element
        the indexed view's first element lies."""
        view = self._view
        shape, strides, on_chip = view.shape, view.strides, self._buf.on_chip
        if not isinstance(key, tuple):
            key = (key,)
        for at, k in enumerate(key):
            if k is Ellipsis:
                key = key[:at] + (slice(None),) * (len(shape) - len(key) + 1) + key[at + 1 :]
                break
        if len(key) > len(shape):
            raise IndexError(f"too many indices for a {len(shape)}-d tensor {list(shape)}: {key}")
        out: list[Any] = []
        free_sliced = False  # whether some free dim takes a slice
        skipped = 0
        for dim, k in enumerate(key):
            n = shape[dim]
            if type(k) is not slice and isinstance(k, DynSlice):  # plain slices, the usual key, skip the test
                k = k.as_slice()
            if isinstance(k, slice):
                start, stop = k.start, k.stop
                in_bounds_as_written = (  # NumPy then takes it as is: no need to normalise it
                    k.step is None
                    and (start is None or type(start) is int)
                    and (stop is None or type(stop) is int)
                    and 0 <= (start or 0) < (n if stop is None else stop) <= n
                )
                if not in_bounds_as_written:
                    k = _checked_slice(k, n, dim, self)
                out.append(k)
                skipped += (k.start or 0) * strides[dim]
                if dim:
                    free_sliced = True
            elif isinstance(k, (int, np.integer)):
                k = int(k)
                if not -n <= k < n:
                    raise IndexError(f"index {k} out of bounds for dim {dim} of size {n} in {self!r}")
                k %= n
                skipped += k * strides[dim]
                # On-chip tensors keep the partition dim: an integer there selects one partition.
                out.append(slice(k, k + 1) if (dim == 0 and on_chip) else k)
            elif k is None:
                raise IndexError("NKI tensors do not take None (newaxis) indices; use expand_dims")
            else:
                raise IndexError(f"unsupported index {k!r} for dim {dim}; use ints, slices or nl.ds")
        if on_chip and len(key) == len(shape) and not free_sliced:
            # On-chip views stay 2-D: when every free dim is indexed by an int, the last stays (size 1).
            last = out[-1]
            if isinstance(last, int):  # a 1-D on-chip view has no free dim: its partition index is a slice already
                out[-1] = slice(last, last + 1)
        if on_chip and out and isinstance(out[0], slice) and out[0].step not in (None, 1):
            raise rule("index", repr(self), "the partition dimension cannot be strided", step=out[0].step)
        return tuple(out), skipped

    # -- views ------------------------------------------------------------------------------
    def reshape(self, *shape: Any) -> Tensor:
        self._direct("reshape")
        shape = _shape_arg(shape)
        shape = _resolve_shape(shape, self.size)
        try:
            view = np.reshape(self._view, shape, copy=False)
        except ValueError as exc:
            raise NkiValidationError(
                f"reshape: cannot view {list(self.shape)} as {list(shape)} without copying "
                f"(the tensor is a strided slice); reshape the whole tensor or copy first"
            ) from exc
        out = Tensor(self._buf, view, self._dtype)
        out._check_partition_layout("reshape")
        return out

    def view(self, dtype: Any) -> Tensor:
        """Reinterpret the bits as ``dtype`` (the last dimension scales by the size ratio)."""
        self._direct("view")
        new = dtypes.canonical(dtype)
        try:
            view = self._view.view(dtypes.storage(new))
        except ValueError as exc:
            raise NkiValidationError(f"view: cannot reinterpret {self!r} as {dtypes.name(new)}: {exc}") from exc
        return Tensor(self._buf, view, new)

    def reinterpret_cast(self, dtype: Any) -> Tensor:
        """The same as :meth:`view`."""
        return self.view(dtype)

    def permute(self, dims: Sequence[int], *extra: Any) -> Tensor:
        """Reorder dimensions: ``t.permute((0, 2, 1))`` or ``t.permute(dims=[0, 2, 1])``, one sequence, as
        NKI's ``NkiTensor.permute(dims)`` takes them (not torch's ``t.permute(0, 2, 1)``)."""
        self._direct("permute")
        if extra or not isinstance(dims, (tuple, list)):
            raise TypeError(
                f"permute: pass the dims as one tuple, t.permute({(dims, *extra)}), as NkiTensor.permute(dims) takes them"
            )
        dims = tuple(int(d) for d in dims)
        if sorted(dims) != list(range(self.ndim)):
            raise ValueError(f"permute: {dims} is not a permutation of {self.ndim} dims")
        if self.on_chip and dims[0] != 0:
            raise rule("permute", repr(self), "on-chip tensors keep dim 0 as the partition dim", dims=dims)
        return Tensor(self._buf, np.transpose(self._view, dims), self._dtype)

    def broadcast_to(self, shape: Sequence[int]) -> Tensor:
        self._direct("broadcast_to")
        shape = tuple(int(s) for s in shape)
        if self.on_chip and (len(shape) != self.ndim or shape[0] != self.shape[0]):
            # nki.language NkiTensor.broadcast: "On-chip tensors: dim must not be 0 (partition dim)";
            # an engine reads each partition from its own lane, so a view cannot repeat one.
            raise rule(
                "broadcast",
                repr(self),
                "the partition dim (0) of an on-chip tensor cannot be broadcast",
                shape=list(self.shape),
                to=list(shape),
            )
        try:
            view = np.broadcast_to(self._view, shape)
        except ValueError as exc:
            raise ValueError(f"broadcast_to: cannot broadcast {list(self.shape)} to {list(shape)}") from exc
        return Tensor(self._buf, view, self._dtype)

    def broadcast(self, dim: int, size: int) -> Tensor:
        """Repeat a size-1 dimension ``size`` times without copying (stride 0)."""
        if self.shape[dim] != 1:
            raise ValueError(f"broadcast: dim {dim} of {list(self.shape)} has size {self.shape[dim]}, not 1")
        shape = list(self.shape)
        shape[dim] = int(size)
        return self.broadcast_to(shape)

    def expand_dims(self, axis: int) -> Tensor:
        self._direct("expand_dims")
        if self.on_chip and int(axis) % (self.ndim + 1) == 0:
            raise rule("expand_dims", repr(self), "axis 0 is the partition dim of an on-chip tensor")
        return Tensor(self._buf, np.expand_dims(self._view, axis), self._dtype)

    def expand_dim(self, dim: int) -> Tensor:
        return self.expand_dims(dim)

    def squeeze_dim(self, dim: int) -> Tensor:
        self._direct("squeeze_dim")
        if self.shape[dim] != 1:
            raise ValueError(f"squeeze_dim: dim {dim} of {list(self.shape)} has size {self.shape[dim]}, not 1")
        if self.on_chip and int(dim) % self.ndim == 0:
            raise rule("squeeze_dim", repr(self), "axis 0 is the partition dim of an on-chip tensor")
        return Tensor(self._buf, np.squeeze(self._view, dim), self._dtype)

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> Tensor:
        """``start:end:step`` along one dimension."""
        key: list[Any] = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim: int, index: int) -> Tensor:
        """Drop dimension ``dim`` by taking element ``index`` of it."""
        if self.on_chip and int(dim) % self.ndim == 0:
            raise rule("select", repr(self), "cannot drop the partition dim of an on-chip tensor")
        key: list[Any] = [slice(None)] * self.ndim
        key[dim] = _scalar_value(index)  # an int, a register, or a one-element tile read now
        return self[tuple(key)]

    def flatten_dims(self, start_dim: int, end_dim: int) -> Tensor:
        """Merge dimensions ``start_dim..end_dim`` (inclusive) into one."""
        shape = self.shape[:start_dim] + (-1,) + self.shape[end_dim + 1 :]
        return self.reshape(shape)

    def reshape_dim(self, dim: int, shape: Sequence[int]) -> Tensor:
        """Split dimension ``dim`` into ``shape`` (one entry may be -1)."""
        return self.reshape(self.shape[:dim] + tuple(shape) + self.shape[dim + 1 :])

    def rearrange(
        self, src_pattern: Sequence[Any], dst_pattern: Sequence[Any], fixed_sizes: dict[str, int] | None = None
    ) -> Tensor:
        """An einops-style view: ``t.rearrange(('b', ('h', 'w')), ('b', 'w', 'h'), {'h': 4})``.

        Each pattern entry names one dim or, as a tuple of names, a group: a group in
        ``src_pattern`` splits that dim (sizes from ``fixed_sizes``, one may be inferred), a group in
        ``dst_pattern`` merges dims. Both patterns must use the same names.
        """
        what = "rearrange"
        fixed = dict(fixed_sizes or {})
        if len(src_pattern) != self.ndim:
            raise ValueError(
                f"{what}: src_pattern {src_pattern} has {len(src_pattern)} entries, the tensor {self.ndim} dims"
            )
        sizes: dict[str, int] = {}
        order: list[str] = []
        for entry, extent in zip(src_pattern, self.shape):
            names = [entry] if isinstance(entry, str) else list(entry)
            unknown = [n for n in names if n not in fixed]
            known = int(np.prod([fixed[n] for n in names if n in fixed]))
            if len(unknown) > 1 or (not unknown and known != extent) or extent % known:
                raise ValueError(f"{what}: cannot split a dim of size {extent} into {tuple(names)} with sizes {fixed}")
            for name in names:
                sizes[name] = fixed.get(name, extent // known)
            order.extend(names)
        flat_dst = [name for entry in dst_pattern for name in ([entry] if isinstance(entry, str) else entry)]
        if sorted(flat_dst) != sorted(order) or len(set(order)) != len(order):
            raise ValueError(f"{what}: {dst_pattern} must name exactly the dims of {src_pattern}, once each")
        split = self.reshape(tuple(sizes[name] for name in order))
        moved = split.permute(tuple(order.index(name) for name in flat_dst))
        merged = [
            sizes[entry] if isinstance(entry, str) else int(np.prod([sizes[n] for n in entry])) for entry in dst_pattern
        ]
        return moved.reshape(tuple(merged))

    def vector_select(self, dim: int, vector_offset: Tensor) -> Tensor:
        """Per-partition indirect rows of an HBM tensor: row ``vector_offset[p]`` of dim 0 for each ``p``.

        The result has ``vector_offset.shape[0]`` rows and is an indirect view, resolved by the DMA
        instruction that reads or writes it (as ``.ap(..., vector_offset=...)``).
        """
        self._direct("vector_select")
        if int(dim) != 0:
            raise rule("vector_select", "dim", "must be 0", dim=dim)
        if self.on_chip:
            raise rule("vector_select", repr(self), "vector_select applies to HBM tensors only")
        if not isinstance(vector_offset, Tensor) or vector_offset.buffer != "sbuf":
            raise rule("vector_select", "vector_offset", "must be an SBUF tile of per-partition indices")
        if self._view.itemsize != self._buf.data.itemsize:
            raise rule("vector_select", repr(self), "select rows before reinterpreting the dtype with .view()")
        nums = (vector_offset.shape[0],) + self.shape[1:]
        indirect = Indirect(vector_offset, 0, self.offset, self.strides, nums)
        shape_only = np.broadcast_to(self._buf.data.reshape(-1)[:1], nums)
        return Tensor(self._buf, shape_only, self._dtype, indirect=indirect)

    def indirect(self, index: Tensor, num_elem: int | None = None) -> Tensor:
        """Tensor indirection (NeuronCore-v4): a ``[P, num_elem]`` view of columns of this SBUF/PSUM view at the
        free-dim offsets held in ``index`` (an SBUF ``[P, K]`` uint16 tile; ``num_elem`` defaults to its size).

        Passed as an operand that supports it, the instruction gathers the columns (an input) or scatters its
        result into them (``dst``); which operands, engines and partition placements are allowed is checked
        there (see ``indirection.py``). See :class:`Columns` for how offsets are read from ``index``.
        """
        what = "indirect"
        self._direct(what)
        if not self.on_chip:
            raise rule(
                what, repr(self), "tensor indirection selects columns of an SBUF or PSUM tensor", buffer=self.buffer
            )
        if not isinstance(index, Tensor) or index.buffer != "sbuf":
            raise rule(what, "index", "must be an SBUF tensor of free-dim offsets", index=repr(index))
        if index.is_indirect():
            raise rule(what, "index", "must be a plain SBUF tile, not an indirect view", index=repr(index))
        if index.ndim != 2 or index.shape[0] != self.shape[0]:
            raise rule(
                what,
                "index",
                "must have shape (P, K) with P the data's partitions",
                index=list(index.shape),
                P=self.shape[0],
            )
        if (
            dtypes.name(index.dtype) != "uint16"
        ):  # AWS's tensor-indirection deep dive: "an SBUF tensor of uint16 values"
            raise rule(what, "index", "offsets must be uint16", dtype=dtypes.name(index.dtype))
        count = index.size if num_elem is None else int(num_elem)
        if not 1 <= count <= index.size:
            raise rule(what, "num_elem", "must be between 1 and index.size", num_elem=count, index_size=index.size)
        shape_only = np.broadcast_to(self._buf.data.reshape(-1)[:1], (self.shape[0], count))
        return Tensor(self._buf, shape_only, self._dtype, columns=Columns(self, index, count))

    def ap(
        self,
        pattern: Sequence[Sequence[int]],
        offset: int | None = None,
        *,
        vector_offset: Tensor | None = None,
        scalar_offset: Any = None,
        indirect_dim: int = 0,
        dtype: Any = None,
    ) -> Tensor:
        """An access pattern straight onto this tensor's allocation: ``[[step, num], ...]``.

        Steps and ``offset`` count elements (of ``dtype`` when given, reinterpreting the bits)
        of the whole allocation laid out row-major, partition dim included; like NKI, a pattern
        ignores any slicing done before it. ``offset=None`` starts where this view starts. For
        SBUF/PSUM the first pair must step one partition. ``scalar_offset`` (an int, register or
        one-element tile) and ``vector_offset`` (an SBUF ``[P, 1]`` tile of per-partition indices)
        shift the start by whole slices of the allocation along ``indirect_dim``.
        """
        if vector_offset is not None and scalar_offset is not None:
            raise ValueError("ap: vector_offset and scalar_offset are mutually exclusive")
        if vector_offset is not None and indirect_dim != 0:
            raise rule("ap", "indirect_dim", "vector_offset indexes dim 0 only", indirect_dim=indirect_dim)
        steps = [int(step) for step, _ in pattern]
        nums = [int(num) for _, num in pattern]
        new_dtype = self._dtype if dtype is None else dtypes.canonical(dtype)
        storage = dtypes.storage(new_dtype)
        base = self._buf.data
        try:
            flat = base.reshape(-1).view(storage)
        except ValueError as exc:
            raise rule("ap", repr(self), f"cannot reinterpret the allocation as {dtypes.name(new_dtype)}") from exc
        ratio = base.itemsize / flat.itemsize
        base_shape = base.shape[:-1] + (int(base.shape[-1] * ratio),) if base.ndim else (flat.size,)
        if offset is None:
            offset = self.byte_offset() // flat.itemsize
        start = int(offset)
        row = int(np.prod(base_shape[indirect_dim + 1 :]))
        if scalar_offset is not None:
            start += _scalar_value(scalar_offset) * row
        if vector_offset is not None:
            # Only the instruction can resolve the rows; the view just carries the shape.
            shape_only = np.broadcast_to(flat[:1], tuple(nums))
            indirect = Indirect(vector_offset, indirect_dim, start, (row,) + tuple(steps[1:]), tuple(nums))
            return Tensor(self._buf, shape_only, new_dtype, indirect=indirect)
        lo = start + sum(min(0, (n - 1) * st) for st, n in zip(steps, nums))
        hi = start + sum(max(0, (n - 1) * st) for st, n in zip(steps, nums))
        if lo < 0 or hi >= flat.size:
            raise rule(
                "ap",
                repr(self),
                "access pattern reaches outside the allocation",
                pattern=[list(p) for p in pattern],
                offset=start,
                first=lo,
                last=hi,
                allocation_elements=flat.size,
            )
        item = flat.itemsize
        view = as_strided(flat[start:], shape=tuple(nums), strides=tuple(st * item for st in steps), writeable=True)
        out = Tensor(self._buf, view, new_dtype)
        out._check_partition_layout("ap")
        return out

    def _check_partition_layout(self, what: str) -> None:
        """On-chip views step one partition along dim 0 and stay inside a partition otherwise."""
        if not self.on_chip or self.ndim == 0 or self.size == 0:
            return
        row = self._buf.partition_bytes
        if self.shape[0] > 1 and self._view.strides[0] != row:
            raise rule(
                what,
                repr(self),
                "dim 0 of an on-chip view must step exactly one partition",
                stride_bytes=self._view.strides[0],
                partition_bytes=row,
            )
        region = self.region()
        if region.p1 - region.p0 != self.shape[0]:
            raise rule(
                what,
                repr(self),
                "free dims of an on-chip view spill into other partitions",
                shape=list(self.shape),
                partitions_touched=region.p1 - region.p0,
            )

    # -- arithmetic sugar (each is a real instruction, see nki.language) ---------------------
    def _binary(self, other: Any, op: str, reverse: bool = False) -> Tensor:
        fn = getattr(frontend.language(), op)
        return fn(other, self) if reverse else fn(self, other)

    def __add__(self, o):
        return self._binary(o, "add")

    def __radd__(self, o):
        return self._binary(o, "add", True)

    def __sub__(self, o):
        return self._binary(o, "subtract")

    def __rsub__(self, o):
        return self._binary(o, "subtract", True)

    def __mul__(self, o):
        return self._binary(o, "multiply")

    def __rmul__(self, o):
        return self._binary(o, "multiply", True)

    def __truediv__(self, o):
        return self._binary(o, "divide")

    def __rtruediv__(self, o):
        return self._binary(o, "divide", True)

    def __pow__(self, o):
        return self._binary(o, "power")

    def __lt__(self, o):
        return self._binary(o, "less")

    def __le__(self, o):
        return self._binary(o, "less_equal")

    def __gt__(self, o):
        return self._binary(o, "greater")

    def __ge__(self, o):
        return self._binary(o, "greater_equal")

    def __and__(self, o):
        return self._binary(o, "bitwise_and")

    def __or__(self, o):
        return self._binary(o, "bitwise_or")

    def __xor__(self, o):
        return self._binary(o, "bitwise_xor")

    def __neg__(self):
        return frontend.language().negative(self)

    def __iadd__(self, other: Any) -> Tensor:
        frontend.language()._accumulate_into(self, other)
        return self

    __hash__ = object.__hash__

    def __eq__(self, other: object):  # NKI tiles compare element-wise, like NumPy
        if other is None:  # a Python-level check of an optional argument in NKI's front end
            return False
        return self._binary(other, "equal")

    def __ne__(self, other: object):
        if other is None:
            return True
        return self._binary(other, "not_equal")

    def __bool__(self) -> bool:
        """True when every element is non-zero, read now.

        AWS's API examples check results inside kernels with ``assert nl.equal(a, b)``; a
        simulated kernel runs eagerly, so the tile's current values decide.
        """
        if self._indirect is not None:
            raise TypeError(f"the truth value of an indirect access pattern {self!r} is not defined")
        return bool(np.all(np.asarray(self.computed_values("bool", "tensor")) != 0))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TypeError(
            f"{self!r} is device memory; read it back by returning it from the kernel "
            "(or nl.device_print it) rather than converting it to NumPy inside the kernel"
        )


def _checked_slice(k: slice, n: int, dim: int, tensor: Tensor) -> slice:
    start, stop, step = k.start, k.stop, k.step
    step = 1 if step is None else int(step)
    if step <= 0:
        raise IndexError(f"dim {dim}: only positive slice steps are supported, got {step}")
    start = 0 if start is None else int(start)
    stop = n if stop is None else int(stop)
    if start < 0:
        start += n
    if stop < 0:
        stop += n
    if not (0 <= start <= n and 0 <= stop <= n):
        raise IndexError(f"slice {start}:{stop} is out of bounds for dim {dim} of size {n} in {tensor!r}")
    if start >= stop:  # NkiTensor.slice: "0 <= start < end <= t.shape[dim]"
        raise IndexError(f"slice {start}:{stop} of dim {dim} in {tensor!r} is empty: start must be below end")
    return slice(start, stop, step)


def _shape_arg(args: tuple) -> tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = tuple(args[0])
    return tuple(int(a) for a in args)


def _resolve_shape(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    if shape.count(-1) > 1:
        raise ValueError(f"reshape: at most one -1 in {shape}")
    if -1 in shape:
        known = int(np.prod([s for s in shape if s != -1]))
        if known == 0 or size % known:
            raise ValueError(f"reshape: cannot infer -1 in {shape} for {size} elements")
        shape = tuple(size // known if s == -1 else s for s in shape)
    if int(np.prod(shape)) != size:
        raise ValueError(f"reshape: {list(shape)} has {int(np.prod(shape))} elements, the tensor has {size}")
    return shape


def _same_view(target: np.ndarray, buf: Buffer, view: np.ndarray, offset: int) -> np.ndarray:
    """Apply ``view``'s offset (``offset`` bytes into ``buf``'s storage) and strides to a parallel array
    ``target``."""
    base = buf.data
    scale_from, scale_to = base.itemsize, target.itemsize
    # A dtype-reinterpreting view only happens on whole rows; map bytes to base elements.
    elem = offset // scale_from
    strides = tuple([s * scale_to // scale_from for s in view.strides])
    shape = view.shape
    if view.itemsize != base.itemsize:
        ratio = view.itemsize / base.itemsize
        shape = shape[:-1] + (int(shape[-1] * ratio),) if shape else shape
        strides = strides[:-1] + (scale_to,) if strides else strides
    # The ndarray constructor over the (contiguous) target is a fifth of as_strided's cost; it also checks the bounds.
    return np.ndarray(shape, target.dtype, buffer=target, offset=elem * scale_to, strides=strides)


def _scalar_value(x: Any) -> int:
    if isinstance(x, Tensor):
        if x.size != 1:
            raise ValueError(f"scalar_offset must hold one element, got {list(x.shape)}")
        return int(np.asarray(x.computed_values("scalar offset", "tensor")).reshape(-1)[0])
    if hasattr(x, "value"):
        return int(x.value)
    return int(x)
