"""AWS's new-API NKI examples (aws-neuron-sdk ``nki/examples``), unmodified, on the simulator.

Each example is imported from the checkout and run at the shapes its own driver (the ``*_torch.py``
file, its ``__main__`` block, or the guide that calls it) uses, against a NumPy reference with the
driver's tolerance.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernels_neuron import sim

pytestmark = pytest.mark.conformance

BF16 = ml_dtypes.bfloat16
RNG_SEED = 0


def test_getting_started_baremetal(load_example):
    """Its ``__main__``: two (4, 3) fp16 arrays of ones."""
    example = load_example("getting_started_baremetal.py")
    a = np.ones((4, 3), np.float16)
    np.testing.assert_array_equal(example.nki_tensor_add_kernel(a, a), a + a)


def test_nki_simulate_example(load_example):
    """The ``nki.simulate`` quick start runs and checks itself (``assert_allclose``) when imported."""
    example = load_example("simulate/nki_simulate_example.py")
    np.testing.assert_allclose(example.result, example.a + example.b, rtol=1e-5)


def test_tensor_addition(load_example):
    """guides/framework_custom_op.rst calls it on two (256, 1024) fp32 Gaussian arrays."""
    example = load_example("tensor_addition/tensor_addition_nki_kernels.py")
    rng = np.random.default_rng(RNG_SEED)
    a, b = rng.standard_normal((2, 256, 1024)).astype(np.float32)
    np.testing.assert_array_equal(example.nki_tensor_add(a, b), a + b)


def test_transpose2d(load_example):
    """transpose2d_torch.py: int8 ``arange`` of shape (5, 3 * 4), shape2D (3, 4); exact."""
    example = load_example("transpose2d/transpose2d_nki_kernels.py")
    rows, cols = 3, 4
    a = np.arange(5 * rows * cols, dtype=np.int8).reshape(5, rows * cols)
    expected = a.reshape(5, rows, cols).transpose(0, 2, 1).reshape(5, rows * cols)
    np.testing.assert_array_equal(example.tensor_transpose2D_kernel_(a, (rows, cols)), expected)


def test_average_pool2d(load_example):
    """average_pool2d_torch.py: bf16 ``arange`` of shape (2, 6, 6), pool 2; exact, as its driver checks."""
    example = load_example("average_pool2d/average_pool2d_nki_kernels.py")
    x = np.arange(2 * 6 * 6, dtype=np.float32).reshape(2, 6, 6).astype(BF16)
    expected = x.astype(np.float32).reshape(2, 3, 2, 3, 2).mean(axis=(2, 4))
    np.testing.assert_array_equal(example.tensor_avgpool_kernel(x, 2).astype(np.float32), expected)


def test_index_case_1_tensor_split(load_example):
    """index-case-1.py's driver: a bf16 ``arange`` of shape (4, 5) split into even and odd columns; exact."""
    example = load_example("index-case-1.py")
    x = np.arange(4 * 5, dtype=np.float32).reshape(4, 5).astype(BF16)
    even, odd = example.tensor_split_kernel_(x)
    np.testing.assert_array_equal(even, x[:, 0::2])
    np.testing.assert_array_equal(odd, x[:, 1::2])


def test_index_case_3_maxpool(load_example):
    """index-case-3.py's driver: a bf16 ``arange`` of shape (2, 6, 6), 2x2 max-pool through a 5-D access
    pattern; exact."""
    example = load_example("index-case-3.py")
    x = np.arange(2 * 6 * 6, dtype=np.float32).reshape(2, 6, 6).astype(BF16)
    expected = x.astype(np.float32).reshape(2, 3, 2, 3, 2).max(axis=(2, 4))
    np.testing.assert_array_equal(example.tensor_maxpool_kernel_(x, 2).astype(np.float32), expected)


def test_layout_pass_exp(load_example):
    """layout-pass.py's driver: exp of a (128, 512) bf16 tile; within bf16 rounding."""
    example = load_example("layout-pass.py")
    x = np.random.default_rng(RNG_SEED).random((128, 512)).astype(BF16)
    out = example.tensor_exp_kernel_(x).astype(np.float32)
    np.testing.assert_allclose(out, np.exp(x.astype(np.float32)), rtol=2**-8)


def test_layout_violation_is_refused_as_the_docs_show(load_example):
    """layout-violation.py loads a (256, 512) tile, which the docs use to show the partition limit."""
    example = load_example("layout-violation.py")
    with pytest.raises(sim.NkiValidationError, match=r"partition dim \(dim 0\) exceeds the partition count"):
        example.tensor_exp_kernel_(np.ones((256, 512), BF16))


# matrix_multiplication_torch.py: the basic kernel at lhs (64, 128) x rhs (128, 512), the others at
# (4096, 1024) x (1024, 2048), bf16 uniform [0, 1); torch.allclose(atol=1e-4, rtol=1e-2).
@pytest.mark.parametrize(
    "kernel_name, m, k, n",
    [
        ("nki_matmul_basic_", 64, 128, 512),
        ("nki_matmul_tiled_", 4096, 1024, 2048),
        ("nki_matmul_hoist_load_", 4096, 1024, 2048),
        ("nki_matmul_block_free_dimension_", 4096, 1024, 2048),
        ("nki_matmul_fully_optimized_", 4096, 1024, 2048),
    ],
)
def test_matrix_multiplication(load_example, kernel_name, m, k, n):
    example = load_example("matrix_multiplication/matrix_multiplication_nki_kernels.py")
    rng = np.random.default_rng(RNG_SEED)
    lhs = rng.random((m, k)).astype(BF16)
    rhs = rng.random((k, n)).astype(BF16)
    out = getattr(example, kernel_name)(np.ascontiguousarray(lhs.T), rhs)
    expected = (lhs.astype(np.float32) @ rhs.astype(np.float32)).astype(BF16).astype(np.float32)
    np.testing.assert_allclose(out.astype(np.float32), expected, atol=1e-4, rtol=1e-2)


def mamba_reference(delta, u, a, b, c):
    """The selective scan ``mamba_torch.py`` defines, in float64 NumPy."""
    delta_a = np.exp(delta[:, :, None, :] * a[None, :, :, None])
    delta_b_u = delta[:, :, None, :] * b[:, None, :, :] * u[:, :, None, :]
    state = np.zeros(delta_a.shape[:-1])
    scan = np.empty_like(delta_a)
    for t in range(delta_a.shape[-1]):
        state = delta_a[..., t] * state + delta_b_u[..., t]
        scan[..., t] = state
    return (c[:, None, :, :] * scan).sum(axis=-2)


# mamba_torch.py's accuracy check: batch 1, seq_len 512, channels 256, state 16, fp32; delta, u, B, C
# ones and A minus ones; torch.allclose(atol=1e-2, rtol=1e-2). The three kernel versions alike; and the
# same shapes with random inputs, where a wrong partition broadcast of B_i / C_i (nl.broadcast_to) shows.
@pytest.mark.parametrize("inputs", ["ones", "random"])
@pytest.mark.parametrize("version", ["mamba_v1", "mamba_v2", "mamba_v3"])
def test_fused_mamba(load_example, version, inputs):
    example = load_example("fused_mamba/mamba_nki_kernels.py")
    batch, seq_len, channels, state_size = 1, 512, 256, 16
    if inputs == "ones":
        delta = np.ones((batch, channels, seq_len), np.float32)
        u = np.ones((batch, channels, seq_len), np.float32)
        a = -np.ones((channels, state_size), np.float32)
        b = np.ones((batch, state_size, seq_len), np.float32)
        c = np.ones((batch, state_size, seq_len), np.float32)
    else:
        rng = np.random.default_rng(0)
        delta, u = (rng.random((batch, channels, seq_len), np.float32) for _ in range(2))
        a = -rng.random((channels, state_size), np.float32)
        b, c = (rng.random((batch, state_size, seq_len), np.float32) for _ in range(2))
    out = getattr(example, version)(delta, u, a, b, c)
    np.testing.assert_allclose(out, mamba_reference(delta, u, a, b, c), atol=1e-2, rtol=1e-2)
