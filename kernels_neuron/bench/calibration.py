"""Calibration of the cost model against AWS's published Trn1 matmul-tutorial latencies.

AWS's NKI matrix-multiplication tutorial measured four kernels for bf16
``[4096, 8192] @ [8192, 8192]`` on Trn1 (``lhsT`` is the left operand delivered transposed).
These are our own NKI kernels written to the tutorial's descriptions of each stage:

1. ``basic_tiled``: every matmul loads its two tiles (no reuse);
2. ``hoisted_loads``: an M-tile's K column of ``lhsT`` is loaded once and reused across N;
3. ``blocked_free``: blocks of 2 M-tiles x 2 N-tiles share their loads;
4. ``fully_optimized``: blocks of 16 M-tiles, 2 N-tiles and 8 K-tiles, SBUF-resident results,
   wide per-partition DMA rows.

Simulating the full size is slow, so :func:`model_stage` models slices and scales them, using the
loop structure: each stage's outermost loop (M tiles for stages 1-3, N blocks for stage 4) runs
identical, independent iterations, so time is proportional to that dimension; inside one such
iteration the other dimension's blocks repeat identically but share the outer loads, so time is
affine in it and is extrapolated from two slice sizes. The calibration test checks this against
modelling the whole problem at sizes small enough to simulate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from kernels_neuron import cost, sim

sim.install()
import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

TILE_K, TILE_M, TILE_N = 128, 128, 512
FULL_M, FULL_K, FULL_N = 4096, 8192, 8192


def _result_tile(acc, out, m0: int, n0: int) -> None:
    """Evict one PSUM accumulator to SBUF (casting to the output dtype) and store it."""
    tile = nl.ndarray(acc.shape, out.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=tile, src=acc)
    nisa.dma_copy(dst=out[m0 : m0 + TILE_M, n0 : n0 + TILE_N], src=tile)


def _column(src, col0: int, width: int) -> list:
    """The K column of ``src`` at columns [col0, col0 + width), one SBUF tile per 128 rows."""
    tiles = []
    for k in nl.affine_range(src.shape[0] // TILE_K):
        tile = nl.ndarray((TILE_K, width), src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=src[k * TILE_K : (k + 1) * TILE_K, col0 : col0 + width])
        tiles.append(tile)
    return tiles


@nki.jit
def basic_tiled(lhs_t, rhs):
    k_total, m_total = lhs_t.shape
    n_total = rhs.shape[1]
    out = nl.ndarray((m_total, n_total), lhs_t.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(m_total // TILE_M):
        for n in nl.affine_range(n_total // TILE_N):
            acc = nl.ndarray((TILE_M, TILE_N), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(k_total // TILE_K):
                a = nl.ndarray((TILE_K, TILE_M), lhs_t.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhs_t[k * TILE_K : (k + 1) * TILE_K, m * TILE_M : (m + 1) * TILE_M])
                b = nl.ndarray((TILE_K, TILE_N), rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=b, src=rhs[k * TILE_K : (k + 1) * TILE_K, n * TILE_N : (n + 1) * TILE_N])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b)
            _result_tile(acc, out, m * TILE_M, n * TILE_N)
    return out


@nki.jit
def hoisted_loads(lhs_t, rhs):
    k_total, m_total = lhs_t.shape
    n_total = rhs.shape[1]
    k_tiles = k_total // TILE_K
    out = nl.ndarray((m_total, n_total), lhs_t.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(m_total // TILE_M):
        lhs_column = _column(lhs_t, m * TILE_M, TILE_M)
        for n in nl.affine_range(n_total // TILE_N):
            rhs_column = _column(rhs, n * TILE_N, TILE_N)
            acc = nl.ndarray((TILE_M, TILE_N), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(k_tiles):
                nisa.nc_matmul(dst=acc, stationary=lhs_column[k], moving=rhs_column[k])
            _result_tile(acc, out, m * TILE_M, n * TILE_N)
            del rhs_column  # last use: the next column may reuse this SBUF
        del lhs_column
    return out


@nki.jit
def blocked_free(lhs_t, rhs, tiles_m=2, tiles_n=2):
    k_total, m_total = lhs_t.shape
    n_total = rhs.shape[1]
    k_tiles = k_total // TILE_K
    out = nl.ndarray((m_total, n_total), lhs_t.dtype, buffer=nl.shared_hbm)
    for mb in nl.affine_range(m_total // (TILE_M * tiles_m)):
        lhs_block = [_column(lhs_t, (mb * tiles_m + i) * TILE_M, TILE_M) for i in range(tiles_m)]
        for nb in nl.affine_range(n_total // (TILE_N * tiles_n)):
            rhs_block = [_column(rhs, (nb * tiles_n + j) * TILE_N, TILE_N) for j in range(tiles_n)]
            for i in range(tiles_m):
                for j in range(tiles_n):
                    acc = nl.ndarray((TILE_M, TILE_N), nl.float32, buffer=nl.psum)
                    for k in nl.affine_range(k_tiles):
                        nisa.nc_matmul(dst=acc, stationary=lhs_block[i][k], moving=rhs_block[j][k])
                    _result_tile(acc, out, (mb * tiles_m + i) * TILE_M, (nb * tiles_n + j) * TILE_N)
            del rhs_block  # last use: the next block may reuse this SBUF
        del lhs_block
    return out


@nki.jit
def fully_optimized(lhs_t, rhs, tiles_m=16, tiles_n=2, tiles_k=8):
    k_total, m_total = lhs_t.shape
    n_total = rhs.shape[1]
    block_m, block_n, block_k = TILE_M * tiles_m, TILE_N * tiles_n, TILE_K * tiles_k
    out = nl.ndarray((m_total, n_total), lhs_t.dtype, buffer=nl.shared_hbm)
    for nb in nl.affine_range(n_total // block_n):
        # Partial sums for this N block over all of M live in SBUF across the K blocks.
        results = [
            [nl.ndarray((TILE_M, TILE_N), lhs_t.dtype, buffer=nl.sbuf) for _ in range(tiles_n)]
            for _ in range(m_total // TILE_M)
        ]
        for kb in nl.sequential_range(k_total // block_k):
            rhs_block = []
            for kt in range(tiles_k):
                k0 = kb * block_k + kt * TILE_K
                b = nl.ndarray((TILE_K, block_n), rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=b, src=rhs[k0 : k0 + TILE_K, nb * block_n : (nb + 1) * block_n])
                rhs_block.append(b)
            for mb in nl.affine_range(m_total // block_m):
                lhs_block = []
                for kt in range(tiles_k):
                    k0 = kb * block_k + kt * TILE_K
                    a = nl.ndarray((TILE_K, block_m), lhs_t.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=a, src=lhs_t[k0 : k0 + TILE_K, mb * block_m : (mb + 1) * block_m])
                    lhs_block.append(a)
                for i in range(tiles_m):
                    for j in range(tiles_n):
                        acc = nl.ndarray((TILE_M, TILE_N), nl.float32, buffer=nl.psum)
                        for kt in range(tiles_k):
                            nisa.nc_matmul(
                                dst=acc,
                                stationary=lhs_block[kt][:, i * TILE_M : (i + 1) * TILE_M],
                                moving=rhs_block[kt][:, j * TILE_N : (j + 1) * TILE_N],
                            )
                        partial = results[mb * tiles_m + i][j]
                        if kb == 0:
                            nisa.tensor_copy(dst=partial, src=acc)
                        else:
                            nisa.tensor_tensor(dst=partial, data1=partial, data2=acc, op=nl.add)
        for mt, row in enumerate(results):
            for j, tile in enumerate(row):
                n0 = nb * block_n + j * TILE_N
                nisa.dma_copy(dst=out[mt * TILE_M : (mt + 1) * TILE_M, n0 : n0 + TILE_N], src=tile)
    return out


@dataclass(frozen=True)
class Stage:
    """A tutorial stage and how to slice it: ``outer`` is its outermost loop's dimension ("m"/"n"),
    ``outer_slice`` one iteration's extent, ``inner_slices`` two extents of the other dimension."""

    name: str
    kernel: Callable
    published_ms: float  # AWS NKI matmul tutorial, Trn1, bf16 [4096x8192]@[8192x8192]
    outer: str
    outer_slice: int
    inner_slices: tuple[int, int]


STAGES = (
    Stage("basic tiled", basic_tiled, 51.80, outer="m", outer_slice=256, inner_slices=(1024, 2048)),
    Stage("hoisted loads", hoisted_loads, 42.96, outer="m", outer_slice=256, inner_slices=(1024, 2048)),
    Stage("blocked free dims", blocked_free, 22.07, outer="m", outer_slice=256, inner_slices=(1024, 2048)),
    Stage("fully optimised", fully_optimized, 6.97, outer="n", outer_slice=1024, inner_slices=(2048, 4096)),
)


def operands(m: int, k: int, n: int, seed: int = 0, values: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The matmul's bf16 operands ``lhs_t [k, m]`` and ``rhs [k, n]``, standard normal; zeros without
    ``values`` (a trace-only run's stand-in, see :class:`~kernels_neuron.bench.case.Case`)."""
    if not values:
        return np.zeros((k, m), ml_dtypes.bfloat16), np.zeros((k, n), ml_dtypes.bfloat16)
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((k, m)).astype(ml_dtypes.bfloat16),
        rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16),
    )


def _modelled_ms(stage: Stage, m: int, k: int, n: int, target: str) -> float:
    return cost.estimate(stage.kernel, *operands(m, k, n), target=target).time_us / 1e3


def model_stage(
    stage: Stage, m: int = FULL_M, k: int = FULL_K, n: int = FULL_N, *, target: str = "trn1", whole: bool = False
) -> float:
    """Modelled ms for ``[m, k] @ [k, n]``, from slices scaled by the stage's loop structure.

    ``whole=True`` models the problem unsliced instead (slow at the tutorial's size).
    """
    if whole:
        return _modelled_ms(stage, m, k, n, target)
    outer_total, inner_total = (m, n) if stage.outer == "m" else (n, m)
    if outer_total % stage.outer_slice:
        raise ValueError(f"{stage.name}: {stage.outer.upper()}={outer_total} must be a multiple of {stage.outer_slice}")
    small, large = stage.inner_slices
    times = []
    for inner in (small, large):
        shape = (stage.outer_slice, inner) if stage.outer == "m" else (inner, stage.outer_slice)
        times.append(_modelled_ms(stage, shape[0], k, shape[1], target))
    per_outer_slice = times[0] + (times[1] - times[0]) * (inner_total - small) / (large - small)
    return per_outer_slice * outer_total / stage.outer_slice


def calibrate(target: str = "trn1") -> list[dict]:
    """Model each stage at the tutorial's size; rows of name, published and modelled ms, ratio."""
    rows = []
    for stage in STAGES:
        modelled = model_stage(stage, target=target)
        rows.append(
            {
                "stage": stage.name,
                "published_ms": stage.published_ms,
                "modelled_ms": modelled,
                "ratio": modelled / stage.published_ms,
            }
        )
    return rows


if __name__ == "__main__":
    for row in calibrate():
        print(
            f"{row['stage']:<20} published {row['published_ms']:6.2f} ms   modelled {row['modelled_ms']:6.2f} ms"
            f"   ratio {row['ratio']:.2f}"
        )
