"""The microbenchmark suite: ``kernels-neuron bench`` runs these cases.

Each case is a kernel on a shape from a real model, beside the PyTorch computation it replaces
(``Case.prepare_reference``, called with the kernel's own arguments). Beside the hub kernels,
the suite runs the calibration matmuls (:mod:`kernels_neuron.bench.calibration`) on projection
shapes: ``x[tokens, hidden] @ W.T`` with ``lhs_t = x.T`` and ``rhs = W.T``.

The factories (:func:`projection_case`, :func:`rmsnorm_case`, :func:`attention_case`,
:func:`mlp_case`) are public so tests can build the same cases at small sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F

from kernels_neuron import sim

sim.install()  # the kernels import ``nki``: real NKI on a Trainium host, else the simulator
from kernels_neuron.sim.examples import tiled_matmul  # noqa: E402
from nki_src.attention import flash_attn_bwd, flash_attn_fwd  # noqa: E402
from nki_src.attention_decode import flash_decode_fwd, flash_decode_paged_fwd  # noqa: E402
from nki_src.layernorm import layernorm_bwd, layernorm_fwd  # noqa: E402
from nki_src.mlp import mlp_bwd, mlp_fwd, plain_mlp_bwd, plain_mlp_fwd, saved_shape  # noqa: E402
from nki_src.moe import moe_bwd, moe_fwd  # noqa: E402
from nki_src.rmsnorm import rmsnorm_bwd, rmsnorm_fwd  # noqa: E402

from ..ops.attention import attention_reference  # noqa: E402
from ..ops.layernorm import layer_norm_reference  # noqa: E402
from ..ops.mlp import gated_mlp_reference  # noqa: E402
from ..ops.moe import moe_experts_reference, routing_layout  # noqa: E402
from ..ops.plain_mlp import plain_mlp_reference  # noqa: E402
from ..ops.rmsnorm import rms_norm_reference  # noqa: E402
from .calibration import basic_tiled, blocked_free, fully_optimized, operands  # noqa: E402
from .case import Case  # noqa: E402

BF16 = ml_dtypes.bfloat16
PREFILL_TOKENS = 2048
DECODE_TOKENS = 128
RMSNORM_EPS = 1e-6


_DRAW_CHUNK = 1 << 24  # fp32 values drawn at a time: the MoE cases draw over a billion weights


def _draw(
    rng: np.random.Generator | None, *shape: int, scale: float = 1.0, offset: float = 0.0, dtype: Any = BF16
) -> np.ndarray:
    """``offset + scale * N(0, 1)`` values of ``shape`` in ``dtype`` (bf16 by default), drawn in fp32 and
    rounded once; with ``rng`` None, zeros of that shape and dtype, the stand-in a trace-only run takes
    (see :class:`~kernels_neuron.bench.case.Case`). Drawn in chunks, which gives the same values and
    leaves ``rng`` where one draw would (its stream is consumed in order), with a fraction of the fp32
    memory and about a third less time."""
    out = np.zeros(shape, dtype)  # calloc'd: a stand-in's pages are never touched
    if rng is None:
        return out
    flat = out.reshape(-1)
    for start in range(0, flat.size, _DRAW_CHUNK):
        values = rng.standard_normal(min(_DRAW_CHUNK, flat.size - start), dtype=np.float32)
        values *= np.float32(scale)
        values += np.float32(offset)
        flat[start : start + values.size] = values.astype(dtype)
    return out


def _data(seed: int, values: bool) -> np.random.Generator | None:
    """The generator a case draws its floating-point data from, or None for zeros (``values=False``)."""
    return np.random.default_rng(seed) if values else None


def autograd_backward(
    forward: Callable[..., Any], grad_out: torch.Tensor, leaves: tuple[torch.Tensor, ...]
) -> Callable[[], tuple[torch.Tensor, ...]]:
    """The backward a PyTorch user runs: autograd through ``forward(*leaves)`` against ``grad_out``.

    The forward runs here, once; the returned call is the backward alone (the graph is retained,
    so a timing loop may call it repeatedly). It returns the gradients of ``leaves`` in order.
    """
    leaves = tuple(t.detach().requires_grad_() for t in leaves)
    out = forward(*leaves)
    return lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)


def _linear(lhs_t, rhs, **tiling):
    """What ``torch.nn.Linear`` computes for the kernel's operands: ``x @ W.T`` with x = lhs_t.T and
    W = rhs.T, laid out as a Linear holds them. The kernel's tiling options do not change the result."""
    return partial(F.linear, lhs_t.T.contiguous(), rhs.T.contiguous())


def projection_case(name: str, kernel, model: str, m: int, k: int, n: int, **kwargs) -> Case:
    return Case(
        name=name,
        kernel=kernel,
        make_inputs=partial(operands, m, k, n),
        shape={"M": m, "K": k, "N": n},
        dtype="bfloat16",
        model=model,
        reference_name="torch.nn.functional.linear (nn.Linear)",
        prepare_reference=_linear,
        kwargs=kwargs,
    )


def _rmsnorm_inputs(rows: int, hidden: int, backward: bool, seed: int, values: bool = True) -> tuple:
    rng = _data(seed, values)
    x = _draw(rng, rows, hidden)
    weight = _draw(rng, hidden, scale=0.1, offset=1.0)
    if not backward:
        return x, weight
    rstd = _draw(None, rows, 1, dtype=np.float32)  # the forward's saved statistic (a stand-in: zeros)
    if values:
        rstd[:] = 1.0 / np.sqrt((x.astype(np.float32) ** 2).mean(axis=1, keepdims=True) + RMSNORM_EPS)
    return _draw(rng, rows, hidden), x, weight, rstd


def _rmsnorm_forward(x, weight, eps, convention, out_dtype):
    """The transformers module's forward (``rms_norm_reference``), in the kernel's output dtype."""
    return lambda: rms_norm_reference(x, weight, eps, convention).to(getattr(torch, out_dtype))


def _rmsnorm_backward(dy, x, weight, rstd, convention):
    """Autograd through the module's forward; ``rstd`` is the kernel's saved statistic, which
    autograd keeps in its own graph instead."""

    def forward(x, weight):
        return rms_norm_reference(x, weight, RMSNORM_EPS, convention)

    return autograd_backward(forward, dy, (x, weight))


def rmsnorm_case(name: str, model: str, rows: int, hidden: int, convention: str, backward: bool = False) -> Case:
    module = {"llama": "LlamaRMSNorm", "gemma": "GemmaRMSNorm", "fp32_multiply": "Olmo2RMSNorm"}[convention]
    return Case(
        name=name,
        kernel=rmsnorm_bwd if backward else rmsnorm_fwd,
        make_inputs=partial(_rmsnorm_inputs, rows, hidden, backward),
        shape={"rows": rows, "hidden": hidden},
        dtype="bfloat16",
        model=model,
        reference_name=f"{module} {'backward (autograd)' if backward else 'forward'} (torch)",
        prepare_reference=_rmsnorm_backward if backward else _rmsnorm_forward,
        kwargs={"convention": convention}
        if backward
        else {"eps": RMSNORM_EPS, "convention": convention, "out_dtype": "bfloat16"},
    )


LAYERNORM_EPS = 1e-5


def _layernorm_inputs(
    rows: int, hidden: int, bias: bool, backward: bool, dtype: str, seed: int, values: bool = True
) -> tuple:
    rng = _data(seed, values)
    element = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    x = _draw(rng, rows, hidden, dtype=element)
    weight = _draw(rng, hidden, scale=0.1, offset=1.0, dtype=element)
    b = _draw(rng, hidden, scale=0.1, dtype=element) if bias else None
    if not backward:
        return x, weight, b, LAYERNORM_EPS
    mean, rstd = _draw(None, rows, 1, dtype=np.float32), _draw(None, rows, 1, dtype=np.float32)  # saved statistics
    if values:
        x32 = x.astype(np.float32)
        mean[:] = x32.mean(axis=1, keepdims=True)
        rstd[:] = 1.0 / np.sqrt(x32.var(axis=1, keepdims=True) + LAYERNORM_EPS)
    return _draw(rng, rows, hidden, dtype=element), x, weight, mean, rstd


def _layernorm_forward(x, weight, bias, eps):
    """torch.nn.LayerNorm's forward (``layer_norm_reference``)."""
    return partial(layer_norm_reference, x, weight, bias, eps)


def _layernorm_with_bias(x, weight, bias):
    return layer_norm_reference(x, weight, bias, LAYERNORM_EPS)


def _layernorm_backward(bias: bool, dy, x, weight, mean, rstd):
    """Autograd through the module's forward against dy: (dx, dweight[, dbias]), the kernel's leading
    outputs (``bias``: whether the module has one; its gradient is taken at zero). ``mean`` and ``rstd``
    are the kernel's saved statistics, which autograd keeps in its graph."""
    if bias:
        return autograd_backward(_layernorm_with_bias, dy, (x, weight, torch.zeros_like(weight)))
    return autograd_backward(partial(_layernorm_with_bias, bias=None), dy, (x, weight))


_LAYERNORM_BACKWARDS = {bias: partial(_layernorm_backward, bias) for bias in (False, True)}


def layernorm_case(
    name: str,
    model: str,
    rows: int,
    hidden: int,
    bias: bool = True,
    backward: bool = False,
    dtype: str = "bfloat16",
) -> Case:
    module = "LayerNorm" if bias else "CohereLayerNorm"
    return Case(
        name=name,
        kernel=layernorm_bwd if backward else layernorm_fwd,
        make_inputs=partial(_layernorm_inputs, rows, hidden, bias, backward, dtype),
        shape={"rows": rows, "hidden": hidden, **({} if bias else {"bias": "none"})},
        dtype=dtype,
        model=model,
        reference_name=f"{module} {'backward (autograd)' if backward else 'forward'} (torch)",
        prepare_reference=_LAYERNORM_BACKWARDS[bias] if backward else _layernorm_forward,
    )


def _attention_inputs(
    sq: int, sk: int, d: int, window: int, softcap: float, backward: bool, segments, seed: int, values: bool = True
) -> tuple:
    rng = _data(seed, values)
    q, k, v = _draw(rng, 1, 1, sq, d), _draw(rng, 1, 1, sk, d), _draw(rng, 1, 1, sk, d)
    args = (None, d**-0.5, True, window, softcap, segments)
    if not backward:
        return (q, k, v) + args
    if values:  # the backward's out and lse as the forward kernel leaves them
        out, lse = sim.run(flash_attn_fwd, q, k, v, *args).outputs
    else:
        out, lse = _draw(None, 1, 1, sq, d), _draw(None, 1, 1, sq, dtype=np.float32)
    return (q, k, v, out, _draw(rng, 1, 1, sq, d), lse) + args


def _sdpa_expresses(sq: int, sk: int, window: int, softcap: float, packed: bool) -> bool:
    """Whether transformers' sdpa route computes this attention: no window, softcap or packing, and
    causal alignment that sdpa's ``is_causal`` (top-left) agrees with: Sq = Sk, or one decode query."""
    return not (window or softcap or packed) and (sq == sk or sq == 1)


def _torch_attention(q, k, v, bias, scale, causal, window, softcap, segments):
    """What transformers runs for this attention: ``scaled_dot_product_attention`` where it can (see
    :func:`_sdpa_expresses`), else the eager path (``attention_reference``)."""
    sq, sk = q.shape[2], k.shape[2]
    if bias is None and _sdpa_expresses(sq, sk, window, softcap, segments is not None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal) and sq > 1, scale=scale)
    cu_seqlens = (
        None
        if segments is None
        else torch.tensor([0] + [end for _, end in segments], dtype=torch.int32, device=q.device)
    )
    return attention_reference(
        q,
        k,
        v,
        attention_mask=bias,
        scale=scale,
        causal=causal,
        window=window or None,
        softcap=softcap or None,
        cu_seqlens=cu_seqlens,
    )


def _attention_forward(q, k, v, bias, scale, causal, window, softcap, segments):
    return partial(_torch_attention, q, k, v, bias, scale, causal, window, softcap, segments)


def _attention_backward(q, k, v, out, dout, lse, bias, scale, causal, window, softcap, segments):
    """Autograd through the forward against ``dout``; ``out`` and ``lse`` are the kernel's saved
    forward results, which autograd keeps in its own graph instead."""

    def forward(q, k, v):
        return _torch_attention(q, k, v, bias, scale, causal, window, softcap, segments)

    return autograd_backward(forward, dout, (q, k, v))


def _attention_reference_name(sdpa: bool) -> str:
    """The attention references' names: sdpa where transformers would call it, else its eager path."""
    return "scaled_dot_product_attention" if sdpa else "eager attention (transformers' eager_attention_forward)"


def attention_case(
    name: str,
    model: str,
    sq: int,
    sk: int,
    d: int = 128,
    window: int = 0,
    softcap: float = 0.0,
    backward: bool = False,
    packed: tuple[int, ...] = (),
) -> Case:
    """One (batch, KV head) group, causal, bf16; FLOPs the standard way: 4*Sq*Sk*d halved for causal
    (only the visible pairs when Sq < Sk), and 2.5x that for the backward. ``packed``: sequence lengths
    packed into the Sq = Sk tokens (the kernel's segments), each attending within itself."""
    if packed:
        visible = sum(n * n / 2 for n in packed)
    elif window or sq != sk:
        visible = sum(min(sk, i + 1 + sk - sq) - (max(0, i + sk - sq - window + 1) if window else 0) for i in range(sq))
    else:
        visible = sq * sk / 2
    flops = int(4 * visible * d * (2.5 if backward else 1.0))
    offsets = np.cumsum((0,) + packed).tolist()
    segments = tuple(zip(offsets[:-1], offsets[1:])) if packed else None
    return Case(
        name=name,
        kernel=flash_attn_bwd if backward else flash_attn_fwd,
        make_inputs=partial(_attention_inputs, sq, sk, d, window, softcap, backward, segments),
        shape={
            "Sq": sq,
            "Sk": sk,
            "d": d,
            **({"window": window} if window else {}),
            **({"softcap": softcap} if softcap else {}),
            **({"packed": "+".join(map(str, packed))} if packed else {}),
        },
        dtype="bfloat16",
        model=model,
        reference_name=_attention_reference_name(_sdpa_expresses(sq, sk, window, softcap, bool(packed)))
        + (" backward (autograd)" if backward else ""),
        prepare_reference=_attention_backward if backward else _attention_forward,
        standard_flops=flops,
    )


def _decode_inputs(
    batch: int,
    heads: int,
    kv_heads: int,
    sq: int,
    sk: int,
    d: int,
    softcap: float,
    seed: int,
    values: bool = True,
) -> tuple:
    rng = _data(seed, values)
    q = _draw(rng, batch, heads, sq, d)
    k, v = _draw(rng, batch, kv_heads, sk, d), _draw(rng, batch, kv_heads, sk, d)
    return (q, k, v, d**-0.5, True, 0, softcap)


def _decode_forward(q, k, v, scale, causal, window, softcap):
    """transformers' attention for a few queries against a cache: sdpa with GQA for one query, else (or
    with a softcap, which sdpa cannot apply) the eager path (sdpa's ``is_causal`` aligns top-left, a
    cache needs bottom-right)."""
    if q.shape[2] == 1 and not softcap:
        return partial(F.scaled_dot_product_attention, q, k, v, scale=scale, enable_gqa=True)
    return partial(attention_reference, q, k, v, scale=scale, causal=causal, softcap=softcap or None)


def decode_case(
    name: str,
    model: str,
    batch: int,
    heads: int,
    kv_heads: int,
    sq: int,
    sk: int,
    d: int = 128,
    softcap: float = 0.0,
) -> Case:
    """The decode kernel (what the flash-attention op runs for up to 16 queries without a mask): ``sq``
    queries of ``heads`` query heads per sequence against ``sk`` cached keys of ``kv_heads`` KV heads,
    causal, bf16, logits softcapped at ``softcap`` when set. Memory-bound: the roofline is reading K
    and V once."""
    return Case(
        name=name,
        kernel=flash_decode_fwd,
        make_inputs=partial(_decode_inputs, batch, heads, kv_heads, sq, sk, d, softcap),
        shape={
            "B": batch,
            "H": heads,
            "Hkv": kv_heads,
            "Sq": sq,
            "Sk": sk,
            "d": d,
            **({"softcap": softcap} if softcap else {}),
        },
        dtype="bfloat16",
        model=model,
        reference_name=_attention_reference_name(sq == 1 and not softcap),
        prepare_reference=_decode_forward,
        standard_flops=4 * batch * heads * sq * sk * d,
    )


def _paged_inputs(
    batch: int,
    heads: int,
    kv_heads: int,
    sq: int,
    sk: int,
    d: int,
    block_size: int,
    softcap: float,
    seed: int,
    values: bool = True,
) -> tuple:
    """A paged cache holding ``sk`` keys per sequence in blocks scattered over the cache (the block
    table is drawn with or without ``values``: the kernel's trace depends on it)."""
    structure = np.random.default_rng(seed)
    per_row = -(-sk // block_size)
    slots = batch * per_row * block_size
    table = structure.permutation(batch * per_row).reshape(batch, per_row).astype(np.int32)
    rng = structure if values else None
    q = _draw(rng, batch, heads, sq, d)
    k_slots, v_slots = _draw(rng, slots, kv_heads, d), _draw(rng, slots, kv_heads, d)
    return (q, k_slots, v_slots, table, block_size, (sk,) * batch, d**-0.5, True, 0, softcap)


def _paged_forward(q, k_slots, v_slots, block_table, block_size, lengths, scale, causal, window, softcap):
    """The same attention in torch: each sequence's blocks gathered through the table, then sdpa (GQA)
    over its ``lengths`` keys (the suite gives every sequence the same length), or with a softcap,
    which sdpa cannot apply, the eager path."""

    def attend():
        kv_heads, d = k_slots.shape[1], k_slots.shape[2]
        blocks = block_table.long()
        keys = k_slots.view(-1, block_size, kv_heads, d)[blocks].flatten(1, 2).transpose(1, 2)[:, :, : lengths[0]]
        values = v_slots.view(-1, block_size, kv_heads, d)[blocks].flatten(1, 2).transpose(1, 2)[:, :, : lengths[0]]
        if softcap:
            return attention_reference(q, keys, values, scale=scale, softcap=softcap)
        return F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)

    return attend


def decode_paged_case(
    name: str,
    model: str,
    batch: int,
    heads: int,
    kv_heads: int,
    sk: int,
    block_size: int,
    d: int = 128,
    softcap: float = 0.0,
) -> Case:
    """``decode_case`` with one query per sequence against a paged cache (FlashAttention's
    ``[blocks, block_size, Hkv, D]`` viewed flat, the blocks scattered), read by the kernel through
    the block table."""
    return Case(
        name=name,
        kernel=flash_decode_paged_fwd,
        make_inputs=partial(_paged_inputs, batch, heads, kv_heads, 1, sk, d, block_size, softcap),
        shape={
            "B": batch,
            "H": heads,
            "Hkv": kv_heads,
            "Sq": 1,
            "Sk": sk,
            "d": d,
            "block_size": block_size,
            **({"softcap": softcap} if softcap else {}),
        },
        dtype="bfloat16",
        model=model,
        reference_name="block-table gather + " + _attention_reference_name(not softcap),
        prepare_reference=_paged_forward,
        standard_flops=4 * batch * heads * sk * d,
    )


def _mlp_inputs(tokens: int, hidden: int, inter: int, backward: bool, seed: int, values: bool = True) -> tuple:
    rng = _data(seed, values)

    x = _draw(rng, tokens, hidden)
    weights = (
        _draw(rng, inter, hidden, scale=hidden**-0.5),
        _draw(rng, inter, hidden, scale=hidden**-0.5),
        _draw(rng, hidden, inter, scale=inter**-0.5),
    )
    if not backward:
        return (x,) + weights
    # The saved gate/up projections are drawn, not computed by a forward run: the modelled time does
    # not depend on the values, and a full-size forward would double the case's simulation time.
    return (_draw(rng, tokens, hidden), x) + weights + (_draw(rng, *saved_shape(tokens, inter)),)


def _mlp_forward(x, w_gate, w_up, w_down, activation, save_gate_up):
    """The transformers module's forward (``gated_mlp_reference``: LlamaMLP, GemmaMLP)."""
    return partial(gated_mlp_reference, x, w_gate, w_up, w_down, activation)


def _mlp_backward(dy, x, w_gate, w_up, w_down, saved, activation):
    """Autograd through the module's forward against ``dy``: (dx, dw_gate, dw_up, dw_down), the
    kernel's order. ``saved`` is the kernel's saved gate/up, which autograd keeps in its own graph."""

    def forward(x, w_gate, w_up, w_down):
        return gated_mlp_reference(x, w_gate, w_up, w_down, activation)

    return autograd_backward(forward, dy, (x, w_gate, w_up, w_down))


def mlp_case(
    name: str, model: str, tokens: int, hidden: int, inter: int, activation: str = "silu", backward: bool = False
) -> Case:
    """The fused gated MLP, simulated at the full shape (no slicing). FLOPs the standard way: the three
    projections, 2*T*H*I each (6*T*H*I), and twice that for the backward (dx and the three weight
    gradients); the TensorE transposes the kernel needs are not counted."""
    module = {"silu": "LlamaMLP", "gelu_tanh": "GemmaMLP"}[activation]
    return Case(
        name=name,
        kernel=mlp_bwd if backward else mlp_fwd,
        make_inputs=partial(_mlp_inputs, tokens, hidden, inter, backward),
        shape={"tokens": tokens, "hidden": hidden, "intermediate": inter},
        dtype="bfloat16",
        model=model,
        reference_name=f"{module} {'backward (autograd)' if backward else 'forward'} (torch)",
        prepare_reference=_mlp_backward if backward else _mlp_forward,
        kwargs={"activation": activation} if backward else {"activation": activation, "save_gate_up": False},
        standard_flops=(12 if backward else 6) * tokens * hidden * inter,
    )


def _plain_mlp_inputs(tokens: int, hidden: int, inter: int, backward: bool, seed: int, values: bool = True) -> tuple:
    rng = _data(seed, values)

    x = _draw(rng, tokens, hidden)
    weights = (_draw(rng, inter, hidden, scale=hidden**-0.5), _draw(rng, hidden, inter, scale=inter**-0.5))
    if not backward:
        return (x,) + weights + (_draw(rng, inter, scale=0.1), _draw(rng, hidden, scale=0.1))
    return (_draw(rng, tokens, hidden), x) + weights + (_draw(rng, *saved_shape(tokens, inter, 1)),)


def _plain_mlp_forward(x, w_up, w_down, b_up, b_down, activation, save_up):
    """The transformers module's forward (``plain_mlp_reference``: Starcoder2MLP, GPTNeoXMLP ...)."""
    return partial(plain_mlp_reference, x, w_up, w_down, b_up, b_down, activation)


def _plain_mlp_backward(dy, x, w_up, w_down, saved, activation, with_bias):
    """Autograd through the module's forward against ``dy``: (dx, dw_up, dw_down[, db_up, db_down]), the
    kernel's order, with the biases at zero. The backward kernel reads no bias (the saved up
    projection carries it), so the bias values do not change what it computes; the comparison in the
    tests gives it a ``saved`` from a zero-bias forward."""
    biases = (torch.zeros(w_up.shape[0], dtype=x.dtype), torch.zeros(w_down.shape[0], dtype=x.dtype))

    def forward(x, w_up, w_down, *biases):
        return plain_mlp_reference(x, w_up, w_down, *(biases or (None, None)), activation)

    return autograd_backward(forward, dy, (x, w_up, w_down) + (biases if with_bias else ()))


def plain_mlp_case(
    name: str, model: str, module: str, tokens: int, hidden: int, inter: int, activation: str, backward: bool = False
) -> Case:
    """The fused plain MLP with biases, simulated at the full shape. FLOPs the standard way: the two
    projections, 2*T*H*I each (4*T*H*I), and twice that for the backward; the TensorE transposes and
    the bias sums are not counted."""
    return Case(
        name=name,
        kernel=plain_mlp_bwd if backward else plain_mlp_fwd,
        make_inputs=partial(_plain_mlp_inputs, tokens, hidden, inter, backward),
        shape={"tokens": tokens, "hidden": hidden, "intermediate": inter},
        dtype="bfloat16",
        model=model,
        reference_name=f"{module} {'backward (autograd)' if backward else 'forward'} (torch)",
        prepare_reference=_plain_mlp_backward if backward else _plain_mlp_forward,
        kwargs={"activation": activation, "with_bias": True}
        if backward
        else {"activation": activation, "save_up": False},
        standard_flops=(8 if backward else 4) * tokens * hidden * inter,
    )


def _moe_inputs(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, backward: bool, seed: int, values: bool = True
) -> tuple:
    """bf16 tokens and expert weights, routed by a random softmax router (top-k, renormalised as
    Mixtral's router does), laid out for the kernel (``routing_layout``, the backward's block size for
    the backward, which also takes dy first and the idle experts' flags last). The routing is drawn
    first, with or without ``values``: the kernel's trace depends on it."""
    structure = np.random.default_rng(seed)
    probs = torch.from_numpy(structure.standard_normal((tokens, experts), dtype=np.float32)).softmax(-1)
    weights, index = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    layout = routing_layout(index, weights, experts, hidden, inter, torch.bfloat16, backward=backward)
    tables = tuple(t.numpy() for t in layout.tables)
    rng = structure if values else None
    x = _draw(rng, tokens, hidden)
    w_gate_up = _draw(rng, experts, 2 * inter, hidden, scale=hidden**-0.5)
    w_down = _draw(rng, experts, hidden, inter, scale=inter**-0.5)
    if not backward:
        return (x, w_gate_up, w_down) + tables
    idle = (layout.counts == 0).to(torch.int32)[:, None].numpy()
    return (_draw(rng, tokens, hidden), x, w_gate_up, w_down) + tables + (idle,)


def _moe_routing(tokens, top_k, block_info, slot_row, slot_weight):
    """(top_k_index, top_k_weights) [T, k] of the routing a block layout encodes: each used slot's
    choice t*k + j gets its block's expert and its weight."""
    block = slot_row.shape[0] // block_info.shape[0]
    slot_expert = torch.as_tensor(block_info)[:, 0].long().repeat_interleave(block)
    row = torch.as_tensor(slot_row)[:, 0].long()
    used = row < tokens * top_k
    index = torch.zeros(tokens * top_k, dtype=torch.long, device=row.device)
    weights = torch.zeros(tokens * top_k, dtype=torch.float32, device=row.device)
    index[row[used]] = slot_expert[used].to(row.device)
    weights[row[used]] = torch.as_tensor(slot_weight)[:, 0].float()[used]
    return index.reshape(tokens, top_k), weights.reshape(tokens, top_k)


def _moe_forward(x, w_gate_up, w_down, block_info, slot_token, slot_row, slot_weight, top_k, activation):
    """The transformers module's forward (``moe_experts_reference``: MixtralExperts) on the routing the
    block layout encodes."""
    index, weights = _moe_routing(x.shape[0], top_k, block_info, slot_row, slot_weight)
    return partial(moe_experts_reference, x, index, weights, w_gate_up, w_down, activation)


def _moe_backward(
    dy, x, w_gate_up, w_down, block_info, slot_token, slot_row, slot_weight, expert_idle, top_k, activation
):
    """Autograd through the module's forward on the routing the block layout encodes, against ``dy``:
    (dx, d top_k_weights as the kernel's [T*k, 1], d w_gate_up, d w_down), the kernel's order."""
    index, weights = _moe_routing(x.shape[0], top_k, block_info, slot_row, slot_weight)

    def forward(x, weights, w_gate_up, w_down):
        return moe_experts_reference(x, index, weights, w_gate_up, w_down, activation)

    backward = autograd_backward(forward, dy, (x, weights, w_gate_up, w_down))

    def gradients():
        dx, d_weights, dw_gate_up, dw_down = backward()
        return dx, d_weights.reshape(-1, 1), dw_gate_up, dw_down

    return gradients


def moe_case(
    name: str, model: str, tokens: int, hidden: int, inter: int, experts: int, top_k: int, backward: bool = False
) -> Case:
    """The grouped MoE experts forward or backward, simulated at the full shape. FLOPs the standard way:
    each of the T*k routed choices through its expert's three projections (6*T*k*H*I), twice that for
    the backward (dx and the three weight gradients); the padding of the ragged groups, the TensorE
    transposes and the backward's recomputed gate/up projections (4*T*k*H*I more) are not counted."""
    return Case(
        name=name,
        kernel=moe_bwd if backward else moe_fwd,
        make_inputs=partial(_moe_inputs, tokens, hidden, inter, experts, top_k, backward),
        shape={"tokens": tokens, "hidden": hidden, "intermediate": inter, "experts": experts, "top_k": top_k},
        dtype="bfloat16",
        model=model,
        reference_name=f"MixtralExperts {'backward (autograd)' if backward else 'forward'} (torch)",
        prepare_reference=_moe_backward if backward else _moe_forward,
        kwargs={"top_k": top_k, "activation": "silu"},
        standard_flops=(12 if backward else 6) * tokens * top_k * hidden * inter,
    )


CASES: list[Case] = [
    mlp_case("mlp-fwd/llama3-8b/2048-tokens", "Llama-3-8B", PREFILL_TOKENS, 4096, 14336),
    mlp_case("mlp-bwd/llama3-8b/2048-tokens", "Llama-3-8B", PREFILL_TOKENS, 4096, 14336, backward=True),
    mlp_case("mlp-fwd/llama3-8b/decode-1", "Llama-3-8B", 1, 4096, 14336),
    mlp_case("mlp-fwd/llama3-8b/decode-8", "Llama-3-8B", 8, 4096, 14336),
    mlp_case("mlp-fwd/gemma2-9b-geglu/2048-tokens", "Gemma-2-9B", PREFILL_TOKENS, 3584, 14336, activation="gelu_tanh"),
    mlp_case(
        "mlp-bwd/gemma2-9b-geglu/2048-tokens",
        "Gemma-2-9B",
        PREFILL_TOKENS,
        3584,
        14336,
        activation="gelu_tanh",
        backward=True,
    ),
    plain_mlp_case(
        "plain-mlp-fwd/starcoder2-7b/2048-tokens",
        "Starcoder2-7B",
        "Starcoder2MLP",
        PREFILL_TOKENS,
        4608,
        18432,
        "gelu_tanh",
    ),
    plain_mlp_case(
        "plain-mlp-bwd/starcoder2-7b/2048-tokens",
        "Starcoder2-7B",
        "Starcoder2MLP",
        PREFILL_TOKENS,
        4608,
        18432,
        "gelu_tanh",
        backward=True,
    ),
    plain_mlp_case(
        "plain-mlp-fwd/starcoder2-7b/decode-8", "Starcoder2-7B", "Starcoder2MLP", 8, 4608, 18432, "gelu_tanh"
    ),
    plain_mlp_case(
        "plain-mlp-fwd/pythia-6.9b/2048-tokens", "Pythia-6.9B", "GPTNeoXMLP", PREFILL_TOKENS, 4096, 16384, "gelu"
    ),
    moe_case("moe-fwd/mixtral-8x7b/2048-tokens-top2", "Mixtral-8x7B", PREFILL_TOKENS, 4096, 14336, 8, 2),
    moe_case("moe-fwd/mixtral-8x7b/decode-8-top2", "Mixtral-8x7B", 8, 4096, 14336, 8, 2),
    moe_case("moe-fwd/qwen3-30b-a3b/2048-tokens-top8", "Qwen3-30B-A3B", PREFILL_TOKENS, 2048, 768, 128, 8),
    # The backward at 512 tokens, not the forward's 2048: at 2048 the simulator needs well over 10 minutes.
    moe_case("moe-bwd/mixtral-8x7b/512-tokens-top2", "Mixtral-8x7B", 512, 4096, 14336, 8, 2, backward=True),
    attention_case("attention-fwd/llama3-8b/causal-4096", "Llama-3-8B", 4096, 4096),
    attention_case("attention-fwd/llama3-8b/causal-8192", "Llama-3-8B", 8192, 8192),
    attention_case("attention-bwd/llama3-8b/causal-4096", "Llama-3-8B", 4096, 4096, backward=True),
    attention_case("attention-bwd/llama3-8b/causal-8192", "Llama-3-8B", 8192, 8192, backward=True),
    attention_case("attention-fwd/mistral-7b/window-4096-of-8192", "Mistral-7B", 8192, 8192, window=4096),
    attention_case(
        "attention-fwd/gemma2-9b/softcap-d256-4096", "Gemma-2-9B", 4096, 4096, d=256, window=4096, softcap=50.0
    ),
    # Decoding (the decode kernel): one query head against one KV head's cache, as these cases measured
    # before the decode kernel; then whole layers (32 query heads over 8 KV heads, GQA) at batch 1 and 8.
    decode_case("attention-fwd/qwen3-8b/decode-1-of-4096", "Qwen3-8B", 1, 1, 1, 1, 4096),
    decode_case("attention-fwd/qwen3-8b/decode-gqa-b1-of-4096", "Qwen3-8B", 1, 32, 8, 1, 4096),
    decode_case("attention-fwd/llama3-8b/decode-gqa-b8-of-4096", "Llama-3-8B", 8, 32, 8, 1, 4096),
    # Gemma-2-9B's layer: head_dim 256 (the contraction over D in two blocks) and its logit softcap.
    decode_case("attention-fwd/gemma2-9b/decode-gqa-b1-of-4096", "Gemma-2-9B", 1, 16, 8, 1, 4096, d=256, softcap=50.0),
    # The same layers against a paged cache (vLLM-sized blocks of 16, FlashAttention's of 256).
    decode_paged_case("attention-fwd/qwen3-8b/decode-paged16-b1-of-4096", "Qwen3-8B", 1, 32, 8, 4096, 16),
    decode_paged_case("attention-fwd/llama3-8b/decode-paged16-b8-of-4096", "Llama-3-8B", 8, 32, 8, 4096, 16),
    decode_paged_case("attention-fwd/llama3-8b/decode-paged256-b8-of-4096", "Llama-3-8B", 8, 32, 8, 4096, 256),
    decode_paged_case(
        "attention-fwd/gemma2-9b/decode-paged16-b1-of-4096", "Gemma-2-9B", 1, 16, 8, 4096, 16, d=256, softcap=50.0
    ),
    # Speculative / chunked decode: a few queries per sequence against a long cache.
    decode_case("attention-fwd/llama3-8b/spec-decode-4-of-4096", "Llama-3-8B", 1, 1, 1, 4, 4096),
    decode_case("attention-fwd/llama3-8b/spec-decode-16-of-4096", "Llama-3-8B", 1, 1, 1, 16, 4096),
    decode_case("attention-fwd/mistral-7b/spec-decode-4-gqa-b1-of-4096", "Mistral-7B", 1, 32, 8, 4, 4096),
    decode_case("attention-fwd/mistral-7b/spec-decode-16-gqa-b1-of-4096", "Mistral-7B", 1, 32, 8, 16, 4096),
    # Packed training batches (TRL's padding-free packing): one launch over the sequences, against one of
    # them alone (the packed case should cost about 4x it).
    attention_case("attention-fwd/qwen3-8b/packed-4x256", "Qwen3-8B", 1024, 1024, packed=(256, 256, 256, 256)),
    attention_case(
        "attention-bwd/qwen3-8b/packed-4x256", "Qwen3-8B", 1024, 1024, packed=(256, 256, 256, 256), backward=True
    ),
    attention_case("attention-fwd/qwen3-8b/causal-256", "Qwen3-8B", 256, 256),
    attention_case("attention-bwd/qwen3-8b/causal-256", "Qwen3-8B", 256, 256, backward=True),
    rmsnorm_case("rmsnorm-fwd/llama3-8b/4096-tokens", "Llama-3-8B", 4096, 4096, "llama"),
    rmsnorm_case("rmsnorm-bwd/llama3-8b/4096-tokens", "Llama-3-8B", 4096, 4096, "llama", backward=True),
    rmsnorm_case("rmsnorm-fwd/gemma2-9b/4096-tokens", "Gemma-2-9B", 4096, 3584, "gemma"),
    rmsnorm_case("rmsnorm-bwd/gemma2-9b/4096-tokens", "Gemma-2-9B", 4096, 3584, "gemma", backward=True),
    rmsnorm_case("rmsnorm-fwd/qwen3-8b-q_norm/2048-tokens", "Qwen3-8B", 2048 * 32, 128, "llama"),
    # Decode: one token per sequence, batch 1 and 8 (few rows, each spread over the partitions).
    rmsnorm_case("rmsnorm-fwd/llama3-8b/decode-1", "Llama-3-8B", 1, 4096, "llama"),
    rmsnorm_case("rmsnorm-fwd/llama3-8b/decode-8", "Llama-3-8B", 8, 4096, "llama"),
    rmsnorm_case("rmsnorm-fwd/qwen3-8b/decode-1", "Qwen3-8B", 1, 4096, "llama"),
    rmsnorm_case("rmsnorm-fwd/qwen3-8b/decode-8", "Qwen3-8B", 8, 4096, "llama"),
    rmsnorm_case("rmsnorm-fwd/mistral-7b/decode-1", "Mistral-7B", 1, 4096, "llama"),
    rmsnorm_case("rmsnorm-fwd/mistral-7b/decode-8", "Mistral-7B", 8, 4096, "llama"),
    layernorm_case("layernorm-fwd/gpt-j-6b/4096-tokens", "GPT-J-6B", 4096, 4096),
    layernorm_case("layernorm-bwd/gpt-j-6b/4096-tokens", "GPT-J-6B", 4096, 4096, backward=True),
    layernorm_case("layernorm-fwd/starcoder2-7b/4096-tokens", "Starcoder2-7B", 4096, 4608),
    layernorm_case("layernorm-fwd/starcoder2-7b/decode-8", "Starcoder2-7B", 8, 4608),
    layernorm_case("layernorm-fwd/command-r/4096-tokens", "Command-R", 4096, 8192, bias=False),
    layernorm_case("layernorm-bwd/command-r/4096-tokens", "Command-R", 4096, 8192, bias=False, backward=True),
    # fp32 rows too wide for SBUF (as autocast hands LayerNorm): the kernels stream them through twice.
    layernorm_case("layernorm-fwd/falcon-180b/fp32-2048-tokens", "Falcon-180B", 2048, 14848, dtype="float32"),
    layernorm_case(
        "layernorm-bwd/falcon-180b/fp32-2048-tokens", "Falcon-180B", 2048, 14848, dtype="float32", backward=True
    ),
    projection_case(
        "matmul-optimised/llama3-8b-q_proj/prefill", fully_optimized, "Llama-3-8B", PREFILL_TOKENS, 4096, 4096
    ),
    projection_case(
        "matmul-optimised/mistral-7b-kv_proj/prefill", fully_optimized, "Mistral-7B", PREFILL_TOKENS, 4096, 1024
    ),
    projection_case(
        "matmul-optimised/gemma2-9b-q_proj/prefill",
        fully_optimized,
        "Gemma-2-9B",
        PREFILL_TOKENS,
        3584,
        4096,
        tiles_k=7,
    ),
    projection_case("matmul-blocked/qwen3-8b-o_proj/prefill", blocked_free, "Qwen3-8B", PREFILL_TOKENS, 4096, 4096),
    projection_case("matmul-basic/qwen3-8b-o_proj/prefill", basic_tiled, "Qwen3-8B", PREFILL_TOKENS, 4096, 4096),
    projection_case("matmul-tiled/llama3-8b-q_proj/decode128", tiled_matmul, "Llama-3-8B", DECODE_TOKENS, 4096, 4096),
]
