"""RMSNorm op: numerics against the transformers formulas, autograd, torch.library contract, bad input."""

import math

import pytest
import torch

from kernels_neuron.ops.rmsnorm import MAX_HIDDEN, MIN_HIDDEN, rms_norm, rms_norm_reference, rmsnorm_fwd

CONVENTIONS = ["llama", "gemma", "fp32_multiply"]
# rows x hidden: ragged row tiles, hidden sizes off multiples of 128, the range's ends, leading dims
SHAPES = [(1, 64), (128, 128), (300, 4096), (5, 3000), (129, 100), (2, 7, 256), (3, MAX_HIDDEN), (7, 1), (300, 3)]
# rows the forward packs several to a partition (hidden under 2 KiB per row), with a ragged tail
PACKED_SHAPES = [(4096 + 77, 128), (2 * 32 * 128 + 5, 16), (2048 * 2, 64)]
EPS = 1e-6


def _inputs(shape, dtype, convention, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype)
    hidden = shape[-1]
    w = torch.randn(hidden, generator=gen) * 0.1 + (0.0 if convention == "gemma" else 1.0)
    return x, w.to(dtype)


def _fp32(x, w, convention):
    return rms_norm_reference(x.float(), w.float(), EPS, convention)


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_matches_reference_tightly(shape, convention):
    x, w = _inputs(shape, torch.float32, convention)
    torch.testing.assert_close(
        rms_norm(x, w, EPS, convention), rms_norm_reference(x, w, EPS, convention), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bf16_error_is_within_torchs_own_bf16_error(shape, convention):
    x, w = _inputs(shape, torch.bfloat16, convention)
    exact = _fp32(x, w, convention)
    torch_error = (rms_norm_reference(x, w, EPS, convention).float() - exact).abs().max()
    kernel_error = (rms_norm(x, w, EPS, convention).float() - exact).abs().max()
    assert kernel_error <= 1.5 * torch_error, (kernel_error, torch_error)


@pytest.mark.parametrize(
    "shape", [(256, 512), (16, 4096), (8, 3000)], ids=["row-tiles", "decode-rowwise", "decode-groupwise"]
)
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_bf16_rounds_where_the_transformers_module_rounds(convention, shape):
    """Llama rounds the normalised value before scaling; the fp32 conventions round once."""
    x, w = _inputs(shape, torch.bfloat16, convention, seed=3)
    out = rms_norm(x, w, EPS, convention)
    mismatches = (out != rms_norm_reference(x, w, EPS, convention)).float().mean()
    assert mismatches < 1e-3  # rare one-ulp flips from a differently ordered fp32 sum, nothing more


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=str)
def test_packed_short_rows_match_like_any_other(shape, convention):
    """Short rows go several to a partition (rows_per_partition > 1); the packed tiles and the ragged
    tail both match, in fp32 tightly and in bf16 within torch's own bf16 error."""
    from nki_src.rmsnorm import rows_per_partition

    assert rows_per_partition(shape[-1], "bfloat16") > 1
    x, w = _inputs(shape, torch.float32, convention)
    torch.testing.assert_close(
        rms_norm(x, w, EPS, convention), rms_norm_reference(x, w, EPS, convention), rtol=1e-5, atol=1e-5
    )
    x, w = _inputs(shape, torch.bfloat16, convention)
    exact = _fp32(x, w, convention)
    torch_error = (rms_norm_reference(x, w, EPS, convention).float() - exact).abs().max()
    assert (rms_norm(x, w, EPS, convention).float() - exact).abs().max() <= 1.5 * torch_error


# The decode layout (each of a few rows spread over the partitions) serves up to P // 8 = 16 rows of a
# hidden size with a 128-way divisor; these run it from one row to one past the switch, on hidden sizes
# that are (4096) and are not (4000: 125 partitions; 3000: 125; 1000: 50 in bf16, 100 in fp32) multiples of 128;
# 4096 and 4000 normalise row by row on ScalarE (32 columns per partition), 3000 and 1000 group-wise on VectorE.
DECODE_SHAPES = [(rows, 4096) for rows in range(1, 18)] + [(1, 4000), (5, 3000), (4, 1000), (2, 3, 1000)]


def _decode_partitions(shape, dtype):
    from nki_src.rmsnorm import decode_partitions

    return decode_partitions(math.prod(shape[:-1]), shape[-1], str(dtype).removeprefix("torch."))


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=str)
def test_decode_rows_match_like_any_other(shape, convention):
    """Few rows spread over the partitions (and, one past the switch, the row tiles again) match in fp32
    tightly and in bf16 within torch's own bf16 error."""
    x, w = _inputs(shape, torch.float32, convention, seed=len(shape) + shape[0])
    torch.testing.assert_close(
        rms_norm(x, w, EPS, convention), rms_norm_reference(x, w, EPS, convention), rtol=1e-5, atol=1e-5
    )
    x, w = _inputs(shape, torch.bfloat16, convention, seed=shape[0])
    exact = _fp32(x, w, convention)
    torch_error = (rms_norm_reference(x, w, EPS, convention).float() - exact).abs().max()
    assert (rms_norm(x, w, EPS, convention).float() - exact).abs().max() <= 1.5 * torch_error


def test_decode_shapes_take_the_decode_layout_up_to_the_switch():
    """The shapes above do run the decode layout (all but the one past the switch)."""
    for dtype in (torch.float32, torch.bfloat16):
        used = {shape: _decode_partitions(shape, dtype) for shape in DECODE_SHAPES}
        assert used[(17, 4096)] == 0
        assert all(parts for shape, parts in used.items() if shape != (17, 4096)), used
    assert _decode_partitions((5, 3000), torch.bfloat16) == 125
    assert _decode_partitions((4, 1000), torch.bfloat16) == 50  # 20-element (40-byte) runs; 125 would give 16 bytes
    assert _decode_partitions((4, 1000), torch.float32) == 100


@pytest.mark.parametrize(
    "rows, hidden, dtype, parts",
    [
        (16, 4096, "bfloat16", 128),  # the switch: 8 partitions per row
        (17, 4096, "bfloat16", 0),
        (6, 1000, "bfloat16", 50),
        (7, 1000, "bfloat16", 0),
        (8, 2048, "bfloat16", 64),  # 128 partitions would read 32-byte runs
        (9, 2048, "bfloat16", 0),
        (1, 512, "float32", 32),
        (1, 256, "float32", 0),  # 32 partitions would read 32-byte runs, and fewer do not pay off
        (1, 4099, "bfloat16", 0),  # prime: no divisor spreads it
        (1, 1, "float32", 0),
    ],
)
def test_decode_layout_selection(rows, hidden, dtype, parts):
    from nki_src.rmsnorm import decode_partitions

    assert decode_partitions(rows, hidden, dtype) == parts


def _modelled(rows, hidden, dtype, convention, parts=None):
    """Cost report (Trn2) of the forward: the decode layout on ``parts`` partitions, the row tiles for
    ``parts=0``, or the layout the kernel chooses for ``parts=None``."""
    import ml_dtypes
    import numpy as np

    import nki_src.rmsnorm as kernels
    from kernels_neuron import cost

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((rows, hidden)).astype(np_dtype), np.ones(hidden, np_dtype)
    chosen = kernels.decode_partitions
    if parts is not None:
        kernels.decode_partitions = lambda *args: parts
    try:
        return cost.estimate(kernels.rmsnorm_fwd, x, w, EPS, convention, dtype)
    finally:
        kernels.decode_partitions = chosen


@pytest.mark.parametrize(
    "rows, hidden, dtype, convention",
    [
        (1, 4096, "bfloat16", "llama"),
        (8, 4096, "bfloat16", "llama"),
        (16, 4096, "bfloat16", "gemma"),
        (6, 1000, "bfloat16", "llama"),
        # the two closest calls of benchmarks/norm_decode_sweep.py, behind DECODE_PARTITIONS_PER_ROW
        (16, 1152, "float32", "gemma"),
        (8, 576, "float32", "fp32_multiply"),
    ],
)
def test_decode_layout_is_never_modelled_slower_than_row_tiles(rows, hidden, dtype, convention):
    """Where the decode layout is chosen, the row tiles (the weight copied only to the rows' partitions)
    are modelled no faster."""
    from nki_src.rmsnorm import decode_partitions

    parts = decode_partitions(rows, hidden, dtype)
    assert parts  # the comparison is vacuous unless the decode layout is the one chosen
    assert _modelled(rows, hidden, dtype, convention).time_us <= _modelled(rows, hidden, dtype, convention, 0).time_us


def test_row_tiles_win_well_past_the_switch():
    """Negative control: forced on 64 rows of 4096, the decode layout is modelled slower than the row
    tiles, so the switch does choose between two layouts that each win somewhere."""
    assert _modelled(64, 4096, "bfloat16", "llama", 128).time_us > _modelled(64, 4096, "bfloat16", "llama").time_us


def test_decode_layout_reads_the_weight_once():
    """Decode-8 on Mistral-7B's hidden size moves x, the output, the rstd column and one weight: 139 KB,
    not the 1.18 MB of a weight copied to all 128 partitions."""
    rows, hidden = 8, 4096
    report = _modelled(rows, hidden, "bfloat16", "llama")
    assert report.hbm_bytes == 2 * rows * hidden * 2 + hidden * 2 + rows * 4


def test_decode_nan_and_inf_stay_in_their_row():
    """The partial sums cross the partitions in a matmul, one moving column per row: a NaN or inf in one
    row leaves the others alone."""
    x, w = _inputs((4, 4096), torch.float32, "llama")
    assert _decode_partitions(x.shape, x.dtype)
    x[1, 5], x[2, 4000] = float("nan"), float("inf")
    out, ref = rms_norm(x, w, EPS, "llama"), rms_norm_reference(x, w, EPS, "llama")
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    assert out[1].isnan().all() and out[2].isnan().any() and not out[[0, 3]].isnan().any()


@pytest.mark.parametrize("shape", [(4, 256), (4, 4096)], ids=["row-tiles", "decode"])
def test_mixed_dtypes_follow_torch_promotion_for_llama(shape):
    x, w = _inputs(shape, torch.bfloat16, "llama")
    out = rms_norm(x, w.float(), EPS, "llama")
    assert out.dtype == torch.float32  # fp32 weight * bf16 normed promotes, as in LlamaRMSNorm
    torch.testing.assert_close(out, rms_norm_reference(x, w.float(), EPS, "llama"), rtol=1e-5, atol=1e-5)
    assert rms_norm(x, w.float(), EPS, "gemma").dtype == torch.bfloat16


@pytest.mark.parametrize("dtype, tol", [(torch.float32, None), (torch.bfloat16, 3.0)])
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("shape", [(300, 1000), (2, 3, 64), (130, 4096)], ids=str)
def test_gradients(shape, convention, dtype, tol):
    x, w = _inputs(shape, dtype, convention, seed=1)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)

    def grads(fn, x, w):
        x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        fn(x, w, EPS, convention).backward(grad.to(fn(x, w, EPS, convention).dtype))
        return x.grad, w.grad

    kx, kw = grads(rms_norm, x, w)
    assert kx.dtype == x.dtype and kw.dtype == w.dtype
    if tol is None:
        rx, rw = grads(rms_norm_reference, x, w)
        torch.testing.assert_close(kx, rx, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kw, rw, rtol=1e-4, atol=1e-3 * math.sqrt(x.numel() / shape[-1]))
    else:
        ex, ew = grads(rms_norm_reference, x.float(), w.float())
        tx, tw = grads(rms_norm_reference, x, w)
        assert (kx.float() - ex).abs().max() <= tol * (tx.float() - ex).abs().max()
        assert (kw.float() - ew).abs().max() <= tol * (tw.float() - ew).abs().max()


def test_opcheck_passes_for_forward_with_autograd():
    x, w = _inputs((20, 256), torch.float32, "llama")
    torch.library.opcheck(rmsnorm_fwd, (x, w, EPS, "llama"))
    torch.library.opcheck(rmsnorm_fwd, (x.requires_grad_(), w.requires_grad_(), EPS, "gemma"))


def test_torch_compile_fullgraph_has_no_graph_breaks():
    x, w = _inputs((2, 9, 256), torch.float32, "llama")
    compiled = torch.compile(lambda a, b: rms_norm(a, b, EPS, "llama") * 2, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, w), 2 * rms_norm_reference(x, w, EPS, "llama"), rtol=1e-5, atol=1e-5)
    explanation = torch._dynamo.explain(lambda a, b: rms_norm(a, b, EPS, "llama"))(x, w)
    assert explanation.graph_break_count == 0


def test_nan_and_inf_propagate_like_the_reference():
    x, w = _inputs((4, 128), torch.float32, "llama")
    x[1, 5], x[2, 0] = float("nan"), float("inf")
    out, ref = rms_norm(x, w, EPS, "llama"), rms_norm_reference(x, w, EPS, "llama")
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    assert out[1].isnan().all() and not out[0].isnan().any()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.ones(4, 128, dtype=torch.int32), torch.ones(128)), "dtype torch.int32"),
        (lambda: (torch.ones(4, 128), torch.ones(127)), r"weight of shape \(127,\) does not match hidden size 128"),
        (lambda: (torch.ones(0, 128), torch.ones(128)), r"shape \(0, 128\) is empty"),
        (lambda: (torch.ones(128, 4).t(), torch.ones(128)), "not contiguous"),
        (
            lambda: (torch.ones(4, MAX_HIDDEN + 1), torch.ones(MAX_HIDDEN + 1)),
            f"outside the supported range {MIN_HIDDEN}",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(make, match):
    x, w = make()
    with pytest.raises((TypeError, ValueError), match=match):
        rms_norm(x, w, EPS)


def test_unknown_convention_is_rejected():
    with pytest.raises(ValueError, match="convention 'olmo'"):
        rms_norm(torch.ones(2, 64), torch.ones(64), EPS, "olmo")
