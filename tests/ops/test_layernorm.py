"""LayerNorm op: numerics against torch.nn.functional.layer_norm, autograd, torch.library contract, SBUF
limits on every target, bad input."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from kernels_neuron import sim
from kernels_neuron.ops.layernorm import (
    MAX_HIDDEN,
    layer_norm,
    layer_norm_reference,
    layernorm_fwd,
    max_hidden,
)
from nki_src import layernorm as kernels

# rows x hidden: ragged row tiles, hidden sizes off multiples of 128 and of the 2048-column chunk,
# the range's ends, leading dims
SHAPES = [(1, 1), (128, 3), (300, 4096), (5, 3000), (129, 100), (2, 7, 256), (3, 2050)]
AFFINE = {"weight+bias": (True, True), "weight": (True, False), "none": (False, False), "bias": (False, True)}
EPS = 1e-5


def _inputs(shape, dtype, affine, seed=0, vector_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
    hidden = shape[-1]
    with_weight, with_bias = AFFINE[affine]
    w = (torch.randn(hidden, generator=gen) * 0.1 + 1.0).to(vector_dtype or dtype) if with_weight else None
    b = (torch.randn(hidden, generator=gen) * 0.1).to(vector_dtype or dtype) if with_bias else None
    return x, w, b


def _fp32(t):
    return None if t is None else t.float()


@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_matches_reference_tightly(shape, affine):
    x, w, b = _inputs(shape, torch.float32, affine)
    torch.testing.assert_close(layer_norm(x, w, b, EPS), layer_norm_reference(x, w, b, EPS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("affine", ["weight+bias", "weight"])
@pytest.mark.parametrize("shape", [(300, 4096), (5, 3000), (129, 100)], ids=str)
def test_bf16_error_is_within_torchs_own_bf16_error(shape, affine):
    x, w, b = _inputs(shape, torch.bfloat16, affine)
    exact = layer_norm_reference(x.float(), _fp32(w), _fp32(b), EPS)
    torch_error = (layer_norm_reference(x, w, b, EPS).float() - exact).abs().max()
    kernel_error = (layer_norm(x, w, b, EPS).float() - exact).abs().max()
    assert torch_error > 0 and kernel_error <= 1.5 * torch_error, (kernel_error, torch_error)


def test_a_large_mean_costs_at_most_the_documented_precision():
    """The variance is two-pass (bn_stats: no E[x^2] - mean^2 cancellation), but n = x * rstd - mean * rstd
    is one fused ScalarE pass, whose absolute error grows as 2**-24 * |mean| / std (docs of nki_src/layernorm)."""
    gen = torch.Generator().manual_seed(5)
    for mean, std in ((300.0, 0.01), (3.0, 1.0)):
        x = torch.randn(64, 1000, generator=gen) * std + mean
        ratio = abs(mean) / std
        error = (layer_norm(x, None, None, EPS) - layer_norm_reference(x, None, None, EPS)).abs().max()
        assert error <= 8 * 2**-24 * ratio + 1e-6, (ratio, error)
        if ratio > 1e4:
            assert error > 1e-5  # the cancellation is real (this test would notice a change of formula)


def test_mixed_dtypes_compute_in_fp32_and_return_the_inputs_dtype():
    x, w, b = _inputs((40, 256), torch.bfloat16, "weight+bias", vector_dtype=torch.float32)
    out = layer_norm(x, w, b, EPS)
    assert out.dtype == torch.bfloat16 == layer_norm_reference(x, w, b, EPS).dtype
    exact = layer_norm_reference(x.float(), w, b, EPS)
    assert (out.float() - exact).abs().max() <= 1.5 * (layer_norm_reference(x, w, b, EPS).float() - exact).abs().max()


GRADIENT_CASES = [
    *[
        (shape, affine, torch.float32, None)
        for shape in [(300, 1000), (2, 3, 64), (130, 4096), (7, 1)]
        for affine in ["weight+bias", "weight", "none", "bias"]
    ],
    *[
        (shape, affine, torch.bfloat16, 3.0)
        for shape in [(300, 1000), (130, 4096)]
        for affine in ["weight+bias", "none"]
    ],
    ((130, 2500), "weight+bias", torch.float16, 3.0),
    # the backward's schedules (_BackwardPlan): three tiles in flight with several chunk groups, and the
    # lean one-tile schedule with dy streamed
    ((300, 6000), "weight+bias", torch.bfloat16, 3.0),
    ((130, 8192), "weight+bias", torch.float32, None),
]


@pytest.mark.parametrize("shape, affine, dtype, tol", GRADIENT_CASES, ids=str)
def test_gradients(shape, affine, dtype, tol):
    x, w, b = _inputs(shape, dtype, affine, seed=1)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)

    def grads(fn, *tensors):
        leaves = [None if t is None else t.clone().requires_grad_(True) for t in tensors]
        fn(*leaves, EPS).backward(grad.to(leaves[0].dtype))
        return [None if t is None else t.grad for t in leaves]

    got = grads(layer_norm, x, w, b)
    present = [i for i, t in enumerate((x, w, b)) if t is not None]
    assert all(got[i].dtype == (x, w, b)[i].dtype for i in present)
    # a comparison that can fail: non-zero gradients (at H = 1, n = 0, so only the bias gets one)
    assert all(got[i].abs().max() > 0 for i in present if shape[-1] > 1 or i == 2)
    rows = x.numel() // shape[-1]
    if tol is None:
        want = grads(layer_norm_reference, x, w, b)
        # H = 1: rstd = 1/sqrt(eps) scales the (exactly cancelling) dx terms by ~300
        scale = 1 / math.sqrt(EPS) if shape[-1] == 1 else 1.0
        for i in present:
            atol = 1e-4 * scale if i == 0 else 1e-4 * math.sqrt(rows)
            torch.testing.assert_close(got[i], want[i], rtol=1e-4, atol=atol)
    else:
        exact = grads(layer_norm_reference, x.float(), _fp32(w), _fp32(b))
        torch_bf16 = grads(layer_norm_reference, x, w, b)
        for i in present:
            kernel_error = (got[i].float() - exact[i]).abs().max()
            assert kernel_error <= tol * (torch_bf16[i].float() - exact[i]).abs().max() + 1e-6, i


def test_opcheck_passes_for_forward_with_autograd():
    x, w, b = _inputs((20, 256), torch.float32, "weight+bias")
    torch.library.opcheck(layernorm_fwd, (x, w, b, EPS))
    torch.library.opcheck(layernorm_fwd, (x.requires_grad_(), w.requires_grad_(), None, EPS))


def test_torch_compile_fullgraph_has_no_graph_breaks():
    x, w, b = _inputs((2, 9, 256), torch.float32, "weight+bias")
    compiled = torch.compile(lambda a, c, d: layer_norm(a, c, d, EPS) * 2, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, w, b), 2 * layer_norm_reference(x, w, b, EPS), rtol=1e-5, atol=1e-5)
    explanation = torch._dynamo.explain(lambda a, c, d: layer_norm(a, c, d, EPS))(x, w, b)
    assert explanation.graph_break_count == 0


def test_nan_and_inf_propagate_like_the_reference():
    x, w, b = _inputs((4, 128), torch.float32, "weight+bias")
    x[1, 5], x[2, 0] = float("nan"), float("inf")
    out, ref = layer_norm(x, w, b, EPS), layer_norm_reference(x, w, b, EPS)
    assert torch.equal(out.isnan(), ref.isnan())
    assert out[1].isnan().all() and not out[0].isnan().any()


@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
@pytest.mark.parametrize("dtypes", [("bfloat16",) * 3, ("bfloat16", "float32", "float32"), ("float32",) * 3], ids=str)
def test_the_largest_hidden_size_fits_sbuf_forward_and_backward(target, dtypes):
    """One row tile at the largest size the op accepts for these dtypes (on every target), capacity
    checks on: forward and backward (streaming the rows there) run and match torch."""
    hidden = max_hidden(*dtypes)
    rng = np.random.default_rng(0)
    x, w, b = (
        rng.standard_normal(shape).astype(_np(d)) for shape, d in zip(((3, hidden), (hidden,), (hidden,)), dtypes)
    )
    dy = rng.standard_normal((3, hidden)).astype(_np(dtypes[0]))
    out, mean, rstd = sim.run(kernels.layernorm_fwd, x, w, b, EPS, target=target).outputs
    dx, dw, db = sim.run(kernels.layernorm_bwd, dy, x, w, mean, rstd, target=target).outputs
    leaves = [torch.from_numpy(t.astype(np.float32)).requires_grad_() for t in (x, w, b)]
    want = layer_norm_reference(*leaves, EPS)
    want.backward(torch.from_numpy(dy.astype(np.float32)))
    tolerance = 0.05 if dtypes[0] == "bfloat16" else 1e-4
    assert np.abs(out.astype(np.float32) - want.detach().numpy()).max() < tolerance
    for got, leaf, scale in ((dx, leaves[0], 1), (dw, leaves[1], 3), (db, leaves[2], 3)):
        assert np.abs(got.astype(np.float32) - leaf.grad.numpy()).max() < tolerance * scale


def test_rows_too_wide_for_sbuf_stream_through_and_match_torch_tightly():
    """fp32 rows of 16385 (one more than 16K, so bn_stats' last pieces straddle a load) do not fit SBUF
    with their result: the forward reads x twice (statistics, then normalisation) and the backward x
    and dy twice; over two row tiles, one ragged, both match torch in fp32."""
    hidden, rows = 16385, 130
    assert kernels.forward_bytes(hidden, 4, 4, 4) > 229376
    assert kernels._BackwardPlan(hidden, "float32", "float32", "float32").streamed
    rng = np.random.default_rng(1)
    x, dy = (rng.standard_normal((rows, hidden)).astype(np.float32) for _ in range(2))
    w, b = (rng.standard_normal(hidden).astype(np.float32) for _ in range(2))
    forward = sim.run(kernels.layernorm_fwd, x, w, b, EPS)
    out, mean, rstd = forward.outputs
    backward = sim.run(kernels.layernorm_bwd, dy, x, w, mean, rstd)
    dx, dw, db = backward.outputs
    # x twice, and the weight and bias broadcast to the 128 partitions once
    assert sum(i.hbm_bytes_read for i in forward.trace) == 2 * x.nbytes + 128 * (w.nbytes + b.nbytes)
    # x and dy twice, the weight broadcast once, and each row's mean and rstd
    assert sum(i.hbm_bytes_read for i in backward.trace) == 2 * (x.nbytes + dy.nbytes) + 128 * w.nbytes + 2 * rows * 4
    leaves = [torch.from_numpy(t).requires_grad_() for t in (x, w, b)]
    want = layer_norm_reference(*leaves, EPS)
    want.backward(torch.from_numpy(dy))
    assert leaves[0].grad.abs().max() > 0.1 and leaves[1].grad.abs().max() > 1  # the gradients are not vacuous
    torch.testing.assert_close(torch.from_numpy(out), want.detach(), rtol=1e-5, atol=1e-5)
    for got, leaf in ((dx, leaves[0]), (dw, leaves[1]), (db, leaves[2])):
        torch.testing.assert_close(torch.from_numpy(got), leaf.grad, rtol=1e-4, atol=1e-4)


def _np(dtype):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32


def test_past_the_largest_hidden_size_the_kernels_name_the_limit():
    x = np.zeros((1, MAX_HIDDEN + 1), np.float32)
    with pytest.raises(
        ValueError, match=f"hidden size {MAX_HIDDEN + 1} is outside the supported range 1..{MAX_HIDDEN}"
    ):
        sim.run(kernels.layernorm_fwd, x, None, None, EPS)
    with pytest.raises(ValueError, match=r"needs [\d,]+ bytes of SBUF per partition in the backward"):
        kernels._BackwardPlan(100000, "float32", "float32", "float32")
    assert max_hidden("float32", "float32", "float32") < max_hidden("bfloat16", "bfloat16", "bfloat16") == MAX_HIDDEN


def test_bn_stats_never_gets_a_one_element_piece():
    for hidden in (2, 513, 1025, 4097, 512):
        pieces = [c for _, c in kernels._bn_pieces(hidden)]
        assert sum(pieces) == hidden and min(pieces) >= 2, (hidden, pieces)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.ones(4, 128, dtype=torch.int32), None, None), "dtype torch.int32"),
        (
            lambda: (torch.ones(4, 128), torch.ones(127), None),
            r"weight of shape \(127,\) does not match hidden size 128",
        ),
        (lambda: (torch.ones(4, 128), None, torch.ones(2, 64)), r"bias of shape \(2, 64\) does not match"),
        (lambda: (torch.ones(0, 128), None, None), r"shape \(0, 128\) is empty"),
        (lambda: (torch.ones(128, 4).t(), None, None), "not contiguous"),
        (
            lambda: (torch.ones(2, MAX_HIDDEN + 2, dtype=torch.bfloat16), None, None),
            f"hidden size {MAX_HIDDEN + 2} is outside the supported range 1..{MAX_HIDDEN} for x torch.bfloat16",
        ),
        (
            lambda: (torch.ones(2, 20000), torch.ones(20000), torch.ones(20000)),
            r"outside the supported range 1..18432 for x torch.float32, weight torch.float32, bias torch.float32",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(make, match):
    x, w, b = make()
    with pytest.raises((TypeError, ValueError), match=match):
        layer_norm(x, w, b, EPS)


@pytest.mark.parametrize("with_weight, with_bias", [(True, False), (False, True), (False, False)])
def test_streamed_rows_without_a_weight_or_a_bias_match_torch(with_weight, with_bias):
    """The streamed forward and backward (fp32 rows of 16385) with the weight or the bias absent."""
    hidden, rows = 16385, 3
    rng = np.random.default_rng(2)
    x, dy = (rng.standard_normal((rows, hidden)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(hidden).astype(np.float32) if with_weight else None
    b = rng.standard_normal(hidden).astype(np.float32) if with_bias else None
    out, mean, rstd = sim.run(kernels.layernorm_fwd, x, w, b, EPS).outputs
    dx, dw, db = sim.run(kernels.layernorm_bwd, dy, x, w, mean, rstd).outputs
    leaves = [torch.from_numpy(t).requires_grad_() if t is not None else None for t in (x, w, b)]
    want = layer_norm_reference(*leaves, EPS)
    want.backward(torch.from_numpy(dy))
    torch.testing.assert_close(torch.from_numpy(out), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(dx), leaves[0].grad, rtol=1e-4, atol=1e-4)
    if with_weight:
        torch.testing.assert_close(torch.from_numpy(dw), leaves[1].grad, rtol=1e-4, atol=1e-4)
    if with_bias:
        torch.testing.assert_close(torch.from_numpy(db), leaves[2].grad, rtol=1e-4, atol=1e-4)


# The decode layout (few rows spread over the partitions, ``kernels._decode_forward``): from one row to
# one past the switch at Starcoder2-7B's hidden 4608 (36 columns per partition: row by row on ScalarE),
# and hidden sizes that split unevenly (3000: 125 partitions; 1000: 50 in bf16, 100 in fp32, 10 or 20
# columns: the group-wise VectorE normalisation).
DECODE_SHAPES = [(rows, 4608) for rows in (1, 3, 8, 16, 17)] + [(5, 3000), (4, 1000), (2, 3, 1000)]


def _decode_partitions(shape, dtype, affine="weight+bias"):
    rows, dtype = math.prod(shape[:-1]), str(dtype).removeprefix("torch.")
    return kernels.forward_decode_partitions(rows, shape[-1], dtype, any(AFFINE[affine]))


@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=str)
def test_decode_rows_match_like_any_other(shape, affine):
    """fp32 tightly, bf16 within torch's own bf16 error, the returned mean and rstd too."""
    x, w, b = _inputs(shape, torch.float32, affine, seed=shape[0])
    out, mean, rstd = layernorm_fwd(x.reshape(-1, shape[-1]), w, b, EPS)
    torch.testing.assert_close(out.reshape(shape), layer_norm_reference(x, w, b, EPS), rtol=1e-5, atol=1e-5)
    rows = x.reshape(-1, shape[-1])
    torch.testing.assert_close(mean[:, 0], rows.mean(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rstd[:, 0], (rows.var(-1, unbiased=False) + EPS).rsqrt(), rtol=1e-5, atol=1e-6)
    x, w, b = _inputs(shape, torch.bfloat16, affine, seed=shape[0])
    exact = layer_norm_reference(x.float(), _fp32(w), _fp32(b), EPS)
    torch_error = (layer_norm_reference(x, w, b, EPS).float() - exact).abs().max()
    assert torch_error > 0
    assert (layer_norm(x, w, b, EPS).float() - exact).abs().max() <= 1.5 * torch_error


def test_decode_shapes_take_the_decode_layout_up_to_the_switch():
    """The shapes above run the decode layout, but for the one past the switch (17 rows of 4608; without a
    weight or a bias, from 9 rows on)."""
    for dtype in (torch.float32, torch.bfloat16):
        used = {shape: _decode_partitions(shape, dtype) for shape in DECODE_SHAPES}
        assert used[(17, 4608)] == 0
        assert all(parts for shape, parts in used.items() if shape != (17, 4608)), used
    assert _decode_partitions((8, 4608), torch.bfloat16) == 128
    assert _decode_partitions((8, 4608), torch.bfloat16, "none") == 128
    assert _decode_partitions((9, 4608), torch.bfloat16, "none") == 0


def _modelled(rows, hidden, affine, parts=None, dtype=torch.bfloat16):
    """Cost report (Trn2) of the forward in the layout the kernel chooses (``parts=None``), or with the
    row tiles forced (``parts=0``)."""
    from kernels_neuron import cost

    def numpy(t):
        if t is None or t.dtype != torch.bfloat16:
            return None if t is None else t.numpy()
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)

    x, w, b = (numpy(t) for t in _inputs((rows, hidden), dtype, affine))
    chosen = kernels.decode_partitions
    if parts is not None:
        kernels.decode_partitions = lambda *args: parts
    try:
        return cost.estimate(kernels.layernorm_fwd, x, w, b, EPS)
    finally:
        kernels.decode_partitions = chosen


def test_decode_layout_reads_the_weight_and_bias_once():
    """Decode-8 on Starcoder2-7B's hidden size moves x, the output, the mean and rstd columns and one copy
    each of the weight and the bias: 166 KB, not the 2.4 MB of both copied to all 128 partitions."""
    rows, hidden = 8, 4608
    report = _modelled(rows, hidden, "weight+bias")
    assert report.hbm_bytes == 2 * rows * hidden * 2 + 2 * hidden * 2 + 2 * rows * 4


@pytest.mark.parametrize(
    "rows, hidden, affine, dtype",
    [
        (1, 4608, "weight+bias", torch.bfloat16),
        (8, 4608, "weight+bias", torch.bfloat16),
        (16, 4096, "weight", torch.bfloat16),
        (8, 4096, "none", torch.bfloat16),
        (2, 384, "none", torch.float32),  # the closest call of benchmarks/norm_decode_sweep.py (0.95)
    ],
)
def test_decode_layout_is_never_modelled_slower_than_row_tiles(rows, hidden, affine, dtype):
    """Where the decode layout is chosen, the row tiles (the weight and bias copied to the rows'
    partitions only) are modelled slower."""
    assert _decode_partitions((rows, hidden), dtype, affine)  # vacuous unless the decode layout is chosen
    chosen, row_tiles = _modelled(rows, hidden, affine, dtype=dtype), _modelled(rows, hidden, affine, 0, dtype)
    assert chosen.time_us < row_tiles.time_us


@pytest.mark.parametrize(
    "x_dtype, vector_dtype",
    [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.float16, torch.float32)],
    ids=str,
)
def test_decode_layout_with_mixed_dtypes_computes_in_fp32_and_returns_the_inputs_dtype(x_dtype, vector_dtype):
    """Weight and bias of another float dtype than x: the result is x's dtype, within the error of
    rounding the exact (fp64) LayerNorm to it."""
    x, w, b = _inputs((8, 4608), x_dtype, "weight+bias", vector_dtype=vector_dtype)
    assert _decode_partitions(x.shape, x_dtype)
    out = layer_norm(x, w, b, EPS)
    assert out.dtype == x_dtype
    exact = layer_norm_reference(x.double(), w.double(), b.double(), EPS)
    rounding = (exact.to(x_dtype).double() - exact).abs().max()
    assert rounding > 0  # the dtype does lose precision, so the bound below can fail
    assert (out.double() - exact).abs().max() <= 1.5 * rounding


def test_without_affine_the_decode_layout_needs_twice_the_partitions():
    """Negative control for the rule: forced on 16 fp32 rows of 1152 without a weight or a bias (8
    partitions per row), the decode layout is modelled slower than the row tiles the kernel chooses."""
    assert _decode_partitions((16, 1152), torch.float32, "none") == 0
    forced = _modelled(16, 1152, "none", 128, torch.float32)
    assert forced.time_us > _modelled(16, 1152, "none", dtype=torch.float32).time_us


def test_decode_nan_and_inf_stay_in_their_row():
    """The partial sums cross the partitions in a matmul, one moving column per row: a NaN or inf in one
    row leaves the others alone."""
    x, w, b = _inputs((4, 4608), torch.float32, "weight+bias")
    assert _decode_partitions(x.shape, x.dtype)
    x[1, 5], x[2, 4000] = float("nan"), float("inf")
    out, ref = layer_norm(x, w, b, EPS), layer_norm_reference(x, w, b, EPS)
    assert torch.equal(out.isnan(), ref.isnan())
    assert out[1].isnan().all() and out[2].isnan().all() and not out[[0, 3]].isnan().any()


def test_the_decode_layout_keeps_the_documented_precision_for_a_large_mean():
    """As the row tiles (the test above): the mean is summed in fp32 across the partitions, so its error,
    and the output's, grows as 2**-24 * |mean| / std; the variance comes from x - mean (two passes)."""
    gen = torch.Generator().manual_seed(6)
    for mean, std in ((300.0, 0.01), (3.0, 1.0)):
        x = torch.randn(4, 4608, generator=gen) * std + mean
        assert _decode_partitions(x.shape, x.dtype)
        ratio = abs(mean) / std
        error = (layer_norm(x, None, None, EPS) - layer_norm_reference(x, None, None, EPS)).abs().max()
        assert error <= 8 * 2**-24 * ratio + 1e-6, (ratio, error)
