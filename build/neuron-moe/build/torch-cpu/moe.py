"""MoE experts (every routed expert's gated MLP in one launch) as a torch op backed by the NKI kernel,
with autograd, and its pure-torch reference.

>>> import torch
>>> from kernels_neuron.ops.moe import moe_experts, moe_experts_reference
>>> x = torch.randn(5, 64)
>>> w_gate_up, w_down = torch.randn(4, 2 * 96, 64) / 8, torch.randn(4, 64, 96) / 10
>>> index = torch.tensor([[0, 1], [1, 3], [3, 0], [1, 0], [0, 3]])
>>> weights = torch.rand(5, 2)
>>> expected = moe_experts_reference(x, index, weights, w_gate_up, w_down, "silu")
>>> torch.allclose(moe_experts(x, index, weights, w_gate_up, w_down, "silu"), expected, atol=1e-5)
True

The router (softmax, top-k, any renormalisation or scaling) stays in torch: the op takes what
transformers' experts modules take, the chosen experts ``top_k_index`` [T, k] and their weights
``top_k_weights`` [T, k]. It builds the kernel's block layout from them (:func:`routing_layout`: the
choices sorted by expert, each expert's group cut into blocks), a few [T*k]-sized index operations.

Backward: ``moe_bwd`` is one grouped NKI launch too (``nki_src/moe.py`` ``moe_bwd``), on a block
layout of the backward kernel's own block size (``routing_layout(..., backward=True)``): per block of
an expert's routed tokens it recomputes the gate/up projections (the grouped forward saves nothing),
and forms dx (scattered back to the tokens' choices, summed per token), the expert's weight gradients
(summed over its blocks; zero for an expert no token picks) and the routing weights' gradient
``dy . y_e`` per choice, with the expert's output gradient ``w * dy`` (w the choice's routing weight).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
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

_kernels = nki_source(__package__, "moe")
ACTIVATIONS = _kernels.ACTIVATIONS
MAX_HIDDEN, MAX_HIDDEN_FP32, MAX_INTERMEDIATE = _kernels.MAX_HIDDEN, _kernels.MAX_HIDDEN_FP32, _kernels.MAX_INTERMEDIATE
max_hidden = _kernels.max_hidden
_NS = op_namespace(__name__)
_OP = "moe_experts"


class RoutingLayout(NamedTuple):
    """The kernels' block layout of one routing (``nki_src/moe.py``): per block slot (expert, used token
    tiles, used, starts: the expert's first block, continues: a later one, and where the forward's runs
    of 4 and of 2 token tiles end: ``run_ends``), and per slot the token, the choice (t*k + j) and the
    routing weight; padding slots point past the end (token T, choice T*k) and weigh 0. ``counts[e]`` is
    expert e's number of choices."""

    block_info: torch.Tensor
    slot_token: torch.Tensor
    slot_row: torch.Tensor
    slot_weight: torch.Tensor
    counts: torch.Tensor

    @property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The four tables the kernels take, in their argument order."""
        return self.block_info, self.slot_token, self.slot_row, self.slot_weight


def routing_layout(
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    experts: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    backward: bool = False,
) -> RoutingLayout:
    """Sort the T*k choices by expert and lay each expert's group out in blocks of the forward kernel's
    size, or with ``backward`` the backward kernel's (``nki_src/moe.py``).

    A choice of an expert outside 0..E-1 (transformers' expert-parallel marker E) is given to expert 0
    with weight 0, so it adds nothing (the module skips it)."""
    tokens, top_k = top_k_index.shape
    shape = _kernels.backward_routing_shape if backward else _kernels.routing_shape
    tile, block, num_blocks = shape(tokens, top_k, experts, hidden, inter, dtype_name(dtype))
    device = top_k_index.device
    expert = top_k_index.reshape(-1).long()
    weight = top_k_weights.reshape(-1).float()
    masked = (expert < 0) | (expert >= experts)
    expert = torch.where(masked, 0, expert)
    weight = torch.where(masked, 0.0, weight)
    counts = torch.bincount(expert, minlength=experts)
    order = torch.argsort(expert, stable=True)
    blocks = (counts + block - 1) // block
    first_block = torch.cumsum(blocks, 0) - blocks
    group_start = torch.cumsum(counts, 0) - counts
    sorted_expert = expert[order]
    rank = torch.arange(order.numel(), device=device) - group_start[sorted_expert]
    slot = (first_block[sorted_expert] + rank // block) * block + rank % block
    slots = num_blocks * block
    slot_token = torch.full((slots,), tokens, dtype=torch.int32, device=device)
    slot_row = torch.full((slots,), tokens * top_k, dtype=torch.int32, device=device)
    slot_weight = torch.zeros(slots, dtype=torch.float32, device=device)
    slot_token[slot] = (order // top_k).to(torch.int32)
    slot_row[slot] = order.to(torch.int32)
    slot_weight[slot] = weight[order]
    used = int(blocks.sum())
    block_expert = torch.repeat_interleave(torch.arange(experts, device=device), blocks)
    in_block = torch.clamp(
        counts[block_expert] - (torch.arange(used, device=device) - first_block[block_expert]) * block, max=block
    )
    block_info = torch.zeros((num_blocks, _kernels.BLOCK_FIELDS), dtype=torch.int32, device=device)
    used_tiles = (in_block + tile - 1) // tile
    block_info[:used, 0] = block_expert.to(torch.int32)
    block_info[:used, 1] = used_tiles.to(torch.int32)
    block_info[:used, 2] = 1
    starts = torch.arange(used, device=device) == first_block[block_expert]
    block_info[:used, 3] = starts.to(torch.int32)
    block_info[:used, 4] = (~starts).to(torch.int32)
    for field, end in zip(_kernels.RUN_END_FIELDS, _kernels.run_ends(used_tiles)):
        block_info[:used, field] = end.to(torch.int32)
    return RoutingLayout(block_info, slot_token[:, None], slot_row[:, None], slot_weight[:, None], counts)


def validate(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
) -> None:
    """Raise a clear error (op, argument, value, limit) for anything the kernel cannot take."""
    check_operands(_OP, [("x", x), ("gate_up weight", w_gate_up), ("down weight", w_down)], "x and the weights")
    check_float_tensor(_OP, "top_k_weights", top_k_weights, contiguous=False)
    if top_k_index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{_OP}: top_k_index has dtype {top_k_index.dtype}; expected int64 or int32")
    if x.dim() != 2 or x.shape[0] == 0:
        raise ValueError(f"{_OP}: x must be [tokens >= 1, hidden], got shape {tuple(x.shape)}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0] or top_k_index.shape[1] < 1:
        raise ValueError(
            f"{_OP}: top_k_index of shape {tuple(top_k_index.shape)} is not [{x.shape[0]}, k >= 1] (x {tuple(x.shape)})"
        )
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(
            f"{_OP}: top_k_weights of shape {tuple(top_k_weights.shape)} does not match top_k_index "
            f"{tuple(top_k_index.shape)}"
        )
    devices = {t.device for t in (x, top_k_index, top_k_weights, w_gate_up, w_down)}  # the routing too
    if len(devices) != 1:
        raise ValueError(f"{_OP}: the inputs are on different devices: {sorted(map(str, devices))}")
    _kernels.check_shapes(
        tuple(x.shape), tuple(w_gate_up.shape), tuple(w_down.shape), activation, [dtype_name(x.dtype)]
    )


@define_op(f"{_NS}::moe_fwd")
def moe_fwd(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """[T, H] forward: every token's k chosen experts, weighted and summed."""
    validate(x, top_k_index, top_k_weights, w_gate_up, w_down, activation)
    experts, hidden, inter = w_down.shape
    layout = routing_layout(top_k_index, top_k_weights, experts, hidden, inter, x.dtype)
    return run_kernel(
        _kernels.moe_fwd,
        x,
        w_gate_up,
        w_down,
        *layout.tables,
        top_k_index.shape[1],
        activation,
    )


@moe_fwd.register_fake
def _(x, top_k_index, top_k_weights, w_gate_up, w_down, activation):
    validate(x, top_k_index, top_k_weights, w_gate_up, w_down, activation)
    return x.new_empty(x.shape)


@define_op(f"{_NS}::moe_bwd")
def moe_bwd(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d top_k_weights, d w_gate_up, d w_down), every routed expert in one grouped NKI launch.

    With y_e the expert's output for a choice (t, j) of weight w: out[t] += w * y_e, so
    d w = dy[t] . y_e, and the expert's MLP sees the output gradient w * dy[t] (module docstring).
    A masked choice (expert outside 0..E-1) gets no gradient, as the module skips it."""
    validate(x, top_k_index, top_k_weights, w_gate_up, w_down, activation)
    check_float_tensor(_OP, "grad_out", grad_out, contiguous=False)
    tokens, top_k = top_k_index.shape
    experts, hidden, inter = w_down.shape
    layout = routing_layout(top_k_index, top_k_weights, experts, hidden, inter, x.dtype, backward=True)
    idle = (layout.counts == 0).to(torch.int32)[:, None]
    dx, d_weight, dw_gate_up, dw_down = run_kernel(
        _kernels.moe_bwd,
        grad_out.contiguous(),
        x,
        w_gate_up,
        w_down,
        *layout.tables,
        idle,
        top_k,
        activation,
    )
    masked = (top_k_index < 0) | (top_k_index >= experts)
    d_weight = torch.where(masked, 0.0, d_weight.reshape(tokens, top_k))
    return dx, d_weight.to(top_k_weights.dtype), dw_gate_up, dw_down


@moe_bwd.register_fake
def _(grad_out, x, top_k_index, top_k_weights, w_gate_up, w_down, activation):
    return torch.empty_like(x), torch.empty_like(top_k_weights), torch.empty_like(w_gate_up), torch.empty_like(w_down)


def _setup_context(ctx, inputs, output):
    x, top_k_index, top_k_weights, w_gate_up, w_down, activation = inputs
    ctx.save_for_backward(x, top_k_index, top_k_weights, w_gate_up, w_down)
    ctx.activation = activation


def _backward(ctx, grad_out):
    x, top_k_index, top_k_weights, w_gate_up, w_down = ctx.saved_tensors
    dx, d_weights, dw_gate_up, dw_down = moe_bwd(
        grad_out, x, top_k_index, top_k_weights, w_gate_up, w_down, ctx.activation
    )
    return dx, None, d_weights, dw_gate_up, dw_down, None


torch.library.register_autograd(f"{_NS}::moe_fwd", _backward, setup_context=_setup_context)


def moe_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """Every token's k chosen experts, ``sum_j top_k_weights[t, j] * down_e(act(gate_e(x)) * up_e(x))``
    with e = ``top_k_index[t, j]``, with the NKI kernel.

    ``x`` [T, H]; ``top_k_index`` [T, k] (int); ``top_k_weights`` [T, k]; weights in the layout of
    transformers' ``MixtralExperts``: ``w_gate_up`` [E, 2I, H] (gate rows first), ``w_down`` [E, H, I],
    contiguous. ``activation``: "silu" or "gelu_tanh". Under ``torch.autocast``, x and the weights
    are cast to the autocast dtype, as the module's ``F.linear`` calls cast them.
    """
    if isinstance(x, torch.Tensor):
        x = x.contiguous()
        dtype = autocast_dtype(x)
        if dtype is not None:
            x, w_gate_up, w_down = x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype)
    return moe_fwd(x, top_k_index, top_k_weights, w_gate_up, w_down, activation)


def moe_experts_reference(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """Pure torch, the computation of transformers' ``MixtralExperts.forward`` (and Qwen3-MoE's,
    DeepSeek-V3's, OLMoE's): per expert hit, its tokens' rows through ``F.linear`` with the fused gate_up
    weight, ``act(gate) * up``, the down weight, times the routing weight, added in x's dtype."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe_experts_reference: activation {activation!r} is not one of {ACTIVATIONS}")
    act = F.silu if activation == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    experts = w_gate_up.shape[0]
    out = torch.zeros_like(x)
    for e in range(experts):
        token, position = torch.where(top_k_index == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, w_down[e]) * top_k_weights[token, position, None]
        out = out.index_add(0, token, y.to(out.dtype))
    return out
