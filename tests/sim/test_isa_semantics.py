"""Semantics of every simulated ``nki.isa`` instruction, checked against independent NumPy math.

Each test builds a tiny ``@nki.jit`` kernel: inputs are DMA'd HBM -> SBUF, one instruction (or a
short sequence) runs, and results are DMA'd to ``nl.shared_hbm`` and returned. The expected
values are computed here with plain NumPy (float64 where the reference must be exact, float32
where the engines' fp32 rounding is the contract), never with the simulator's own helpers.
"""

from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest
from kernel_io import run_body, to_hbm, to_sbuf

from kernels_neuron import sim

sim.install()

import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

from kernels_neuron.sim import ops as sim_ops  # noqa: E402

BF16 = ml_dtypes.bfloat16
FP8_E4M3 = ml_dtypes.float8_e4m3
FLOATS = {"float32": np.float32, "bfloat16": BF16, "float16": np.float16}
FP32_MIN = float(np.finfo(np.float32).min)


def run(body, *arrays, target="trn2", seed=0):
    """The outputs of ``body`` run as a kernel on ``arrays`` (``kernel_io.run_body``)."""
    return run_body(body, *arrays, target=target, seed=seed).outputs


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def sb(shape, dtype):
    return nl.ndarray(tuple(shape), dtype, buffer=nl.sbuf)


def ps(shape, dtype=nl.float32):
    return nl.ndarray(tuple(shape), dtype, buffer=nl.psum)


def rand(shape, dtype=np.float32, lo=-2.0, hi=2.0, seed=0):
    rng = np.random.default_rng(seed)
    return rng.uniform(lo, hi, size=shape).astype(np.float32).astype(dtype)


def f32(x):
    return np.asarray(x).astype(np.float32)


def f64(x):
    return np.asarray(x).astype(np.float32).astype(np.float64)


def bits(x):
    x = np.ascontiguousarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 1: np.uint8}[x.dtype.itemsize])


def assert_bits_equal(actual, expected):
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    np.testing.assert_array_equal(bits(actual), bits(expected))


# Relative tolerance of one unit in the last place for reference results rounded to each dtype.
ULP_RTOL = {np.float32: 1e-6, BF16: 2.0**-7, np.float16: 2.0**-10}


def assert_close_in(dtype, actual, expected64, atol=1e-6):
    """``actual`` (stored in ``dtype``) matches an exact float64 reference to ~one ulp of ``dtype``."""
    assert actual.dtype == np.dtype(dtype)
    np.testing.assert_allclose(f64(actual), np.asarray(expected64, np.float64), rtol=ULP_RTOL[dtype], atol=atol)


# =============================================================================================
# data movement
# =============================================================================================
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16, np.int32, np.uint16, np.int8, FP8_E4M3])
def test_dma_copy_roundtrip_is_bit_exact(dtype):
    rng = np.random.default_rng(1)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max, size=(128, 64), endpoint=True).astype(dtype)
    else:
        x = rand((128, 64), dtype, -100, 100)
        x[0, :4] = np.array([np.inf, -np.inf, -0.0, np.nan]).astype(dtype)
    out = run(lambda t: t, x)
    assert_bits_equal(out, x)


def test_dma_copy_fp32_to_bf16_rounds_to_nearest_even():
    # Exact ties (low 16 bits == 0x8000) round to the even bf16; others round to nearest.
    tie_patterns = np.array(
        [
            0x3F808000,
            0x3F818000,
            0xBF808000,
            0xBF818000,
            0x3F80_8001,
            0x3F80_7FFF,
            0x7F7FFFFF,
            0x00008000,
            0x00018000,
            0x7F800000,
        ],
        dtype=np.uint32,
    )
    x = rand((128, 64), np.float32, -1e4, 1e4, seed=2)
    x.reshape(-1)[: tie_patterns.size] = tie_patterns.view(np.float32)

    @nki.jit
    def kernel(src):
        tile = sb(src.shape, nl.bfloat16)
        nisa.dma_copy(dst=tile, src=src)  # HBM fp32 -> SBUF bf16: conversion in the DMA
        out = nl.ndarray(src.shape, nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    out = kernel(x)
    expected = x.astype(BF16)
    assert_bits_equal(out, expected)
    # Spot-check the tie cases against hand-computed bit patterns.
    got = bits(out).reshape(-1)[: tie_patterns.size]
    np.testing.assert_array_equal(got[:6], [0x3F80, 0x3F82, 0xBF80, 0xBF82, 0x3F81, 0x3F80])
    assert got[6] == 0x7F80  # fp32 max rounds up to +inf in bf16


@pytest.mark.parametrize(
    "src_dtype,dst_dtype",
    [
        (np.float32, np.float16),
        (BF16, np.float32),
        (np.float16, BF16),
        (np.float32, FP8_E4M3),
        (np.int32, np.float32),
    ],
)
def test_dma_copy_converts_dtype_through_fp32(src_dtype, dst_dtype):
    if np.dtype(src_dtype).kind == "i":
        x = np.random.default_rng(3).integers(-5000, 5000, size=(64, 32)).astype(src_dtype)
    else:
        x = rand((64, 32), src_dtype, -8, 8, seed=3)

    @nki.jit
    def kernel(src):
        tile = sb(src.shape, dst_dtype)
        nisa.dma_copy(dst=tile, src=src)
        out = nl.ndarray(src.shape, dst_dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    assert_bits_equal(kernel(x), x.astype(np.float32).astype(dst_dtype))


def test_dma_copy_sbuf_to_sbuf_into_a_slice():
    x = rand((64, 32), seed=4)

    def body(t):
        big = sb((64, 96), nl.float32)
        nisa.memset(dst=big, value=-7.0)
        nisa.dma_copy(dst=big[:, 32:64], src=t)
        return big

    out = run(body, x)
    expected = np.full((64, 96), -7.0, np.float32)
    expected[:, 32:64] = x
    np.testing.assert_array_equal(out, expected)


def test_dma_copy_strided_and_stepped_slices():
    x = rand((128, 96), seed=5)

    @nki.jit
    def kernel(src):
        tile = sb((64, 32), nl.float32)
        nisa.memset(dst=tile, value=0.0)
        # every other HBM row, every third column starting at 1 -> every other SBUF column
        nisa.dma_copy(dst=tile[:, ::2], src=src[::2, 1:48:3])
        nisa.dma_copy(dst=tile[:, 1::2], src=src[nl.ds(1, 64), nl.ds(50, 16)])
        out = nl.ndarray((64, 32), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    expected = np.zeros((64, 32), np.float32)
    expected[:, ::2] = x[::2, 1:48:3]
    expected[:, 1::2] = x[1:65, 50:66]
    np.testing.assert_array_equal(kernel(x), expected)


def test_dma_copy_access_patterns_on_hbm_and_sbuf():
    x = rand((64, 32), seed=6)
    flat = x.reshape(-1)

    @nki.jit
    def kernel(src):
        a = sb((16, 8), nl.float32)
        # a[i, j] = flat[5 + 32*i + 2*j]
        nisa.dma_copy(dst=a, src=src.ap(pattern=[[32, 16], [2, 8]], offset=5))
        b = sb((32, 2, 4), nl.float32)
        # 3-level pattern: b[i, k, j] = flat[64*i + 16*k + j]
        nisa.dma_copy(dst=b, src=src.ap(pattern=[[64, 32], [16, 2], [1, 4]], offset=0))
        # SBUF access pattern with an offset: write columns 8..15 of a (16, 24) tile.
        c = sb((16, 24), nl.float32)
        nisa.memset(dst=c, value=1.5)
        nisa.dma_copy(dst=c.ap(pattern=[[24, 16], [1, 8]], offset=8), src=a)
        outs = []
        for t in (a, b, c):
            o = nl.ndarray(t.shape, nl.float32, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=o, src=t)
            outs.append(o)
        return tuple(outs)

    a, b, c = kernel(x)
    i, j = np.meshgrid(np.arange(16), np.arange(8), indexing="ij")
    np.testing.assert_array_equal(a, flat[5 + 32 * i + 2 * j])
    i, k, j = np.meshgrid(np.arange(32), np.arange(2), np.arange(4), indexing="ij")
    np.testing.assert_array_equal(b, flat[64 * i + 16 * k + j])
    expected_c = np.full((16, 24), 1.5, np.float32)
    expected_c[:, 8:16] = a
    np.testing.assert_array_equal(c, expected_c)


def _gather_kernel(oob):
    @nki.jit
    def kernel(data, indices):
        P, F = indices.shape[0], data.shape[1]
        idx = sb((P, 1), nl.uint32)
        nisa.dma_copy(dst=idx, src=indices)
        dst = sb((P, F), data.dtype)
        nisa.memset(dst=dst, value=-1.0)
        nisa.dma_copy(dst=dst, src=data.ap(pattern=[[F, P], [1, F]], vector_offset=idx, indirect_dim=0), oob_mode=oob)
        out = nl.ndarray((P, F), data.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=dst)
        return out

    return kernel


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_dma_copy_indirect_gather_rows(dtype):
    data = rand((64, 16), dtype, seed=7)
    idx = np.random.default_rng(7).integers(0, 64, size=(32, 1)).astype(np.uint32)
    out = _gather_kernel(nisa.oob_mode.error)(data, idx)
    assert_bits_equal(out, data[idx[:, 0]])


def test_an_indirect_gather_records_the_row_as_its_contiguous_run():
    """The cost model prices a DMA by its descriptors' contiguous bytes: a gather of whole rows moves a
    row per descriptor, not one element."""
    data = rand((64, 16), np.float32, seed=7)
    idx = np.arange(32, dtype=np.uint32).reshape(32, 1)
    result = sim.run(_gather_kernel(nisa.oob_mode.error), data, idx)
    gather = [i for i in result.trace.instructions if i.op == "dma_copy"][1]
    assert gather.attrs["contiguous_bytes"] == 16 * 4


def test_dma_copy_indirect_gather_out_of_bounds_skip_vs_error():
    data = rand((64, 16), seed=8)
    idx = np.arange(32, dtype=np.uint32).reshape(32, 1) * 2
    idx[[3, 17, 30], 0] = [64, 1000, 65]  # past the last row
    with pytest.raises(nisa.NkiValidationError, match="out of bounds"):
        _gather_kernel(nisa.oob_mode.error)(data, idx)
    out = _gather_kernel(nisa.oob_mode.skip)(data, idx)
    valid = idx[:, 0] < 64
    np.testing.assert_array_equal(out[valid], data[idx[valid, 0]])
    np.testing.assert_array_equal(out[~valid], -1.0)  # skipped rows keep what dst held


def test_dma_copy_indirect_scatter_rows():
    src = rand((16, 8), seed=9)
    idx = np.random.default_rng(9).permutation(40)[:16].astype(np.uint32).reshape(16, 1)
    target = np.full((40, 8), -3.0, np.float32)

    @nki.jit
    def kernel(values, indices, output):
        t = to_sbuf(values)
        i = to_sbuf(indices)
        nisa.dma_copy(dst=output.ap(pattern=[[8, 16], [1, 8]], vector_offset=i, indirect_dim=0), src=t)
        return output

    out = kernel(src, idx, target)
    expected = np.full((40, 8), -3.0, np.float32)
    expected[idx[:, 0]] = src
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("shape", [(16, 128), (4, 8, 32), (2, 3, 4, 16)], ids=["2d", "3d", "4d"])
@pytest.mark.parametrize("dtype", [BF16, np.float16])
def test_dma_transpose_permutations(shape, dtype):
    x = rand(shape, dtype, seed=10)
    axes = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}[len(shape)]
    expected = np.transpose(x, axes)

    @nki.jit
    def kernel(src):
        tile = sb(expected.shape, src.dtype)
        nisa.dma_transpose(dst=tile, src=src, axes=axes)
        out = nl.ndarray(expected.shape, src.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    assert_bits_equal(kernel(x), np.ascontiguousarray(expected))


def test_dma_transpose_sbuf_source_and_rules():
    x = rand((16, 64), BF16, seed=11)
    out = run(lambda t: _dma_t(t, (64, 16)), x)
    assert_bits_equal(out, np.ascontiguousarray(x.T))
    # AWS's API reference limits only the hardware-DGE and indirect transposes to 2-byte dtypes.
    wide = x.astype(np.float32)
    np.testing.assert_array_equal(run(lambda t: _dma_t(t, (64, 16)), wide), wide.T)
    with pytest.raises(nisa.NkiValidationError, match="axes"):
        run(lambda t: _dma_t(t, (64, 16), axes=(0, 1)), x)


def _dma_t(t, shape, axes=None):
    dst = sb(shape, t.dtype)
    nisa.dma_transpose(dst=dst, src=t, axes=axes)
    return dst


@pytest.mark.parametrize("engine", [nisa.vector_engine, nisa.scalar_engine, nisa.gpsimd_engine])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int32])
def test_tensor_copy_same_dtype_is_bit_exact(engine, dtype):
    if np.dtype(dtype).kind == "i":
        x = np.random.default_rng(12).integers(-(2**31), 2**31 - 1, size=(128, 64)).astype(dtype)
    else:
        x = rand((128, 64), dtype, -1e30, 1e30, seed=12)
        # NaN payloads, signed zero and infinities survive a same-dtype copy untouched.
        specials = np.array([0x7FC01234, 0xFFA00001, 0x80000000, 0x7F800000], np.uint32)
        if dtype == BF16:
            specials = (specials >> 16).astype(np.uint16)
        x.reshape(-1)[:4] = specials.view(dtype)

    def body(t):
        dst = sb(t.shape, t.dtype)
        nisa.tensor_copy(dst=dst, src=t, engine=engine)
        return dst

    assert_bits_equal(run(body, x), x)


@pytest.mark.parametrize("dst_dtype", [BF16, np.float16, FP8_E4M3])
def test_tensor_copy_cast_rounds_like_numpy(dst_dtype):
    x = rand((128, 64), np.float32, -50, 50, seed=13)
    x.reshape(-1)[:3] = np.array([0x3F808000, 0x3F818000, 0x3F80_8001], np.uint32).view(np.float32)

    def body(t):
        dst = sb(t.shape, dst_dtype)
        nisa.tensor_copy(dst=dst, src=t)
        return dst

    assert_bits_equal(run(body, x), x.astype(dst_dtype))


def test_tensor_copy_int_conversions_go_through_fp32():
    # Differing dtypes convert through an fp32 intermediate: 2**24 + 1 is not an fp32 value, and
    # an out-of-range value saturates (it does not wrap) when the fp32 is written as int16.
    x = np.array([[2**24 + 1, 40000, -40000, 7]], dtype=np.int32).repeat(4, axis=0)

    def body(t):
        as_f32, as_i16 = sb(t.shape, nl.float32), sb(t.shape, nl.int16)
        nisa.tensor_copy(dst=as_f32, src=t)
        nisa.tensor_copy(dst=as_i16, src=t)
        return as_f32, as_i16

    as_f32, as_i16 = run(body, x)
    np.testing.assert_array_equal(as_f32, x.astype(np.float32))
    assert as_f32[0, 0] == 2**24
    np.testing.assert_array_equal(as_i16[0], [32767, 32767, -32768, 7])


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_tensor_copy_sbuf_to_psum_and_back(dtype):
    x = rand((64, 128), dtype, seed=14)

    def body(t):
        acc = ps(t.shape, t.dtype)
        nisa.tensor_copy(dst=acc, src=t)
        back = sb(t.shape, nl.float32)
        nisa.tensor_copy(dst=back, src=acc, engine=nisa.vector_engine)
        return back

    assert_bits_equal(run(body, x), x.astype(np.float32))
    with pytest.raises(nisa.NkiValidationError, match="PSUM"):
        run(lambda t: nisa.tensor_copy(dst=ps(t.shape), src=t, engine=nisa.gpsimd_engine), x)


@pytest.mark.parametrize("pred_dtype", [np.uint8, np.uint16, np.uint32])
@pytest.mark.parametrize("reverse", [False, True])
def test_tensor_copy_predicated_tensor_source(pred_dtype, reverse):
    rng = np.random.default_rng(15)
    x = rand((128, 48), seed=15)
    # Any non-zero bit pattern is "true", including ones whose low byte is zero.
    pred = (rng.integers(0, 2, size=x.shape) * (256 if pred_dtype != np.uint8 else 1)).astype(pred_dtype)

    def body(t, p):
        dst = sb(t.shape, nl.float32)
        nisa.memset(dst=dst, value=9.0)
        nisa.tensor_copy_predicated(dst=dst, src=t, predicate=p, reverse_pred=reverse)
        return dst

    mask = (pred != 0) != reverse
    np.testing.assert_array_equal(run(body, x, pred), np.where(mask, x, np.float32(9.0)))


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_tensor_copy_predicated_scalar_source(dtype):
    x = rand((64, 32), dtype, seed=16)
    pred = np.random.default_rng(16).integers(0, 2, size=x.shape).astype(np.uint8)

    def body(t, p):
        nisa.tensor_copy_predicated(dst=t, src=-0.375, predicate=p)
        return t

    expected = np.where(pred != 0, np.asarray(-0.375, dtype), x)
    assert_bits_equal(run(body, x, pred), expected.astype(dtype))


@pytest.mark.parametrize(
    "dtype,value",
    [
        (np.float32, 3.25),
        (BF16, 1.0 / 3.0),
        (np.float16, -1e-3),
        (np.int32, -123456),
        (np.uint8, 200),
    ],
)
@pytest.mark.parametrize("engine", [nisa.vector_engine, nisa.gpsimd_engine])
def test_memset_fills_with_value_rounded_to_dtype(dtype, value, engine):
    def body():
        t = sb((96, 40), dtype)
        nisa.memset(dst=t, value=value, engine=engine)
        return t

    out = run(body)
    is_int = np.dtype(dtype).kind in "iu"
    expected = np.full((96, 40), (np.int64(value) if is_int else np.float32(value)).astype(dtype))
    assert_bits_equal(out, expected)


def test_memset_partial_view_leaves_rest():
    def body():
        t = sb((32, 16), nl.float32)
        nisa.memset(dst=t, value=1.0)
        nisa.memset(dst=t[:, 4:12:2], value=-2.0)
        return t

    expected = np.ones((32, 16), np.float32)
    expected[:, 4:12:2] = -2.0
    np.testing.assert_array_equal(run(body), expected)


# =============================================================================================
# TensorE
# =============================================================================================
def _matmul(stationary, moving, dst_shape, **kwargs):
    acc = ps(dst_shape)
    nisa.nc_matmul(dst=acc, stationary=stationary, moving=moving, **kwargs)
    return acc


def _matmul_ref(a, b):
    """stationary.T @ moving in float64, plus a bound on fp32 accumulation error."""
    a64, b64 = f64(a), f64(b)
    return a64.T @ b64, (np.abs(a64).T @ np.abs(b64)) * 1e-6


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("kmn", [(128, 64, 96), (32, 128, 512), (7, 3, 5)])
def test_nc_matmul_matches_float_reference(dtype, kmn):
    k, m, n = kmn
    a, b = rand((k, m), dtype, seed=20), rand((k, n), dtype, seed=21)
    out = run(lambda s, mv: _matmul(s, mv, (m, n)), a, b)
    ref, tol = _matmul_ref(a, b)
    assert out.dtype == np.float32
    assert np.all(np.abs(out - ref) <= tol + 1e-30)


def test_nc_matmul_accumulate_auto_detect_first_overwrites_then_adds():
    a = rand((128, 64), seed=22)
    b = rand((128, 80), seed=23)
    c = rand((128, 80), seed=24)

    def body(s, m1, m2):
        acc = ps((64, 80))  # uninitialized PSUM reads as NaN: an add would poison the result
        nisa.nc_matmul(dst=acc, stationary=s, moving=m1)  # first write: overwrite
        first = sb((64, 80), nl.float32)
        nisa.tensor_copy(dst=first, src=acc)
        nisa.nc_matmul(dst=acc, stationary=s, moving=m2)  # later write: accumulate
        return first, acc

    first, total = run(body, a, b, c)
    ref1, tol1 = _matmul_ref(a, b)
    ref2, tol2 = _matmul_ref(a, c)
    assert np.all(np.abs(first - ref1) <= tol1)
    assert np.all(np.abs(total - (ref1 + ref2)) <= tol1 + tol2)


def test_nc_matmul_accumulates_by_its_own_view_once_a_tile_holds_mixed_writers():
    """Whether a matmul accumulates, and whether it warns, comes from its own view's elements, also after
    different parts of the tile were written by different instructions (a tile whose elements all hold
    one writer is answered without reading them: this checks the partial writes end that)."""
    a, b = rand((32, 16), seed=60), rand((32, 24), seed=61)

    def body(s, m):
        halves = ps((16, 48))  # uninitialized PSUM reads as NaN: a wrong add would poison the result
        nisa.nc_matmul(dst=halves[:, 0:24], stationary=s, moving=m)  # overwrites
        nisa.nc_matmul(dst=halves[:, 24:48], stationary=s, moving=m)  # its half is unwritten: overwrites
        nisa.nc_matmul(dst=halves[:, 0:24], stationary=s, moving=m)  # adds
        return halves

    result = run_body(body, a, b)
    reads_dst = ["dst_in" in [op.role for op in i.operands] for i in result.trace if i.op == "nc_matmul"]
    assert reads_dst == [False, False, True]
    out = result.outputs
    ref, tol = _matmul_ref(a, b)
    assert np.all(np.abs(out[:, :24] - 2 * ref) <= 2 * tol)
    assert np.all(np.abs(out[:, 24:] - ref) <= tol)

    wide = rand((32, 64), seed=62)

    def partly_memset(onto_memset):
        def body(s, m):
            tile = ps((64, 24))
            nisa.nc_matmul(dst=tile, stationary=s, moving=m)  # the whole tile, by a matmul
            nisa.memset(dst=tile[0:32, :], value=1.0)  # part of it by another instruction
            nisa.nc_matmul(dst=tile[0:32, :] if onto_memset else tile[32:64, :], stationary=s[:, 0:32], moving=m)
            return tile

        return body

    with pytest.warns(sim.AccumulateOntoNonMatmulWarning, match="written by a non-matmul"):
        run(partly_memset(True), wide, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = run(partly_memset(False), wide, b)
    ref, tol = _matmul_ref(wide, b)
    assert np.all(np.abs(out[32:] - (ref[32:] + ref[:32])) <= tol[32:] + tol[:32])


def test_a_strided_write_with_the_tiles_element_count_does_not_count_as_the_whole_tile():
    """An access pattern may have as many elements as its tile and still cover only part of it (here the
    first 24 columns, each twice): a matmul into the other columns then starts a group, as on an
    unwritten tile."""
    a, b = rand((32, 16), seed=63), rand((32, 24), seed=64)

    def body(s, m):
        tile = ps((16, 48))
        nisa.memset(dst=tile.ap([[48, 16], [0, 2], [1, 24]], offset=0), value=0.0)
        nisa.nc_matmul(dst=tile[:, 24:48], stationary=s, moving=m)
        return tile

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no accumulating-onto-memset warning: nothing accumulates
        result = run_body(body, a, b)
    assert ["dst_in" in [op.role for op in i.operands] for i in result.trace if i.op == "nc_matmul"] == [False]
    ref, tol = _matmul_ref(a, b)
    assert np.all(np.abs(result.outputs[:, 24:] - ref) <= tol)


def test_nc_matmul_accumulate_explicit_true_and_false():
    a, b = rand((64, 32), seed=25), rand((64, 48), seed=26)

    def body(s, m):
        added = ps((32, 48))
        nisa.memset(dst=added, value=5.0)
        nisa.nc_matmul(dst=added, stationary=s, moving=m, accumulate=True)
        replaced = ps((32, 48))
        nisa.memset(dst=replaced, value=5.0)
        nisa.nc_matmul(dst=replaced, stationary=s, moving=m, accumulate=False)
        # K split in two chunks accumulated explicitly == one K=64 matmul
        split = ps((32, 48))
        nisa.nc_matmul(dst=split, stationary=s[0:32, :], moving=m[0:32, :], accumulate=False)
        nisa.nc_matmul(dst=split, stationary=s[32:64, :], moving=m[32:64, :], accumulate=True)
        return added, replaced, split

    # Accumulating onto memset PSUM is defined from NeuronCore-v4 on (nc_matmul's docstring).
    added, replaced, split = run(body, a, b, target="trn3")
    ref, tol = _matmul_ref(a, b)
    assert np.all(np.abs(added - (ref + 5.0)) <= tol + 1e-5)
    assert np.all(np.abs(replaced - ref) <= tol)
    assert np.all(np.abs(split - ref) <= tol)


@pytest.mark.parametrize(
    "position,size,k,m",
    [
        ((32, 0), (32, 128), 32, 96),
        ((64, 64), (64, 64), 64, 64),
        ((96, 32), (32, 32), 20, 32),
    ],
)
def test_nc_matmul_row_and_column_tiling_computes_the_same_product(position, size, k, m):
    a, b = rand((k, m), BF16, seed=27), rand((k, 64), BF16, seed=28)
    out = run(lambda s, mv: _matmul(s, mv, (m, 64), tile_position=position, tile_size=size), a, b)
    ref, tol = _matmul_ref(a, b)
    assert np.all(np.abs(out - ref) <= tol)


def test_nc_matmul_tiling_rules():
    a, b = rand((64, 32), BF16, seed=29), rand((64, 16), BF16, seed=30)
    with pytest.raises(nisa.NkiValidationError, match="row tile"):  # K=64 does not fit a 32-row tile
        run(lambda s, mv: _matmul(s, mv, (32, 16), tile_position=(0, 0), tile_size=(32, 128)), a, b)
    with pytest.raises(nisa.NkiValidationError, match="multiple"):
        run(lambda s, mv: _matmul(s, mv, (32, 16), tile_position=(32, 0), tile_size=(64, 128)), a, b)
    with pytest.raises(nisa.NkiValidationError, match="32"):  # 32-row tiles need NeuronCore-v3
        run(
            lambda s, mv: _matmul(s[0:32], mv[0:32], (32, 16), tile_position=(0, 0), tile_size=(32, 128)),
            a,
            b,
            target="trn1",
        )


def test_nc_matmul_fp8_double_row_contracts_over_partitions_and_pairs():
    rng = np.random.default_rng(31)
    grid = np.array([-2, -1.5, -1, -0.5, -0.25, 0, 0.25, 0.5, 1, 1.5, 2], np.float32)
    s = rng.choice(grid, size=(64, 2, 24)).astype(FP8_E4M3)
    m = rng.choice(grid, size=(64, 2, 40)).astype(FP8_E4M3)
    out = run(lambda st, mv: _matmul(st, mv, (24, 40), perf_mode=nisa.matmul_perf_mode.double_row), s, m)
    expected = np.einsum("kjm,kjn->mn", f64(s), f64(m))  # small dyadic values: exact in fp32
    np.testing.assert_array_equal(out, expected.astype(np.float32))
    with pytest.raises(nisa.NkiValidationError, match="double_row"):
        run(lambda st, mv: _matmul(st, mv, (24, 40), perf_mode=nisa.matmul_perf_mode.double_row), s, m, target="trn1")
    with pytest.raises(nisa.NkiValidationError, match="fp8"):
        run(
            lambda st, mv: _matmul(st, mv, (24, 40), perf_mode=nisa.matmul_perf_mode.double_row),
            s.astype(BF16),
            m.astype(BF16),
        )


def test_nc_matmul_is_transpose_is_bit_accurate_with_nan_and_inf():
    x = rand((64, 48), seed=32)
    x[3, 5], x[10, 0] = np.nan, np.inf
    eye = np.eye(64, dtype=np.float32)

    def body(s, identity):
        tp = ps((48, 64))
        nisa.nc_matmul(dst=tp, stationary=s, moving=identity, is_transpose=True)
        plain = ps((48, 64))
        nisa.nc_matmul(dst=plain, stationary=s, moving=identity)
        return tp, plain

    tp, plain = run(body, x, eye)
    assert_bits_equal(tp, np.ascontiguousarray(x.T))
    # A real multiply by the identity spreads NaN (NaN * 0) across the whole output row.
    assert np.isnan(plain[5]).all() and np.isnan(plain[0]).any()


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("shape", [(128, 128), (96, 40), (5, 3)])
def test_nc_transpose_tensor_engine(dtype, shape):
    x = rand(shape, dtype, seed=33)

    def body(t):
        dst = ps((shape[1], shape[0]), t.dtype)
        nisa.nc_transpose(dst=dst, data=t, engine=nisa.tensor_engine)
        return dst

    assert_bits_equal(run(body, x), np.ascontiguousarray(x.T))


def test_nc_transpose_flattens_free_axes():
    x = rand((16, 4, 8), seed=34)

    def body(t):
        dst = ps((32, 16), t.dtype)
        nisa.nc_transpose(dst=dst, data=t)
        return dst

    np.testing.assert_array_equal(run(body, x), x.reshape(16, 32).T)


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int32])
def test_nc_transpose_vector_engine_up_to_32x32(dtype):
    x = (np.arange(32 * 24).reshape(32, 24) * 3 - 700).astype(dtype)

    def body(t):
        dst = sb((24, 32), t.dtype)
        nisa.nc_transpose(dst=dst, data=t, engine=nisa.vector_engine)
        return dst

    assert_bits_equal(run(body, x), np.ascontiguousarray(x.T))
    big = rand((64, 64), seed=35)
    with pytest.raises(nisa.NkiValidationError, match="32x32"):
        run(lambda t: nisa.nc_transpose(dst=sb((64, 64), nl.float32), data=t, engine=nisa.vector_engine), big)


# =============================================================================================
# element-wise: tensor_tensor, tensor_scalar, scalar_tensor_tensor, reciprocal
# =============================================================================================
EXACT_BINARY = {
    "add": (nl.add, np.add),
    "subtract": (nl.subtract, np.subtract),
    "multiply": (nl.multiply, np.multiply),
    "divide": (nl.divide, np.divide),
    "maximum": (nl.maximum, np.maximum),
    "minimum": (nl.minimum, np.minimum),
}


def _abs_max_ref(a, b):
    return np.where(np.abs(a) > np.abs(b), a, b)  # the signed value of larger magnitude; ties -> b


@pytest.mark.parametrize("name", sorted(EXACT_BINARY) + ["abs_max"])
@pytest.mark.parametrize("dtype", list(FLOATS.values()), ids=list(FLOATS))
def test_tensor_tensor_arithmetic_ops(name, dtype):
    a = rand((128, 64), dtype, -4, 4, seed=40)
    b = rand((128, 64), dtype, -4, 4, seed=41)
    b[np.abs(f32(b)) < 0.25] = 0.5  # keep divisors away from zero
    b[0, :8] = a[0, :8]  # ties for max/min/abs_max
    b[1, :8] = -a[1, :8]
    op, ref = (nl.abs_max, _abs_max_ref) if name == "abs_max" else EXACT_BINARY[name]

    def body(x, y):
        dst = sb(x.shape, x.dtype)
        nisa.tensor_tensor(dst=dst, data1=x, data2=y, op=op)
        return dst

    # The engines compute in fp32 and round once to dst's dtype: exact for IEEE ops.
    with np.errstate(all="ignore"):
        expected = np.asarray(ref(f32(a), f32(b)), np.float32).astype(dtype)
    target = "trn3" if name == "abs_max" else "trn2"  # nl.abs_max is NeuronCore-v4 only
    assert_bits_equal(run(body, a, b, target=target), expected)


@pytest.mark.parametrize("dtype", list(FLOATS.values()), ids=list(FLOATS))
def test_tensor_tensor_power_runs_on_gpsimd(dtype):
    a = rand((64, 32), dtype, 0.25, 3, seed=42)
    b = rand((64, 32), dtype, -2, 2, seed=43)

    def body(x, y):
        dst = sb(x.shape, x.dtype)
        nisa.tensor_tensor(dst=dst, data1=x, data2=y, op=nl.power)
        return dst

    assert_close_in(dtype, run(body, a, b), np.power(f64(a), f64(b)))
    with pytest.raises(nisa.NkiValidationError, match="GpSimd"):
        run(
            lambda x, y: nisa.tensor_tensor(
                dst=sb(x.shape, x.dtype), data1=x, data2=y, op=nl.power, engine=nisa.vector_engine
            ),
            a,
            b,
        )


@pytest.mark.parametrize(
    "name,ref",
    [
        ("equal", np.equal),
        ("not_equal", np.not_equal),
        ("greater", np.greater),
        ("greater_equal", np.greater_equal),
        ("less", np.less),
        ("less_equal", np.less_equal),
    ],
)
@pytest.mark.parametrize("out_dtype", [np.float32, np.uint8, BF16])
def test_tensor_tensor_comparisons_return_one_or_zero(name, ref, out_dtype):
    a = rand((64, 32), np.float32, -3, 3, seed=44)
    b = rand((64, 32), np.float32, -3, 3, seed=45)
    b[::3] = a[::3]  # plenty of ties

    def body(x, y):
        dst = sb(x.shape, out_dtype)
        nisa.tensor_tensor(dst=dst, data1=x, data2=y, op=getattr(nl, name))
        return dst

    out = run(body, a, b)
    assert set(np.unique(f32(out))) <= {0.0, 1.0}
    np.testing.assert_array_equal(f32(out), ref(a, b).astype(np.float32))


@pytest.mark.parametrize(
    "name,ref",
    [
        ("bitwise_and", np.bitwise_and),
        ("bitwise_or", np.bitwise_or),
        ("bitwise_xor", np.bitwise_xor),
        ("left_shift", np.left_shift),
        ("right_shift", np.right_shift),
    ],
)
@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.uint8])
def test_tensor_tensor_bitvec_ops_act_on_bit_patterns(name, ref, dtype):
    rng = np.random.default_rng(46)
    info = np.iinfo(dtype)
    if "shift" in name:
        a = rng.integers(0, info.max, size=(64, 32), endpoint=True).astype(dtype)
        b = rng.integers(0, 8, size=(64, 32)).astype(dtype)
    else:
        a = rng.integers(info.min, info.max, size=(64, 32), endpoint=True).astype(dtype)
        b = rng.integers(info.min, info.max, size=(64, 32), endpoint=True).astype(dtype)

    def body(x, y):
        dst = sb(x.shape, x.dtype)
        nisa.tensor_tensor(dst=dst, data1=x, data2=y, op=getattr(nl, name))
        return dst

    # Shifted-out bits are dropped (the result wraps to the dtype's width).
    np.testing.assert_array_equal(run(body, a, b), ref(a, b).astype(dtype))


def test_tensor_tensor_bitvec_rejects_float_tiles():
    a = rand((8, 8), seed=47)
    with pytest.raises(nisa.NkiValidationError, match="integer"):
        run(lambda x, y: nisa.tensor_tensor(dst=sb(x.shape, x.dtype), data1=x, data2=y, op=nl.bitwise_and), a, a)


@pytest.mark.parametrize(
    "name,ref",
    [
        ("add", np.add),
        ("subtract", np.subtract),
        ("multiply", np.multiply),
        ("maximum", np.maximum),
        ("minimum", np.minimum),
    ],
)
def test_tensor_tensor_int32_on_gpsimd_is_exact(name, ref):
    # All-int32 tiles default to GpSimd's native 32-bit integer arithmetic: no fp32 rounding.
    a = np.array([[2**24 + 1, 2**30 + 3, -(2**28) - 7, 123456789, 5]], np.int32).repeat(8, axis=0)
    b = np.array([[1, 5, 3, -987654, -(2**24) - 1]], np.int32).repeat(8, axis=0)
    if name == "multiply":
        a, b = a % 40000, b % 40000

    def body(x, y):
        dst = sb(x.shape, nl.int32)
        nisa.tensor_tensor(dst=dst, data1=x, data2=y, op=getattr(nl, name))
        return dst

    expected = ref(a.astype(np.int64), b.astype(np.int64)).astype(np.int32)
    np.testing.assert_array_equal(run(body, a, b), expected)


@pytest.mark.parametrize("dtype", list(FLOATS.values()), ids=list(FLOATS))
def test_tensor_scalar_scalar_and_vector_operands(dtype):
    x = rand((128, 64), dtype, -4, 4, seed=50)
    col = rand((128, 1), np.float32, 0.5, 2, seed=51)

    def body(t, v):
        with_scalar = sb(t.shape, t.dtype)
        nisa.tensor_scalar(dst=with_scalar, data=t, op0=nl.multiply, operand0=0.3)
        with_vector = sb(t.shape, t.dtype)
        nisa.tensor_scalar(dst=with_vector, data=t, op0=nl.subtract, operand0=v)
        return with_scalar, with_vector

    with_scalar, with_vector = run(body, x, col)
    assert_bits_equal(with_scalar, (f32(x) * np.float32(0.3)).astype(dtype))
    assert_bits_equal(with_vector, (f32(x) - col).astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_tensor_scalar_reverse_flags_and_two_op_chain(dtype):
    x = rand((64, 48), dtype, 0.5, 4, seed=52)
    col = rand((64, 1), np.float32, -2, 2, seed=53)

    def body(t, v):
        outs = [sb(t.shape, nl.float32) for _ in range(4)]
        nisa.tensor_scalar(dst=outs[0], data=t, op0=nl.subtract, operand0=v, reverse0=True)  # v - x
        nisa.tensor_scalar(dst=outs[1], data=t, op0=nl.divide, operand0=3.0, reverse0=True)  # 3 / x
        nisa.tensor_scalar(dst=outs[2], data=t, op0=nl.multiply, operand0=v, op1=nl.add, operand1=0.75)
        nisa.tensor_scalar(
            dst=outs[3], data=t, op0=nl.add, operand0=1.5, op1=nl.subtract, operand1=v, reverse1=True
        )  # v - (x + 1.5)
        return tuple(outs)

    o0, o1, o2, o3 = run(body, x, col)
    xf = f32(x)
    np.testing.assert_array_equal(o0, col - xf)
    np.testing.assert_array_equal(o1, np.float32(3.0) / xf)
    np.testing.assert_array_equal(o2, (xf * col) + np.float32(0.75))
    np.testing.assert_array_equal(o3, col - (xf + np.float32(1.5)))


def test_tensor_scalar_unary_ops_as_op0():
    x = rand((64, 32), np.float32, -4, 4, seed=54)
    x[0, 0] = -0.0

    def body(t):
        a, r, c = (sb(t.shape, nl.float32) for _ in range(3))
        nisa.tensor_scalar(dst=a, data=t, op0=nl.abs, operand0=0.0, op1=nl.multiply, operand1=2.0)
        nisa.tensor_scalar(dst=r, data=a, op0=nl.rsqrt, operand0=None, engine=nisa.gpsimd_engine)
        nisa.tensor_scalar(dst=c, data=t, op0=nl.abs, operand0=None)
        return a, r, c

    a, r, c = run(body, x)
    np.testing.assert_array_equal(a, np.abs(x) * np.float32(2))
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(r, 1.0 / np.sqrt(np.abs(f64(x)) * 2), rtol=1e-6)
    assert_bits_equal(c, np.abs(x))


def test_tensor_scalar_bitvec_on_integers():
    x = np.random.default_rng(55).integers(0, 2**16, size=(32, 16)).astype(np.uint16)

    def body(t):
        dst = sb(t.shape, nl.uint16)
        nisa.tensor_scalar(dst=dst, data=t, op0=nl.bitwise_and, operand0=0x0FF0, op1=nl.left_shift, operand1=4)
        return dst

    np.testing.assert_array_equal(run(body, x), ((x & 0x0FF0) << 4).astype(np.uint16))
    with pytest.raises(nisa.NkiValidationError, match="bitvec"):
        run(
            lambda t: nisa.tensor_scalar(
                dst=sb(t.shape, nl.uint16), data=t, op0=nl.bitwise_and, operand0=1, op1=nl.add, operand1=1.0
            ),
            x,
        )


def test_tensor_scalar_scalar_engine_combos():
    x = rand((32, 16), seed=56)

    def body(t):
        dst = sb(t.shape, nl.float32)
        nisa.tensor_scalar(
            dst=dst, data=t, op0=nl.multiply, operand0=-1.25, op1=nl.add, operand1=0.5, engine=nisa.scalar_engine
        )
        return dst

    np.testing.assert_array_equal(run(body, x), x * np.float32(-1.25) + np.float32(0.5))
    with pytest.raises(nisa.NkiValidationError, match="ScalarE"):
        run(
            lambda t: nisa.tensor_scalar(
                dst=sb(t.shape, nl.float32), data=t, op0=nl.maximum, operand0=0.0, engine=nisa.scalar_engine
            ),
            x,
        )


@pytest.mark.parametrize("dtype", list(FLOATS.values()), ids=list(FLOATS))
def test_scalar_tensor_tensor(dtype):
    x = rand((128, 64), dtype, -3, 3, seed=57)
    y = rand((128, 64), dtype, -3, 3, seed=58)
    col = rand((128, 1), np.float32, -2, 2, seed=59)

    def body(t, u, v):
        a, b = sb(t.shape, t.dtype), sb(t.shape, nl.float32)
        nisa.scalar_tensor_tensor(dst=a, data=t, op0=nl.multiply, operand0=v, op1=nl.add, operand1=u)
        nisa.scalar_tensor_tensor(
            dst=b, data=t, op0=nl.subtract, operand0=0.5, op1=nl.subtract, operand1=u, reverse0=True, reverse1=True
        )  # u - (0.5 - t)
        return a, b

    a, b = run(body, x, y, col)
    assert_bits_equal(a, ((f32(x) * col) + f32(y)).astype(dtype))
    np.testing.assert_array_equal(b, f32(y) - (np.float32(0.5) - f32(x)))


@pytest.mark.parametrize("dtype", list(FLOATS.values()), ids=list(FLOATS))
def test_reciprocal(dtype):
    x = rand((128, 64), dtype, 0.1, 8, seed=60)
    x[::2] = -x[::2]

    def body(t):
        dst = sb(t.shape, t.dtype)
        nisa.reciprocal(dst=dst, data=t)
        return dst

    assert_bits_equal(run(body, x), (np.float32(1) / f32(x)).astype(dtype))


# =============================================================================================
# reductions
# =============================================================================================
REDUCE = {
    "add": (nl.add, np.sum),
    "maximum": (nl.maximum, np.max),
    "minimum": (nl.minimum, np.min),
    "multiply": (nl.multiply, np.prod),
}


@pytest.mark.parametrize("name", sorted(REDUCE))
@pytest.mark.parametrize("dtype", list(FLOATS.values()), ids=list(FLOATS))
def test_tensor_reduce_last_axis(name, dtype):
    op, ref = REDUCE[name]
    lo, hi = (0.8, 1.25) if name == "multiply" else (-4, 4)
    x = rand((128, 64), dtype, lo, hi, seed=61)

    def body(t):
        dst = sb((128, 1), nl.float32)
        nisa.tensor_reduce(dst=dst, op=op, data=t, axis=1)
        return dst

    expected = ref(f64(x), axis=1, keepdims=True)
    bound = 1e-6 * np.abs(expected) + 1e-6 * np.abs(f64(x)).sum(1, keepdims=True)
    assert np.all(np.abs(run(body, x) - expected) <= bound)


@pytest.mark.parametrize("name", sorted(REDUCE))
def test_tensor_reduce_trailing_axes_negate_and_keepdims(name):
    op, ref = REDUCE[name]
    lo, hi = (0.9, 1.1) if name == "multiply" else (-4, 4)
    x = rand((64, 3, 4, 8), np.float32, lo, hi, seed=62)

    def body(t):
        last = sb((64, 3, 4), nl.float32)
        nisa.tensor_reduce(dst=last, op=op, data=t, axis=3)
        two = sb((64, 3), nl.float32)
        nisa.tensor_reduce(dst=two, op=op, data=t, axis=(2, 3), negate=True)
        kept = sb((64, 1, 1, 1), nl.float32)
        nisa.tensor_reduce(dst=kept, op=op, data=t, axis=[1, 2, 3], keepdims=True)
        return last, two, kept

    last, two, kept = run(body, x)
    x64 = f64(x)
    rtol = 1e-5
    np.testing.assert_allclose(last, ref(x64, axis=3), rtol=rtol, atol=1e-5)
    np.testing.assert_allclose(two, -ref(x64, axis=(2, 3)), rtol=rtol, atol=1e-5)
    assert kept.shape == (64, 1, 1, 1)
    np.testing.assert_allclose(kept, ref(x64, axis=(1, 2, 3), keepdims=True), rtol=rtol, atol=1e-4)


def test_tensor_reduce_rules_and_bitvec():
    x = np.random.default_rng(63).integers(0, 2**20, size=(32, 16)).astype(np.int32)

    def body(t):
        o, a = sb((32, 1), nl.int32), sb((32, 1), nl.int32)
        nisa.tensor_reduce(dst=o, op=nl.bitwise_or, data=t, axis=1)
        nisa.tensor_reduce(dst=a, op=nl.bitwise_and, data=t, axis=1)
        return o, a

    o, a = run(body, x)
    np.testing.assert_array_equal(o[:, 0], np.bitwise_or.reduce(x, axis=1))
    np.testing.assert_array_equal(a[:, 0], np.bitwise_and.reduce(x, axis=1))
    y = rand((32, 4, 8), seed=64)
    with pytest.raises(nisa.NkiValidationError, match="partition"):
        run(lambda t: nisa.tensor_reduce(dst=sb((1, 32), nl.float32), op=nl.add, data=t, axis=0), y)
    with pytest.raises(nisa.NkiValidationError, match="last contiguous"):
        run(lambda t: nisa.tensor_reduce(dst=sb((32, 8), nl.float32), op=nl.add, data=t, axis=1), y)


@pytest.mark.parametrize(
    "name,op,ref",
    [
        ("add", nl.add, np.sum),
        ("maximum", nl.maximum, np.max),
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_tensor_partition_reduce(name, op, ref, dtype):
    x = rand((96, 40), dtype, -4, 4, seed=65)

    def body(t):
        dst = sb((1, 40), nl.float32)
        nisa.tensor_partition_reduce(dst=dst, op=op, data=t)
        return dst

    np.testing.assert_allclose(run(body, x), ref(f64(x), axis=0, keepdims=True), rtol=1e-6, atol=1e-5)


def test_tensor_partition_reduce_bitwise():
    x = np.random.default_rng(66).integers(0, 2**16, size=(24, 8)).astype(np.int32)

    def body(t):
        o, a = sb((1, 8), nl.int32), sb((1, 8), nl.int32)
        nisa.tensor_partition_reduce(dst=o, op=nl.bitwise_or, data=t)
        nisa.tensor_partition_reduce(dst=a, op=nl.bitwise_and, data=t)
        return o, a

    o, a = run(body, x)
    np.testing.assert_array_equal(o[0], np.bitwise_or.reduce(x, axis=0))
    np.testing.assert_array_equal(a[0], np.bitwise_and.reduce(x, axis=0))


def test_tensor_scalar_reduce_commands_accumulate_across_calls():
    x1, x2, x3 = (rand((64, 32), np.float32, -3, 3, seed=s) for s in (67, 68, 69))
    init = rand((64, 1), np.float32, -10, 10, seed=70)

    def body(a, b, c, i):
        d = sb(a.shape, nl.float32)
        r1, r2, r3 = (sb((64, 1), nl.float32) for _ in range(3))
        nisa.tensor_scalar_reduce(
            dst=d,
            data=a,
            op0=nl.multiply,
            operand0=2.0,
            reduce_op=nl.add,
            reduce_res=r1,
            reduce_cmd=nisa.reduce_cmd.reset_reduce,
        )
        nisa.tensor_scalar_reduce(
            dst=d,
            data=b,
            op0=nl.multiply,
            operand0=2.0,
            reduce_op=nl.add,
            reduce_res=r2,
            reduce_cmd=nisa.reduce_cmd.reduce,
        )
        d3 = sb(a.shape, nl.float32)
        nisa.tensor_scalar_reduce(
            dst=d3,
            data=c,
            op0=nl.add,
            operand0=1.0,
            reduce_op=nl.add,
            reduce_res=r3,
            reduce_cmd=nisa.reduce_cmd.load_reduce,
            reduce_init=i,
        )
        return d3, r1, r2, r3

    d3, r1, r2, r3 = run(body, x1, x2, x3, init)
    np.testing.assert_array_equal(d3, x3 + np.float32(1))
    s1 = (f64(x1) * 2).sum(1, keepdims=True)
    s2 = (f64(x2) * 2).sum(1, keepdims=True)
    np.testing.assert_allclose(r1, s1, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(r2, s1 + s2, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(r3, f64(init) + (f64(x3) + 1).sum(1, keepdims=True), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "name,op,ref",
    [("maximum", nl.maximum, np.max), ("minimum", nl.minimum, np.min), ("multiply", nl.multiply, np.prod)],
)
def test_tensor_scalar_reduce_other_reduce_ops(name, op, ref):
    # All-negative rows: a max reduction must not be clamped by a zero-initialised register.
    x = rand((32, 16), np.float32, -3, -0.9, seed=71) if name != "multiply" else rand((32, 16), np.float32, 0.9, 1.1)
    col = rand((32, 1), np.float32, 0.5, 1.5, seed=72)

    def body(t, v):
        d, r = sb(t.shape, nl.float32), sb((32, 1), nl.float32)
        nisa.tensor_scalar_reduce(dst=d, data=t, op0=nl.multiply, operand0=v, reduce_op=op, reduce_res=r)
        return d, r

    d, r = run(body, x, col)
    np.testing.assert_array_equal(d, x * col)
    np.testing.assert_allclose(r, ref(f64(x * col), axis=1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_tensor_tensor_scan(dtype):
    a = rand((64, 40), dtype, -1, 1, seed=73)
    b = rand((64, 40), dtype, -1, 1, seed=74)
    init = rand((64, 1), np.float32, -1, 1, seed=75)

    def body(x, y, i):
        lin, rev = sb(x.shape, nl.float32), sb(x.shape, nl.float32)
        # r[i] = x[i] * r[i-1] + y[i]
        nisa.tensor_tensor_scan(dst=lin, data0=x, data1=y, initial=i, op0=nl.multiply, op1=nl.add)
        # r[i] = y[i] - (r[i-1] - x[i])
        nisa.tensor_tensor_scan(
            dst=rev, data0=x, data1=y, initial=0.25, op0=nl.subtract, op1=nl.subtract, reverse0=True, reverse1=True
        )
        return lin, rev

    lin, rev = run(body, a, b, init)
    af, bf = f32(a), f32(b)
    exp_lin, exp_rev = np.empty_like(af), np.empty_like(af)
    r1, r2 = init[:, 0].copy(), np.full(64, 0.25, np.float32)
    for i in range(af.shape[1]):
        r1 = af[:, i] * r1 + bf[:, i]
        r2 = bf[:, i] - (r2 - af[:, i])
        exp_lin[:, i], exp_rev[:, i] = r1, r2
    np.testing.assert_array_equal(lin, exp_lin)
    np.testing.assert_array_equal(rev, exp_rev)


def test_tensor_scalar_cumulative():
    x = rand((32, 24), np.float32, -2, 2, seed=76)
    y = rand((32, 24), np.float32, -2, 2, seed=77)
    start = rand((32, 1), np.float32, -5, 5, seed=78)

    def body(t, u, s):
        outs = [sb(t.shape, nl.float32) for _ in range(5)]
        nisa.tensor_scalar_cumulative(dst=outs[0], src=t, op0=nl.multiply, op1=nl.add, imm0=0.5)
        nisa.tensor_scalar_cumulative(
            dst=outs[1], src=u, op0=nl.multiply, op1=nl.add, imm0=0.5, reduce_cmd=nisa.reduce_cmd.reduce
        )  # continues from outs[0][:, -1]
        nisa.tensor_scalar_cumulative(dst=outs[2], src=t, op0=nl.add, op1=nl.maximum, imm0=1.0)
        nisa.tensor_scalar_cumulative(
            dst=outs[3], src=t, op0=nl.add, op1=nl.add, imm0=0.0, imm1=s, reduce_cmd=nisa.reduce_cmd.load_reduce
        )
        nisa.tensor_scalar_cumulative(dst=outs[4], src=t, op0=nl.multiply, op1=nl.subtract, imm0=1.0)
        return tuple(outs)

    o0, o1, o2, o3, o4 = run(body, x, y, start)

    def scan(values, reg, fn):
        out = np.empty_like(values)
        for i in range(values.shape[1]):
            reg = fn(values[:, i], reg)
            out[:, i] = reg
        return out

    zeros = np.zeros(32, np.float32)
    e0 = scan(x * np.float32(0.5), zeros, np.add)
    np.testing.assert_array_equal(o0, e0)
    np.testing.assert_array_equal(o1, scan(y * np.float32(0.5), e0[:, -1], np.add))
    np.testing.assert_array_equal(o2, scan(x + np.float32(1), np.full(32, -np.inf, np.float32), np.maximum))
    np.testing.assert_array_equal(o3, scan(x, start[:, 0], np.add))
    np.testing.assert_array_equal(o4, scan(x, zeros, np.subtract))  # reg = x[i] - reg


# =============================================================================================
# ScalarE: activation, activation_reduce, activate2
# =============================================================================================
def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x):
    return np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0)


def _phi(x):
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


ACT_REF = {
    "copy": lambda x: x,
    "identity": lambda x: x,
    "negative": lambda x: -x,
    "abs": np.abs,
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "reciprocal": lambda x: 1 / x,
    "square": lambda x: x * x,
    "tanh": np.tanh,
    "sigmoid": _sig,
    "relu": lambda x: np.where(x > 0, x, 0.0),
    "gelu": lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
    "gelu_apprx_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    "gelu_apprx_sigmoid": lambda x: x * _sig(1.702 * x),
    "gelu_dx": lambda x: 0.5 * (1 + _erf(x / math.sqrt(2))) + x * _phi(x),
    "gelu_apprx_sigmoid_dx": lambda x: _sig(1.702 * x) * (1 + 1.702 * x * (1 - _sig(1.702 * x))),
    "silu": lambda x: x * _sig(x),
    "silu_dx": lambda x: _sig(x) * (1 + x * (1 - _sig(x))),
    "softplus": _softplus,
    "mish": lambda x: x * np.tanh(_softplus(x)),
    "erf": _erf,
    "erf_dx": lambda x: 2 / math.sqrt(math.pi) * np.exp(-x * x),
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "arctan": np.arctan,
    "ceil": np.ceil,
    "floor": np.floor,
    "trunc": np.trunc,
    "sign": np.sign,
    "softsign": lambda x: x / (1 + np.abs(x)),
}
ACT_DOMAIN = {
    "log": (0.05, 6),
    "sqrt": (0, 9),
    "rsqrt": (0.05, 9),
    "reciprocal": (0.2, 5),
    "tan": (-1.3, 1.3),
    "sin": (-3.1, 3.1),  # ScalarE's valid range (nki.api.shared.rst); beyond it the polynomial extrapolates
}
EXACT_ACT = {"copy", "identity", "negative", "abs", "square", "relu", "ceil", "floor", "trunc", "sign"}


def _act_input(name, dtype=np.float32, shape=(128, 64), seed=80):
    lo, hi = ACT_DOMAIN.get(name, (-4, 4))
    x = rand(shape, dtype, lo, hi, seed=seed)
    if name == "reciprocal":
        x[::2] = -x[::2]
    if name in ("ceil", "floor", "trunc", "sign", "relu", "abs"):
        x[0, :6] = np.array([-2.0, -0.0, 0.0, 1.0, -1.5, 2.5]).astype(dtype)
    return x


@pytest.mark.parametrize("name", sorted(sim_ops.ACTIVATION))
def test_activation_every_function_against_reference(name):
    assert name in ACT_REF, f"no NumPy reference for activation nl.{name}: add one to ACT_REF"
    x = _act_input(name)
    op = getattr(nl, name)

    def body(t):
        dst = sb(t.shape, nl.float32)
        nisa.activation(dst=dst, op=op, data=t)
        return dst

    out = run(body, x)
    with np.errstate(all="ignore"):
        expected = ACT_REF[name](f64(x))
    if name in EXACT_ACT:
        np.testing.assert_array_equal(out, expected.astype(np.float32))
    else:
        np.testing.assert_allclose(out, expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("name", ["exp", "tanh", "silu", "gelu", "rsqrt", "square", "copy"])
@pytest.mark.parametrize("dtype", [BF16, np.float16])
def test_activation_low_precision_io(name, dtype):
    x = _act_input(name, dtype, seed=81)

    def body(t):
        dst = sb(t.shape, t.dtype)
        nisa.activation(dst=dst, op=getattr(nl, name), data=t)
        return dst

    assert_close_in(dtype, run(body, x), ACT_REF[name](f64(x)))


def test_activation_scale_and_bias_scalars_and_vectors():
    x = rand((128, 64), np.float32, -3, 3, seed=82)
    scale_col = rand((128, 1), np.float32, -2, 2, seed=83)
    bias_col = rand((128, 1), BF16, -1, 1, seed=84)  # bias may be any dtype but tfloat32

    def body(t, s, b):
        outs = [sb(t.shape, nl.float32) for _ in range(4)]
        nisa.activation(dst=outs[0], op=nl.copy, data=t, scale=0.75)
        nisa.activation(dst=outs[1], op=nl.copy, data=t, scale=s, bias=b)
        nisa.activation(dst=outs[2], op=nl.exp, data=t, scale=s, bias=-0.5)
        nisa.activation(dst=outs[3], op=nl.relu, data=t, scale=-1.0, bias=b)
        return tuple(outs)

    o0, o1, o2, o3 = run(body, x, scale_col, bias_col)
    bf = f32(bias_col)
    np.testing.assert_array_equal(o0, x * np.float32(0.75))
    np.testing.assert_array_equal(o1, x * scale_col + bf)  # multiply, then add, each rounded to fp32
    np.testing.assert_allclose(o2, np.exp(f64(x * scale_col + np.float32(-0.5))), rtol=2e-6)
    np.testing.assert_array_equal(o3, np.maximum(-x + bf, 0))


def test_activation_bias_scalar_needs_neuroncore_v3():
    x = rand((8, 8), seed=85)
    with pytest.raises(nisa.NkiValidationError, match="bias"):
        run(lambda t: nisa.activation(dst=sb(t.shape, nl.float32), op=nl.copy, data=t, bias=1.0), x, target="trn1")


def test_activation_reduce_registers_across_calls():
    x1, x2 = rand((64, 48), seed=86), rand((64, 48), seed=87)

    def body(a, b):
        d1, d2 = sb(a.shape, nl.float32), sb(a.shape, nl.float32)
        r1, r2, r_idle, r_reset = (sb((64, 1), nl.float32) for _ in range(4))
        nisa.activation(
            dst=d1, op=nl.exp, data=a, reduce_op=nl.add, reduce_res=r1, reduce_cmd=nisa.reduce_cmd.reset_reduce
        )
        nisa.activation(
            dst=d2, op=nl.square, data=b, reduce_op=nl.add, reduce_res=r2, reduce_cmd=nisa.reduce_cmd.reduce
        )
        # idle leaves the registers alone; reading them out again gives the same sum
        nisa.activation(dst=d2, op=nl.square, data=b, reduce_res=r_idle)
        nisa.activation(dst=d1, op=nl.exp, data=a, reduce_cmd=nisa.reduce_cmd.reset, reduce_res=r_reset)
        return d1, r1, r2, r_idle, r_reset

    d1, r1, r2, r_idle, r_reset = run(body, x1, x2)
    e1 = np.exp(f64(x1)).sum(1, keepdims=True)
    e2 = (f64(x2) ** 2).sum(1, keepdims=True)
    np.testing.assert_allclose(d1, np.exp(f64(x1)), rtol=2e-6)
    np.testing.assert_allclose(r1, e1, rtol=1e-5)
    np.testing.assert_allclose(r2, e1 + e2, rtol=1e-5)
    np.testing.assert_array_equal(r_idle, r2)
    np.testing.assert_array_equal(r_reset, 0.0)


def test_activation_reduce_only_adds():
    x = rand((8, 8), seed=88)
    with pytest.raises(nisa.NkiValidationError, match="nl.add"):
        run(
            lambda t: nisa.activation(
                dst=sb(t.shape, nl.float32),
                op=nl.exp,
                data=t,
                reduce_op=nl.maximum,
                reduce_cmd=nisa.reduce_cmd.reset_reduce,
            ),
            x,
        )


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_activation_reduce(dtype):
    x = rand((128, 3, 16), dtype, -2, 2, seed=89)
    bias = rand((128, 1), np.float32, -1, 1, seed=90)

    def body(t, b):
        d, r = sb(t.shape, nl.float32), sb((128, 1), nl.float32)
        nisa.activation_reduce(dst=d, op=nl.exp, data=t, reduce_op=nl.add, reduce_res=r, bias=b, scale=0.5)
        return d, r

    d, r = run(body, x, bias)
    pre = f32(x) * np.float32(0.5) + bias[:, :, None]
    np.testing.assert_allclose(d, np.exp(f64(pre)), rtol=2e-6)
    np.testing.assert_allclose(r[:, 0], np.exp(f64(pre)).sum(axis=(1, 2)), rtol=1e-5)


def test_activate2_trn3_pipeline_and_target_check():
    x = rand((64, 32), np.float32, -2, 2, seed=91)
    col = rand((64, 1), np.float32, 0.5, 1.5, seed=92)

    def body(t, v):
        a, b, r = sb(t.shape, nl.float32), sb(t.shape, nl.float32), sb((64, 1), nl.float32)
        nisa.activate2(
            dst=a,
            op=nl.gelu,
            data=t,
            imm0=2.0,
            imm1=v,
            op0=nl.multiply,
            op1=nl.add,
            reduce_op=nl.maximum,
            reduce_res=r,
            reduce_cmd=nisa.reduce_cmd.reset_reduce,
        )
        nisa.activate2(dst=b, op=nl.copy, data=t, imm0=1.0, imm1=0.0, op0=nl.subtract, op1=nl.bypass, reverse0=True)
        return a, b, r

    a, b, r = run(body, x, col, target="trn3")
    pre = f64(x * np.float32(2.0) + col)
    gelu = ACT_REF["gelu"](pre)
    np.testing.assert_allclose(a, gelu, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(r, gelu.max(1, keepdims=True), rtol=2e-6)
    np.testing.assert_array_equal(b, np.float32(1.0) - x)
    with pytest.raises(nisa.NkiValidationError, match="trn3|NeuronCore-v4"):
        run(body, x, col, target="trn2")


# =============================================================================================
# GpSimd: iota, affine_select
# =============================================================================================
@pytest.mark.parametrize("dtype", [np.int32, np.float32, BF16])
def test_iota_pattern_channel_multiplier_offset(dtype):
    def body():
        flat, nested = sb((64, 48), dtype), sb((64, 4, 12), dtype)
        nisa.iota(dst=flat, pattern=[[1, 48]], offset=3, channel_multiplier=48)
        nisa.iota(dst=nested, pattern=[[-100, 4], [2, 12]], offset=-7, channel_multiplier=-3)
        return flat, nested

    flat, nested = run(body)
    p = np.arange(64)[:, None]
    np.testing.assert_array_equal(f32(flat), (3 + 48 * p + np.arange(48)).astype(dtype).astype(np.float32))
    w, x = np.meshgrid(np.arange(4), np.arange(12), indexing="ij")
    expected = -7 - 3 * p[:, :, None] + (-100 * w + 2 * x)[None]
    np.testing.assert_array_equal(f32(nested), expected.astype(dtype).astype(np.float32))


def test_iota_pattern_must_cover_the_tile():
    with pytest.raises(nisa.NkiValidationError, match="element count"):
        run(lambda: nisa.iota(dst=sb((8, 10), nl.int32), pattern=[[1, 12]]))


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_affine_select_causal_mask(dtype):
    x = rand((128, 128), dtype, -3, 3, seed=93)

    def body(t):
        dst = sb(t.shape, t.dtype)
        # keep where (p - j) >= 0: the lower triangle, like np.tril
        nisa.affine_select(
            dst=dst,
            pattern=[[-1, 128]],
            channel_multiplier=1,
            on_true_tile=t,
            on_false_value=-9984.0,
            cmp_op=nl.greater_equal,
        )
        shifted = sb(t.shape, nl.float32)
        # offset 16: keep where p + 16 - j > 0
        nisa.affine_select(
            dst=shifted,
            pattern=[[-1, 128]],
            channel_multiplier=1,
            on_true_tile=t,
            on_false_value=FP32_MIN,
            cmp_op=nl.greater,
            offset=16,
        )
        return dst, shifted

    dst, shifted = run(body, x)
    keep = np.tril(np.ones((128, 128), bool))
    assert_bits_equal(dst, np.where(keep, x, np.asarray(-9984.0, dtype)).astype(dtype))
    keep16 = np.tril(np.ones((128, 128), bool), k=15)
    np.testing.assert_array_equal(shifted, np.where(keep16, f32(x), np.float32(FP32_MIN)))


def test_affine_select_default_compare_is_equal():
    x = rand((32, 32), seed=94)

    def body(t):
        dst = sb(t.shape, nl.float32)
        nisa.affine_select(dst=dst, pattern=[[-1, 32]], channel_multiplier=1, on_true_tile=t, on_false_value=0.0)
        return dst

    np.testing.assert_array_equal(run(body, x), np.diag(np.diag(x)))


# =============================================================================================
# selection: range_select, select_reduce, max8, nc_find_index8, nc_match_replace8, nc_n_gather
# =============================================================================================
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_range_select_bounds_and_max_reduce(dtype):
    x = rand((64, 40), dtype, -5, 5, seed=95)
    rng = np.random.default_rng(96)
    lo = rng.integers(0, 30, size=(64, 1)).astype(np.float32) + 5
    hi = lo + rng.integers(1, 12, size=(64, 1)).astype(np.float32)

    def body(t, b0, b1):
        dst, red = sb(t.shape, t.dtype), sb((64, 1), nl.float32)
        nisa.range_select(
            dst=dst,
            on_true_tile=t,
            comp_op0=nl.greater_equal,
            comp_op1=nl.less,
            bound0=b0,
            bound1=b1,
            reduce_op=nl.maximum,
            reduce_res=red,
            range_start=5,
        )
        return dst, red

    dst, red = run(body, x, lo, hi)
    index = 5 + np.arange(40, dtype=np.float32)[None, :]
    mask = (index >= lo) & (index < hi)
    expected = np.where(mask, f32(x), np.float32(FP32_MIN))
    assert_bits_equal(dst, expected.astype(dtype))  # FP32_MIN becomes -inf in bf16
    np.testing.assert_array_equal(red, expected.max(1, keepdims=True))


def test_range_select_takes_fp32_min_spelled_as_a_decimal_literal():
    """nki-library passes ``-3.4028235e38``: not float32's minimum as a double, but that value once
    rounded to the fp32 immediate the instruction takes."""
    x = rand((8, 4), np.float32, -1, 1, seed=99)

    def body(t, b0, b1):
        dst = sb(t.shape, t.dtype)
        nisa.range_select(
            dst=dst,
            on_true_tile=t,
            on_false_value=-3.4028235e38,
            comp_op0=nl.greater_equal,
            comp_op1=nl.less,
            bound0=b0,
            bound1=b1,
        )
        return dst

    bound = np.full((8, 1), 2, np.float32)
    dst = run(body, x, bound * 0, bound)
    np.testing.assert_array_equal(dst, np.where(np.arange(4) < 2, x, np.float32(FP32_MIN)))


def test_select_reduce():
    x = rand((64, 32), np.float32, -4, 4, seed=97)
    pred = np.random.default_rng(98).integers(0, 2, size=x.shape).astype(np.uint8)
    pred[0] = 0
    fallback = rand((64, 1), np.float32, -9, -8, seed=99)

    def body(t, p, f):
        a, b = sb(t.shape, nl.float32), sb(t.shape, nl.float32)
        ra, rb = sb((64, 1), nl.float32), sb((64, 1), nl.float32)
        nisa.select_reduce(
            dst=a,
            predicate=p,
            on_true=t,
            on_false=-100.0,
            reduce_res=ra,
            reduce_cmd=nisa.reduce_cmd.reset_reduce,
            reduce_op=nl.maximum,
        )
        nisa.select_reduce(
            dst=b,
            predicate=p,
            on_true=t,
            on_false=f,
            reduce_res=rb,
            reduce_cmd=nisa.reduce_cmd.reset_reduce,
            reverse_pred=True,
        )
        return a, b, ra, rb

    a, b, ra, rb = run(body, x, pred, fallback)
    ea = np.where(pred != 0, x, np.float32(-100))
    eb = np.where(pred == 0, x, fallback)
    np.testing.assert_array_equal(a, ea)
    np.testing.assert_array_equal(b, eb)
    np.testing.assert_array_equal(ra, ea.max(1, keepdims=True))
    np.testing.assert_array_equal(rb, eb.max(1, keepdims=True))


@pytest.mark.parametrize("shape", [(64, 100), (32, 4, 25), (16, 8)])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_max8(shape, dtype):
    x = rand(shape, dtype, -100, 100, seed=100)

    def body(t):
        dst = sb((shape[0], 8), t.dtype)
        nisa.max8(dst=dst, src=t)
        return dst

    expected = -np.sort(-f32(x).reshape(shape[0], -1), axis=1)[:, :8]
    assert_bits_equal(run(body, x), expected.astype(dtype))


def _nth_occurrence(row, vals, j):
    return np.flatnonzero(row == vals[j])[list(vals[:j]).count(vals[j])]


def test_nc_find_index8_first_occurrence():
    rng = np.random.default_rng(101)
    x = rng.integers(-20, 20, size=(32, 64)).astype(np.float32)  # many repeated values
    picks = np.stack([rng.choice(64, size=8, replace=False) for _ in range(32)])
    vals = np.take_along_axis(x, picks, axis=1)

    def body(t, v):
        d32, d16 = sb((32, 8), nl.uint32), sb((32, 8), nl.uint16)
        nisa.nc_find_index8(dst=d32, data=t, vals=v)
        nisa.nc_find_index8(dst=d16, data=t, vals=v)
        return d32, d16

    d32, d16 = run(body, x, vals)
    # A value repeated in vals takes its next occurrence each time (the docstring of
    # nc_match_replace8 contrasts its own descending pairing with find_index8's ascending one).
    expected = np.array([[_nth_occurrence(x[p], vals[p], j) for j in range(8)] for p in range(32)])
    np.testing.assert_array_equal(d32, expected)
    np.testing.assert_array_equal(d16, expected)


def _match_replace_ref(data, vals, imm):
    out = data.copy()
    idx = np.zeros(vals.shape, np.int64)
    for p in range(out.shape[0]):
        for j in reversed(range(vals.shape[1])):  # vals are processed last to first (the docstring)
            v = vals[p, j]
            hits = np.flatnonzero(out[p] == v)  # search the partially replaced row
            if hits.size:
                idx[p, j] = hits[0]
                out[p, hits[0]] = imm
    return out, idx


def test_nc_match_replace8_replaces_first_occurrences():
    x = rand((32, 64), np.float32, -10, 10, seed=102)

    def body(t):
        top = sb((32, 8), nl.float32)
        nisa.max8(dst=top, src=t)
        dst, idx = sb(t.shape, nl.float32), sb((32, 8), nl.uint32)
        nisa.nc_match_replace8(dst=dst, data=t, vals=top, imm=-1e9, dst_idx=idx)
        return dst, idx

    dst, idx = run(body, x)
    vals = -np.sort(-x, axis=1)[:, :8]
    exp_dst, exp_idx = _match_replace_ref(x, vals, np.float32(-1e9))
    np.testing.assert_array_equal(dst, exp_dst)
    np.testing.assert_array_equal(idx, exp_idx)


def test_nc_match_replace8_duplicate_values_consume_distinct_occurrences():
    # Top-k by repeated max8 + match_replace8 must remove each copy of a repeated maximum.
    x = np.tile(np.array([3, 9, 1, 9, 9, 2, 8, 9, 9, 0, 9, 9, 5, 9, 4, 9], np.float32), (16, 1))
    vals = np.tile(np.array([9, 9, 9, 9, 9, 9, 9, 9], np.float32), (16, 1))

    def body(t, v):
        dst, idx = sb(t.shape, nl.float32), sb((16, 8), nl.uint32)
        nisa.nc_match_replace8(dst=dst, data=t, vals=v, imm=-1.0, dst_idx=idx)
        return dst, idx

    dst, idx = run(body, x, vals)
    exp_dst, exp_idx = _match_replace_ref(x, vals, np.float32(-1.0))
    np.testing.assert_array_equal(dst, exp_dst)
    np.testing.assert_array_equal(idx, exp_idx)
    assert (dst == 9).sum(axis=1).tolist() == [1] * 16  # nine 9s, eight replaced


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int32])
def test_nc_n_gather(dtype):
    rng = np.random.default_rng(103)
    data = (rng.standard_normal((64, 4, 16)) * 100).astype(dtype)
    idx = rng.integers(0, 64, size=(64, 20)).astype(np.uint32)

    def body(d, i):
        dst = sb((64, 20), d.dtype)
        nisa.nc_n_gather(dst=dst, data=d, indices=i)
        return dst

    expected = np.take_along_axis(data.reshape(64, -1), idx.astype(np.int64), axis=1)
    assert_bits_equal(run(body, data, idx), expected)
    bad = idx.copy()
    bad[5, 3] = 64
    with pytest.raises(nisa.NkiValidationError, match="out of range"):
        run(body, data, bad)


# =============================================================================================
# statistics: bn_stats / bn_aggr
# =============================================================================================
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_bn_stats_fields_even_and_odd(dtype):
    x = rand((32, 7), dtype, -3, 3, seed=104)

    def body(t):
        dst = sb((32, 6), nl.float32)
        nisa.bn_stats(dst=dst, data=t)
        return dst

    out = run(body, x).astype(np.float64)
    xv = f64(x)
    even, odd = xv[:, 0::2], xv[:, 1::2]
    np.testing.assert_array_equal(out[:, 0], 4)
    np.testing.assert_array_equal(out[:, 3], 3)
    np.testing.assert_allclose(out[:, 1], even.mean(1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out[:, 4], odd.mean(1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out[:, 2], even.var(1) * 4, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[:, 5], odd.var(1) * 3, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("width", [512, 1024, 700])
def test_bn_stats_then_bn_aggr_mean_and_variance(dtype, width):
    x = rand((128, width), dtype, -2, 5, seed=105)
    chunks = [(s, min(512, width - s)) for s in range(0, width, 512)]

    def body(t):
        stats = sb((128, 6 * len(chunks)), nl.float32)
        for i, (start, size) in enumerate(chunks):
            nisa.bn_stats(dst=stats[:, 6 * i : 6 * i + 6], data=t[:, start : start + size])
        mv = sb((128, 2), nl.float32)
        nisa.bn_aggr(dst=mv, data=stats)
        return mv

    mv = run(body, x)
    np.testing.assert_allclose(mv[:, 0], f64(x).mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mv[:, 1], f64(x).var(1), rtol=1e-5, atol=1e-6)


def test_bn_stats_free_size_limit():
    with pytest.raises(nisa.NkiValidationError, match="bn_stats_fmax"):
        run(lambda t: nisa.bn_stats(dst=sb((8, 6), nl.float32), data=t), rand((8, 513)))


# =============================================================================================
# Trn3 VectorE exponential, random numbers, dropout
# =============================================================================================
def test_exponential_with_running_sum_on_trn3():
    x1, x2 = rand((64, 32), seed=106), rand((64, 32), seed=107)
    m = rand((64, 1), np.float32, 0, 1, seed=108)
    init = rand((64, 1), np.float32, 0, 3, seed=109)

    def body(a, b, mx, i):
        d1, d2, d3 = (sb(a.shape, nl.float32) for _ in range(3))
        r1, r2, r3 = (sb((64, 1), nl.float32) for _ in range(3))
        nisa.exponential(dst=d1, src=a, max_value=mx, reduce_res=r1, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.exponential(dst=d2, src=b, max_value=0.5, reduce_res=r2, reduce_cmd=nisa.reduce_cmd.reduce)
        nisa.exponential(dst=d3, src=b, reduce_res=r3, reduce_cmd=nisa.reduce_cmd.load_reduce, reduce_init=i)
        return d1, d2, r1, r2, r3

    d1, d2, r1, r2, r3 = run(body, x1, x2, m, init, target="trn3")
    e1, e2 = np.exp(f64(x1 - m)), np.exp(f64(x2 - np.float32(0.5)))
    np.testing.assert_allclose(d1, e1, rtol=2e-6)
    np.testing.assert_allclose(d2, e2, rtol=2e-6)
    np.testing.assert_allclose(r1, e1.sum(1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(r2, (e1 + e2).sum(1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(r3, f64(init) + np.exp(f64(x2)).sum(1, keepdims=True), rtol=1e-5)
    with pytest.raises(nisa.NkiValidationError, match="trn3|NeuronCore-v4"):
        run(body, x1, x2, m, init, target="trn2")


def _rng_kernel(dtype=nl.uint32, shape=(64, 32)):
    @nki.jit
    def kernel(seed):
        s = to_sbuf(seed)
        nisa.set_rng_seed(src_seeds=s)
        first = sb(shape, dtype)
        nisa.rng(dst=first)
        nisa.set_rng_seed(src_seeds=s)  # reseeding restarts the same sequence
        again = sb(shape, nl.uint32)
        nisa.rng(dst=again)
        low = sb(shape, nl.uint8)
        nisa.set_rng_seed(src_seeds=s)
        nisa.rng(dst=low)
        return to_hbm(first), to_hbm(again), to_hbm(low)

    return kernel


def test_rng_set_seed_is_deterministic_and_truncates_to_low_bits():
    seed7, seed8 = np.array([[7]], np.uint32), np.array([[8]], np.uint32)
    a1, again1, low1 = _rng_kernel()(seed7)
    a2, _, _ = _rng_kernel()(seed7)
    b, _, _ = _rng_kernel()(seed8)
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_array_equal(a1, again1)
    assert (a1 != b).mean() > 0.99
    np.testing.assert_array_equal(low1, (a1 & 0xFF).astype(np.uint8))  # least-significant bits kept
    assert a1.max() > 2**31  # full 32-bit range is used
    assert len(np.unique(a1)) > 0.99 * a1.size
    with pytest.raises(nisa.NkiValidationError, match="integer"):
        _rng_kernel(dtype=nl.float32)(seed7)


def test_rand2_uniform_in_range_on_trn3_only():
    lo = np.linspace(-3, 0, 64, dtype=np.float32).reshape(64, 1)

    def body(mn):
        dst = sb((64, 256), nl.float32)
        nisa.rand2(dst=dst, min=mn, max=2.0)
        return dst

    out = run(body, lo, target="trn3", seed=3)
    again = run(body, lo, target="trn3", seed=3)
    assert np.all(out >= lo) and np.all(out <= 2.0)
    np.testing.assert_array_equal(out, again)
    # roughly uniform: the mean of each row is near the middle of its range
    np.testing.assert_allclose(out.mean(1), (lo[:, 0] + 2.0) / 2, atol=0.35)
    with pytest.raises(nisa.NkiValidationError, match="trn3|NeuronCore-v4"):
        run(body, lo, target="trn2")


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int32])
def test_dropout_probabilities(dtype):
    x = (rand((128, 64), np.float32, 1, 5, seed=110) * (10 if dtype == np.int32 else 1)).astype(dtype)
    prob_col = np.where(np.arange(128) % 2 == 0, 0.0, 1.0).astype(np.float32).reshape(128, 1)

    def body(t, pc):
        keep, drop, half, per_row = (sb(t.shape, t.dtype) for _ in range(4))
        nisa.dropout(dst=keep, data=t, prob=0.0)
        nisa.dropout(dst=drop, data=t, prob=1.0)
        nisa.dropout(dst=half, data=t, prob=0.5)
        nisa.dropout(dst=per_row, data=t, prob=pc)
        return keep, drop, half, per_row

    keep, drop, half, per_row = run(body, x, prob_col)
    assert_bits_equal(keep, x)
    np.testing.assert_array_equal(f32(drop), 0)
    kept = f32(half) != 0
    assert 0.45 < kept.mean() < 0.55
    assert_bits_equal(half[kept], x[kept])  # survivors are not rescaled
    assert_bits_equal(per_row[0::2], x[0::2])
    np.testing.assert_array_equal(f32(per_row[1::2]), 0)


# =============================================================================================
# bf16 rounding on write and fp32 PSUM accumulation
# =============================================================================================
def test_bf16_destination_rounds_fp32_result_exactly():
    a = rand((128, 64), np.float32, -10, 10, seed=111)
    b = rand((128, 64), np.float32, -10, 10, seed=112)
    col = rand((128, 1), np.float32, 0.1, 3, seed=113)

    def body(x, y, v):
        outs = [sb(x.shape, nl.bfloat16) for _ in range(5)]
        nisa.tensor_tensor(dst=outs[0], data1=x, data2=y, op=nl.multiply)
        nisa.tensor_scalar(dst=outs[1], data=x, op0=nl.divide, operand0=v, op1=nl.add, operand1=0.1)
        nisa.activation(dst=outs[2], op=nl.copy, data=x, scale=v, bias=v)
        nisa.scalar_tensor_tensor(dst=outs[3], data=x, op0=nl.multiply, operand0=v, op1=nl.subtract, operand1=y)
        nisa.reciprocal(dst=outs[4], data=y)
        return tuple(outs)

    outs = run(body, a, b, col)
    expected = [
        a * b,
        (a / col) + np.float32(0.1),
        a * col + col,
        (a * col) - b,
        np.float32(1) / b,
    ]
    for got, want in zip(outs, expected):
        assert_bits_equal(got, want.astype(np.float32).astype(BF16))


def test_bf16_matmul_accumulates_in_fp32_psum():
    # 8 accumulation steps of K=128: the sum of 1024 bf16 products kept in fp32, not bf16.
    rng = np.random.default_rng(114)
    a = rng.uniform(0.5, 1.5, size=(1024, 16)).astype(np.float32).astype(BF16)
    b = rng.uniform(0.5, 1.5, size=(1024, 32)).astype(np.float32).astype(BF16)

    @nki.jit
    def kernel(sta, mov):
        acc = ps((16, 32))
        for i in range(8):
            s, m = sb((128, 16), nl.bfloat16), sb((128, 32), nl.bfloat16)
            nisa.dma_copy(dst=s, src=sta[i * 128 : (i + 1) * 128, :])
            nisa.dma_copy(dst=m, src=mov[i * 128 : (i + 1) * 128, :])
            nisa.nc_matmul(dst=acc, stationary=s, moving=m)
        return to_hbm(acc)

    out = kernel(a, b)
    exact = f64(a).T @ f64(b)
    np.testing.assert_allclose(out, exact, rtol=5e-6)
    # A bf16 accumulator would be off by far more: make sure the test can tell them apart.
    bf16_acc = np.zeros((16, 32), np.float32)
    for k in range(1024):
        bf16_acc = (bf16_acc + np.outer(f32(a[k]), f32(b[k]))).astype(BF16).astype(np.float32)
    assert np.max(np.abs(bf16_acc - exact) / exact) > 1e-3


def test_torch_bf16_io_matches_torch_rounding():
    import torch

    gen = torch.Generator().manual_seed(115)
    a = (torch.rand((64, 48), generator=gen) * 8 - 4).to(torch.bfloat16)
    b = (torch.rand((64, 48), generator=gen) * 8 - 4).to(torch.bfloat16)

    @nki.jit
    def kernel(x, y):
        tx, ty = to_sbuf(x), to_sbuf(y)
        s, p = sb(x.shape, nl.bfloat16), sb(x.shape, nl.bfloat16)
        nisa.tensor_tensor(dst=s, data1=tx, data2=ty, op=nl.add)
        nisa.tensor_tensor(dst=p, data1=tx, data2=ty, op=nl.multiply)
        return to_hbm(s), to_hbm(p)

    s, p = kernel(a, b)
    assert s.dtype == torch.bfloat16 and p.dtype == torch.bfloat16
    assert torch.equal(s.view(torch.int16), (a + b).view(torch.int16))
    assert torch.equal(p.view(torch.int16), (a * b).view(torch.int16))


# =============================================================================================
# remaining ALU operators, stream shuffle, DMA compute, registers, target queries
# =============================================================================================
@pytest.mark.parametrize(
    "name,ref",
    [
        ("abs_min", lambda a, b: np.where(np.abs(a) < np.abs(b), a, b)),  # smaller magnitude; ties -> b
        ("fmod", np.fmod),
        ("mod", np.mod),
    ],
)
def test_tensor_tensor_more_arithmetic_ops(name, ref):
    a = rand((64, 32), np.float32, 0.5, 20, seed=120)
    b = rand((64, 32), np.float32, 0.5, 4, seed=121)
    if name == "abs_min":
        a[::2] = -a[::2]
        b[0, :8] = -a[0, :8]

    def body(x, y):
        dst = sb(x.shape, nl.float32)
        nisa.tensor_tensor(dst=dst, data1=x, data2=y, op=getattr(nl, name))
        return dst

    target = "trn3" if name == "abs_min" else "trn2"  # nl.abs_min is NeuronCore-v4 only
    np.testing.assert_array_equal(run(body, a, b, target=target), ref(a, b).astype(np.float32))


@pytest.mark.parametrize(
    "name,ref", [("logical_and", np.logical_and), ("logical_or", np.logical_or), ("logical_xor", np.logical_xor)]
)
def test_tensor_tensor_logical_ops(name, ref):
    rng = np.random.default_rng(122)
    a = (rng.integers(0, 2, size=(32, 16)) * rng.uniform(0.5, 3, size=(32, 16))).astype(np.float32)
    b = (rng.integers(0, 2, size=(32, 16)) * -2.5).astype(np.float32)

    def body(x, y):
        dst = sb(x.shape, nl.float32)
        nisa.tensor_tensor(dst=dst, data1=x, data2=y, op=getattr(nl, name))
        return dst

    np.testing.assert_array_equal(run(body, a, b), ref(a != 0, b != 0).astype(np.float32))


def test_nc_stream_shuffle_within_quadrants():
    x = rand((64, 16), seed=123)
    mask = [(i * 7 + 3) % 32 for i in range(32)]
    mask[5] = 255  # 255 leaves that destination partition untouched

    def body(t):
        dst = sb(t.shape, nl.float32)
        nisa.memset(dst=dst, value=42.0)
        nisa.nc_stream_shuffle(dst=dst, src=t, shuffle_mask=mask)
        inplace = sb(t.shape, nl.float32)
        nisa.tensor_copy(dst=inplace, src=t)
        nisa.nc_stream_shuffle(dst=inplace, src=inplace, shuffle_mask=[31 - i for i in range(32)])
        return dst, inplace

    dst, inplace = run(body, x)
    expected = np.full_like(x, 42.0)
    for p in range(64):
        quadrant, lane = divmod(p, 32)
        if mask[lane] != 255:
            expected[p] = x[quadrant * 32 + mask[lane]]
    np.testing.assert_array_equal(dst, expected)
    np.testing.assert_array_equal(inplace, np.concatenate([x[31::-1], x[63:31:-1]]))


@pytest.mark.parametrize("dst_dtype", [np.float32, BF16])
def test_dma_compute_sums_sources_in_fp32(dst_dtype):
    a = rand((32, 24), np.float32, -5, 5, seed=124)
    b = rand((32, 24), BF16, -5, 5, seed=125)
    c = rand((32, 24), np.float32, -5, 5, seed=126)

    @nki.jit
    def kernel(x, y, z):
        ty = to_sbuf(y)  # one source in SBUF, two in HBM
        dst = sb(x.shape, dst_dtype)
        nisa.dma_compute(dst=dst, srcs=[x, ty, z], reduce_op=nl.add)
        return to_hbm(dst)

    expected = ((a + f32(b)) + c).astype(dst_dtype)
    assert_bits_equal(kernel(a, b, c), expected)
    with pytest.raises(nisa.NkiValidationError, match="nl.add"):
        run(lambda t: nisa.dma_compute(dst=sb(t.shape, nl.float32), srcs=[t, t], reduce_op=nl.maximum), a)


def test_registers_load_move_store():
    x = np.array([[41]], np.int32)

    def body(t):
        reg = nisa.register_alloc()
        nisa.register_load(reg, t)
        other = nisa.register_alloc(0)
        nisa.register_move(other, reg)
        assert int(other) == 41
        out = sb((1, 1), nl.int32)
        nisa.register_store(out, other)
        count = nisa.register_alloc(3)
        total = sb((1, 1), nl.float32)
        nisa.memset(dst=total, value=0.0)
        for _ in nl.dynamic_range(count):
            nisa.tensor_scalar(dst=total, data=total, op0=nl.add, operand0=2.5)
        return out, total

    out, total = run(body, x)
    assert out[0, 0] == 41
    assert total[0, 0] == 7.5


def test_get_nc_version_follows_the_target():
    seen = {}

    @nki.jit
    def kernel(x):
        seen[x.shape[0]] = nisa.get_nc_version()
        return to_hbm(to_sbuf(x))

    sim.run(kernel, np.zeros((2, 2), np.float32), target="trn2")
    sim.run(kernel, np.zeros((3, 2), np.float32), target="trn3")
    sim.run(kernel, np.zeros((4, 2), np.float32), target="trn1")
    assert seen == {2: nisa.nc_version.gen3, 3: nisa.nc_version.gen4, 4: nisa.nc_version.gen2}


def test_activate2_prelu_uses_relu_param():
    x = rand((32, 16), np.float32, -3, 3, seed=127)
    slope = rand((32, 1), np.float32, 0.01, 0.3, seed=128)

    def body(t, s):
        a, b = sb(t.shape, nl.float32), sb(t.shape, nl.float32)
        nisa.activate2(dst=a, op=nl.prelu, data=t, imm0=1.0, imm1=0.0, op0=nl.bypass, op1=nl.bypass, relu_param=0.1)
        nisa.activate2(dst=b, op=nl.prelu, data=t, imm0=2.0, imm1=0.0, op0=nl.multiply, op1=nl.bypass, relu_param=s)
        return a, b

    a, b = run(body, x, slope, target="trn3")
    np.testing.assert_array_equal(a, np.where(x >= 0, x, x * np.float32(0.1)))
    x2 = x * np.float32(2)
    np.testing.assert_array_equal(b, np.where(x2 >= 0, x2, x2 * slope))


def _gather_transpose_kernel(oob=nisa.oob_mode.error):
    @nki.jit
    def kernel(src_hbm, idx_hbm):
        rows_per_col = idx_hbm.shape[0]
        P, F = src_hbm.shape[1], rows_per_col * idx_hbm.shape[1]
        idx = to_sbuf(idx_hbm)
        dst = sb((P, F), src_hbm.dtype)
        nisa.memset(dst=dst, value=0.0)
        view = src_hbm.ap(pattern=[[P, F], [1, P]], vector_offset=idx, indirect_dim=0)
        nisa.dma_transpose(dst=dst, src=view, axes=(1, 0), oob_mode=oob)
        return to_hbm(dst)

    return kernel


@pytest.mark.parametrize("cols", [1, 2])
def test_dma_transpose_indirect_gather(cols):
    # dst = src[indices.T.flatten()].T : an [P, N] index tile is consumed column by column
    src = rand((300, 64), BF16, seed=130)
    idx = np.random.default_rng(130).integers(0, 300, size=(128, cols)).astype(np.uint32)
    out = _gather_transpose_kernel()(src, idx)
    assert_bits_equal(out, np.ascontiguousarray(src[idx.T.reshape(-1)].T))


def test_dma_transpose_indirect_gather_oob_skip_keeps_dst():
    src = rand((100, 32), BF16, seed=131)
    idx = np.random.default_rng(131).integers(0, 100, size=(64, 1)).astype(np.uint32)
    idx[[2, 40], 0] = [100, 5000]
    with pytest.raises(nisa.NkiValidationError, match="out of bounds"):
        _gather_transpose_kernel()(src, idx)
    out = _gather_transpose_kernel(nisa.oob_mode.skip)(src, idx)
    valid = idx[:, 0] < 100
    np.testing.assert_array_equal(f32(out[:, valid]), f32(src[idx[valid, 0]].T))
    np.testing.assert_array_equal(f32(out[:, ~valid]), 0.0)


def test_dma_transpose_hwdge_shape_rules():
    ok = rand((16, 128), BF16, seed=132)
    out = run(lambda t: _dma_t_hw(t, (128, 16)), ok)
    assert_bits_equal(out, np.ascontiguousarray(ok.T))
    with pytest.raises(nisa.NkiValidationError, match="16"):
        run(lambda t: _dma_t_hw(t, (128, 32)), rand((32, 128), BF16))
    # The docstring's column limit is src.shape[-1] <= 128 (not a multiple of 128): 64 are fine.
    narrow = rand((16, 64), BF16, seed=133)
    assert_bits_equal(run(lambda t: _dma_t_hw(t, (64, 16)), narrow), np.ascontiguousarray(narrow.T))


def _dma_t_hw(t, shape):
    dst = sb(shape, t.dtype)
    nisa.dma_transpose(dst=dst, src=t, dge_mode=nisa.dge_mode.hwdge)
    return dst


@pytest.mark.parametrize("op", [nl.sum, nl.max, nl.min], ids=["sum", "max", "min"])
def test_tensor_reduce_accepts_nl_reduction_functions_as_op(op):
    x = rand((16, 24), seed=133)
    ref = {"sum": np.sum, "max": np.max, "min": np.min}[op.name]

    def body(t):
        dst = sb((16, 1), nl.float32)
        nisa.tensor_reduce(dst=dst, op=op, data=t, axis=1)
        return dst

    np.testing.assert_allclose(run(body, x), ref(f64(x), axis=1, keepdims=True), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "name,ref",
    [
        ("add", lambda v: v.sum(1)),
        ("maximum", lambda v: v.max(1)),
        ("minimum", lambda v: v.min(1)),
        ("abs_max", lambda v: np.take_along_axis(v, np.abs(v).argmax(1)[:, None], 1)[:, 0]),
        ("abs_min", lambda v: np.take_along_axis(v, np.abs(v).argmin(1)[:, None], 1)[:, 0]),
    ],
)
def test_activate2_reduce_ops_reset_to_their_identity(name, ref):
    # Rows of large-magnitude values with one sign: a register reset to 0 (instead of the
    # operator's identity) would win every max/min/abs_min comparison.
    x = rand((32, 24), np.float32, 2, 6, seed=134)
    x[::2] = -x[::2]

    def body(t):
        d, r = sb(t.shape, nl.float32), sb((32, 1), nl.float32)
        nisa.activate2(
            dst=d,
            op=nl.copy,
            data=t,
            imm0=1.0,
            imm1=0.0,
            op0=nl.bypass,
            op1=nl.bypass,
            reduce_op=getattr(nl, name),
            reduce_res=r,
            reduce_cmd=nisa.reduce_cmd.reset_reduce,
        )
        return r

    np.testing.assert_allclose(run(body, x, target="trn3")[:, 0], ref(f64(x)), rtol=1e-6)


@nki.jit
def _reduce_into_bf16_dst(x):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    squares = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
    total = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
    nisa.activation_reduce(dst=squares, op=nl.square, data=t, reduce_op=nl.add, reduce_res=total)
    out = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=total)
    return out


def test_engine_reductions_accumulate_fp32_results_not_the_rounded_writes():
    x = (1.0 + np.arange(128 * 64, dtype=np.float32).reshape(128, 64) * 1e-3).astype(np.float32)
    got = _reduce_into_bf16_dst(x)[:, 0]
    fp32_sum = (x.astype(np.float32) ** 2).sum(axis=1, dtype=np.float32)
    rounded_sum = (x.astype(np.float32) ** 2).astype(ml_dtypes.bfloat16).astype(np.float32).sum(axis=1)
    np.testing.assert_allclose(got, fp32_sum, rtol=1e-6)
    assert np.abs(got - rounded_sum).max() > 1e-3  # the two readings really differ here
