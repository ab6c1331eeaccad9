"""The neuron-flash-attn repo's transformers and FlashAttention-2 APIs (kernels_neuron/ops/
flash_attn_interface.py, shipped as is): transformers' attention-function contract against transformers'
own sdpa function, and FA2's flash_attn_func / flash_attn_varlen_func / flash_attn_with_kvcache against
the reference, including the layouts, window_size conventions and KV-cache bookkeeping."""

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kernels_neuron import sim
from kernels_neuron.ops.attention import attention_reference
from kernels_neuron.ops.flash_attn_interface import (
    flash_attn_forward,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    supports_flash_attn,
    unsupported_reasons,
)

TOL = dict(rtol=1e-5, atol=2e-5)


def _randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


class FakeAttention(nn.Module):
    """What a transformers attention module gives the attention function."""

    def __init__(self, heads=4, kv_heads=2, head_dim=64, sliding_window=None, is_causal=True, dropout=0.0):
        super().__init__()
        self.num_key_value_groups, self.head_dim, self.is_causal = heads // kv_heads, head_dim, is_causal
        self.sliding_window, self.attention_dropout = sliding_window, dropout


def _sdpa_mask(batch, sq, sk, pads, window=None):
    """transformers-style bool mask [B, 1, Sq, Sk]: causal aligned bottom-right, left padding, window."""
    position = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None]
    keep = (j <= position) & (j > position - window if window else True)
    keep = keep[None, None].repeat(batch, 1, 1, 1)
    for b, pad in enumerate(pads):
        keep[b, ..., :pad] = False
    return keep


# --- transformers' attention function ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "sq, sk, pads, window", [(16, 16, [0, 5], None), (1, 24, [0, 5], None), (6, 24, [3, 0], 8), (16, 16, [0, 0], 6)]
)
def test_flash_attn_forward_with_an_sdpa_mask_matches_transformers_sdpa(sq, sk, pads, window):
    module = FakeAttention(sliding_window=window)
    q, k, v = _randn(2, 4, sq, 64, seed=1), _randn(2, 2, sk, 64, seed=2), _randn(2, 2, sk, 64, seed=3)
    mask = _sdpa_mask(2, sq, sk, pads, window)
    out, weights = flash_attn_forward(module, q, k, v, mask, scaling=0.1, sliding_window=window)
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.1)
    assert weights is None and out.shape == (2, sq, 4, 64) and out.is_contiguous()
    seen = mask.any(-1)[:, 0]  # [B, Sq]; sdpa gives NaN where we give zeros
    torch.testing.assert_close(out[seen], expected[seen], **TOL)
    assert torch.all(out[~seen] == 0)


@pytest.mark.parametrize("sq, sk", [(16, 16), (1, 30), (12, 40)], ids=["prefill", "decode", "static-cache-prefill"])
def test_flash_attn_forward_without_a_mask_matches_transformers_sdpa(sq, sk):
    """None means causal for several queries (an empty static cache's extra keys are dropped, as sdpa's
    top-left causal mask does), and all keys for one query."""
    module = FakeAttention()
    q, k, v = _randn(2, 4, sq, 64, seed=1), _randn(2, 2, sk, 64, seed=2), _randn(2, 2, sk, 64, seed=3)
    out, _ = flash_attn_forward(module, q, k, v, None)
    expected, _ = sdpa_attention_forward(module, q, k, v, None)
    torch.testing.assert_close(out, expected, **TOL)
    non_causal, _ = flash_attn_forward(FakeAttention(is_causal=False), q, k, v, None)
    torch.testing.assert_close(non_causal, attention_reference(q, k, v).transpose(1, 2), **TOL)


def test_flash_attn_forward_takes_softcap_and_window_where_transformers_passes_them():
    q, k, v = _randn(1, 4, 20, 64, seed=1), _randn(1, 2, 20, 64, seed=2), _randn(1, 2, 20, 64, seed=3)
    expected = attention_reference(q, k, v, causal=True, window=5, softcap=0.5, scale=0.2).transpose(1, 2)
    # Gemma2: softcap and sliding_window as keyword arguments (mask None: nothing else carries the window)
    out, _ = flash_attn_forward(FakeAttention(), q, k, v, None, scaling=0.2, softcap=0.5, sliding_window=5)
    torch.testing.assert_close(out, expected, **TOL)
    # no sliding_window keyword: the module's attribute
    out, _ = flash_attn_forward(FakeAttention(sliding_window=5), q, k, v, None, scaling=0.2, softcap=0.5)
    torch.testing.assert_close(out, expected, **TOL)
    # an explicit sliding_window=None (a Gemma2 full-attention layer) wins over the attribute
    out, _ = flash_attn_forward(
        FakeAttention(sliding_window=5), q, k, v, None, scaling=0.2, softcap=0.5, sliding_window=None
    )
    torch.testing.assert_close(
        out, attention_reference(q, k, v, causal=True, softcap=0.5, scale=0.2).transpose(1, 2), **TOL
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"s_aux": torch.zeros(4)}, "attention sinks"),
        ({"dropout": 0.1}, "dropout is not supported"),
        ({"position_bias": torch.zeros(1, 4, 8, 8)}, "position_bias"),
    ],
)
def test_flash_attn_forward_refuses_what_it_cannot_do(kwargs, match):
    q = _randn(1, 4, 8, 64)
    with pytest.raises(ValueError, match=match):
        flash_attn_forward(FakeAttention(), q, q[:, :2], q[:, :2], None, **kwargs)


def test_unsupported_reasons_and_supports_flash_attn():
    assert supports_flash_attn() and supports_flash_attn(FakeAttention())
    assert unsupported_reasons(FakeAttention(head_dim=320)) == ["head_dim 320 is above the kernel's limit of 256"]
    sinks = FakeAttention()
    sinks.sinks = nn.Parameter(torch.zeros(4))
    assert unsupported_reasons(sinks) == ["attention sinks (s_aux) are not supported"]
    dropout = FakeAttention(dropout=0.1)
    assert supports_flash_attn(dropout) and not supports_flash_attn(dropout, training=True)
    assert "attention dropout 0.1 in training" in unsupported_reasons(dropout, training=True)[0]


# --- FlashAttention-2's functions ---------------------------------------------------------------------------


def _bshd(x):
    return x.transpose(1, 2)  # [B, H, S, D] <-> [B, S, H, D]


@pytest.mark.parametrize(
    "causal, window_size, window",
    [(True, (-1, -1), None), (True, (4, 4), 5), (True, (4, 0), 5), (False, (-1, -1), None), (False, (9, -1), 10)],
)
def test_flash_attn_func_layout_and_window_size(causal, window_size, window):
    q, k, v = _randn(2, 4, 30, 80, seed=1), _randn(2, 1, 40, 80, seed=2), _randn(2, 1, 40, 80, seed=3)
    out = flash_attn_func(_bshd(q), _bshd(k), _bshd(v), causal=causal, window_size=window_size, softcap=2.0)
    assert out.shape == (2, 30, 4, 80)
    expected = attention_reference(q, k, v, causal=causal, window=window, softcap=2.0)
    torch.testing.assert_close(_bshd(out), expected, **TOL)
    out, lse, probs = flash_attn_func(
        _bshd(q), _bshd(k), _bshd(v), causal=causal, window_size=window_size, softcap=2.0, return_attn_probs=True
    )
    _, expected_lse = attention_reference(q, k, v, causal=causal, window=window, softcap=2.0, return_lse=True)
    assert probs is None and lse.shape == (2, 4, 30)
    torch.testing.assert_close(lse, expected_lse, **TOL)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"window_size": (3, 3)}, "right window"),
        ({"alibi_slopes": torch.zeros(4)}, "alibi_slopes is not supported"),
        ({"dropout_p": 0.1}, "dropout is not supported"),
    ],
)
def test_flash_attn_func_refuses_what_it_cannot_do(kwargs, match):
    q = _randn(1, 8, 4, 64)
    with pytest.raises(ValueError, match=match):
        flash_attn_func(q, q, q, **kwargs)


def _packed(lengths, heads, seed):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return cu, _randn(int(cu[-1]), heads, 64, seed=seed)


def _per_sequence(q, k, v, cu_q, cu_k, **kwargs):
    outs = []
    for (a, b), (c, d) in zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()), zip(cu_k[:-1].tolist(), cu_k[1:].tolist())):
        if b > a:
            outs.append(_bshd(attention_reference(*(_bshd(x[None]) for x in (q[a:b], k[c:d], v[c:d])), **kwargs))[0])
    return torch.cat(outs)


def test_flash_attn_varlen_func_equal_sequences_run_as_one_launch():
    from kernels_neuron import sim

    cu, q = _packed([7, 0, 140, 3], 4, 1)  # an empty sequence (a fully padded row) is allowed here
    _, k = _packed([7, 0, 140, 3], 2, 2)
    _, v = _packed([7, 0, 140, 3], 2, 3)
    with sim.capture() as traces:
        out = flash_attn_varlen_func(q, k, v, cu, cu, 140, 140, causal=True, window_size=(9, 9), softcap=3.0)
    assert len(traces) == 1
    torch.testing.assert_close(out, _per_sequence(q, k, v, cu, cu, causal=True, window=10, softcap=3.0), **TOL)


def test_flash_attn_varlen_func_decoding_a_padded_batch():
    """What transformers' flash path sends while decoding with padding: one query per sequence, keys of
    different lengths; causal aligned bottom-right (the query is the last position)."""
    cu_q, q = _packed([1, 1, 1], 4, 1)
    cu_k, k = _packed([20, 9, 33], 2, 2)
    _, v = _packed([20, 9, 33], 2, 3)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 33, causal=True, window_size=(7, 7))
    torch.testing.assert_close(out, _per_sequence(q, k, v, cu_q, cu_k, causal=True, window=8), **TOL)
    chunk_q, q = _packed([5, 3], 4, 4)  # chunked prefill: several queries after a cache
    chunk_k, k = _packed([12, 3], 2, 5)
    _, v = _packed([12, 3], 2, 6)
    out = flash_attn_varlen_func(q, k, v, chunk_q, chunk_k, 5, 12, causal=True)
    torch.testing.assert_close(out, _per_sequence(q, k, v, chunk_q, chunk_k, causal=True), **TOL)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_flash_attn_with_kvcache_appends_and_attends(paged):
    batch, capacity, block = 3, 48, 16
    q = _randn(batch, 2, 4, 64, seed=1)  # [B, Sq, H, D]
    new_k, new_v = _randn(batch, 2, 2, 64, seed=2), _randn(batch, 2, 2, 64, seed=3)
    lengths = torch.tensor([5, 30, 17], dtype=torch.int32)
    dense_k, dense_v = _randn(batch, capacity, 2, 64, seed=4), _randn(batch, capacity, 2, 64, seed=5)
    if paged:  # blocks shuffled across sequences
        order = torch.randperm(batch * capacity // block, generator=torch.Generator().manual_seed(0))
        table = order.reshape(batch, capacity // block).int()
        k_cache = torch.empty(batch * capacity // block, block, 2, 64)
        v_cache = torch.empty_like(k_cache)
        k_cache[table.flatten().long()] = dense_k.reshape(-1, block, 2, 64)
        v_cache[table.flatten().long()] = dense_v.reshape(-1, block, 2, 64)
    else:
        table, k_cache, v_cache = None, dense_k.clone(), dense_v.clone()
    with sim.capture() as traces:
        out, lse = flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            new_k,
            new_v,
            cache_seqlens=lengths,
            block_table=table,
            causal=True,
            return_softmax_lse=True,
        )
    assert out.shape == q.shape and lse.shape == (batch, 4, 2)
    # ragged lengths in one launch; a paged cache read by the kernel through the block table
    assert [t.kernel for t in traces] == ["flash_decode_paged_fwd" if paged else "flash_decode_fwd"]
    for b, n in enumerate(lengths.tolist()):
        keys = torch.cat([dense_k[b, :n], new_k[b]])
        values = torch.cat([dense_v[b, :n], new_v[b]])
        expected = attention_reference(_bshd(q[b : b + 1]), _bshd(keys[None]), _bshd(values[None]), causal=True)
        torch.testing.assert_close(out[b : b + 1], _bshd(expected), **TOL)
        # the new keys were written into the cache in place, after the n already there
        stored = k_cache[table[b].long()].reshape(-1, 2, 64) if paged else k_cache[b]
        torch.testing.assert_close(stored[n : n + 2], new_k[b], rtol=0, atol=0)


def test_flash_attn_with_kvcache_equal_lengths_decode_in_one_launch():
    q, k_cache, v_cache = _randn(2, 1, 4, 64, seed=1), _randn(2, 20, 2, 64, seed=2), _randn(2, 20, 2, 64, seed=3)
    with sim.capture() as traces:
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=12, causal=True, softcap=1.5)
    assert len(traces) == 1
    expected = attention_reference(_bshd(q), _bshd(k_cache[:, :12]), _bshd(v_cache[:, :12]), causal=True, softcap=1.5)
    torch.testing.assert_close(out, _bshd(expected), **TOL)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rotary_cos": torch.zeros(1)}, "rotary_cos is not supported"),
        ({"cache_batch_idx": torch.zeros(1)}, "cache_batch_idx is not supported"),
        ({"k": torch.zeros(1, 1, 2, 64)}, "give both k and v"),
        ({"k": torch.zeros(1, 1, 2, 64), "v": torch.zeros(1, 1, 2, 64)}, "cache_seqlens is needed"),
        ({"cache_seqlens": 30}, "do not fit the cache of 20"),
    ],
)
def test_flash_attn_with_kvcache_refuses_what_it_cannot_do(kwargs, match):
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(_randn(1, 1, 4, 64), _randn(1, 20, 2, 64), _randn(1, 20, 2, 64), **kwargs)


@pytest.mark.parametrize("window_size", [5, (5,), (4.0, 0), "full"], ids=str)
def test_a_malformed_window_size_is_a_clear_error(window_size):
    q = _randn(1, 8, 4, 64)
    with pytest.raises(ValueError, match=r"window_size must be a \(left, right\) pair of ints"):
        flash_attn_func(q, q, q, causal=True, window_size=window_size)


@pytest.mark.parametrize(
    "cu_q, cu_k, match",
    [
        ([0, 6, 4, 10], [0, 6, 4, 10], r"cu_seqlens_q must not decrease, got \[0, 6, 4, 10\]"),
        ([0, -2, 10], [0, -2, 10], r"cu_seqlens_q must not decrease"),
        ([0, 4, 10], [0, 7, 5, 12], r"cu_seqlens_k must not decrease"),
        ([0, 4, 10], [0, 7, 12, 12], "cu_seqlens_q holds 2 sequences but cu_seqlens_k 3"),
        ([0, 4, 10], [0, 7, 11], "cu_seqlens_k ends at 11 but there are 12 tokens"),
    ],
    ids=["decreasing", "negative", "keys-decreasing", "counts", "keys-total"],
)
def test_flash_attn_varlen_func_validates_both_cu_seqlens(cu_q, cu_k, match):
    q, k = _randn(10, 4, 64), _randn(12, 2, 64)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k))
    with pytest.raises(ValueError, match=match):
        flash_attn_varlen_func(q, k, k, cu_q, cu_k, 10, 12, causal=True)


def test_flash_attn_with_kvcache_validates_everything_before_writing_the_cache():
    """A -1 block in the part of block_table a sequence reads used to wrap to the last block (another
    sequence's); it is refused now, and the cache is untouched by the refused call."""
    q, new = _randn(2, 1, 4, 64, seed=1), _randn(2, 1, 2, 64, seed=2)
    k_cache, v_cache = _randn(4, 16, 2, 64, seed=3), _randn(4, 16, 2, 64, seed=4)
    before = k_cache.clone(), v_cache.clone()
    table = torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table\[0\] names blocks \[0, -1\].*outside the cache's 0..3"):
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=torch.tensor([20, 5]), block_table=table)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    with pytest.raises(ValueError, match="window_size must be"):  # checked before the write too
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=3, window_size=4)
    assert torch.equal(k_cache, before[0])
    # entries past what a sequence reads are unused: -1 there is fine
    out = flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=torch.tensor([10, 20]),
        block_table=torch.tensor([[1, -1], [2, 3]], dtype=torch.int32),
    )
    expected = attention_reference(_bshd(q[:1]), _bshd(k_cache[1, :10][None]), _bshd(v_cache[1, :10][None]))
    torch.testing.assert_close(out[:1], _bshd(expected), **TOL)


def test_flash_attn_with_kvcache_refuses_a_query_batch_larger_than_the_cache():
    with pytest.raises(ValueError, match="q has a batch of 3 but k_cache holds 2 sequences"):
        flash_attn_with_kvcache(_randn(3, 1, 4, 64), _randn(2, 20, 2, 64), _randn(2, 20, 2, 64), cache_seqlens=5)


def test_packing_hints_that_disagree_with_the_mask_are_ignored():
    """cu_seq_lens or restarting position_ids are used only when the mask is exactly those sequences:
    with a plain causal mask the result is the causal one."""
    q, k, v = _randn(1, 4, 12, 64, seed=1), _randn(1, 2, 12, 64, seed=2), _randn(1, 2, 12, 64, seed=3)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    expected = attention_reference(q, k, v, causal=True)
    for hints in ({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, {"position_ids": positions}):
        out, _ = flash_attn_forward(None, q, k, v, causal, **hints)
        torch.testing.assert_close(_bshd(out), expected, **TOL)
    packed = causal & torch.block_diag(torch.ones(5, 5), torch.ones(7, 7)).bool()[None, None]
    out, _ = flash_attn_forward(None, q, k, v, packed, position_ids=positions)
    torch.testing.assert_close(_bshd(out), attention_reference(q, k, v, causal=True, cu_seqlens=cu), **TOL)


def test_flash_attn_with_kvcache_refuses_a_query_dtype_other_than_the_caches_before_writing():
    q, new = _randn(1, 1, 4, 64).bfloat16(), _randn(1, 1, 2, 64)
    k_cache, v_cache = _randn(1, 8, 2, 64, seed=3), _randn(1, 8, 2, 64, seed=4)
    before = k_cache.clone()
    with pytest.raises(TypeError, match="q has dtype torch.bfloat16 but the cache torch.float32"):
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=2)
    assert torch.equal(k_cache, before)
