"""LayerNorm as a torch op backed by the NKI kernel, with autograd, and its pure-torch reference.

>>> import torch
>>> from kernels_neuron.ops.layernorm import layer_norm, layer_norm_reference
>>> x, w, b = torch.randn(2, 5, 48), torch.randn(48), torch.randn(48)
>>> torch.allclose(layer_norm(x, w, b, 1e-5), layer_norm_reference(x, w, b, 1e-5), atol=1e-5)
True
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ._backend import check_float_tensor, define_op, dtype_name, nki_source, op_namespace, run_kernel

_kernels = nki_source(__package__, "layernorm")
MIN_HIDDEN, MAX_HIDDEN = _kernels.MIN_HIDDEN, _kernels.MAX_HIDDEN
# A search over the SBUF plan, asked several times per call (layer, op, fake): once per dtype combination.
max_hidden = functools.cache(_kernels.max_hidden)
_NS = op_namespace(__name__)


def hidden_limit(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> int:
    """The largest hidden size the kernels take with these tensors' dtypes, on every Trainium target."""
    return max_hidden(*(None if t is None else dtype_name(t.dtype) for t in (x, weight, bias)))


def validate(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    """Raise a clear error (op, argument, value, limit) for anything the kernel cannot take."""
    check_float_tensor("layer_norm", "x", x)
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"layer_norm: x of shape {tuple(x.shape)} is empty")
    hidden = x.shape[-1]
    limit = hidden_limit(x, weight, bias)
    if not MIN_HIDDEN <= hidden <= limit:
        dtypes = ", ".join(f"{n} {t.dtype}" for n, t in (("x", x), ("weight", weight), ("bias", bias)) if t is not None)
        raise ValueError(
            f"layer_norm: hidden size {hidden} is outside the supported range {MIN_HIDDEN}..{limit} for {dtypes} "
            "(what the kernels hold in SBUF on every Trainium target)"
        )
    for name, vector in (("weight", weight), ("bias", bias)):
        if vector is None:
            continue
        check_float_tensor("layer_norm", name, vector)
        if vector.dim() != 1 or vector.shape[0] != hidden:
            raise ValueError(
                f"layer_norm: {name} of shape {tuple(vector.shape)} does not match hidden size {hidden} of x"
            )
        if vector.device != x.device:
            raise ValueError(f"layer_norm: x is on {x.device} but {name} is on {vector.device}")


@define_op(f"{_NS}::layernorm_fwd")
def layernorm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, H] forward: (out in x's dtype, mean [N, 1] fp32, rstd [N, 1] fp32)."""
    validate(x, weight, bias)
    return run_kernel(_kernels.layernorm_fwd, x, weight, bias, float(eps))


@layernorm_fwd.register_fake
def _(x, weight, bias, eps):
    validate(x, weight, bias)
    column = x.new_empty((x.shape[0], 1), dtype=torch.float32)
    return torch.empty_like(x), column, torch.empty_like(column)


@define_op(f"{_NS}::layernorm_bwd")
def layernorm_bwd(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, H] backward: (dx in x's dtype, dweight fp32, dbias fp32)."""
    return run_kernel(_kernels.layernorm_bwd, grad_out.contiguous().to(x.dtype), x, weight, mean, rstd)


@layernorm_bwd.register_fake
def _(grad_out, x, weight, mean, rstd):
    hidden = x.shape[-1]
    return torch.empty_like(x), x.new_empty((hidden,), dtype=torch.float32), x.new_empty((hidden,), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)


def _backward(ctx, grad_out, _grad_mean, _grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = layernorm_bwd(grad_out, x, weight, mean, rstd)
    weight_dtype, bias_dtype = ctx.dtypes
    return (
        dx,
        None if weight_dtype is None else dweight.to(weight_dtype),
        None if bias_dtype is None else dbias.to(bias_dtype),
        None,
    )


torch.library.register_autograd(f"{_NS}::layernorm_fwd", _backward, setup_context=_setup_context)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dim of ``x`` (any leading shape) with the NKI kernel: what
    ``torch.nn.functional.layer_norm(x, (H,), weight, bias, eps)`` computes, in fp32 and rounded once to
    x's dtype. ``weight`` and ``bias`` are optional and may have another float dtype than ``x``."""
    validate(x, weight, bias)
    out, _, _ = layernorm_fwd(x.reshape(-1, x.shape[-1]), weight, bias, eps)
    return out.reshape(x.shape)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """Pure torch, what ``torch.nn.LayerNorm`` (and Cohere's LayerNorm, without a bias) computes."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


__all__ = ["hidden_limit", "layer_norm", "layer_norm_reference", "layernorm_bwd", "layernorm_fwd"]
