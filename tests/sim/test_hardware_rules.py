"""Every hardware/NKI rule the simulator enforces: a tiny kernel that breaks it, and the exact error.

Each error must name the instruction, the operand and the offending value / limit, so the
``match=`` patterns below check all three. Where a rule has a legal neighbour (DMA may start
anywhere, trn3 takes wider matmuls ...) the neighbour is run too, so a simulator that simply
rejected everything would fail. Also here: uninitialized memory (capacity and placement: test_memory.py).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernels_neuron import sim
from kernels_neuron.sim import isa as nisa
from kernels_neuron.sim import language as nl
from kernels_neuron.sim import runtime
from kernels_neuron.sim.tensor import Tensor

DUMMY = np.zeros((1, 1), np.float32)
F32, BF16 = nl.float32, nl.bfloat16


def run_body(body, target: str = "trn2", capacity: str = "error") -> sim.SimResult:
    """Run ``body()`` as the whole of a kernel."""

    def kernel(x):
        body()

    return sim.run(kernel, DUMMY, target=target, capacity=capacity)


def sb(shape, dtype=F32):
    return nl.ndarray(shape, dtype, buffer=nl.sbuf)


def ps(shape, dtype=F32):
    return nl.ndarray(shape, dtype, buffer=nl.psum)


def hbm(shape, dtype=F32):
    return nl.ndarray(shape, dtype, buffer=nl.shared_hbm)


def raw(shape, kind="sbuf", dtype=F32):
    """An on-chip tensor allocated behind nl.ndarray's back, to reach the instructions' own checks."""
    return Tensor(runtime.current().allocate(tuple(shape), dtype, kind, "raw"))


def mm(dst, st, mv, **kw):
    nisa.nc_matmul(dst, st, mv, **kw)


# (id, body, target, error pattern). Patterns name instruction, operand and value/limit.
VIOLATIONS = [
    # -- partition dim --------------------------------------------------------------------------
    (
        "alloc-sbuf-256-partitions",
        lambda: sb((256, 4)),
        "trn2",
        r"nl\.ndarray: shape: partition dim \(dim 0\) exceeds the partition count \(partitions=256, limit=128\)",
    ),
    (
        "alloc-psum-129-partitions",
        lambda: ps((129, 4)),
        "trn2",
        r"nl\.ndarray: shape: partition dim .*partitions=129, limit=128",
    ),
    (
        "alloc-on-chip-1d",
        lambda: sb((128,)),
        "trn2",
        r"nl\.ndarray: shape: on-chip tensors need a partition dim and at least one free dim \(shape=\[128\]\)",
    ),
    (
        "operand-256-partitions",
        lambda: nisa.tensor_copy(dst=sb((128, 8)), src=raw((256, 4))),
        "trn2",
        r"nisa\.tensor_copy: src: partition dim exceeds the partition count \(partitions=256, limit=128\)",
    ),
    (
        "matmul-K-over-128",
        lambda: mm(ps((64, 512)), raw((256, 64), dtype=BF16), raw((256, 512), dtype=BF16)),
        "trn2",
        r"nisa\.nc_matmul: stationary: partition dim exceeds the partition count \(partitions=256, limit=128\)",
    ),
    (
        "dma-256-partitions",
        lambda: nisa.dma_copy(dst=raw((256, 4)), src=hbm((256, 4))),
        "trn2",
        r"nisa\.dma_copy: dst: partition dim exceeds the partition count \(partitions=256",
    ),
    # -- start-partition alignment on compute engines -----------------------------------------
    (
        "align-96-at-32",
        lambda: nisa.tensor_copy(dst=sb((128, 8))[0:96], src=sb((128, 8))[32:128]),
        "trn2",
        r"nisa\.tensor_copy: src: an access over more than 64 partitions must start at partition 0 "
        r"\(start_partition=32, partitions=96\)",
    ),
    (
        "align-48-at-32",
        lambda: nisa.tensor_scalar(sb((128, 8))[32:80], sb((128, 8))[0:48], nl.add, 1.0),
        "trn2",
        r"nisa\.tensor_scalar: dst: an access over 33-64 partitions must start at partition 0 or 64 "
        r"\(start_partition=32, partitions=48\)",
    ),
    (
        "align-16-crossing-quadrant",
        lambda: nisa.activation(sb((16, 8)), nl.exp, sb((128, 8))[24:40]),
        "trn2",
        r"nisa\.activation: data: an access over at most 32 partitions must start at partition 0, 32, 64 or 96 "
        r"\(start_partition=24, partitions=16\)",
    ),
    (
        "align-matmul-moving",
        lambda: mm(ps((64, 512)), sb((64, 64), BF16), sb((128, 512), BF16)[16:80]),
        "trn2",
        r"nisa\.nc_matmul: moving: an access over 33-64 partitions must start at partition 0 or 64 "
        r"\(start_partition=16, partitions=64\)",
    ),
    # -- nc_matmul ------------------------------------------------------------------------------
    (
        "matmul-stationary-free-129",
        lambda: mm(ps((128, 512)), sb((128, 129), BF16), sb((128, 512), BF16)),
        "trn2",
        r"nisa\.nc_matmul: stationary: free size exceeds gemm_stationary_fmax \(M=129, limit=128\)",
    ),
    (
        "matmul-moving-free-1024-trn2",
        lambda: mm(ps((128, 1024)), sb((128, 128), BF16), sb((128, 1024), BF16)),
        "trn2",
        r"nisa\.nc_matmul: moving: free size exceeds gemm_moving_fmax "
        r"\(N=1024, limit=512, dst_dtype=float32, target=trn2\)",
    ),
    (
        "matmul-moving-free-1024-trn1",
        lambda: mm(ps((128, 1024)), sb((128, 128), BF16), sb((128, 1024), BF16)),
        "trn1",
        r"nisa\.nc_matmul: moving: free size exceeds gemm_moving_fmax "
        r"\(N=1024, limit=512, dst_dtype=float32, target=trn1\)",
    ),
    (
        "matmul-moving-free-4097-fp32-trn3",
        lambda: mm(ps((1, 4096)), sb((128, 1), BF16), sb((128, 4097), BF16)),
        "trn3",
        r"nisa\.nc_matmul: moving: free size exceeds gemm_moving_fmax "
        r"\(N=4097, limit=4096, dst_dtype=float32, target=trn3\)",
    ),
    (
        "matmul-moving-free-8193-bf16-trn3",
        lambda: mm(ps((1, 8192), BF16), sb((128, 1), BF16), sb((128, 8193), BF16)),
        "trn3",
        r"nisa\.nc_matmul: moving: free size exceeds gemm_moving_fmax "
        r"\(N=8193, limit=8192, dst_dtype=bfloat16, target=trn3\)",
    ),
    (
        "matmul-K-mismatch",
        lambda: mm(ps((128, 512)), sb((128, 128), BF16), sb((64, 512), BF16)),
        "trn2",
        r"nisa\.nc_matmul: stationary/moving: contraction \(partition\) dims differ \(stationary_K=128, moving_K=64\)",
    ),
    (
        "matmul-fp32-with-bf16",
        lambda: mm(ps((128, 512)), sb((128, 128), F32), sb((128, 512), BF16)),
        "trn2",
        r"nisa\.nc_matmul: stationary/moving: fp32/tf32 inputs must be paired with fp32/tf32 "
        r"\(stationary=float32, moving=bfloat16\)",
    ),
    (
        "matmul-int8-input",
        lambda: mm(ps((128, 512)), sb((128, 128), nl.int8), sb((128, 512), nl.int8)),
        "trn2",
        r"nisa\.nc_matmul: stationary: unsupported matmul input dtype \(dtype=int8, target=trn2\)",
    ),
    (
        "matmul-fp8e4m3fn-trn2",
        lambda: mm(ps((128, 512)), sb((128, 128), nl.float8_e4m3fn), sb((128, 512), nl.float8_e4m3fn)),
        "trn2",
        r"nisa\.nc_matmul: stationary: unsupported matmul input dtype \(dtype=float8_e4m3fn, target=trn2\)",
    ),
    (
        "matmul-dst-in-sbuf",
        lambda: mm(sb((128, 512)), sb((128, 128), BF16), sb((128, 512), BF16)),
        "trn2",
        r"nisa\.nc_matmul: dst: must be in PSUM, not SBUF",
    ),
    (
        "matmul-stationary-in-psum",
        lambda: mm(ps((128, 512)), ps((128, 128), BF16), sb((128, 512), BF16)),
        "trn2",
        r"nisa\.nc_matmul: stationary: must be in SBUF, not PSUM",
    ),
    (
        "matmul-moving-in-hbm",
        lambda: mm(ps((128, 512)), sb((128, 128), BF16), hbm((128, 512), BF16)),
        "trn2",
        r"nisa\.nc_matmul: moving: must be in SBUF, not SHARED_HBM",
    ),
    (
        "matmul-dst-bf16-trn2",
        lambda: mm(ps((128, 512), BF16), sb((128, 128), BF16), sb((128, 512), BF16)),
        "trn2",
        r"nisa\.nc_matmul: dst: PSUM result dtype not supported \(dtype=bfloat16, allowed=float32, target=trn2\)",
    ),
    (
        "matmul-dst-shape",
        lambda: mm(ps((128, 256)), sb((128, 128), BF16), sb((128, 512), BF16)),
        "trn2",
        r"nisa\.nc_matmul: dst: shape must be \[stationary free, moving free\] \(dst=\[128, 256\], expected=\[128, 512\]\)",
    ),
    (
        "matmul-crosses-psum-bank",
        lambda: mm(ps((128, 1024))[:, 256:768], sb((128, 128), BF16), sb((128, 512), BF16)),
        "trn2",
        r"nisa\.nc_matmul: dst: a matmul result must lie within one 2 KiB PSUM bank "
        r"\(first_byte=1024, last_byte=3071, bank_bytes=2048\)",
    ),
    (
        "tiling-position-without-size",
        lambda: mm(ps((64, 512)), sb((64, 64), BF16), sb((64, 512), BF16), tile_position=(0, 0)),
        "trn2",
        r"nisa\.nc_matmul: tile_position/tile_size: set both to use tiling mode, or neither",
    ),
    (
        "tiling-bad-size",
        lambda: mm(ps((64, 512)), sb((64, 64), BF16), sb((64, 512), BF16), tile_position=(0, 0), tile_size=(48, 64)),
        "trn2",
        r"nisa\.nc_matmul: tile_size: row tile size must be one of \(32, 64, 128\) \(value=48\)",
    ),
    (
        "tiling-32-on-trn1",
        lambda: mm(ps((32, 512)), sb((32, 32), BF16), sb((32, 512), BF16), tile_position=(0, 0), tile_size=(32, 32)),
        "trn1",
        r"nisa\.nc_matmul: tile_size: row tile size must be one of \(64, 128\) \(value=32\)",
    ),
    (
        "tiling-misaligned-position",
        lambda: mm(ps((64, 512)), sb((64, 64), BF16), sb((64, 512), BF16), tile_position=(32, 0), tile_size=(64, 64)),
        "trn2",
        r"nisa\.nc_matmul: tile_position: start row must be a multiple of the row tile size below 128 "
        r"\(start=32, tile=64\)",
    ),
    (
        "tiling-K-exceeds-row-tile",
        lambda: mm(ps((64, 512)), sb((128, 64), BF16), sb((128, 512), BF16), tile_position=(0, 0), tile_size=(64, 64)),
        "trn2",
        r"nisa\.nc_matmul: stationary: partition \(contraction\) dim exceeds the row tile \(K=128, row_size=64\)",
    ),
    (
        "tiling-M-exceeds-column-tile",
        lambda: mm(ps((128, 512)), sb((64, 128), BF16), sb((64, 512), BF16), tile_position=(0, 0), tile_size=(64, 64)),
        "trn2",
        r"nisa\.nc_matmul: stationary: free dim exceeds the column tile \(M=128, column_size=64\)",
    ),
    (
        "double-row-on-trn1",
        lambda: mm(
            ps((64, 64)),
            sb((128, 2, 64), nl.float8_e5m2),
            sb((128, 2, 64), nl.float8_e5m2),
            perf_mode=nisa.matmul_perf_mode.double_row,
        ),
        "trn1",
        r"nisa\.nc_matmul: perf_mode: double_row needs NeuronCore-v3 or newer \(target=trn1\)",
    ),
    (
        "double-row-bf16",
        lambda: mm(
            ps((64, 64)), sb((128, 2, 64), BF16), sb((128, 2, 64), BF16), perf_mode=nisa.matmul_perf_mode.double_row
        ),
        "trn2",
        r"nisa\.nc_matmul: perf_mode: double_row takes fp8 inputs only \(stationary=bfloat16, moving=bfloat16\)",
    ),
    # -- GpSimd cannot touch PSUM ---------------------------------------------------------------
    (
        "iota-into-psum",
        lambda: nisa.iota(ps((128, 8), nl.int32), [[1, 8]]),
        "trn2",
        r"nisa\.iota: dst: must be in SBUF, not PSUM",
    ),
    (
        "affine-select-psum",
        lambda: nisa.affine_select(ps((128, 8)), [[1, 8]], 1, sb((128, 8)), 0.0),
        "trn2",
        r"nisa\.affine_select: dst: must be in SBUF, not PSUM",
    ),
    (
        "affine-select-on-true-psum",
        lambda: nisa.affine_select(sb((128, 8)), [[1, 8]], 1, ps((128, 8)), 0.0),
        "trn2",
        r"nisa\.affine_select: on_true_tile: must be in SBUF, not PSUM",
    ),
    (
        "power-writes-psum",
        lambda: nisa.tensor_tensor(ps((128, 8)), sb((128, 8)), sb((128, 8)), nl.power),
        "trn2",
        r"nisa\.tensor_tensor: dst: the GpSimd engine cannot access PSUM",
    ),
    (
        "power-on-vector",
        lambda: nisa.tensor_tensor(sb((128, 8)), sb((128, 8)), sb((128, 8)), nl.power, engine=nisa.vector_engine),
        "trn2",
        r"nisa\.tensor_tensor: op: nl\.power runs on GpSimd only \(engine=vector\)",
    ),
    (
        "gpsimd-tensor-tensor-reads-psum",
        lambda: nisa.tensor_tensor(sb((128, 8)), ps((128, 8)), sb((128, 8)), nl.add, engine=nisa.gpsimd_engine),
        "trn2",
        r"nisa\.tensor_tensor: data1: the GpSimd engine cannot access PSUM",
    ),
    (
        "gpsimd-copy-from-psum",
        lambda: nisa.tensor_copy(sb((128, 8)), ps((128, 8)), engine=nisa.gpsimd_engine),
        "trn2",
        r"nisa\.tensor_copy: src: the GpSimd engine cannot access PSUM",
    ),
    (
        "gpsimd-memset-psum",
        lambda: nisa.memset(ps((128, 8)), 0.0, engine=nisa.gpsimd_engine),
        "trn2",
        r"nisa\.memset: dst: the GpSimd engine cannot access PSUM",
    ),
    # -- DMA ------------------------------------------------------------------------------------
    (
        "dma-reads-psum",
        lambda: nisa.dma_copy(dst=hbm((128, 8)), src=ps((128, 8))),
        "trn2",
        r"nisa\.dma_copy: src: must be in HBM/SBUF, not PSUM",
    ),
    (
        "dma-writes-psum",
        lambda: nisa.dma_copy(dst=ps((128, 8)), src=hbm((128, 8))),
        "trn2",
        r"nisa\.dma_copy: dst: must be in HBM/SBUF, not PSUM",
    ),
    (
        "dma-element-count",
        lambda: nisa.dma_copy(dst=sb((128, 8)), src=hbm((128, 9))),
        "trn2",
        r"nisa\.dma_copy: dst/src: element counts differ \(dst=\[128, 8\], src=\[128, 9\]\)",
    ),
    (
        "hwdge-on-trn1",
        lambda: nisa.dma_copy(dst=sb((128, 8)), src=hbm((128, 8)), dge_mode=nisa.dge_mode.hwdge),
        "trn1",
        r"nisa\.dma_copy: dge_mode: hardware DGE needs NeuronCore-v3 or newer \(target=trn1\)",
    ),
    (
        "dma-transpose-4-byte-hwdge",
        lambda: nisa.dma_transpose(sb((8, 16)), hbm((16, 8)), dge_mode=nisa.dge_mode.hwdge),
        "trn2",
        r"nisa\.dma_transpose: src: hardware-DGE and indirect DMA transposes move 2-byte dtypes only "
        r"\(dtype=float32\)",
    ),
    (
        "dma-transpose-into-hbm",
        lambda: nisa.dma_transpose(hbm((8, 16), BF16), hbm((16, 8), BF16)),
        "trn2",
        r"nisa\.dma_transpose: dst: must be in SBUF, not SHARED_HBM",
    ),
    # -- element counts / layouts ---------------------------------------------------------------
    (
        "tensor-copy-layout",
        lambda: nisa.tensor_copy(dst=sb((128, 8)), src=sb((128, 9))),
        "trn2",
        r"nisa\.tensor_copy: dst/src: must have the same partitions and elements per partition "
        r"\(dst=\[128, 8\], src=\[128, 9\]\)",
    ),
    (
        "tensor-copy-partitions",
        lambda: nisa.tensor_copy(dst=sb((64, 16)), src=sb((128, 8))),
        "trn2",
        r"nisa\.tensor_copy: dst/src: must have the same partitions .*\(dst=\[64, 16\], src=\[128, 8\]\)",
    ),
    (
        "tensor-tensor-layout",
        lambda: nisa.tensor_tensor(sb((128, 8)), sb((128, 8)), sb((128, 4)), nl.add),
        "trn2",
        r"nisa\.tensor_tensor: data1/data2: must have the same partitions and elements per partition "
        r"\(data1=\[128, 8\], data2=\[128, 4\]\)",
    ),
    (
        "tensor-scalar-vector-operand-shape",
        lambda: nisa.tensor_scalar(sb((128, 8)), sb((128, 8)), nl.add, sb((128, 2))),
        "trn2",
        r"nisa\.tensor_scalar: operand0: a vector operand must have shape \(partitions, 1\) "
        r"\(shape=\[128, 2\], partitions=128\)",
    ),
    (
        "tensor-scalar-bf16-operand",
        lambda: nisa.tensor_scalar(sb((128, 8)), sb((128, 8)), nl.add, sb((128, 1), BF16)),
        "trn2",
        r"nisa\.tensor_scalar: operand0: a vector operand of an arithmetic operator must be float32 "
        r"\(dtype=bfloat16\)",
    ),
    (
        "tensor-tensor-both-psum",
        lambda: nisa.tensor_tensor(sb((128, 8)), ps((128, 8)), ps((128, 8)), nl.add),
        "trn2",
        r"nisa\.tensor_tensor: data1/data2: cannot both be in PSUM",
    ),
    (
        "scalar-tensor-tensor-both-psum",
        lambda: nisa.scalar_tensor_tensor(sb((128, 8)), ps((128, 8)), nl.multiply, 2.0, nl.add, ps((128, 8))),
        "trn2",
        r"nisa\.scalar_tensor_tensor: data/operand1: cannot both be in PSUM",
    ),
    # -- free-size caps -------------------------------------------------------------------------
    (
        "vector-psum-free-4097",
        lambda: nisa.tensor_copy(dst=sb((128, 4097), BF16), src=ps((128, 4097), BF16)),
        "trn2",
        r"nisa\.tensor_copy: src: free size exceeds the PSUM per-instruction limit \(free_elements=4097, limit=4096\)",
    ),
    (
        "vector-sbuf-free-65537",
        lambda: nisa.memset(sb((128, 65537), BF16), 0.0),
        "trn2",
        r"nisa\.memset: dst: free size exceeds the SBUF per-instruction limit \(free_elements=65537, limit=65536\)",
    ),
    (
        "access-pattern-5-free-dims",
        lambda: nisa.memset(sb((2, 4, 4, 4, 4, 4))[:, ::2, ::2, ::2, ::2, ::2], 0.0),
        "trn2",
        r"nisa\.memset: dst: access pattern has too many free dimensions \(free_dims=5, limit=4\)",
    ),
    (
        "bn-stats-513",
        lambda: nisa.bn_stats(sb((128, 6)), sb((128, 513))),
        "trn2",
        r"nisa\.bn_stats: data: free size exceeds bn_stats_fmax \(free_elements=513, limit=512\)",
    ),
    (
        "bn-stats-dst",
        lambda: nisa.bn_stats(sb((128, 4)), sb((128, 64))),
        "trn2",
        r"nisa\.bn_stats: dst: must hold 6 statistics per partition \(dst=\[128, 4\]\)",
    ),
    # -- reductions -----------------------------------------------------------------------------
    (
        "reduce-partition-axis",
        lambda: nisa.tensor_reduce(sb((128, 1)), nl.add, sb((128, 8)), axis=0),
        "trn2",
        r"nisa\.tensor_reduce: axis: the partition axis \(0\) cannot be reduced.*\(axis=\(0,\)\)",
    ),
    (
        "reduce-non-trailing-axis",
        lambda: nisa.tensor_reduce(sb((128, 4)), nl.add, sb((128, 8, 4)), axis=1),
        "trn2",
        r"nisa\.tensor_reduce: axis: must be the last contiguous free dims, ending at the final dim "
        r"\(axis=\(1,\), ndim=3\)",
    ),
    (
        "reduce-gap-in-axes",
        lambda: nisa.tensor_reduce(sb((128, 2)), nl.add, sb((128, 2, 3, 4)), axis=(1, 3)),
        "trn2",
        r"nisa\.tensor_reduce: axis: must be the last contiguous free dims.*\(axis=\(1, 3\), ndim=4\)",
    ),
    (
        "reduce-dst-shape",
        lambda: nisa.tensor_reduce(sb((128, 2)), nl.add, sb((128, 8, 4)), axis=2),
        "trn2",
        r"nisa\.tensor_reduce: dst: shape does not match the reduction \(dst=\[128, 2\], "
        r"expected_elements_per_partition=8\)",
    ),
    # -- transposes -----------------------------------------------------------------------------
    (
        "pe-transpose-129",
        lambda: nisa.nc_transpose(ps((128, 128)), sb((128, 129))),
        "trn2",
        r"nisa\.nc_transpose: data: tensor engine transposes at most 128x128 \(shape=\[128, 129\]\)",
    ),
    (
        "vector-transpose-33",
        lambda: nisa.nc_transpose(sb((33, 33)), sb((33, 33)), engine=nisa.vector_engine),
        "trn2",
        r"nisa\.nc_transpose: data: vector engine transposes at most 32x32 \(shape=\[33, 33\]\)",
    ),
    (
        "pe-transpose-into-sbuf",
        lambda: nisa.nc_transpose(sb((8, 16)), sb((16, 8)), engine=nisa.tensor_engine),
        "trn2",
        r"nisa\.nc_transpose: dst: must be in PSUM, not SBUF",
    ),
    (
        "transpose-dtype",
        lambda: nisa.nc_transpose(ps((8, 16)), sb((16, 8), BF16)),
        "trn2",
        r"nisa\.nc_transpose: dst: must have the same dtype as data \(dst=float32, data=bfloat16\)",
    ),
    (
        "transpose-dst-shape",
        lambda: nisa.nc_transpose(ps((16, 8)), sb((16, 8))),
        "trn2",
        r"nisa\.nc_transpose: dst: must be the transposed shape of data \(dst=\[16, 8\], expected=\[8, 16\]\)",
    ),
    # -- operator classes -----------------------------------------------------------------------
    (
        "bitvec-on-float",
        lambda: nisa.tensor_tensor(sb((128, 8)), sb((128, 8)), sb((128, 8)), nl.bitwise_and),
        "trn2",
        r"nisa\.tensor_tensor: data1: bitvec operators need integer tiles \(op=bitwise_and, dtype=float32\)",
    ),
    (
        "bitvec-into-float-dst",
        lambda: nisa.tensor_scalar(sb((128, 8)), sb((128, 8), nl.int32), nl.left_shift, 2),
        "trn2",
        r"nisa\.tensor_scalar: dst: bitvec operators need integer tiles \(op=left_shift, dtype=float32\)",
    ),
    (
        "bitvec-mixed-with-arith",
        lambda: nisa.tensor_scalar(
            sb((128, 8), nl.int32), sb((128, 8), nl.int32), nl.bitwise_and, 3, op1=nl.add, operand1=1
        ),
        "trn2",
        r"nisa\.tensor_scalar: op0/op1: both operators must be bitvec or both arithmetic "
        r"\(ops=\['bitwise_and', 'add'\]\)",
    ),
    (
        "bitvec-reduce-on-float",
        lambda: nisa.tensor_reduce(sb((128, 1)), nl.bitwise_or, sb((128, 8)), axis=1),
        "trn2",
        r"nisa\.tensor_reduce: data: bitvec reductions need integer tiles \(dtype=float32\)",
    ),
    (
        "activation-with-alu-op",
        lambda: nisa.activation(sb((128, 8)), nl.bitwise_and, sb((128, 8))),
        "trn2",
        r"nisa\.activation: op: nl\.bitwise_and is not an activation function",
    ),
    # -- ScalarE combinations -------------------------------------------------------------------
    (
        "scalar-engine-subtract",
        lambda: nisa.tensor_scalar(sb((128, 8)), sb((128, 8)), nl.subtract, 1.0, engine=nisa.scalar_engine),
        "trn2",
        r"nisa\.tensor_scalar: engine: ScalarE supports only multiply\+add, multiply, or add "
        r"\(op0=subtract, op1=None\)",
    ),
    (
        "scalar-engine-add-multiply",
        lambda: nisa.tensor_scalar(
            sb((128, 8)), sb((128, 8)), nl.add, 1.0, op1=nl.multiply, operand1=2.0, engine=nisa.scalar_engine
        ),
        "trn2",
        r"nisa\.tensor_scalar: engine: ScalarE supports only .*\(op0=add, op1=multiply\)",
    ),
    (
        "activation-reduce-max",
        lambda: nisa.activation(sb((128, 8)), nl.exp, sb((128, 8)), reduce_op=nl.maximum, reduce_res=sb((128, 1))),
        "trn2",
        r"nisa\.activation: reduce_op: ScalarE reduces with nl\.add only \(op=maximum\)",
    ),
    (
        "activation-scalar-bias-trn1",
        lambda: nisa.activation(sb((128, 8)), nl.exp, sb((128, 8)), bias=1.0),
        "trn1",
        r"nisa\.activation: bias: NeuronCore-v2 takes bias only as a \(P, 1\) vector \(target=trn1\)",
    ),
    (
        "activation-bf16-scale",
        lambda: nisa.activation(sb((128, 8)), nl.exp, sb((128, 8)), scale=sb((128, 1), BF16)),
        "trn2",
        r"nisa\.activation: scale: a scale vector must be float32 \(dtype=bfloat16\)",
    ),
    (
        "activation-reduce-trn1-max",
        lambda: nisa.activation_reduce(sb((128, 8)), nl.exp, sb((128, 8)), nl.maximum, sb((128, 1))),
        "trn1",
        r"nisa\.activation_reduce: reduce_op: NeuronCore-v2 reduces with nl\.add only \(op=maximum\)",
    ),
    (
        "scalar-tensor-copy-trn1",
        lambda: nisa.tensor_copy(sb((128, 8)), sb((128, 8)), engine=nisa.scalar_engine),
        "trn1",
        r"nisa\.tensor_copy: engine: ScalarE has no tensor_copy on NeuronCore-v2.*\(target=trn1\)",
    ),
    (
        "memset-on-tensor-engine",
        lambda: nisa.memset(sb((128, 8)), 0.0, engine=nisa.tensor_engine),
        "trn2",
        r"nisa\.memset: engine: tensor cannot run this instruction \(allowed=vector/gpsimd\)",
    ),
    # -- generation-specific instructions -------------------------------------------------------
    (
        "activate2-on-trn2",
        lambda: nisa.activate2(sb((128, 8)), nl.exp, sb((128, 8)), 1.0, 0.0, nl.multiply, nl.add),
        "trn2",
        r"nisa\.activate2: target: activate2 needs NeuronCore-v4 or newer \(target=trn2\)",
    ),
    (
        "exponential-on-trn2",
        lambda: nisa.exponential(sb((128, 8)), sb((128, 8))),
        "trn2",
        r"nisa\.exponential: target: exponential needs NeuronCore-v4 or newer \(target=trn2\)",
    ),
    (
        "rand2-on-trn2",
        lambda: nisa.rand2(sb((128, 8)), 0.0, 1.0),
        "trn2",
        r"nisa\.rand2: target: rand2 needs NeuronCore-v4 or newer \(target=trn2\)",
    ),
    (
        "range-select-on-trn1",
        lambda: nisa.range_select(sb((128, 8)), sb((128, 8)), nl.greater_equal, nl.less, sb((128, 1)), sb((128, 1))),
        "trn1",
        r"nisa\.range_select: target: range_select needs NeuronCore-v3 or newer \(target=trn1\)",
    ),
    (
        "rng-gpsimd-on-trn1",
        lambda: nisa.rng(sb((128, 8), nl.uint32), engine=nisa.gpsimd_engine),
        "trn1",
        r"nisa\.rng: engine: gpsimd cannot run this instruction \(allowed=vector\)",
    ),
]


def _gather_view():
    rows = sb((2, 1), nl.int32)
    nisa.iota(rows, [[1, 1]], offset=0, channel_multiplier=1)
    return hbm((8, 4)).ap(pattern=[[4, 2], [1, 4]], offset=0, vector_offset=rows, indirect_dim=0)


def _bad_gather():
    rows = sb((2, 1), nl.int32)
    nisa.iota(rows, [[1, 1]], offset=7, channel_multiplier=1)  # rows 7 and 8 of an 8-row tensor
    nisa.dma_copy(dst=sb((2, 4)), src=hbm((8, 4)).ap(pattern=[[4, 2], [1, 4]], offset=0, vector_offset=rows))


def _read_unset_register():
    reg = nisa.register_alloc()
    int(reg)


# Operand types, instruction-specific shapes and dtypes, registers.
VIOLATIONS += [
    (
        "operand-not-a-tensor",
        lambda: nisa.tensor_copy(dst=sb((128, 8)), src=3.0),
        "trn2",
        r"nisa\.tensor_copy: src: expected an NKI tensor, got float",
    ),
    (
        "scalar-operand-wrong-type",
        lambda: nisa.tensor_scalar(sb((128, 8)), sb((128, 8)), nl.add, "1"),
        "trn2",
        r"nisa\.tensor_scalar: operand0: expected a scalar or a \(P, 1\) tile, got str",
    ),
    (
        "indirect-ap-on-compute-engine",
        lambda: nisa.tensor_copy(dst=sb((2, 4)), src=_gather_view()),
        "trn2",
        r"nisa\.tensor_copy: src: indirect \(vector_offset\) access patterns are only for DMA instructions",
    ),
    (
        "indirect-index-out-of-bounds",
        _bad_gather,
        "trn2",
        r"nisa\.dma_copy: vector_offset: indirect index out of bounds \(oob_mode=error\) \(indices=\[8\], "
        r"allocation_elements=32\)",
    ),
    (
        "indirect-dim-not-0",
        lambda: hbm((8, 4)).ap(pattern=[[4, 2], [1, 4]], vector_offset=sb((2, 1), nl.int32), indirect_dim=1),
        "trn2",
        r"ap: indirect_dim: vector_offset indexes dim 0 only \(indirect_dim=1\)",
    ),
    (
        "write-through-broadcast",
        lambda: nisa.memset(sb((128, 1)).broadcast_to((128, 8)), 0.0),
        "trn2",
        r"nisa\.memset: dst: cannot write through a broadcast view \(shape=\(128, 8\)\)",
    ),
    (
        "assign-constant-to-hbm",
        lambda: hbm((4, 4)).__setitem__((slice(None), slice(None)), 1.0),
        "trn2",
        r"tensor assignment: dst: cannot assign a constant to HBM tensor .*shared_hbm float32\[4, 4\].*\(value=1\.0\)",
    ),
    (
        "view-odd-bytes",
        lambda: sb((4, 3), nl.bfloat16).view(nl.float32),
        "trn2",
        r"view: cannot reinterpret <nki tensor sbuf bfloat16\[4, 3\]> as float32",
    ),
    (
        "tensor-scalar-op1-without-operand1",
        lambda: nisa.tensor_scalar(sb((128, 8)), sb((128, 8)), nl.add, 1.0, op1=nl.multiply),
        "trn2",
        r"nisa\.tensor_scalar: op1/operand1: set both or neither",
    ),
    (
        "stt-bitvec",
        lambda: nisa.scalar_tensor_tensor(
            sb((128, 8), nl.int32), sb((128, 8), nl.int32), nl.bitwise_and, 1, nl.add, sb((128, 8), nl.int32)
        ),
        "trn2",
        r"nisa\.scalar_tensor_tensor: op: bitvec operators are not supported here \(op=bitwise_and\)",
    ),
    (
        "reduce-negate-bitvec",
        lambda: nisa.tensor_reduce(sb((128, 1), nl.int32), nl.bitwise_or, sb((128, 8), nl.int32), axis=1, negate=True),
        "trn2",
        r"nisa\.tensor_reduce: negate: only applies to arithmetic reductions \(op=bitwise_or\)",
    ),
    (
        "partition-reduce-op",
        lambda: nisa.tensor_partition_reduce(sb((1, 8)), nl.multiply, sb((128, 8))),
        "trn2",
        r"nisa\.tensor_partition_reduce: op: must be add, average, maximum, bitwise_or or bitwise_and \(op=multiply\)",
    ),
    (
        "partition-reduce-dst",
        lambda: nisa.tensor_partition_reduce(sb((2, 8)), nl.add, sb((128, 8))),
        "trn2",
        r"nisa\.tensor_partition_reduce: dst: must hold one partition of data's free size "
        r"\(dst=\[2, 8\], expected=\[1, 8\]\)",
    ),
    (
        "tsr-reduce-op",
        lambda: nisa.tensor_scalar_reduce(sb((128, 8)), sb((128, 8)), nl.add, 1.0, nl.subtract, sb((128, 1))),
        "trn2",
        r"nisa\.tensor_scalar_reduce: reduce_op: must be add, multiply, maximum or minimum \(op=subtract\)",
    ),
    (
        "tsr-bitvec-op0",
        lambda: nisa.tensor_scalar_reduce(
            sb((128, 8), nl.int32), sb((128, 8), nl.int32), nl.bitwise_and, 1, nl.add, sb((128, 1))
        ),
        "trn2",
        r"nisa\.tensor_scalar_reduce: op0: bitvec operators are not supported here \(op=bitwise_and\)",
    ),
    (
        "tsr-load-reduce-needs-init",
        lambda: nisa.tensor_scalar_reduce(
            sb((128, 8)), sb((128, 8)), nl.add, 1.0, nl.add, sb((128, 1)), reduce_cmd=nisa.reduce_cmd.load_reduce
        ),
        "trn2",
        r"nisa\.tensor_scalar_reduce: reduce_init: is required with reduce_cmd\.load_reduce",
    ),
    (
        "reduce-res-shape",
        lambda: nisa.activation_reduce(sb((128, 8)), nl.exp, sb((128, 8)), nl.add, sb((128, 2))),
        "trn2",
        r"nisa\.activation_reduce: reduce_res: must have shape \(partitions, 1\) \(shape=\[128, 2\], "
        r"partitions=128\)",
    ),
    (
        "cumulative-op1",
        lambda: nisa.tensor_scalar_cumulative(sb((128, 8)), sb((128, 8)), nl.add, nl.divide, 1.0),
        "trn2",
        r"nisa\.tensor_scalar_cumulative: op1: must be add, subtract, multiply, maximum or minimum "
        r"\(op=divide\)",
    ),
    (
        "activation-tf32-bias",
        lambda: nisa.activation(sb((128, 8)), nl.exp, sb((128, 8)), bias=sb((128, 1), nl.tfloat32)),
        "trn2",
        r"nisa\.activation: bias: tfloat32 bias is not supported",
    ),
    (
        "activate2-op-pair",
        lambda: nisa.activate2(sb((128, 8)), nl.exp, sb((128, 8)), 1.0, 0.0, nl.add, nl.multiply),
        "trn3",
        r"nisa\.activate2: op0/op1: unsupported operator pair \(op0=add, op1=multiply\)",
    ),
    (
        "activate2-reduce-op",
        lambda: nisa.activate2(
            sb((128, 8)), nl.exp, sb((128, 8)), 1.0, 0.0, nl.multiply, nl.add, reduce_op=nl.multiply
        ),
        "trn3",
        r"nisa\.activate2: reduce_op: must be add, maximum, minimum, abs_max or abs_min \(op=multiply\)",
    ),
    # -- TensorE extras -------------------------------------------------------------------------
    (
        "matmul-mixed-fp8-e4m3",
        lambda: mm(ps((128, 512)), sb((128, 128), nl.float8_e4m3), sb((128, 512), nl.float8_e4m3fn)),
        "trn3",
        r"nisa\.nc_matmul: stationary/moving: legacy float8_e4m3 and OCP float8_e4m3fn cannot be mixed",
    ),
    (
        "matmul-transpose-dtype",
        lambda: mm(ps((64, 64)), sb((64, 64), BF16), sb((64, 64), BF16), is_transpose=True),
        "trn2",
        r"nisa\.nc_matmul: dst: a transpose writes the stationary dtype \(dst=float32, stationary=bfloat16\)",
    ),
    (
        "double-row-with-column-tiling",
        lambda: mm(
            ps((64, 64)),
            sb((64, 2, 64), nl.float8_e5m2),
            sb((64, 2, 64), nl.float8_e5m2),
            tile_position=(0, 0),
            tile_size=(64, 64),
            perf_mode=nisa.matmul_perf_mode.double_row,
        ),
        "trn2",
        r"nisa\.nc_matmul: perf_mode: double_row cannot be combined with column tiling",
    ),
    (
        "double-row-pair-dim",
        lambda: mm(
            ps((64, 64)),
            sb((128, 3, 64), nl.float8_e5m2),
            sb((128, 3, 64), nl.float8_e5m2),
            perf_mode=nisa.matmul_perf_mode.double_row,
        ),
        "trn2",
        r"nisa\.nc_matmul: stationary/moving: double_row needs the first free dim to be 2 "
        r"\(stationary=\[128, 3, 64\], moving=\[128, 3, 64\]\)",
    ),
    # -- DMA transposes -------------------------------------------------------------------------
    (
        "dma-transpose-dtype-mismatch",
        lambda: nisa.dma_transpose(sb((8, 16), nl.float16), hbm((16, 8), BF16)),
        "trn2",
        r"nisa\.dma_transpose: dst: must have the same dtype as src \(dst=float16, src=bfloat16\)",
    ),
    (
        "dma-transpose-axes",
        lambda: nisa.dma_transpose(sb((8, 4, 2), BF16), hbm((2, 4, 8), BF16), axes=(1, 0, 2)),
        "trn2",
        r"nisa\.dma_transpose: axes: supported permutations are \(1, 0\), \(2, 1, 0\) and \(3, 1, 2, 0\) "
        r"\(axes=\(1, 0, 2\), src_ndim=3\)",
    ),
    (
        "dma-transpose-count",
        lambda: nisa.dma_transpose(sb((8, 8), BF16), hbm((16, 8), BF16)),
        "trn2",
        r"nisa\.dma_transpose: dst: element count differs from the transposed src \(dst=\[8, 8\], transposed=\[8, 16\]\)",
    ),
    (
        "dma-transpose-hwdge-trn1",
        lambda: nisa.dma_transpose(sb((128, 16), BF16), hbm((16, 128), BF16), dge_mode=nisa.dge_mode.hwdge),
        "trn1",
        r"nisa\.dma_transpose: dge_mode: hardware DGE needs NeuronCore-v3 or newer \(target=trn1\)",
    ),
    (
        "dma-transpose-hwdge-shape",
        lambda: nisa.dma_transpose(sb((64, 8), BF16), hbm((8, 64), BF16), dge_mode=nisa.dge_mode.hwdge),
        "trn2",
        r"nisa\.dma_transpose: src: a hardware-DGE transpose needs src\.shape\[0\] == 16 \(2-D; .*\) and "
        r"src\.shape\[-1\] <= 128 \(shape=\[8, 64\]\)",
    ),
    (
        "dma-transpose-hwdge-3d-leading",
        lambda: nisa.dma_transpose(sb((8, 16, 3), BF16), hbm((3, 16, 8), BF16), dge_mode=nisa.dge_mode.hwdge),
        "trn2",
        r"nisa\.dma_transpose: src: a hardware-DGE transpose needs .* \(shape=\[3, 16, 8\]\)",
    ),
    (
        "dma-transpose-hwdge-3d-rows",
        lambda: nisa.dma_transpose(sb((8, 4, 2), BF16), hbm((2, 4, 8), BF16), dge_mode=nisa.dge_mode.hwdge),
        "trn2",
        r"nisa\.dma_transpose: src: a hardware-DGE transpose needs .* \(shape=\[2, 4, 8\]\)",
    ),
    (
        "dma-compute-op",
        lambda: nisa.dma_compute(sb((4, 4)), [hbm((4, 4))], nl.multiply),
        "trn2",
        r"nisa\.dma_compute: reduce_op: only nl\.add is supported \(op=multiply\)",
    ),
    (
        "dma-compute-scales",
        lambda: nisa.dma_compute(sb((4, 4)), [hbm((4, 4))], nl.add, scales=[2.0]),
        "trn2",
        r"nisa\.dma_compute: scales: all scales must be 1\.0 \(scales=\[2\.0\]\)",
    ),
    (
        "dma-compute-17-srcs",
        lambda: nisa.dma_compute(sb((4, 4)), [hbm((4, 4))] * 17, nl.add),
        "trn2",
        r"nisa\.dma_compute: srcs: takes 1 to 16 source tensors \(count=17\)",
    ),
    (
        "dma-compute-count",
        lambda: nisa.dma_compute(sb((4, 4)), [hbm((4, 4)), hbm((4, 5))], nl.add),
        "trn2",
        r"nisa\.dma_compute: srcs\[1\]: element count differs from dst \(src=\[4, 5\], dst=\[4, 4\]\)",
    ),
    # -- memset / predicated copy ---------------------------------------------------------------
    (
        "memset-x4-nonzero",
        lambda: nisa.memset(sb((128, 8), nl.float8_e4m3fn_x4), 1),
        "trn2",
        r"nisa\.memset: value: packed x4 dtypes can only be set to 0 \(value=1\)",
    ),
    (
        "memset-tensor-value",
        lambda: nisa.memset(sb((128, 8)), sb((128, 1))),
        "trn2",
        r"nisa\.memset: value: must be a compile-time constant, not a tensor",
    ),
    (
        "predicated-copy-float-predicate",
        lambda: nisa.tensor_copy_predicated(sb((128, 8)), sb((128, 8)), sb((128, 8))),
        "trn2",
        r"nisa\.tensor_copy_predicated: predicate: must be uint8, uint16 or uint32 \(dtype=float32\)",
    ),
    (
        "predicated-copy-dtype",
        lambda: nisa.tensor_copy_predicated(sb((128, 8)), sb((128, 8), BF16), sb((128, 8), nl.uint8)),
        "trn2",
        r"nisa\.tensor_copy_predicated: src: must have the same dtype as dst \(src=bfloat16, dst=float32\)",
    ),
    # -- GpSimd patterns ------------------------------------------------------------------------
    (
        "iota-5d-pattern",
        lambda: nisa.iota(sb((128, 32), nl.int32), [[1, 2]] * 5),
        "trn2",
        r"nisa\.iota: pattern: must have 1 to 4 \[step, num\] pairs",
    ),
    (
        "iota-pattern-count",
        lambda: nisa.iota(sb((128, 8), nl.int32), [[1, 4]]),
        "trn2",
        r"nisa\.iota: pattern: element count must equal dst's elements per partition \(pattern_elements=4, "
        r"free_elements=8\)",
    ),
    (
        "affine-select-tensor-on-false",
        lambda: nisa.affine_select(sb((128, 8)), [[1, 8]], 1, sb((128, 8)), sb((128, 1))),
        "trn2",
        r"nisa\.affine_select: on_false_value: must be a float32 scalar",
    ),
    # -- selection and search -------------------------------------------------------------------
    (
        "range-select-compare-op",
        lambda: nisa.range_select(sb((128, 8)), sb((128, 8)), nl.add, nl.less, sb((128, 1)), sb((128, 1))),
        "trn2",
        r"nisa\.range_select: comp_op0: must be equal, less, less_equal, greater or greater_equal \(op=add\)",
    ),
    (
        "range-select-reduce-op",
        lambda: nisa.range_select(
            sb((128, 8)), sb((128, 8)), nl.greater_equal, nl.less, sb((128, 1)), sb((128, 1)), reduce_op=nl.add
        ),
        "trn2",
        r"nisa\.range_select: reduce_op: only nl\.maximum is supported \(op=add\)",
    ),
    (
        "range-select-on-false",
        lambda: nisa.range_select(
            sb((128, 8)), sb((128, 8)), nl.greater_equal, nl.less, sb((128, 1)), sb((128, 1)), on_false_value=0.0
        ),
        "trn2",
        r"nisa\.range_select: on_false_value: the hardware fills with FP32_MIN only \(value=0\.0\)",
    ),
    (
        "range-select-int-tile",
        lambda: nisa.range_select(
            sb((128, 8), nl.int32), sb((128, 8), nl.int32), nl.greater_equal, nl.less, sb((128, 1)), sb((128, 1))
        ),
        "trn2",
        r"nisa\.range_select: on_true_tile: must be a float tile \(dtype=int32\)",
    ),
    (
        "select-reduce-op",
        lambda: nisa.select_reduce(sb((128, 8)), sb((128, 8), nl.uint8), sb((128, 8)), 0.0, reduce_op=nl.add),
        "trn2",
        r"nisa\.select_reduce: reduce_op: only nl\.maximum is supported \(op=add\)",
    ),
    (
        "select-reduce-int32",
        lambda: nisa.select_reduce(sb((128, 8), nl.int32), sb((128, 8), nl.uint8), sb((128, 8), nl.int32), 0.0),
        "trn2",
        r"nisa\.select_reduce: on_true: tfloat32/int32/uint32 are not supported \(dtype=int32\)",
    ),
    (
        "select-reduce-float-predicate",
        lambda: nisa.select_reduce(sb((128, 8)), sb((128, 8)), sb((128, 8)), 0.0),
        "trn2",
        r"nisa\.select_reduce: predicate: must be int8, uint8, int16 or uint16 \(dtype=float32\)",
    ),
    (
        "max8-too-few",
        lambda: nisa.max8(sb((128, 8)), sb((128, 7))),
        "trn2",
        r"nisa\.max8: src: needs 8 to 16384 elements per partition \(free_elements=7\)",
    ),
    (
        "max8-dst",
        lambda: nisa.max8(sb((128, 4)), sb((128, 64))),
        "trn2",
        r"nisa\.max8: dst: must have shape \(partitions, 8\) \(dst=\[128, 4\]\)",
    ),
    (
        "find-index8-dst-dtype",
        lambda: nisa.nc_find_index8(sb((128, 8), nl.int32), sb((128, 64)), sb((128, 8))),
        "trn2",
        r"nisa\.nc_find_index8: dst: must be uint16 or uint32 \(dtype=int32\)",
    ),
    (
        "find-index8-vals",
        lambda: nisa.nc_find_index8(sb((128, 8), nl.uint32), sb((128, 64)), sb((128, 4))),
        "trn2",
        r"nisa\.nc_find_index8: vals: must hold 8 values per partition \(shape=\[128, 4\]\)",
    ),
    (
        "match-replace8-vals",
        lambda: nisa.nc_match_replace8(sb((128, 64)), sb((128, 64)), sb((128, 4)), 0.0),
        "trn2",
        r"nisa\.nc_match_replace8: vals: must hold 8 values per partition \(shape=\[128, 4\]\)",
    ),
    (
        "n-gather-index-dtype",
        lambda: nisa.nc_n_gather(sb((128, 4)), sb((128, 8)), sb((128, 4), nl.int32)),
        "trn2",
        r"nisa\.nc_n_gather: indices: must be uint32 \(dtype=int32\)",
    ),
    (
        "n-gather-dst-dtype",
        lambda: nisa.nc_n_gather(sb((128, 4), BF16), sb((128, 8)), sb((128, 4), nl.uint32)),
        "trn2",
        r"nisa\.nc_n_gather: dst: must have data's dtype \(dst=bfloat16, data=float32\)",
    ),
    (
        "n-gather-index-range",
        lambda: nisa.nc_n_gather(sb((128, 4)), sb((128, 8)), nl.full((128, 4), 8, nl.uint32)),
        "trn2",
        r"nisa\.nc_n_gather: indices: out of range of data's elements per partition \(max_index=8, limit=8\)",
    ),
    (
        "stream-shuffle-dtype",
        lambda: nisa.nc_stream_shuffle(sb((32, 8), BF16), sb((32, 8)), list(range(32))),
        "trn2",
        r"nisa\.nc_stream_shuffle: dst: must match src's dtype and elements per partition",
    ),
    (
        "stream-shuffle-mask",
        lambda: nisa.nc_stream_shuffle(sb((32, 8)), sb((32, 8)), list(range(16))),
        "trn2",
        r"nisa\.nc_stream_shuffle: shuffle_mask: must have 32 entries \(length=16\)",
    ),
    # -- statistics, random numbers -------------------------------------------------------------
    (
        "bn-aggr-not-triples",
        lambda: nisa.bn_aggr(sb((128, 2)), sb((128, 7))),
        "trn2",
        r"nisa\.bn_aggr: data: elements per partition must be a multiple of 3 \(free_elements=7\)",
    ),
    (
        "bn-aggr-dst",
        lambda: nisa.bn_aggr(sb((128, 3)), sb((128, 6))),
        "trn2",
        r"nisa\.bn_aggr: dst: must hold \(mean, variance\) per partition \(dst=\[128, 3\]\)",
    ),
    (
        "rng-float-dst",
        lambda: nisa.rng(sb((128, 8))),
        "trn2",
        r"nisa\.rng: dst: must be an integer tile \(dtype=float32\)",
    ),
    (
        "rng-seed-shape",
        lambda: nisa.set_rng_seed(sb((1, 2), nl.uint32)),
        "trn2",
        r"nisa\.set_rng_seed: src_seeds: must be a \[1, 1\] 32-bit tile \(shape=\[1, 2\], dtype=uint32\)",
    ),
    (
        "rand2-bounds",
        lambda: nisa.rand2(sb((128, 8)), 1.0, 1.0),
        "trn3",
        r"nisa\.rand2: min/max: min must be below max",
    ),
    (
        "dropout-dtype",
        lambda: nisa.dropout(sb((128, 8), BF16), sb((128, 8)), 0.5),
        "trn2",
        r"nisa\.dropout: dst: must have data's dtype \(dst=bfloat16, data=float32\)",
    ),
    # -- registers ------------------------------------------------------------------------------
    (
        "register-read-before-write",
        _read_unset_register,
        "trn2",
        r"register read before any value was moved or loaded into it",
    ),
    (
        "register-load-two-elements",
        lambda: nisa.register_load(nisa.register_alloc(), sb((1, 2), nl.int32)),
        "trn2",
        r"nisa\.register_load: src: must hold exactly one element \(shape=\[1, 2\]\)",
    ),
    (
        "register-store-two-elements",
        lambda: nisa.register_store(sb((1, 2), nl.int32), nisa.register_alloc(3)),
        "trn2",
        r"nisa\.register_store: dst: must hold exactly one element \(shape=\[1, 2\]\)",
    ),
]


@pytest.mark.parametrize("body, target, pattern", [v[1:] for v in VIOLATIONS], ids=[v[0] for v in VIOLATIONS])
def test_rule_violation_is_reported(body, target, pattern):
    with pytest.raises(sim.NkiValidationError, match=pattern):
        run_body(body, target)


def test_violation_ids_are_unique():
    ids = [v[0] for v in VIOLATIONS]
    assert len(ids) == len(set(ids))


# -- the legal neighbours of the rules above ----------------------------------------------------
@pytest.mark.parametrize(
    "start, size, legal",
    [
        (0, 128, True),
        (0, 65, True),
        (32, 96, False),
        (1, 80, False),
        (0, 64, True),
        (64, 64, True),
        (64, 33, True),
        (32, 64, False),
        (16, 48, False),
        (96, 32, True),
        (0, 32, True),
        (32, 32, True),
        (96, 1, True),
        (64, 17, True),
        (16, 16, False),  # inside one quadrant, but <= 32 partitions start at 0/32/64/96 only
        (40, 24, False),
        (33, 31, False),
        (24, 16, False),
        (1, 32, False),
        (40, 25, False),
        (127, 1, False),
    ],
)
def test_start_partition_alignment_table(start, size, legal):
    """trainium_inferentia2_arch.rst: > 64 partitions start at 0; 33-64 at 0 or 64; <= 32 at 0/32/64/96."""

    def body():
        tile = sb((128, 4))
        nisa.memset(tile, 0.0)
        nisa.tensor_scalar(tile[start : start + size], tile[start : start + size], nl.add, 1.0)

    if legal:
        trace = run_body(body).trace
        assert trace.instructions[-1].op == "tensor_scalar" and trace.instructions[-1].partitions == size
    else:
        with pytest.raises(
            sim.NkiValidationError,
            match=rf"nisa\.tensor_scalar: dst: .*start_partition={start}, "
            rf"partitions={size}",
        ):
            run_body(body)


def test_dma_may_start_at_any_partition():
    x = np.arange(128 * 6, dtype=np.float32).reshape(128, 6)

    def kernel(x):
        tile = nl.ndarray((128, 6), F32, buffer=nl.sbuf)
        nisa.memset(tile, -1.0)
        nisa.dma_copy(dst=tile[17:114], src=x[3:100])  # 97 partitions starting at 17
        out = nl.ndarray((128, 6), F32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    out = sim.run(kernel, x).outputs
    expected = np.full((128, 6), -1.0, np.float32)
    expected[17:114] = x[3:100]
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dst_dtype, columns", [(nl.bfloat16, 8192), (nl.float32, 4096)])
def test_wide_and_bf16_matmul_are_legal_on_trn3_only(dst_dtype, columns):
    # NC-v4: the moving tile may span all 8 PSUM banks (4096 fp32 or 8192 bf16 result columns).
    a = np.ones((128, 128), ml_dtypes.bfloat16)
    b = np.ones((128, columns), ml_dtypes.bfloat16)

    def kernel(a, b):
        st = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        mv = nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=st, src=a)
        nisa.dma_copy(dst=mv, src=b)
        acc = nl.ndarray((128, columns), dst_dtype, buffer=nl.psum)
        nisa.nc_matmul(acc, st, mv)
        res = nl.ndarray((128, columns), nl.bfloat16, buffer=nl.sbuf)
        for c in range(0, columns, 4096):  # VectorE reads at most 4096 PSUM elements per partition
            nisa.tensor_copy(res[:, c : c + 4096], acc[:, c : c + 4096])
        out = nl.ndarray((128, columns), nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=res)
        return out

    result = sim.run(kernel, a, b, target="trn3")
    assert result.outputs.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(result.outputs.astype(np.float32), 128.0)
    assert result.trace.instructions[2].attrs["N"] == columns
    assert result.trace.psum_peak_bytes == 16384
    with pytest.raises(sim.NkiValidationError, match=r"nisa\.nc_matmul: (moving|dst): "):
        sim.run(kernel, a, b, target="trn2")


def test_matmul_within_one_bank_and_tiling_are_legal():
    def body():
        st, mv = sb((64, 64), BF16), sb((64, 512), BF16)
        nisa.memset(st, 1.0)
        nisa.memset(mv, 1.0)
        acc = ps((128, 1024))
        mm(acc[0:64, 512:1024], st, mv, tile_position=(64, 64), tile_size=(64, 64))  # second bank, whole
        mm(acc[0:64, 0:256], st, mv[:, 0:256])

    trace = run_body(body).trace
    ops = [i.op for i in trace]
    assert ops.count("nc_matmul") == 2 and trace.instructions[-2].attrs["row_size"] == 64


def test_reduce_over_trailing_axes_is_legal():
    x = np.arange(4 * 2 * 3 * 5, dtype=np.float32).reshape(4, 2, 3, 5)

    def kernel(x):
        t = nl.ndarray(x.shape, F32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        r = nl.ndarray((4, 2), F32, buffer=nl.sbuf)
        nisa.tensor_reduce(r, nl.add, t, axis=(2, 3))
        out = nl.ndarray((4, 2), F32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=r)
        return out

    np.testing.assert_array_equal(sim.run(kernel, x).outputs, x.sum(axis=(2, 3)))


# -- indices and slices -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "where, index, pattern",
    [
        ("sbuf", (slice(None), slice(0, 9)), r"slice 0:9 is out of bounds for dim 1 of size 8"),
        ("sbuf", (slice(None), 8), r"index 8 out of bounds for dim 1 of size 8"),
        ("sbuf", (128, 0), r"index 128 out of bounds for dim 0 of size 128"),
        ("sbuf", (slice(None), -9), r"index -9 out of bounds for dim 1 of size 8"),
        ("sbuf", (slice(120, 130),), r"slice 120:130 is out of bounds for dim 0 of size 128"),
        ("sbuf", (slice(None), nl.ds(4, 5)), r"slice 4:9 is out of bounds for dim 1 of size 8"),
        ("hbm", (slice(None), slice(0, 9)), r"slice 0:9 is out of bounds for dim 1 of size 8"),
        ("hbm", (200, 1), r"index 200 out of bounds for dim 0 of size 128"),
        ("hbm", (0, 0, 0), r"too many indices for a 2-d tensor \[128, 8\]"),
    ],
)
def test_out_of_bounds_index_names_dim_and_size(where, index, pattern):
    def body():
        t = sb((128, 8)) if where == "sbuf" else hbm((128, 8))
        t[index]

    with pytest.raises(IndexError, match=pattern):
        run_body(body)


def test_partition_dim_cannot_be_strided():
    with pytest.raises(sim.NkiValidationError, match=r"index: .*the partition dimension cannot be strided \(step=2\)"):
        run_body(lambda: sb((128, 8))[0:128:2, :])


def test_access_pattern_outside_allocation():
    with pytest.raises(
        sim.NkiValidationError,
        match=r"ap: .*access pattern reaches outside the allocation .*last=1031, allocation_elements=1024",
    ):
        run_body(lambda: sb((128, 8)).ap(pattern=[[8, 129], [1, 8]], offset=0))
    with pytest.raises(sim.NkiValidationError, match=r"ap: .*free dims of an on-chip view spill into other partitions"):
        run_body(lambda: sb((128, 8)).ap(pattern=[[8, 4], [1, 16]], offset=0))
    with pytest.raises(
        sim.NkiValidationError,
        match=r"ap: .*dim 0 of an on-chip view must step exactly one partition "
        r"\(stride_bytes=64, partition_bytes=32\)",
    ):
        run_body(lambda: sb((128, 8)).ap(pattern=[[16, 8], [1, 8]], offset=0))


# -- the kernel interface ----------------------------------------------------------------------
def test_returning_an_on_chip_tensor_is_an_error():
    def kernel(x):
        t = nl.ndarray((1, 1), F32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        return t

    with pytest.raises(
        sim.NkiValidationError, match=r"nki\.jit: return value: .*sbuf.* is in SBUF; kernels return HBM"
    ):
        sim.run(kernel, DUMMY)


@pytest.mark.parametrize("buffer", ["hbm", "private_hbm"])
def test_returning_a_private_hbm_tensor_from_an_spmd_program_is_an_error(buffer):
    def kernel(x):
        t = nl.ndarray((1, 1), F32, buffer=buffer)
        nisa.dma_copy(dst=t, src=x)
        return t

    with pytest.raises(
        sim.NkiValidationError, match=rf"nki\.jit: return value: .* private HBM \({buffer}\).*nl\.shared_hbm"
    ):
        sim.run(kernel, DUMMY, grid=2)
    if buffer == "private_hbm":  # explicitly private memory is never an output
        with pytest.raises(sim.NkiValidationError, match=r"private HBM \(private_hbm\)"):
            sim.run(kernel, DUMMY)


def test_an_nl_hbm_tensor_is_an_output_without_a_grid():
    """AWS's nonzero_with_count example returns an nl.hbm tensor from a kernel launched without a grid."""

    def kernel(x):
        t = nl.ndarray((1, 1), F32, buffer=nl.hbm)
        nisa.dma_copy(dst=t, src=x)
        return t

    np.testing.assert_array_equal(sim.run(kernel, np.full((1, 1), 3.0, np.float32)).outputs, [[3.0]])


@pytest.mark.parametrize("dtype", [np.float64, np.int64])
def test_64_bit_kernel_arguments_are_rejected(dtype):
    def kernel(x):
        return x

    name = np.dtype(dtype).name
    with pytest.raises(
        sim.NkiValidationError,
        match=rf"nki\.jit: argument 'arg0': dtype {name} has no NKI engine "
        rf"support \(shape=\[2, 3\]\)",
    ):
        sim.run(kernel, np.zeros((2, 3), dtype))
    # ...and it is also a TypeError, for callers that catch that.
    with pytest.raises(TypeError):
        sim.run(kernel, np.zeros((2, 3), dtype))


# -- uninitialized memory -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, expected",
    [
        (np.float32, np.nan),
        (ml_dtypes.bfloat16, np.nan),
        (np.float16, np.nan),
        (np.int32, 4),
        (np.uint8, 4),
        (np.int16, 4),
    ],
)
def test_never_written_sbuf_reads_as_sentinel(dtype, expected):
    def kernel(x):
        t = nl.ndarray((8, 5), dtype, buffer=nl.sbuf)
        out = nl.ndarray((8, 5), dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    out = sim.run(kernel, DUMMY).outputs
    assert out.dtype == np.dtype(dtype)
    if np.isnan(expected):
        assert np.isnan(out.astype(np.float32)).all()
    else:
        assert (out == expected).all()


def test_partly_written_tile_keeps_sentinels_elsewhere():
    def kernel(x):
        t = nl.ndarray((4, 6), F32, buffer=nl.sbuf)
        nisa.memset(t[:, 0:2], 1.0)
        out = nl.ndarray((4, 6), F32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    out = sim.run(kernel, DUMMY).outputs
    assert (out[:, 0:2] == 1.0).all() and np.isnan(out[:, 2:]).all()
