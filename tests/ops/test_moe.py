"""MoE experts op: numerics against transformers' MixtralExperts math (fp32 tight, bf16 against torch's own
bf16 error), ragged groups (an expert with no token, one with a single token, groups over several
blocks and token tiles), sizes off multiples of 128, gradients (non-zero, then compared; top-1, 2 and 4,
experts over several backward blocks, masked choices), the block layout, the kernels' multi-part paths
and skipped experts, the forward's matmuls over runs of 4, 2 and 1 token tiles (each run computed, up to
512 moving columns), the backward's g and u projections (paired in one matmul, and apart), the torch.library contract, torch.compile, and bad input."""

from collections import Counter

import pytest
import torch

from kernels_neuron import sim
from kernels_neuron.ops import moe as moe_op
from kernels_neuron.ops.moe import moe_bwd, moe_experts, moe_experts_reference, moe_fwd, routing_layout
from nki_src import moe as moe_kernels

ACTIVATIONS = ["silu", "gelu_tanh"]
# (tokens, hidden, intermediate, experts, top_k): one token; sizes off multiples of 128 with ragged
# token tiles; a token count above one block (1024 slots) so an expert's group spans two blocks;
# top-1; a top-4 combine.
SHAPES = [(1, 64, 96, 4, 2), (37, 200, 150, 5, 2), (300, 130, 260, 3, 2), (1100, 72, 136, 2, 1), (50, 96, 80, 8, 4)]


def _routing(tokens, experts, top_k, gen, empty=None, single=None):
    """Softmax top-k routing; ``empty``: an expert no token picks; ``single``: one only token 0 picks."""
    logits = torch.randn(tokens, experts, generator=gen)
    if empty is not None:
        logits[:, empty] = -1e4
    if single is not None:
        logits[:, single] = -1e4
        logits[0, single] = 1e4
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return index, weights / weights.sum(-1, keepdim=True)


def _inputs(shape, dtype, seed=0):
    tokens, hidden, inter, experts, top_k = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w_down = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    ragged = experts > top_k + 1  # room for an empty expert and a single-token one
    index, weights = _routing(tokens, experts, top_k, gen, *((experts - 1, experts - 2) if ragged else ()))
    return x.to(dtype), index, weights, w_gate_up.to(dtype), w_down.to(dtype)


def _fp32(args):
    return [a.float() if a.is_floating_point() else a for a in args]


def _launches(traces, name):
    return sum(t.kernel == name for t in traces)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_matches_reference_tightly(shape, activation):
    args = _inputs(shape, torch.float32)
    with sim.capture() as traces:
        out = moe_experts(*args, activation)
    assert _launches(traces, "moe_fwd") == 1 and out.shape == args[0].shape
    torch.testing.assert_close(out, moe_experts_reference(*args, activation), rtol=1e-5, atol=1e-5)


def test_the_ragged_routing_has_an_empty_and_a_single_token_expert():
    """The shapes above do exercise the ragged cases they claim to (a negative control for the routing)."""
    _, index, _, _, _ = _inputs(SHAPES[1], torch.float32)
    counts = torch.bincount(index.reshape(-1), minlength=5)
    assert counts[4] == 0 and counts[3] == 1 and counts.sum() == 37 * 2


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_bf16_error_is_within_twice_torchs_own_bf16_error(shape, activation):
    args = _inputs(shape, torch.bfloat16)
    exact = moe_experts_reference(*_fp32(args), activation)
    torch_error = (moe_experts_reference(*args, activation).float() - exact).abs().max()
    kernel_error = (moe_experts(*args, activation).float() - exact).abs().max()
    assert 0 < kernel_error <= 2 * torch_error, (kernel_error, torch_error)


def test_fp16_matches_the_fp32_reference():
    args = _inputs((40, 96, 160, 4, 2), torch.float16)
    exact = moe_experts_reference(*_fp32(args), "silu")
    torch_error = (moe_experts_reference(*args, "silu").float() - exact).abs().max()
    assert (moe_experts(*args, "silu").float() - exact).abs().max() <= 2 * torch_error


def _grads(fn, args, activation, grad_out):
    x, index, weights, w_gate_up, w_down = args
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, weights, w_gate_up, w_down)]
    out = fn(leaves[0], index, leaves[1], leaves[2], leaves[3], activation)
    out.backward(grad_out.to(out.dtype))
    return [leaf.grad for leaf in leaves]


GRAD_NAMES = ("dx", "d_weights", "d_gate_up", "d_down")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[4], (300, 130, 260, 3, 2), (200, 72, 136, 3, 1)], ids=str)
def test_fp32_gradients_match_autograd_of_the_reference(shape, activation):
    args = _inputs(shape, torch.float32, seed=1)
    grad_out = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(2))
    with sim.capture() as traces:
        got = _grads(moe_experts, args, activation, grad_out)
    assert [t.kernel for t in traces] == ["moe_fwd", "moe_bwd"]  # one grouped launch each way
    _assert_grads_match(got, _grads(moe_experts_reference, args, activation, grad_out))


def _assert_grads_match(got, want):
    for name, g, w in zip(GRAD_NAMES, got, want):
        assert g.shape == w.shape and g.dtype == torch.float32, name
        # a vacuous comparison would pass any tolerance
        assert w.abs().max() > 0 and g.abs().max() > 0, name
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * w.abs().max(), msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("ahead, paired", [(0, 0), (1, 0), (0, 1)])
def test_backward_over_several_blocks_and_parts_per_expert(monkeypatch, ahead, paired):
    """Blocks of one token tile, so each expert's ~200 choices span two blocks (the weight gradients'
    read-back and add) with a partial last tile, and parts of one intermediate tile (several parts, each
    one's da formed beside the last one's tiles), with and without gate/up rows read ahead, with g and u
    projected apart and side by side (a full intermediate tile and the partial last one)."""
    monkeypatch.setattr(moe_kernels, "backward_block_plan", lambda tokens, *_: (min(128, tokens), 1))
    monkeypatch.setattr(moe_kernels, "backward_part_plan", lambda *_: (128, ahead, paired))
    shape = (300, 130, 260, 3, 2)
    args = _inputs(shape, torch.float32, seed=3)
    layout = routing_layout(args[1], args[2], 3, 130, 260, torch.float32, backward=True)
    assert int(layout.block_info[:, 4].sum()) >= 3  # every expert continues in a later block
    grad_out = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(4))
    got = _grads(moe_experts, args, "gelu_tanh", grad_out)
    _assert_grads_match(got, _grads(moe_experts_reference, args, "gelu_tanh", grad_out))


def test_a_masked_choice_gets_no_gradient():
    """transformers' expert-parallel marker (index == E): the module skips the choice, so its routing
    weight gets no gradient and it adds nothing to dx or the weight gradients."""
    args = list(_inputs((20, 64, 96, 4, 2), torch.float32, seed=5))
    args[1][3, 1] = 4
    args[1][7, 0] = 4
    grad_out = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(6))
    got = _grads(moe_experts, args, "silu", grad_out)
    assert got[1][3, 1] == 0 and got[1][7, 0] == 0
    _assert_grads_match(got, _grads(moe_experts_reference, args, "silu", grad_out))


def test_an_expert_without_tokens_gets_a_zero_weight_gradient():
    args = _inputs(SHAPES[1], torch.float32, seed=1)
    _, _, d_gate_up, d_down = _grads(moe_experts, args, "silu", torch.randn(args[0].shape))
    assert d_gate_up[4].abs().max() == 0 and d_down[4].abs().max() == 0
    assert d_gate_up[3].abs().max() > 0 and d_down[3].abs().max() > 0  # the single-token expert learns


@pytest.mark.parametrize("shape, activation", [(SHAPES[1], "silu"), ((200, 72, 136, 3, 1), "gelu_tanh")], ids=str)
def test_bf16_gradients_are_within_twice_torchs_own_bf16_error(shape, activation):
    args = _inputs(shape, torch.bfloat16, seed=1)
    grad_out = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(2))
    got = _grads(moe_experts, args, activation, grad_out)
    exact = _grads(moe_experts_reference, _fp32(args), activation, grad_out)
    eager = _grads(moe_experts_reference, args, activation, grad_out)
    for name, g, e, t in zip(GRAD_NAMES, got, exact, eager):
        assert g.dtype == t.dtype, name
        kernel_error, torch_error = (g.float() - e).abs().max(), (t.float() - e).abs().max()
        assert 0 < kernel_error <= 2 * torch_error, (name, kernel_error, torch_error)


def test_routing_layout_places_every_choice_once_in_its_experts_blocks():
    tokens, experts, top_k = 300, 3, 2
    index, weights = _routing(tokens, experts, top_k, torch.Generator().manual_seed(5))
    layout = routing_layout(index, weights, experts, 130, 260, torch.float32)
    tile, block, num_blocks = moe_kernels.routing_shape(tokens, top_k, experts, 130, 260, "float32")
    assert layout.block_info.shape == (num_blocks, 7) and layout.slot_token.shape == (num_blocks * block, 1)
    rows = layout.slot_row[:, 0]
    used = rows < tokens * top_k
    assert sorted(rows[used].tolist()) == list(range(tokens * top_k))  # every choice once
    slot_expert = layout.block_info[:, 0].repeat_interleave(block)
    assert torch.equal(slot_expert[used].long(), index.reshape(-1)[rows[used].long()])
    assert torch.equal(layout.slot_token[used, 0].long(), rows[used].long() // top_k)
    assert torch.equal(layout.slot_weight[used, 0], weights.reshape(-1)[rows[used].long()])
    assert torch.all(layout.slot_token[~used] == tokens) and torch.all(layout.slot_weight[~used] == 0)
    # used tiles cover exactly the block's choices, rounded up to whole token tiles
    seen = set()
    for b, (expert, tiles_used, flag, starts, continues, fours_end, twos_end) in enumerate(layout.block_info.tolist()):
        in_block = int(used[b * block : (b + 1) * block].sum())
        assert flag == (in_block > 0) and tiles_used == -(-in_block // tile)
        # the forward's runs: of 4 token tiles up to fours_end, then at most one of 2 and one of 1
        assert fours_end % 4 == 0 and twos_end - fours_end in (0, 2) and tiles_used - twos_end in (0, 1)
        # the backward's flags: an expert's first block starts its weight gradients, a later one continues
        assert (starts, continues) == ((0, 0) if not flag else (int(expert not in seen), int(expert in seen)))
        seen.add(expert)


def test_unused_experts_read_none_of_their_weights():
    """An expert no token picks costs no weight read: decode touches only the routed experts."""
    tokens, hidden, inter, experts, top_k = 3, 128, 256, 8, 1
    x, _, _, w_gate_up, w_down = _inputs((tokens, hidden, inter, experts, top_k), torch.bfloat16)
    index, weights = torch.tensor([[2], [2], [5]]), torch.ones(tokens, 1)
    with sim.capture() as traces:
        out = moe_experts(x, index, weights, w_gate_up, w_down)
    (trace,) = traces
    weight_bytes = 2 * 3 * hidden * inter  # one expert's three projections, bf16
    assert 2 * weight_bytes <= trace.hbm_bytes < 2 * weight_bytes + 64 * 1024
    args = (x, index, weights, w_gate_up, w_down)
    exact = moe_experts_reference(*_fp32(args))
    torch_error = (moe_experts_reference(*args).float() - exact).abs().max()
    assert (out.float() - exact).abs().max() <= 2 * torch_error


def test_the_backward_reads_only_the_routed_experts_weights():
    """Decode-like routing: the backward reads the two routed experts' weights and writes their gradients;
    the six idle experts cost only their gradients' zeros."""
    tokens, hidden, inter, experts = 3, 128, 256, 8
    x, _, _, w_gate_up, w_down = _inputs((tokens, hidden, inter, experts, 1), torch.bfloat16)
    index, weights = torch.tensor([[2], [2], [5]]), torch.ones(tokens, 1)
    grad_out = torch.randn(tokens, hidden).bfloat16()
    with sim.capture() as traces:
        moe_bwd(grad_out, x, index, weights, w_gate_up, w_down, "silu")
    (trace,) = traces
    weight_bytes = 2 * 3 * hidden * inter  # one expert's three projections, bf16
    routed, idle = 2, experts - 2
    expected = 2 * routed * weight_bytes + idle * weight_bytes  # read and written once; zeros
    assert expected <= trace.hbm_bytes < expected + 64 * 1024


def test_multi_part_forward(monkeypatch):
    """Parts of the intermediate with fp32 partial sums in HBM (one part per intermediate tile)."""
    monkeypatch.setattr(moe_kernels, "part_tiles", lambda *args: 1)
    args = _inputs((140, 96, 300, 4, 2), torch.float32)
    torch.testing.assert_close(moe_experts(*args, "silu"), moe_experts_reference(*args, "silu"), rtol=1e-5, atol=1e-5)


def _top1_inputs(counts, hidden, inter, seed=7):
    """fp32 inputs with top-1 routing that gives expert e exactly counts[e] tokens (in shuffled order)."""
    gen = torch.Generator().manual_seed(seed)
    tokens, experts = sum(counts), len(counts)
    order = torch.randperm(tokens, generator=gen)
    index = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))[order][:, None]
    weights = torch.rand(tokens, 1, generator=gen) + 0.5
    x = torch.randn(tokens, hidden, generator=gen)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w_down = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    return x, index, weights, w_gate_up, w_down


# Expert 0's used token tiles in its one block (and the runs of 4, 2 and 1 tiles the forward's matmuls take
# them in): exactly 4 (one run of 4), 5 (4 + 1), 6 (4 + 2), 7 (4 + 2 + 1), exactly 8 (4 + 4); the other
# expert gets one partial tile (a run of 1).
WIDE_RUN_TILES = [4, 5, 6, 7, 8]


def _expert_counts(used_tiles):
    """Token counts that give expert 0 ``used_tiles`` token tiles, the last partial unless 4 or 8 (full)."""
    return [128 * used_tiles - (0 if used_tiles % 4 == 0 else 27), 30]


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("used_tiles", WIDE_RUN_TILES)
def test_forward_takes_a_blocks_token_tiles_in_runs_of_4_2_and_1(monkeypatch, used_tiles, parts):
    """Every run of a block's used token tiles is computed (the wide runs and the remainder's), in one part
    (y^T evicted from PSUM) and in three (the first part's sums stored, the later ones' added)."""
    if parts > 1:
        monkeypatch.setattr(moe_kernels, "part_tiles", lambda *args: 1)
    counts = _expert_counts(used_tiles)
    args = _top1_inputs(counts, 64, 300)
    layout = routing_layout(args[1], args[2], 2, 64, 300, torch.float32)
    assert layout.block_info[0, :3].tolist() == [0, used_tiles, 1]  # one block of expert 0, as intended
    torch.testing.assert_close(moe_experts(*args, "silu"), moe_experts_reference(*args, "silu"), rtol=1e-5, atol=1e-5)


def test_forward_matmuls_move_up_to_512_token_columns():
    """The projections' matmuls take a block's used token tiles in runs of 4, 2 and 1 (512, 256 and 128
    moving columns): one hidden tile, one intermediate tile, so each run is one gate, one up and one
    down matmul; expert 0's 7 tiles are three runs, expert 1's one tile one."""
    args = _top1_inputs(_expert_counts(7), 64, 96)
    with sim.capture() as traces:
        moe_experts(*args, "silu")
    (trace,) = traces
    moving = Counter(i.attrs["N"] for i in trace.instructions if i.op == "nc_matmul")
    assert moving == {512: 3, 256: 3, 128: 3 + 3}


@pytest.mark.parametrize("paired", [1, 0])
def test_backward_projects_g_and_u_in_one_matmul_per_hidden_tile(monkeypatch, paired):
    """Paired (the plan's choice when SBUF allows), an intermediate tile's gate and up rows are one moving
    operand: one token tile, two hidden tiles (128 + 72), one intermediate tile of 96, so g and u take two
    192-column matmuls; apart, four of 96. The other products: da and dWd two of the part's 96 columns
    each, dx and dWg/dWu two of the hidden's 200 each; the gradients match either way."""
    plan = moe_kernels.backward_part_plan
    monkeypatch.setattr(moe_kernels, "backward_part_plan", lambda *a: plan(*a)[:2] + (paired,))
    args = _top1_inputs([100], 200, 96)
    grad_out = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(8))
    with sim.capture() as traces:
        got = _grads(moe_experts, args, "silu", grad_out)
    (trace,) = [t for t in traces if t.kernel == "moe_bwd"]
    moving = Counter(i.attrs["N"] for i in trace.instructions if i.op == "nc_matmul")
    assert moving == ({96: 4, 192: 2, 200: 4} if paired else {96: 8, 200: 4})
    _assert_grads_match(got, _grads(moe_experts_reference, args, "silu", grad_out))


def test_a_masked_choice_adds_nothing():
    """transformers' expert-parallel marker (index == E) is skipped by the module; the op skips it too."""
    x, index, weights, w_gate_up, w_down = _inputs((20, 64, 96, 4, 2), torch.float32)
    index[3, 1] = 4
    out = moe_experts(x, index, weights, w_gate_up, w_down)
    torch.testing.assert_close(out, moe_experts_reference(x, index, weights, w_gate_up, w_down), rtol=1e-5, atol=1e-5)


def test_opcheck_passes():
    x, index, weights, w_gate_up, w_down = _inputs((20, 64, 96, 4, 2), torch.float32)
    torch.library.opcheck(moe_fwd, (x, index, weights, w_gate_up, w_down, "silu"))
    leaves = [t.clone().requires_grad_() for t in (x, weights, w_gate_up, w_down)]
    torch.library.opcheck(moe_fwd, (leaves[0], index, leaves[1], leaves[2], leaves[3], "gelu_tanh"))
    torch.library.opcheck(moe_bwd, (torch.randn_like(x), x, index, weights, w_gate_up, w_down, "silu"))


def test_torch_compile_fullgraph_forward_and_backward():
    args = _inputs((24, 128, 96, 4, 2), torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: moe_experts(*a, "silu") * 2, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), 2 * moe_experts_reference(*args, "silu"), rtol=1e-5, atol=1e-5)
    x, index, weights, w_gate_up, w_down = args
    leaves = [t.clone().requires_grad_() for t in (x, weights, w_gate_up, w_down)]
    loss = torch.compile(
        lambda x, w, gu, d: moe_experts(x, index, w, gu, d, "silu").square().sum(), fullgraph=True, backend="aot_eager"
    )
    with sim.capture() as traces:
        loss(*leaves).backward()
    assert _launches(traces, "moe_fwd") == 1
    ref = [t.clone().requires_grad_() for t in (x, weights, w_gate_up, w_down)]
    moe_experts_reference(ref[0], index, ref[1], ref[2], ref[3], "silu").square().sum().backward()
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


def test_autocast_computes_in_the_autocast_dtype_as_the_modules_linears_do():
    args = _inputs((30, 64, 96, 4, 2), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe_experts(*args, "silu")
        want = moe_experts_reference(*args, "silu")
    assert out.dtype == torch.bfloat16
    exact = moe_experts_reference(*args, "silu")
    assert (out.float() - exact).abs().max() <= 2 * (want.float() - exact).abs().max()


def _bad(**changes):
    x, index, weights, w_gate_up, w_down = _inputs((6, 64, 96, 4, 2), torch.float32)
    args = dict(x=x, top_k_index=index, top_k_weights=weights, w_gate_up=w_gate_up, w_down=w_down, activation="silu")
    args.update({k: (v(args[k]) if callable(v) else v) for k, v in changes.items()})
    return args


@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"activation": "relu"}, ValueError, "activation 'relu' is not one of"),
        ({"x": lambda x: x[None]}, ValueError, r"x must be \[tokens >= 1, hidden\]"),
        ({"top_k_index": lambda i: i[:3]}, ValueError, r"top_k_index of shape \(3, 2\) is not \[6, k >= 1\]"),
        ({"top_k_index": lambda i: i.float()}, TypeError, "top_k_index has dtype torch.float32"),
        ({"top_k_weights": lambda w: w[:, :1]}, ValueError, "top_k_weights of shape"),
        (
            {"w_down": lambda w: w[:, :32].contiguous()},
            ValueError,
            "down weight of shape .* does not match hidden size 64",
        ),
        ({"w_gate_up": lambda w: w[:, :100].contiguous()}, ValueError, r"gate_up weight of shape \(4, 100, 64\)"),
        ({"w_down": lambda w: w.double()}, TypeError, "down weight has dtype torch.float64"),
        ({"w_down": lambda w: w.bfloat16()}, TypeError, "x and the weights must share one dtype"),
        ({"w_down": lambda w: w.transpose(1, 2).contiguous().transpose(1, 2)}, ValueError, "not contiguous"),
    ],
)
def test_bad_input_gets_a_clear_error(changes, error, match):
    with pytest.raises(error, match=match):
        moe_experts(**_bad(**changes))


def test_sizes_past_the_limits_get_a_clear_error():
    with pytest.raises(ValueError, match="hidden size 4160 is outside the supported range 1..4096 for float32"):
        moe_op.validate(
            torch.empty(2, 4160),
            torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, 1),
            torch.empty(1, 2, 4160),
            torch.empty(1, 4160, 1),
            "silu",
        )
    with pytest.raises(ValueError, match="intermediate size 65537 is outside the supported range 1..65536"):
        moe_kernels.check_shapes((2, 8), (1, 2 * 65537, 8), (1, 8, 65537), "silu")


def test_the_backward_plan_takes_the_forwards_limits():
    """The backward's SBUF plan (Trn1's 192 KiB) holds the largest hidden sizes the forward takes."""
    for dtype, hidden in (("bfloat16", moe_kernels.MAX_HIDDEN), ("float32", moe_kernels.MAX_HIDDEN_FP32)):
        tile, block_tiles = moe_kernels.backward_block_plan(4096, hidden, moe_kernels.MAX_INTERMEDIATE, dtype)
        plan = moe_kernels.backward_part_plan(
            tile, block_tiles, hidden, moe_kernels.MAX_INTERMEDIATE, dtype, moe_kernels.PLAN_SBUF_BYTES
        )
        assert block_tiles >= 1 and plan is not None, dtype
    with pytest.raises(ValueError, match="moe_experts backward: hidden size 16384 .bfloat16. does not fit the 192 KiB"):
        moe_kernels.backward_block_plan(4096, 16384, 1024, "bfloat16")
