"""Flash attention op: accuracy against the pure-torch reference over a pairwise-covering grid of the
features models use (causal, GQA/MQA, head dims, window, softcap, left/right padding with fully
masked rows, decode and prefill against a KV cache), bf16 within torch's own bf16 error, gradients
from the NKI backward kernel, packed sequences, the torch.library contract, torch.compile, bad input,
and the kernel's HBM traffic."""

import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels_neuron import sim
from kernels_neuron.ops import attention as ops
from kernels_neuron.ops.attention import (
    MAX_HEAD_DIM,
    attention_backward_reference,
    attention_reference,
    flash_attention,
    flash_attn_bwd,
    flash_attn_fwd,
    flash_attn_varlen,
)

# --- the grid -------------------------------------------------------------------------------------------

FACTORS = {
    "causal": [True, False],
    "heads": [(4, 4), (4, 2), (8, 2), (8, 1)],  # GQA ratio 1, 2, 4 and MQA
    "head_dim": [64, 80, 96, 128, 256],
    "window": [None, 5, 40],
    "softcap": [None, 3.0],
    "padding": [None, "left", "right"],
    "shape": ["prefill", "decode", "cache"],  # Sq = Sk; Sq = 1 against a cache; a chunk against a cache
}
# Two sizes per shape kind, alternated over the cases: ragged, and several 128-query tiles, 512-key
# backward tiles and 1024-key forward steps (so the running max is rescaled across steps).
SIZES = {"prefill": [(37, 37), (150, 150)], "decode": [(1, 77), (1, 1100)], "cache": [(20, 530), (130, 1300)]}


def pairwise_cases(factors, seed=0, candidates=60):
    """A small deterministic set of combinations covering every pair of factor values (greedy)."""
    names = list(factors)
    uncovered = {
        (a, va, b, vb)
        for a, b in itertools.combinations(names, 2)
        for va in range(len(factors[a]))
        for vb in range(len(factors[b]))
    }
    rng = random.Random(seed)
    cases = []
    while uncovered:
        best, best_gain = None, -1
        for _ in range(candidates):
            pick = {n: rng.randrange(len(factors[n])) for n in names}
            # seed each candidate with one uncovered pair so progress is guaranteed
            a, va, b, vb = min(uncovered)
            if not cases or rng.random() < 0.5:
                pick[a], pick[b] = va, vb
            gain = sum((a, pick[a], b, pick[b]) in uncovered for a, b in itertools.combinations(names, 2))
            if gain > best_gain:
                best, best_gain = pick, gain
        uncovered -= {(a, best[a], b, best[b]) for a, b in itertools.combinations(names, 2)}
        cases.append({n: factors[n][best[n]] for n in names})
    return cases


CASES = pairwise_cases(FACTORS)


def _case_id(case):
    h, hkv = case["heads"]
    return (
        f"{'causal' if case['causal'] else 'full'}-h{h}kv{hkv}-d{case['head_dim']}-w{case['window']}"
        f"-cap{case['softcap']}-pad{case['padding']}-{case['shape']}"
    )


def make_case(case, index, dtype, seed=0):
    """q, k, v and the keyword arguments of one grid case; and which query rows see no key."""
    gen = torch.Generator().manual_seed(seed + index)
    heads, kv_heads = case["heads"]
    sq, sk = SIZES[case["shape"]][index % 2]
    d, batch = case["head_dim"], 2
    q = torch.randn(batch, heads, sq, d, generator=gen)
    k = torch.randn(batch, kv_heads, sk, d, generator=gen)
    v = torch.randn(batch, kv_heads, sk, d, generator=gen)
    kwargs = dict(causal=case["causal"], window=case["window"], softcap=case["softcap"])
    if case["padding"]:
        pads = [0, max(1, sk // 3)]
        keep = torch.ones(batch, 1, sq, sk, dtype=torch.bool)
        position = torch.arange(sq) + sk - sq  # each query's position in the key sequence
        for b, pad in enumerate(pads):
            if case["padding"] == "left":
                keep[b, :, :, :pad] = False
                keep[b, :, position < pad, :] = False  # padding queries see nothing
            else:
                keep[b, :, :, sk - pad :] = False
                keep[b, :, position >= sk - pad, :] = False
        # half the cases pass an additive float mask (transformers' eager style: finfo.min)
        kwargs["attention_mask"] = (
            keep if index % 2 else torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        )
    to = lambda t: t.to(dtype)  # noqa: E731
    return to(q), to(k), to(v), kwargs


def _empty_rows(q, k, kwargs):
    """[B, H, Sq] bool: rows that can see no key under the case's mask, causality and window."""
    keep = ops._visible(q.shape[2], k.shape[2], kwargs.get("causal", False), kwargs.get("window"), None, q.device)
    keep = keep[None, None].expand(q.shape[0], q.shape[1], -1, -1)
    mask = kwargs.get("attention_mask")
    if mask is not None:
        keep = keep & (mask if mask.dtype == torch.bool else mask > -1e30)
    return ~keep.any(-1)


def _fp32(*tensors):
    return [t.float() for t in tensors]


def torch_bf16_attention(q, k, v, kwargs):
    """Torch's own bf16 attention on the same inputs: sdpa (math) with the same mask folded into a bool
    mask; with softcap (sdpa has none) the reference's math in bf16."""
    if kwargs.get("softcap"):
        return attention_reference(q, k, v, **kwargs)
    sq, sk = q.shape[2], k.shape[2]
    keep = ops._visible(sq, sk, kwargs["causal"], kwargs["window"], None, q.device)[None, None]
    mask = kwargs.get("attention_mask")
    if mask is not None:
        keep = keep & (mask if mask.dtype == torch.bool else mask > -1e30)
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=keep
    )


# --- accuracy -------------------------------------------------------------------------------------------


def test_the_grid_covers_every_pair_of_feature_values():
    for a, b in itertools.combinations(FACTORS, 2):
        seen = {(repr(c[a]), repr(c[b])) for c in CASES}
        assert seen == {(repr(x), repr(y)) for x in FACTORS[a] for y in FACTORS[b]}, (a, b)
    assert len(CASES) <= 40


@pytest.mark.parametrize("index, case", list(enumerate(CASES)), ids=lambda x: x if isinstance(x, int) else _case_id(x))
def test_fp32_matches_the_reference_tightly(index, case):
    q, k, v, kwargs = make_case(case, index, torch.float32)
    out = flash_attention(q, k, v, **kwargs)
    torch.testing.assert_close(out, attention_reference(q, k, v, **kwargs), rtol=1e-5, atol=2e-5)
    empty = _empty_rows(q, k, kwargs)
    assert torch.all(out[empty] == 0), "a row that sees no key must give zeros"
    assert not out.isnan().any()


@pytest.mark.parametrize("index, case", list(enumerate(CASES)), ids=lambda x: x if isinstance(x, int) else _case_id(x))
def test_bf16_error_is_within_twice_torchs_own_bf16_error(index, case):
    q, k, v, kwargs = make_case(case, index, torch.bfloat16)
    exact = attention_reference(*_fp32(q, k, v), **kwargs)
    out = flash_attention(q, k, v, **kwargs)
    assert out.dtype == torch.bfloat16
    seen = ~_empty_rows(q, k, kwargs)
    torch_error = (torch_bf16_attention(q, k, v, kwargs).float() - exact)[seen].abs().max()
    kernel_error = (out.float() - exact)[seen].abs().max()
    assert 0 < torch_error and kernel_error <= 2 * torch_error, (float(kernel_error), float(torch_error))
    assert torch.all(out[~seen] == 0)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    sq=st.integers(1, 140),
    extra=st.integers(0, 80),
    d=st.integers(1, 160),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 60)),
    softcap=st.one_of(st.none(), st.floats(0.5, 20.0)),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_match_the_reference(batch, kv_heads, group, sq, extra, d, causal, window, softcap, seed):
    gen = torch.Generator().manual_seed(seed)
    sk = sq + extra
    q = torch.randn(batch, kv_heads * group, sq, d, generator=gen)
    k, v = (torch.randn(batch, kv_heads, sk, d, generator=gen) for _ in range(2))
    kwargs = dict(causal=causal, window=window, softcap=softcap)
    torch.testing.assert_close(
        flash_attention(q, k, v, **kwargs), attention_reference(q, k, v, **kwargs), rtol=1e-5, atol=2e-5
    )


def test_masks_broadcast_from_fewer_dims():
    q, k, v = torch.randn(2, 4, 9, 64), torch.randn(2, 2, 12, 64), torch.randn(2, 2, 12, 64)
    key_padding = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    key_padding[1, ..., :4] = False
    per_head = torch.randn(1, 4, 9, 12)
    for mask in (key_padding, torch.tril(torch.ones(9, 12, dtype=torch.bool), diagonal=3), per_head, torch.randn(12)):
        torch.testing.assert_close(
            flash_attention(q, k, v, attention_mask=mask),
            attention_reference(q, k, v, attention_mask=mask),
            rtol=1e-5,
            atol=2e-5,
        )


def test_scale_and_fp16():
    q, k, v = (torch.randn(1, 2, 33, 96).half() for _ in range(3))
    out = flash_attention(q, k, v, scale=0.3, causal=True)
    assert out.dtype == torch.float16
    exact = attention_reference(*_fp32(q, k, v), scale=0.3, causal=True)
    torch_error = (attention_reference(q, k, v, scale=0.3, causal=True).float() - exact).abs().max()
    assert (out.float() - exact).abs().max() <= 2 * torch_error


@pytest.mark.parametrize("sq, sk", [(300, 100), (260, 3)])
def test_queries_before_the_first_key_return_zeros_with_gradients(sq, sk):
    """More queries than keys, causal: whole 128-query tiles see no key (the last query aligns with
    the last key), get no work items, and must still be written: zeros, and zero gradients."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, sq, 64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 1, sk, 64, generator=gen, requires_grad=True) for _ in range(2))
    out, expected = flash_attention(q, k, v, causal=True), attention_reference(q, k, v, causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-5)
    assert torch.all(out[:, :, : sq - sk] == 0)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("feature", ["causal", "window", "padding", "softcap"])
def test_masks_and_bias_apply_past_the_first_key_step(feature):
    """Sq = Sk = 1100 spans two forward key steps and three backward key tiles; a kernel that
    masked, biased or capped only the first step would be off here (fp32, forward and gradients)."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 2, 1100, 64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 1, 1100, 64, generator=gen, requires_grad=True) for _ in range(2))
    keep = torch.ones(1, 1, 1100, 1100, dtype=torch.bool)
    keep[..., 1050:] = False
    kwargs = {
        "causal": dict(causal=True),
        "window": dict(causal=True, window=300),
        "padding": dict(attention_mask=keep),
        "softcap": dict(softcap=0.5, scale=1.0),
    }[feature]
    out, expected = flash_attention(q, k, v, **kwargs), attention_reference(q, k, v, **kwargs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-5)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


def test_the_running_max_may_fall_across_key_steps():
    """The first key step holds far larger logits than the second: the running max must keep the
    first step's value (not take the second's), or the first step's exp overflows."""
    step = ops._kernels.FWD_KEY_TILE
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 1, 130, 64, generator=gen)
    k, v = (torch.randn(1, 1, step + 276, 64, generator=gen) for _ in range(2))
    k[..., :step, :] *= 40.0
    torch.testing.assert_close(flash_attention(q, k, v), attention_reference(q, k, v), rtol=1e-5, atol=2e-5)


def test_the_running_max_is_rescaled_across_key_steps():
    """The second forward key step holds far larger logits than the first, so the first step's
    partial output and row sum must be rescaled by exp(old max - new max) to be right."""
    step = ops._kernels.FWD_KEY_TILE
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 130, 64, generator=gen)
    k, v = (torch.randn(1, 1, step + 300, 64, generator=gen) for _ in range(2))
    k[..., step:, :] *= 6.0
    torch.testing.assert_close(flash_attention(q, k, v), attention_reference(q, k, v), rtol=1e-5, atol=2e-5)
    assert (attention_reference(q, k[..., :step, :], v[..., :step, :]) - attention_reference(q, k, v)).abs().max() > 0.5


def test_a_kernel_that_ignored_the_window_would_fail():
    """The grid's window values change the result (so the accuracy checks test them)."""
    q, k, v, kwargs = make_case(
        dict(causal=True, heads=(4, 2), head_dim=64, window=5, softcap=None, padding=None, shape="prefill"),
        1,
        torch.float32,
    )
    with pytest.raises(AssertionError):
        torch.testing.assert_close(
            flash_attention(q, k, v, **{**kwargs, "window": None}),
            attention_reference(q, k, v, **kwargs),
            rtol=1e-5,
            atol=2e-5,
        )


# --- packed sequences -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lengths, causal, window, softcap",
    [
        ([5, 130, 1, 40], True, None, None),
        ([5, 130, 1, 40], True, 7, 2.0),
        ([5, 130, 1, 40], False, None, None),
        # windows wider than the sequences, and key steps that start before a sequence's first key
        ([100, 1200], True, 2000, None),
        ([700, 1200, 100], False, 1500, None),
        ([300, 900], True, 600, 3.0),
    ],
    ids=lambda x: str(x),
)
def test_varlen_matches_the_reference_per_sequence(lengths, causal, window, softcap):
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    total, gen = cu[-1].item(), torch.Generator().manual_seed(3)
    q = torch.randn(total, 4, 64, generator=gen)
    k, v = (torch.randn(total, 2, 64, generator=gen) for _ in range(2))
    kwargs = dict(causal=causal, window=window, softcap=softcap)
    out = flash_attn_varlen(q, k, v, cu, cu, max(lengths), max(lengths), **kwargs)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = attention_reference(*(x[a:b].transpose(0, 1)[None] for x in (q, k, v)), **kwargs)[0].transpose(0, 1)
        torch.testing.assert_close(out[a:b], ref, rtol=1e-5, atol=2e-5)
    packed = [x.transpose(0, 1)[None] for x in (q, k, v)]  # the reference's own packed mode agrees
    torch.testing.assert_close(
        out, attention_reference(*packed, cu_seqlens=cu, **kwargs)[0].transpose(0, 1), rtol=1e-5, atol=2e-5
    )


@pytest.mark.parametrize(
    "cu, match",
    [
        (torch.tensor([[0, 4, 8]], dtype=torch.int32), "1-D int32 tensor"),
        (torch.tensor([0.0, 4.0, 8.0]), "1-D int32 tensor"),
        (torch.tensor([0, 4, 8]), "1-D int32 tensor.*dtype torch.int64"),
        (torch.tensor([1, 4, 8], dtype=torch.int32), "must start at 0"),
        (torch.tensor([0, 6, 4, 8], dtype=torch.int32), r"must not decrease, got \[0, 6, 4, 8\]"),
        (torch.tensor([0, -2, 8], dtype=torch.int32), r"must not decrease, got \[0, -2, 8\]"),
        (torch.tensor([0, 4, 7], dtype=torch.int32), "ends at 7 but there are 8 tokens"),
    ],
)
@pytest.mark.parametrize("which", ["q", "k"])
def test_varlen_rejects_bad_cu_seqlens_of_the_queries_and_of_the_keys(cu, match, which):
    q, k, v = torch.randn(8, 2, 64), torch.randn(8, 2, 64), torch.randn(8, 2, 64)
    good = torch.tensor([0, 4, 8], dtype=torch.int32)
    cu_q, cu_k = (cu, good) if which == "q" else (good, cu)
    with pytest.raises((ValueError, TypeError), match=f"cu_seqlens_{which} .*{match}"):
        flash_attn_varlen(q, k, v, cu_q, cu_k, 8, 8)


def test_varlen_checks_the_sequence_counts_and_max_seqlen():
    q, k = torch.randn(8, 2, 64), torch.randn(10, 2, 64)
    cu_q, cu_k = torch.tensor([0, 4, 8], dtype=torch.int32), torch.tensor([0, 3, 6, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q holds 2 sequences but cu_seqlens_k 3"):
        flash_attn_varlen(q, k, k, cu_q, cu_k, 4, 4)
    with pytest.raises(ValueError, match="max_seqlen_q=3 is shorter than the longest sequence"):
        flash_attn_varlen(q, q, q, cu_q, cu_q, 3, 4)
    with pytest.raises(ValueError, match="max_seqlen_k=5 is shorter than the longest sequence"):
        flash_attn_varlen(q, k, k, cu_q, torch.tensor([0, 4, 10], dtype=torch.int32), 4, 5)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_with_different_query_and_key_sequences_matches_each_sequence_alone(causal):
    """A chunk of queries against a longer cache per sequence (bottom-right causal), an empty sequence,
    and a sequence whose queries have no key (zeros): every query row gets its own output."""
    gen = torch.Generator().manual_seed(3)
    cu_q = torch.tensor([0, 3, 3, 7, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 12, 20, 20], dtype=torch.int32)
    q = torch.randn(9, 4, 64, generator=gen)
    k, v = (torch.randn(20, 2, 64, generator=gen) for _ in range(2))
    out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, 4, 10, causal=causal, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, 9)
    for (q0, q1), (k0, k1) in zip(
        zip(cu_q[:-1].tolist(), cu_q[1:].tolist()), zip(cu_k[:-1].tolist(), cu_k[1:].tolist())
    ):
        if q1 == q0:
            continue
        if k1 == k0:
            assert torch.equal(out[q0:q1], torch.zeros_like(out[q0:q1]))
            continue
        ref = attention_reference(*(x.transpose(0, 1)[None] for x in (q[q0:q1], k[k0:k1], v[k0:k1])), causal=causal)[
            0
        ].transpose(0, 1)
        torch.testing.assert_close(out[q0:q1], ref, rtol=1e-5, atol=2e-5)


# --- gradients ------------------------------------------------------------------------------------------


def _grads(fn, q, k, v, kwargs, grad):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, **kwargs)
    out.backward(grad.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def assert_gradients_like_torch(kernel, exact, torch_grads=None, factor=3.0):
    """fp32 (torch_grads None): dq, dk, dv equal the reference's tightly; bf16: each within ``factor``
    times torch's own bf16 gradient error."""
    for name, got, want, base in zip("qkv", kernel[1:], exact[1:], (torch_grads or exact)[1:]):
        if torch_grads is None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"d{name}: {m}")
        else:
            error, torch_error = (got.float() - want).abs().max(), (base.float() - want).abs().max()
            assert 0 < torch_error and error <= factor * torch_error, (
                f"d{name}: {float(error)} vs torch {float(torch_error)}"
            )


GRAD_CASES = CASES[::2]  # every other grid case still spans every feature value


@pytest.mark.parametrize(
    "index, case",
    [(i * 2, c) for i, c in enumerate(GRAD_CASES)],
    ids=lambda x: x if isinstance(x, int) else _case_id(x),
)
def test_fp32_gradients_match_the_reference(index, case):
    q, k, v, kwargs = make_case(case, index, torch.float32)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(index))
    kernel = _grads(flash_attention, q, k, v, kwargs, grad)
    assert_gradients_like_torch(kernel, _grads(attention_reference, q, k, v, kwargs, grad))
    assert not any(g.isnan().any() for g in kernel[1:])


@pytest.mark.parametrize(
    "index, case",
    [(i * 2, c) for i, c in enumerate(GRAD_CASES)],
    ids=lambda x: x if isinstance(x, int) else _case_id(x),
)
def test_bf16_gradients_within_three_times_torchs_own_bf16_error(index, case):
    q, k, v, kwargs = make_case(case, index, torch.bfloat16)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(index)).bfloat16()
    kernel = _grads(flash_attention, q, k, v, kwargs, grad)
    assert all(g.dtype == torch.bfloat16 for g in kernel[1:])
    exact = _grads(attention_reference, *_fp32(q, k, v), kwargs, grad.float())
    assert_gradients_like_torch(kernel, exact, _grads(attention_reference, q, k, v, kwargs, grad))


@pytest.mark.parametrize("cu, window", [([0, 3, 70, 150], None), ([0, 100, 700], 2000)], ids=["short", "wide-window"])
def test_varlen_gradients_match_the_reference(cu, window):
    cu = torch.tensor(cu, dtype=torch.int32)
    total, longest = cu[-1].item(), (cu[1:] - cu[:-1]).max().item()
    gen = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(total, 4, 64, generator=gen),
        torch.randn(total, 1, 64, generator=gen),
        torch.randn(total, 1, 64, generator=gen),
    )
    grad = torch.randn(total, 4, 64, generator=gen)
    varlen = lambda q, k, v, **kw: flash_attn_varlen(q, k, v, cu, cu, longest, longest, **kw)  # noqa: E731

    def reference(q, k, v, **kw):
        return attention_reference(*(x.transpose(0, 1)[None] for x in (q, k, v)), cu_seqlens=cu, **kw)[0].transpose(
            0, 1
        )

    kwargs = dict(causal=True, window=window or 20, softcap=5.0)
    assert_gradients_like_torch(_grads(varlen, q, k, v, kwargs, grad), _grads(reference, q, k, v, kwargs, grad))


def test_a_wrong_kernel_gradient_fails_the_gradient_check(monkeypatch):
    """Negative control: dk off by 1% in the kernel is caught."""
    q, k, v, kwargs = make_case(CASES[0], 0, torch.float32)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(0))
    real = ops._kernels.flash_attn_bwd

    def skewed(*args):
        dq, dk, dv = real(*args)
        return dq, dk * 1.01, dv

    monkeypatch.setattr(ops._kernels, "flash_attn_bwd", skewed)
    with pytest.raises(AssertionError, match="dk"):
        assert_gradients_like_torch(
            _grads(flash_attention, q, k, v, kwargs, grad), _grads(attention_reference, q, k, v, kwargs, grad)
        )


def test_the_reference_backward_matches_autograd_of_the_reference():
    """attention_backward_reference (the NKI backward's signature, from the saved lse) is right, so it
    can stand in for the kernel in the wiring test below."""
    q, k, v, kwargs = make_case(
        dict(causal=True, heads=(8, 2), head_dim=80, window=9, softcap=3.0, padding="left", shape="cache"),
        1,
        torch.float32,
    )
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    _, dq, dk, dv = _grads(attention_reference, q, k, v, kwargs, grad)
    bias = ops.mask_to_bias("test", kwargs["attention_mask"], tuple(q.shape[:3]) + (k.shape[2],), q.device)
    out, lse = attention_reference(q, k, v, return_lse=True, **kwargs)
    got = attention_backward_reference(q, k, v, out, grad, lse, bias, q.shape[-1] ** -0.5, True, 9, 3.0, None)
    for name, a, b in zip("qkv", got, (dq, dk, dv)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")


def test_autograd_wiring_with_the_reference_backward(monkeypatch):
    """The op's autograd (saved tensors, options, GQA shapes, packed sequences) is right independently of
    the NKI backward kernel: with the reference backward in its place, gradients equal autograd's."""
    monkeypatch.setattr(ops._kernels, "flash_attn_bwd", attention_backward_reference, raising=False)
    q, k, v, kwargs = make_case(
        dict(causal=True, heads=(8, 2), head_dim=64, window=None, softcap=2.0, padding="right", shape="prefill"),
        0,
        torch.float32,
    )
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    assert_gradients_like_torch(
        _grads(flash_attention, q, k, v, kwargs, grad), _grads(attention_reference, q, k, v, kwargs, grad)
    )


# --- torch.library contract and torch.compile -------------------------------------------------------------


def _op_args(bias=True, cu=False):
    gen = torch.Generator().manual_seed(4)
    if cu:
        q, k, v = (
            torch.randn(1, 4, 24, 64, generator=gen),
            torch.randn(1, 2, 24, 64, generator=gen),
            torch.randn(1, 2, 24, 64, generator=gen),
        )
        return (q, k, v, None, 0.125, True, 0, 0.0, torch.tensor([0, 10, 24], dtype=torch.int32))
    q, k, v = (
        torch.randn(2, 4, 24, 64, generator=gen),
        torch.randn(2, 2, 30, 64, generator=gen),
        torch.randn(2, 2, 30, 64, generator=gen),
    )
    b = torch.zeros(2, 1, 24, 30).masked_fill(torch.rand(2, 1, 24, 30, generator=gen) < 0.2, float("-inf"))
    return (q, k, v, b if bias else None, 0.125, True, 7, 2.5, None)


@pytest.mark.parametrize("bias, cu", [(True, False), (False, False), (False, True)], ids=["bias", "plain", "packed"])
def test_opcheck_forward(bias, cu):
    torch.library.opcheck(flash_attn_fwd, _op_args(bias, cu))


@pytest.mark.parametrize("bias, cu", [(True, False), (False, True)], ids=["bias", "packed"])
def test_opcheck_forward_with_autograd_and_backward_op(bias, cu):
    q, k, v, *rest = _op_args(bias, cu)
    torch.library.opcheck(flash_attn_fwd, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *rest))
    out, lse = flash_attn_fwd(q.detach(), k.detach(), v.detach(), *rest)
    torch.library.opcheck(flash_attn_bwd, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, *rest))


def test_torch_compile_fullgraph_has_no_graph_breaks():
    q, k, v = torch.randn(2, 4, 20, 64), torch.randn(2, 2, 20, 64), torch.randn(2, 2, 20, 64)
    mask = torch.ones(2, 1, 20, 20, dtype=torch.bool)
    mask[1, ..., :6] = False

    def fn(q, k, v, mask):
        return flash_attention(q, k, v, attention_mask=mask, causal=True, window=8, softcap=4.0) * 2

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    expected = 2 * attention_reference(q, k, v, attention_mask=mask, causal=True, window=8, softcap=4.0)
    torch.testing.assert_close(compiled(q, k, v, mask), expected, rtol=1e-5, atol=2e-5)
    assert torch._dynamo.explain(fn)(q, k, v, mask).graph_break_count == 0
    # ... and the backward through the compiled graph
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    compiled(*leaves, mask).sum().backward()
    refs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    fn_ref = 2 * attention_reference(*refs, attention_mask=mask, causal=True, window=8, softcap=4.0)
    fn_ref.sum().backward()
    for a, b in zip(leaves, refs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


# --- bad input ------------------------------------------------------------------------------------------


def _t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: ((_t(1, 6, 4, 64), _t(1, 4, 4, 64), _t(1, 4, 4, 64)), {}),
            "6 query heads are not a multiple of 4 KV heads",
        ),
        (
            lambda: ((_t(1, 2, 4, 320), _t(1, 2, 4, 320), _t(1, 2, 4, 320)), {}),
            f"head_dim 320 is above the kernel's limit of {MAX_HEAD_DIM}",
        ),
        (lambda: ((_t(1, 2, 4, 64), _t(1, 2, 4, 64, dtype=torch.bfloat16), _t(1, 2, 4, 64)), {}), "same dtype"),
        (lambda: ((_t(1, 2, 4, 64, dtype=torch.int32),) * 3, {}), "dtype torch.int32"),
        (
            lambda: ((_t(1, 2, 4, 64),) * 3, {"attention_mask": _t(1, 1, 5, 4)}),
            r"attention_mask of shape \(1, 1, 5, 4\) does not broadcast to \[B, H, Sq, Sk\] = \[1, 2, 4, 4\]",
        ),
        (lambda: ((_t(1, 2, 4, 64),) * 3, {"attention_mask": _t(3, 1, 4, 4)}), "does not broadcast"),
        (lambda: ((_t(1, 2, 4, 64),) * 3, {"attention_mask": _t(1, 1, 4, 4, dtype=torch.int64)}), "must be bool"),
        (lambda: ((_t(1, 2, 4, 64),) * 3, {"dropout": 0.1}), "dropout is not supported"),
        (lambda: ((_t(1, 2, 0, 64), _t(1, 2, 4, 64), _t(1, 2, 4, 64)), {}), "empty input"),
        (lambda: ((_t(1, 2, 4, 64), _t(1, 2, 0, 64), _t(1, 2, 0, 64)), {}), "empty input"),
        (lambda: ((_t(2, 4, 64),) * 3, {}), "must be 4-D"),
        (lambda: ((_t(1, 2, 4, 64), _t(1, 2, 5, 64), _t(1, 2, 4, 64)), {}), "must have the same shape"),
        (lambda: ((_t(1, 2, 4, 64), _t(1, 2, 4, 32), _t(1, 2, 4, 32)), {}), "head_dim 64 but k and v have 32"),
        (lambda: ((_t(2, 2, 4, 64), _t(1, 2, 4, 64), _t(1, 2, 4, 64)), {}), "batch 2 but k and v have 1"),
        (lambda: ((_t(1, 2, 4, 64),) * 3, {"window": -1}), "window must be None or a non-negative int"),
        (lambda: ((_t(1, 2, 4, 64),) * 3, {"softcap": -2.0}), "softcap must be None or a non-negative"),
        (lambda: ((_t(1, 2, 4, 64),) * 3, {"scale": 0.0}), "scale must be a positive finite number"),
        (
            lambda: ((_t(1, 2, 4, 64),) * 3, {"attention_mask": torch.zeros(1, 1, 4, 4, requires_grad=True)}),
            "requires grad",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_input_gets_a_clear_error(make, match):
    (q, k, v), kwargs = make()
    with pytest.raises((TypeError, ValueError), match=match):
        flash_attention(q, k, v, **kwargs)


# --- the longest supported sequences --------------------------------------------------------------------


def _longest(fits):
    """The most keys, in whole 128-key blocks, that ``fits`` accepts."""
    keys = 128
    while fits(keys + 128):
        keys += 128
    return keys


@pytest.mark.parametrize("d, dtype", [(128, torch.bfloat16), (256, torch.float32)])
def test_the_longest_keys_one_launch_holds_fit_in_sbuf_and_one_more_block_is_refused(d, dtype):
    """At the named limits the kernels run without overflowing SBUF (the simulator would raise
    CapacityError); one 128-key block more and the kernel itself refuses with a ValueError naming the
    limit, forward and backward (the op splits such inputs into launches: test_attention_launches.py)."""
    kernels, itemsize = ops._kernels, torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 130, d, generator=gen).to(dtype)
    fwd_keys = _longest(lambda n: kernels.resident_kv_bytes(n, d, itemsize) <= kernels.MAX_RESIDENT_KV_BYTES)
    k, v = (torch.randn(1, 1, fwd_keys, d, generator=gen).to(dtype) for _ in range(2))
    args = (None, d**-0.5, False, 0, 0.0, None)
    sim.run(kernels.flash_attn_fwd, q, k, v, *args)
    longer = torch.zeros(1, 1, fwd_keys + 128, d, dtype=dtype)
    with pytest.raises(ValueError, match=f"{fwd_keys + 128} keys of head_dim {d}.*above the limit of"):
        sim.run(kernels.flash_attn_fwd, q, longer, longer, *args)
    bwd_keys = _longest(
        lambda n: n <= fwd_keys and kernels.resident_bwd_bytes(130, n, d, itemsize) <= kernels.MAX_RESIDENT_BWD_BYTES
    )
    k, v = k[:, :, :bwd_keys], v[:, :, :bwd_keys]
    out, lse = sim.run(kernels.flash_attn_fwd, q, k, v, *args).outputs
    sim.run(kernels.flash_attn_bwd, q, k, v, out, out, lse, *args)
    longer = torch.zeros(1, 1, bwd_keys + 128, d, dtype=dtype)
    out, lse = torch.zeros(1, 1, 130, d, dtype=dtype), torch.zeros(1, 1, 130)
    binding = "backward of 130 queries and " if bwd_keys < fwd_keys else ""
    with pytest.raises(ValueError, match=f"{binding}{bwd_keys + 128} keys.*above the limit of"):
        sim.run(kernels.flash_attn_bwd, q, longer, longer, out, out, lse, *args)


# --- the kernel writes only what it returns -----------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, dtype, bias, causal",
    [
        ((2, 8, 2, 200, 200, 128), torch.bfloat16, False, True),
        ((1, 4, 4, 37, 600, 64), torch.float32, True, False),
        ((1, 4, 1, 1, 530, 256), torch.bfloat16, False, True),
    ],
    ids=["causal-gqa-bf16", "bias-fp32", "decode-mqa-d256"],
)
def test_the_forward_writes_only_the_output_and_the_lse_to_hbm(shape, dtype, bias, causal):
    """No S x S scores (or anything else) reach HBM: the bytes written equal out + lse."""
    batch, heads, kv_heads, sq, sk, d = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, sq, d, generator=gen).to(dtype)
    k, v = (torch.randn(batch, kv_heads, sk, d, generator=gen).to(dtype) for _ in range(2))
    b = torch.zeros(1, 1, sq, sk) if bias else None
    result = sim.run(ops._kernels.flash_attn_fwd, q, k, v, b, d**-0.5, causal, 0, 0.0, None)
    out, lse = result.outputs
    assert tuple(out.shape) == (batch, heads, sq, d) and out.dtype == dtype
    assert tuple(lse.shape) == (batch, heads, sq) and lse.dtype == torch.float32
    written = sum(i.hbm_bytes_written for i in result.trace.instructions)
    assert written == out.nbytes + lse.nbytes, (written, out.nbytes + lse.nbytes)
