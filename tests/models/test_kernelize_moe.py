"""kernelize(model, device="neuron") swaps the grouped MoE experts kernel into tiny Mixtral, Qwen3-MoE,
DeepSeek-V3 and OLMoE models: every experts module is swapped and reported, logits (fp32, bf16), training
loss and every gradient (router included) match the un-kernelized model, and greedy generate gives the
same tokens. GPT-OSS's experts (another computation) and look-alike classes keep their own forward with
the reason in the report. The NKI kernels run on the CPU simulator, and each test checks that they did."""

import copy
import sys

import pytest
import torch
import transformers
from tiny_models import (
    BASE,
    MOE_CONFIGS,
    assert_gradients_match,
    assert_logits_match,
    build_moe,
    forward_of,
    input_ids,
    logits,
)
from torch import nn

import kernels_neuron
from kernels_neuron import sim

MOE_REPO = "kernels-neuron/neuron-moe"
MOE_PACKAGE = "_neuron_moe_"  # the builder's module ids: _neuron_moe_<backend>_<hash>
LAYERS = 2

ARCHS = ["mixtral", *MOE_CONFIGS]


def _kernelize(model, **kwargs):
    # attention=False: the experts' numerics without the attention kernel's.
    return kernels_neuron.kernelize(model, device="neuron", attention=False, **kwargs)


def _experts(model):
    return {path: m for path, m in model.named_modules() if path.endswith("mlp.experts")}


def _moe_rows(model):
    return [row for row in model.kernels_neuron_report if row.kernel.startswith(MOE_REPO)]


def _launches(traces, name):
    return sum(t.kernel == name for t in traces)


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


def test_every_experts_module_is_swapped_and_reported(arch):
    model = _kernelize(build_moe(arch))
    rows = _moe_rows(model)
    experts = _experts(model)
    assert len(experts) == LAYERS
    assert [r.path for r in rows] == list(experts)
    assert {(r.layer, r.kernel, r.status) for r in rows} == {("MoEExperts", f"{MOE_REPO}:MoEExperts", "swapped")}
    for module in experts.values():
        function = forward_of(module)
        assert function is not type(module).forward and function.__qualname__ == "MoEExperts.forward"
        assert function.__module__.startswith(MOE_PACKAGE), function.__module__
    text = str(model.kernels_neuron_report)
    assert all(path in text for path in experts) and f"{MOE_REPO}:MoEExperts" in text


def test_fp32_logits_match_the_original_model(arch):
    model = build_moe(arch)
    reference = copy.deepcopy(model)
    _kernelize(model)
    with sim.capture() as traces:
        assert_logits_match(model, reference, input_ids())
    assert _launches(traces, "moe_fwd") == LAYERS


def test_bf16_logits_stay_within_twice_torchs_own_bf16_error(arch):
    exact = build_moe(arch)
    eager = copy.deepcopy(exact).to(torch.bfloat16)
    kernelized = _kernelize(copy.deepcopy(exact).to(torch.bfloat16))
    ids = input_ids()
    with sim.capture() as traces:
        got = logits(kernelized, ids)
    assert _launches(traces, "moe_fwd") == LAYERS
    want = logits(exact, ids)
    torch_error, kernel_error = (logits(eager, ids) - want).abs().max(), (got - want).abs().max()
    assert 0 < torch_error and kernel_error <= 2 * torch_error, (kernel_error, torch_error)


def test_training_loss_and_every_gradient_match(arch):
    model = build_moe(arch).train()
    reference = copy.deepcopy(model)
    _kernelize(model)
    assert model.kernels_neuron_report.mode == "training"
    assert {r.status for r in _moe_rows(model)} == {"swapped"}
    ids = input_ids()
    with sim.capture() as traces:
        loss = model(ids, labels=ids).loss
        loss.backward()
    assert _launches(traces, "moe_fwd") == LAYERS and _launches(traces, "moe_bwd") == LAYERS
    expected = reference(ids, labels=ids).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for path, module in _experts(model).items():
        assert module.gate_up_proj.grad.abs().max() > 0, path  # non-zero before comparing
    assert_gradients_match(model, reference)


def test_greedy_generate_gives_the_same_tokens(arch):
    model = build_moe(arch)
    reference = copy.deepcopy(model)
    _kernelize(model)
    prompt = input_ids(batch=2, seq=8)
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=5, do_sample=False, min_new_tokens=5)
        with sim.capture() as traces:
            got = model.generate(prompt, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert torch.equal(got, expected)
    assert _launches(traces, "moe_fwd") == LAYERS * 5  # the prompt, then 4 decode steps of 2 tokens each


# --- what keeps its own forward ------------------------------------------------------------------------


def test_gpt_oss_experts_are_reported_as_another_form():
    config = transformers.GptOssConfig(
        **{**BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128, "layer_types": None}
    )
    model = _kernelize(transformers.GptOssForCausalLM(config).eval())
    rows = [r for r in model.kernels_neuron_report.no_kernel if r.path.endswith("mlp.experts")]
    assert [r.path for r in rows] == [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    assert all("GptOssExperts: not MixtralExperts' forward" in r.reason for r in rows)
    assert not _moe_rows(model)


def test_a_look_alike_experts_class_is_not_taken_for_mixtrals():
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    class ScaledExperts(MixtralExperts):  # same weights, another computation
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2 * super().forward(hidden_states, top_k_index, top_k_weights)

    model = build_moe("mixtral")
    model.model.layers[0].mlp.experts.__class__ = ScaledExperts
    _kernelize(model)
    first, second = _moe_rows(model)
    assert (first.path, first.status) == ("model.layers.0.mlp.experts", "fallback")
    assert "ScaledExperts.forward is not MixtralExperts' computation" in first.reason
    assert (second.path, second.status) == ("model.layers.1.mlp.experts", "swapped")


def test_an_activation_the_kernel_lacks_keeps_the_modules_forward():
    model = build_moe("mixtral")
    reference = copy.deepcopy(model)
    for module in _experts(model).values():
        module.act_fn = nn.ReLU()
    for module in _experts(reference).values():
        module.act_fn = nn.ReLU()
    _kernelize(model)
    rows = _moe_rows(model)
    assert {r.status for r in rows} == {"fallback"}
    assert all("act_fn: activation ReLU" in r.reason for r in rows)
    assert_logits_match(model, reference, input_ids())


def test_the_layer_recognises_experts_once_transformers_is_loaded(monkeypatch):
    """The plug-in never imports transformers itself (the Hub repo does not depend on it); asked while it is
    not loaded, it recognises nothing, and remembers nothing of that once it is."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from kernels_neuron.ops import moe_layers

    monkeypatch.delitem(sys.modules, "transformers")
    assert not moe_layers.computes("MoEExperts", MixtralExperts)
    monkeypatch.undo()
    assert moe_layers.computes("MoEExperts", MixtralExperts)
