"""The fused gated MLP (SwiGLU / GeGLU) as a torch op backed by the NKI kernel, with autograd,
and its pure-torch reference.

>>> import torch
>>> from kernels_neuron.ops.mlp import gated_mlp, gated_mlp_reference
>>> x = torch.randn(2, 3, 64)
>>> wg, wu, wd = torch.randn(96, 64) / 8, torch.randn(96, 64) / 8, torch.randn(64, 96) / 10
>>> torch.allclose(gated_mlp(x, wg, wu, wd, "silu"), gated_mlp_reference(x, wg, wu, wd, "silu"), atol=1e-5)
True

What the training forward saves: x and the weights (inputs, no copies) and the gate and up
projections before the activation, in x's dtype (``saved_shape(T, I)``, partition-major). The
backward needs g for act(g) and act'(g) and u for dg; recomputing them would repeat two of the
forward's three GEMMs (a third more backward FLOPs, plus the weight transposes), while saving
them costs one extra [T, 2I] write in the forward and one read in the backward -- what PyTorch's
own autograd keeps for the unfused module. The inference forward saves nothing: the [T, I]
intermediate never leaves the chip.

Low-rank (LoRA) updates: ``gated_mlp(..., updates=)`` adds ``scale * b @ a`` to a weight. An
update inside the nonlinearity (gate, up) cannot be applied after the fused kernel, so each
weight's updates are merged into it first, ``W' = W + sum scale * b @ a`` (in fp32, then cast to
the compute dtype, as PEFT's ``merge_and_unload`` merges). Their gradients follow from the merged
weight's: with ``dW'`` from the kernel's backward, ``da = scale * b^T dW'`` and
``db = scale * dW' a^T``. The merged weights are rebuilt in the backward rather than kept: they are
the size of the weights (3 * H * I per layer), which would otherwise stay alive from each layer's
forward to its backward (and, under FSDP, defeat the freeing of unsharded weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from ._backend import (
    autocast_dtype,
    check_float_tensor,
    check_operands,
    define_op,
    dtype_name,
    nki_source,
    op_namespace,
    run_kernel,
)

_kernels = nki_source(__package__, "mlp")
ACTIVATIONS = _kernels.ACTIVATIONS
MAX_HIDDEN, MAX_HIDDEN_FP32, MAX_INTERMEDIATE = _kernels.MAX_HIDDEN, _kernels.MAX_HIDDEN_FP32, _kernels.MAX_INTERMEDIATE
max_hidden = _kernels.max_hidden
_NS = op_namespace(__name__)
_OP = "gated_mlp"

# transformers' activation classes (module transformers.activations) by what the kernels compute.
# GELUTanh (both its C and Python paths), NewGELU and FastGELU are the same tanh formula; GELUActivation
# is the exact (erf) GELU, through torch's or its own Python formula.
_TRANSFORMERS_ACTIVATIONS = {
    "SiLUActivation": "silu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
    "GELUActivation": "gelu",
}
_DESCRIPTIONS = {"silu": "SiLU", "gelu_tanh": "tanh-approximated GELU", "gelu": "exact erf GELU", "relu": "ReLU"}


def _activation_name(act: object) -> str | None:
    """What ``act`` computes, as a kernel activation name, or None. Matches classes exactly, so a
    subclass that changes the function is never taken for its parent."""
    cls = type(act)
    if cls.__module__ == "transformers.activations" and cls.__name__ in _TRANSFORMERS_ACTIVATIONS:
        return _TRANSFORMERS_ACTIVATIONS[cls.__name__]
    if cls is nn.SiLU or act is F.silu:
        return "silu"
    if cls is nn.GELU and isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if cls is nn.ReLU or act is F.relu:
        return "relu"
    return "gelu" if act is F.gelu else None


def activation_kind(act: object, supported: Sequence[str] = ACTIVATIONS) -> str | None:
    """The kernel's name for an MLP's activation module ("silu", "gelu_tanh", "gelu", "relu") when it is
    one of ``supported`` (the gated kernel's by default), else None (an activation no kernel
    implements, such as QuickGELU, or one this kernel does not, such as exact GELU in a gated MLP)."""
    kind = _activation_name(act)
    return kind if kind in supported else None


def describe_activation(act: object, supported: Sequence[str] = ACTIVATIONS) -> str:
    """Why an activation is refused, for kernelize's report."""
    name = getattr(act, "__name__", None) or type(act).__name__
    kind = _activation_name(act)
    detail = f" ({_DESCRIPTIONS[kind]})" if kind is not None and _DESCRIPTIONS[kind] != name else ""
    implemented = ", ".join(_DESCRIPTIONS[k] for k in supported)
    return f"activation {name}{detail} is not one the kernel implements ({implemented})"


def _check_shapes(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor | None, w_down: torch.Tensor, activation: str
) -> None:
    _kernels.check_shapes(
        tuple(x.shape),
        tuple(w_gate.shape),
        None if w_up is None else tuple(w_up.shape),
        tuple(w_down.shape),
        activation,
        [dtype_name(x.dtype)],
    )


def validate(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor | None, w_down: torch.Tensor, activation: str
) -> None:
    """Raise a clear error (op, shape, limit) for anything the kernel cannot take."""
    named = [("x", x), ("gate weight" if w_up is not None else "gate_up weight", w_gate), ("down weight", w_down)]
    if w_up is not None:
        named.insert(2, ("up weight", w_up))
    check_operands(_OP, named, "x and the weights")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_OP}: activation {activation!r} is not one of {ACTIVATIONS}")
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"{_OP}: x of shape {tuple(x.shape)} is empty (no tokens)")
    _check_shapes(x.reshape(-1, x.shape[-1]), w_gate, w_up, w_down, activation)


def _saved_shape(x: torch.Tensor, w_down: torch.Tensor) -> tuple[int, ...]:
    return tuple(_kernels.saved_shape(x.shape[0], w_down.shape[1]))


@define_op(f"{_NS}::mlp_fwd")
def mlp_fwd(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    activation: str,
    save_for_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] forward: (y, saved). ``saved`` holds the gate/up projections when
    ``save_for_backward``, else it is empty and nothing [T, I]-sized is written."""
    validate(x, w_gate, w_up, w_down, activation)
    if save_for_backward:
        return run_kernel(_kernels.mlp_fwd, x, w_gate, w_up, w_down, activation, True)
    return run_kernel(_kernels.mlp_fwd, x, w_gate, w_up, w_down, activation, False), x.new_empty((0,))


@mlp_fwd.register_fake
def _(x, w_gate, w_up, w_down, activation, save_for_backward):
    validate(x, w_gate, w_up, w_down, activation)
    saved = x.new_empty(_saved_shape(x, w_down)) if save_for_backward else x.new_empty((0,))
    return x.new_empty(x.shape), saved


@define_op(f"{_NS}::mlp_bwd")
def mlp_bwd(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    saved: torch.Tensor,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d w_gate, d w_up, d w_down); d w_up is empty for a fused gate_up weight, whose
    gradient (both halves) is d w_gate."""
    grads = run_kernel(_kernels.mlp_bwd, grad_out.contiguous(), x, w_gate, w_up, w_down, saved, activation)
    if w_up is None:
        dx, dw_gate_up, dw_down = grads
        return dx, dw_gate_up, x.new_empty((0,)), dw_down
    return grads


@mlp_bwd.register_fake
def _(grad_out, x, w_gate, w_up, w_down, saved, activation):
    dw_up = x.new_empty((0,)) if w_up is None else torch.empty_like(w_up)
    return torch.empty_like(x), torch.empty_like(w_gate), dw_up, torch.empty_like(w_down)


def _setup_context(ctx, inputs, output):
    x, w_gate, w_up, w_down, activation, save_for_backward = inputs
    ctx.save_for_backward(x, w_gate, w_up, w_down, output[1])
    ctx.activation, ctx.saved_gate_up, ctx.fused = activation, save_for_backward, w_up is None


def _backward(ctx, grad_out, _grad_saved):
    if not ctx.saved_gate_up:
        raise RuntimeError(
            f"{_OP}: mlp_fwd ran with save_for_backward=False, so it kept nothing to "
            "differentiate; call gated_mlp (which saves when gradients are needed)"
        )
    x, w_gate, w_up, w_down, saved = ctx.saved_tensors
    dx, dw_gate, dw_up, dw_down = mlp_bwd(
        grad_out, x, w_gate, None if ctx.fused else w_up, w_down, saved, ctx.activation
    )
    return dx, dw_gate, None if ctx.fused else dw_up, dw_down, None, None


torch.library.register_autograd(f"{_NS}::mlp_fwd", _backward, setup_context=_setup_context)


class LowRankUpdate(NamedTuple):
    """``scale * b @ a`` added to a weight ``[out, in]``: a LoRA adapter's ``lora_A.weight`` (``a``,
    ``[r, in]``), ``lora_B.weight`` (``b``, ``[out, r]``) and scaling."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


def _merge(weight: torch.Tensor, updates: Sequence[LowRankUpdate], dtype: torch.dtype) -> torch.Tensor:
    if not updates:
        return weight.to(dtype)
    merged = weight.float()
    for update in updates:
        merged = torch.addmm(merged, update.b.float(), update.a.float(), alpha=update.scale)
    return merged.to(dtype)


class _GatedMLPWithUpdates(torch.autograd.Function):
    """The fused MLP over merged weights, rebuilt in the backward instead of saved (module docstring).
    ``owners[i]`` is the weight (0 gate, 1 up, 2 down) that update ``i`` belongs to; ``factors``
    holds each update's ``a`` and ``b``."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, activation, owners, scales, *factors):
        weights = (w_gate, w_up, w_down)
        merged = _merged_weights(weights, owners, scales, factors, x.dtype)
        out, saved = mlp_fwd(x, *merged, activation, True)
        ctx.save_for_backward(x, w_gate, w_up, w_down, saved, *factors)
        ctx.activation, ctx.owners, ctx.scales = activation, owners, scales
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w_gate, w_up, w_down, saved, *factors = ctx.saved_tensors
        weights = (w_gate, w_up, w_down)
        merged = _merged_weights(weights, ctx.owners, ctx.scales, factors, x.dtype)
        dx, dw_gate, dw_up, dw_down = mlp_bwd(grad_out, x, *merged, saved, ctx.activation)
        d_merged = (dw_gate, dw_up, dw_down)
        d_factors = []
        for owner, scale, a, b in zip(ctx.owners, ctx.scales, factors[0::2], factors[1::2]):
            d_weight = d_merged[owner].float()
            d_factors += [
                (scale * (b.float().t() @ d_weight)).to(a.dtype),
                (scale * (d_weight @ a.float().t())).to(b.dtype),
            ]
        d_weights = [
            None if w is None or not needed else d.to(w.dtype)
            for w, d, needed in zip(weights, d_merged, ctx.needs_input_grad[1:4])
        ]
        return (dx, *d_weights, None, None, None, *d_factors)


def _merged_weights(weights, owners, scales, factors, dtype):
    return tuple(
        None
        if w is None
        else _merge(
            w,
            [
                LowRankUpdate(a, b, scale)
                for o, scale, a, b in zip(owners, scales, factors[0::2], factors[1::2])
                if o == i
            ],
            dtype,
        )
        for i, w in enumerate(weights)
    )


def gated_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    activation: str = "silu",
    updates: Sequence[Sequence[LowRankUpdate]] | None = None,
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` over the last dim of ``x`` (any leading shape) with the NKI kernel.

    Weights in the ``nn.Linear`` layout: ``w_gate``/``w_up`` [I, H], ``w_down`` [H, I]; or Phi3's
    fused gate_up weight [2I, H] (gate rows first) as ``w_gate`` with ``w_up=None``.
    ``activation``: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with the tanh-approximated GELU).
    x may be non-contiguous (it is copied); the weights must be contiguous (a copy per call would
    cost a full weight read and write, so it is refused rather than hidden). Under ``torch.autocast``
    x and the weights are cast to the autocast dtype, as ``nn.Linear`` casts them.
    ``updates``: per weight (gate, up, down; up's is empty for a fused gate_up weight) the
    ``LowRankUpdate``s added to it, e.g. LoRA adapters; they are merged into the weights in x's
    (compute) dtype, and receive gradients.
    """
    if isinstance(x, torch.Tensor):
        x = x.contiguous()
        dtype = autocast_dtype(x)
        if dtype is not None:
            x = x.to(dtype)
            if not updates or not any(updates):
                w_gate, w_down = w_gate.to(dtype), w_down.to(dtype)
                w_up = None if w_up is None else w_up.to(dtype)
    if updates and any(updates):
        return _gated_mlp_with_updates(x, w_gate, w_up, w_down, activation, updates)
    validate(x, w_gate, w_up, w_down, activation)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w_gate, w_up, w_down))
    out, _ = mlp_fwd(x.reshape(-1, x.shape[-1]), w_gate, w_up, w_down, activation, needs_grad)
    return out.reshape(x.shape)


def _gated_mlp_with_updates(x, w_gate, w_up, w_down, activation, updates) -> torch.Tensor:
    if len(updates) != 3:
        raise ValueError(
            f"{_OP}: updates must list the updates of the gate, up and down weights (3 lists), got {len(updates)}"
        )
    if w_up is None and updates[1]:
        raise ValueError(f"{_OP}: a fused gate_up weight takes its updates in the gate list, not the up list")
    owners, scales, factors = [], [], []
    for owner, (weight, weight_updates) in enumerate(zip((w_gate, w_up, w_down), updates)):
        for update in weight_updates:
            if weight is not None and (update.b.shape[0], update.a.shape[1]) != tuple(weight.shape):
                raise ValueError(
                    f"{_OP}: a low-rank update b {tuple(update.b.shape)} @ a {tuple(update.a.shape)} "
                    f"does not match the {('gate', 'up', 'down')[owner]} weight {tuple(weight.shape)}"
                )
            owners.append(owner)
            scales.append(float(update.scale))
            factors += [update.a, update.b]
    check_float_tensor(_OP, "x", x)
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"{_OP}: x of shape {tuple(x.shape)} is empty (no tokens)")
    rows = x.reshape(-1, x.shape[-1])
    # mlp_fwd validates the merged weights (shapes, limits, dtypes)
    if not (
        torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w_gate, w_up, w_down, *factors))
    ):
        merged = _merged_weights((w_gate, w_up, w_down), owners, scales, factors, x.dtype)
        return mlp_fwd(rows, *merged, activation, False)[0].reshape(x.shape)  # nothing kept for a backward
    out = _GatedMLPWithUpdates.apply(rows, w_gate, w_up, w_down, activation, tuple(owners), tuple(scales), *factors)
    return out.reshape(x.shape)


def gated_mlp_reference(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    activation: str = "silu",
    updates: Sequence[Sequence[LowRankUpdate]] | None = None,
) -> torch.Tensor:
    """Pure torch, the same computation as transformers' LlamaMLP (and Phi3MLP for a fused weight), with
    each low-rank update applied as PEFT's LoRA layer applies it: ``linear(x, W) + scale * b(a(x))``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated_mlp_reference: activation {activation!r} is not one of {ACTIVATIONS}")
    act = F.silu if activation == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    gate_updates, up_updates, down_updates = updates or ((), (), ())

    def project(t, weight, weight_updates):
        out = F.linear(t, weight)
        for update in weight_updates:
            out = out + update.scale * F.linear(F.linear(t, update.a), update.b)
        return out

    if w_up is None:
        gate, up = project(x, w_gate, gate_updates).chunk(2, dim=-1)
    else:
        gate, up = project(x, w_gate, gate_updates), project(x, w_up, up_updates)
    return project(act(gate) * up, w_down, down_updates)
