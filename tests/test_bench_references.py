"""Every benchmark case's PyTorch reference computes what its kernel computes, through the same
calls a Trainium host's timing loop makes (``bench.device_calls``), here on the CPU.

The suite's cases are full-size; these are the same factories at small sizes, one per variant of
each reference (the last test checks that every suite case's kernel, reference and keyword
arguments are among them)."""

import numpy as np
import pytest
import torch

from kernels_neuron import bench, sim
from kernels_neuron.bench import suite
from kernels_neuron.bench.calibration import basic_tiled, blocked_free, fully_optimized
from kernels_neuron.sim.examples import tiled_matmul
from nki_src.mlp import mlp_fwd, plain_mlp_fwd

# Relative error (Frobenius norm) between the kernel's bf16 result and the torch reference's own
# bf16 result: both round differently, a few bf16 ulps (2**-8) at most; a reference that computes
# something else (no window, no softcap, the wrong causal alignment) is off by tens of percent.
RELATIVE_TOLERANCE = 3e-2

SMALL = [
    # fully_optimized's default blocks are 16 M tiles x 2 N tiles x 8 K tiles: one block at most.
    suite.projection_case("optimised", fully_optimized, "Llama-3-8B", 2048, 1024, 1024),
    suite.projection_case("optimised/tiles_k", fully_optimized, "Gemma-2-9B", 2048, 384, 1024, tiles_k=3),
    suite.projection_case("blocked", blocked_free, "Qwen3-8B", 256, 256, 1024),
    suite.projection_case("basic", basic_tiled, "Qwen3-8B", 128, 256, 512),
    suite.projection_case("tiled", tiled_matmul, "Llama-3-8B", 200, 300, 600),
    suite.rmsnorm_case("rmsnorm-fwd/llama", "Llama-3-8B", 130, 96, "llama"),
    suite.rmsnorm_case("rmsnorm-fwd/gemma", "Gemma-2-9B", 130, 96, "gemma"),
    suite.rmsnorm_case("rmsnorm-fwd/llama-decode", "Llama-3-8B", 3, 1024, "llama"),
    suite.rmsnorm_case("rmsnorm-fwd/gemma-decode", "Gemma-2-9B", 3, 1024, "gemma"),
    suite.rmsnorm_case("rmsnorm-bwd/llama", "Llama-3-8B", 130, 96, "llama", backward=True),
    suite.rmsnorm_case("rmsnorm-bwd/gemma", "Gemma-2-9B", 130, 96, "gemma", backward=True),
    suite.layernorm_case("layernorm-fwd/affine", "GPT-J-6B", 130, 300),
    suite.layernorm_case("layernorm-fwd/weight", "Command-R", 130, 2100, bias=False),
    suite.layernorm_case("layernorm-fwd/decode", "Starcoder2-7B", 3, 576),  # the decode layout: 32 partitions
    suite.layernorm_case("layernorm-bwd/affine", "GPT-J-6B", 130, 300, backward=True),
    suite.layernorm_case("layernorm-bwd/weight", "Command-R", 130, 2100, bias=False, backward=True),
    suite.attention_case("attention-fwd/causal", "Llama-3-8B", 200, 200, d=64),
    suite.attention_case("attention-fwd/window", "Mistral-7B", 384, 384, d=64, window=100),
    suite.attention_case("attention-fwd/softcap", "Gemma-2-9B", 256, 256, d=256, window=128, softcap=5.0),
    suite.attention_case("attention-fwd/decode", "Qwen3-8B", 1, 300, d=64),
    suite.attention_case("attention-fwd/suffix", "Qwen3-8B", 128, 384, d=64),
    suite.attention_case("attention-fwd/packed", "Qwen3-8B", 300, 300, d=64, packed=(100, 150, 50)),
    suite.decode_case("attention-decode/one-query-gqa", "Qwen3-8B", 2, 8, 2, 1, 300, d=64),
    suite.decode_case("attention-decode/spec-gqa", "Mistral-7B", 1, 4, 2, 4, 300, d=64),
    suite.decode_case("attention-decode/softcap-d256", "Gemma-2-9B", 1, 4, 2, 1, 300, d=256, softcap=5.0),
    suite.decode_paged_case("attention-decode/paged", "Llama-3-8B", 2, 8, 2, 300, 16, d=64),
    suite.decode_paged_case("attention-decode/paged-softcap-d256", "Gemma-2-9B", 1, 4, 2, 300, 16, d=256, softcap=5.0),
    suite.attention_case("attention-bwd/causal", "Llama-3-8B", 200, 200, d=64, backward=True),
    suite.attention_case("attention-bwd/packed", "Qwen3-8B", 300, 300, d=64, packed=(100, 150, 50), backward=True),
    suite.mlp_case("mlp-fwd/silu", "Llama-3-8B", 100, 192, 320),
    suite.mlp_case("mlp-fwd/gelu", "Gemma-2-9B", 100, 192, 320, activation="gelu_tanh"),
    suite.mlp_case("mlp-bwd/silu", "Llama-3-8B", 100, 192, 320, backward=True),
    suite.mlp_case("mlp-bwd/gelu", "Gemma-2-9B", 100, 192, 320, activation="gelu_tanh", backward=True),
    suite.plain_mlp_case("plain-mlp-fwd/gelu_tanh", "Starcoder2-7B", "Starcoder2MLP", 100, 192, 320, "gelu_tanh"),
    suite.plain_mlp_case(
        "plain-mlp-bwd/gelu_tanh", "Starcoder2-7B", "Starcoder2MLP", 100, 192, 320, "gelu_tanh", backward=True
    ),
    suite.plain_mlp_case("plain-mlp-fwd/gelu", "Pythia-6.9B", "GPTNeoXMLP", 100, 192, 320, "gelu"),
    suite.moe_case("moe-fwd/top2", "Mixtral-8x7B", 100, 192, 320, 4, 2),
    suite.moe_case("moe-bwd/top2", "Mixtral-8x7B", 100, 192, 320, 4, 2, backward=True),
]


def _inputs(case):
    inputs = case.make_inputs(0)
    if case.kernel is suite.mlp_bwd:
        # The suite draws the saved gate/up (the modelled time does not depend on them); a comparison
        # needs the forward's.
        dy, x, w_gate, w_up, w_down, _ = inputs
        _, saved = sim.run(mlp_fwd, x, w_gate, w_up, w_down, case.kwargs["activation"], True).outputs
        inputs = (dy, x, w_gate, w_up, w_down, saved)
    if case.kernel is suite.plain_mlp_bwd:
        # Likewise, from a forward with the zero biases the reference's autograd runs with.
        dy, x, w_up, w_down, _ = inputs
        zeros = (np.zeros(w_up.shape[0], x.dtype), np.zeros(w_down.shape[0], x.dtype))
        _, saved = sim.run(plain_mlp_fwd, x, w_up, w_down, *zeros, case.kwargs["activation"], True).outputs
        inputs = (dy, x, w_up, w_down, saved)
    return inputs


def _as_tuple(value):
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _relative_errors(case):
    kernel_call, reference_call = bench.device_calls(case, _inputs(case), "cpu")
    got, want = _as_tuple(kernel_call()), _as_tuple(reference_call())
    assert len(got) >= len(want)
    errors = []
    for g, w in zip(got, want):
        assert g.shape == w.shape, (g.shape, w.shape)
        w = w.float()
        assert w.norm() > 0  # a vacuous comparison (all-zero gradients) would pass any tolerance
        errors.append(float((g.float() - w).norm() / w.norm()))
    return errors


@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
def test_reference_computes_what_the_kernel_computes_through_the_device_calls(case):
    assert max(_relative_errors(case)) < RELATIVE_TOLERANCE


def test_a_reference_that_ignores_the_window_is_caught():
    """Negative control: the comparison above fails for the reference the suite once had, plain
    causal sdpa whatever the case's window."""
    case = next(c for c in SMALL if c.name == "attention-fwd/window")

    def causal_sdpa(q, k, v, *args):
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    wrong = suite.Case(**{**case.__dict__, "prepare_reference": causal_sdpa})
    assert max(_relative_errors(wrong)) > 10 * RELATIVE_TOLERANCE


def test_backward_references_time_the_backward_alone():
    """The call a timing loop repeats runs no forward: the forward graph is built when it is prepared."""
    case = next(c for c in SMALL if c.name == "mlp-bwd/silu")
    _, reference_call = bench.device_calls(case, _inputs(case), "cpu")
    with torch.autograd.profiler.profile() as profile:
        reference_call()
    names = {event.name for event in profile.function_events}
    assert "aten::mm" in names and not any("silu" in name and "backward" not in name for name in names), names


def test_every_suite_case_is_covered_at_a_small_size():
    def variant(case):
        return case.kernel, case.prepare_reference, tuple(sorted(case.kwargs)), case.reference_name

    small = {variant(c) for c in SMALL}
    uncovered = [c.name for c in suite.CASES if variant(c) not in small]
    assert not uncovered


def test_bf16_inputs_reach_torch_through_their_bits():
    x = np.arange(6, dtype=np.float32).reshape(2, 3).astype(suite.ml_dtypes.bfloat16)
    (t, flag) = bench.torch_inputs((x, True), "cpu")
    assert t.dtype == torch.bfloat16 and flag is True
    assert torch.equal(t.float(), torch.arange(6, dtype=torch.float32).reshape(2, 3))
