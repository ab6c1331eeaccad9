"""``nki.language``: allocation, indexing helpers, SPMD queries and the tile-level convenience ops.

Convenience ops (``nl.exp``, ``nl.matmul``, ``nl.load``, ``a + b`` ...) are lowered to the same
``nki.isa`` instructions the compiler would emit, so they are checked and traced like any
hand-written instruction.
"""

from __future__ import annotations

import builtins
import contextlib
import enum
import inspect
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from . import dtypes, frontend, isa, operands, ops, runtime
from .dtypes import (  # noqa: F401  (re-exported: nl.float32 etc.)
    bfloat16,
    bool_,
    float4_e2m1fn_x4,
    float8_e4m3,
    float8_e4m3fn,
    float8_e4m3fn_x4,
    float8_e5m2,
    float8_e5m2_x4,
    float8_e8m0fnu,
    float16,
    float32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
from .errors import rule
from .targets import resolve as _resolve_target
from .tensor import DynSlice, Tensor

NkiTensor = Tensor
ndarray_type = Tensor


class MemoryRegion(enum.StrEnum):
    """The memory a tensor lives in; each member equals the ``nl.sbuf`` ... string it names."""

    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"


sbuf = "sbuf"
psum = "psum"
hbm = "hbm"
private_hbm = "private_hbm"
shared_hbm = "shared_hbm"
_BUFFERS = (sbuf, psum, hbm, private_hbm, shared_hbm)


class NKIObject:
    """Base class for user classes in NKI kernels. As in NKI, every subclass behaves like a dataclass
    with or without ``@dataclass`` (nki-language-guide.rst, "Class Support"): without an ``__init__``
    of its own it takes its fields (annotated names, then plain class attributes) by position or
    keyword, a field not given keeps its class default (or None), then
    ``__post_init__`` runs if defined; equality compares fields, as NKI's is structural."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        fields = _nki_fields(type(self))
        if len(args) > len(fields):
            raise TypeError(f"{type(self).__name__}() takes at most {len(fields)} positional fields, got {len(args)}")
        given = dict(zip(fields, args))
        for key, value in kwargs.items():
            if key not in fields:
                raise TypeError(f"{type(self).__name__}() has no field {key!r}; fields: {list(fields)}")
            if key in given:
                raise TypeError(f"{type(self).__name__}() got field {key!r} twice")
            given[key] = value
        for field, default in fields.items():
            # object.__setattr__, as dataclass's own __init__ does, so @dataclass(frozen=True) works
            object.__setattr__(self, field, given.get(field, default))
        post_init = getattr(self, "__post_init__", None)
        if post_init is not None:
            post_init()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Python's @dataclass, applied after the class body, writes its own __init__/__eq__/__repr__
        # from annotated fields only, so a class whose fields are plain attributes (nki-library's
        # attention_cte.SectionParams) would get a no-argument __init__; it leaves methods already in
        # the class's own namespace alone, so NKIObject's are placed there unless the class (or a
        # base between it and NKIObject) brings its own.
        super().__init_subclass__(**kwargs)
        for method in ("__init__", "__eq__", "__repr__"):
            if getattr(cls, method) is getattr(NKIObject, method):
                setattr(cls, method, getattr(NKIObject, method))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({inner})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]  # mutable and compared by value, like a dataclass


def _nki_fields(cls: type) -> dict[str, Any]:
    """A class's fields and their defaults: annotated names and data class attributes, base classes first."""
    fields: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or klass is NKIObject:
            continue
        for field in inspect.get_annotations(klass):
            fields[field] = klass.__dict__.get(field, fields.get(field))
        for field, value in klass.__dict__.items():
            if not field.startswith("__") and not _is_behaviour(value):
                fields[field] = value
    return fields


def _is_behaviour(value: Any) -> bool:
    return callable(value) or isinstance(value, (property, classmethod, staticmethod))


DMA_TRANSPOSE_AS_PE_ENV_VAR = "NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE"
GEMM_MOVING_TILE = 512


class _TileSizeMeta(type):
    """Tile-size constants, read for the running kernel's target (trn2 outside a kernel)."""

    @property
    def _target(cls):
        run = runtime.active()
        return run.target if run is not None else _resolve_target(None)

    @property
    def pmax(cls) -> int:
        return cls._target.partitions

    @property
    def psum_fmax(cls) -> int:
        return cls._target.psum_bank_bytes // 4  # fp32 elements in one PSUM bank

    @property
    def gemm_stationary_fmax(cls) -> int:
        return cls._target.gemm_stationary_fmax

    @property
    def gemm_moving_fmax(cls) -> int:
        # The moving tile kernels are written for: 512 on every target, as AWS's tiling overview
        # states it and its Trn3-only MX matmul examples rely on (their moving tiles are [128, 512]
        # x4). NeuronCore-v4's nc_matmul itself accepts wider moving operands (targets.py).
        return GEMM_MOVING_TILE

    @property
    def bn_stats_fmax(cls) -> int:
        return operands.BN_STATS_FMAX

    @property
    def psum_min_align(cls) -> int:
        return 4

    @property
    def sbuf_min_align(cls) -> int:
        return 32

    @property
    def total_available_sbuf_size(cls) -> int:
        return cls._target.sbuf_bytes_per_partition

    @property
    def psum_bank_fmax(cls) -> int:
        return cls._target.psum_bank_bytes // 4

    @property
    def psum_bank_fmax_bytes(cls) -> int:
        return cls._target.psum_bank_bytes

    @property
    def psum_num_banks(cls) -> int:
        banks = cls._target.psum_bytes_per_partition // cls._target.psum_bank_bytes
        # AWS: bank 7 is kept for nc_transpose when DMA transposes are lowered to TensorE (trn2+).
        lowered = os.environ.get(DMA_TRANSPOSE_AS_PE_ENV_VAR, "").lower() == "true"
        return banks - 1 if lowered and cls._target.generation >= 3 else banks

    @property
    def sbuf_size_bytes(cls) -> int:
        return cls._target.sbuf_bytes_per_partition * cls._target.partitions

    @property
    def sbuf_fmax_bytes(cls) -> int:
        return cls._target.sbuf_bytes_per_partition

    @property
    def sbuf_fmax(cls) -> int:
        return cls._target.sbuf_bytes_per_partition // 4  # fp32 elements


class tile_size(NKIObject, metaclass=_TileSizeMeta):
    """Tile size constants (``nl.tile_size.pmax`` ...), per the running kernel's target."""


# ---------------------------------------------------------------------------------------------
# allocation
# ---------------------------------------------------------------------------------------------
def _check_alloc(shape: Sequence[int], buffer: str, what: str) -> tuple[int, ...]:
    if buffer not in _BUFFERS:
        raise ValueError(f"{what}: unknown buffer {buffer!r}; use nl.sbuf, nl.psum, nl.hbm or nl.shared_hbm")
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    shape = tuple(int(s) for s in shape)
    if any(s <= 0 for s in shape):
        raise ValueError(f"{what}: every dim must be positive, got {list(shape)}")
    if buffer in runtime.ON_CHIP:
        if len(shape) < 2:
            raise rule(
                what, "shape", "on-chip tensors need a partition dim and at least one free dim", shape=list(shape)
            )
        limit = runtime.current().target.partitions
        if shape[0] > limit:
            raise rule(
                what, "shape", "partition dim (dim 0) exceeds the partition count", partitions=shape[0], limit=limit
            )
    return shape


def ndarray(
    shape: Sequence[int], dtype: Any, buffer: str | None = None, name: str | None = "", address: Any = None
) -> Tensor:
    """A new tensor of ``shape``/``dtype`` in ``buffer`` (SBUF by default), uninitialized (NaN).

    ``address=(partition_offset, free_offset)`` places an SBUF or PSUM tile at that partition and byte
    of the core's memory instead of leaving it to the compiler: tiles whose addresses overlap share
    those bytes (the trace records the physical regions, so their hazards order the schedule), count
    once towards capacity, and a tile that reads bytes it wrote which another tile placed over them has
    written since raises ``AliasingError`` (bytes a tile never wrote read as uninitialized).
    """
    buffer = sbuf if buffer is None else buffer
    name = name or ""
    shape = _check_alloc(shape, buffer, "nl.ndarray")
    placed = None if address is None else _check_address(address, buffer)
    return Tensor(runtime.current().allocate(shape, dtypes.canonical(dtype), buffer, name, address=placed))


def _check_address(address: Any, buffer: str) -> tuple[int, int]:
    if buffer not in runtime.ON_CHIP:
        raise rule("nl.ndarray", "address", "only SBUF and PSUM tiles take an address", buffer=buffer)
    if (
        not isinstance(address, (tuple, list))
        or len(address) != 2
        or not builtins.all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) and a >= 0 for a in address)
    ):
        raise rule(
            "nl.ndarray", "address", "must be (partition_offset, free_offset), two non-negative ints", address=address
        )
    return int(address[0]), int(address[1])


def _filled(shape: Sequence[int], value: Any, dtype: Any, buffer: str | None, name: str, what: str) -> Tensor:
    buffer = sbuf if buffer is None else buffer
    shape = _check_alloc(shape, buffer, what)
    dt = dtypes.canonical(dtype)
    run = runtime.current()
    if buffer in runtime.ON_CHIP:
        out = Tensor(run.allocate(shape, dt, buffer, name))
        isa.memset(out, value)
        return out
    return Tensor(run.allocate(shape, dt, buffer, name, fill=value))


def zeros(shape: Sequence[int], dtype: Any, buffer: str | None = None, name: str = "") -> Tensor:
    return _filled(shape, 0, dtype, buffer, name, "nl.zeros")


def ones(shape: Sequence[int], dtype: Any, buffer: str | None = None, name: str = "") -> Tensor:
    return _filled(shape, 1, dtype, buffer, name, "nl.ones")


def full(shape: Sequence[int], fill_value: Any, dtype: Any, buffer: str | None = None, name: str = "") -> Tensor:
    return _filled(shape, fill_value, dtype, buffer, name, "nl.full")


def zeros_like(x: Tensor, dtype: Any = None, buffer: str | None = None, name: str = "") -> Tensor:
    return zeros(x.shape, x.dtype if dtype is None else dtype, x.buffer if buffer is None else buffer, name)


def empty_like(x: Tensor, dtype: Any = None, buffer: str | None = None, name: str = "") -> Tensor:
    return ndarray(x.shape, x.dtype if dtype is None else dtype, x.buffer if buffer is None else buffer, name)


def shared_constant(constant: Any, dtype: Any = None) -> Tensor:
    """A shared-HBM tensor holding ``constant``: an array (or array-like), or the path of an ``.npy`` file."""
    if isinstance(constant, (str, os.PathLike)):
        constant = np.load(os.fspath(constant), allow_pickle=False)
    values = np.asarray(constant)
    dt = dtypes.canonical(values.dtype if dtype is None else dtype)
    buf = runtime.current().allocate(values.shape, dt, shared_hbm, "shared_constant", fill=0)
    buf.data[...] = dtypes.cast(values, dt)
    return Tensor(buf)


def shared_identity_matrix(n: int, dtype: Any = "uint8", dst: Tensor | None = None) -> Tensor:
    """An ``n × n`` identity matrix in SBUF (written into ``dst`` when given, else a new tile).

    AWS's API reference creates it in SBUF (its example compares it with a loaded tile, and the
    nki-library kernels feed it to TensorE); the matrix itself is a shared constant that a DMA
    brings in, as the compiler does.
    """
    n = int(n)
    what = "nl.shared_identity_matrix"
    if dst is None:
        limit = runtime.current().target.partitions
        if n > limit:
            raise rule(
                what, "n", "the identity matrix is an SBUF tile: n rows exceed the partition count", n=n, limit=limit
            )
        dst = ndarray((n, n), dtype, buffer=sbuf, name="identity")
    if dst.buffer != sbuf or dst.partition_size != n or dst.free_size != n:
        raise rule(what, "dst", f"must be an [n, n] SBUF tile for n={n}", shape=list(dst.shape), buffer=str(dst.buffer))
    isa.dma_copy(dst, shared_constant(np.eye(n), dst.dtype))
    return dst


# ---------------------------------------------------------------------------------------------
# indexing, loops, SPMD
# ---------------------------------------------------------------------------------------------
def ds(start: int, size: int) -> DynSlice:
    """``size`` elements from ``start``: the same as ``start:start + size``."""
    return DynSlice(int(start), int(size))


def _range(start: Any, stop: Any = None, step: int = 1) -> range:
    if stop is None:
        start, stop = 0, start
    return range(int(start), int(stop), int(step))


def affine_range(start: Any, stop: Any = None, step: int = 1) -> range:
    """Loop iterator for iterations without carried dependencies (runs in order here)."""
    return _range(start, stop, step)


def sequential_range(start: Any, stop: Any = None, step: int = 1) -> range:
    """Loop iterator for iterations with carried dependencies."""
    return _range(start, stop, step)


def static_range(start: Any, stop: Any = None, step: int = 1) -> range:
    """Fully unrolled loop iterator."""
    return _range(start, stop, step)


def dynamic_range(start: Any, stop: Any = None, step: int = 1) -> range:
    """Loop with bounds from registers (``nisa.register_alloc``) or ints."""
    return _range(start, stop, step)


def fori_loop(lower: Any, upper: Any, body_fun: Any, step: int = 1) -> None:
    """Run ``body_fun(i)`` for ``i`` in ``range(lower, upper, step)`` (NKI 0.6's dynamic loop).

    ``lower`` and ``upper`` may be registers; ``step`` is a compile-time positive integer.
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step <= 0:
        raise rule("nl.fori_loop", "step", "must be a compile-time positive integer", step=step)
    for i in range(int(lower), int(upper), int(step)):
        body_fun(i)


def while_loop(init: Any, body_fun: Any) -> None:
    """``r = init; while r != 0: r = body_fun(r)``: the body gets the condition register by value
    and returns the next one (a register or int)."""
    condition = init
    while int(condition):
        condition = body_fun(isa.VirtualRegister(int(condition)))


def par_dim(size: int) -> int:
    """Mark a shape entry as the partition dim (older NKI); the partition dim is always dim 0 now."""
    return size


def program_id(axis: int = 0) -> int:
    """Index of this program along ``axis`` of the SPMD launch grid."""
    run = runtime.current()
    if not 0 <= axis < len(run.grid):
        raise IndexError(f"nl.program_id: axis {axis} outside a {len(run.grid)}-d launch grid {run.grid}")
    return run.program_id[axis]


def num_programs(axes: Any = 0) -> int:
    """Programs along ``axes`` of the launch grid (axis 0 by default, as in NKI; None: all of them)."""
    grid = runtime.current().grid
    if axes is None:
        return int(np.prod(grid))
    if isinstance(axes, (list, tuple)):
        return int(np.prod([grid[a] for a in axes]))
    return grid[axes]


def program_ndim() -> int:
    """Dimensions of the SPMD launch grid (0 without a grid)."""
    run = runtime.current()
    return 0 if run.grid == (1,) and not run.explicit_grid else len(run.grid)


def device_print(print_prefix: str, tensor: Tensor) -> None:
    """Print a tensor's current values now (on hardware this goes to the runtime's debug dir)."""
    if not runtime.current().computed(tensor._buf):
        print(f"{print_prefix} {tensor!r}: not computed (a trace-only run, numerics=False)")
        return
    values = np.asarray(tensor.read())
    print(f"{print_prefix} {tensor!r}:\n{values.astype(np.float32) if dtypes.is_float(tensor.dtype) else values}")


@contextlib.contextmanager
def no_reorder() -> Iterator[None]:
    """Ask the compiler to keep instruction order; the simulator always does."""
    yield


def is_hbm(buffer: str) -> bool:
    return buffer in runtime.HBM_KINDS


def is_sbuf(buffer: str) -> bool:
    return buffer == sbuf


def is_psum(buffer: str) -> bool:
    return buffer == psum


def is_on_chip(buffer: str) -> bool:
    return buffer in runtime.ON_CHIP


# ---------------------------------------------------------------------------------------------
# data movement
# ---------------------------------------------------------------------------------------------
def load(src: Tensor, dtype: Any = None) -> Tensor:
    """Copy an HBM tensor into a new SBUF tile (dim 0 becomes the partition dim)."""
    out = ndarray(src.shape, src.dtype if dtype is None else dtype, buffer=sbuf)
    isa.dma_copy(out, src)
    return out


def store(dst: Tensor, value: Tensor) -> None:
    """Copy a tile into an HBM tensor (a PSUM tile is first copied to SBUF, as DMA cannot read PSUM)."""
    if isinstance(value, Tensor) and value.buffer == psum:
        value = _to_sbuf(value)
    isa.dma_copy(dst, value)


def load_transpose2d(src: Tensor, dtype: Any = None) -> Tensor:
    """Load a 2-D HBM tensor transposed, with the DMA engine."""
    if src.ndim != 2:
        raise ValueError(f"nl.load_transpose2d: expected a 2-D tensor, got {list(src.shape)}")
    out = ndarray((src.shape[1], src.shape[0]), src.dtype if dtype is None else dtype, buffer=sbuf)
    isa.dma_transpose(out, src)
    return out


def _to_sbuf(x: Tensor, dtype: Any = None) -> Tensor:
    """A VectorE copy of ``x`` into a new SBUF tile."""
    out = ndarray(x.shape, x.dtype if dtype is None else dtype, buffer=sbuf)
    isa.tensor_copy(out, x)
    return out


def transpose(x: Tensor, dtype: Any = None) -> Tensor:
    """2-D transpose on TensorE into a new PSUM tile."""
    out = ndarray((x.free_size, x.partition_size), x.dtype if dtype is None else dtype, buffer=psum)
    isa.nc_transpose(out, x)
    return out


def matmul(x: Tensor, y: Tensor, transpose_x: bool = False) -> Tensor:
    """``x @ y`` into a new fp32 PSUM tile (``x`` given as [K, M] when ``transpose_x``)."""
    if not transpose_x:
        # TensorE contracts over partitions: bring x to [K, M] first, as the compiler would.
        x = _to_sbuf(transpose(x))
    out = ndarray((x.free_size, y.free_size), float32, buffer=psum)
    isa.nc_matmul(out, x, y, accumulate=False)
    out._buf.origin = ("matmul", runtime.current().trace.instructions[-1].index, x, y)
    return out


def _assign(dst: Tensor, value: Any) -> None:
    """``tile[...] = value``: a copy instruction (DMA when HBM is involved), or a memset."""
    if isinstance(value, Tensor):
        if dst.buffer in runtime.HBM_KINDS or value.buffer in runtime.HBM_KINDS:
            store(dst, value)
        else:
            isa.tensor_copy(dst, value)
    elif dst.on_chip:
        isa.memset(dst, value)
    else:
        raise rule(
            "tensor assignment",
            "dst",
            f"cannot assign a constant to HBM tensor {dst!r}; memset an SBUF tile and dma_copy it",
            value=value,
        )


def _accumulate_into(dst: Tensor, value: Any) -> None:
    """``dst += value``; ``psum += nl.matmul(...)`` accumulates in PSUM like the compiler's lowering."""
    origin = getattr(value, "_buf", None) and value._buf.origin
    trace = runtime.current().trace.instructions
    if origin and dst.buffer == psum and trace and trace[-1].index == origin[1]:
        trace.pop()  # the standalone matmul is replaced by one that accumulates into dst
        isa.nc_matmul(dst, origin[2], origin[3])
        return
    if isinstance(value, Tensor):
        isa.tensor_tensor(dst, dst, value, ops.ALL["add"])
    else:
        isa.tensor_scalar(dst, dst, ops.ALL["add"], value)


# ---------------------------------------------------------------------------------------------
# element-wise math
# ---------------------------------------------------------------------------------------------
_PRECISION = [
    bool_,
    uint8,
    int8,
    uint16,
    int16,
    uint32,
    int32,
    float8_e5m2,
    float8_e4m3,
    float8_e4m3fn,
    bfloat16,
    float16,
    tfloat32,
    float32,
]


def _promote(*values: Any) -> dtypes.DType:
    tiles = [v.dtype for v in values if isinstance(v, Tensor)]
    if any(isinstance(v, float) for v in values) and builtins.all(not dtypes.is_float(t) for t in tiles):
        return float32
    return builtins.max(tiles, key=lambda d: _PRECISION.index(d) if d in _PRECISION else len(_PRECISION))


def _unary(op: ops.Op, x: Tensor, dtype: Any = None) -> Tensor:
    out = ndarray(x.shape, _promote(x) if dtype is None else dtype, buffer=sbuf)
    if op.name == "copy":
        # nl.copy is VectorE's tensor_copy (bit-exact when the dtypes match), not the ScalarE
        # activation that nl.copy names as an ISA ``op=`` (which computes in fp32).
        isa.tensor_copy(out, x)
    elif op.name == "sin":
        _range_reduced_sin(out, x)
    elif op.kind == "bitvec":  # invert: xor with all ones
        isa.tensor_scalar(out, x, ops.ALL["bitwise_xor"], -1)
    elif op.kind == "logical":
        isa.tensor_scalar(out, x, ops.ALL["equal"], 0.0)
    else:
        isa.activation(out, op, x)
    return out


def _range_reduced_sin(out: Tensor, x: Tensor) -> None:
    """``nl.sin``: bring x into [-pi, pi) first, as AWS's nl.sin does (nki.api.shared.rst, the note
    under the activation table): ScalarE's sin polynomial is only valid there and extrapolates a
    cubic outside it."""
    reduced = ndarray(x.shape, float32, buffer=sbuf)
    isa.tensor_scalar(reduced, x, ops.ALL["add"], _PI, op1=ops.ALL["mod"], operand1=2 * _PI)
    isa.tensor_scalar(reduced, reduced, ops.ALL["subtract"], _PI)
    isa.activation(out, ops.ALL["sin"], reduced)


_PI = float(np.float32(np.pi))


def _is_column(t: Tensor, parts: int) -> bool:
    return t.ndim >= 2 and t.shape[0] == parts and builtins.all(s == 1 for s in t.shape[1:])


def _column_operand(column: Tensor, op: ops.Op) -> Tensor:
    """tensor_scalar's arithmetic operators take fp32 vector operands: copy-cast others first."""
    if op.kind == "bitvec" or dtypes.name(column.dtype) == "float32":
        return column
    return _to_sbuf(column, float32)


def _binary(op: ops.Op, x: Any, y: Any, dtype: Any = None) -> Any:
    if not isinstance(x, Tensor) and not isinstance(y, Tensor):
        assert op.binary is not None  # apply_operator sends only operators with a binary form here
        return op.binary(np.float32(x), np.float32(y)).item()
    out_dtype = _promote(x, y) if dtype is None else dtype
    if not isinstance(y, Tensor) or not isinstance(x, Tensor):
        tile, scalar, reverse = (x, y, False) if isinstance(x, Tensor) else (y, x, True)
        out = ndarray(tile.shape, out_dtype, buffer=sbuf)
        isa.tensor_scalar(out, tile, op, float(scalar), reverse0=reverse)
        return out
    shape = np.broadcast_shapes(x.shape, y.shape)
    if x.shape == shape and y.shape != shape and _is_column(y, shape[0]):
        out = ndarray(shape, out_dtype, buffer=sbuf)
        isa.tensor_scalar(out, x, op, _column_operand(y, op))
        return out
    if y.shape == shape and x.shape != shape and _is_column(x, shape[0]):
        out = ndarray(shape, out_dtype, buffer=sbuf)
        isa.tensor_scalar(out, y, op, _column_operand(x, op), reverse0=True)
        return out
    out = ndarray(shape, out_dtype, buffer=sbuf)
    isa.tensor_tensor(out, x.broadcast_to(shape), y.broadcast_to(shape), op)
    return out


# Operators that compute on one tile although they also have a binary ALU form.
_UNARY_FORMS = ("abs", "rsqrt", "reciprocal", "square", "relu")


def apply_operator(op: ops.Op, x: Any, *rest: Any, dtype: Any = None) -> Any:
    """Calling an operator object: ``nl.exp(x)`` is an element-wise unary into a new SBUF tile,
    ``nl.add(a, b)`` a binary of two tiles (or a tile and a scalar / [P, 1] column)."""
    if op.binary is None or op.name in _UNARY_FORMS:
        if len(rest) > 1:
            raise TypeError(f"nl.{op.name} takes one tile (and dtype=), got {1 + len(rest)} positional arguments")
        return _unary(op, x, rest[0] if rest else dtype)
    if len(rest) not in (1, 2):
        raise TypeError(f"nl.{op.name} takes two operands (and dtype=), got {1 + len(rest)} positional arguments")
    return _binary(op, x, rest[0], rest[1] if len(rest) == 2 else dtype)


for _op in ops.ALL.values():
    globals()[_op.name] = _op
del _op


def where(condition: Tensor, x: Any, y: Any, dtype: Any = None) -> Tensor:
    """``x`` where ``condition`` is non-zero, else ``y``."""
    shape = condition.shape
    out = ndarray(shape, _promote(x, y) if dtype is None else dtype, buffer=sbuf)
    _assign(out, y)
    predicate = ndarray(shape, uint8, buffer=sbuf)
    isa.tensor_scalar(predicate, condition, ops.ALL["not_equal"], 0.0)
    isa.tensor_copy_predicated(
        out, x if not isinstance(x, Tensor) else _to_sbuf(x, out.dtype) if x.dtype != out.dtype else x, predicate
    )
    return out


# ---------------------------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------------------------
class _Reduction:
    """``nl.sum`` / ``nl.max`` / ...: a function, and also usable as the matching ALU ``op``."""

    def __init__(self, name: str, alu: str) -> None:
        self.name = name
        self.alu_op = ops.ALL[alu]

    def __call__(self, x: Tensor, axis: Any, dtype: Any = None, keepdims: bool = False) -> Tensor:
        axes = tuple(sorted(a % x.ndim for a in (axis if isinstance(axis, (list, tuple)) else [axis])))
        kept = (
            tuple(1 if d in axes else n for d, n in enumerate(x.shape))
            if keepdims
            else tuple(n for d, n in enumerate(x.shape) if d not in axes)
        )
        if len(kept) < 2:
            kept = kept + (1,) * (2 - len(kept))
        out = ndarray(kept, x.dtype if dtype is None else dtype, buffer=sbuf)
        if self.name != "mean":
            isa.tensor_reduce(out, self.alu_op, x, axes, keepdims=keepdims)
            return out
        # nl.mean keeps its intermediates in fp32 (its docstring): the sum is rounded once, after scaling.
        total = ndarray(kept, float32, buffer=sbuf)
        isa.tensor_reduce(total, self.alu_op, x, axes, keepdims=keepdims)
        count = int(np.prod([x.shape[a] for a in axes]))
        isa.tensor_scalar(out, total, ops.ALL["multiply"], 1.0 / count)
        return out

    def __repr__(self) -> str:
        return f"nl.{self.name}"


sum = _Reduction("sum", "add")  # noqa: A001  (NKI's names)
max = _Reduction("max", "maximum")  # noqa: A001
min = _Reduction("min", "minimum")  # noqa: A001
prod = _Reduction("prod", "multiply")
mean = _Reduction("mean", "add")


def _free_axes(x: Tensor, axis: Any, what: str) -> tuple[int, ...]:
    """``axis`` (an int or a list) as sorted dims: free dims only, the last contiguous ones."""
    axes = tuple(sorted({int(a) % x.ndim for a in (axis if isinstance(axis, (list, tuple)) else [axis])}))
    if x.ndim < 2 or 0 in axes or axes != tuple(range(axes[0], x.ndim)):
        raise rule(
            what, "axis", "must be the last contiguous free dims ([1], [1, 2], ...)", axis=axes, shape=list(x.shape)
        )
    return axes


def _kept_slices(x: Tensor, axes: tuple[int, ...]) -> Iterator[tuple[Any, ...]]:
    """Index tuples that cut ``x`` into [P, *reduced dims] pieces, one per kept free position."""
    for position in np.ndindex(*x.shape[1 : axes[0]]):
        yield (slice(None),) + position


def softmax(x: Tensor, axis: Any = -1, dtype: Any = None) -> Tensor:
    """Numerically stable softmax over ``axis`` (the last free dims): max, exp(x - max) with sum, scale.

    Kept free dims before the reduced ones are handled one [P, reduced...] piece at a time.
    """
    axes = _free_axes(x, axis, "nl.softmax")
    out = ndarray(x.shape, x.dtype if dtype is None else dtype, buffer=sbuf)
    parts = x.partition_size
    for index in _kept_slices(x, axes):
        piece, result = x[index], out[index]
        row_max = ndarray((parts, 1), float32, buffer=sbuf)
        isa.tensor_reduce(row_max, ops.ALL["maximum"], piece, tuple(range(1, piece.ndim)), negate=True)
        total = ndarray((parts, 1), float32, buffer=sbuf)
        isa.activation_reduce(result, ops.ALL["exp"], piece, ops.ALL["add"], total, bias=row_max)
        inverse = ndarray((parts, 1), float32, buffer=sbuf)
        isa.reciprocal(inverse, total)
        isa.tensor_scalar(result, result, ops.ALL["multiply"], inverse)
    return out


def _keepdims_shape(x: Tensor, axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if d in axes else n for d, n in enumerate(x.shape))


def var(x: Tensor, axis: Any, dtype: Any = None, keepdims: bool = False) -> Tensor:
    """Population variance over ``axis`` (the last free dims); the result always keeps the reduced dims
    as size one, as AWS documents (``keepdims`` is accepted and ignored)."""
    axes = _free_axes(x, axis, "nl.var")
    parts = x.partition_size
    count = int(np.prod([x.shape[a] for a in axes]))
    out = ndarray(_keepdims_shape(x, axes), x.dtype if dtype is None else dtype, buffer=sbuf)
    for index in _kept_slices(x, axes):
        piece = x[index]
        neg_mean = ndarray((parts, 1), float32, buffer=sbuf)
        isa.tensor_reduce(neg_mean, ops.ALL["add"], piece, tuple(range(1, piece.ndim)), negate=True)
        isa.tensor_scalar(neg_mean, neg_mean, ops.ALL["multiply"], 1.0 / count)
        squares = ndarray(piece.shape, float32, buffer=sbuf)
        square_sum = ndarray((parts, 1), float32, buffer=sbuf)
        isa.activation_reduce(squares, ops.ALL["square"], piece, ops.ALL["add"], square_sum, bias=neg_mean)
        isa.tensor_scalar(out[index].reshape((parts, 1)), square_sum, ops.ALL["multiply"], 1.0 / count)
    return out


def all(x: Tensor, axis: Any, dtype: Any = None) -> Tensor:  # noqa: A001  (NKI's name)
    """1 where every element along ``axis`` (the last free dims) is non-zero, else 0."""
    axes = _free_axes(x, axis, "nl.all")
    nonzero = ndarray(x.shape, float32, buffer=sbuf)
    isa.tensor_scalar(nonzero, x, ops.ALL["not_equal"], 0.0)
    return min(nonzero, list(axes), dtype=x.dtype if dtype is None else dtype)


def rms_norm(
    x: Tensor, w: Tensor, axis: Any, n: int, epsilon: float = 1e-6, dtype: Any = None, compute_dtype: Any = None
) -> Tensor:
    """``x / sqrt(sum(x**2 over axis) / n + epsilon) * w``; intermediates in ``compute_dtype`` (fp32 by default)."""
    axes = _free_axes(x, axis, "nl.rms_norm")
    work = float32 if compute_dtype is None else compute_dtype
    parts = x.partition_size
    out = ndarray(x.shape, x.dtype if dtype is None else dtype, buffer=sbuf)
    weight = w if w.shape == x.shape else w.broadcast_to(x.shape)
    for index in _kept_slices(x, axes):
        piece = x[index]
        squares = ndarray(piece.shape, work, buffer=sbuf)
        square_sum = ndarray((parts, 1), float32, buffer=sbuf)
        isa.activation_reduce(squares, ops.ALL["square"], piece, ops.ALL["add"], square_sum)
        inverse_rms = ndarray((parts, 1), float32, buffer=sbuf)
        isa.tensor_scalar(
            inverse_rms, square_sum, ops.ALL["multiply"], 1.0 / int(n), op1=ops.ALL["add"], operand1=float(epsilon)
        )
        isa.activation(inverse_rms, ops.ALL["rsqrt"], inverse_rms)
        scaled = ndarray(piece.shape, work, buffer=sbuf)
        isa.tensor_scalar(scaled, piece, ops.ALL["multiply"], inverse_rms)
        isa.tensor_tensor(out[index], scaled, weight[index], ops.ALL["multiply"])
    return out


def gather_flattened(data: Tensor, indices: Tensor, axis: int = 0, dtype: Any = None) -> Tensor:
    """Per partition, the elements of ``data``'s flattened free dims at ``indices`` (GpSimd's gather).

    The result has ``indices``' shape. Indices are read as uint32, so another integer index tile is
    first copied to uint32.
    """
    if int(axis) != 0:
        raise rule("nl.gather_flattened", "axis", "only axis 0 (gather within each partition) is supported", axis=axis)
    if dtypes.name(indices.dtype) != "uint32":
        indices = _to_sbuf(indices, uint32)
    gathered = ndarray(indices.shape, data.dtype, buffer=sbuf)
    isa.nc_n_gather(gathered, data, indices)
    if dtype is None or dtypes.canonical(dtype) == data.dtype:
        return gathered
    return _to_sbuf(gathered, dtype)


def random_seed(seed: Tensor) -> None:
    """Seed the random numbers of ``nl.rand`` (and ``nisa.rng``) from a [1, 1] 32-bit tile."""
    isa.set_rng_seed(seed)


# nl.rand keeps 24 random bits: the fraction bits * 2**-24 is exact in fp32 and always below 1.
_RAND_FRACTION_BITS = 24


def rand(shape: Sequence[int], dtype: Any, buffer: str | None = None, name: str = "") -> Tensor:
    """A new tile of uniform random values in [0, 1): ``nisa.rng`` bits scaled on VectorE.

    The simulator's generator is deterministic per seed but is not the device's bit stream.
    """
    bits = ndarray(shape, uint32, buffer=sbuf)
    isa.rng(bits)
    isa.tensor_scalar(bits, bits, ops.ALL["right_shift"], 32 - _RAND_FRACTION_BITS)
    buffer = sbuf if buffer is None else buffer
    out = ndarray(shape, dtype, buffer=buffer if buffer in runtime.ON_CHIP else sbuf, name=name)
    isa.tensor_scalar(out, bits, ops.ALL["multiply"], 2.0**-_RAND_FRACTION_BITS)
    if buffer in runtime.ON_CHIP:
        return out
    stored = ndarray(shape, dtype, buffer=buffer, name=name)
    isa.dma_copy(stored, out)
    return stored


def dropout(x: Tensor, rate: Any, dtype: Any = None) -> Tensor:
    """Zero each element with probability ``rate``."""
    out = ndarray(x.shape, x.dtype if dtype is None else dtype, buffer=sbuf)
    isa.dropout(out, x if out.dtype == x.dtype else _to_sbuf(x, out.dtype), rate)
    return out


# ---------------------------------------------------------------------------------------------
# views as functions
# ---------------------------------------------------------------------------------------------
def expand_dims(x: Tensor, axis: int) -> Tensor:
    return x.expand_dims(axis)


def broadcast_to(x: Tensor, shape: Sequence[int], dtype: Any = None) -> Tensor:
    """``x`` broadcast to ``shape`` (same rank, NumPy's rules), cast to ``dtype`` when given.

    Free dims broadcast as a view, which the consuming instruction reads at no cost. A one-partition
    on-chip tile broadcast over M partitions becomes a new tile, made the way AWS's architecture guide
    says NKI lowers it: ``nc_matmul(ones[1, M], x, is_stationary_onezero=True)`` on TensorE into PSUM (at
    most 512 columns a matmul), then a copy into SBUF. (An ISA operand view itself can never broadcast
    the partition dim; ``NkiTensor.broadcast_to`` refuses it.)
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) != x.ndim:
        raise ValueError(f"nl.broadcast_to: shape {list(shape)} must have the rank of x {list(x.shape)}")
    if x.on_chip and shape[0] != x.shape[0]:
        if x.shape[0] != 1:
            raise ValueError(f"nl.broadcast_to: cannot broadcast {list(x.shape)} to {list(shape)}")
        limit = runtime.current().target.partitions
        if shape[0] > limit:
            raise rule(
                "nl.broadcast_to",
                "shape",
                "partition dim exceeds the partition count",
                partitions=shape[0],
                limit=limit,
            )
        x = _broadcast_partitions(x, shape[0], x.dtype if dtype is None else dtype)
    elif dtype is not None and dtypes.canonical(dtype) != x.dtype:
        x = _to_sbuf(x, dtype)
    return x if x.shape == shape else x.broadcast_to(shape)


def _broadcast_partitions(x: Tensor, partitions: int, dtype: Any) -> Tensor:
    """A new SBUF tile with ``x``'s single partition on each of ``partitions`` partitions (TensorE)."""
    # TensorE multiplies float dtypes (1.0 * x is exact in each); integers go through fp32, exact below 2**24.
    operand_dtype = x.dtype if dtypes.is_float(x.dtype) else float32
    if x.buffer != sbuf or x.dtype != operand_dtype or not x.is_contiguous():
        x = _to_sbuf(x, operand_dtype)  # TensorE reads a contiguous SBUF row
    row = x.reshape((1, x.free_size))
    ones_row = ones((1, partitions), operand_dtype, buffer=sbuf)
    out = ndarray((partitions,) + x.shape[1:], dtype, buffer=sbuf)
    flat = out.reshape((partitions, x.free_size))
    step = runtime.current().target.gemm_moving_fmax
    for start in range(0, x.free_size, step):
        stop = builtins.min(start + step, x.free_size)
        product = ndarray((partitions, stop - start), float32, buffer=psum)
        isa.nc_matmul(product, ones_row, row[:, start:stop], is_stationary_onezero=True, accumulate=False)
        isa.tensor_copy(flat[:, start:stop], product)
    return out


frontend.register(sys.modules[__name__])
