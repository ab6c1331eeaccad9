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


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_bf16_rounds_where_the_transformers_module_rounds(convention):
    """Llama rounds the normalised value before scaling; the fp32 conventions round once."""
    x, w = _inputs((256, 512), torch.bfloat16, convention, seed=3)
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


def test_mixed_dtypes_follow_torch_promotion_for_llama():
    x, w = _inputs((4, 256), torch.bfloat16, "llama")
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
