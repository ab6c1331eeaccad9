"""The instruction rules of tensor indirection (``NkiTensor.indirect``, NeuronCore-v4): which operands of
which instructions take an ``.indirect(index)`` view, the engines they may then run on, and where the
views and their indices must start (the "Tensor indirection" paragraphs of each ``nki.isa`` docstring).

The view itself, and the gather/scatter it performs, is :class:`~.tensor.Columns`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from . import dtypes, runtime
from .errors import require_generation, rule
from .memory import QUADRANT
from .tensor import Tensor

# Partitions that share one column of offsets: 16 on the Vector/Scalar/GpSimd engines, 32 on TensorE.
GROUP_PARTITIONS = {"tensor": 32}
DEFAULT_GROUP_PARTITIONS = 16
# nc_matmul: "The indirect operands must be a Tensor-Engine float dtype".
MATMUL_DTYPES = frozenset({"float16", "bfloat16", "float8_e4m3", "float8_e5m2", "float8_e4m3fn"})
# Inputs that must start on the same partition as their index ("if src uses .indirect(), src starts on the
# same partition as its index", and likewise data, data1, predicate, stationary, moving); nc_matmul_mx's
# scales share their data's index and have no such rule.
ALIGNED_INPUTS = frozenset({"src", "data", "data1", "predicate", "stationary", "moving"})

# Instruction -> (operands that accept an .indirect() view, engines it may run on when one does).
OPERANDS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "nisa.tensor_copy": (frozenset({"dst", "src"}), ("vector", "scalar")),
    "nisa.tensor_copy_predicated": (frozenset({"dst", "predicate"}), ("vector",)),
    "nisa.nc_matmul": (frozenset({"dst", "stationary", "moving"}), ("tensor",)),
    "nisa.nc_matmul_mx": (
        frozenset({"dst", "stationary", "moving", "stationary_scale", "moving_scale"}),
        ("tensor",),
    ),
    "nisa.tensor_tensor": (frozenset({"dst", "data1"}), ("vector", "gpsimd")),
    "nisa.tensor_scalar": (frozenset({"dst", "data"}), ("vector", "scalar", "gpsimd")),
    "nisa.tensor_reduce": (frozenset({"dst", "data"}), ("vector",)),
    "nisa.tensor_scalar_cumulative": (frozenset({"dst", "src"}), ("vector",)),
    "nisa.activation": (frozenset({"dst", "data"}), ("scalar",)),
    "nisa.activation_reduce": (frozenset({"dst", "data"}), ("scalar",)),
    "nisa.activate2": (frozenset({"dst", "data"}), ("scalar",)),
    "nisa.exponential": (frozenset({"dst", "src"}), ("vector",)),
    "nisa.tensor_scalar_reduce": (frozenset({"dst", "data"}), ("vector",)),
}


def check_accepted(t: Tensor, instr: str, role: str) -> None:
    """``t``, an ``.indirect()`` view, only where the instruction's docstring lists the operand."""
    accepted = OPERANDS.get(instr)
    if accepted is None or role not in accepted[0]:
        raise rule(
            instr,
            role,
            "does not support tensor indirection (an .indirect() view)",
            supported="/".join(sorted(accepted[0])) if accepted else "none",
        )


def bind(t: Tensor, instr: str, role: str, engine: str) -> Tensor:
    """Check an operand that may be an ``.indirect()`` view (``operands.tile`` has already checked the
    instruction accepts it there) and fix its partition group to the engine that runs the instruction;
    other operands pass through unchanged."""
    columns = t._columns
    if columns is None:
        return t
    target = runtime.current().target
    require_generation(instr, role, target, 4, "tensor indirection")
    engines = OPERANDS[instr][1]
    if engine not in engines:
        raise rule(instr, "engine", "with tensor indirection it runs on " + "/".join(engines) + " only", engine=engine)
    index_start = columns.index.start_partition
    if index_start % QUADRANT:
        raise rule(instr, f"{role} index", "must start on a quadrant boundary (a multiple of 32)", start=index_start)
    if role in ALIGNED_INPUTS and t.start_partition != index_start:
        raise rule(
            instr,
            role,
            "an indirect input starts on the same partition as its index",
            start=t.start_partition,
            index_start=index_start,
        )
    if role == "dst" and engine == "scalar" and t.buffer == "psum":
        raise rule(instr, "dst", "on the Scalar engine a scattered dst cannot be in PSUM")
    if instr == "nisa.nc_matmul" and dtypes.name(t.dtype) not in MATMUL_DTYPES:
        raise rule(
            instr,
            role,
            "an indirect operand must be a Tensor-Engine float dtype",
            dtype=dtypes.name(t.dtype),
            allowed="/".join(sorted(MATMUL_DTYPES)),
        )
    group = GROUP_PARTITIONS.get(engine, DEFAULT_GROUP_PARTITIONS)
    index = columns.index
    if columns.num_elem > group * index.free_size:
        raise rule(
            instr,
            f"{role} index",
            "num_elem exceeds the offsets one partition group holds (group partitions x index columns)",
            num_elem=columns.num_elem,
            limit=group * index.free_size,
            group=group,
        )
    rows_needed = min(group, columns.num_elem)
    last_group = (index.partition_size - 1) // group * group
    if last_group + rows_needed > index.partition_size:
        raise rule(
            instr,
            f"{role} index",
            "the last partition group has fewer index rows than its offsets need",
            partitions=index.partition_size,
            group=group,
            rows_needed=rows_needed,
        )
    bound = replace(columns, instruction=instr, role=role, group=group)
    return Tensor(t._buf, t._view, t._dtype, columns=bound)


def check_lanes(instr: str, dst: Tensor, in_role: str, src: Tensor) -> None:
    """Where a scattered ``dst``'s index starts, against the instruction's input ``src`` (the partitions the
    data comes from): ``src``'s own start when it is in SBUF, ``src``'s index when both are indirect in PSUM."""
    if dst._columns is None:
        return
    dst_index = dst._columns.index.start_partition
    if src.buffer == "sbuf" and dst_index != src.start_partition:
        raise rule(
            instr,
            "dst index",
            f"must start on the same partition as {in_role}",
            dst_index_start=dst_index,
            **{f"{in_role}_start": src.start_partition},
        )
    if src.buffer == "psum" and src._columns is not None:
        src_index = src._columns.index.start_partition
        if dst_index != src_index:
            raise rule(
                instr,
                "dst index",
                f"must start on the same partition as {in_role}'s index",
                dst_index_start=dst_index,
                **{f"{in_role}_index_start": src_index},
            )


def check_untiled(instr: str, tile_position: Sequence[Any] | None) -> None:
    """Tensor indirection is incompatible with TensorE tiling: ``tile_position`` unset or ``(0, 0)``."""
    if tile_position and tuple(int(v) for v in tile_position) != (0, 0):
        raise rule(
            instr,
            "tile_position",
            "must be (0, 0) or unset with tensor indirection (incompatible with hardware tiling)",
            tile_position=tuple(tile_position),
        )


def uses_indirection(*tensors: object) -> bool:
    """Whether any of these operands is an ``.indirect()`` view."""
    for t in tensors:  # a loop, not any() over a generator: every matmul asks
        if isinstance(t, Tensor) and t._columns is not None:
            return True
    return False


def same_index(a: Tensor, b: Tensor) -> bool:
    """Whether two ``.indirect()`` views read their offsets from the same index tile."""
    ca, cb = a._columns, b._columns
    if ca is None or cb is None:
        return ca is None and cb is None
    return (
        ca.index._buf is cb.index._buf and ca.index.region() == cb.index.region() and ca.index.shape == cb.index.shape
    )
