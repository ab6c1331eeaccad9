"""Fused plain MLP op ``down(act(up(x)))``: numerics against transformers' formula (fp32 tight, bf16
against torch's own bf16 error) for every activation, with and without biases, gradients including the
biases', ragged shapes, the multi-part and small-block paths, what the forward writes to HBM, the
torch.library contract, torch.compile, autocast and bad input."""

import math

import pytest
import torch

from kernels_neuron import sim
from kernels_neuron.ops import plain_mlp as plain_op
from kernels_neuron.ops.plain_mlp import plain_mlp, plain_mlp_bwd, plain_mlp_fwd, plain_mlp_reference

# (tokens..., hidden, intermediate): one token; ragged tiles off multiples of 128; leading dims; several
# saved token tiles (> 256 tokens) and two forward token blocks (> 1024 tokens).
SHAPES = [(1, 64, 96), (300, 200, 300), (2, 7, 130, 256), (1100, 72, 136)]
ACTIVATIONS = ["gelu", "gelu_tanh", "relu", "silu"]


def _inputs(shape, dtype, bias=True, seed=0):
    """x, weights and biases scaled like a trained layer's (outputs of order one), as ``dtype``."""
    *lead, hidden, inter = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, hidden, generator=gen)
    w_up = torch.randn(inter, hidden, generator=gen) * hidden**-0.5
    w_down = torch.randn(hidden, inter, generator=gen) * inter**-0.5
    biases = (0.3 * torch.randn(inter, generator=gen), 0.3 * torch.randn(hidden, generator=gen))
    tensors = (x, w_up, w_down) + (biases if bias else (None, None))
    return [None if t is None else t.to(dtype) for t in tensors]


def _fp32(args):
    return [None if a is None else a.float() for a in args]


def _launches(traces, name):
    return sum(t.kernel == name for t in traces)


def _grads(fn, args, activation, grad_out):
    leaves = [None if a is None else a.detach().clone().requires_grad_(True) for a in args]
    fn(*leaves, activation).backward(grad_out.to(args[0].dtype))
    return [None if leaf is None else leaf.grad for leaf in leaves]


GRAD_NAMES = ("dx", "d_up", "d_down", "d_up_bias", "d_down_bias")


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_matches_reference_tightly(shape, activation, bias):
    args = _inputs(shape, torch.float32, bias)
    with sim.capture() as traces:
        out = plain_mlp(*args, activation)
    assert _launches(traces, "plain_mlp_fwd") == 1 and out.shape == args[0].shape
    torch.testing.assert_close(out, plain_mlp_reference(*args, activation), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=str)
def test_bf16_error_is_within_twice_torchs_own_bf16_error(shape, activation):
    args = _inputs(shape, torch.bfloat16)
    exact = plain_mlp_reference(*_fp32(args), activation)
    torch_error = (plain_mlp_reference(*args, activation).float() - exact).abs().max()
    kernel_error = (plain_mlp(*args, activation).float() - exact).abs().max()
    assert 0 < kernel_error <= 2 * torch_error, (kernel_error, torch_error)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(1, 64, 96), (300, 200, 300), (2, 3, 130, 260)], ids=str)
def test_fp32_gradients_match_autograd_of_the_reference(shape, activation, bias):
    args = _inputs(shape, torch.float32, bias, seed=1)
    grad_out = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(2))
    with sim.capture() as traces:
        got = _grads(plain_mlp, args, activation, grad_out)
    assert _launches(traces, "plain_mlp_fwd") == 1 and _launches(traces, "plain_mlp_bwd") == 1
    want = _grads(plain_mlp_reference, args, activation, grad_out)
    for name, g, w in zip(GRAD_NAMES, got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.shape == w.shape and g.dtype == torch.float32 and w.abs().max() > 0, name
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * w.abs().max(), msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_bf16_gradients_are_within_three_times_torchs_own_bf16_error(activation):
    args = _inputs((300, 200, 300), torch.bfloat16, seed=1)
    grad_out = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(2))
    got = _grads(plain_mlp, args, activation, grad_out)
    exact = _grads(plain_mlp_reference, _fp32(args), activation, grad_out)
    eager = _grads(plain_mlp_reference, args, activation, grad_out)
    for name, g, e, t in zip(GRAD_NAMES, got, exact, eager):
        assert g.dtype == torch.bfloat16, name
        kernel_error, torch_error = (g.float() - e).abs().max(), (t.float() - e).abs().max()
        assert 0 < kernel_error <= 3 * torch_error, (name, kernel_error, torch_error)


def test_relu_gradient_at_zero_is_zero_as_in_torch():
    """Tokens whose up projection is exactly 0 (x = 0, zero bias) get relu'(0) = 0, as torch's."""
    x, w_up, w_down, _, _ = _inputs((8, 64, 96), torch.float32)
    x[3] = 0.0
    b_up, b_down = torch.zeros(96), torch.zeros(64)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    got = _grads(plain_mlp, [x, w_up, w_down, b_up, b_down], "relu", grad_out)
    want = _grads(plain_mlp_reference, [x, w_up, w_down, b_up, b_down], "relu", grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_multi_part_forward_and_small_backward_blocks(monkeypatch):
    """Force the paths big shapes take: the intermediate in parts (fp32 partial sums in HBM, the down
    bias added once), one intermediate tile per backward block (bias sums over several blocks), token
    contractions over several PSUM groups."""
    kernels = plain_op._kernels
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
    got = _grads(plain_mlp, args, "gelu", grad_out)
    want = _grads(plain_mlp_reference, args, "gelu", grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * w.abs().max())


@pytest.mark.parametrize("tokens, hidden, inter", [(300, 200, 300), (8, 128, 1024)])
def test_inference_forward_writes_no_intermediate_to_hbm(tokens, hidden, inter):
    """Without gradients the only HBM writes are y; the reads are x, each weight once per token block
    and the two biases."""
    args = _inputs((tokens, hidden, inter), torch.bfloat16)
    with torch.no_grad(), sim.capture() as traces:
        plain_mlp(*args, "gelu_tanh")
    (trace,) = traces
    assert sum(i.hbm_bytes_written for i in trace.instructions) == tokens * hidden * 2
    block, _ = plain_op._kernels.forward_plan(tokens, hidden, inter, "bfloat16", 224 * 1024, 1)
    reads = sum(i.hbm_bytes_read for i in trace.instructions)
    assert reads == (tokens * hidden + math.ceil(tokens / block) * 2 * hidden * inter + inter + hidden) * 2


def test_training_forward_saves_exactly_the_up_projection_with_its_bias():
    tokens, hidden, inter = 300, 200, 300
    x, w_up, w_down, b_up, b_down = _inputs((tokens, hidden, inter), torch.float32)
    y, saved = plain_mlp_fwd(x, w_up, w_down, b_up, b_down, "gelu", True)
    assert tuple(saved.shape) == plain_op._kernels.saved_shape(tokens, inter, 1)
    up = saved.permute(0, 4, 2, 3, 1).reshape(-1, saved.shape[3] * 128)[:tokens, :inter]
    torch.testing.assert_close(up, torch.nn.functional.linear(x, w_up, b_up), rtol=1e-5, atol=1e-5)
    assert torch.equal(y, plain_mlp_fwd(x, w_up, w_down, b_up, b_down, "gelu", False)[0])


def test_opcheck_and_the_backward_of_a_forward_that_saved_nothing():
    x, w_up, w_down, b_up, b_down = _inputs((20, 64, 96), torch.float32)
    torch.library.opcheck(plain_mlp_fwd, (x, w_up, w_down, b_up, b_down, "gelu", False))
    leaves = [t.clone().requires_grad_() for t in (x, w_up, w_down, b_up, b_down)]
    torch.library.opcheck(plain_mlp_fwd, (*leaves, "relu", True))
    torch.library.opcheck(plain_mlp_fwd, (*leaves[:3], None, None, "silu", True))
    _, saved = plain_mlp_fwd(x, w_up, w_down, b_up, b_down, "gelu", True)
    torch.library.opcheck(plain_mlp_bwd, (torch.randn_like(x), x, w_up, w_down, saved, "gelu", True))
    out, nothing = plain_mlp_fwd(*leaves, "gelu", False)
    assert nothing.numel() == 0
    with pytest.raises(RuntimeError, match="save_for_backward=False"):
        out.sum().backward()


def test_torch_compile_fullgraph_forward_and_backward():
    args = _inputs((2, 9, 128, 192), torch.float32)
    torch._dynamo.reset()
    loss = torch.compile(lambda *a: plain_mlp(*a, "gelu").square().sum(), fullgraph=True, backend="aot_eager")
    leaves = [a.clone().requires_grad_() for a in args]
    with sim.capture() as traces:
        loss(*leaves).backward()
    assert _launches(traces, "plain_mlp_fwd") == 1 and _launches(traces, "plain_mlp_bwd") == 1
    ref = [a.clone().requires_grad_() for a in args]
    plain_mlp_reference(*ref, "gelu").square().sum().backward()
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


def test_autocast_casts_x_weights_and_biases_like_nn_linear():
    args = _inputs((40, 64, 96), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = plain_mlp(*args, "gelu_tanh")
        want = plain_mlp_reference(*args, "gelu_tanh")
    assert got.dtype == want.dtype == torch.bfloat16
    exact = plain_mlp_reference(*args, "gelu_tanh")
    assert (got.float() - exact).abs().max() <= 2 * (want.float() - exact).abs().max()


def _bad(**changes):
    args = dict(zip(("x", "w_up", "w_down", "b_up", "b_down"), _inputs((4, 64, 96), torch.float32)))
    return {**args, **changes}


@pytest.mark.parametrize(
    "args, error, match",
    [
        (_bad(), ValueError, "activation 'quick_gelu' is not one of"),
        (_bad(b_down=None), ValueError, "the up and down biases come both or neither"),
        (
            _bad(b_up=torch.zeros(95)),
            ValueError,
            r"biases of shapes \(95,\) and \(64,\) do not match \[96\] and \[64\]",
        ),
        (_bad(w_down=torch.zeros(64, 95)), ValueError, r"down weight of shape \(64, 95\) does not match \[64, 96\]"),
        (_bad(w_up=torch.zeros(96, 65)), ValueError, r"up weight of shape \(96, 65\) does not match x"),
        (_bad(b_up=torch.zeros(96, dtype=torch.bfloat16)), TypeError, "must share one dtype, got x torch.float32"),
        (_bad(x=torch.zeros(4, 64, dtype=torch.int32)), TypeError, "x has dtype torch.int32"),
        (_bad(w_up=torch.zeros(64, 96).t()), ValueError, "up weight of shape .* is not contiguous"),
        (
            _bad(
                x=torch.zeros(2, 8200), w_up=torch.zeros(4, 8200), w_down=torch.zeros(8200, 4), b_up=None, b_down=None
            ),
            ValueError,
            "hidden size 8200 is outside the supported range 1..4096 for float32",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(args, error, match):
    activation = "quick_gelu" if "activation" in match else "gelu"
    with pytest.raises(error, match=match):
        plain_mlp(*args.values(), activation)
