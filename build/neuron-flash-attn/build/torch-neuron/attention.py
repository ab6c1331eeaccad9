"""Flash attention as torch ops backed by the NKI kernel, with autograd, and its pure-torch reference.

- ``flash_attention(q, k, v, *, attention_mask, scale, causal, window, softcap)``: q ``[B, H, Sq, D]``,
  k/v ``[B, Hkv, Sk, D]`` (grouped-query attention when ``Hkv < H``), returns ``[B, H, Sq, D]``.
- ``flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)``: packed
  sequences ``[total, H, D]``, each attending only within itself.
- ``attention_reference(...)``: the same semantics in plain torch (tests, and the explicit fallback);
  ``attention_backward_reference(...)``: the backward with the NKI backward kernel's signature.

- ``decode_attention(q, k, v, key_ranges, ...)``: a few queries per sequence against a padded KV cache,
  each batch row attending to its own range of cache positions.

Decoding (at most ``DECODE_MAX_QUERIES`` queries per sequence, no mask or packing, head_dim <= 256,
and at most 128 query rows per KV head) runs the decode kernel (``nki_src/attention_decode.py``: keys
on the partitions, every query head of a KV group served from one K/V read, any number of keys in one
launch, ragged per-row key ranges) through the ``flash_decode_fwd`` op; everything else, and every
backward, runs the flash-attention kernel (``nki_src/attention.py``).

Semantics are ``torch.nn.functional.scaled_dot_product_attention`` plus: causal masking aligned as
transformers aligns it when ``Sq < Sk`` (a KV cache: the last query sees the last key), a sliding
window (query ``i`` sees keys ``j`` with ``i + Sk - Sq - window < j``), logit softcapping
(``softcap * tanh(logits / softcap)``, before the mask is added), and a query row that can see no
key gives zeros (not NaN).

>>> import torch
>>> from kernels_neuron.ops.attention import flash_attention, attention_reference
>>> q, k, v = torch.randn(1, 4, 10, 64), torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 64)
>>> torch.allclose(flash_attention(q, k, v, causal=True), attention_reference(q, k, v, causal=True), atol=1e-5)
True
"""

from __future__ import annotations

import math

import torch

from . import attention_launches as launches
from ._backend import autocast_dtype, check_float_tensor, define_op, nki_source, op_namespace, run_kernel

_kernels = nki_source(__package__, "attention")
_decode = nki_source(__package__, "attention_decode")
# Up to 16 queries per sequence the decode kernel is the faster one in the cost model (1..16 queries
# against 4096 keys, 1..8 query heads per KV head); at 32 queries of 4 heads the prefill kernel is.
DECODE_MAX_QUERIES = 16
MAX_HEAD_DIM = _kernels.MAX_HEAD_DIM
MASKED_LOGIT = _kernels.MASKED_LOGIT_FLOOR  # rows whose logits all lie at or below it have seen no key
_NS = op_namespace(__name__)


# --- validation -----------------------------------------------------------------------------------------


def _autocast(q, k, v) -> tuple:
    """Under ``torch.autocast``, q, k and v in the autocast dtype, as sdpa takes them there (q/k
    promoted to fp32 by rotary beside a bf16 v is normal then); otherwise unchanged."""
    dtype = autocast_dtype(q) if isinstance(q, torch.Tensor) else None
    if dtype is None:
        return q, k, v
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, k, v))


def _check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(op, name, t, contiguous=False)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{op}: q, k and v must have the same dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"{op}: q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    dims = len(layout.split(","))
    if q.dim() != dims or k.dim() != dims or v.dim() != dims:
        raise ValueError(
            f"{op}: q, k, v must be {dims}-D [{layout}], got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.numel() == 0 or k.numel() == 0:
        raise ValueError(f"{op}: empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    head_dim, heads, kv_heads = q.shape[-1], q.shape[1], k.shape[1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"{op}: q has head_dim {head_dim} but k and v have {k.shape[-1]}")
    if dims == 4 and k.shape[0] != q.shape[0]:
        raise ValueError(f"{op}: q has batch {q.shape[0]} but k and v have {k.shape[0]}")
    if heads % kv_heads:
        raise ValueError(f"{op}: {heads} query heads are not a multiple of {kv_heads} KV heads")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head_dim {head_dim} is above the kernel's limit of {MAX_HEAD_DIM}")


def _check_options(op: str, scale, window, softcap, dropout) -> None:
    if dropout:
        raise ValueError(f"{op}: dropout is not supported (got dropout={dropout}); use dropout=0.0")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{op}: scale must be a positive finite number or None, got {scale!r}")
    if window is not None and not (isinstance(window, int) and not isinstance(window, bool) and window >= 0):
        raise ValueError(f"{op}: window must be None or a non-negative int (keys per query), got {window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"{op}: softcap must be None or a non-negative number, got {softcap!r}")


def mask_to_bias(
    op: str, mask: torch.Tensor | None, shape: tuple[int, int, int, int], device: torch.device
) -> torch.Tensor | None:
    """An attention mask (bool keep-mask, or additive float) broadcastable to ``[B, H, Sq, Sk]`` as the
    kernel's additive fp32 bias ``[B or 1, H or 1, Sq, Sk]`` (-inf where a bool mask is False)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{op}: attention_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    target = "[" + ", ".join(map(str, shape)) + "]"
    if mask.dim() > 4 or any(m not in (1, t) for m, t in zip(mask.shape[::-1], shape[::-1])):
        raise ValueError(
            f"{op}: attention_mask of shape {tuple(mask.shape)} does not broadcast to [B, H, Sq, Sk] = {target}"
        )
    if mask.device != device:
        raise ValueError(f"{op}: attention_mask is on {mask.device} but q is on {device}")
    if mask.dtype == torch.bool:
        bias = torch.full(mask.shape, float("-inf"), dtype=torch.float32, device=device).masked_fill(mask, 0.0)
    elif mask.dtype.is_floating_point:
        if mask.requires_grad:
            raise ValueError(
                f"{op}: a float attention_mask that requires grad is not supported "
                "(the kernel gives no gradient for the bias)"
            )
        bias = mask.to(torch.float32)
    else:
        raise TypeError(f"{op}: attention_mask must be bool (True keeps) or float (additive), got {mask.dtype}")
    bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    return bias.expand(bias.shape[0], bias.shape[1], shape[2], shape[3]).contiguous()


def _offsets(cu_seqlens: torch.Tensor) -> list[int]:
    return [int(x) for x in cu_seqlens.tolist()]


def check_cu_seqlens(op: str, name: str, cu_seqlens: torch.Tensor, total: int) -> list[int]:
    """``cu_seqlens`` as FlashAttention takes them: a 1-D int32 tensor of offsets that starts at 0, never
    decreases (an empty sequence is allowed) and ends at the token count. Returns the offsets."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"{op}: {name} must be a 1-D int32 tensor of at least 2 offsets (as FlashAttention "
            f"takes them), got shape {tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}"
        )
    offsets = _offsets(cu_seqlens)
    if offsets[0] != 0:
        raise ValueError(f"{op}: {name} must start at 0, got {offsets}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{op}: {name} must not decrease, got {offsets}")
    if offsets[-1] != total:
        raise ValueError(f"{op}: {name} ends at {offsets[-1]} but there are {total} tokens")
    return offsets


# --- the custom ops -------------------------------------------------------------------------------------


def _segments(cu_seqlens: torch.Tensor | None):
    if cu_seqlens is None:
        return None
    offsets = _offsets(cu_seqlens)
    return tuple(zip(offsets[:-1], offsets[1:]))


def _validate_op(q, k, v, bias, cu_seqlens) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor("flash_attn_fwd", name, t)
    if bias is not None:
        check_float_tensor("flash_attn_fwd", "bias", bias)
        if bias.dtype != torch.float32:
            raise TypeError(f"flash_attn_fwd: bias must be float32, got {bias.dtype}")
    _kernels.check_shapes(tuple(q.shape), tuple(k.shape), tuple(v.shape), None if bias is None else tuple(bias.shape))
    if cu_seqlens is not None and (q.shape[0] != 1 or q.shape[2] != k.shape[2]):
        raise ValueError(
            f"flash_attn_fwd: packed sequences need batch 1 and as many queries as keys, got q "
            f"{tuple(q.shape)} and k {tuple(k.shape)}"
        )


@define_op(f"{_NS}::flash_attn_fwd")
def flash_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool,
    window: int,
    softcap: float,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H, Sq, D] forward: (out in q's dtype, lse [B, H, Sq] fp32)."""
    _validate_op(q, k, v, bias, cu_seqlens)
    return launches.forward(
        _kernels.flash_attn_fwd,
        q,
        k,
        v,
        bias,
        float(scale),
        bool(causal),
        int(window),
        float(softcap),
        _segments(cu_seqlens),
        _kernels,
        MASKED_LOGIT,
    )


@flash_attn_fwd.register_fake
def _(q, k, v, bias, scale, causal, window, softcap, cu_seqlens):
    _validate_op(q, k, v, bias, cu_seqlens)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@define_op(f"{_NS}::flash_attn_bwd")
def flash_attn_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool,
    window: int,
    softcap: float,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: (dq, dk, dv), dk/dv per KV head (summed over the query heads of each group)."""
    dq, dk, dv = launches.backward(
        _kernels.flash_attn_bwd,
        grad_out.contiguous(),
        q,
        k,
        v,
        out,
        lse,
        bias,
        float(scale),
        bool(causal),
        int(window),
        float(softcap),
        _segments(cu_seqlens),
        _kernels,
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@flash_attn_bwd.register_fake
def _(grad_out, q, k, v, out, lse, bias, scale, causal, window, softcap, cu_seqlens):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, scale, causal, window, softcap, cu_seqlens = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bias, cu_seqlens)
    ctx.options = (scale, causal, window, softcap)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, bias, cu_seqlens = ctx.saved_tensors
    scale, causal, window, softcap = ctx.options
    dq, dk, dv = flash_attn_bwd(grad_out, q, k, v, out, lse, bias, scale, causal, window, softcap, cu_seqlens)
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd(f"{_NS}::flash_attn_fwd", _backward, setup_context=_setup_context)


def kernel_options(scale: float | None, head_dim: int, causal: bool, window, softcap) -> tuple:
    """The kernels' (scale, causal, window, softcap) arguments: the default scale 1/sqrt(D), 0 for none."""
    return (
        float(scale) if scale is not None else head_dim**-0.5,
        bool(causal),
        int(window or 0),
        float(softcap or 0.0),
    )


def decodes(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the decode kernel takes q ``[B, H, Sq, D]`` against k ``[B, Hkv, Sk, D]``: at most
    ``DECODE_MAX_QUERIES`` queries, head_dim and query rows per KV head within its limits."""
    sq, d = q.shape[2], q.shape[3]
    rows = (q.shape[1] // k.shape[1]) * sq
    return sq <= DECODE_MAX_QUERIES and rows <= _decode.MAX_GROUP_ROWS and d <= _decode.MAX_HEAD_DIM


def paged_fits(kv_heads: int, head_dim: int, element_size: int) -> bool:
    """Whether the paged decode kernel's loads fit SBUF on every target for a cache of ``kv_heads`` KV
    heads of ``head_dim`` elements of ``element_size`` bytes (``attention_decode.paged_fits``)."""
    return bool(_decode.paged_fits(kv_heads, head_dim, element_size))


def _ranges(key_ranges: list[int], batch: int) -> tuple[tuple[int, int], ...] | None:
    """The op's flat ``[start0, end0, start1, end1, ...]`` (empty: whole rows) as the kernel's pairs."""
    if not key_ranges:
        return None
    if len(key_ranges) != 2 * batch:
        raise ValueError(
            f"flash_decode_fwd: key_ranges needs a (start, end) pair per batch row ({batch}), got {key_ranges}"
        )
    return tuple(zip(key_ranges[0::2], key_ranges[1::2]))


def _validate_decode(q, k, v, key_ranges) -> tuple[tuple[int, int], ...] | None:
    """Check the op's arguments; returns the key ranges as the kernel's pairs."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor("flash_decode_fwd", name, t)
    _decode.check_shapes(tuple(q.shape), tuple(k.shape), tuple(v.shape))
    pairs = _ranges(key_ranges, q.shape[0])
    _decode.check_key_ranges(pairs, q.shape[0], k.shape[2], "flash_decode_fwd")
    return pairs


@define_op(f"{_NS}::flash_decode_fwd")
def flash_decode_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    window: int,
    softcap: float,
    key_ranges: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel: (out [B, H, Sq, D] in q's dtype, lse [B, H, Sq] fp32). ``key_ranges``: empty,
    or ``[start, end]`` per batch row, the cache positions the row attends to (aligned at ``end``)."""
    pairs = _validate_decode(q, k, v, key_ranges)
    return run_kernel(_decode.flash_decode_fwd, q, k, v, float(scale), bool(causal), int(window), float(softcap), pairs)


@flash_decode_fwd.register_fake
def _(q, k, v, scale, causal, window, softcap, key_ranges):
    _validate_decode(q, k, v, key_ranges)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _range_mask(q, sk, key_ranges, causal, window) -> torch.Tensor:
    """[B, 1, Sq, Sk] additive 0/-inf mask of what each decode row sees (its range, causal and window at
    the range's end): the decode forward's visibility, for the flash-attention backward kernel."""
    batch, sq = q.shape[0], q.shape[2]
    ranges = _ranges(key_ranges, batch) or ((0, sk),) * batch
    keep = torch.zeros(batch, 1, sq, sk, dtype=torch.bool, device=q.device)
    for b, (start, end) in enumerate(ranges):
        if end > start:
            # Aligned at the range's end: the slice's own bottom-right causal alignment and window.
            keep[b, 0, :, start:end] = _visible(sq, end - start, causal, window or None, None, q.device)
    return torch.zeros(keep.shape, device=q.device).masked_fill(~keep, float("-inf"))


def _setup_decode_context(ctx, inputs, output):
    q, k, v, scale, causal, window, softcap, key_ranges = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = (scale, causal, window, softcap, list(key_ranges))


def _decode_backward(ctx, grad_out, _grad_lse):
    """The flash-attention backward kernel, with the decode rows' visibility as a mask."""
    q, k, v, out, lse = ctx.saved_tensors
    scale, causal, window, softcap, key_ranges = ctx.options
    bias = _range_mask(q, k.shape[2], key_ranges, causal, window)
    dq, dk, dv = flash_attn_bwd(grad_out, q, k, v, out, lse, bias, scale, False, 0, softcap, None)
    return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd(f"{_NS}::flash_decode_fwd", _decode_backward, setup_context=_setup_decode_context)


# --- public functions -----------------------------------------------------------------------------------


def _validate_paged(q, k_slots, v_slots, block_table, block_size, lengths) -> None:
    for name, t in (("q", q), ("k_slots", k_slots), ("v_slots", v_slots)):
        check_float_tensor("flash_decode_paged_fwd", name, t)
    if block_table.dtype != torch.int32 or not block_table.is_contiguous():
        raise TypeError(
            f"flash_decode_paged_fwd: block_table must be a contiguous int32 tensor, got {block_table.dtype}"
        )
    batch, heads, sq, d = q.shape
    kv_heads = k_slots.shape[1] if k_slots.dim() == 3 else 0
    _decode.check_shapes(tuple(q.shape), (batch, kv_heads, 1, d), (batch, kv_heads, 1, d))
    _decode.check_paged(
        tuple(k_slots.shape), tuple(v_slots.shape), tuple(block_table.shape), block_size, lengths, batch
    )


@define_op(f"{_NS}::flash_decode_paged_fwd")
def flash_decode_paged_fwd(
    q: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    lengths: list[int],
    scale: float,
    causal: bool,
    window: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel against a paged cache (inference only, as FlashAttention's kvcache function):
    q [B, H, Sq, D], the cache's slots [blocks * block_size, Hkv, D], its block table [B, max_blocks]
    int32; row b attends to its first ``lengths[b]`` cached keys. Returns (out, lse) as ``flash_decode_fwd``."""
    _validate_paged(q, k_slots, v_slots, block_table, block_size, lengths)
    return run_kernel(
        _decode.flash_decode_paged_fwd,
        q,
        k_slots,
        v_slots,
        block_table,
        int(block_size),
        tuple(int(n) for n in lengths),
        float(scale),
        bool(causal),
        int(window),
        float(softcap),
    )


@flash_decode_paged_fwd.register_fake
def _(q, k_slots, v_slots, block_table, block_size, lengths, scale, causal, window, softcap):
    _validate_paged(q, k_slots, v_slots, block_table, block_size, lengths)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    return_lse: bool = False,
):
    """Attention with the NKI kernel. q ``[B, H, Sq, D]``, k/v ``[B, Hkv, Sk, D]`` -> ``[B, H, Sq, D]``.

    Args:
        attention_mask: None, a bool keep-mask (True attends) or an additive float mask, broadcastable
            to ``[B, H, Sq, Sk]``.
        scale: softmax scale, default ``1 / sqrt(D)``.
        causal: query ``i`` sees keys ``j <= i + Sk - Sq`` (the last query sees the last key).
        window: None/0, or sliding-window size: query ``i`` sees keys ``j > i + Sk - Sq - window``.
        softcap: None/0, or ``c`` for logits ``c * tanh(logits / c)``.
        dropout: must be 0.0 (the kernel has no dropout).
        return_lse: also return the log-sum-exp of each row's logits, ``[B, H, Sq]`` fp32 (no gradient).
    """
    op = "flash_attention"
    q, k, v = _autocast(q, k, v)
    _check_qkv(op, q, k, v, "B, H, S, D")
    _check_options(op, scale, window, softcap, dropout)
    batch, heads, sq, d = q.shape
    if attention_mask is None and decodes(q, k):
        return _run_decode(q, k, v, [], scale, causal, window, softcap, return_lse)
    bias = mask_to_bias(op, attention_mask, (batch, heads, sq, k.shape[2]), q.device)
    out, lse = flash_attn_fwd(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        bias,
        *kernel_options(scale, d, causal, window, softcap),
        None,
    )
    return (out, lse) if return_lse else out


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_ranges: list[tuple[int, int]],
    *,
    scale: float | None = None,
    causal: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
):
    """A few queries per sequence against a padded KV cache: row ``b`` of q ``[B, H, Sq, D]`` attends to
    the cache positions ``key_ranges[b] = (start, end)`` of k/v ``[B, Hkv, Sk, D]``, its queries being
    the last ``Sq`` positions before ``end`` (causal and window aligned there); a row with an empty
    range gets zeros. One launch of the decode kernel, which never reads keys outside the ranges, when
    it takes the shapes (:func:`decodes`); else one flash-attention launch per distinct range.
    """
    op = "decode_attention"
    q, k, v = _autocast(q, k, v)
    _check_qkv(op, q, k, v, "B, H, S, D")
    _check_options(op, scale, window, softcap, 0.0)
    _decode.check_key_ranges(key_ranges, q.shape[0], k.shape[2], op)
    if decodes(q, k):
        flat = [int(x) for pair in key_ranges for x in pair]
        return _run_decode(q, k, v, flat, scale, causal, window, softcap, return_lse)
    out = q.new_zeros(q.shape)
    lse = q.new_full(q.shape[:3], MASKED_LOGIT, dtype=torch.float32)
    rows_by_range: dict[tuple[int, int], list[int]] = {}
    for b, (start, end) in enumerate(key_ranges):
        rows_by_range.setdefault((int(start), int(end)), []).append(b)
    for (start, end), rows in rows_by_range.items():
        if end > start:
            index = torch.tensor(rows, device=q.device)
            out[index], lse[index] = flash_attention(
                q[index],
                k[index, :, start:end],
                v[index, :, start:end],
                scale=scale,
                causal=causal,
                window=window,
                softcap=softcap,
                return_lse=True,
            )
    return (out, lse) if return_lse else out


def _run_decode(q, k, v, flat_ranges, scale, causal, window, softcap, return_lse):
    out, lse = flash_decode_fwd(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        *kernel_options(scale, q.shape[3], causal, window, softcap),
        flat_ranges,
    )
    return (out, lse) if return_lse else out


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    return_lse: bool = False,
):
    """Packed variable-length sequences: q ``[total_q, H, D]``, k/v ``[total_k, Hkv, D]`` -> ``[total_q, H, D]``.

    Sequence ``i`` is queries ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` against keys
    ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]`` (causal and window apply within each, aligned bottom-right
    when a sequence has more keys than queries). Equal query and key sequences (prefill, packed training)
    run in one launch of the kernel's packed-sequence path; otherwise (prefill against a cache, decoding
    a padded batch) each sequence runs on its own. A sequence with queries but no key gives zeros.
    ``return_lse`` also returns the lse, ``[H, total_q]`` fp32.
    """
    op = "flash_attn_varlen"
    q, k, v = _autocast(q, k, v)
    _check_qkv(op, q, k, v, "total, H, D")
    _check_options(op, scale, window, softcap, dropout)
    offsets_q = check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, q.shape[0])
    offsets_k = check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if len(offsets_q) != len(offsets_k):
        raise ValueError(
            f"{op}: cu_seqlens_q holds {len(offsets_q) - 1} sequences but cu_seqlens_k {len(offsets_k) - 1}"
        )
    for name, offsets, value in (("max_seqlen_q", offsets_q, max_seqlen_q), ("max_seqlen_k", offsets_k, max_seqlen_k)):
        longest = max(b - a for a, b in zip(offsets, offsets[1:]))
        if int(value) < longest:
            raise ValueError(f"{op}: {name}={int(value)} is shorter than the longest sequence ({longest})")
    for name, cu_seqlens in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu_seqlens.device != q.device:
            raise ValueError(f"{op}: {name} is on {cu_seqlens.device} but q is on {q.device}")
    options = dict(scale=scale, causal=causal, window=window, softcap=softcap)
    if offsets_q == offsets_k:
        kept = [offsets_q[0]] + [b for a, b in zip(offsets_q, offsets_q[1:]) if b > a]  # empty sequences dropped
        out, lse = _packed(q, k, v, torch.tensor(kept, dtype=torch.int32, device=q.device), **options)
    else:
        out, lse = _sequence_by_sequence(q, k, v, offsets_q, offsets_k, **options)
    return (out, lse) if return_lse else out


def _packed(q, k, v, cu_seqlens, scale, causal, window, softcap):
    """One launch over sequences of equal query and key lengths, as the kernel's segments."""
    d = q.shape[-1]
    packed = [x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v)]  # [1, H, total, D]
    out, lse = flash_attn_fwd(
        *packed,
        None,
        *kernel_options(scale, d, causal, window, softcap),
        cu_seqlens,
    )
    return out.squeeze(0).transpose(0, 1).contiguous(), lse.squeeze(0)


def _sequence_by_sequence(q, k, v, offsets_q, offsets_k, scale, causal, window, softcap):
    """Each (query range, key range) pair on its own, causal aligned bottom-right."""
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(zip(offsets_q, offsets_q[1:]), zip(offsets_k, offsets_k[1:])):
        if q1 == q0:
            continue
        if k1 == k0:  # no key at all: zeros, as for any row that sees no key
            outs.append(q.new_zeros((q1 - q0,) + tuple(q.shape[1:])))
            lses.append(q.new_full((q.shape[1], q1 - q0), float("-inf"), dtype=torch.float32))
            continue
        out, lse = flash_attention(
            *(x.transpose(0, 1).unsqueeze(0) for x in (q[q0:q1], k[k0:k1], v[k0:k1])),
            scale=scale,
            causal=causal,
            window=window,
            softcap=softcap,
            return_lse=True,
        )
        outs.append(out.squeeze(0).transpose(0, 1))
        lses.append(lse.squeeze(0))
    if not outs:
        return q.new_zeros(q.shape), q.new_full((q.shape[1], 0), float("-inf"), dtype=torch.float32)
    return torch.cat(outs).contiguous(), torch.cat(lses, dim=1)


# --- pure-torch references ------------------------------------------------------------------------------


def _visible(sq: int, sk: int, causal: bool, window: int | None, segments, device) -> torch.Tensor:
    """[Sq, Sk] bool: which keys each query may see (before any mask/bias)."""
    offset = 0 if segments is not None else sk - sq
    i = torch.arange(sq, device=device)[:, None] + offset
    j = torch.arange(sk, device=device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        keep &= j <= i
    if window:
        keep &= j > i - window
    if segments is not None:
        ids = torch.zeros(sk, dtype=torch.long, device=device)
        for n, (start, end) in enumerate(segments):
            ids[start:end] = n
        keep &= ids[:, None] == ids[None, :]
    return keep


def _logits(q, k, scale, softcap):
    """Scaled (and softcapped) logits with K repeated per query-head group: [B, H, Sq, Sk]."""
    group = q.shape[1] // k.shape[1]
    s = torch.matmul(q, k.repeat_interleave(group, dim=1).transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    cu_seqlens: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Pure torch, the semantics of ``flash_attention`` (``[B, H, Sq, D]`` layout).

    Matmuls run in the inputs' dtype and the softmax in fp32, as transformers' eager attention does,
    so calling it on fp32 copies gives the exact answer and on bf16 inputs torch's own bf16 math.
    ``cu_seqlens`` (with B = 1 and Sq = Sk) restricts attention to packed sequences. A query row that
    sees no key (every logit -inf or below -1e30) gives zeros, and its lse is -inf. ``dropout`` (training only) follows sdpa.
    """
    sq, sk = q.shape[2], k.shape[2]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    segments = _segments(cu_seqlens)
    logits = _logits(q, k, scale, softcap).float()
    if attention_mask is not None:
        logits = (
            logits.masked_fill(~attention_mask, float("-inf"))
            if attention_mask.dtype == torch.bool
            else logits + attention_mask.float()
        )
    logits = logits.masked_fill(~_visible(sq, sk, causal, window, segments, q.device), float("-inf"))
    # As in the kernel, a row whose every logit is at or below -1e30 (-inf, or a float mask's
    # finfo.min) has seen no key.
    empty = logits.amax(dim=-1, keepdim=True) <= MASKED_LOGIT
    probs = torch.softmax(logits.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if dropout:
        probs = torch.nn.functional.dropout(probs, p=dropout)
    group = q.shape[1] // k.shape[1]
    out = torch.matmul(probs.to(v.dtype), v.repeat_interleave(group, dim=1))
    if return_lse:
        return out, torch.logsumexp(logits, dim=-1)
    return out


def attention_backward_reference(q, k, v, out, grad_out, lse, bias, scale, causal, window, softcap, segments):
    """Pure torch, the NKI backward kernel's signature and result: (dq, dk, dv), dk/dv summed per KV head.

    Uses the forward's ``lse`` (fp32) to rebuild the probabilities, as a flash backward does; all math
    in fp32, results in the inputs' dtypes.
    """
    f32 = [t.float() for t in (q, k, v, out, grad_out)]
    qf, kf, vf, of, gf = f32
    batch, heads, sq, d = q.shape
    kv_heads, sk = k.shape[1], k.shape[2]
    group = heads // kv_heads
    raw = torch.matmul(qf, kf.repeat_interleave(group, dim=1).transpose(-1, -2)) * scale
    capped = torch.tanh(raw / softcap) if softcap else None
    logits = softcap * capped if softcap else raw
    if bias is not None:
        logits = logits + bias.float()
    logits = logits.masked_fill(~_visible(sq, sk, causal, window, segments, q.device), float("-inf"))
    probs = torch.exp(logits - lse.float().clamp(min=MASKED_LOGIT)[..., None])
    dv = torch.matmul(probs.transpose(-1, -2), gf)
    dprobs = torch.matmul(gf, vf.repeat_interleave(group, dim=1).transpose(-1, -2))
    dlogits = probs * (dprobs - (gf * of).sum(-1, keepdim=True))
    if softcap:
        dlogits = dlogits * (1.0 - capped * capped)
    dq = torch.matmul(dlogits, kf.repeat_interleave(group, dim=1)) * scale
    dk = torch.matmul(dlogits.transpose(-1, -2), qf) * scale

    def per_kv_head(x):
        return x.reshape(batch, kv_heads, group, sk, d).sum(dim=2)

    return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


__all__ = [
    "MAX_HEAD_DIM",
    "attention_backward_reference",
    "attention_reference",
    "flash_attention",
    "flash_attn_bwd",
    "flash_attn_fwd",
    "flash_attn_varlen",
    "mask_to_bias",
    "paged_fits",
]
