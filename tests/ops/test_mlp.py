"""Fused gated MLP op: numerics against transformers' formula (fp32 tight, bf16 against torch's own bf16
error), gradients, ragged shapes, the fused gate_up weight, the kernel's multi-part and small-block paths,
what the forward writes to HBM, the torch.library contract, torch.compile, and bad input."""

import math

import pytest
import torch
from torch import nn

from kernels_neuron import sim
from kernels_neuron.ops import mlp as mlp_op
from kernels_neuron.ops.mlp import (
    activation_kind,
    describe_activation,
    gated_mlp,
    gated_mlp_reference,
    mlp_bwd,
    mlp_fwd,
)

# (tokens..., hidden, intermediate): one token; ragged token tiles with hidden and intermediate off
# multiples of 128; leading dims; several saved token tiles (> 256 tokens) and two forward token
# blocks (> 1024 tokens), with a partial last intermediate tile.
SHAPES = [(1, 64, 96), (300, 200, 300), (2, 7, 128, 256), (600, 130, 1100), (1100, 72, 136)]
ACTIVATIONS = ["silu", "gelu_tanh"]


def _inputs(shape, dtype, fused=False, seed=0):
    """x and weights scaled like a trained layer's (outputs of order one), as ``dtype``."""
    *lead, hidden, inter = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, hidden, generator=gen)
    w_gate = torch.randn(inter, hidden, generator=gen) * hidden**-0.5
    w_up = torch.randn(inter, hidden, generator=gen) * hidden**-0.5
    w_down = torch.randn(hidden, inter, generator=gen) * inter**-0.5
    if fused:
        return x.to(dtype), torch.cat([w_gate, w_up]).to(dtype), None, w_down.to(dtype)
    return x.to(dtype), w_gate.to(dtype), w_up.to(dtype), w_down.to(dtype)


def _fp32(args):
    return [None if a is None else a.float() for a in args]


def _launches(traces, name):
    return sum(t.kernel == name for t in traces)


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused_gate_up"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_matches_reference_tightly(shape, activation, fused):
    args = _inputs(shape, torch.float32, fused)
    with sim.capture() as traces:
        out = gated_mlp(*args, activation)
    assert _launches(traces, "mlp_fwd") == 1 and out.shape == args[0].shape
    torch.testing.assert_close(out, gated_mlp_reference(*args, activation), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bf16_error_is_within_twice_torchs_own_bf16_error(shape, activation):
    args = _inputs(shape, torch.bfloat16)
    exact = gated_mlp_reference(*_fp32(args), activation)
    torch_error = (gated_mlp_reference(*args, activation).float() - exact).abs().max()
    kernel_error = (gated_mlp(*args, activation).float() - exact).abs().max()
    assert 0 < kernel_error <= 2 * torch_error, (kernel_error, torch_error)


def test_fp16_matches_the_fp32_reference():
    args = _inputs((130, 96, 160), torch.float16)
    exact = gated_mlp_reference(*_fp32(args), "silu")
    torch_error = (gated_mlp_reference(*args, "silu").float() - exact).abs().max()
    assert (gated_mlp(*args, "silu").float() - exact).abs().max() <= 2 * torch_error


def _grads(fn, args, activation, grad_out):
    leaves = [None if a is None else a.detach().clone().requires_grad_(True) for a in args]
    out = fn(*leaves, activation)
    out.backward(grad_out.to(out.dtype))
    return [None if leaf is None else leaf.grad for leaf in leaves]


GRAD_SHAPES = [(1, 64, 96), (300, 200, 300), (2, 3, 130, 260), (600, 130, 1100), (1100, 72, 136)]


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused_gate_up"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=str)
def test_fp32_gradients_match_autograd_of_the_reference(shape, activation, fused):
    args = _inputs(shape, torch.float32, fused, seed=1)
    grad_out = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(2))
    with sim.capture() as traces:
        got = _grads(gated_mlp, args, activation, grad_out)
    assert _launches(traces, "mlp_fwd") == 1 and _launches(traces, "mlp_bwd") == 1
    want = _grads(gated_mlp_reference, args, activation, grad_out)
    for name, g, w in zip(("dx", "d_gate", "d_up", "d_down"), got, want):
        if w is None:
            assert g is None
            continue
        assert g.shape == w.shape and g.dtype == torch.float32, name
        scale = w.abs().max()
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=str)
def test_bf16_gradients_are_within_three_times_torchs_own_bf16_error(shape, activation):
    args = _inputs(shape, torch.bfloat16, seed=1)
    grad_out = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(2))
    got = _grads(gated_mlp, args, activation, grad_out)
    exact = _grads(gated_mlp_reference, _fp32(args), activation, grad_out)
    eager = _grads(gated_mlp_reference, args, activation, grad_out)
    for name, g, e, t in zip(("dx", "d_gate", "d_up", "d_down"), got, exact, eager):
        assert g.dtype == torch.bfloat16, name
        kernel_error, torch_error = (g.float() - e).abs().max(), (t.float() - e).abs().max()
        assert 0 < kernel_error <= 3 * torch_error, (name, kernel_error, torch_error)


def test_the_fused_gate_up_weight_is_the_same_computation_as_separate_weights():
    x, w_gate, w_up, w_down = _inputs((140, 96, 200), torch.bfloat16, seed=3)
    w_gate_up = torch.cat([w_gate, w_up])
    assert torch.equal(gated_mlp(x, w_gate_up, None, w_down), gated_mlp(x, w_gate, w_up, w_down))
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    dx_f, dgu, _, dd_f = _grads(gated_mlp, (x, w_gate_up, None, w_down), "silu", grad_out)
    dx, dg, du, dd = _grads(gated_mlp, (x, w_gate, w_up, w_down), "silu", grad_out)
    assert torch.equal(dx_f, dx) and torch.equal(dd_f, dd) and torch.equal(dgu, torch.cat([dg, du]))


def test_multi_part_forward_and_small_backward_blocks(monkeypatch):
    """Force the paths big shapes take: the intermediate in parts with fp32 partial sums in HBM, one
    intermediate tile per backward block, narrow GEMM blocks, and token contractions split over
    several PSUM groups with fp32 SBUF partial sums."""
    kernels = mlp_op._kernels
    real_forward_plan, real_backward_plan = kernels.forward_plan, kernels.backward_plan
    monkeypatch.setattr(kernels, "forward_plan", lambda *a: (min(256, a[0]), 1))
    monkeypatch.setattr(
        kernels,
        "backward_plan",
        lambda *a: kernels.BackwardPlan(i_block_tiles=1, dx_rows=256, dx_cols=128, down_rows=128, gate_cols=256),
    )
    monkeypatch.setattr(kernels, "TOKEN_K_TILES", 2)
    monkeypatch.setattr(kernels, "DX_K_TILES", 2)
    args = _inputs((600, 200, 330), torch.float32, seed=5)
    grad_out = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(6))
    with sim.capture() as traces:
        got = _grads(gated_mlp, args, "gelu_tanh", grad_out)
    want = _grads(gated_mlp_reference, args, "gelu_tanh", grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * w.abs().max())
    forward = next(t for t in traces if t.kernel == "mlp_fwd")
    # parts of one tile: the partial sums [hidden, block] went through kernel-private HBM
    assert any(
        i.op == "dma_copy" and any(o.role == "dst" and o.buffer == "hbm" for o in i.operands)
        for i in forward.instructions
    )
    assert real_forward_plan(600, 200, 330, "float32", 224 * 1024) == (600, 3)  # unpatched: one part
    assert real_backward_plan(600, 200, 330, "float32", 224 * 1024).i_block_tiles == 3


def _hbm_bytes_written(trace):
    return sum(i.hbm_bytes_written for i in trace.instructions)


@pytest.mark.parametrize("tokens, hidden, inter", [(300, 200, 300), (8, 128, 1024), (1100, 64, 640)])
def test_inference_forward_writes_no_intermediate_to_hbm(tokens, hidden, inter):
    """Without gradients, the only HBM writes are y itself: nothing [tokens, I]-sized leaves the chip."""
    args = _inputs((tokens, hidden, inter), torch.bfloat16)
    with torch.no_grad(), sim.capture() as traces:
        gated_mlp(*args, "silu")
    (trace,) = traces
    assert _hbm_bytes_written(trace) == tokens * hidden * 2
    assert tokens * inter * 2 > tokens * hidden * 2  # so a [tokens, I] write could not hide in that count
    block, _ = mlp_op._kernels.forward_plan(tokens, hidden, inter, "bfloat16", 224 * 1024)
    reads = sum(i.hbm_bytes_read for i in trace.instructions)
    assert reads == (tokens * hidden + math.ceil(tokens / block) * 3 * hidden * inter) * 2  # weights once per block


def test_training_forward_saves_exactly_the_gate_and_up_projections():
    tokens, hidden, inter = 300, 200, 300
    args = [a.requires_grad_() for a in _inputs((tokens, hidden, inter), torch.bfloat16)]
    with sim.capture() as traces:
        gated_mlp(*args, "silu")
    (trace,) = traces
    saved = math.prod(mlp_op._kernels.saved_shape(tokens, inter))
    assert saved >= 2 * tokens * inter  # gate and up, padded to whole tiles
    assert _hbm_bytes_written(trace) == (tokens * hidden + saved) * 2
    x, w_gate, w_up, w_down = (a.detach() for a in args)
    y, gate_up = mlp_fwd(x, w_gate, w_up, w_down, "silu", True)
    tiles = gate_up.permute(0, 4, 2, 3, 1).reshape(-1, 2, gate_up.shape[3] * 128)[:tokens, :, :inter]
    torch.testing.assert_close(tiles[:, 0].float(), (x.float() @ w_gate.float().T), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(tiles[:, 1].float(), (x.float() @ w_up.float().T), rtol=2e-2, atol=2e-2)
    assert torch.equal(y, mlp_fwd(x, w_gate, w_up, w_down, "silu", False)[0])  # same forward either way


def test_backward_of_a_forward_that_saved_nothing_is_a_clear_error():
    x, w_gate, w_up, w_down = (a.requires_grad_() for a in _inputs((4, 64, 96), torch.float32))
    out, saved = mlp_fwd(x, w_gate, w_up, w_down, "silu", False)
    assert saved.numel() == 0
    with pytest.raises(RuntimeError, match="save_for_backward=False"):
        out.sum().backward()


def test_opcheck_passes():
    x, w_gate, w_up, w_down = _inputs((20, 64, 96), torch.float32)
    torch.library.opcheck(mlp_fwd, (x, w_gate, w_up, w_down, "silu", False))
    grads = [t.clone().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    torch.library.opcheck(mlp_fwd, (*grads, "gelu_tanh", True))
    fused = torch.cat([w_gate, w_up]).requires_grad_()
    torch.library.opcheck(
        mlp_fwd, (x.clone().requires_grad_(), fused, None, w_down.clone().requires_grad_(), "silu", True)
    )
    _, saved = mlp_fwd(x, w_gate, w_up, w_down, "silu", True)
    torch.library.opcheck(mlp_bwd, (torch.randn_like(x), x, w_gate, w_up, w_down, saved, "silu"))


def test_torch_compile_fullgraph_forward_and_backward():
    args = _inputs((2, 9, 128, 192), torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: gated_mlp(*a, "silu") * 2, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), 2 * gated_mlp_reference(*args, "silu"), rtol=1e-5, atol=1e-5)
    explanation = torch._dynamo.explain(lambda *a: gated_mlp(*a, "silu"))(*args)
    assert explanation.graph_break_count == 0
    loss = torch.compile(lambda *a: gated_mlp(*a, "gelu_tanh").square().sum(), fullgraph=True, backend="aot_eager")
    leaves = [a.clone().requires_grad_() for a in args]
    with sim.capture() as traces:
        loss(*leaves).backward()
    assert _launches(traces, "mlp_fwd") == 1 and _launches(traces, "mlp_bwd") == 1
    ref = [a.clone().requires_grad_() for a in args]
    gated_mlp_reference(*ref, "gelu_tanh").square().sum().backward()
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


def test_non_contiguous_x_is_accepted():
    x = torch.randn(64, 40)[:, 8:40]  # [64, 32], not contiguous: activations may be views; they are copied
    assert not x.is_contiguous()
    w_gate, w_up, w_down = _inputs((64, 32, 96), torch.float32)[1:]
    torch.testing.assert_close(
        gated_mlp(x, w_gate, w_up, w_down), gated_mlp_reference(x, w_gate, w_up, w_down), rtol=1e-5, atol=1e-5
    )


def _bad(**changes):
    x, w_gate, w_up, w_down = _inputs((4, 64, 96), torch.float32)
    args = {"x": x, "w_gate": w_gate, "w_up": w_up, "w_down": w_down, "activation": "silu"}
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "args, error, match",
    [
        (_bad(w_gate=torch.ones(97, 64)), ValueError, r"gate weight of shape \(97, 64\) does not match \[96, 64\]"),
        (_bad(w_up=torch.ones(96, 65)), ValueError, r"up weight of shape \(96, 65\) does not match \[96, 64\]"),
        (_bad(w_down=torch.ones(64, 95)), ValueError, r"gate weight of shape \(96, 64\) does not match \[95, 64\]"),
        (_bad(w_down=torch.ones(63, 96)), ValueError, r"down weight of shape \(63, 96\) does not match hidden size 64"),
        (
            _bad(w_gate=torch.ones(190, 64), w_up=None),
            ValueError,
            r"fused gate_up weight of shape \(190, 64\) does not "
            r"match \[2 \* 96, 64\]",
        ),
        (_bad(x=torch.ones(4, 64, dtype=torch.bfloat16)), TypeError, "must share one dtype, got x torch.bfloat16"),
        (_bad(w_down=torch.ones(64, 96, dtype=torch.float16)), TypeError, "down weight torch.float16"),
        (_bad(x=torch.ones(0, 64)), ValueError, r"x of shape \(0, 64\) is empty \(no tokens\)"),
        (_bad(x=torch.ones(2, 0, 64)), ValueError, r"x of shape \(2, 0, 64\) is empty"),
        (_bad(w_gate=torch.ones(64, 96).t()), ValueError, r"gate weight of shape \(96, 64\) is not contiguous"),
        (_bad(w_down=torch.ones(96, 64).t()), ValueError, r"down weight of shape \(64, 96\) is not contiguous"),
        (_bad(x=torch.ones(4, 64, dtype=torch.int32)), TypeError, "x has dtype torch.int32"),
        (_bad(activation="gelu"), ValueError, r"activation 'gelu' is not one of \('silu', 'gelu_tanh'\)"),
        (
            _bad(
                x=torch.ones(2, 4097), w_gate=torch.ones(1, 4097), w_up=torch.ones(1, 4097), w_down=torch.ones(4097, 1)
            ),
            ValueError,
            "hidden size 4097 is outside the supported range 1..4096 for float32",
        ),
        (_bad(w_gate=torch.ones(96, 64, 1)), ValueError, r"gate weight of shape \(96, 64, 1\) does not match"),
    ],
    ids=[
        "gate-shape",
        "up-shape",
        "down-intermediate",
        "down-hidden",
        "fused-shape",
        "x-dtype",
        "weight-dtype",
        "no-tokens",
        "empty-batch",
        "gate-not-contiguous",
        "down-not-contiguous",
        "int-dtype",
        "activation",
        "hidden-limit",
        "weight-rank",
    ],
)
def test_bad_input_gets_a_clear_error(args, error, match):
    with pytest.raises(error, match=match):
        gated_mlp(**args)


def test_bad_input_is_caught_before_tracing_under_torch_compile():
    args = _bad(w_gate=torch.ones(97, 64))
    compiled = torch.compile(lambda **a: gated_mlp(**a), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"gate weight of shape \(97, 64\)"):
        compiled(**args)
    torch._dynamo.reset()


def test_activation_kinds_of_transformers_and_torch_modules():
    from transformers import activations

    kinds = {
        "silu": "silu",
        "swish": "silu",
        "gelu_pytorch_tanh": "gelu_tanh",
        "gelu_python_tanh": "gelu_tanh",
        "gelu_new": "gelu_tanh",
        "gelu_fast": "gelu_tanh",
        "gelu": None,
        "gelu_accurate": None,
        "quick_gelu": None,
        "relu": None,
        "gelu_10": None,
    }
    for name, kind in kinds.items():
        assert activation_kind(activations.ACT2FN[name]) == kind, name
    assert activation_kind(nn.GELU(approximate="tanh")) == "gelu_tanh" and activation_kind(nn.GELU()) is None
    assert activation_kind(torch.nn.functional.silu) == "silu"

    class LeakySiLU(nn.SiLU):  # a subclass that changes the function is not taken for its parent
        def forward(self, x):
            return super().forward(x) + 0.01 * x

    assert activation_kind(LeakySiLU()) is None
    assert "GELUActivation (exact erf GELU)" in describe_activation(activations.ACT2FN["gelu"])


@pytest.mark.parametrize("name", ["gelu_pytorch_tanh", "gelu_new", "gelu_fast", "silu", "swish"])
def test_each_accepted_activation_computes_what_the_kernel_computes(name):
    from transformers import activations

    x = torch.linspace(-8, 8, 4001)
    kind = activation_kind(activations.ACT2FN[name])
    ref = torch.nn.functional.silu(x) if kind == "silu" else torch.nn.functional.gelu(x, approximate="tanh")
    torch.testing.assert_close(activations.ACT2FN[name](x), ref, rtol=1e-6, atol=1e-6)


# --- low-rank (LoRA) updates ---------------------------------------------------------------------------


def _updates(shape, rank=4, seed=7, fused=False):
    """One or two low-rank updates per weight, with non-zero b (a LoRA b starts at zero)."""
    *_, hidden, inter = shape
    gen = torch.Generator().manual_seed(seed)

    def update(out, inp, scale):
        return mlp_op.LowRankUpdate(
            (torch.randn(rank, inp, generator=gen) / 10).requires_grad_(),
            (torch.randn(out, rank, generator=gen) / 10).requires_grad_(),
            scale,
        )

    gate_rows = 2 * inter if fused else inter
    return (
        [update(gate_rows, hidden, 2.0), update(gate_rows, hidden, 0.5)],
        [] if fused else [update(inter, hidden, 2.0)],
        [update(hidden, inter, 1.5)],
    )


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused_gate_up"])
def test_low_rank_updates_match_peft_style_application_and_get_gradients(fused):
    """W + scale * b @ a inside the fused kernel equals applying each update beside the linear (as PEFT's
    LoRA layer does), and a, b (and x) get the same gradients; the frozen base weights get none."""
    shape = (2, 40, 96, 160)
    x, w_gate, w_up, w_down = _inputs(shape, torch.float32, fused)
    x.requires_grad_()
    updates = _updates(shape, fused=fused)
    factors = [t for weight_updates in updates for u in weight_updates for t in (u.a, u.b)]
    with sim.capture() as traces:
        out = gated_mlp(x, w_gate, w_up, w_down, "silu", updates=updates)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        got = torch.autograd.grad(out, [x, *factors], grad)
    assert _launches(traces, "mlp_fwd") == 1 and _launches(traces, "mlp_bwd") == 1
    expected = gated_mlp_reference(x, w_gate, w_up, w_down, "silu", updates=updates)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    without = gated_mlp_reference(x, w_gate, w_up, w_down, "silu")
    assert (expected - without).abs().max() > 1e-2, "the updates change nothing: the check would prove nothing"
    want = torch.autograd.grad(expected, [x, *factors], grad)
    for g, w in zip(got, want):
        scale = w.abs().max()
        assert scale > 0
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * scale)


def test_low_rank_updates_under_bf16_stay_within_torchs_own_bf16_error():
    shape = (64, 128, 256)
    args = _inputs(shape, torch.bfloat16)
    updates = _updates(shape)
    exact = gated_mlp_reference(*_fp32(args), "silu", updates=updates)
    torch_error = (
        (
            gated_mlp_reference(
                *args, "silu", updates=[[u._replace(a=u.a.bfloat16(), b=u.b.bfloat16()) for u in w] for w in updates]
            ).float()
            - exact
        )
        .abs()
        .max()
    )
    kernel_error = (gated_mlp(*args, "silu", updates=updates).float() - exact).abs().max()
    assert torch_error > 0 and kernel_error <= 2 * torch_error, (kernel_error, torch_error)


@pytest.mark.parametrize(
    "updates, match",
    [
        (lambda u: u[:2], "3 lists"),
        (lambda u: [u[0], u[1], [u[2][0]._replace(a=torch.zeros(4, 10))]], "does not match the down weight"),
    ],
    ids=["two-lists", "wrong-shape"],
)
def test_bad_low_rank_updates_get_a_clear_error(updates, match):
    shape = (8, 96, 160)
    args = _inputs(shape, torch.float32)
    with pytest.raises(ValueError, match=match):
        gated_mlp(*args, "silu", updates=updates(_updates(shape)))


def test_low_rank_updates_without_gradients_keep_nothing_for_a_backward():
    """Inference with unmerged adapters (eval, generate) writes only the output, like the plain MLP."""
    shape = (8, 96, 160)
    args = _inputs(shape, torch.float32)
    updates = _updates(shape)
    with torch.no_grad(), sim.capture() as traces:
        out = gated_mlp(*args, "silu", updates=updates)
    written = sum(i.hbm_bytes_written for t in traces for i in t.instructions)
    assert written == out.nbytes
    torch.testing.assert_close(out, gated_mlp_reference(*args, "silu", updates=updates), rtol=1e-5, atol=1e-5)
