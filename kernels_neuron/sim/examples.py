"""Complete NKI kernels that ship with the simulator, each beside a NumPy reference.

They are real NKI (new ``dst``-first ISA) and run unchanged on Trainium; here they serve as
the simulator's demo, its end-to-end tests and a starting point for kernel authors. Every
kernel takes any row count (a ragged last 128-row tile included).

Import this module after :func:`kernels_neuron.sim.install` (it imports ``nki``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import ml_dtypes
import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np

P = 128  # partitions
MATMUL_N_TILE = 512  # fp32 columns in one PSUM bank
BN_STATS_CHUNK = 512


def _tiles(total: int, size: int):
    """(start, length) of each tile covering ``total``, the last one possibly short."""
    for start in range(0, total, size):
        yield start, min(size, total - start)


@nki.jit
def tiled_matmul(lhs_t, rhs):
    """``out[M, N] = lhs_t[K, M].T @ rhs[K, N]``, accumulating over K in fp32 PSUM.

    Dimensions: K (contraction, tiled by 128 partitions), M (tiled by 128), N (tiled by 512).
    IO shapes: lhs_t [K, M], rhs [K, N] in HBM; out [M, N] in HBM with lhs_t's dtype.
    Tiling plan: for each (M, N) output tile, K/128 matmuls accumulate into one PSUM bank,
    then VectorE evicts it to SBUF (casting) and DMA writes it out.
    """
    k_total, m_total = lhs_t.shape
    _, n_total = rhs.shape
    out = nl.ndarray((m_total, n_total), lhs_t.dtype, buffer=nl.shared_hbm)
    for m0, m in _tiles(m_total, P):
        for n0, n in _tiles(n_total, MATMUL_N_TILE):
            acc = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
            for k0, k in _tiles(k_total, P):
                stationary = nl.ndarray((k, m), lhs_t.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=stationary, src=lhs_t[k0 : k0 + k, m0 : m0 + m])
                moving = nl.ndarray((k, n), rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=moving, src=rhs[k0 : k0 + k, n0 : n0 + n])
                nisa.nc_matmul(dst=acc, stationary=stationary, moving=moving)
            result = nl.ndarray((m, n), lhs_t.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=result, src=acc)
            nisa.dma_copy(dst=out[m0 : m0 + m, n0 : n0 + n], src=result)
    return out


def tiled_matmul_reference(lhs_t: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    return (lhs_t.astype(np.float32).T @ rhs.astype(np.float32)).astype(lhs_t.dtype)


@nki.jit
def transpose_2d(x):
    """``out = x.T`` for any [R, C], through TensorE 128×128 block transposes.

    IO shapes: x [R, C] in HBM; out [C, R] in HBM. Tiling plan: each 128×128 block is loaded
    to SBUF, transposed by TensorE into PSUM (bit-exact on Trn2+), evicted and stored at the
    mirrored block position.
    """
    rows, cols = x.shape
    out = nl.ndarray((cols, rows), x.dtype, buffer=nl.shared_hbm)
    for r0, r in _tiles(rows, P):
        for c0, c in _tiles(cols, P):
            block = nl.ndarray((r, c), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=block, src=x[r0 : r0 + r, c0 : c0 + c])
            flipped = nl.ndarray((c, r), x.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=flipped, data=block)
            evicted = nl.ndarray((c, r), x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=evicted, src=flipped)
            nisa.dma_copy(dst=out[c0 : c0 + c, r0 : r0 + r], src=evicted)
    return out


def transpose_2d_reference(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.T)


@nki.jit
def row_softmax(x):
    """Softmax over the last dim of [R, F], one 128-row tile at a time, in fp32.

    IO shapes: x [R, F] in HBM; out [R, F] in HBM with x's dtype. Engine plan: VectorE
    takes the negated row max; ScalarE computes exp(x - max) and its row sum in one
    instruction; VectorE takes the reciprocal and scales.
    """
    rows, cols = x.shape
    out = nl.ndarray((rows, cols), x.dtype, buffer=nl.shared_hbm)
    for r0, r in _tiles(rows, P):
        tile = nl.ndarray((r, cols), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x[r0 : r0 + r, :])
        neg_max = nl.ndarray((r, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=tile, axis=1, negate=True)
        exps = nl.ndarray((r, cols), nl.float32, buffer=nl.sbuf)
        total = nl.ndarray((r, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=exps, op=nl.exp, data=tile, reduce_op=nl.add, reduce_res=total, bias=neg_max)
        inverse = nl.ndarray((r, 1), nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inverse, data=total)
        result = nl.ndarray((r, cols), x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=result, data=exps, op0=nl.multiply, operand0=inverse)
        nisa.dma_copy(dst=out[r0 : r0 + r, :], src=result)
    return out


def row_softmax_reference(x: np.ndarray) -> np.ndarray:
    x32 = x.astype(np.float32)
    e = np.exp(x32 - x32.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(x.dtype)


@nki.jit
def layernorm(x, gamma, beta, eps):
    """LayerNorm over the last dim of [R, F] with affine gamma/beta, statistics from bn_stats.

    IO shapes: x [R, F], gamma [1, F], beta [1, F] in HBM; out [R, F] with x's dtype.
    Engine plan: VectorE bn_stats on ≤512-element chunks and one bn_aggr give mean and
    variance; GpSimd-free tensor_scalar ops normalise; gamma/beta are broadcast to all
    partitions once by a K=1 TensorE matmul with a ones row.
    """
    rows, cols = x.shape
    chunks = list(_tiles(cols, BN_STATS_CHUNK))
    out = nl.ndarray((rows, cols), x.dtype, buffer=nl.shared_hbm)
    affine = []
    ones = nl.ndarray((1, P), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    for vector in (gamma, beta):
        row = nl.ndarray((1, cols), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=row, src=vector)
        spread = nl.ndarray((P, cols), nl.float32, buffer=nl.sbuf)
        for c0, c in _tiles(cols, MATMUL_N_TILE):
            bank = nl.ndarray((P, c), nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=bank, stationary=ones, moving=row[:, c0 : c0 + c])
            nisa.tensor_copy(dst=spread[:, c0 : c0 + c], src=bank)
        affine.append(spread)
    gamma_all, beta_all = affine
    for r0, r in _tiles(rows, P):
        tile = nl.ndarray((r, cols), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x[r0 : r0 + r, :])
        stats = nl.ndarray((r, 6 * len(chunks)), nl.float32, buffer=nl.sbuf)
        for i, (c0, c) in enumerate(chunks):
            nisa.bn_stats(dst=stats[:, 6 * i : 6 * i + 6], data=tile[:, c0 : c0 + c])
        moments = nl.ndarray((r, 2), nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=moments, data=stats)
        rstd = nl.ndarray((r, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=rstd, data=moments[:, 1:2], op0=nl.add, operand0=float(eps), op1=nl.rsqrt, operand1=0.0)
        normed = nl.ndarray((r, cols), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(
            dst=normed, data=tile, op0=nl.subtract, operand0=moments[:, 0:1], op1=nl.multiply, operand1=rstd
        )
        nisa.tensor_tensor(dst=normed, data1=normed, data2=gamma_all[:r, :], op=nl.multiply)
        result = nl.ndarray((r, cols), x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=result, data1=normed, data2=beta_all[:r, :], op=nl.add)
        nisa.dma_copy(dst=out[r0 : r0 + r, :], src=result)
    return out


def layernorm_reference(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    x32 = x.astype(np.float32)
    mean = x32.mean(axis=1, keepdims=True)
    var = x32.var(axis=1, keepdims=True)
    y = (x32 - mean) / np.sqrt(var + np.float32(eps)) * gamma.astype(np.float32) + beta.astype(np.float32)
    return y.astype(x.dtype)


@nki.jit
def spmd_scaled_add(a, b, alpha):
    """``out = a + alpha * b`` with one SPMD program per 128-row block: launch as ``spmd_scaled_add[n]``.

    IO shapes: a, b, out [R, F] in HBM (out shared by all programs); program ``i`` handles
    rows ``[128 i, 128 (i + 1))`` (clipped at R), so launch ``ceil(R / 128)`` programs.
    """
    rows, cols = a.shape
    out = nl.ndarray((rows, cols), a.dtype, buffer=nl.shared_hbm)
    r0 = nl.program_id(0) * P
    r = min(P, rows - r0)
    ta = nl.ndarray((r, cols), a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=ta, src=a[r0 : r0 + r, :])
    tb = nl.ndarray((r, cols), b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tb, src=b[r0 : r0 + r, :])
    result = nl.ndarray((r, cols), a.dtype, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=result, data=tb, op0=nl.multiply, operand0=float(alpha), op1=nl.add, operand1=ta)
    nisa.dma_copy(dst=out[r0 : r0 + r, :], src=result)
    return out


def spmd_scaled_add_reference(a: np.ndarray, b: np.ndarray, alpha: float) -> np.ndarray:
    return (a.astype(np.float32) + np.float32(alpha) * b.astype(np.float32)).astype(a.dtype)


class Example(NamedTuple):
    """An example kernel, its NumPy reference, demo inputs (shapes that leave ragged tiles) drawn from
    a generator, and the SPMD grid it launches on (None: one program)."""

    kernel: Callable
    reference: Callable
    make_inputs: Callable[[np.random.Generator], tuple]
    grid: int | None = None


def _bf16(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)


def _fp32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


EXAMPLES: dict[str, Example] = {
    "tiled_matmul": Example(
        tiled_matmul, tiled_matmul_reference, lambda rng: (_bf16(rng, 384, 256), _bf16(rng, 384, 1024))
    ),
    "transpose_2d": Example(transpose_2d, transpose_2d_reference, lambda rng: (_bf16(rng, 300, 260),)),
    "row_softmax": Example(row_softmax, row_softmax_reference, lambda rng: (_fp32(rng, 300, 1000),)),
    "layernorm": Example(
        layernorm,
        layernorm_reference,
        lambda rng: (_fp32(rng, 300, 1000), _fp32(rng, 1, 1000), _fp32(rng, 1, 1000), 1e-5),
    ),
    "spmd_scaled_add": Example(
        spmd_scaled_add,
        spmd_scaled_add_reference,
        lambda rng: (_fp32(rng, 300, 1000), _fp32(rng, 300, 1000), 0.5),
        grid=3,
    ),
}
