"""Attention longer than one kernel launch holds in SBUF: the launch plan covers every visible
(query, key) pair exactly once and each launch fits, and the op's forward and backward through
several launches match the reference (the residency limits are lowered so that short sequences
need several launches)."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_neuron.ops import attention as ops
from kernels_neuron.ops import attention_launches as launches
from kernels_neuron.ops.attention import attention_reference, flash_attention, flash_attn_varlen

KERNELS = ops._kernels


def _visible(sq, sk, causal, window, segments):
    """Reference visibility [sq, sk] in absolute positions (the op's documented semantics)."""
    offset = 0 if segments else sk - sq
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= j <= i + offset
    if window:
        keep &= j > i + offset - window
    if segments:
        ids = torch.full((sk,), -1)
        for n, (start, end) in enumerate(segments):
            ids[start:end] = n
        keep &= ids[:, None] == ids[None, :]
    return keep


def _coverage(plan, sq, sk, offset):
    """How many launches see each (query, key) pair, by the kernel's own rule inside each block."""
    counts = torch.zeros(sq, sk, dtype=torch.int32)
    for launch in plan:
        rows, cols = launch.q1 - launch.q0, launch.k1 - launch.k0
        seen = _visible(rows, cols, launch.causal, launch.window, launch.segments)
        if launch.bias_window:
            i = torch.arange(launch.q0, launch.q1)[:, None]
            j = torch.arange(launch.k0, launch.k1)[None, :]
            seen &= j > i + offset - launch.bias_window
        counts[launch.q0 : launch.q1, launch.k0 : launch.k1] += seen.int()
    return counts


def _smaller_limits(keys):
    """The kernel module's residency rules with limits that hold ``keys`` keys of head_dim 64 in
    bf16 per forward launch (and 256 queries beside them in the backward)."""
    return SimpleNamespace(
        P=KERNELS.P,
        resident_kv_bytes=KERNELS.resident_kv_bytes,
        resident_bwd_bytes=KERNELS.resident_bwd_bytes,
        MAX_RESIDENT_KV_BYTES=KERNELS.resident_kv_bytes(keys, 64, 2),
        MAX_RESIDENT_BWD_BYTES=KERNELS.resident_bwd_bytes(256, keys, 64, 2),
    )


def _segments(draw_lengths):
    offsets = [0]
    for length in draw_lengths:
        offsets.append(offsets[-1] + length)
    return tuple(zip(offsets[:-1], offsets[1:]))


@settings(max_examples=150, deadline=None)
@given(
    sq=st.integers(1, 700),
    extra_keys=st.integers(0, 400),
    causal=st.booleans(),
    window=st.sampled_from([0, 1, 7, 100, 300, 900]),
    backward=st.booleans(),
    capacity_keys=st.sampled_from([128, 256, 384]),
    packed=st.lists(st.integers(1, 500), min_size=1, max_size=5),
    use_packed=st.booleans(),
)
def test_the_plan_covers_every_visible_pair_exactly_once(
    sq, extra_keys, causal, window, backward, capacity_keys, packed, use_packed
):
    capacity = launches.Capacity(_smaller_limits(capacity_keys), 64, 2)
    segments = _segments(packed) if use_packed else None
    if segments:
        sq = sk = segments[-1][1]
    else:
        sk = sq + extra_keys
    plan = launches.plan(sq, sk, causal, window, segments, capacity, backward)
    for launch in plan:
        assert capacity.fits(launch.q1 - launch.q0, launch.k1 - launch.k0, backward), launch
    expected = _visible(sq, sk, causal, window, segments)
    counts = _coverage(plan, sq, sk, 0 if segments else sk - sq)
    assert torch.equal(counts, expected.int()), (counts - expected.int()).nonzero()[:5]


@pytest.mark.parametrize("d, itemsize", [(128, 2), (256, 4), (64, 2)])
@pytest.mark.parametrize("backward", [False, True])
def test_long_sequences_are_planned_into_launches_the_kernel_accepts(d, itemsize, backward):
    """With the real limits: 100k tokens (causal, windowed, packed with one long sequence) become
    launches that each pass the kernel's own residency checks."""
    capacity = launches.Capacity(KERNELS, d, itemsize)
    cases = [
        (100_000, 100_000, True, 0, None),
        (4096, 100_000, True, 0, None),
        (100_000, 100_000, True, 4096, None),
        (100_000, 100_000, False, 0, None),
        (70_000, 70_000, True, 0, ((0, 1000), (1000, 61_000), (61_000, 70_000))),
    ]
    assert not capacity.fits(100_000, 100_000, backward)  # the negative control: one launch would not do
    for sq, sk, causal, window, segments in cases:
        plan = launches.plan(sq, sk, causal, window, segments, capacity, backward)
        assert len(plan) > 1
        for launch in plan:
            keys, queries = launch.k1 - launch.k0, launch.q1 - launch.q0
            KERNELS.check_forward_residency(keys, d, itemsize)
            if backward:
                assert KERNELS.resident_bwd_bytes(queries, keys, d, itemsize) <= KERNELS.MAX_RESIDENT_BWD_BYTES


@pytest.fixture
def small_sbuf(monkeypatch):
    """Limits that hold 128 keys of head_dim 32 in fp32 per forward launch and 256 tokens per backward
    launch, so a few hundred tokens already need several launches."""
    monkeypatch.setattr(KERNELS, "MAX_RESIDENT_KV_BYTES", KERNELS.resident_kv_bytes(128, 32, 4))
    monkeypatch.setattr(KERNELS, "MAX_RESIDENT_BWD_BYTES", KERNELS.resident_bwd_bytes(128, 128, 32, 4))


def _grads(out, inputs, grad):
    return torch.autograd.grad(out, inputs, grad)


@pytest.mark.parametrize(
    "sq, sk, heads, causal, window, softcap, padded",
    [
        (300, 300, (4, 2), True, None, None, False),
        (200, 420, (2, 1), True, 150, None, False),
        (260, 260, (2, 2), False, None, 5.0, True),
    ],
    ids=["causal-gqa", "cache-window-mqa", "padded-softcap"],
)
def test_attention_through_several_launches_matches_the_reference(
    small_sbuf, sq, sk, heads, causal, window, softcap, padded
):
    d = 32
    capacity = launches.Capacity(KERNELS, d, 4)
    assert len(launches.plan(sq, sk, causal, window or 0, None, capacity, backward=False)) > 1
    assert len(launches.plan(sq, sk, causal, window or 0, None, capacity, backward=True)) > 1
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads[0], sq, d, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, heads[1], sk, d, generator=gen, requires_grad=True) for _ in range(2))
    mask = None
    if padded:  # the second row left-padded by 37 keys, so its first 37 queries see nothing
        mask = torch.ones(2, 1, sq, sk, dtype=torch.bool)
        mask[1, :, :, :37] = False
    options = dict(causal=causal, window=window, softcap=softcap, attention_mask=mask)
    out = flash_attention(q, k, v, **options)
    expected = attention_reference(q, k, v, **options)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)
    grad = torch.randn(out.shape, generator=gen)
    got, want = _grads(out, (q, k, v), grad), _grads(expected, (q, k, v), grad)
    for name, g, w in zip("qkv", got, want):
        assert w.abs().max() > 0, f"d{name} is zero: the comparison would prove nothing"
        torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-5, msg=lambda m, name=name: f"d{name}: {m}")


def test_packed_sequences_longer_than_a_launch_match_the_reference(small_sbuf):
    """Short sequences share launches; the 300-token one is cut into blocks."""
    d, lengths = 32, [40, 300, 70, 20]
    cu = torch.tensor([0, 40, 340, 410, 430], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(430, 2, d, generator=gen, requires_grad=True)
    k, v = (torch.randn(430, 1, d, generator=gen, requires_grad=True) for _ in range(2))
    out = flash_attn_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    as_batch = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
    expected = attention_reference(*as_batch, causal=True, cu_seqlens=cu).squeeze(0).transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)
    grad = torch.randn(out.shape, generator=gen)
    for name, g, w in zip("qkv", _grads(out, (q, k, v), grad), _grads(expected, (q, k, v), grad)):
        assert w.abs().max() > 0
        torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-5, msg=lambda m, name=name: f"d{name}: {m}")


def test_bf16_through_several_launches_stays_within_torchs_own_bf16_error(small_sbuf):
    d = 32
    gen = torch.Generator().manual_seed(2)
    q32 = torch.randn(1, 2, 300, d, generator=gen)
    k32, v32 = (torch.randn(1, 2, 300, d, generator=gen) for _ in range(2))
    exact = attention_reference(q32, k32, v32, causal=True)
    q, k, v = (t.to(torch.bfloat16) for t in (q32, k32, v32))
    torch_error = (attention_reference(q, k, v, causal=True).float() - exact).abs().max()
    kernel_error = (flash_attention(q, k, v, causal=True).float() - exact).abs().max()
    assert torch_error > 0
    assert kernel_error <= 2 * torch_error, (kernel_error, torch_error)


@pytest.mark.parametrize("backward", [False, True])
def test_packed_sequences_are_modelled_no_slower_than_running_them_one_by_one(backward):
    """The packed-sequence path (one launch, each sequence's causal tiles only) against the same
    sequences launched alone: within 1.2x of their sum (modelled Trn2, bf16, 4 x 192 tokens)."""
    from kernels_neuron import cost

    kernels, d, lengths = KERNELS, 128, (192, 192, 192, 192)
    gen = torch.Generator().manual_seed(0)

    def modelled(total, segments):
        q, k, v = (torch.randn(1, 1, total, d, generator=gen).to(torch.bfloat16) for _ in range(3))
        args = (None, d**-0.5, True, 0, 0.0, segments)
        if not backward:
            return cost.estimate(kernels.flash_attn_fwd, q, k, v, *args).time_us
        out, lse = launches.run_kernel(kernels.flash_attn_fwd, q, k, v, *args)
        return cost.estimate(kernels.flash_attn_bwd, q, k, v, out, out, lse, *args).time_us

    offsets = [0, 192, 384, 576, 768]
    packed = modelled(768, tuple(zip(offsets[:-1], offsets[1:])))
    alone = modelled(192, None)
    assert packed <= 1.2 * len(lengths) * alone, (packed, alone)
