"""The fused plain MLP ``down(act(up(x)))``, with or without biases, as a torch op backed by the NKI
kernel, with autograd, and its pure-torch reference.

>>> import torch
>>> from kernels_neuron.ops.plain_mlp import plain_mlp, plain_mlp_reference
>>> x = torch.randn(2, 3, 64)
>>> wu, wd = torch.randn(96, 64) / 8, torch.randn(64, 96) / 10
>>> bu, bd = torch.randn(96) / 10, torch.randn(64) / 10
>>> y = plain_mlp(x, wu, wd, bu, bd, "gelu")
>>> torch.allclose(y, plain_mlp_reference(x, wu, wd, bu, bd, "gelu"), atol=1e-5)
True

The math and its gradient (u = x Wu^T + bu, a = act(u), y = a Wd^T + bd):
``da = dy Wd``, ``du = da * act'(u)``, ``dx = du Wu``, ``dWd = dy^T a``, ``dWu = du^T x``,
``dbu = sum_t du``, ``dbd = sum_t dy``.

What the training forward saves: x and the weights (inputs, no copies) and u, the up projection
with its bias, before the activation, in x's dtype (``saved_shape(T, I, 1)``): the backward needs
act(u) for dWd and act'(u) for du; recomputing u would repeat one of the forward's two GEMMs and its
weight transposes. The inference forward saves nothing: the [T, I] intermediate never leaves the chip.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ._backend import autocast_dtype, check_operands, define_op, dtype_name, nki_source, op_namespace, run_kernel

_kernels = nki_source(__package__, "mlp")
PLAIN_ACTIVATIONS = _kernels.PLAIN_ACTIVATIONS
_NS = op_namespace(__name__)
_OP = "plain_mlp"


def validate(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    b_up: torch.Tensor | None,
    b_down: torch.Tensor | None,
    activation: str,
) -> None:
    """Raise a clear error (op, argument, value, limit) for anything the kernel cannot take."""
    named = [("x", x), ("up weight", w_up), ("down weight", w_down)]
    named += [(name, b) for name, b in (("up bias", b_up), ("down bias", b_down)) if b is not None]
    check_operands(_OP, named, "x, the weights and the biases")
    if activation not in PLAIN_ACTIVATIONS:
        raise ValueError(f"{_OP}: activation {activation!r} is not one of {PLAIN_ACTIVATIONS}")
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"{_OP}: x of shape {tuple(x.shape)} is empty (no tokens)")
    _kernels.check_plain_shapes(
        (x.numel() // x.shape[-1], x.shape[-1]),
        tuple(w_up.shape),
        tuple(w_down.shape),
        None if b_up is None else tuple(b_up.shape),
        None if b_down is None else tuple(b_down.shape),
        activation,
        [dtype_name(x.dtype)],
    )


@define_op(f"{_NS}::plain_mlp_fwd")
def plain_mlp_fwd(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    b_up: torch.Tensor | None,
    b_down: torch.Tensor | None,
    activation: str,
    save_for_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] forward: (y, saved). ``saved`` holds the up projection (with its bias) when
    ``save_for_backward``, else it is empty and nothing [T, I]-sized is written."""
    validate(x, w_up, w_down, b_up, b_down, activation)
    if save_for_backward:
        return run_kernel(_kernels.plain_mlp_fwd, x, w_up, w_down, b_up, b_down, activation, True)
    return run_kernel(_kernels.plain_mlp_fwd, x, w_up, w_down, b_up, b_down, activation, False), x.new_empty((0,))


@plain_mlp_fwd.register_fake
def _(x, w_up, w_down, b_up, b_down, activation, save_for_backward):
    validate(x, w_up, w_down, b_up, b_down, activation)
    saved_shape = tuple(_kernels.saved_shape(x.shape[0], w_up.shape[0], 1))
    return x.new_empty(x.shape), x.new_empty(saved_shape if save_for_backward else (0,))


@define_op(f"{_NS}::plain_mlp_bwd")
def plain_mlp_bwd(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    saved: torch.Tensor,
    activation: str,
    with_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d w_up, d w_down, d b_up, d b_down); the bias gradients are empty without ``with_bias``."""
    grads = run_kernel(_kernels.plain_mlp_bwd, grad_out.contiguous(), x, w_up, w_down, saved, activation, with_bias)
    if with_bias:
        return grads
    return (*grads, x.new_empty((0,)), x.new_empty((0,)))


@plain_mlp_bwd.register_fake
def _(grad_out, x, w_up, w_down, saved, activation, with_bias):
    biases = (x.new_empty((w_up.shape[0],)), x.new_empty((w_down.shape[0],))) if with_bias else (x.new_empty((0,)),) * 2
    return torch.empty_like(x), torch.empty_like(w_up), torch.empty_like(w_down), *biases


def _setup_context(ctx, inputs, output):
    x, w_up, w_down, b_up, b_down, activation, save_for_backward = inputs
    ctx.save_for_backward(x, w_up, w_down, output[1])
    ctx.activation, ctx.saved_up, ctx.with_bias = activation, save_for_backward, b_up is not None


def _backward(ctx, grad_out, _grad_saved):
    if not ctx.saved_up:
        raise RuntimeError(
            f"{_OP}: plain_mlp_fwd ran with save_for_backward=False, so it kept nothing to "
            "differentiate; call plain_mlp (which saves when gradients are needed)"
        )
    x, w_up, w_down, saved = ctx.saved_tensors
    dx, dw_up, dw_down, db_up, db_down = plain_mlp_bwd(grad_out, x, w_up, w_down, saved, ctx.activation, ctx.with_bias)
    if not ctx.with_bias:
        db_up = db_down = None
    return dx, dw_up, dw_down, db_up, db_down, None, None


torch.library.register_autograd(f"{_NS}::plain_mlp_fwd", _backward, setup_context=_setup_context)


def plain_mlp(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: str = "gelu",
) -> torch.Tensor:
    """``down(act(up(x)))`` over the last dim of ``x`` (any leading shape) with the NKI kernel.

    Weights in the ``nn.Linear`` layout: ``w_up`` [I, H], ``w_down`` [H, I]; biases ``b_up`` [I] and
    ``b_down`` [H], both or neither. ``activation``: "gelu" (exact, erf), "gelu_tanh", "relu" or
    "silu". x may be non-contiguous (it is copied); the weights and biases must be contiguous. Under
    ``torch.autocast`` x, the weights and the biases are cast to the autocast dtype, as ``nn.Linear``
    casts them.
    """
    if isinstance(x, torch.Tensor):
        x = x.contiguous()
        dtype = autocast_dtype(x)
        if dtype is not None:
            x, w_up, w_down = x.to(dtype), w_up.to(dtype), w_down.to(dtype)
            b_up = None if b_up is None else b_up.to(dtype)
            b_down = None if b_down is None else b_down.to(dtype)
    validate(x, w_up, w_down, b_up, b_down, activation)
    tensors = (x, w_up, w_down, b_up, b_down)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    out, _ = plain_mlp_fwd(x.reshape(-1, x.shape[-1]), w_up, w_down, b_up, b_down, activation, needs_grad)
    return out.reshape(x.shape)


_TORCH_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def plain_mlp_reference(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: str = "gelu",
) -> torch.Tensor:
    """Pure torch, the same computation as transformers' Starcoder2MLP, GPTNeoXMLP, FalconMLP, GPT2MLP
    and PhiMLP (without their dropout): ``linear(act(linear(x, Wu, bu)), Wd, bd)``."""
    if activation not in PLAIN_ACTIVATIONS:
        raise ValueError(f"plain_mlp_reference: activation {activation!r} is not one of {PLAIN_ACTIVATIONS}")
    return F.linear(_TORCH_ACTIVATIONS[activation](F.linear(x, w_up, b_up)), w_down, b_down)
