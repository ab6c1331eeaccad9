"""kernelize(model, device="neuron") on tiny Cohere, Starcoder2, GPT-NeoX and Falcon models: every LayerNorm
is swapped for the NKI layer and rounds where the module rounds in bf16; LayerNorm classes the kernel does
not compute keep their forward. The same models' fp32 logits, training gradients and greedy generation
with every kernel swapped are checked in tests/models/test_architecture_coverage.py. The NKI kernels run
on the CPU simulator."""

import copy

import pytest
import torch
import transformers
from tiny_models import assert_bf16_like_torch, bf16_errors, input_ids
from torch import nn

import kernels_neuron

BASE = dict(hidden_size=256, num_attention_heads=4, intermediate_size=512, num_hidden_layers=2, vocab_size=128)
# (model class, config class, config adjustments, LayerNorm modules in the 2-layer model, the layer they get)
ARCHS = {
    "cohere": (
        "CohereForCausalLM",
        "CohereConfig",
        {"num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        3,
        "CohereLayerNorm",
    ),
    "starcoder2": (
        "Starcoder2ForCausalLM",
        "Starcoder2Config",
        {"num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2},
        5,
        "LayerNorm",
    ),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {}, 5, "LayerNorm"),
    "falcon": (
        "FalconForCausalLM",
        "FalconConfig",
        {"new_decoder_architecture": True, "num_kv_heads": 2},
        5,
        "LayerNorm",
    ),
}


def _build(arch: str, seed: int = 0) -> nn.Module:
    """A tiny fp32 model whose LayerNorm weights and biases are random, so a layer that ignored them
    would change the output."""
    model_class, config_class, extra, _, _ = ARCHS[arch]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**BASE, **extra})).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in _layer_norms(model).values():
            module.weight.copy_(1.0 + 0.2 * torch.randn(module.weight.shape, generator=gen))
            if getattr(module, "bias", None) is not None:
                module.bias.copy_(0.2 * torch.randn(module.bias.shape, generator=gen))
    return model


def _layer_norms(model: nn.Module) -> dict[str, nn.Module]:
    return {path: m for path, m in model.named_modules() if type(m).__name__.endswith("LayerNorm")}


def _kernelize(model, **kwargs):
    return kernels_neuron.kernelize(model, device="neuron", only=["neuron-layernorm"], **kwargs)


@pytest.fixture(params=list(ARCHS))
def arch(request):
    return request.param


def test_every_layer_norm_is_swapped(arch):
    model = _kernelize(_build(arch))
    report = model.kernels_neuron_report
    norms = _layer_norms(model)
    assert len(norms) == ARCHS[arch][3]
    assert report.fallbacks == [] and [row.path for row in report.swapped] == list(norms)
    layer = ARCHS[arch][4]
    assert {row.kernel for row in report.swapped} == {f"kernels-neuron/neuron-layernorm:{layer}"}
    for module in norms.values():
        forward = getattr(module.forward, "__func__", module.forward)
        assert forward.__qualname__ == f"{layer}.forward" and forward.__module__.startswith("_neuron_layernorm_")


def test_bf16_logits_are_within_torchs_own_bf16_error(arch):
    assert_bf16_like_torch(bf16_errors(_build(arch), input_ids(), _kernelize))


class LayerNorm(nn.Module):  # a model's own class of the same name, with other semantics
    def __init__(self, hidden):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(hidden)), nn.Parameter(torch.zeros(hidden)), 1e-5

    def forward(self, x):
        return x * self.weight + self.bias


def test_layer_norms_the_kernel_does_not_compute_keep_their_forward_and_say_why():
    model = nn.Sequential(
        LayerNorm(64),  # same name, not torch's
        nn.LayerNorm((4, 16)),  # normalises over two dims
        nn.LayerNorm(64, elementwise_affine=False),
        nn.LayerNorm(64, bias=False),
    )
    x = torch.randn(3, 64)
    reference = copy.deepcopy(model)
    report = _kernelize(model).kernels_neuron_report
    reasons = {row.path: row.reason for row in report.fallbacks}
    assert "is not torch.nn.LayerNorm" in reasons["0"] and "spans more than the last dim" in reasons["1"]
    assert [row.path for row in report.swapped] == ["2", "3"]
    assert torch.equal(model[0](x), reference[0](x))  # their own forwards, unchanged
    assert torch.equal(model[1](x.reshape(3, 4, 16)), reference[1](x.reshape(3, 4, 16)))
    for i in (2, 3):
        torch.testing.assert_close(model[i](x), reference[i](x), rtol=1e-5, atol=1e-5)
