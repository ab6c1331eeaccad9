"""Tiny transformers models built from their configs (nothing is downloaded), and the checks the
model-level kernelize tests share."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import transformers
from torch import nn

# hidden 256, 4 heads of 64 (2 KV heads), 2 layers: the kernels' usual sizes; tests of tiny sizes override.
BASE = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
    num_hidden_layers=2,
    vocab_size=128,
)
KERNEL_REPO = "kernels-neuron/neuron-rmsnorm"
KERNEL_PACKAGE = "_neuron_rmsnorm_"  # the builder's module ids: _neuron_rmsnorm_<backend>_<hash>


@dataclass(frozen=True)
class Arch:
    model: str  # transformers model class
    config: str  # its config class
    layer: str  # the registry layer every norm of the model must get
    norms: int  # norm modules in the 2-layer model (from /tmp/normscan/REPORT.md)
    extra: dict = field(default_factory=dict)  # per-arch config adjustments
    head_dim: bool = True  # whether the config takes head_dim


ARCHS = {
    "llama": Arch("LlamaForCausalLM", "LlamaConfig", "RMSNorm", 5),
    "qwen2": Arch("Qwen2ForCausalLM", "Qwen2Config", "RMSNorm", 5, head_dim=False),
    "qwen3": Arch("Qwen3ForCausalLM", "Qwen3Config", "RMSNorm", 9),  # + q_norm/k_norm over head_dim 64
    "mistral": Arch("MistralForCausalLM", "MistralConfig", "RMSNorm", 5),
    "mixtral": Arch(
        "MixtralForCausalLM", "MixtralConfig", "RMSNorm", 5, {"num_local_experts": 4, "num_experts_per_tok": 2}
    ),
    # default bos/eos/pad ids lie outside the 128-token vocab
    "phi3": Arch(
        "Phi3ForCausalLM",
        "Phi3Config",
        "RMSNorm",
        5,
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        head_dim=False,
    ),
    "olmo2": Arch(
        "Olmo2ForCausalLM",
        "Olmo2Config",
        "RMSNormFP32Multiply",
        9,
        {"eos_token_id": 2, "pad_token_id": 1},
        head_dim=False,
    ),
    "granite": Arch("GraniteForCausalLM", "GraniteConfig", "RMSNorm", 5, head_dim=False),
    "gemma": Arch("GemmaForCausalLM", "GemmaConfig", "GemmaRMSNorm", 5),
    "gemma2": Arch("Gemma2ForCausalLM", "Gemma2Config", "GemmaRMSNorm", 9),
    "gemma3": Arch("Gemma3ForCausalLM", "Gemma3TextConfig", "GemmaRMSNorm", 13),  # + q_norm/k_norm
}


def build_tiny(arch: str, seed: int = 0, **overrides) -> nn.Module:
    """A freshly initialised tiny model (eval mode, fp32) whose norm weights are random, so a layer
    with the wrong weight convention changes the output."""
    spec = ARCHS[arch]
    kwargs = {**BASE, **spec.extra, **overrides}
    if not spec.head_dim:
        kwargs.pop("head_dim")
    torch.manual_seed(seed)
    config = getattr(transformers, spec.config)(**kwargs)
    model = getattr(transformers, spec.model)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in norm_modules(model).values():
            centre = 0.0 if spec.layer == "GemmaRMSNorm" else 1.0  # Gemma scales by (1 + weight)
            module.weight.copy_(centre + 0.2 * torch.randn(module.weight.shape, generator=gen))
    return model


def norm_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every norm module, found by walking the model: classes whose name contains "RMSNorm"."""
    return {path: module for path, module in model.named_modules() if "RMSNorm" in type(module).__name__}


def input_ids(batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def forward_of(module: nn.Module):
    return getattr(module.forward, "__func__", module.forward)


def assert_runs_kernel_layer(module: nn.Module, layer: str) -> None:
    function = forward_of(module)
    assert function is not type(module).forward, f"{type(module).__name__} kept its own forward"
    assert function.__qualname__ == f"{layer}.forward", function.__qualname__
    assert function.__module__.startswith(KERNEL_PACKAGE), function.__module__


def assert_logits_match(kernelized: nn.Module, reference: nn.Module, ids: torch.Tensor) -> None:
    """fp32: the kernelized model's logits equal the original's to fp32 rounding."""
    torch.testing.assert_close(logits(kernelized, ids), logits(reference, ids), rtol=1e-5, atol=1e-5)


def bf16_errors(fp32_model: nn.Module, ids: torch.Tensor, kernelize) -> dict[str, float]:
    """Max |logit error| against the fp32 model of the model cast to bf16, eager and kernelized,
    and the distance between those two."""
    eager = copy.deepcopy(fp32_model).to(torch.bfloat16)
    kernelized = kernelize(copy.deepcopy(fp32_model).to(torch.bfloat16))
    exact, eager_out, kernel_out = logits(fp32_model, ids), logits(eager, ids), logits(kernelized, ids)
    return {
        "torch": float((eager_out - exact).abs().max()),
        "kernel": float((kernel_out - exact).abs().max()),
        "kernel_vs_torch": float((kernel_out - eager_out).abs().max()),
    }


def assert_bf16_like_torch(errors: dict[str, float]) -> None:
    """The kernel's bf16 error stays within torch's own (1.5x: one extra rounding somewhere), and it
    rounds where the transformers module rounds: its distance from torch's bf16 model is well below
    torch's own bf16 error (a layer that rounds at a different point, e.g. llama vs fp32_multiply,
    lands about a full bf16 error away)."""
    assert errors["torch"] > 0, "the bf16 model equals the fp32 one: the comparison would prove nothing"
    assert errors["kernel"] <= 1.5 * errors["torch"], f"bf16 error beyond torch's own: {errors}"
    assert errors["kernel_vs_torch"] <= 0.5 * errors["torch"], f"rounds elsewhere than the module: {errors}"


def assert_gradients_match(kernelized: nn.Module, reference: nn.Module) -> None:
    pairs = list(zip(kernelized.named_parameters(), reference.named_parameters()))
    assert pairs
    for (name, p), (ref_name, q) in pairs:
        assert name == ref_name
        assert p.grad is not None and q.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


# Tiny MoE configs (nothing downloaded): 4 experts of intermediate 192 (off a multiple of 128), top-2.
MOE_CONFIGS = {
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 192, "norm_topk_prob": True},
    ),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 192,
            "n_shared_experts": 1,
            "first_k_dense_replace": 0,
            "n_group": 1,
            "topk_group": 1,
            "q_lora_rank": 64,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 32,
            "qk_nope_head_dim": 32,
            "v_head_dim": 64,
        },
    ),
    "olmoe": (
        "OlmoeForCausalLM",
        "OlmoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 192},
    ),
}


def build_moe(arch: str, seed: int = 0, **overrides) -> nn.Module:
    """A tiny model of ``arch`` in eval mode, fp32, with random (not zero) router biases where it has them."""
    if arch == "mixtral":
        return build_tiny("mixtral", seed, **{"intermediate_size": 192, **overrides})
    model_cls, config_cls, extra = MOE_CONFIGS[arch]
    torch.manual_seed(seed)
    kwargs = {**BASE, **extra, **overrides}
    if arch == "deepseek_v3":
        kwargs.pop("head_dim")
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0, 0.1)
            weight = getattr(module, "weight", None)
            if type(module).__name__.endswith("TopkRouter") and weight is not None:
                weight.normal_(0, 0.5)  # DeepSeek's router starts at zero: every token would tie
    return model


def fresh_process_check(results: dict, check: str) -> dict:
    """One check's result from conftest.py's ``fresh_process`` fixture; fails with the traceback of a
    check that raised."""
    result = results[check]
    assert "error" not in result, f"{check}: {result['error']}"
    return result
