"""The bundled example kernels, end to end on the simulator, against their NumPy references."""

import ml_dtypes
import numpy as np
import pytest

from kernels_neuron import sim
from kernels_neuron.sim import examples

BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(1234)


def _randn(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("k, m, n", [(128, 128, 512), (384, 256, 1024), (200, 130, 700), (1, 5, 3)])
def test_tiled_matmul_accumulates_over_k(k, m, n, dtype):
    lhs_t, rhs = _randn(k, m, dtype=dtype), _randn(k, n, dtype=dtype)
    result = sim.run(examples.tiled_matmul, lhs_t, rhs)
    exact = lhs_t.astype(np.float64).T @ rhs.astype(np.float64)
    if dtype == np.float32:
        np.testing.assert_allclose(result.outputs, exact, rtol=1e-5, atol=1e-4 * np.sqrt(k))
    else:
        # fp32 accumulation (error <= k * 2**-24 * sum|a||b|), then one bf16 rounding (<= 2**-8 relative).
        magnitude = np.abs(lhs_t.astype(np.float64)).T @ np.abs(rhs.astype(np.float64))
        bound = np.abs(exact) * 2**-8 + k * 2**-24 * magnitude * (1 + 2**-8)
        assert np.all(np.abs(result.outputs.astype(np.float64) - exact) <= bound)
        # ...and a bf16-accumulating kernel would be far worse than that on some element.
        assert np.abs(result.outputs.astype(np.float64) - exact).max() < 0.02 * np.abs(exact).max()
    k_tiles = -(-k // 128)
    out_tiles = -(-m // 128) * -(-n // 512)
    assert result.trace.counts()[("tensor", "nc_matmul")] == k_tiles * out_tiles


@pytest.mark.parametrize("shape", [(128, 128), (300, 260), (1, 7), (129, 1)])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_transpose_2d_is_exact(shape, dtype):
    x = _randn(*shape, dtype=dtype)
    np.testing.assert_array_equal(examples.transpose_2d(x), x.T)


def test_transpose_2d_keeps_nan_and_inf_on_trn2():
    x = _randn(64, 96)
    x[3, 5], x[10, 0] = np.nan, np.inf
    out = examples.transpose_2d(x)
    assert np.isnan(out[5, 3]) and np.isposinf(out[0, 10])


@pytest.mark.parametrize("shape", [(128, 64), (300, 1000), (5, 3)])
def test_row_softmax(shape):
    x = _randn(*shape) * 4
    out = examples.row_softmax(x)
    np.testing.assert_allclose(out, examples.row_softmax_reference(x), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(out.sum(axis=1), 1.0, rtol=1e-5)


def test_row_softmax_bf16_matches_fp32_math_rounded_once():
    x = _randn(200, 300, dtype=BF16)
    out = examples.row_softmax(x).astype(np.float32)
    ref = examples.row_softmax_reference(x.astype(np.float32))
    # One bf16 rounding of the output: at most half an ulp (2**-8 relative) apart.
    np.testing.assert_array_less(np.abs(out - ref), np.abs(ref) * 2**-8 + 1e-30)


@pytest.mark.parametrize("rows, cols", [(128, 512), (300, 1000), (7, 64)])
def test_layernorm(rows, cols):
    x = _randn(rows, cols) * 3 + 1
    gamma, beta = _randn(1, cols), _randn(1, cols)
    np.testing.assert_allclose(
        examples.layernorm(x, gamma, beta, 1e-5),
        examples.layernorm_reference(x, gamma, beta, 1e-5),
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.parametrize("rows, programs", [(512, 4), (300, 3), (128, 1)])
def test_spmd_scaled_add_one_program_per_block(rows, programs):
    a, b = _randn(rows, 96), _randn(rows, 96)
    result = sim.run(examples.spmd_scaled_add, a, b, 0.25, grid=programs)
    np.testing.assert_array_equal(result.outputs, examples.spmd_scaled_add_reference(a, b, 0.25))
    assert {inst.program for inst in result.trace} == {(p,) for p in range(programs)}


def test_spmd_with_too_few_programs_leaves_rows_unwritten():
    a, b = _randn(256, 8), _randn(256, 8)
    out = examples.spmd_scaled_add[1](a, b, 1.0)
    assert np.isnan(out[128:]).all() and not np.isnan(out[:128]).any()
