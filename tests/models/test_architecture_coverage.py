"""Every kernel together on the architectures beyond the Llama family: ``kernelize(model, device="neuron")``
on tiny Cohere, Starcoder2, GPT-NeoX, Falcon, GPT-2, Phi, Mixtral, Qwen3-MoE and DeepSeek-V3 models swaps
every norm, MLP, experts and attention module (Falcon's attention through its own layer, the others
through transformers' attention interface),
and the model computes what it computed: fp32 logits, greedy generation and
training gradients match the un-kernelized model, bf16 logits stay within torch's own bf16 error. Both
head sizes the configs meet: 64, and the 16 of checkpoint-style tiny test models.

Per-kernel behaviour (fallbacks, limits) is tested beside each kernel; this file checks the whole."""

import copy

import pytest
import torch
import transformers
from tiny_models import assert_gradients_match, assert_logits_match, bf16_errors, build_moe, input_ids
from torch import nn

import kernels_neuron

# (model class, config class, config for a 2-layer model with 4 heads of `head_dim`, hidden 4 * head_dim)
ARCHS = {
    "cohere": ("CohereForCausalLM", "CohereConfig", {"num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2}),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", {"num_key_value_heads": 2, "eos_token_id": 2}),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {}),
    "falcon": ("FalconForCausalLM", "FalconConfig", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {"bos_token_id": 1, "eos_token_id": 2}),
    "phi": ("PhiForCausalLM", "PhiConfig", {"num_key_value_heads": 2}),
}


# MoE models (tests/models/tiny_models.py's configs): their experts, dense MLPs, norms and attention.
MOE_ARCHS = ("mixtral", "qwen3_moe", "deepseek_v3")


def _build(arch: str, head_dim: int = 64, seed: int = 0) -> nn.Module:
    if arch in MOE_ARCHS:  # DeepSeek-V3's attention sizes come from its own head dims (MLA)
        sizes = {} if arch == "deepseek_v3" else {"hidden_size": 4 * head_dim, "head_dim": head_dim}
        return build_moe(arch, seed, **sizes)
    model_class, config_class, extra = ARCHS[arch]
    hidden = 4 * head_dim
    sizes = {"n_embd": hidden, "n_head": 4, "n_layer": 2, "n_inner": 2 * hidden} if arch == "gpt2" else {}
    config = getattr(transformers, config_class)(
        hidden_size=hidden,
        num_attention_heads=4,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        vocab_size=128,
        **sizes,
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # random norm affines and biases, so a layer that dropped them would show
        for name, param in model.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    return model


def _candidates(model: nn.Module) -> dict[str, str]:
    """Every norm, MLP and attention module of the model, by path, with its kind."""
    kinds = {}
    for path, module in model.named_modules():
        name = type(module).__name__
        if name.endswith(("LayerNorm", "RMSNorm")):
            kinds[path] = "norm"
        elif name.endswith(("MLP", "Experts")):
            kinds[path] = "mlp"
        elif name.endswith("Attention"):
            kinds[path] = "attention"
    return kinds


@pytest.fixture(params=[*ARCHS, *MOE_ARCHS])
def arch(request):
    return request.param


# Both head sizes for every architecture but DeepSeek-V3, whose attention sizes are its MLA dims.
SIZED = [(arch, d) for arch in [*ARCHS, *MOE_ARCHS] for d in (64, 16) if not (arch == "deepseek_v3" and d != 64)]


@pytest.mark.parametrize("arch, head_dim", SIZED)
def test_every_candidate_is_swapped_and_logits_and_generation_match(arch, head_dim):
    model = _build(arch, head_dim)
    reference = copy.deepcopy(model)
    kernels_neuron.kernelize(model, device="neuron")
    report = model.kernels_neuron_report
    candidates = _candidates(model)
    assert {kind for kind in candidates.values()} == {"norm", "mlp", "attention"}
    swapped = {row.path for row in report.swapped}
    unserved = {row.path: row.reason for row in report.fallbacks + report.no_kernel}
    for path in candidates:
        assert path in swapped, (path, unserved.get(path), str(report))
    assert report.fallbacks == []
    assert_logits_match(model, reference, input_ids())
    if head_dim != 64:
        return  # generation walks the same kernels; once per architecture is enough
    ids = input_ids(batch=1, seq=8)
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=5, do_sample=False)
        want = reference.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want)


def test_training_gradients_match(arch):
    model = _build(arch).train()
    for module in model.modules():  # dropout would draw different masks in the two models
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    for attribute in ("residual_dropout", "attention_dropout", "hidden_dropout"):
        setattr(model.config, attribute, 0.0)
    reference = copy.deepcopy(model)
    kernels_neuron.kernelize(model, device="neuron", mode="training")
    assert len(model.kernels_neuron_report.swapped) >= 6  # 2 layers x (norm, MLP, attention) at least
    ids = input_ids()
    for m in (model, reference):
        m(ids, labels=ids).loss.backward()
    assert any(p.grad.abs().max() > 0 for p in model.parameters() if p.grad is not None)
    assert_gradients_match(model, reference)


@pytest.mark.parametrize("bf16_arch", ["starcoder2", "gpt_neox"])
def test_bf16_logits_are_within_twice_torchs_own_bf16_error(bf16_arch):
    """The fused MLP rounds fewer intermediates than the module (the up projection stays fp32 into the
    activation), so its logits sit up to a bf16 error from torch's rather than on them; the norms'
    rounding points are checked per kernel (tiny_models.assert_bf16_like_torch)."""
    errors = bf16_errors(_build(bf16_arch), input_ids(), lambda m: kernels_neuron.kernelize(m, device="neuron"))
    assert 0 < errors["kernel"] <= 2 * errors["torch"], errors
