"""``nki.isa``: NeuronCore instructions, executed eagerly on NumPy and checked against the hardware.

Each instruction validates its operands (buffers, partitions, free sizes, dtypes, engine
access rules) with an error naming the instruction, the operand and the limit; computes in
fp32 as the engines do; rounds on write to the destination dtype; and appends one record to
the run's trace.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import dtypes, indirection, operands, prng, runtime
from . import enums as constants  # noqa: F401  (nki.isa.constants: the enums, as nki-library imports them)
from .cores import core_barrier, sendrecv
from .enums import (  # noqa: F401
    dependency,
    dge_mode,
    dma_engine,
    engine,
    gpsimd_engine,
    matmul_perf_mode,
    nc_version,
    oob_mode,
    reduce_cmd,  # (nisa.vector_engine ...)
    scalar_engine,
    tensor_engine,
    unknown_engine,
    vector_engine,
)
from .errors import (
    AccumulateOntoNonMatmulWarning,
    AccumulateUninitializedWarning,
    NkiValidationError,
    require_generation,
    rule,
    too_old,
)
from .gpsimd import local_gather, nonzero_with_count, sequence_bounds, topk
from .mx import nc_matmul_mx, quantize_mx
from .ops import ALL as _OPS
from .ops import BYPASS, Op, as_activation, as_alu
from .prng import rand_get_state, rand_set_state
from .tensor import Tensor, innermost_run
from .trace import Instruction

__all__ = [
    "engine",
    "reduce_cmd",
    "dge_mode",
    "oob_mode",
    "matmul_perf_mode",
    "nc_version",
    "dma_engine",
    "NkiValidationError",
    "NkiInstruction",
    "VirtualRegister",
    "get_nc_version",
    "get_nc_sub_version",
    "dma_copy",
    "dma_transpose",
    "tensor_copy",
    "tensor_copy_predicated",
    "memset",
    "nc_matmul",
    "nc_transpose",
    "tensor_tensor",
    "tensor_scalar",
    "scalar_tensor_tensor",
    "reciprocal",
    "tensor_reduce",
    "tensor_scalar_reduce",
    "tensor_partition_reduce",
    "tensor_tensor_scan",
    "tensor_scalar_cumulative",
    "activation",
    "activation_reduce",
    "activate2",
    "iota",
    "affine_select",
    "range_select",
    "select_reduce",
    "max8",
    "nc_find_index8",
    "nc_match_replace8",
    "nc_n_gather",
    "nc_stream_shuffle",
    "bn_stats",
    "bn_aggr",
    "exponential",
    "rng",
    "rand2",
    "set_rng_seed",
    "dropout",
    "dma_compute",
    "register_alloc",
    "register_move",
    "register_load",
    "register_store",
    "local_gather",
    "sequence_bounds",
    "nonzero_with_count",
    "topk",
    "rand_set_state",
    "rand_get_state",
    "quantize_mx",
    "nc_matmul_mx",
    "sendrecv",
    "core_barrier",
]


# Instruction parameters share these enums' names; inside the functions use the aliases.
_DGE, _OOB, _CMD = dge_mode, oob_mode, reduce_cmd


def get_nc_version() -> nc_version:
    """The NeuronCore generation of the running kernel's target."""
    return nc_version(runtime.current().target.nc_version)


# ---------------------------------------------------------------------------------------------
# data movement
# ---------------------------------------------------------------------------------------------
def _dma_read(src: Tensor, instr: str, skip: bool) -> tuple[np.ndarray, np.ndarray | None]:
    if src._indirect is None:
        return np.asarray(src.read()), None
    flat = src._buf.data.reshape(-1)
    offsets, inside = src._indirect.flat_offsets(flat.size, instr, skip)
    return flat[np.where(inside, offsets, 0)], inside


def _dma_write(dst: Tensor, values: np.ndarray, instr: str, skip: bool, keep: np.ndarray | None) -> None:
    values = dtypes.cast(values.astype(np.float32) if values.dtype != dtypes.storage(dst.dtype) else values, dst.dtype)
    if dst._indirect is None:
        if keep is not None and not keep.all():
            current = np.asarray(dst.read()).reshape(values.shape)
            values = np.where(keep, values, current)
        dst.write(values.reshape(dst.shape), instr)
        return
    flat = dst._buf.data.reshape(-1)
    offsets, inside = dst._indirect.flat_offsets(flat.size, instr, skip)
    flat[offsets[inside]] = values.reshape(offsets.shape)[inside]


def _indices_computed(run: Any, *tensors: Tensor) -> bool:
    """Whether every gather/scatter index of these accesses holds values the run computed."""
    return all(run.computed(t._indirect.index._buf) for t in tensors if t._indirect is not None)


def _dma_uncomputed(dst: Tensor, src: Tensor, instr: str, skip: bool) -> None:
    """A trace-only DMA of uncomputed data, or through uncomputed indices: the index checks of an
    indirect access whose indices are known, no values. (An indirect access is recorded as touching its
    whole allocation, so the trace does not depend on the indices; only their bounds go unchecked.)"""
    run = runtime.current()
    for t in (src, dst):
        if t._indirect is not None and _indices_computed(run, t):
            t._indirect.check_bounds(t._buf.data.size, instr, skip)
    dst.write_uncomputed(instr)


def _contiguous_bytes(t: Tensor) -> int:
    """Bytes in the innermost contiguous run of an access: what one DMA descriptor moves (for a
    gather/scatter, the run within one indexed row)."""
    if t._indirect is not None:
        return t._indirect.contiguous_elements() * dtypes.itemsize(t.dtype)
    return innermost_run(t._view.shape, t._view.strides, t._view.itemsize)


def dma_copy(
    dst: Tensor,
    src: Tensor,
    priority: Any = None,
    oob_mode: oob_mode = oob_mode.error,
    dge_mode: dge_mode = dge_mode.unknown,
    engine: engine = engine.unknown,
    name: str | None = None,
) -> None:
    """Copy ``src`` to ``dst`` with a DMA engine (HBM or SBUF on either side), casting via fp32."""
    instr = "nisa.dma_copy"
    dge_mode, oob_mode = _DGE(dge_mode), _OOB(oob_mode)
    dst, src = operands.tile(dst, instr, "dst"), operands.tile(src, instr, "src")
    run = runtime.current()
    queue = _hwdge_engine(instr, engine, dge_mode)
    for role, t in (("dst", dst), ("src", src)):
        operands.where(t, instr, role, ("hbm", "sbuf"))
        _check_indirect_dma(instr, role, t, dge_mode)
        if t.on_chip and t.partition_size > run.target.partitions:
            raise rule(instr, role, "partition dim exceeds the partition count", partitions=t.partition_size)
    if dst.size != src.size:
        raise rule(instr, "dst/src", "element counts differ", dst=list(dst.shape), src=list(src.shape))
    if dge_mode == _DGE.hwdge and not run.target.has_hwdge:
        raise too_old(instr, "dge_mode", run.target.name, 3, "hardware DGE")
    skip = oob_mode == _OOB.skip
    if run.numerics or (run.computed(src._buf) and _indices_computed(run, src, dst)):
        # Data movement stays exact in a trace-only run wherever its source and indices are: a
        # kernel's inputs reach the registers and indices it reads while tracing.
        values, inside = _dma_read(src, instr, skip)
        if src.dtype != dst.dtype:
            values = dtypes.to_engine(values)
        _dma_write(dst, values, instr, skip, inside)
    else:
        _dma_uncomputed(dst, src, instr, skip)
    parts = (dst if dst.on_chip else src).partition_size  # 1 for HBM on both sides
    hbm_side = src if not src.on_chip else dst
    run.record(
        "dma",
        "dma_copy",
        reads=[("src", src)],
        writes=[("dst", dst)],
        bytes_moved=dst.nbytes,
        partitions=parts,
        bytes_per_partition=dst.nbytes // max(parts, 1),
        contiguous_bytes=_contiguous_bytes(hbm_side),
        dge_mode=dge_mode.name,
        dge_engine=queue,
    )


def _hwdge_engine(instr: str, requested: Any, mode: dge_mode) -> str:
    """dma_copy's ``engine=``: the sequencer (sync or scalar) that drives hardware DGE, only with
    ``dge_mode=hwdge`` (nki.isa.dma_copy's docstring, ``engine`` parameter)."""
    name = engine(requested if requested is not None else engine.unknown).name
    if name == "unknown":
        return name
    if mode != _DGE.hwdge:
        raise rule(instr, "engine", "only valid with dge_mode=hwdge", engine=name, dge_mode=mode.name)
    if name not in ("sync", "scalar"):
        raise rule(instr, "engine", "hardware DGE is driven by the sync or scalar engine", engine=name)
    return name


def _check_indirect_dma(instr: str, role: str, t: Tensor, mode: dge_mode) -> None:
    """Gather/scatter (a vector_offset access pattern) is software DGE work on an HBM tensor
    (nki.isa.dma_copy's docstring: "When sw_dge is selected ... gather or scatter";
    "The tensor being indexed ... must be in HBM")."""
    if t._indirect is None:
        return
    if t.buffer not in runtime.HBM_KINDS:
        raise rule(instr, role, "an indirect (vector_offset) access must index an HBM tensor", buffer=t.buffer)
    if mode not in (_DGE.swdge, _DGE.unknown):
        raise rule(instr, "dge_mode", "indirect (vector_offset) access needs software DGE", dge_mode=mode.name)


_DMA_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(
    dst: Tensor,
    src: Tensor,
    axes: Sequence[int] | None = None,
    priority: Any = None,
    dge_mode: dge_mode = dge_mode.unknown,
    oob_mode: oob_mode = oob_mode.error,
    name: str | None = None,
) -> None:
    """Transpose with the DMA engine: ``(1, 0)``, ``(2, 1, 0)`` or ``(3, 1, 2, 0)`` of 2-byte data."""
    instr = "nisa.dma_transpose"
    dge_mode, oob_mode = _DGE(dge_mode), _OOB(oob_mode)
    dst, src = operands.tile(dst, instr, "dst"), operands.tile(src, instr, "src")
    operands.where(dst, instr, "dst", ("sbuf",))
    operands.where(src, instr, "src", ("hbm", "sbuf"))
    if src.dtype != dst.dtype:
        raise rule(
            instr, "dst", "must have the same dtype as src", dst=dtypes.name(dst.dtype), src=dtypes.name(src.dtype)
        )
    if (dge_mode == _DGE.hwdge or src._indirect is not None) and dtypes.itemsize(src.dtype) != 2:
        # AWS's API reference limits the hardware-DGE and the indirect (gather) transposes to 2-byte
        # dtypes; it states no dtype limit for a direct transpose by the default DGE mode.
        raise rule(
            instr,
            "src",
            "hardware-DGE and indirect DMA transposes move 2-byte dtypes only",
            dtype=dtypes.name(src.dtype),
        )
    expected = _DMA_TRANSPOSE_AXES.get(src.ndim)
    axes = tuple(axes) if axes is not None else expected
    if expected is None or axes != expected:
        raise rule(
            instr, "axes", "supported permutations are (1, 0), (2, 1, 0) and (3, 1, 2, 0)", axes=axes, src_ndim=src.ndim
        )
    _check_transpose_dge(instr, src, dge_mode, runtime.current().target)
    skip = oob_mode == _OOB.skip
    if skip and src._indirect is None:  # the docstring: "Only valid when src uses indirect indexing"
        raise rule(instr, "oob_mode", "skip is only valid when src uses indirect indexing", oob_mode=oob_mode.name)
    if src.size != dst.size:
        raise rule(
            instr,
            "dst",
            "element count differs from the transposed src",
            dst=list(dst.shape),
            transposed=[src.shape[a] for a in axes],
        )
    run = runtime.current()
    if run.numerics or (run.computed(src._buf) and _indices_computed(run, src)):  # exact (see dma_copy)
        values, inside = _dma_read(src, instr, skip)
        values = np.transpose(values.reshape(src.shape), axes)
        if inside is not None and not inside.all():
            # oob_mode=skip: elements gathered through an out-of-bounds index leave dst as it was.
            keep = np.transpose(inside.reshape(src.shape), axes).reshape(dst.shape)
            values = np.where(keep, values.reshape(dst.shape), np.asarray(dst.read()))
        dst.write(values.reshape(dst.shape), instr)
    else:
        _dma_uncomputed(dst, src, instr, skip)
    run.record(
        "dma",
        "dma_transpose",
        reads=[("src", src)],
        writes=[("dst", dst)],
        bytes_moved=dst.nbytes,
        partitions=dst.partition_size,
        bytes_per_partition=dst.nbytes // max(dst.partition_size, 1),
        contiguous_bytes=dtypes.itemsize(src.dtype),
        transpose=True,
    )


def _check_transpose_dge(instr: str, src: Tensor, mode: dge_mode, target: Any) -> None:
    """nki.isa.dma_transpose's docstring: a direct transpose runs on hardware DGE (or unknown), an
    indirect one (a vector_offset src) on software DGE (or unknown), each with its own limits."""
    if src._indirect is not None:
        if mode not in (_DGE.unknown, _DGE.swdge):
            raise rule(instr, "dge_mode", "an indirect transpose takes unknown or swdge", dge_mode=mode.name)
        if src.buffer not in runtime.HBM_KINDS:
            raise rule(instr, "src", "an indirect transpose gathers from HBM", buffer=src.buffer)
        require_generation(instr, "src", target, 3, "an indirect transpose")
        if src.shape[-1] > 128:
            raise rule(instr, "src", "an indirect transpose moves at most 128 elements per row", shape=list(src.shape))
        return
    if mode not in (_DGE.unknown, _DGE.hwdge):
        raise rule(instr, "dge_mode", "a direct transpose takes unknown or hwdge", dge_mode=mode.name)
    if mode != _DGE.hwdge:
        return
    if not target.has_hwdge:
        raise too_old(instr, "dge_mode", target.name, 3, "hardware DGE")
    # The 0.6 API reference's shapes. AWS's DGE deep dive (nki-dge.rst) still says shape[0] == 16 and
    # shape[-1] % 128 == 0; where two AWS pages disagree the newer API reference is followed.
    rows = src.shape[0]
    legal_rows = rows == 16 if src.ndim == 2 else rows in (1, 2, 4, 8, 16) and rows * src.shape[-2] % 16 == 0
    if not legal_rows or src.shape[-1] > 128:
        raise rule(
            instr,
            "src",
            "a hardware-DGE transpose needs src.shape[0] == 16 (2-D; 3-D/4-D: 1/2/4/8/16 with "
            "shape[0] * shape[-2] a multiple of 16) and src.shape[-1] <= 128",
            shape=list(src.shape),
        )


def tensor_copy(dst: Tensor, src: Tensor, engine: engine = engine.unknown, name: str | None = None) -> None:
    """Copy a tile within SBUF/PSUM on Vector, Scalar or GpSimd (bit-exact when dtypes match)."""
    instr = "nisa.tensor_copy"
    eng = operands.engine_for(engine, instr, ("vector", "scalar", "gpsimd"), "vector")
    run = runtime.current()
    if eng == "scalar" and not run.target.scalar_engine_tensor_copy:
        raise rule(
            instr,
            "engine",
            "ScalarE has no tensor_copy on NeuronCore-v2; use activation(op=nl.copy)",
            target=run.target.name,
        )
    dst, src = operands.compute_tile(dst, instr, "dst", eng), operands.compute_tile(src, instr, "src", eng)
    operands.same_layout(instr, "dst", dst, "src", src)
    indirection.check_lanes(instr, dst, "src", src)
    if run.numerics or run.computed(src._buf):  # exact (see dma_copy)
        values = np.asarray(src.read())
        if src.dtype != dst.dtype:
            # Differing dtypes convert through an fp32 intermediate (ints too: 2**24 + 1 is lost, and
            # out-of-range values saturate when written back as a narrower int rather than wrapping).
            values = values.astype(np.float32)
        dst.write(values.reshape(dst.shape), instr)
    else:
        dst.write_uncomputed(instr)
    run.record(eng, "tensor_copy", reads=[("src", src)], writes=[("dst", dst)])


def memset(dst: Tensor, value: Any, engine: engine = engine.unknown, name: str | None = None) -> None:
    """Fill ``dst`` with a compile-time constant."""
    instr = "nisa.memset"
    eng = operands.engine_for(engine, instr, ("vector", "gpsimd"), "vector")
    dst = operands.compute_tile(dst, instr, "dst", eng)
    if dst.dtype in dtypes.PACKED_X4 and value != 0:
        raise rule(instr, "value", "packed x4 dtypes can only be set to 0", value=value)
    if isinstance(value, Tensor):
        raise rule(instr, "value", "must be a compile-time constant, not a tensor")
    dst.write(np.full(dst.shape, value, dtype=np.float64 if dtypes.is_float(dst.dtype) else np.int64), instr)
    runtime.current().record(eng, "memset", writes=[("dst", dst)], zero=(value == 0))


def tensor_copy_predicated(
    dst: Tensor, src: Any, predicate: Tensor, reverse_pred: bool = False, name: str | None = None
) -> None:
    """Copy ``src`` into ``dst`` where ``predicate`` is non-zero (or zero, with ``reverse_pred``)."""
    instr = "nisa.tensor_copy_predicated"
    dst = operands.compute_tile(dst, instr, "dst", "vector")
    predicate = operands.compute_tile(predicate, instr, "predicate", "vector")
    if dtypes.name(predicate.dtype) not in ("uint8", "uint16", "uint32"):  # the docstring's constraint 2
        raise rule(instr, "predicate", "must be uint8, uint16 or uint32", dtype=dtypes.name(predicate.dtype))
    operands.same_layout(instr, "dst", dst, "predicate", predicate)
    indirection.check_lanes(instr, dst, "predicate", predicate)
    if isinstance(src, Tensor):
        src = operands.compute_tile(src, instr, "src", "vector")
        operands.same_layout(instr, "dst", dst, "src", src)
        operands.not_both_psum(instr, "src", src, "predicate", predicate)
        if src.dtype != dst.dtype:
            raise rule(
                instr, "src", "must have the same dtype as dst", src=dtypes.name(src.dtype), dst=dtypes.name(dst.dtype)
            )
        values = np.asarray(src.read()).reshape(dst.shape)
    else:
        values = np.full(dst.shape, src)
    mask = np.asarray(predicate.read()).reshape(dst.shape) != 0
    if reverse_pred:
        mask = ~mask
    current = np.asarray(dst.read())
    dst.write(np.where(mask, values, current), instr)
    runtime.current().record(
        "vector",
        "tensor_copy_predicated",
        reads=operands.reads(src=src, predicate=predicate, dst_in=dst),
        writes=[("dst", dst)],
    )


# ---------------------------------------------------------------------------------------------
# TensorE
# ---------------------------------------------------------------------------------------------
_MATMUL_IN = {"float8_e4m3", "float8_e5m2", "float8_e4m3fn", "bfloat16", "float16", "tfloat32", "float32"}
_MATMUL_FP32 = {"tfloat32", "float32"}


# The tile sizes (rows, columns) of TensorE's tiling mode; the smallest only from generation 3 (Trn2) on.
_TILING_MODE_SIZES = (32, 64, 128)


def _check_tiling(
    instr: str, tile_position: Sequence[Any], tile_size: Sequence[Any], generation: int, k: int, m: int
) -> tuple[int, int]:
    if bool(tile_position) != bool(tile_size):
        raise rule(instr, "tile_position/tile_size", "set both to use tiling mode, or neither")
    if not tile_size:
        return operands.PE_ARRAY, operands.PE_ARRAY
    rows, cols = (int(v) for v in tile_size)
    start_row, start_col = (int(v) for v in tile_position)
    legal = _TILING_MODE_SIZES if generation >= 3 else _TILING_MODE_SIZES[1:]
    for label, size, start in (("row", rows, start_row), ("column", cols, start_col)):
        if size not in legal:
            raise rule(instr, "tile_size", f"{label} tile size must be one of {legal}", value=size)
        if start % size or not 0 <= start < operands.PE_ARRAY:
            raise rule(
                instr,
                "tile_position",
                f"start {label} must be a multiple of the {label} tile size below 128",
                start=start,
                tile=size,
            )
    if k > rows:
        raise rule(instr, "stationary", "partition (contraction) dim exceeds the row tile", K=k, row_size=rows)
    if m > cols:
        raise rule(instr, "stationary", "free dim exceeds the column tile", M=m, column_size=cols)
    return rows, cols


def nc_matmul(
    dst: Tensor,
    stationary: Tensor,
    moving: Tensor,
    is_stationary_onezero: bool = False,
    is_moving_onezero: bool = False,
    is_transpose: bool = False,
    accumulate: bool | None = None,
    tile_position: Sequence[Any] = (),
    tile_size: Sequence[Any] = (),
    perf_mode: matmul_perf_mode = matmul_perf_mode.none,
    name: str | None = None,
) -> None:
    """``dst[M, N] (+)= stationary[K, M].T @ moving[K, N]`` on TensorE, accumulating in fp32 PSUM."""
    instr = "nisa.nc_matmul"
    run = runtime.current()
    target = run.target
    stationary = operands.compute_tile(stationary, instr, "stationary", "tensor", ("sbuf",))
    moving = operands.compute_tile(moving, instr, "moving", "tensor", ("sbuf",))
    dst = operands.compute_tile(dst, instr, "dst", "tensor", ("psum",))
    s_dt, m_dt = dtypes.name(stationary.dtype), dtypes.name(moving.dtype)
    for role, dt in (("stationary", s_dt), ("moving", m_dt)):
        if dt not in _MATMUL_IN or (dt == "float8_e4m3fn" and target.generation < 4):
            raise rule(instr, role, "unsupported matmul input dtype", dtype=dt, target=target.name)
    if (s_dt in _MATMUL_FP32) != (m_dt in _MATMUL_FP32):
        raise rule(
            instr, "stationary/moving", "fp32/tf32 inputs must be paired with fp32/tf32", stationary=s_dt, moving=m_dt
        )
    if {s_dt, m_dt} == {"float8_e4m3", "float8_e4m3fn"}:
        raise rule(instr, "stationary/moving", "legacy float8_e4m3 and OCP float8_e4m3fn cannot be mixed")
    d_dt = dtypes.name(dst.dtype)
    # The default skips the enum conversion: every matmul runs this line.
    double_row = perf_mode is not matmul_perf_mode.none and matmul_perf_mode(perf_mode) == matmul_perf_mode.double_row
    if is_transpose:
        if d_dt != s_dt:
            raise rule(instr, "dst", "a transpose writes the stationary dtype", dst=d_dt, stationary=s_dt)
    elif d_dt not in target.matmul_dst_dtypes:
        raise rule(
            instr,
            "dst",
            "PSUM result dtype not supported",
            dtype=d_dt,
            allowed="/".join(target.matmul_dst_dtypes),
            target=target.name,
        )
    k = stationary.partition_size
    m, n = stationary.free_size, moving.free_size
    if double_row:
        if not target.has_fp8_double_row:
            raise too_old(instr, "perf_mode", target.name, 3, "double_row")
        if s_dt not in ("float8_e4m3", "float8_e5m2", "float8_e4m3fn") or m_dt not in (
            "float8_e4m3",
            "float8_e5m2",
            "float8_e4m3fn",
        ):
            raise rule(instr, "perf_mode", "double_row takes fp8 inputs only", stationary=s_dt, moving=m_dt)
        if tile_size and tuple(tile_size)[1] != operands.PE_ARRAY:
            raise rule(instr, "perf_mode", "double_row cannot be combined with column tiling")
        if stationary.ndim < 3 or stationary.shape[1] != 2 or moving.ndim < 3 or moving.shape[1] != 2:
            raise rule(
                instr,
                "stationary/moving",
                "double_row needs the first free dim to be 2",
                stationary=list(stationary.shape),
                moving=list(moving.shape),
            )
        m, n = m // 2, n // 2  # the contraction spans partitions and the pair dim: [K, 2, M] -> [2K, M]
    if moving.partition_size != k:
        raise rule(
            instr,
            "stationary/moving",
            "contraction (partition) dims differ",
            stationary_K=k,
            moving_K=moving.partition_size,
        )
    if k > operands.PE_ARRAY:
        raise rule(instr, "stationary", "contraction (partition) dim exceeds 128", K=k)
    if m > target.gemm_stationary_fmax:
        raise rule(
            instr, "stationary", "free size exceeds gemm_stationary_fmax", M=m, limit=target.gemm_stationary_fmax
        )
    moving_limit = target.gemm_moving_fmax
    if target.generation >= 4 and d_dt == "bfloat16" and not is_transpose:
        moving_limit *= 2  # NC-v4: the moving free size is bounded by all 8 PSUM banks, 8192 bf16 columns
    if n > moving_limit:
        raise rule(
            instr,
            "moving",
            "free size exceeds gemm_moving_fmax",
            N=n,
            limit=moving_limit,
            dst_dtype=d_dt,
            target=target.name,
        )
    row_size, _ = _check_tiling(instr, tile_position, tile_size, target.generation, k, m)
    if indirection.uses_indirection(dst, stationary, moving):
        _check_matmul_indirection(instr, dst, stationary, moving, is_transpose, tile_position)
    if dst.partition_size != m or dst.free_size != n:
        raise rule(instr, "dst", "shape must be [stationary free, moving free]", dst=list(dst.shape), expected=[m, n])
    region = dst.region()
    bank = target.psum_bank_bytes
    if target.generation < 4 and region.b0 // bank != (region.b1 - 1) // bank:
        raise rule(
            instr,
            "dst",
            "a matmul result must lie within one 2 KiB PSUM bank",
            first_byte=region.b0,
            last_byte=region.b1 - 1,
            bank_bytes=bank,
        )
    # The writer codes are ordered (unwritten < by matmul < by another instruction), so one reduction
    # tells both whether any element was written and whether another instruction wrote one; none is
    # needed when the whole tile holds one code (a matmul group into a whole tile).
    latest_writer = dst.uniform_psum_writer()
    writers = None
    if latest_writer is None:
        writers = dst.psum_writers().reshape(m, n)
        latest_writer = int(writers.max())
    accumulates = latest_writer != runtime.PSUM_UNWRITTEN if accumulate is None else bool(accumulate)
    if accumulates:
        # Every element the rules concern is one this matmul adds to (all of them with accumulate=True;
        # with None, every written one), so the rules read the whole tile, no masked copy.
        lowest_writer = None
        if accumulate:
            lowest_writer = latest_writer if writers is None else int(writers.min())
        _check_accumulation(instr, lowest_writer, latest_writer, target)
    if run.numerics:
        if writers is None:
            writers = dst.psum_writers().reshape(m, n)
        add = writers != runtime.PSUM_UNWRITTEN if accumulate is None else np.full((m, n), bool(accumulate))
        st, mv = operands.rows(stationary), operands.rows(moving)
        if double_row:
            st, mv = _double_row_pairs(st, k), _double_row_pairs(mv, k)
        if is_transpose and target.generation >= 3 and k == n and np.array_equal(mv, np.eye(k, dtype=mv.dtype)):
            product = st.T.copy()  # bit-accurate transpose mode: NaN/Inf pass through untouched
        else:
            with np.errstate(all="ignore"):
                product = st.T.astype(np.float32, copy=False) @ mv.astype(np.float32, copy=False)
        result = product
        if accumulates:
            previous = dtypes.to_engine(np.asarray(dst.read())).reshape(m, n)
            with np.errstate(all="ignore"):
                result = np.where(add, previous + product, product)
        dst.write(result.reshape(dst.shape), instr, runtime.PSUM_BY_MATMUL)
    else:
        dst.write_uncomputed(instr, runtime.PSUM_BY_MATMUL)
    reads = [("stationary", stationary), ("moving", moving)]
    if accumulates:
        reads.append(("dst_in", dst))
    contraction = 2 * k if double_row else k
    run.record(
        "tensor",
        "nc_matmul",
        reads=reads,
        writes=[("dst", dst)],
        flops=2 * contraction * m * n,
        K=contraction,
        M=m,
        N=n,
        fp32=s_dt in _MATMUL_FP32,
        onezero=is_stationary_onezero or is_moving_onezero,
        double_row=double_row,
        row_size=row_size,
        transpose=bool(is_transpose),
    )


def _check_matmul_indirection(
    instr: str, dst: Tensor, stationary: Tensor, moving: Tensor, is_transpose: bool, tile_position: Sequence[Any]
) -> None:
    """nc_matmul's "Tensor indirection" paragraph, beyond the per-operand rules of ``indirection.bind``."""
    if is_transpose and moving._columns is not None:
        raise rule(instr, "moving", "cannot use tensor indirection when is_transpose=True")
    indirection.check_untiled(instr, tile_position)
    indirection.check_lanes(instr, dst, "stationary", stationary)


def _double_row_pairs(values: np.ndarray, k: int) -> np.ndarray:
    """A double_row operand's [K, 2 * F] rows as the [2K, F] contraction they feed."""
    return values.reshape(k, 2, -1).transpose(1, 0, 2).reshape(2 * k, -1)


def _check_accumulation(instr: str, lowest_writer: int | None, latest_writer: int, target: Any) -> None:
    """The accumulation rules of nki.isa.nc_matmul's docstring ("Accumulation mode"), from the lowest and
    highest writer codes of the elements it adds to (the lowest only with an explicit accumulate=True)."""
    if lowest_writer == runtime.PSUM_UNWRITTEN:
        warnings.warn(
            f"{instr}: accumulate=True onto PSUM that no matmul has written is undefined behaviour on "
            "every target; start the group with accumulate=False",
            AccumulateUninitializedWarning,
            stacklevel=3,
        )
    if target.generation < 4 and latest_writer == runtime.PSUM_BY_OTHER:
        # A warning, not an error: AWS's own trn2 kernel (nki-library's attention_bwd) zeroes PSUM with
        # memset and accumulates onto it, so the hardware evidently sums; the docs still call it undefined.
        warnings.warn(
            f"{instr}: dst: accumulating onto PSUM written by a non-matmul instruction (memset, tensor_copy, "
            f"...) is undefined on NeuronCore-v2/v3 (target={target.name}); start the group with "
            "accumulate=False. The simulator accumulates.",
            AccumulateOntoNonMatmulWarning,
            stacklevel=3,
        )


def nc_transpose(dst: Tensor, data: Tensor, engine: engine = engine.unknown, name: str | None = None) -> None:
    """Swap the partition dim with the (flattened) free dims, on TensorE (≤128×128) or VectorE (≤32×32)."""
    instr = "nisa.nc_transpose"
    data = operands.tile(data, instr, "data")
    dst = operands.tile(dst, instr, "dst")
    default = "tensor" if (data.buffer == "sbuf" and dst.buffer == "psum") else "vector"
    eng = operands.engine_for(engine, instr, ("tensor", "vector"), default)
    if eng == "tensor":
        data = operands.compute_tile(data, instr, "data", "tensor", ("sbuf",))
        dst = operands.compute_tile(dst, instr, "dst", "tensor", ("psum",))
        limit = operands.PE_ARRAY
    else:
        data = operands.compute_tile(data, instr, "data", "vector")
        dst = operands.compute_tile(dst, instr, "dst", "vector")
        limit = operands.VECTOR_TRANSPOSE_MAX
    if data.dtype != dst.dtype:
        raise rule(
            instr, "dst", "must have the same dtype as data", dst=dtypes.name(dst.dtype), data=dtypes.name(data.dtype)
        )
    p, f = data.partition_size, data.free_size
    if p > limit or f > limit:
        raise rule(instr, "data", f"{eng} engine transposes at most {limit}x{limit}", shape=[p, f])
    if dst.partition_size != f or dst.free_size != p:
        raise rule(instr, "dst", "must be the transposed shape of data", dst=list(dst.shape), expected=[f, p])
    # TensorE transposes through a matmul against an identity, so its result starts a PSUM group.
    writer = runtime.PSUM_BY_MATMUL if eng == "tensor" else runtime.PSUM_BY_OTHER
    run = runtime.current()
    if run.numerics:
        dst.write(np.asarray(data.read()).reshape(p, f).T.reshape(dst.shape), instr, writer)
    else:
        dst.write_uncomputed(instr, writer)
    flops = 2 * p * p * f if eng == "tensor" else 0
    run.record(
        eng,
        "nc_transpose",
        reads=[("data", data)],
        writes=[("dst", dst)],
        flops=flops,
        K=p,
        M=p,
        N=f,
        fp32=dtypes.name(data.dtype) == "float32",
        transpose=True,
    )


# ---------------------------------------------------------------------------------------------
# element-wise
# ---------------------------------------------------------------------------------------------
def _alu_apply(op: Op, a: Any, b: Any, reverse: bool = False) -> np.ndarray:
    if op is BYPASS:
        return b if reverse else a
    binary = op.binary
    assert binary is not None  # as_alu admits only operators with a binary form
    return binary(b, a) if reverse else binary(a, b)


def _check_bitvec(instr: str, ops: Sequence[Op], tiles: dict[str, Tensor]) -> None:
    kinds = {op.kind == "bitvec" for op in ops if op is not BYPASS}
    if len(kinds) > 1:
        raise rule(instr, "op0/op1", "both operators must be bitvec or both arithmetic", ops=[op.name for op in ops])
    if True in kinds:
        for role, t in tiles.items():
            if not operands.is_int(t):
                raise rule(
                    instr, role, "bitvec operators need integer tiles", op=ops[0].name, dtype=dtypes.name(t.dtype)
                )


_GPSIMD_INT_ALU = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "maximum": np.maximum,
    "minimum": np.minimum,
}


def tensor_tensor(
    dst: Tensor, data1: Tensor, data2: Tensor, op: Any, engine: engine = engine.unknown, name: str | None = None
) -> None:
    """``dst = data1 <op> data2`` element-wise on VectorE (GpSimd for ``nl.power`` and int32)."""
    instr = "nisa.tensor_tensor"
    alu = as_alu(op, instr)
    data1, data2 = operands.tile(data1, instr, "data1"), operands.tile(data2, instr, "data2")
    all_int32 = all(dtypes.name(t.dtype) in ("int32", "uint32") for t in (dst, data1, data2) if isinstance(t, Tensor))
    any_psum = any(t.buffer == "psum" for t in (dst, data1, data2) if isinstance(t, Tensor))
    default = "gpsimd" if (alu.name == "power" or (all_int32 and not any_psum)) else "vector"
    eng = operands.engine_for(engine, instr, ("vector", "gpsimd"), default)
    if alu.name == "power" and eng != "gpsimd":
        raise rule(instr, "op", "nl.power runs on GpSimd only", engine=eng)
    dst = operands.compute_tile(dst, instr, "dst", eng)
    data1 = operands.compute_tile(data1, instr, "data1", eng)
    data2 = operands.compute_tile(data2, instr, "data2", eng)
    operands.same_layout(instr, "data1", data1, "data2", data2)
    operands.same_layout(instr, "dst", dst, "data1", data1)
    operands.not_both_psum(instr, "data1", data1, "data2", data2)
    indirection.check_lanes(instr, dst, "data1", data1)
    _check_bitvec(instr, [alu], {"data1": data1, "data2": data2, "dst": dst})
    run = runtime.current()
    if not run.numerics:
        dst.write_uncomputed(instr)
    elif eng == "gpsimd" and all_int32 and alu.name in _GPSIMD_INT_ALU:
        # GpSimd's native 32-bit integer arithmetic: exact (no fp32 rounding above 2**24), and the
        # int64 result wraps to 32 bits when written, as two's-complement hardware does.
        dst.write(_GPSIMD_INT_ALU[alu.name](operands.rows(data1), operands.rows(data2)).reshape(dst.shape), instr)
    else:
        dst.write(_alu_apply(alu, operands.rows(data1), operands.rows(data2)).reshape(dst.shape), instr)
    run.record(eng, "tensor_tensor", reads=[("data1", data1), ("data2", data2)], writes=[("dst", dst)], alu=alu.name)


_SCALAR_ENGINE_COMBOS = {("multiply", "add"), ("multiply", None), ("add", None)}
# Engines that implement each restricted ALU operator (AWS's NKI operator table); others run anywhere.
ALU_OP_ENGINES = {
    "rsqrt": ("gpsimd", "scalar"),
    "power": ("gpsimd",),
    "reciprocal": ("vector", "scalar"),
    "abs": ("vector", "scalar"),
}


def _alu_engines(instr: str, ops: Sequence[Op], candidates: Sequence[str]) -> list[str]:
    allowed = list(candidates)
    for op in ops:
        allowed = [e for e in allowed if e in ALU_OP_ENGINES.get(op.name, candidates)]
    if not allowed:
        raise rule(instr, "op", "no engine implements this operator combination", ops=[op.name for op in ops])
    return allowed


def tensor_scalar(
    dst: Tensor,
    data: Tensor,
    op0: Any,
    operand0: Any,
    reverse0: bool = False,
    op1: Any = None,
    operand1: Any = None,
    reverse1: bool = False,
    engine: engine = engine.unknown,
    name: str | None = None,
) -> None:
    """``dst = (data <op0> operand0) <op1> operand1`` with scalar or per-partition [P, 1] operands."""
    instr = "nisa.tensor_scalar"
    first = as_alu(op0, instr, "op0")
    second = as_alu(op1, instr, "op1") if op1 is not None else None
    if (op1 is None) != (operand1 is None) and not (second is not None and second.name in ("abs", "bypass")):
        raise rule(instr, "op1/operand1", "set both or neither")
    pair = (first.name, second.name if second else None)
    allowed = _alu_engines(instr, [first] + ([second] if second else []), ("vector", "scalar", "gpsimd"))
    # Like the compiler: VectorE when it can, else GpSimd, else ScalarE for the pairs it supports.
    usable = [
        e for e in ("vector", "gpsimd", "scalar") if e in allowed and (e != "scalar" or pair in _SCALAR_ENGINE_COMBOS)
    ]
    eng = operands.engine_for(engine, instr, allowed, usable[0] if usable else allowed[0])
    if eng == "scalar" and pair not in _SCALAR_ENGINE_COMBOS:
        raise rule(instr, "engine", "ScalarE supports only multiply+add, multiply, or add", op0=pair[0], op1=pair[1])
    dst = operands.compute_tile(dst, instr, "dst", eng)
    data = operands.compute_tile(data, instr, "data", eng)
    operands.same_layout(instr, "dst", dst, "data", data)
    indirection.check_lanes(instr, dst, "data", data)
    ops = [first] + ([second] if second else [])
    _check_bitvec(instr, ops, {"data": data, "dst": dst})
    if first.kind != "bitvec":
        # Arithmetic operators take float32 operands (a vector operand is not cast on the way in).
        for role, operand in (("operand0", operand0), ("operand1", operand1)):
            if isinstance(operand, Tensor) and dtypes.name(operand.dtype) != "float32":
                raise rule(
                    instr,
                    role,
                    "a vector operand of an arithmetic operator must be float32",
                    dtype=dtypes.name(operand.dtype),
                )
    parts = data.partition_size
    operand0 = 0.0 if operand0 is None else operand0
    operands.check_scalar_or_vector(operand0, instr, "operand0", parts, eng)
    if second is not None:
        operands.check_scalar_or_vector(0.0 if operand1 is None else operand1, instr, "operand1", parts, eng)
    run = runtime.current()
    if run.numerics:
        values = _alu_apply(first, operands.rows(data), operands.scalar_or_vector_values(operand0), reverse0)
        if second is not None:
            a1 = operands.scalar_or_vector_values(0.0 if operand1 is None else operand1)
            values = _alu_apply(second, values, a1, reverse1)
        dst.write(np.broadcast_to(values, (parts, data.free_size)).reshape(dst.shape), instr)
    else:
        dst.write_uncomputed(instr)
    run.record(
        eng,
        "tensor_scalar",
        reads=operands.reads(data=data, operand0=operand0, operand1=operand1),
        writes=[("dst", dst)],
        alu=first.name,
    )


def scalar_tensor_tensor(
    dst: Tensor,
    data: Tensor,
    op0: Any,
    operand0: Any,
    op1: Any,
    operand1: Tensor,
    reverse0: bool = False,
    reverse1: bool = False,
    name: str | None = None,
) -> None:
    """``dst = (data <op0> operand0) <op1> operand1`` with a scalar/[P, 1] operand0 and a tile operand1."""
    instr = "nisa.scalar_tensor_tensor"
    first, second = as_alu(op0, instr, "op0"), as_alu(op1, instr, "op1")
    for op in (first, second):
        if op.kind == "bitvec":
            raise rule(instr, "op", "bitvec operators are not supported here", op=op.name)
    dst = operands.compute_tile(dst, instr, "dst", "vector")
    data = operands.compute_tile(data, instr, "data", "vector")
    operand1 = operands.compute_tile(operand1, instr, "operand1", "vector")
    operands.same_layout(instr, "dst", dst, "data", data)
    operands.same_layout(instr, "data", data, "operand1", operand1)
    operands.not_both_psum(instr, "data", data, "operand1", operand1)
    operands.check_scalar_or_vector(operand0, instr, "operand0", data.partition_size, "vector")
    run = runtime.current()
    if run.numerics:
        values = _alu_apply(first, operands.rows(data), operands.scalar_or_vector_values(operand0), reverse0)
        dst.write(_alu_apply(second, values, operands.rows(operand1), reverse1).reshape(dst.shape), instr)
    else:
        dst.write_uncomputed(instr)
    run.record(
        "vector",
        "scalar_tensor_tensor",
        reads=operands.reads(data=data, operand0=operand0, operand1=operand1),
        writes=[("dst", dst)],
        alu=second.name,
    )


def reciprocal(dst: Tensor, data: Tensor, name: str | None = None) -> None:
    """``dst = 1 / data`` on VectorE."""
    instr = "nisa.reciprocal"
    dst, data = operands.compute_tile(dst, instr, "dst", "vector"), operands.compute_tile(data, instr, "data", "vector")
    operands.same_layout(instr, "dst", dst, "data", data)
    run = runtime.current()
    if run.numerics:
        with np.errstate(all="ignore"):
            values = np.float32(1.0) / operands.rows(data).astype(np.float32, copy=False)
        dst.write(values.reshape(dst.shape), instr)
    else:
        dst.write_uncomputed(instr)
    run.record("vector", "reciprocal", reads=[("data", data)], writes=[("dst", dst)])


# ---------------------------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------------------------
def _reduce(op: Op, values: np.ndarray, axis: int = -1) -> np.ndarray:
    """Reduce one axis with an ALU operator, in the engines' arithmetic."""
    if op.name == "add":
        return values.sum(axis=axis, dtype=values.dtype)
    if op.name == "maximum":
        return values.max(axis=axis)
    if op.name == "minimum":
        return values.min(axis=axis)
    if op.name == "multiply":
        return values.prod(axis=axis, dtype=values.dtype)
    if op.name == "average":
        return values.mean(axis=axis, dtype=np.float32)
    ufunc = {"bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor}.get(op.name)
    if ufunc is not None:
        return ufunc.reduce(values.astype(np.int64), axis=axis)
    moved = np.moveaxis(values, axis, -1)
    result = moved[..., 0]
    binary = op.binary
    assert binary is not None  # as_alu admits only operators with a binary form
    for i in range(1, moved.shape[-1]):
        result = binary(result, moved[..., i])
    return result


# The "Legal Reduction op" column of the operator table (nki.api.shared.rst).
LEGAL_REDUCE_OPS = frozenset(
    {
        "bitwise_and",
        "bitwise_or",
        "bitwise_xor",
        "add",
        "subtract",
        "multiply",
        "maximum",
        "minimum",
        "logical_and",
        "logical_or",
        "logical_xor",
    }
)


def tensor_reduce(
    dst: Tensor, op: Any, data: Tensor, axis: Any, negate: bool = False, keepdims: bool = False, name: str | None = None
) -> None:
    """Reduce the trailing free axes of ``data`` on VectorE (optionally negated)."""
    instr = "nisa.tensor_reduce"
    alu = as_alu(op, instr)
    if alu.name not in LEGAL_REDUCE_OPS:
        raise rule(instr, "op", "not a legal reduction operator", op=alu.name, legal="/".join(sorted(LEGAL_REDUCE_OPS)))
    dst, data = operands.compute_tile(dst, instr, "dst", "vector"), operands.compute_tile(data, instr, "data", "vector")
    indirection.check_lanes(instr, dst, "data", data)
    axes = tuple(sorted(int(a) % data.ndim for a in (axis if isinstance(axis, (list, tuple)) else [axis])))
    if 0 in axes:
        raise rule(instr, "axis", "the partition axis (0) cannot be reduced; transpose or use a matmul", axis=axes)
    if axes != tuple(range(axes[0], data.ndim)):
        raise rule(
            instr, "axis", "must be the last contiguous free dims, ending at the final dim", axis=axes, ndim=data.ndim
        )
    if alu.kind == "bitvec" and not operands.is_int(data):
        raise rule(instr, "data", "bitvec reductions need integer tiles", dtype=dtypes.name(data.dtype))
    if negate and alu.kind == "bitvec":
        raise rule(instr, "negate", "only applies to arithmetic reductions", op=alu.name)
    kept = int(np.prod([data.shape[d] for d in range(1, data.ndim) if d not in axes]))
    if dst.partition_size != data.partition_size or dst.free_size != kept:
        raise rule(
            instr,
            "dst",
            "shape does not match the reduction",
            dst=list(dst.shape),
            expected_elements_per_partition=kept,
        )
    run = runtime.current()
    if run.numerics:
        values = dtypes.to_engine(np.asarray(data.read()))
        reduced = _reduce(alu, values.reshape(values.shape[: axes[0]] + (-1,)), -1)
        dst.write(np.asarray(-reduced if negate else reduced).reshape(dst.shape), instr)
    else:
        dst.write_uncomputed(instr)
    run.record("vector", "tensor_reduce", reads=[("data", data)], writes=[("dst", dst)], alu=alu.name)


def tensor_partition_reduce(dst: Tensor, op: Any, data: Tensor, name: str | None = None) -> None:
    """Reduce across partitions on GpSimd: ``dst[1, F] = op over p of data[p, F]``."""
    instr = "nisa.tensor_partition_reduce"
    alu = as_alu(op, instr)
    if alu.name not in ("add", "average", "maximum", "bitwise_or", "bitwise_and"):
        raise rule(instr, "op", "must be add, average, maximum, bitwise_or or bitwise_and", op=alu.name)
    dst, data = operands.compute_tile(dst, instr, "dst", "gpsimd"), operands.compute_tile(data, instr, "data", "gpsimd")
    if dst.partition_size != 1 or dst.free_size != data.free_size:
        raise rule(
            instr,
            "dst",
            "must hold one partition of data's free size",
            dst=list(dst.shape),
            expected=[1, data.free_size],
        )
    if runtime.current().numerics:
        dst.write(_reduce(alu, operands.rows(data), 0).reshape(dst.shape), instr)
    else:
        dst.write_uncomputed(instr)
    runtime.current().record("gpsimd", "tensor_partition_reduce", reads=[("data", data)], writes=[("dst", dst)])


def _accumulate(
    registers: np.ndarray, parts: int, cmd: reduce_cmd, op: Op, values: np.ndarray | None, init: Any, instr: str
) -> None:
    """Apply a reduce_cmd to per-lane accumulator registers (in place); with ``values`` None (a
    trace-only run, whose registers hold no values) only check it."""
    cmd = _CMD(cmd)
    if cmd == reduce_cmd.load_reduce:
        if init is None:
            raise rule(instr, "reduce_init", "is required with reduce_cmd.load_reduce")
        operands.check_scalar_or_vector(init, instr, "reduce_init", parts, "vector")
    if values is None:
        return
    identity = op.identity if op.identity is not None else 0.0
    lane = registers[:parts]
    if cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce):
        lane[:] = identity
    elif cmd == reduce_cmd.load_reduce:
        lane[:] = np.broadcast_to(operands.scalar_or_vector_values(init), (parts, 1))[:, 0]
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce, reduce_cmd.load_reduce):
        lane[:] = _alu_apply(op, lane, _reduce(op, values.astype(np.float32), -1))


def _read_out(reduce_res: Tensor | None, registers: np.ndarray, parts: int, instr: str, eng: str) -> None:
    if reduce_res is None:
        return
    reduce_res = operands.compute_tile(reduce_res, instr, "reduce_res", eng)
    if reduce_res.partition_size != parts or reduce_res.free_size != 1:
        raise rule(
            instr, "reduce_res", "must have shape (partitions, 1)", shape=list(reduce_res.shape), partitions=parts
        )
    if runtime.current().numerics:
        reduce_res.write(registers[:parts].reshape(reduce_res.shape), instr)
    else:
        reduce_res.write_uncomputed(instr)


def tensor_scalar_reduce(
    dst: Tensor,
    data: Tensor,
    op0: Any,
    operand0: Any,
    reduce_op: Any,
    reduce_res: Tensor,
    reverse0: bool = False,
    reduce_cmd: reduce_cmd = reduce_cmd.reset_reduce,
    reduce_init: Any = None,
    reduce_res_negate: bool = False,
    name: str | None = None,
) -> None:
    """``dst = data <op0> operand0`` and reduce the result along the free dims into ``reduce_res``
    (negated on the way out with ``reduce_res_negate``; the accumulator itself keeps its sign)."""
    instr = "nisa.tensor_scalar_reduce"
    first, red = as_alu(op0, instr, "op0"), as_alu(reduce_op, instr, "reduce_op")
    if red.name not in ("add", "multiply", "maximum", "minimum"):
        raise rule(instr, "reduce_op", "must be add, multiply, maximum or minimum", op=red.name)
    if first.kind == "bitvec":
        raise rule(instr, "op0", "bitvec operators are not supported here", op=first.name)
    dst, data = operands.compute_tile(dst, instr, "dst", "vector"), operands.compute_tile(data, instr, "data", "vector")
    operands.same_layout(instr, "dst", dst, "data", data)
    indirection.check_lanes(instr, dst, "data", data)
    parts = data.partition_size
    operand0 = 0.0 if operand0 is None else operand0
    operands.check_scalar_or_vector(operand0, instr, "operand0", parts, "vector")
    run = runtime.current()
    stored = None
    if run.numerics:
        a0 = operands.scalar_or_vector_values(operand0)
        values = np.broadcast_to(_alu_apply(first, operands.rows(data), a0, reverse0), (parts, data.free_size))
        dst.write(values.reshape(dst.shape), instr)
        # Engines accumulate their fp32 results; only the write to dst rounds.
        stored = np.asarray(values, dtype=np.float32)
    else:
        dst.write_uncomputed(instr)
    _accumulate(run.vector_accumulator, parts, reduce_cmd, red, stored, reduce_init, instr)
    registers = -run.vector_accumulator if reduce_res_negate else run.vector_accumulator
    _read_out(reduce_res, registers, parts, instr, "vector")
    run.record(
        "vector",
        "tensor_scalar_reduce",
        reads=operands.reads(data=data, operand0=operand0),
        writes=operands.reads(dst=dst, reduce_res=reduce_res),
        alu=first.name,
    )


def tensor_tensor_scan(
    dst: Tensor,
    data0: Tensor,
    data1: Tensor,
    initial: Any,
    op0: Any,
    op1: Any,
    reverse0: bool = False,
    reverse1: bool = False,
    name: str | None = None,
) -> None:
    """``r[i] = (data0[i] <op0> r[i-1]) <op1> data1[i]`` along the free dim, from ``initial``."""
    instr = "nisa.tensor_tensor_scan"
    first, second = as_alu(op0, instr, "op0"), as_alu(op1, instr, "op1")
    dst = operands.compute_tile(dst, instr, "dst", "vector")
    data0, data1 = (
        operands.compute_tile(data0, instr, "data0", "vector"),
        operands.compute_tile(data1, instr, "data1", "vector"),
    )
    operands.same_layout(instr, "data0", data0, "data1", data1)
    operands.same_layout(instr, "dst", dst, "data0", data0)
    operands.not_both_psum(instr, "data0", data0, "data1", data1)
    parts = data0.partition_size
    a, b = operands.rows(data0), operands.rows(data1)
    state = np.broadcast_to(operands.scalar_or_vector(initial, instr, "initial", parts, "vector"), (parts, 1))[
        :, 0
    ].astype(np.float32)
    out = np.empty_like(a, dtype=np.float32)
    for i in range(a.shape[1]):
        state = _alu_apply(first, a[:, i], state, reverse0)
        state = _alu_apply(second, state, b[:, i], reverse1)
        out[:, i] = state
    dst.write(out.reshape(dst.shape), instr)
    runtime.current().record(
        "vector",
        "tensor_tensor_scan",
        reads=operands.reads(data0=data0, data1=data1, initial=initial),
        writes=[("dst", dst)],
    )


# nki.isa.tensor_scalar_cumulative's docstring: "restricted to BF16, FP16, FP32, FP8, UINT8, UINT16, INT8, INT16".
_CUMULATIVE_DTYPES = {
    "bfloat16",
    "float16",
    "float32",
    *(dtypes.name(d) for d in dtypes.FP8),
    "uint8",
    "uint16",
    "int8",
    "int16",
}


def tensor_scalar_cumulative(
    dst: Tensor,
    src: Tensor,
    op0: Any,
    op1: Any,
    imm0: Any,
    imm1: Any = None,
    reduce_cmd: reduce_cmd = reduce_cmd.reset_reduce,
    name: str | None = None,
) -> None:
    """Running ``reg = (src[i] <op0> imm0) <op1> reg`` along the free dim, writing every step."""
    instr = "nisa.tensor_scalar_cumulative"
    first, second = as_alu(op0, instr, "op0"), as_alu(op1, instr, "op1")
    if second.name not in ("add", "subtract", "multiply", "maximum", "minimum"):
        raise rule(instr, "op1", "must be add, subtract, multiply, maximum or minimum", op=second.name)
    dst, src = operands.compute_tile(dst, instr, "dst", "vector"), operands.compute_tile(src, instr, "src", "vector")
    operands.same_layout(instr, "dst", dst, "src", src)
    indirection.check_lanes(instr, dst, "src", src)
    for role, t in (("src", src), ("dst", dst)):
        if dtypes.name(t.dtype) not in _CUMULATIVE_DTYPES:
            raise rule(
                instr, role, "dtype not supported (int32/uint32 are an ISA limitation)", dtype=dtypes.name(t.dtype)
            )
    parts = src.partition_size
    run = runtime.current()
    lanes = run.vector_accumulator[:parts]
    reduce_cmd = _CMD(reduce_cmd)
    if reduce_cmd == _CMD.reset_reduce:
        lanes[:] = second.identity if second.identity is not None else 0.0
    elif reduce_cmd == _CMD.load_reduce:
        lanes[:] = np.broadcast_to(operands.scalar_or_vector(imm1, instr, "imm1", parts, "vector"), (parts, 1))[:, 0]
    scaled = np.broadcast_to(
        _alu_apply(first, operands.rows(src), operands.scalar_or_vector(imm0, instr, "imm0", parts, "vector")),
        (parts, src.free_size),
    )
    out = np.empty((parts, src.free_size), dtype=np.float32)
    accumulate = second.binary
    assert accumulate is not None  # as_alu admits only operators with a binary form
    for i in range(src.free_size):
        lanes[:] = accumulate(scaled[:, i], lanes)
        out[:, i] = lanes
    dst.write(out.reshape(dst.shape), instr)
    run.record(
        "vector", "tensor_scalar_cumulative", reads=operands.reads(src=src, imm0=imm0, imm1=imm1), writes=[("dst", dst)]
    )


# ---------------------------------------------------------------------------------------------
# ScalarE
# ---------------------------------------------------------------------------------------------
def _activation_values(
    instr: str, op: Op, data: Tensor, bias: Any, scale: Any, relu_param: Any = 0.0
) -> np.ndarray | None:
    """``op(data * scale + bias)`` in fp32, after checking the operands; None in a trace-only run."""
    run = runtime.current()
    parts = data.partition_size
    if isinstance(scale, Tensor):
        if dtypes.name(scale.dtype) != "float32":
            raise rule(instr, "scale", "a scale vector must be float32", dtype=dtypes.name(scale.dtype))
    operands.check_scalar_or_vector(scale, instr, "scale", parts, "scalar")
    if bias is not None:
        if op.name == "reciprocal" and run.target.generation == 2:  # nki.api.shared.rst, engine selection
            raise rule(
                instr, "bias", "activation(op=nl.reciprocal) takes no bias on NeuronCore-v2", target=run.target.name
            )
        if not isinstance(bias, Tensor) and not run.target.bias_scalar_allowed:
            raise rule(instr, "bias", "NeuronCore-v2 takes bias only as a (P, 1) vector", target=run.target.name)
        if isinstance(bias, Tensor) and dtypes.name(bias.dtype) == "tfloat32":
            raise rule(instr, "bias", "tfloat32 bias is not supported")
        operands.check_scalar_or_vector(bias, instr, "bias", parts, "scalar")
    if op.name == "prelu":
        operands.check_scalar_or_vector(relu_param, instr, "relu_param", parts, "scalar")
    if not run.numerics:
        return None
    x = operands.rows(data).astype(np.float32, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):  # masked logits (-3.4e38) scale to -inf, as in fp32 hardware
        x = x * np.float32(1.0) * operands.scalar_or_vector_values(scale)
    if bias is not None:
        x = x + operands.scalar_or_vector_values(bias)
    if op.name == "prelu":
        slope = operands.scalar_or_vector_values(relu_param)
        return np.where(x >= 0, x, x * slope).astype(np.float32)
    unary = op.unary
    assert unary is not None  # as_activation admits only operators with a unary form
    return unary(x.astype(np.float32))


def activation(
    dst: Tensor,
    op: Any,
    data: Tensor,
    bias: Any = None,
    scale: Any = 1.0,
    reduce_op: Any = None,
    reduce_res: Tensor | None = None,
    reduce_cmd: reduce_cmd = reduce_cmd.idle,
    name: str | None = None,
) -> None:
    """``dst = op(data * scale + bias)`` on ScalarE, optionally add-reducing into the lane registers."""
    instr = "nisa.activation"
    fn = as_activation(op, instr)
    dst, data = operands.compute_tile(dst, instr, "dst", "scalar"), operands.compute_tile(data, instr, "data", "scalar")
    operands.same_layout(instr, "dst", dst, "data", data)
    indirection.check_lanes(instr, dst, "data", data)
    values = _activation_values(instr, fn, data, bias, scale)
    _write_activation(dst, values, instr)
    run = runtime.current()
    red = None
    reduce_cmd = _CMD(reduce_cmd)
    if reduce_op is not None or reduce_cmd != _CMD.idle:
        red = as_alu(reduce_op if reduce_op is not None else _OPS["add"], instr, "reduce_op")
        if red.name != "add":
            raise rule(instr, "reduce_op", "ScalarE reduces with nl.add only", op=red.name)
        stored = None if values is None else np.asarray(values, dtype=np.float32)  # accumulated before the output cast
        _accumulate(run.scalar_accumulator, data.partition_size, reduce_cmd, red, stored, None, instr)
    _read_out(reduce_res, run.scalar_accumulator, data.partition_size, instr, "scalar")
    run.record(
        "scalar",
        "activation",
        reads=operands.reads(data=data, bias=bias, scale=scale),
        writes=operands.reads(dst=dst, reduce_res=reduce_res),
        func=fn.name,
        reduce=red is not None,
    )


def _write_activation(dst: Tensor, values: np.ndarray | None, instr: str) -> None:
    """Store an activation's result (None: a trace-only run computed none)."""
    if values is None:
        dst.write_uncomputed(instr)
    else:
        dst.write(values.reshape(dst.shape), instr)


def activation_reduce(
    dst: Tensor,
    op: Any,
    data: Tensor,
    reduce_op: Any,
    reduce_res: Tensor,
    bias: Any = None,
    scale: Any = 1.0,
    name: str | None = None,
) -> None:
    """``activation`` plus a reduction of its result along the free dims into ``reduce_res``."""
    instr = "nisa.activation_reduce"
    red = as_alu(reduce_op, instr, "reduce_op")
    run = runtime.current()
    if run.target.generation == 2 and red.name != "add":
        raise rule(instr, "reduce_op", "NeuronCore-v2 reduces with nl.add only", op=red.name)
    fn = as_activation(op, instr)
    dst, data = operands.compute_tile(dst, instr, "dst", "scalar"), operands.compute_tile(data, instr, "data", "scalar")
    operands.same_layout(instr, "dst", dst, "data", data)
    indirection.check_lanes(instr, dst, "data", data)
    values = _activation_values(instr, fn, data, bias, scale)
    _write_activation(dst, values, instr)
    stored = None if values is None else np.asarray(values, dtype=np.float32)  # accumulated before the output cast
    _accumulate(run.scalar_accumulator, data.partition_size, _CMD.reset_reduce, red, stored, None, instr)
    _read_out(reduce_res, run.scalar_accumulator, data.partition_size, instr, "scalar")
    run.record(
        "scalar",
        "activation",
        reads=operands.reads(data=data, bias=bias, scale=scale),
        writes=operands.reads(dst=dst, reduce_res=reduce_res),
        func=fn.name,
        reduce=True,
    )


_ACTIVATE2_COMBOS = {
    ("multiply", "add"),
    ("multiply", "subtract"),
    ("multiply", "bypass"),
    ("add", "bypass"),
    ("subtract", "bypass"),
    ("bypass", "bypass"),
}


def activate2(
    dst: Tensor,
    op: Any,
    data: Tensor,
    imm0: Any,
    imm1: Any,
    op0: Any,
    op1: Any,
    relu_param: Any = 0.0,
    reverse0: bool = False,
    reverse1: bool = False,
    reduce_op: Any = None,
    reduce_res: Tensor | None = None,
    reduce_cmd: reduce_cmd = reduce_cmd.idle,
    name: str | None = None,
) -> None:
    """NeuronCore-v4 ScalarE: ``op((data <op0> imm0) <op1> imm1)`` with an optional reduction."""
    instr = "nisa.activate2"
    run = runtime.current()
    require_generation(instr, "target", run.target, 4, "activate2")
    fn = as_activation(op, instr)
    first, second = as_alu(op0, instr, "op0"), as_alu(op1, instr, "op1")
    if (first.name, second.name) not in _ACTIVATE2_COMBOS:
        raise rule(instr, "op0/op1", "unsupported operator pair", op0=first.name, op1=second.name)
    dst, data = operands.compute_tile(dst, instr, "dst", "scalar"), operands.compute_tile(data, instr, "data", "scalar")
    operands.same_layout(instr, "dst", dst, "data", data)
    indirection.check_lanes(instr, dst, "data", data)
    parts = data.partition_size
    x = _alu_apply(
        first, operands.rows(data), operands.scalar_or_vector(imm0, instr, "imm0", parts, "scalar"), reverse0
    )
    x = _alu_apply(second, x, operands.scalar_or_vector(imm1, instr, "imm1", parts, "scalar"), reverse1)
    if fn.name == "prelu":
        slope = operands.scalar_or_vector(relu_param, instr, "relu_param", parts, "scalar")
        values = np.where(x >= 0, x, x * slope).astype(np.float32)
    else:
        unary = fn.unary
        assert unary is not None  # as_activation admits only operators with a unary form
        values = unary(np.broadcast_to(x, (parts, data.free_size)).astype(np.float32))
    dst.write(values.reshape(dst.shape), instr)
    if reduce_op is not None:
        red = as_alu(reduce_op, instr, "reduce_op")
        if red.name not in ("add", "maximum", "minimum", "abs_max", "abs_min"):
            raise rule(instr, "reduce_op", "must be add, maximum, minimum, abs_max or abs_min", op=red.name)
        _accumulate(run.scalar_accumulator, parts, reduce_cmd, red, np.asarray(values, dtype=np.float32), None, instr)
    _read_out(reduce_res, run.scalar_accumulator, parts, instr, "scalar")
    run.record(
        "scalar",
        "activation",
        reads=operands.reads(data=data, imm0=imm0, imm1=imm1),
        writes=operands.reads(dst=dst, reduce_res=reduce_res),
        func=fn.name,
        reduce=reduce_op is not None,
    )


# ---------------------------------------------------------------------------------------------
# GpSimd patterns and selection
# ---------------------------------------------------------------------------------------------
def _affine_values(
    instr: str, pattern: Sequence[Sequence[int]], offset: int, channel_multiplier: int, parts: int, free: int
) -> np.ndarray:
    if not 1 <= len(pattern) <= 4:
        raise rule(instr, "pattern", "must have 1 to 4 [step, num] pairs", pattern=pattern)
    steps = [int(s) for s, _ in pattern]
    nums = [int(n) for _, n in pattern]
    if int(np.prod(nums)) != free:
        raise rule(
            instr,
            "pattern",
            "element count must equal dst's elements per partition",
            pattern_elements=int(np.prod(nums)),
            free_elements=free,
        )
    grids = np.meshgrid(*[np.arange(n, dtype=np.int64) for n in nums], indexing="ij")
    # Summed onto the first term (there is at least one): an array, where sum()'s default 0 start would type as int.
    free_part = sum((g * s for g, s in zip(grids[1:], steps[1:])), grids[0] * steps[0]).reshape(-1)
    lanes = np.arange(parts, dtype=np.int64)[:, None] * int(channel_multiplier)
    return int(offset) + lanes + free_part[None, :]


def iota(
    dst: Tensor, pattern: Sequence[Sequence[int]], offset: int = 0, channel_multiplier: int = 0, name: str | None = None
) -> None:
    """``dst[p, i] = offset + p * channel_multiplier + pattern(i)`` on GpSimd, in int32 arithmetic."""
    instr = "nisa.iota"
    dst = operands.compute_tile(dst, instr, "dst", "gpsimd", ("sbuf",))
    values = _affine_values(instr, pattern, offset, channel_multiplier, dst.partition_size, dst.free_size)
    dst.write(
        values.astype(np.int32).astype(np.float64 if dtypes.is_float(dst.dtype) else np.int64).reshape(dst.shape), instr
    )
    runtime.current().record("gpsimd", "iota", writes=[("dst", dst)])


def affine_select(
    dst: Tensor,
    pattern: Sequence[Sequence[int]],
    channel_multiplier: int,
    on_true_tile: Tensor,
    on_false_value: float,
    cmp_op: Any = None,
    offset: int = 0,
    name: str | None = None,
) -> None:
    """Keep ``on_true_tile`` where ``cmp_op(affine(p, i), 0)`` holds, else ``on_false_value`` (GpSimd)."""
    instr = "nisa.affine_select"
    compare = as_alu(cmp_op if cmp_op is not None else _OPS["equal"], instr, "cmp_op")
    dst = operands.compute_tile(dst, instr, "dst", "gpsimd", ("sbuf",))
    on_true_tile = operands.compute_tile(on_true_tile, instr, "on_true_tile", "gpsimd", ("sbuf",))
    operands.same_layout(instr, "dst", dst, "on_true_tile", on_true_tile)
    if isinstance(on_false_value, Tensor):
        raise rule(instr, "on_false_value", "must be a float32 scalar")
    values = _affine_values(instr, pattern, offset, channel_multiplier, dst.partition_size, dst.free_size)
    if runtime.current().numerics:
        assert compare.binary is not None  # as_alu admits only operators with a binary form
        keep = compare.binary(values.astype(np.float32), np.float32(0)) != 0
        chosen = np.where(keep, operands.rows(on_true_tile), np.float32(on_false_value))
        dst.write(chosen.reshape(dst.shape), instr)
    else:
        dst.write_uncomputed(instr)
    runtime.current().record("gpsimd", "affine_select", reads=[("on_true_tile", on_true_tile)], writes=[("dst", dst)])


_RANGE_COMPARE = {"equal", "less", "less_equal", "greater", "greater_equal"}


def range_select(
    dst: Tensor,
    on_true_tile: Tensor,
    comp_op0: Any,
    comp_op1: Any,
    bound0: Tensor,
    bound1: Tensor,
    reduce_cmd: reduce_cmd = reduce_cmd.reset_reduce,
    reduce_res: Tensor | None = None,
    reduce_op: Any = None,
    range_start: int = 0,
    on_false_value: float = operands.FP32_MIN,
    name: str | None = None,
) -> None:
    """Keep elements whose free index (+ ``range_start``) satisfies both bounds; max-reduce the result."""
    instr = "nisa.range_select"
    run = runtime.current()
    require_generation(instr, "target", run.target, 3, "range_select")
    c0, c1 = as_alu(comp_op0, instr, "comp_op0"), as_alu(comp_op1, instr, "comp_op1")
    for role, c in (("comp_op0", c0), ("comp_op1", c1)):
        if c.name not in _RANGE_COMPARE:
            raise rule(instr, role, "must be equal, less, less_equal, greater or greater_equal", op=c.name)
    red = as_alu(reduce_op if reduce_op is not None else _OPS["maximum"], instr, "reduce_op")
    if red.name != "maximum":
        raise rule(instr, "reduce_op", "only nl.maximum is supported", op=red.name)
    # The fill is an fp32 immediate: a decimal spelling that rounds to fp32's minimum (nki-library
    # writes -3.4028235e38) is that value.
    if float(np.float32(on_false_value)) != operands.FP32_MIN:
        raise rule(instr, "on_false_value", "the hardware fills with FP32_MIN only", value=on_false_value)
    dst = operands.compute_tile(dst, instr, "dst", "vector")
    on_true_tile = operands.compute_tile(on_true_tile, instr, "on_true_tile", "vector")
    if not dtypes.is_float(on_true_tile.dtype):
        raise rule(instr, "on_true_tile", "must be a float tile", dtype=dtypes.name(on_true_tile.dtype))
    operands.same_layout(instr, "dst", dst, "on_true_tile", on_true_tile)
    parts = on_true_tile.partition_size
    for role, bound in (("bound0", bound0), ("bound1", bound1)):
        if isinstance(bound, Tensor) and dtypes.name(bound.dtype) != "float32":  # "must be FP32 types"
            raise rule(instr, role, "must be float32", dtype=dtypes.name(bound.dtype))
    operands.check_scalar_or_vector(bound0, instr, "bound0", parts, "vector")
    operands.check_scalar_or_vector(bound1, instr, "bound1", parts, "vector")
    chosen = None
    if run.numerics:
        b0, b1 = operands.scalar_or_vector_values(bound0), operands.scalar_or_vector_values(bound1)
        index = (int(range_start) + np.arange(on_true_tile.free_size, dtype=np.float32))[None, :]
        assert c0.binary is not None and c1.binary is not None  # as_alu admits only operators with a binary form
        keep = (c0.binary(index, b0) != 0) & (c1.binary(index, b1) != 0)
        chosen = np.where(keep, operands.rows(on_true_tile), np.float32(operands.FP32_MIN)).astype(np.float32)
        dst.write(chosen.reshape(dst.shape), instr)
    else:
        dst.write_uncomputed(instr)
    _accumulate(run.vector_accumulator, parts, reduce_cmd, red, chosen, None, instr)
    _read_out(reduce_res, run.vector_accumulator, parts, instr, "vector")
    run.record(
        "vector",
        "range_select",
        reads=operands.reads(on_true_tile=on_true_tile, bound0=bound0, bound1=bound1),
        writes=operands.reads(dst=dst, reduce_res=reduce_res),
    )


def select_reduce(
    dst: Tensor,
    predicate: Tensor,
    on_true: Tensor,
    on_false: Any,
    reduce_res: Tensor | None = None,
    reduce_cmd: reduce_cmd = reduce_cmd.idle,
    reduce_op: Any = None,
    reverse_pred: bool = False,
    name: str | None = None,
) -> None:
    """``dst = where(predicate, on_true, on_false)``, optionally max-reducing into ``reduce_res``."""
    instr = "nisa.select_reduce"
    red = as_alu(reduce_op if reduce_op is not None else _OPS["maximum"], instr, "reduce_op")
    if red.name != "maximum":
        raise rule(instr, "reduce_op", "only nl.maximum is supported", op=red.name)
    dst = operands.compute_tile(dst, instr, "dst", "vector")
    predicate = operands.compute_tile(predicate, instr, "predicate", "vector")
    on_true = operands.compute_tile(on_true, instr, "on_true", "vector")
    operands.same_layout(instr, "dst", dst, "on_true", on_true)
    operands.same_layout(instr, "dst", dst, "predicate", predicate)
    operands.not_both_psum(instr, "on_true", on_true, "predicate", predicate)
    if dtypes.name(on_true.dtype) in ("tfloat32", "int32", "uint32"):
        raise rule(instr, "on_true", "tfloat32/int32/uint32 are not supported", dtype=dtypes.name(on_true.dtype))
    if dtypes.name(predicate.dtype) not in ("int8", "uint8", "int16", "uint16"):  # the docstring's dtype list
        raise rule(instr, "predicate", "must be int8, uint8, int16 or uint16", dtype=dtypes.name(predicate.dtype))
    parts = on_true.partition_size
    fallback = operands.scalar_or_vector(on_false, instr, "on_false", parts, "vector")
    mask = operands.rows(predicate) != 0
    if reverse_pred:
        mask = ~mask
    chosen = np.where(mask, operands.rows(on_true), fallback).astype(np.float32)
    dst.write(chosen.reshape(dst.shape), instr)
    run = runtime.current()
    _accumulate(run.vector_accumulator, parts, reduce_cmd, red, chosen, None, instr)
    _read_out(reduce_res, run.vector_accumulator, parts, instr, "vector")
    run.record(
        "vector",
        "select_reduce",
        reads=operands.reads(predicate=predicate, on_true=on_true, on_false=on_false),
        writes=operands.reads(dst=dst, reduce_res=reduce_res),
    )


def _eight(instr: str, dst: Tensor, src: Tensor) -> None:
    if not operands.MAX8_MIN <= src.free_size <= operands.MAX8_MAX:
        raise rule(instr, "src", "needs 8 to 16384 elements per partition", free_elements=src.free_size)
    if dst.partition_size != src.partition_size or dst.free_size != 8:
        raise rule(instr, "dst", "must have shape (partitions, 8)", dst=list(dst.shape))


def max8(dst: Tensor, src: Tensor, name: str | None = None) -> None:
    """The 8 largest values of each partition, in descending order."""
    instr = "nisa.max8"
    dst, src = operands.compute_tile(dst, instr, "dst", "vector"), operands.compute_tile(src, instr, "src", "vector")
    _eight(instr, dst, src)
    values = -np.sort(-operands.rows(src).astype(np.float32, copy=False), axis=1)[:, :8]
    dst.write(values.reshape(dst.shape), instr)
    runtime.current().record("vector", "max8", reads=[("src", src)], writes=[("dst", dst)])


def _pair_occurrences(data: np.ndarray, vals: np.ndarray, order: Sequence[int]) -> np.ndarray:
    """Per partition, the position in ``data`` of each of ``vals`` (-1 where none is left), taking
    ``vals`` in ``order`` and giving each the first occurrence no earlier value has claimed: a value
    repeated in ``vals`` (max8 of a row with a repeated maximum) gets a distinct occurrence each time."""
    claimed = np.zeros(data.shape, dtype=bool)
    index = np.full(vals.shape, -1, dtype=np.int64)
    lanes = np.arange(data.shape[0])
    for j in order:
        hits = (data == vals[:, j : j + 1]) & ~claimed
        found = hits.any(axis=1)
        first = hits.argmax(axis=1)
        index[:, j] = np.where(found, first, -1)
        claimed[lanes[found], first[found]] = True
    return index


def nc_find_index8(dst: Tensor, data: Tensor, vals: Tensor, name: str | None = None) -> None:
    """Index of the first occurrence of each of 8 values in each partition of ``data``."""
    instr = "nisa.nc_find_index8"
    dst = operands.compute_tile(dst, instr, "dst", "vector")
    data, vals = (
        operands.compute_tile(data, instr, "data", "vector"),
        operands.compute_tile(vals, instr, "vals", "vector"),
    )
    _eight(instr, dst, data)
    if dtypes.name(dst.dtype) not in ("uint16", "uint32"):
        raise rule(instr, "dst", "must be uint16 or uint32", dtype=dtypes.name(dst.dtype))
    if vals.free_size != 8 or vals.partition_size != data.partition_size:
        raise rule(instr, "vals", "must hold 8 values per partition", shape=list(vals.shape))
    # Duplicates in vals take successive occurrences in ascending order; a value not found gets the
    # all-ones sentinel of dst's dtype (nki.isa.nc_find_index8's docstring).
    found = _pair_occurrences(
        operands.rows(data).astype(np.float32, copy=False),
        operands.rows(vals).astype(np.float32, copy=False),
        range(8),
    )
    sentinel = np.iinfo(dtypes.storage(dst.dtype)).max
    dst.write(np.where(found < 0, sentinel, found).reshape(dst.shape), instr)
    runtime.current().record("vector", "nc_find_index8", reads=[("data", data), ("vals", vals)], writes=[("dst", dst)])


def nc_match_replace8(
    dst: Tensor, data: Tensor, vals: Tensor, imm: float, dst_idx: Tensor | None = None, name: str | None = None
) -> None:
    """Replace the first occurrence of each of 8 values with ``imm`` (and report where)."""
    instr = "nisa.nc_match_replace8"
    dst = operands.compute_tile(dst, instr, "dst", "vector")
    data, vals = (
        operands.compute_tile(data, instr, "data", "vector"),
        operands.compute_tile(vals, instr, "vals", "vector"),
    )
    operands.same_layout(instr, "dst", dst, "data", data)
    if vals.free_size != 8 or vals.partition_size != data.partition_size:
        raise rule(instr, "vals", "must hold 8 values per partition", shape=list(vals.shape))
    rows = operands.rows(data).astype(np.float32, copy=False).copy()
    # vals are processed from the last to the first (nki.isa.nc_match_replace8's docstring), so of
    # repeated vals the last one takes the first occurrence: data [1, 2, 3, 4, 8 x 7] with vals
    # [3, 8 x 7] gives dst_idx [2, 10, 9, 8, 7, 6, 5, 4].
    found = _pair_occurrences(rows, operands.rows(vals).astype(np.float32, copy=False), range(7, -1, -1))
    lanes, slots = np.nonzero(found >= 0)
    rows[lanes, found[lanes, slots]] = np.float32(imm)
    index = np.maximum(found, 0)  # the docs name no index for an unmatched value: 0
    dst.write(rows.reshape(dst.shape), instr)
    if dst_idx is not None:
        dst_idx = operands.compute_tile(dst_idx, instr, "dst_idx", "vector")
        dst_idx.write(index.reshape(dst_idx.shape), instr)
    runtime.current().record(
        "vector",
        "nc_match_replace8",
        reads=[("data", data), ("vals", vals)],
        writes=operands.reads(dst=dst, dst_idx=dst_idx),
    )


def nc_n_gather(dst: Tensor, data: Tensor, indices: Tensor, name: str | None = None) -> None:
    """Per-partition gather from the flattened free dims of ``data`` (GpSimd)."""
    instr = "nisa.nc_n_gather"
    dst = operands.compute_tile(dst, instr, "dst", "gpsimd", ("sbuf",))
    data = operands.compute_tile(data, instr, "data", "gpsimd", ("sbuf",))
    indices = operands.compute_tile(indices, instr, "indices", "gpsimd", ("sbuf",))
    if dtypes.name(indices.dtype) != "uint32":
        raise rule(instr, "indices", "must be uint32", dtype=dtypes.name(indices.dtype))
    if data.dtype != dst.dtype:
        raise rule(instr, "dst", "must have data's dtype", dst=dtypes.name(dst.dtype), data=dtypes.name(data.dtype))
    operands.same_layout(instr, "dst", dst, "indices", indices)
    idx = np.asarray(indices.read()).reshape(indices.partition_size, -1).astype(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= data.free_size):
        raise rule(
            instr,
            "indices",
            "out of range of data's elements per partition",
            max_index=int(idx.max()),
            limit=data.free_size,
        )
    rows = np.asarray(data.read()).reshape(data.partition_size, -1)
    dst.write(np.take_along_axis(rows, idx, axis=1).reshape(dst.shape), instr)
    runtime.current().record(
        "gpsimd", "nc_n_gather", reads=[("data", data), ("indices", indices)], writes=[("dst", dst)]
    )


def nc_stream_shuffle(dst: Tensor, src: Tensor, shuffle_mask: Sequence[int], name: str | None = None) -> None:
    """Move partitions within each 32-partition quadrant: ``dst[i] = src[mask[i]]`` (255 keeps dst)."""
    instr = "nisa.nc_stream_shuffle"
    dst, src = operands.compute_tile(dst, instr, "dst", "vector"), operands.compute_tile(src, instr, "src", "vector")
    if dst.dtype != src.dtype or dst.free_size != src.free_size:
        raise rule(instr, "dst", "must match src's dtype and elements per partition")
    # Both starts follow the alignment of the active partitions of the larger side, rounded up to
    # whole quadrants (nki.isa.nc_stream_shuffle's docstring, constraint 3).
    active = -(-max(src.partition_size, dst.partition_size) // 32) * 32
    starts = tuple(range(0, 128 - active + 1, active))  # the span's multiples within 128 partitions
    for role, t in (("src", src), ("dst", dst)):
        if t.start_partition not in starts:
            raise rule(
                instr,
                role,
                f"with {active} active partitions the start partition must be one of {starts}",
                start_partition=t.start_partition,
                src_partitions=src.partition_size,
                dst_partitions=dst.partition_size,
            )
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != 32:
        raise rule(instr, "shuffle_mask", "must have 32 entries", length=len(mask))
    rows = np.asarray(src.read()).reshape(src.partition_size, -1)
    out = np.asarray(dst.read()).reshape(dst.partition_size, -1).copy()
    for p in range(dst.partition_size):
        quadrant, lane = divmod(p, 32)
        if mask[lane] != 255:
            out[p] = rows[quadrant * 32 + mask[lane]]
    dst.write(out.reshape(dst.shape), instr)
    runtime.current().record("vector", "nc_stream_shuffle", reads=[("src", src)], writes=[("dst", dst)])


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------
def bn_stats(dst: Tensor, data: Tensor, name: str | None = None) -> None:
    """Per partition: (count, mean, var*count) of the even and of the odd elements (≤512 per call)."""
    instr = "nisa.bn_stats"
    dst, data = operands.compute_tile(dst, instr, "dst", "vector"), operands.compute_tile(data, instr, "data", "vector")
    if data.free_size > operands.BN_STATS_FMAX:
        raise rule(
            instr, "data", "free size exceeds bn_stats_fmax", free_elements=data.free_size, limit=operands.BN_STATS_FMAX
        )
    if dst.partition_size != data.partition_size or dst.free_size != 6:
        raise rule(instr, "dst", "must hold 6 statistics per partition", dst=list(dst.shape))
    run = runtime.current()
    if not run.numerics:
        dst.write_uncomputed(instr)
        run.record("vector", "bn_stats", reads=[("data", data)], writes=[("dst", dst)])
        return
    rows = operands.rows(data).astype(np.float32, copy=False)
    out = []
    for half in (rows[:, 0::2], rows[:, 1::2]):
        count = np.float32(half.shape[1])
        with np.errstate(invalid="ignore", over="ignore"):  # inf and NaN propagate, as on the engine
            mean = half.mean(axis=1, dtype=np.float32) if half.shape[1] else np.zeros(rows.shape[0], np.float32)
            m2 = ((half - mean[:, None]) ** 2).sum(axis=1, dtype=np.float32)
        out += [np.full(rows.shape[0], count, np.float32), mean, m2]
    dst.write(np.stack(out, axis=1).reshape(dst.shape), instr)
    run.record("vector", "bn_stats", reads=[("data", data)], writes=[("dst", dst)])


def bn_aggr(dst: Tensor, data: Tensor, name: str | None = None) -> None:
    """Combine (count, mean, var*count) triples into a mean and a (population) variance per partition."""
    instr = "nisa.bn_aggr"
    dst, data = operands.compute_tile(dst, instr, "dst", "vector"), operands.compute_tile(data, instr, "data", "vector")
    if data.free_size % 3:
        raise rule(instr, "data", "elements per partition must be a multiple of 3", free_elements=data.free_size)
    if dst.partition_size != data.partition_size or dst.free_size != 2:
        raise rule(instr, "dst", "must hold (mean, variance) per partition", dst=list(dst.shape))
    run = runtime.current()
    if run.numerics:
        triples = operands.rows(data).astype(np.float32, copy=False).reshape(data.partition_size, -1, 3)
        count, mean, m2 = triples[..., 0], triples[..., 1], triples[..., 2]
        total = count.sum(axis=1)
        with np.errstate(all="ignore"):
            grand = (count * mean).sum(axis=1) / total
            var = (m2 + count * (mean - grand[:, None]) ** 2).sum(axis=1) / total
        dst.write(np.stack([grand, var], axis=1).reshape(dst.shape), instr)
    else:
        dst.write_uncomputed(instr)
    run.record("vector", "bn_aggr", reads=[("data", data)], writes=[("dst", dst)])


def exponential(
    dst: Tensor,
    src: Tensor,
    max_value: Any = 0.0,
    reduce_res: Tensor | None = None,
    reduce_cmd: reduce_cmd = reduce_cmd.idle,
    reduce_init: Any = 0.0,
    name: str | None = None,
) -> None:
    """NeuronCore-v4 VectorE: ``dst = exp(src - max_value)`` with an optional running sum."""
    instr = "nisa.exponential"
    run = runtime.current()
    if not run.target.has_exponential:
        raise too_old(instr, "target", run.target.name, 4, "exponential")
    dst, src = operands.compute_tile(dst, instr, "dst", "vector"), operands.compute_tile(src, instr, "src", "vector")
    operands.same_layout(instr, "dst", dst, "src", src)
    indirection.check_lanes(instr, dst, "src", src)
    parts = src.partition_size
    shift = operands.scalar_or_vector(max_value, instr, "max_value", parts, "vector")
    with np.errstate(all="ignore"):
        values = np.exp(operands.rows(src).astype(np.float32, copy=False) - shift).astype(np.float32)
    dst.write(values.reshape(dst.shape), instr)
    if _CMD(reduce_cmd) != _CMD.idle:
        _accumulate(
            run.vector_accumulator,
            parts,
            reduce_cmd,
            _OPS["add"],
            np.asarray(values, dtype=np.float32),
            reduce_init,
            instr,
        )
    _read_out(reduce_res, run.vector_accumulator, parts, instr, "vector")
    run.record(
        "vector",
        "exponential",
        reads=operands.reads(src=src, max_value=max_value),
        writes=operands.reads(dst=dst, reduce_res=reduce_res),
    )


# ---------------------------------------------------------------------------------------------
# random numbers
# ---------------------------------------------------------------------------------------------
def rng(dst: Tensor, engine: engine = engine.unknown, name: str | None = None) -> None:
    """32 random bits per element, truncated to ``dst``'s integer dtype (seed with set_rng_seed)."""
    instr = "nisa.rng"
    run = runtime.current()
    allowed = ("vector",) if run.target.generation == 2 else ("vector", "gpsimd")
    eng = operands.engine_for(engine, instr, allowed, "vector")
    dst = operands.compute_tile(dst, instr, "dst", eng)
    if not operands.is_int(dst):
        raise rule(instr, "dst", "must be an integer tile", dtype=dtypes.name(dst.dtype))
    if prng.is_seeded(run, eng):  # rand_set_state gave this engine's lanes their state
        lanes = prng.draw(run, eng, dst.start_partition, dst.partition_size, dst.free_size)
        bits = lanes.astype(np.uint64).reshape(dst.shape)
    else:
        bits = run.rng.integers(0, 2**32, size=dst.shape, dtype=np.uint64)
    dst.write((bits & np.uint64((1 << (8 * dtypes.itemsize(dst.dtype))) - 1)).astype(dtypes.storage(dst.dtype)), instr)
    run.record(eng, "rng", writes=[("dst", dst)])


def set_rng_seed(src_seeds: Tensor, name: str | None = None) -> None:
    """Seed the VectorE generator from a [1, 1] 32-bit tile."""
    instr = "nisa.set_rng_seed"
    src_seeds = operands.compute_tile(src_seeds, instr, "src_seeds", "vector")
    if src_seeds.size != 1 or dtypes.itemsize(src_seeds.dtype) != 4:
        raise rule(
            instr,
            "src_seeds",
            "must be a [1, 1] 32-bit tile",
            shape=list(src_seeds.shape),
            dtype=dtypes.name(src_seeds.dtype),
        )
    seed = int(np.asarray(src_seeds.computed_values(instr, "src_seeds")).view(np.uint32).reshape(-1)[0])
    run = runtime.current()
    run.rng = np.random.default_rng(seed)
    run.record("vector", "set_rng_seed", reads=[("src_seeds", src_seeds)])


def rand2(dst: Tensor, min: Any, max: Any, name: str | None = None) -> None:
    """NeuronCore-v4: uniform random values in [min, max]."""
    instr = "nisa.rand2"
    run = runtime.current()
    require_generation(instr, "target", run.target, 4, "rand2")
    dst = operands.compute_tile(dst, instr, "dst", "vector")
    parts = dst.partition_size
    lo = operands.scalar_or_vector(min, instr, "min", parts, "vector")
    hi = operands.scalar_or_vector(max, instr, "max", parts, "vector")
    if np.any(np.asarray(lo) >= np.asarray(hi)):
        raise rule(instr, "min/max", "min must be below max")
    values = lo + (hi - lo) * run.rng.random((parts, dst.free_size), dtype=np.float32)
    dst.write(values.reshape(dst.shape), instr)
    run.record("vector", "rand2", reads=operands.reads(min=min, max=max), writes=[("dst", dst)])


def dropout(dst: Tensor, data: Tensor, prob: Any, name: str | None = None) -> None:
    """Zero each element with probability ``prob`` (scalar or [P, 1]); kept values are unscaled."""
    instr = "nisa.dropout"
    dst, data = operands.compute_tile(dst, instr, "dst", "vector"), operands.compute_tile(data, instr, "data", "vector")
    operands.same_layout(instr, "dst", dst, "data", data)
    if dst.dtype != data.dtype:
        raise rule(instr, "dst", "must have data's dtype", dst=dtypes.name(dst.dtype), data=dtypes.name(data.dtype))
    parts = data.partition_size
    p = operands.scalar_or_vector(prob, instr, "prob", parts, "vector")
    run = runtime.current()
    keep = run.rng.random((parts, data.free_size), dtype=np.float32) >= p
    rows = np.asarray(data.read()).reshape(parts, -1)
    dst.write(np.where(keep, rows, np.zeros((), rows.dtype)).reshape(dst.shape), instr)
    run.record("vector", "dropout", reads=operands.reads(data=data, prob=prob), writes=[("dst", dst)])


def dma_compute(
    dst: Tensor,
    srcs: Sequence[Tensor],
    reduce_op: Any,
    scales: Sequence[float] | None = None,
    unique_indices: bool = True,
    oob_mode: oob_mode = oob_mode.error,
    name: str | None = None,
) -> None:
    """``dst = srcs[0] + srcs[1] + ...`` computed in fp32 by the DMA engines."""
    instr = "nisa.dma_compute"
    red = as_alu(reduce_op, instr, "reduce_op")
    if red.name != "add":
        raise rule(instr, "reduce_op", "only nl.add is supported", op=red.name)
    if scales is not None and any(float(s) != 1.0 for s in scales):
        raise rule(instr, "scales", "all scales must be 1.0", scales=list(scales))
    if not 1 <= len(srcs) <= 16:
        raise rule(instr, "srcs", "takes 1 to 16 source tensors", count=len(srcs))
    dst = operands.tile(dst, instr, "dst")
    operands.where(dst, instr, "dst", ("hbm", "sbuf"))
    srcs = [operands.tile(src, instr, f"srcs[{i}]") for i, src in enumerate(srcs)]
    for i, src in enumerate(srcs):
        operands.where(src, instr, f"srcs[{i}]", ("hbm", "sbuf"))
        if src.size != dst.size:
            raise rule(instr, f"srcs[{i}]", "element count differs from dst", src=list(src.shape), dst=list(dst.shape))
    if dst._indirect is not None or any(src._indirect is not None for src in srcs):
        _check_read_modify_write(instr, dst, srcs, unique_indices)
    skip = _OOB(oob_mode) == _OOB.skip
    total = np.zeros(dst.size, dtype=np.float32)
    keep = None  # elements a skipped out-of-bounds gather index leaves as they were
    for src in srcs:
        values, inside = _dma_read(src, instr, skip)
        total = total + dtypes.to_engine(values).reshape(-1)
        if inside is not None:
            keep = inside.reshape(-1) if keep is None else keep & inside.reshape(-1)
    _dma_write(dst, total, instr, skip, keep)
    runtime.current().record(
        "dma",
        "dma_compute",
        reads=[(f"srcs[{i}]", s) for i, s in enumerate(srcs)],
        writes=[("dst", dst)],
        bytes_moved=dst.nbytes * (len(srcs) + 1),
        partitions=dst.partition_size,
        bytes_per_partition=dst.nbytes // max(dst.partition_size, 1),
        contiguous_bytes=_contiguous_bytes(dst),
    )


def _same_access(a: Tensor, b: Tensor) -> bool:
    """Whether two operands name the same memory (for an indirect view: the same index and pattern)."""
    if a._buf is not b._buf:
        return False
    if a._indirect is None or b._indirect is None:
        return a._indirect is None and b._indirect is None and a.shape == b.shape and a.region() == b.region()
    ia, ib = a._indirect, b._indirect
    return ia.index is ib.index and (ia.dim, ia.start, ia.steps, ia.nums) == (ib.dim, ib.start, ib.steps, ib.nums)


def _check_read_modify_write(instr: str, dst: Tensor, srcs: Sequence[Tensor], unique_indices: bool) -> None:
    """dma_compute with a ``vector_offset`` source: AWS's scatter and gather read-modify-write modes.

    Scatter: ``dst`` is an indirect HBM view, one source is that same view and the other is in SBUF.
    Gather: ``dst`` is in SBUF, one source is an indirect HBM view and the other is ``dst`` itself.
    """
    if len(srcs) != 2:
        raise rule(instr, "srcs", "read-modify-write (vector_offset) takes exactly 2 sources", count=len(srcs))
    if not unique_indices:
        raise rule(instr, "unique_indices", "must be True with vector_offset (non-unique indices are not supported)")
    if dst._indirect is not None:
        if dst.on_chip:
            raise rule(instr, "dst", "a scatter read-modify-write writes an indirect HBM view")
        matches = [i for i, src in enumerate(srcs) if _same_access(src, dst)]
        other = srcs[1 - matches[0]] if matches else None
        if other is None or other.buffer != "sbuf":
            raise rule(
                instr,
                "srcs",
                "a scatter read-modify-write needs one source that is dst's indirect view and one in SBUF",
            )
        return
    gathers = [i for i, src in enumerate(srcs) if src._indirect is not None]
    if dst.buffer != "sbuf" or len(gathers) != 1 or srcs[gathers[0]].on_chip:
        raise rule(
            instr,
            "dst/srcs",
            "a gather read-modify-write writes an SBUF dst from one indirect HBM source and dst itself",
        )
    if not _same_access(srcs[1 - gathers[0]], dst):
        raise rule(instr, "srcs", "a gather read-modify-write's other source must be dst itself")


# ---------------------------------------------------------------------------------------------
# registers (dynamic control flow)
# ---------------------------------------------------------------------------------------------
class VirtualRegister:
    """An engine-sequencer register; in the simulator it simply holds a Python int."""

    def __init__(self, state: int | None = None, frozen: bool = False) -> None:
        self.value = state
        self.frozen = frozen

    def __int__(self) -> int:
        if self.value is None:
            raise NkiValidationError("register read before any value was moved or loaded into it")
        return int(self.value)

    __index__ = __int__

    def __bool__(self) -> bool:
        return int(self) != 0

    def __repr__(self) -> str:
        return f"VirtualRegister({self.value})"


def register_alloc(x: int | None = None) -> VirtualRegister:
    return VirtualRegister(x)


def register_move(dst: VirtualRegister, src: int | VirtualRegister) -> None:
    dst.value = int(src)


def register_load(dst: VirtualRegister, src: Tensor) -> None:
    src = operands.tile(src, "nisa.register_load", "src")
    if src.size != 1:
        raise rule("nisa.register_load", "src", "must hold exactly one element", shape=list(src.shape))
    dst.value = int(
        np.asarray(dtypes.to_engine(np.asarray(src.computed_values("nisa.register_load", "src")))).reshape(-1)[0]
    )


def register_store(dst: Tensor, src: VirtualRegister) -> None:
    dst = operands.tile(dst, "nisa.register_store", "dst")
    if dst.size != 1:
        raise rule("nisa.register_store", "dst", "must hold exactly one element", shape=list(dst.shape))
    dst.write(np.full(dst.shape, int(src)), "nisa.register_store")


# ---------------------------------------------------------------------------------------------
# instruction handles
# ---------------------------------------------------------------------------------------------
class NkiInstruction:
    """What an ``nki.isa`` instruction returns: a handle to its trace record.

    ``c.depends_on(a, b, kind=...)`` adds edges: c runs after a and b. The simulator executes in program
    order anyway; the edges are kept in the trace for the cost model's schedule: a ``runtime`` edge (the
    default, which is what omitting ``kind`` did before NKI 2.33 added it) in ``attrs["depends_on"]``,
    where the consumer starts once the producer has finished; a ``schedule`` edge in
    ``attrs["issued_after"]``, where it only starts no earlier than the producer starts.
    """

    __slots__ = ("instruction",)

    def __init__(self, instruction: Instruction | None) -> None:
        self.instruction = instruction

    def depends_on(self, *producers: NkiInstruction, kind: dependency | str | None = None) -> NkiInstruction:
        try:
            edge = dependency.runtime if kind is None else dependency(kind)
        except ValueError:
            raise rule(
                "NkiInstruction.depends_on", "kind", "must be nki.isa.dependency.runtime or .schedule", kind=kind
            ) from None
        for producer in producers:
            if not isinstance(producer, NkiInstruction):
                raise TypeError(f"depends_on: expected instructions returned by nki.isa, got {type(producer).__name__}")
            if self.instruction is None or producer.instruction is None:
                continue  # an instruction that recorded nothing (register moves) orders nothing
            if producer.instruction.index >= self.instruction.index:
                raise rule(
                    "NkiInstruction.depends_on",
                    "producers",
                    "a producer must come earlier in program order",
                    producer=producer.instruction.op,
                    consumer=self.instruction.op,
                )
            key = "depends_on" if edge is dependency.runtime else "issued_after"
            self.instruction.attrs.setdefault(key, []).append(producer.instruction.index)
        return self

    def __repr__(self) -> str:
        op = self.instruction.op if self.instruction is not None else "nothing recorded"
        return f"<NkiInstruction {op}>"


def get_nc_sub_version() -> int:
    """The silicon revision within the target's ``nc_version`` generation: 0 (the first revision).

    The simulator models each generation's first revision only.
    """
    runtime.current()  # like get_nc_version, only meaningful inside a kernel
    return 0


def _returns_handle(function: Any) -> Any:
    """Make an instruction return an ``NkiInstruction`` for the last trace record it made."""

    @functools.wraps(function)
    def instruction(*args: Any, **kwargs: Any) -> NkiInstruction:
        run = runtime.current()
        before = len(run.trace.instructions)
        function(*args, **kwargs)
        made = run.trace.instructions
        return NkiInstruction(made[-1] if len(made) > before else None)

    return instruction


_NOT_INSTRUCTIONS = {"get_nc_version", "get_nc_sub_version", "register_alloc"}
for _name in __all__:
    _value = globals()[_name]
    # Every function of the API (a plain function here, a Cython function in a compiled build), no class.
    is_function = callable(_value) and not isinstance(_value, type)
    if is_function and _name not in _NOT_INSTRUCTIONS and not _name.startswith("register"):
        globals()[_name] = _returns_handle(_value)
del _name, _value, is_function
