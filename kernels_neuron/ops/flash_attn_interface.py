"""transformers' attention-function contract and the FlashAttention-2 functional API on the NKI kernel.

- ``flash_attn_forward`` + ``supports_flash_attn``: the attention function transformers registers for a
  kernel repo (``attn_implementation="org/repo"``) or that ``AttentionInterface.register`` takes, with
  sdpa-style masks: ``(module, query [B, H, Sq, D], key [B, Hkv, Sk, D], value, attention_mask,
  dropout, scaling, is_causal, **kwargs) -> (out [B, Sq, H, D], None)``.
- ``flash_attn_func`` / ``flash_attn_varlen_func`` / ``flash_attn_with_kvcache``: FlashAttention-2's
  functions (``[B, S, H, D]`` and packed ``[total, H, D]`` layouts), which transformers' flash-attention
  path calls (with unpadding, ``cu_seqlens`` and ``window_size``) when a repo exports them.

Causal masks are aligned bottom-right when there are more keys than queries (the last query sees the
last key), as in FlashAttention >= 2.1 and transformers. FA2's ``window_size=(left, right)`` counts keys
left of the query, so it is the kernel's window ``left + 1``; a right window needs ``causal=True``.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

from ._backend import SUPPORTED_FLOAT_DTYPES, autocast_dtype, check_float_tensor, is_dtensor
from .attention import (
    DECODE_MAX_QUERIES,
    MAX_HEAD_DIM,
    _check_options,
    decode_attention,
    decodes,
    flash_attention,
    flash_attn_varlen,
    flash_decode_paged_fwd,
    kernel_options,
    paged_fits,
)

_Result = TypeVar("_Result")

_OP = "flash_attn_forward"


# --- transformers' attention function -------------------------------------------------------------------


def unsupported_reasons(
    module: torch.nn.Module | None = None,
    training: bool = False,
    query: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    dropout: float = 0.0,
    s_aux: torch.Tensor | None = None,
) -> list[str]:
    """Why the kernel cannot serve this transformers attention module (empty when it can); given the
    call's tensors and options, also why it cannot serve that call."""
    reasons = _call_reasons(query, key, value, dropout, s_aux)
    if module is None:
        return reasons
    config = getattr(module, "config", None)
    head_dim = getattr(module, "head_dim", None) or getattr(config, "head_dim", None)
    if head_dim is not None and head_dim > MAX_HEAD_DIM:
        reasons.append(f"head_dim {head_dim} is above the kernel's limit of {MAX_HEAD_DIM}")
    v_head_dim = getattr(module, "v_head_dim", None)
    qk_head_dim = getattr(module, "qk_head_dim", head_dim)
    if v_head_dim is not None and qk_head_dim is not None and v_head_dim != qk_head_dim:
        reasons.append(f"value head dim {v_head_dim} differs from the query/key head dim {qk_head_dim}")
    if getattr(module, "sinks", None) is not None:
        reasons.append("attention sinks (s_aux) are not supported")
    if training and not dropout:
        dropout = float(getattr(module, "attention_dropout", 0.0) or 0.0)
        if dropout > 0:
            reasons.append(f"attention dropout {dropout} in training: the kernel has no dropout")
    return list(dict.fromkeys(reasons))  # the module and the call can give the same reason (head_dim, sinks)


def _call_reasons(query, key, value, dropout, s_aux) -> list[str]:
    reasons = [f"dropout {dropout}: the kernel has no dropout"] if dropout else []
    if s_aux is not None:
        reasons.append("attention sinks (s_aux) are not supported")
    tensors = [(name, t) for name, t in (("query", query), ("key", key), ("value", value)) if t is not None]
    for name, tensor in tensors:
        if is_dtensor(tensor):
            reasons.append(f"the {name} is a DTensor")
        elif tensor.dtype not in SUPPORTED_FLOAT_DTYPES:
            reasons.append(f"the {name} has dtype {tensor.dtype} (the kernel takes float32, bfloat16, float16)")
    if query is not None and query.shape[-1] > MAX_HEAD_DIM:
        reasons.append(f"head_dim {query.shape[-1]} is above the kernel's limit of {MAX_HEAD_DIM}")
    if key is not None and value is not None and key.shape[-1] != value.shape[-1]:
        reasons.append(f"value head dim {value.shape[-1]} differs from the key head dim {key.shape[-1]}")
    return reasons


def supports_flash_attn(module: torch.nn.Module | None = None, training: bool = False) -> bool:
    """Whether ``flash_attn_forward`` can serve ``module`` (transformers only checks that this exists)."""
    return not unsupported_reasons(module, training)


def flash_attn_forward(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract, with the masks of ``masking_utils.sdpa_mask``.

    ``attention_mask`` is None or a bool keep-mask (or additive float mask) broadcastable to
    ``[B, H, Sq, Sk]``. A mask already holds causality, the sliding window and padding; None means
    "causal (for more than one query) and nothing else", exactly as for transformers' sdpa function:
    then ``sliding_window`` (from kwargs, else ``module.sliding_window``) applies too, and keys beyond
    the queries of an empty static cache are dropped. ``softcap`` is taken from kwargs, where
    transformers passes it (Gemma2's ``attn_logit_softcapping``); a module attribute transformers does
    not pass (Gemma3's) is ignored, as transformers ignores it.

    Packed sequences (``cu_seq_lens_q/k``, or ``position_ids`` that restart, in a batch of one) and
    left-padded batches run on the kernel's packed-sequence path, right-padded ones causal with the
    padding as a bias, whenever the mask says exactly that (see "packed sequences" below).
    """
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{_OP}: attention sinks (s_aux) are not supported")
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"{_OP}: a position_bias is not supported")
    if kwargs.get("cache") is not None:
        raise ValueError(f"{_OP}: a paged (continuous-batching) cache is not supported here")
    if kwargs.get("output_attentions", False):
        warnings.warn(f"{_OP}: attention weights are not returned (output_attentions=True is ignored)", stacklevel=2)
    softcap = kwargs.get("softcap")
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    sq, sk = query.shape[2], key.shape[2]
    packed = _packed_sequences(
        query, key, attention_mask, bool(is_causal), int(window or 0) if is_causal else 0, kwargs
    )
    if packed is not None:
        return _packed_attention(query, key, value, packed, scaling, bool(is_causal), window, softcap, dropout), None
    runs = _padding_runs(attention_mask, sq, sk, int(window or 0)) if is_causal else None
    if runs is not None and sq == sk and all(end == sk for _, end in runs):  # left padding: the valid tokens, packed
        return _unpadded_attention(query, key, value, runs, scaling, window, softcap, dropout), None
    if runs is not None and sq <= DECODE_MAX_QUERIES and all(end == sk or sq == 1 for _, end in runs):
        return _attention_over_runs(query, key, value, runs, scaling, window, softcap, dropout), None
    if runs is not None:  # right padding: causal tiles skipped, the padded keys masked by a bias
        return _causal_with_padded_keys(query, key, value, runs, scaling, window, softcap, dropout), None
    if attention_mask is None:
        causal = bool(is_causal) and sq > 1
        if causal and sk > sq:  # prefill into an empty static cache: sdpa's top-left causal mask
            key, value = key[:, :, :sq], value[:, :, :sq]
        window = int(window) if causal and window else None
    else:
        causal, window = False, None  # the mask has it all
    out = flash_attention(
        query,
        key,
        value,
        attention_mask=attention_mask,
        scale=scaling,
        causal=causal,
        window=window,
        softcap=softcap,
        dropout=dropout,
    )
    return out.transpose(1, 2).contiguous(), None


# --- packed sequences and padding as sequences -----------------------------------------------------------
# Packed and padded batches arrive as dense masks; the kernel runs them faster as sequences it can skip
# whole key tiles of. Each route is taken only when the mask says exactly that (checked against it), so
# it computes what the mask says. A model calls the attention function once per layer with the same
# mask, so the check is made once per mask (``_once_per_mask``).

_last_check: list = []  # [mask weakref, mask version, key, result] of the latest check


def _once_per_mask(mask: torch.Tensor, key: tuple, check: Callable[[], _Result]) -> _Result:
    """``check()``, or its result for this same mask (unchanged since) and key."""
    version = mask._version
    if _last_check and _last_check[0]() is mask and _last_check[1:3] == [version, key]:
        return _last_check[3]
    result = check()
    _last_check[:] = [weakref.ref(mask), version, key, result]
    return result


def _visible(sq: int, sk: int, causal: bool, window: int, device) -> torch.Tensor:
    """[Sq, Sk] bool: causal (bottom-right) within ``window``, as transformers' masks build it."""
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    visible = (j <= i) if causal else torch.ones(sq, sk, dtype=torch.bool, device=device)
    return visible & (j > i - window) if window else visible


def _packed_sequences(query, key, attention_mask, causal: bool, window: int, kwargs) -> torch.Tensor | None:
    """cu_seqlens of the sequences packed into a batch of one, when the bool mask is exactly those
    sequences attending within themselves (causal and window as for the model): from transformers'
    ``cu_seq_lens_q/k`` (TRL's padding-free batches), else from ``position_ids`` that restart (as
    transformers' masks read them: a new sequence wherever the position does not grow by 1). None
    otherwise, and while torch.compile traces (the sequences are data)."""
    total = query.shape[2]
    if (
        query.shape[0] != 1
        or key.shape[2] != total
        or attention_mask is None
        or attention_mask.dtype != torch.bool
        or tuple(attention_mask.shape) != (1, 1, total, total)
        or torch.compiler.is_compiling()
    ):
        return None
    cu_q, cu_k, positions = (kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k", "position_ids"))
    if cu_q is not None and cu_k is not None:
        if cu_q.shape != cu_k.shape or not torch.equal(cu_q, cu_k) or int(cu_q[0]) != 0 or int(cu_q[-1]) != total:
            return None
        cu = cu_q.to(torch.int32)
    elif positions is not None and positions.numel() == total:
        starts = (positions.reshape(-1).diff() != 1).nonzero().reshape(-1) + 1
        edges = torch.tensor([0, total], device=starts.device)
        cu = torch.cat([edges[:1], starts, edges[1:]]).to(torch.int32)
    else:
        return None
    if cu.numel() < 3:  # one sequence: the plain causal path is the same
        return None

    def check() -> bool:
        lengths = cu[1:] - cu[:-1]
        ids = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths.long())
        same = ids[:, None] == ids[None, :]
        return torch.equal(attention_mask[0, 0], same & _visible(total, total, causal, window, same.device))

    return cu if _once_per_mask(attention_mask, ("packed", cu.tolist(), causal, window), check) else None


def _packed_attention(query, key, value, cu_seqlens, scaling, causal, window, softcap, dropout) -> torch.Tensor:
    """[1, H, S, D] packed sequences through the kernel's sequence path -> [1, S, H, D]."""
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    out = flash_attn_varlen(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        longest,
        longest,
        scale=scaling,
        causal=causal,
        window=int(window) if causal and window else None,
        softcap=softcap,
        dropout=dropout,
    )
    return out.unsqueeze(0)


def _padding_runs(mask, sq: int, sk: int, window: int) -> list[tuple[int, int]] | None:
    """Per batch row the run ``[start, end)`` of keys a padding mask keeps, when the bool mask
    ``[B, 1, Sq, Sk]`` is exactly causal (bottom-right, within ``window``) and those keys; else None."""
    if (
        mask is None
        or mask.dtype != torch.bool
        or mask.dim() != 4
        or mask.shape[1] != 1
        or tuple(mask.shape[2:]) != (sq, sk)
        or torch.compiler.is_compiling()
    ):
        return None

    def check() -> list[tuple[int, int]] | None:
        kept = mask[:, 0].any(dim=1)  # [B, Sk]
        if not torch.equal(mask[:, 0], _visible(sq, sk, True, window, mask.device)[None] & kept[:, None, :]):
            return None
        runs = []
        for row in kept:
            indices = row.nonzero().reshape(-1)
            if indices.numel() == 0 or int(indices[-1] - indices[0]) + 1 != indices.numel():
                return None  # no key, or kept keys with a gap
            runs.append((int(indices[0]), int(indices[-1]) + 1))
        return runs

    return _once_per_mask(mask, ("padding", sq, sk, window), check)


def _unpadded_attention(query, key, value, runs, scaling, window, softcap, dropout) -> torch.Tensor:
    """[B, H, S, D] with row b's tokens ``runs[b]`` kept (left padding) through the sequence path, as
    transformers' flash-attention path unpads: padded queries see no key, and get zeros -> [B, S, H, D]."""
    batch, heads, seq, d = query.shape
    rows = torch.cat([torch.arange(b * seq + start, b * seq + end) for b, (start, end) in enumerate(runs)])
    rows = rows.to(query.device)
    q, k, v = (x.transpose(1, 2).reshape(batch * seq, x.shape[1], d)[rows] for x in (query, key, value))
    lengths = torch.tensor([0] + [end - start for start, end in runs])
    cu = lengths.cumsum(0).to(torch.int32).to(query.device)
    longest = int(lengths.max())
    packed = flash_attn_varlen(
        q,
        k,
        v,
        cu,
        cu,
        longest,
        longest,
        scale=scaling,
        causal=True,
        window=int(window) if window else None,
        softcap=softcap,
        dropout=dropout,
    )
    out = packed.new_zeros(batch * seq, heads, d)
    out[rows] = packed
    return out.reshape(batch, seq, heads, d)


def _attention_over_runs(query, key, value, runs, scaling, window, softcap, dropout) -> torch.Tensor:
    """Decoding against a left-padded or static cache: each row's queries against only its kept keys
    ``runs[b] = [start, end)`` (:func:`decode_attention`: one launch of the decode kernel, which never
    reads the keys outside the runs) -> [B, Sq, H, D]. Exact where the caller takes it: a run that ends
    at the last key keeps the causal alignment and window of the whole row; a single query sees every
    key of its run (the mask check put them all inside its causal window)."""
    _check_options(_OP, scaling, window, softcap, dropout)
    out = decode_attention(query, key, value, runs, scale=scaling, causal=True, window=window, softcap=softcap)
    return out.transpose(1, 2).contiguous()


def _causal_with_padded_keys(query, key, value, runs, scaling, window, softcap, dropout) -> torch.Tensor:
    """[B, H, Sq, D], causal, with only row b's keys ``runs[b]`` kept -> [B, Sq, H, D]: the padding as a
    [B, 1, 1, Sk] keep-mask, so the kernel still skips the key tiles above the diagonal."""
    keys_kept = torch.zeros(len(runs), 1, 1, key.shape[2], dtype=torch.bool, device=query.device)
    for b, (start, end) in enumerate(runs):
        keys_kept[b, ..., start:end] = True
    out = flash_attention(
        query,
        key,
        value,
        attention_mask=keys_kept,
        scale=scaling,
        causal=True,
        window=int(window) if window else None,
        softcap=softcap,
        dropout=dropout,
    )
    return out.transpose(1, 2).contiguous()


# --- FlashAttention-2's functions -----------------------------------------------------------------------


def _window(window_size, causal: bool, op: str) -> int | None:
    """FA2's ``(left, right)`` window (-1 = unbounded) as the kernel's window (keys per query)."""
    pair = tuple(window_size) if isinstance(window_size, (tuple, list)) else None
    if pair is None or len(pair) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair):
        raise ValueError(
            f"{op}: window_size must be a (left, right) pair of ints, -1 for unbounded (e.g. (4095, 0) "
            f"for a 4096-key sliding window), got {window_size!r}"
        )
    left, right = pair
    if right >= 0 and not causal:
        raise ValueError(
            f"{op}: a right window (window_size={tuple(window_size)}) is only supported with "
            "causal=True; the kernel bounds keys on the left only"
        )
    return left + 1 if left >= 0 else None


def _unsupported(op: str, **options) -> None:
    for name, value in options.items():
        if value is not None:
            raise ValueError(f"{op}: {name} is not supported")


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    s_aux: torch.Tensor | None = None,
):
    """FA2 ``flash_attn_func``: q ``[B, Sq, H, D]``, k/v ``[B, Sk, Hkv, D]`` -> ``[B, Sq, H, D]``.

    With ``return_attn_probs`` returns ``(out, softmax_lse [B, H, Sq], None)``.
    """
    op = "flash_attn_func"
    _unsupported(op, alibi_slopes=alibi_slopes, s_aux=s_aux)
    out, lse = flash_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        scale=softmax_scale,
        causal=causal,
        window=_window(window_size, causal, op),
        softcap=softcap or None,
        dropout=dropout_p,
        return_lse=True,
    )
    out = out.transpose(1, 2).contiguous()
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    s_aux: torch.Tensor | None = None,
):
    """FA2 ``flash_attn_varlen_func``: packed q ``[total_q, H, D]``, k/v ``[total_k, Hkv, D]``.

    ``cu_seqlens_q``/``cu_seqlens_k`` are validated as FlashAttention takes them (1-D int32, from 0,
    non-decreasing, ending at the token counts, as many sequences in both, ``max_seqlen_*`` at least
    the longest). Equal query and key sequences run in one launch; otherwise (a prefill against a
    cache, decoding a padded batch) each sequence runs on its own, causal aligned bottom-right.
    With ``return_attn_probs`` returns ``(out, softmax_lse [H, total_q], None)``.
    """
    op = "flash_attn_varlen_func"
    _unsupported(op, alibi_slopes=alibi_slopes, s_aux=s_aux)
    out, lse = flash_attn_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        scale=softmax_scale,
        causal=causal,
        window=_window(window_size, causal, op),
        softcap=softcap or None,
        dropout=dropout_p,
        return_lse=True,
    )
    return (out, lse, None) if return_attn_probs else out


def _cache_positions(
    k_cache: torch.Tensor, block_table: torch.Tensor | None, b: int, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache row, slot) of logical positions of sequence ``b``: a paged cache maps them through ``block_table``."""
    if block_table is None:
        return torch.full_like(positions, b), positions
    block_size = k_cache.shape[1]
    return block_table[b].long()[positions // block_size], positions % block_size


def _check_kvcache(op: str, q, k_cache, v_cache, k, v, cache_seqlens, block_table) -> list[int]:
    """Every argument of ``flash_attn_with_kvcache`` before anything is written into the cache; returns
    each sequence's cached length."""
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if tensor is not None and (not isinstance(tensor, torch.Tensor) or tensor.dim() != 4):
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{op}: {name} must be a 4-D tensor, got {shape}")
    if (k is None) != (v is None):
        raise ValueError(f"{op}: give both k and v, or neither")
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if tensor is not None:
            check_float_tensor(op, name, tensor, contiguous=False)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    devices = {t.device for t in (q, k_cache, v_cache, k, v, block_table, cache_seqlens) if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError(f"{op}: the tensors are on different devices: {sorted(map(str, devices))}")
    if autocast_dtype(q) is None and q.dtype != k_cache.dtype:
        raise TypeError(f"{op}: q has dtype {q.dtype} but the cache {k_cache.dtype}; they must match")
    batch, d = q.shape[0], q.shape[3]
    if d > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head_dim {d} is above the kernel's limit of {MAX_HEAD_DIM}")
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != d or q.shape[2] % kv_heads:
        raise ValueError(
            f"{op}: q {tuple(q.shape)} [B, Sq, H, D] does not fit the cache {tuple(k_cache.shape)} "
            "[.., .., Hkv, D] (same D, H a multiple of Hkv)"
        )
    if block_table is None:
        capacity = k_cache.shape[1]
        if k_cache.shape[0] < batch:
            raise ValueError(f"{op}: q has a batch of {batch} but k_cache holds {k_cache.shape[0]} sequences")
    else:
        if (
            block_table.dim() != 2
            or block_table.dtype not in (torch.int32, torch.int64)
            or block_table.shape[0] != batch
        ):
            raise ValueError(
                f"{op}: block_table must be a 2-D int32 (or int64) tensor [batch={batch}, max_blocks], got shape "
                f"{tuple(block_table.shape)} and dtype {block_table.dtype}"
            )
        capacity = k_cache.shape[1] * block_table.shape[1]
    new = 0
    if k is not None:
        new = k.shape[1]
        if k.shape != v.shape or k.shape[0] != batch or tuple(k.shape[2:]) != tuple(k_cache.shape[2:]):
            raise ValueError(
                f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must both be [batch={batch}, S_new, {kv_heads}, {d}]"
            )
    if cache_seqlens is None:
        if k is not None:
            raise ValueError(f"{op}: cache_seqlens is needed to append k and v to the cache")
        lengths = [capacity] * batch
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        lengths = [cache_seqlens] * batch
    elif (
        isinstance(cache_seqlens, torch.Tensor)
        and not cache_seqlens.is_floating_point()
        and cache_seqlens.numel() == batch
    ):
        lengths = [int(x) for x in cache_seqlens.reshape(-1).tolist()]
    else:
        raise ValueError(
            f"{op}: cache_seqlens must be an int or an int tensor of {batch} lengths, got {cache_seqlens!r}"
        )
    if any(length < 0 or length + new > capacity for length in lengths):
        raise ValueError(f"{op}: cache_seqlens {lengths} plus {new} new tokens do not fit the cache of {capacity}")
    if block_table is not None:  # only the blocks a sequence reads must exist; the entries past it are unused
        blocks = k_cache.shape[0]
        for b, length in enumerate(lengths):
            used = block_table[b, : (length + new + k_cache.shape[1] - 1) // k_cache.shape[1]]
            if used.numel() and (int(used.min()) < 0 or int(used.max()) >= blocks):
                raise ValueError(
                    f"{op}: block_table[{b}] names blocks {used.tolist()} for its {length + new} "
                    f"tokens, outside the cache's 0..{blocks - 1}"
                )
    return lengths


def _reads_pages(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the paged decode kernel reads a paged cache ``[blocks, block_size, Hkv, D]`` itself: few
    queries (``decodes``), the query in the cache's dtype, a contiguous cache, and its loads within
    SBUF on every target (``paged_fits``: a cache with many KV heads of a large head_dim is gathered
    by torch instead)."""
    kv_heads, d = k_cache.shape[2], k_cache.shape[3]
    return (
        query.dtype == k_cache.dtype
        and k_cache.is_contiguous()
        and decodes(query, k_cache.transpose(1, 2))
        and paged_fits(kv_heads, d, k_cache.element_size())
    )


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size=(-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    s_aux: torch.Tensor | None = None,
):
    """FA2 ``flash_attn_with_kvcache``: q ``[B, Sq, H, D]`` against a KV cache, ``[B, S_cache, Hkv, D]``
    or paged ``[blocks, block_size, Hkv, D]`` with ``block_table [B, max_blocks]``.

    ``k``/``v`` ``[B, S_new, Hkv, D]``, when given, are written into the cache (in place) after the
    ``cache_seqlens`` tokens already there, and attended to. Sequence ``b`` then attends to its first
    ``cache_seqlens[b] (+ S_new)`` cached keys, causally aligned bottom-right. Every argument is checked
    before the cache is written; a paged sequence reads only the blocks its length covers (entries of
    ``block_table`` past them are unused and may be anything). With ``return_softmax_lse`` returns
    ``(out, softmax_lse [B, H, Sq])``.

    Up to 16 queries run the decode kernel in one launch for the batch: a dense cache with each row's
    length as its key range, a paged one read by the kernel through ``block_table`` (gather DMAs; the
    query in the cache's dtype and the cache contiguous, else torch gathers the blocks first).
    """
    op = "flash_attn_with_kvcache"
    _unsupported(
        op,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        alibi_slopes=alibi_slopes,
        s_aux=s_aux,
    )
    lengths = _check_kvcache(op, q, k_cache, v_cache, k, v, cache_seqlens, block_table)
    window = _window(window_size, causal, op)
    _check_options(op, softmax_scale, window, softcap or None, 0.0)
    batch = q.shape[0]
    new = 0 if k is None else k.shape[1]
    totals = [length + new for length in lengths]
    longest = max(totals)
    kv_heads, d = k_cache.shape[2], k_cache.shape[3]
    if k is not None and v is not None:  # _check_kvcache: both or neither
        for b, length in enumerate(lengths):
            rows, slots = _cache_positions(
                k_cache, block_table, b, torch.arange(length, totals[b], device=k_cache.device)
            )
            k_cache[rows, slots] = k[b].to(k_cache.dtype)
            v_cache[rows, slots] = v[b].to(v_cache.dtype)
    query = q.transpose(1, 2)
    if longest == 0:  # nothing cached and nothing new: no key to see
        out = torch.zeros_like(query)
        lse = query.new_full(query.shape[:3], float("-inf"), dtype=torch.float32)
    elif block_table is not None and _reads_pages(query, k_cache):  # the kernel gathers the blocks itself
        out, lse = flash_decode_paged_fwd(
            query.contiguous(),
            k_cache.view(-1, kv_heads, d),
            v_cache.view(-1, kv_heads, d),
            block_table.to(torch.int32).contiguous(),
            k_cache.shape[1],
            totals,
            *kernel_options(softmax_scale, d, causal, window, softcap),
        )
    else:
        if block_table is None:
            keys, values = k_cache[:batch, :longest], v_cache[:batch, :longest]
        else:  # a paged cache the decode kernel does not take: each sequence's blocks gathered by torch
            keys = k_cache.new_zeros(batch, longest, kv_heads, d)
            values = v_cache.new_zeros(batch, longest, kv_heads, d)
            for b, total in enumerate(totals):
                rows, slots = _cache_positions(k_cache, block_table, b, torch.arange(total, device=k_cache.device))
                keys[b, :total], values[b, :total] = k_cache[rows, slots], v_cache[rows, slots]
        out, lse = decode_attention(
            query,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            [(0, total) for total in totals],
            scale=softmax_scale,
            causal=causal,
            window=window,
            softcap=softcap or None,
            return_lse=True,
        )
    empty = [b for b, total in enumerate(totals) if total == 0]
    if empty:  # an empty sequence's lse is -inf, as FlashAttention gives it
        lse[empty] = float("-inf")
    out = out.transpose(1, 2).contiguous()
    return (out, lse) if return_softmax_lse else out


__all__ = [
    "flash_attn_forward",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "supports_flash_attn",
    "unsupported_reasons",
]
