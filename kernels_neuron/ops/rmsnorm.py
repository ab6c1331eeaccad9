"""RMSNorm as a torch op backed by the NKI kernel, with autograd, and its pure-torch reference.

>>> import torch
>>> from kernels_neuron.ops.rmsnorm import rms_norm, rms_norm_reference
>>> x, w = torch.randn(2, 5, 64), torch.ones(64)
>>> torch.allclose(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), atol=1e-6)
True
"""

from __future__ import annotations

import torch

from ._backend import check_float_tensor, define_op, dtype_name, nki_source, op_namespace, run_kernel

_kernels = nki_source(__package__, "rmsnorm")
CONVENTIONS = _kernels.CONVENTIONS
MIN_HIDDEN, MAX_HIDDEN = _kernels.MIN_HIDDEN, _kernels.MAX_HIDDEN
_NS = op_namespace(__name__)


def _output_dtype(x: torch.Tensor, weight: torch.Tensor, convention: str) -> torch.dtype:
    # Llama multiplies weight * normed.to(x.dtype), so torch's promotion picks the result dtype.
    return torch.promote_types(x.dtype, weight.dtype) if convention == "llama" else x.dtype


def validate(x: torch.Tensor, weight: torch.Tensor, convention: str) -> None:
    """Raise a clear error (op, shape, limit) for anything the kernel cannot take."""
    check_float_tensor("rms_norm", "x", x)
    check_float_tensor("rms_norm", "weight", weight)
    if convention not in CONVENTIONS:
        raise ValueError(f"rms_norm: convention {convention!r} is not one of {CONVENTIONS}")
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"rms_norm: x of shape {tuple(x.shape)} is empty")
    hidden = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != hidden:
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} does not match hidden size {hidden} of x")
    if not MIN_HIDDEN <= hidden <= MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden size {hidden} is outside the supported range {MIN_HIDDEN}..{MAX_HIDDEN}")
    if x.device != weight.device:
        raise ValueError(f"rms_norm: x is on {x.device} but weight is on {weight.device}")


@define_op(f"{_NS}::rmsnorm_fwd")
def rmsnorm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, convention: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, H] forward: (out, rstd [N, 1] fp32)."""
    validate(x, weight, convention)
    return run_kernel(
        _kernels.rmsnorm_fwd, x, weight, float(eps), convention, dtype_name(_output_dtype(x, weight, convention))
    )


@rmsnorm_fwd.register_fake
def _(x, weight, eps, convention):
    validate(x, weight, convention)
    out = x.new_empty(x.shape, dtype=_output_dtype(x, weight, convention))
    return out, x.new_empty((x.shape[0], 1), dtype=torch.float32)


@define_op(f"{_NS}::rmsnorm_bwd")
def rmsnorm_bwd(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, convention: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, H] backward: (dx in x's dtype, dweight fp32)."""
    return run_kernel(_kernels.rmsnorm_bwd, grad_out.contiguous(), x, weight, rstd, convention)


@rmsnorm_bwd.register_fake
def _(grad_out, x, weight, rstd, convention):
    return torch.empty_like(x), weight.new_empty(weight.shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, _, convention = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.convention = convention


def _backward(ctx, grad_out, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = rmsnorm_bwd(grad_out, x, weight, rstd, ctx.convention)
    return dx, dweight.to(weight.dtype), None, None


torch.library.register_autograd(f"{_NS}::rmsnorm_fwd", _backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, convention: str = "llama") -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape) with the NKI kernel.

    ``convention`` picks the transformers numerics: "llama" (normalise in fp32, cast, then
    scale), "gemma" (``1 + weight`` in fp32) or "fp32_multiply" (OLMo2: scale in fp32, then cast).
    """
    validate(x, weight, convention)
    out, _ = rmsnorm_fwd(x.reshape(-1, x.shape[-1]), weight, eps, convention)
    return out.reshape(x.shape)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, convention: str = "llama") -> torch.Tensor:
    """Pure torch, the same computation as the transformers modules for each convention."""
    hidden = x.to(torch.float32)
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    if convention == "llama":
        return weight * normed.to(x.dtype)
    if convention == "gemma":
        return (normed * (1.0 + weight.float())).type_as(x)
    if convention == "fp32_multiply":
        return (weight * normed).to(x.dtype)
    raise ValueError(f"rms_norm_reference: convention {convention!r} is not one of {CONVENTIONS}")
