"""Operand checks of the ``nki.isa`` instructions and the limits they enforce: buffers, partitions and
their start alignment, free sizes per buffer, access-pattern dims, engine access rules. Each raises
``NkiValidationError`` naming the instruction, the operand and the limit (``errors.rule``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import dtypes, indirection, runtime
from .enums import engine
from .errors import rule
from .tensor import Tensor

FP32_MIN = float(np.finfo(np.float32).min)
VECTOR_FREE_MAX_SBUF = 64 * 1024  # elements per partition one VectorE/ScalarE access may span
VECTOR_FREE_MAX_PSUM = 4 * 1024
ACCESS_PATTERN_MAX_FREE_DIMS = 4
BN_STATS_FMAX = 512
MAX8_MIN, MAX8_MAX = 8, 16384
PE_ARRAY = 128
VECTOR_TRANSPOSE_MAX = 32


def tile(x: Any, instr: str, role: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise rule(instr, role, f"expected an NKI tensor, got {type(x).__name__}")
    if x._indirect is not None and instr not in ("nisa.dma_copy", "nisa.dma_transpose", "nisa.dma_compute"):
        raise rule(instr, role, "indirect (vector_offset) access patterns are only for DMA instructions")
    if x._columns is not None:
        indirection.check_accepted(x, instr, role)
    return x


def where(t: Tensor, instr: str, role: str, allowed: Sequence[str]) -> None:
    kind = "hbm" if t.buffer in runtime.HBM_KINDS else t.buffer
    if kind not in allowed:
        raise rule(instr, role, f"must be in {'/'.join(a.upper() for a in allowed)}, not {t.buffer.upper()}")


def compute_tile(t: Any, instr: str, role: str, eng: str, allowed: Sequence[str] = ("sbuf", "psum")) -> Tensor:
    """Checks for an operand a compute engine reads or writes (an ``.indirect()`` view comes back bound to
    the engine's partition groups)."""
    if type(t) is not Tensor or t._indirect is not None or t._columns is not None:  # the uncommon operands
        t = tile(t, instr, role)
        if t._columns is not None:
            t = indirection.bind(t, instr, role, eng)
    kind = t._buf.kind
    if kind not in allowed:  # where() maps the HBM kinds to "hbm"
        where(t, instr, role, allowed)
    if eng == "gpsimd" and kind == "psum":
        raise rule(instr, role, "the GpSimd engine cannot access PSUM")
    parts = t.partition_size
    if parts > PE_ARRAY:  # every generation has 128 partitions
        raise rule(instr, role, "partition dim exceeds the partition count", partitions=parts, limit=PE_ARRAY)
    # Start partitions by access size: trainium_inferentia2_arch.rst, "start_partition must be ...".
    start = t.start_partition
    if parts > 64 and start != 0:
        raise rule(
            instr,
            role,
            "an access over more than 64 partitions must start at partition 0",
            start_partition=start,
            partitions=parts,
        )
    if 32 < parts <= 64 and start not in (0, 64):
        raise rule(
            instr,
            role,
            "an access over 33-64 partitions must start at partition 0 or 64",
            start_partition=start,
            partitions=parts,
        )
    if parts <= 32 and start % 32:
        raise rule(
            instr,
            role,
            "an access over at most 32 partitions must start at partition 0, 32, 64 or 96",
            start_partition=start,
            partitions=parts,
        )
    limit = VECTOR_FREE_MAX_PSUM if kind == "psum" else VECTOR_FREE_MAX_SBUF
    if eng in ("vector", "scalar", "gpsimd") and t.free_size > limit:
        raise rule(
            instr,
            role,
            f"free size exceeds the {kind.upper()} per-instruction limit",
            free_elements=t.free_size,
            limit=limit,
        )
    dims = free_pattern_dims(t) if t._view.ndim > ACCESS_PATTERN_MAX_FREE_DIMS + 1 else 0
    if dims > ACCESS_PATTERN_MAX_FREE_DIMS:
        raise rule(
            instr,
            role,
            "access pattern has too many free dimensions",
            free_dims=dims,
            limit=ACCESS_PATTERN_MAX_FREE_DIMS,
        )
    return t


def free_pattern_dims(t: Tensor) -> int:
    """Free dims of the access pattern after merging dims that are contiguous with each other."""
    shape, strides = t._view.shape[1:], t._view.strides[1:]
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    merged = 0
    for i, (_, s) in enumerate(dims):
        if i + 1 < len(dims) and s == dims[i + 1][0] * dims[i + 1][1]:
            continue
        merged += 1
    return merged


def same_layout(instr: str, a_role: str, a: Tensor, b_role: str, b: Tensor) -> None:
    if a.partition_size != b.partition_size or a.free_size != b.free_size:
        raise rule(
            instr,
            f"{a_role}/{b_role}",
            "must have the same partitions and elements per partition",
            **{a_role: list(a.shape), b_role: list(b.shape)},
        )


def not_both_psum(instr: str, a_role: str, a: Any, b_role: str, b: Any) -> None:
    if isinstance(a, Tensor) and isinstance(b, Tensor) and a.buffer == "psum" and b.buffer == "psum":
        raise rule(instr, f"{a_role}/{b_role}", "cannot both be in PSUM")


def rows(t: Tensor) -> np.ndarray:
    """Values widened to fp32 (ints to int64), shaped [partitions, free]."""
    values = dtypes.to_engine(np.asarray(t.read()))
    return values.reshape(t.partition_size, -1) if t.on_chip else values.reshape(1, -1)


def scalar_or_vector(x: Any, instr: str, role: str, parts: int, eng: str) -> np.ndarray | float:
    """A compile-time scalar, or a [P, 1] tile broadcast along the free dim."""
    check_scalar_or_vector(x, instr, role, parts, eng)
    return scalar_or_vector_values(x)


def check_scalar_or_vector(x: Any, instr: str, role: str, parts: int, eng: str) -> None:
    """The checks of :func:`scalar_or_vector` alone (a trace-only run reads no values)."""
    if isinstance(x, Tensor):
        compute_tile(x, instr, role, eng)
        if x.partition_size != parts or x.free_size != 1:
            raise rule(
                instr, role, "a vector operand must have shape (partitions, 1)", shape=list(x.shape), partitions=parts
            )
    elif not isinstance(x, (bool, int, float, np.integer, np.floating)):
        raise rule(instr, role, f"expected a scalar or a (P, 1) tile, got {type(x).__name__}")


def scalar_or_vector_values(x: Any) -> np.ndarray | float:
    """The values of an operand :func:`check_scalar_or_vector` accepted."""
    return rows(x) if isinstance(x, Tensor) else float(x)


def engine_for(requested: Any, instr: str, allowed: Sequence[str], default: str) -> str:
    if requested is engine.unknown or requested is None:  # the default: no enum conversion (a hot path)
        return default
    name = engine(requested).name
    if name == "unknown":
        return default
    if name not in allowed:
        raise rule(instr, "engine", f"{name} cannot run this instruction", allowed="/".join(allowed))
    return name


def reads(**operands: Any) -> list[tuple[str, Tensor]]:
    return [(role, t) for role, t in operands.items() if isinstance(t, Tensor)]


def is_int(t: Tensor) -> bool:
    return dtypes.is_int(t.dtype)
