"""``nki.isa``'s microscaling (MX) instructions on NeuronCore-v4: ``quantize_mx`` and ``nc_matmul_mx``.

The layout, as AWS documents it (the ``nc_matmul_mx`` / ``quantize_mx`` references, the Trainium3
architecture guide and the MXFP matmul deep dive with its CPU reference):

- an ``_x4`` element packs four values that are consecutive along the contraction dim: FP8 values one
  byte each in a 32-bit word (first value in the lowest byte), FP4 (e2m1) values one nibble each in a
  16-bit word (first value in the lowest nibble);
- one scale (an e8m0 byte: the power of two ``2**(byte - 127)``) covers a group of 8 partitions x one
  ``_x4`` column (32 values);
- scale tiles keep each group in the SBUF quadrant (32 partitions) of its data: group ``g`` (data
  partitions ``8g .. 8g + 7``) sits on partition ``32 * (g // 4) + g % 4`` of the scale view, so a
  data tile within one quadrant has its scales on partitions 0..3 and a view starting at partition 4
  packs a second tensor's scales beside the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from . import dtypes, indirection, operands, runtime
from .errors import require_generation, rule
from .memory import QUADRANT
from .tensor import Tensor

GROUP_PARTITIONS = 8  # a scaling group spans 8 partitions x one x4 element
SCALE_BIAS = 127
_FP8_ELEMENTS = {
    "float8_e5m2_x4": np.dtype(ml_dtypes.float8_e5m2),
    "float8_e4m3fn_x4": np.dtype(ml_dtypes.float8_e4m3fn),
}
# e2m1 magnitudes by their three low bits; bit 3 is the sign.
_FP4_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
# The largest unbiased exponent of each element format (OCP MX): 8 for e4m3fn, 15 for e5m2.
_MAX_EXPONENT = {"float8_e4m3fn_x4": 8, "float8_e5m2_x4": 15}
_SCALE_DTYPES = ("float8_e8m0fnu", "uint8")


def _check_nc_v4(instr: str) -> runtime.Run:
    run = runtime.current()
    require_generation(instr, "target", run.target, 4)
    return run


def _data_partitions(instr: str, role: str, t: Tensor) -> int:
    parts = t.partition_size
    if parts % QUADRANT or parts > operands.PE_ARRAY:
        raise rule(instr, role, "partition dim must be a multiple of 32, at most 128", partitions=parts)
    return parts


def scale_rows(data_partitions: int) -> np.ndarray:
    """Partition (within the scale view) of each scaling group of a data tile with this many partitions."""
    groups = np.arange(data_partitions // GROUP_PARTITIONS)
    return QUADRANT * (groups // 4) + groups % 4


def _scale_view(instr: str, role: str, scale: Tensor, data_partitions: int, columns: int) -> Tensor:
    """Checks of a scale operand: SBUF, e8m0 or uint8 bytes, room for every group's row and column."""
    scale = indirection.bind(operands.tile(scale, instr, role), instr, role, "tensor")
    operands.where(scale, instr, role, ("sbuf",))
    if dtypes.name(scale.dtype) not in _SCALE_DTYPES:
        raise rule(instr, role, "must be float8_e8m0fnu or uint8", dtype=dtypes.name(scale.dtype))
    needed = int(scale_rows(data_partitions)[-1]) + 1
    if scale.partition_size < needed or scale.free_size < columns:
        raise rule(
            instr,
            role,
            "too small for the data's scaling groups (each stays in its data's 32-partition quadrant)",
            shape=list(scale.shape),
            needs_partitions=needed,
            needs_columns=columns,
        )
    return scale


def _read_scales(scale: Tensor, data_partitions: int, columns: int) -> np.ndarray:
    """The [groups, columns] powers of two a scale view holds for a data tile."""
    raw = np.asarray(scale.read()).view(np.uint8).reshape(scale.partition_size, -1)
    exponents = raw[scale_rows(data_partitions), :columns].astype(np.int32)
    return np.ldexp(np.float32(1.0), exponents - SCALE_BIAS).astype(np.float32)


def unpack_x4(t: Tensor) -> np.ndarray:
    """The values of an ``_x4`` tile as fp32, shaped [partitions, columns, 4]."""
    name = dtypes.name(t.dtype)
    words = np.ascontiguousarray(np.asarray(t.read())).reshape(t.partition_size, -1)
    if name in _FP8_ELEMENTS:
        values = words.view(np.uint8).view(_FP8_ELEMENTS[name]).astype(np.float32)
        return values.reshape(t.partition_size, -1, 4)
    nibbles = (words[..., None].astype(np.uint32) >> (4 * np.arange(4, dtype=np.uint32))) & 0xF
    magnitude = _FP4_MAGNITUDES[nibbles & 0x7]
    return np.where(nibbles & 0x8, -magnitude, magnitude).astype(np.float32)


def quantize_mx(dst: Tensor, src: Tensor, dst_scale: Tensor, name: str | None = None) -> None:
    """Quantize fp16/bf16 ``src`` [P, F] to MXFP8 ``dst`` [P, F / 4] and its scales (VectorE, NeuronCore-v4).

    Each group of 8 partitions x 4 consecutive elements gets the scale
    ``2**(floor(log2(max |v|)) - (E_max - 1))`` (2**-127 for an all-zero group), twice the OCP sample
    algorithm's as AWS's reference states (the deep dive's CPU reference uses the OCP one; the newer
    API reference is followed), and each value ``v / scale`` is rounded to the element format.
    """
    instr = "nisa.quantize_mx"
    run = _check_nc_v4(instr)
    src = operands.compute_tile(src, instr, "src", "vector", ("sbuf",))
    dst = operands.compute_tile(dst, instr, "dst", "vector", ("sbuf",))
    if dtypes.name(src.dtype) not in ("float16", "bfloat16"):
        raise rule(instr, "src", "must be float16 or bfloat16", dtype=dtypes.name(src.dtype))
    dst_name = dtypes.name(dst.dtype)
    if dst_name not in _MAX_EXPONENT:
        raise rule(instr, "dst", "must be float8_e5m2_x4 or float8_e4m3fn_x4", dtype=dst_name)
    parts = _data_partitions(instr, "src", src)
    if src.free_size % 4:
        raise rule(instr, "src", "free size must be a multiple of 4", free=src.free_size)
    columns = src.free_size // 4
    if dst.partition_size != parts or dst.free_size != columns:
        raise rule(
            instr, "dst", "must be [src partitions, src free / 4]", dst=list(dst.shape), expected=[parts, columns]
        )
    dst_scale = _scale_view(instr, "dst_scale", dst_scale, parts, columns)
    if dst_scale.free_size != columns:
        raise rule(
            instr, "dst_scale", "free size must be src's free size / 4", free=dst_scale.free_size, expected=columns
        )
    values = np.asarray(src.read()).astype(np.float32).reshape(parts // GROUP_PARTITIONS, GROUP_PARTITIONS, columns, 4)
    largest = np.abs(values).max(axis=(1, 3))
    _, exponent = np.frexp(largest)  # largest = m * 2**exponent with m in [0.5, 1): floor(log2) = exponent - 1
    biased = exponent - 1 - (_MAX_EXPONENT[dst_name] - 1) + SCALE_BIAS
    biased = np.where(largest == 0, 0, np.clip(biased, 0, 254)).astype(np.int32)
    scales = np.ldexp(np.float32(1.0), biased - SCALE_BIAS).astype(np.float32)
    quantized = (values / scales[:, None, :, None]).astype(_FP8_ELEMENTS[dst_name])
    dst.write(quantized.reshape(parts, columns * 4).view(np.uint32).reshape(dst.shape), instr)
    # Only the groups' rows change; the rest of the view (other tensors' packed scales) is kept.
    stored = np.array(dst_scale.read()).reshape(dst_scale.partition_size, -1)
    stored.view(np.uint8)[scale_rows(parts), :columns] = biased.astype(np.uint8)
    dst_scale.write(stored.reshape(dst_scale.shape), instr)
    run.record(
        "vector",
        "quantize_mx",
        reads=[("src", src)],
        writes=[("dst", dst), ("dst_scale", dst_scale)],
    )


def nc_matmul_mx(
    dst: Tensor,
    stationary: Tensor,
    moving: Tensor,
    stationary_scale: Tensor,
    moving_scale: Tensor,
    tile_position: Sequence[Any] | None = None,
    tile_size: Sequence[Any] | None = None,
    accumulate: bool | None = None,
    name: str | None = None,
) -> None:
    """``dst[M, N] (+)= dequant(stationary)[4K, M].T @ dequant(moving)[4K, N]`` on TensorE (NeuronCore-v4).

    The contraction runs over the K partitions and the four values of each ``_x4`` element; each value is
    multiplied by its group's scale first. Sums are fp32; ``dst`` is fp32 or bf16 PSUM.
    """
    instr = "nisa.nc_matmul_mx"
    run = _check_nc_v4(instr)
    stationary = operands.compute_tile(stationary, instr, "stationary", "tensor", ("sbuf",))
    moving = operands.compute_tile(moving, instr, "moving", "tensor", ("sbuf",))
    dst = operands.compute_tile(dst, instr, "dst", "tensor", ("psum",))
    for role, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype not in dtypes.PACKED_X4:
            raise rule(
                instr, role, "must be float8_e5m2_x4, float8_e4m3fn_x4 or float4_e2m1fn_x4", dtype=dtypes.name(t.dtype)
            )
    d_name = dtypes.name(dst.dtype)
    if d_name not in ("float32", "bfloat16"):
        raise rule(instr, "dst", "must be float32 or bfloat16", dtype=d_name)
    k = _data_partitions(instr, "stationary", stationary)
    if moving.partition_size != k:
        raise rule(instr, "stationary/moving", "partition dims must match", stationary=k, moving=moving.partition_size)
    m, n = stationary.free_size, moving.free_size
    if m % 2 or m > operands.PE_ARRAY:
        raise rule(instr, "stationary", "free size must be even and at most 128", M=m)
    moving_limit = 4096 if d_name == "float32" else 8192  # all 8 PSUM banks
    if n > moving_limit:
        raise rule(instr, "moving", "free size exceeds the PSUM", N=n, limit=moving_limit, dst_dtype=d_name)
    row_size = _check_row_tiling(instr, tile_position, tile_size, k)
    if dst.partition_size != m or dst.free_size != n:
        raise rule(instr, "dst", "shape must be [stationary free, moving free]", dst=list(dst.shape), expected=[m, n])
    stationary_scale = _scale_view(instr, "stationary_scale", stationary_scale, k, m)
    moving_scale = _scale_view(instr, "moving_scale", moving_scale, k, n)
    if indirection.uses_indirection(dst, stationary, moving, stationary_scale, moving_scale):
        _check_mx_indirection(instr, dst, stationary, moving, stationary_scale, moving_scale, tile_position)
    weights = _dequantized(stationary, stationary_scale, k, m)
    inputs = _dequantized(moving, moving_scale, k, n)
    with np.errstate(all="ignore"):
        product = np.einsum("kiq,kjq->ij", weights, inputs, dtype=np.float32)
    if accumulate is None:
        add = dst.was_written().reshape(m, n)
    else:
        add = np.full((m, n), bool(accumulate))
    result = product
    if add.any():
        previous = dtypes.to_engine(np.asarray(dst.read())).reshape(m, n)
        with np.errstate(all="ignore"):
            result = np.where(add, previous + product, product)
    dst.write(result.reshape(dst.shape), instr)
    reads = [
        ("stationary", stationary),
        ("moving", moving),
        ("stationary_scale", stationary_scale),
        ("moving_scale", moving_scale),
    ]
    if add.any():
        reads.append(("dst_in", dst))
    run.record(
        "tensor",
        "nc_matmul_mx",
        reads=reads,
        writes=[("dst", dst)],
        flops=2 * 4 * k * m * n,
        K=4 * k,
        M=m,
        N=n,
        row_size=row_size,
    )


def _check_mx_indirection(
    instr: str,
    dst: Tensor,
    stationary: Tensor,
    moving: Tensor,
    stationary_scale: Tensor,
    moving_scale: Tensor,
    tile_position: Sequence[Any] | None,
) -> None:
    """nc_matmul_mx's "Tensor indirection" paragraph: data and scales form one logical tensor, so each pair
    is indirect through the same index or not at all; no TensorE tiling; where a scattered dst's index starts."""
    for data_role, data, scale_role, scale in (
        ("stationary", stationary, "stationary_scale", stationary_scale),
        ("moving", moving, "moving_scale", moving_scale),
    ):
        if not indirection.same_index(data, scale):
            raise rule(
                instr,
                f"{data_role}/{scale_role}",
                "must both use .indirect() with the same index, or neither",
                **{data_role: data.is_indirect(), scale_role: scale.is_indirect()},
            )
    indirection.check_untiled(instr, tile_position)
    indirection.check_lanes(instr, dst, "stationary", stationary)


def _dequantized(data: Tensor, scale: Tensor, parts: int, columns: int) -> np.ndarray:
    """[partitions, columns, 4] values times their groups' scales, fp32."""
    values = unpack_x4(data)
    scales = np.repeat(_read_scales(scale, parts, columns), GROUP_PARTITIONS, axis=0)
    return values * scales[:, :, None]


def _check_row_tiling(instr: str, tile_position: Sequence[Any] | None, tile_size: Sequence[Any] | None, k: int) -> int:
    """Row tiling only: ``tile_size=(rows, 128)`` with rows in 32/64/128, ``tile_position=(start_row, 0)``."""
    if bool(tile_position) != bool(tile_size):
        raise rule(instr, "tile_position/tile_size", "set both to use tiling mode, or neither")
    if not tile_size or not tile_position:
        return operands.PE_ARRAY
    rows, cols = (int(v) for v in tile_size)
    start_row, start_col = (int(v) for v in tile_position)
    if rows not in (32, 64, 128) or cols != operands.PE_ARRAY:
        raise rule(
            instr, "tile_size", "must be (32, 64 or 128, 128): nc_matmul_mx tiles rows only", tile_size=(rows, cols)
        )
    if start_col != 0 or start_row % rows or not 0 <= start_row < operands.PE_ARRAY:
        raise rule(
            instr,
            "tile_position",
            "must be (a multiple of the row tile size below 128, 0)",
            tile_position=(start_row, start_col),
        )
    if k > rows:
        raise rule(instr, "stationary", "partition dim exceeds the row tile", K=k, row_size=rows)
    return rows
