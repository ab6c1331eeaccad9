"""Every op under ``torch.autocast`` behaves as the torch code it replaces does under the same autocast:
attention takes q/k/v of mixed dtypes (rotary promotes q/k to fp32 beside a bf16 v) and computes in the
autocast dtype, as sdpa does; the MLP casts x and its weights like ``nn.Linear``; RMSNorm, whose
transformers code autocast leaves alone, keeps torch's promotion. Outputs have the reference's dtype and
stay within the bf16 accuracy rule against the fp32 computation; gradients reach fp32 weights."""

import pytest
import torch
import torch.nn.functional as F

from kernels_neuron.ops.attention import attention_reference, flash_attention
from kernels_neuron.ops.flash_attn_interface import flash_attn_func
from kernels_neuron.ops.mlp import gated_mlp, gated_mlp_reference
from kernels_neuron.ops.rmsnorm import rms_norm, rms_norm_reference

AUTOCAST = [torch.bfloat16, torch.float16]


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", AUTOCAST)
def test_attention_with_mixed_qkv_dtypes_computes_in_the_autocast_dtype_like_sdpa(dtype):
    q, k = _randn(2, 4, 37, 64, seed=1), _randn(2, 2, 37, 64, seed=2)  # fp32, as rotary leaves them
    v = _randn(2, 2, 37, 64, seed=3, dtype=dtype)
    with torch.autocast("cpu", dtype=dtype):
        out = flash_attention(q, k, v, causal=True)
        expected = F.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
        )
    assert out.dtype == expected.dtype == dtype
    exact = attention_reference(q, k, v.float(), causal=True)
    torch_error = (expected.float() - exact).abs().max()
    assert torch_error > 0
    assert (out.float() - exact).abs().max() <= 2 * torch_error


def test_mixed_dtypes_without_autocast_are_still_an_error_as_in_sdpa():
    q, v = _randn(1, 2, 8, 64), _randn(1, 2, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="same dtype"):
        flash_attention(q, q, v)


def test_flash_attn_func_follows_autocast_too():
    q = _randn(1, 16, 2, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = flash_attn_func(q, q, q.bfloat16(), causal=True)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", AUTOCAST)
def test_the_mlp_follows_autocast_like_nn_linear_and_its_fp32_weights_get_gradients(dtype):
    x = _randn(3, 20, 96, seed=1)
    weights = [
        (_randn(160, 96, seed=2) / 10).requires_grad_(),
        (_randn(160, 96, seed=3) / 10).requires_grad_(),
        (_randn(96, 160, seed=4) / 12).requires_grad_(),
    ]
    with torch.autocast("cpu", dtype=dtype):
        out = gated_mlp(x, *weights, "silu")
        expected = gated_mlp_reference(x, *weights, "silu")  # F.linear under autocast: in the autocast dtype
    assert out.dtype == expected.dtype == dtype
    exact = gated_mlp_reference(x, *weights, "silu")
    torch_error = (expected.float() - exact).abs().max()
    assert torch_error > 0
    assert (out.float() - exact).abs().max() <= 2 * torch_error
    grad = _randn(*out.shape, seed=5)
    got = torch.autograd.grad(out, weights, grad.to(dtype))
    want = torch.autograd.grad(expected, weights, grad.to(dtype))
    exact_grads = torch.autograd.grad(exact, weights, grad)
    for g, w, e in zip(got, want, exact_grads):
        assert g.dtype == torch.float32 and w.dtype == torch.float32
        assert (g - e).abs().max() <= 3 * (w - e).abs().max()


@pytest.mark.parametrize("convention", ["llama", "gemma", "fp32_multiply"])
def test_rms_norm_under_autocast_keeps_the_transformers_modules_dtypes(convention):
    """transformers' norms do their math in fp32 explicitly, which autocast leaves alone: a bf16 input
    (from an autocast linear) with an fp32 weight gives what it gives without autocast."""
    x, weight = _randn(5, 128, dtype=torch.bfloat16), _randn(128, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = rms_norm(x, weight, 1e-6, convention)
        expected = rms_norm_reference(x, weight, 1e-6, convention)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
