"""kernelize(model, device="neuron") swaps the fused gated-MLP kernel into tiny Llama, Qwen2/3, Mistral,
Phi3 (fused gate_up), OLMo2, Granite and Gemma 1/2/3 (GeGLU) models: every MLP is swapped and reported,
logits (fp32, bf16), training loss and gradients match the un-kernelized model, and greedy generate gives
the same tokens. Modules with biases or an activation the kernel lacks keep their own forward with the
reason in the report; other SwiGLU MLP classes are found by their structure, look-alikes are not.
Plain MLPs (the whole models: tests/models/test_architecture_coverage.py): what falls back and why, PEFT,
and GPT-2's output dropout after the kernel. The NKI kernels run on the CPU simulator, and each test
checks that they did."""

import copy

import pytest
import torch
import transformers
from tiny_models import ARCHS, assert_gradients_match, assert_logits_match, build_tiny, forward_of, input_ids, logits
from torch import nn
from transformers.activations import ACT2FN

import kernels_neuron
from kernels_neuron import sim

MLP_REPO = "kernels-neuron/neuron-mlp"
MLP_PACKAGE = "_neuron_mlp_"  # the builder's module ids: _neuron_mlp_<backend>_<hash>
MLP_ARCHS = [arch for arch in ARCHS if arch != "mixtral"]  # Mixtral's feed-forward is a mixture of experts
FUSED = {"phi3"}  # gate_up_proj [2I, H]
LAYERS = 2


def _kernelize(model, **kwargs):
    # attention=False: the MLP's numerics (with the norms, which match in fp32) without the attention kernel's.
    return kernels_neuron.kernelize(model, device="neuron", attention=False, **kwargs)


def _layer(arch):
    return "GatedMLPFusedGateUp" if arch in FUSED else "GatedMLP"


def _mlp_rows(model):
    return [row for row in model.kernels_neuron_report if row.kernel.startswith(MLP_REPO)]


def _mlps(model):
    return {path: module for path, module in model.named_modules() if path.endswith(".mlp")}


def _launches(traces, name):
    return sum(t.kernel == name for t in traces)


@pytest.fixture(params=MLP_ARCHS)
def mlp_arch(request):
    return request.param


def test_every_mlp_is_swapped_for_the_right_layer_and_reported(mlp_arch):
    model = _kernelize(build_tiny(mlp_arch))
    rows = _mlp_rows(model)
    layer = _layer(mlp_arch)
    assert [r.path for r in rows] == [f"model.layers.{i}.mlp" for i in range(LAYERS)] == list(_mlps(model))
    assert {(r.layer, r.kernel, r.status) for r in rows} == {(layer, f"{MLP_REPO}:{layer}", "swapped")}
    for module in _mlps(model).values():
        function = forward_of(module)
        assert function is not type(module).forward and function.__qualname__ == f"{layer}.forward"
        assert function.__module__.startswith(MLP_PACKAGE), function.__module__
    text = str(model.kernels_neuron_report)
    assert "model.layers.1.mlp" in text and f"{MLP_REPO}:{layer}" in text


def test_fp32_logits_match_the_original_model(mlp_arch):
    model = build_tiny(mlp_arch)
    reference = copy.deepcopy(model)
    _kernelize(model)
    with sim.capture() as traces:
        assert_logits_match(model, reference, input_ids())
    assert _launches(traces, "mlp_fwd") == LAYERS


def test_bf16_logits_stay_within_twice_torchs_own_bf16_error(mlp_arch):
    exact = build_tiny(mlp_arch)
    eager = copy.deepcopy(exact).to(torch.bfloat16)
    kernelized = _kernelize(copy.deepcopy(exact).to(torch.bfloat16))
    ids = input_ids()
    with sim.capture() as traces:
        got = logits(kernelized, ids)
    assert _launches(traces, "mlp_fwd") == LAYERS
    want = logits(exact, ids)
    torch_error, kernel_error = (logits(eager, ids) - want).abs().max(), (got - want).abs().max()
    assert 0 < torch_error and kernel_error <= 2 * torch_error, (kernel_error, torch_error)


def test_training_loss_and_every_gradient_match(mlp_arch):
    model = build_tiny(mlp_arch).train()
    reference = copy.deepcopy(model)
    _kernelize(model)
    assert model.kernels_neuron_report.mode == "training"
    assert {r.status for r in _mlp_rows(model)} == {"swapped"}
    ids = input_ids()
    with sim.capture() as traces:
        loss = model(ids, labels=ids).loss
        loss.backward()
    assert _launches(traces, "mlp_fwd") == LAYERS and _launches(traces, "mlp_bwd") == LAYERS
    expected = reference(ids, labels=ids).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert_gradients_match(model, reference)


def test_greedy_generate_gives_the_same_tokens(mlp_arch):
    model = build_tiny(mlp_arch)
    reference = copy.deepcopy(model)
    _kernelize(model)
    prompt = input_ids(batch=2, seq=8)
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
        with sim.capture() as traces:
            got = model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(got, expected)
    assert _launches(traces, "mlp_fwd") == LAYERS * 6  # the prompt, then 5 decode steps of 2 tokens each


# --- fallbacks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "granite"])
def test_an_mlp_with_biases_keeps_its_own_forward_and_the_report_says_why(arch):
    model = build_tiny(arch, mlp_bias=True)
    reference = copy.deepcopy(model)
    _kernelize(model)
    rows = _mlp_rows(model)
    assert [r.status for r in rows] == ["fallback"] * LAYERS
    for row in rows:
        assert "gate_proj has a bias" in row.reason and "down_proj has a bias" in row.reason, row.reason
    for module in _mlps(model).values():
        assert forward_of(module) is type(module).forward
    with sim.capture() as traces:
        assert_logits_match(model, reference, input_ids())
    assert _launches(traces, "mlp_fwd") == 0


@pytest.mark.parametrize(
    "arch, overrides, named",
    [
        ("llama", {"hidden_act": "gelu"}, "GELUActivation (exact erf GELU)"),
        ("gemma", {"hidden_act": "relu"}, "ReLU"),
        ("phi3", {"hidden_act": "gelu"}, "GELUActivation (exact erf GELU)"),
    ],
)
def test_an_activation_the_kernel_lacks_keeps_the_modules_forward(arch, overrides, named):
    model = build_tiny(arch, **overrides)
    reference = copy.deepcopy(model)
    _kernelize(model)
    rows = _mlp_rows(model)
    assert [r.status for r in rows] == ["fallback"] * LAYERS
    assert all(f"activation {named} is not one the kernel implements" in r.reason for r in rows), rows
    with sim.capture() as traces:
        assert_logits_match(model, reference, input_ids())
    assert _launches(traces, "mlp_fwd") == 0


def test_a_hidden_size_above_the_kernels_limit_keeps_the_modules_forward():
    mlp = transformers.models.llama.modeling_llama.LlamaMLP(
        transformers.LlamaConfig(hidden_size=4104, intermediate_size=8, num_attention_heads=4, mlp_bias=False)
    )
    _kernelize(mlp)
    (row,) = _mlp_rows(mlp)
    assert row.status == "fallback" and "hidden size 4104 is above the kernel's 4096 for float32" in row.reason
    assert forward_of(mlp) is type(mlp).forward
    _kernelize(mlp.to(torch.bfloat16))  # 2-byte weights: up to 8192
    assert _mlp_rows(mlp)[0].status == "swapped"


# --- structure: other SwiGLU MLPs are found, look-alikes are not ----------------------------------------


def test_other_swiglu_mlp_classes_are_found_by_their_structure():
    config = transformers.CohereConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        num_hidden_layers=2,
        vocab_size=128,
    )
    torch.manual_seed(0)
    model = transformers.CohereForCausalLM(config).eval()  # CohereMLP is not in the registry
    reference = copy.deepcopy(model)
    _kernelize(model)
    rows = _mlp_rows(model)
    assert [(r.path, r.layer, r.status) for r in rows] == [
        (f"model.layers.{i}.mlp", "GatedMLP", "swapped") for i in range(LAYERS)
    ]
    with sim.capture() as traces:
        assert_logits_match(model, reference, input_ids())
    assert _launches(traces, "mlp_fwd") == LAYERS


class SwiGLUMLP(nn.Module):
    """A user's own gated MLP: found by its structure (variable names differ from Llama's)."""

    def __init__(self, hidden=64, inter=96, act="silu", bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_fn = ACT2FN[act]

    def forward(self, hidden_states):
        """Docstrings are fine."""
        activated = self.act_fn(self.gate_proj(hidden_states))
        product = self.up_proj(hidden_states) * activated
        return self.down_proj(product)


class ScaledMLP(SwiGLUMLP):
    """Looks the same, but scales its output (as FalconH1MLP's multipliers do): must not be swapped."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * 0.5


class ClampedMLP(SwiGLUMLP):
    """Clamps the gate first (as DeepseekV4MLP does): must not be swapped."""

    def forward(self, x):
        gate = self.gate_proj(x).clamp(max=7.0)
        return self.down_proj(self.act_fn(gate) * self.up_proj(x))


class FusedMLP(nn.Module):
    def __init__(self, hidden=64, inter=96):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.activation_fn = ACT2FN["gelu_pytorch_tanh"]

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.plain, self.scaled, self.clamped, self.fused = SwiGLUMLP(), ScaledMLP(), ClampedMLP(), FusedMLP()
        self.biased, self.relu = SwiGLUMLP(bias=True), SwiGLUMLP(act="relu")

    def forward(self, x):
        return sum(m(x) for m in (self.plain, self.scaled, self.clamped, self.fused, self.biased, self.relu))


def test_structure_decides_which_unlisted_mlps_are_swapped():
    torch.manual_seed(0)
    block = Block().eval()
    reference = copy.deepcopy(block)
    _kernelize(block)
    report = {r.path: r for r in block.kernels_neuron_report if r.status != "no kernel"}
    assert set(report) == {"plain", "fused", "biased", "relu"}  # look-alikes are not even candidates ...
    unserved = {r.path: r.reason for r in block.kernels_neuron_report.no_kernel}
    assert set(unserved) == {"scaled", "clamped"}  # ... but the report names them
    assert all("neither a gated MLP" in reason for reason in unserved.values())
    assert (report["plain"].layer, report["plain"].status) == ("GatedMLP", "swapped")
    assert (report["fused"].layer, report["fused"].status) == ("GatedMLPFusedGateUp", "swapped")
    assert report["biased"].status == "fallback" and "has a bias" in report["biased"].reason
    assert report["relu"].status == "fallback" and "activation ReLU" in report["relu"].reason
    for name in ("scaled", "clamped", "biased", "relu"):
        module = getattr(block, name)
        assert forward_of(module) is type(module).forward, name
    x = torch.randn(2, 5, 64)
    with torch.no_grad(), sim.capture() as traces:
        torch.testing.assert_close(block(x), reference(x), rtol=1e-5, atol=1e-5)
    assert _launches(traces, "mlp_fwd") == 2


def test_a_listed_class_whose_forward_changed_keeps_it():
    """The registry names LlamaMLP, but a class of that name computing something else is not swapped."""

    class LlamaMLP(transformers.models.llama.modeling_llama.LlamaMLP):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)).clamp(-1, 1)

    mlp = LlamaMLP(transformers.LlamaConfig(hidden_size=64, intermediate_size=96))
    _kernelize(mlp)
    (row,) = _mlp_rows(mlp)
    assert row.status == "fallback" and "LlamaMLP.forward is not the gated MLP the kernel computes" in row.reason
    assert forward_of(mlp) is LlamaMLP.forward


def test_mlp_false_leaves_every_mlp_alone_even_after_an_earlier_swap():
    model = build_tiny("llama")
    reference = copy.deepcopy(model)
    _kernelize(model)
    assert {r.status for r in _mlp_rows(model)} == {"swapped"}
    _kernelize(model, mlp=False)
    assert _mlp_rows(model) == []
    assert len(model.kernels_neuron_report.swapped) == 5  # the norms
    for module in _mlps(model).values():
        assert forward_of(module) is type(module).forward
    with sim.capture() as traces:
        assert_logits_match(model, reference, input_ids())
    assert _launches(traces, "mlp_fwd") == 0
    _kernelize(model)  # and back
    assert {r.status for r in _mlp_rows(model)} == {"swapped"}


def test_compiled_kernelized_model_has_no_graph_breaks_and_matches():
    model = build_tiny("gemma2")
    reference = copy.deepcopy(model)
    _kernelize(model, mode="inference+torch.compile")
    assert {r.status for r in _mlp_rows(model)} == {"swapped"}
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = input_ids()
    with sim.capture() as traces:
        out = logits(compiled, ids)
    assert _launches(traces, "mlp_fwd") == LAYERS
    torch.testing.assert_close(out, logits(reference, ids), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


# --- negative controls: the checks above would catch a broken kernel -------------------------------------


def _mlp_globals(model):
    return forward_of(next(iter(_mlps(model).values()))).__globals__


def test_the_wrong_activation_fails_the_logits_check(monkeypatch):
    model = build_tiny("gemma")
    reference = copy.deepcopy(model)
    _kernelize(model)
    assert_logits_match(model, reference, input_ids())
    namespace = _mlp_globals(model)
    real = namespace["gated_mlp"]
    monkeypatch.setitem(
        namespace, "gated_mlp", lambda x, wg, wu, wd, activation, updates=None: real(x, wg, wu, wd, "silu", updates)
    )
    with pytest.raises(AssertionError, match="not close"):
        assert_logits_match(model, reference, input_ids())


def test_a_wrong_weight_gradient_fails_the_gradient_check(monkeypatch):
    model = build_tiny("qwen3").train()
    reference = copy.deepcopy(model)
    _kernelize(model)
    import sys

    ops_module = sys.modules[_mlp_globals(model)["gated_mlp"].__module__]  # the hub package's mlp.py
    real_bwd = ops_module._kernels.mlp_bwd

    def skewed_bwd(*args):
        dx, dw_gate, dw_up, dw_down = real_bwd(*args)
        return dx, dw_gate, dw_up * 1.001, dw_down

    monkeypatch.setattr(ops_module._kernels, "mlp_bwd", skewed_bwd)
    ids = input_ids()
    model(ids, labels=ids).loss.backward()
    reference(ids, labels=ids).loss.backward()
    with pytest.raises(AssertionError, match="up_proj.weight"):
        assert_gradients_match(model, reference)


def test_mixed_dtypes_or_a_non_contiguous_weight_keep_the_modules_forward():
    mlp = SwiGLUMLP()
    mlp.up_proj.to(torch.bfloat16)
    _kernelize(mlp)
    (row,) = _mlp_rows(mlp)
    assert row.status == "fallback" and "projections have mixed dtypes ['bfloat16', 'float32']" in row.reason
    mlp = SwiGLUMLP()
    mlp.down_proj.weight = nn.Parameter(torch.randn(96, 64).t())  # [64, 96] as a transposed view
    _kernelize(mlp)
    (row,) = _mlp_rows(mlp)
    assert row.status == "fallback" and "down_proj.weight is not contiguous" in row.reason
    x = torch.randn(3, 64)
    torch.testing.assert_close(mlp(x), type(mlp).forward(mlp, x))


# --- plain MLPs: down(act(up(x))) --------------------------------------------------------------------


def _gpt_neox_mlp(**overrides):
    config = transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, **overrides)
    torch.manual_seed(0)
    return transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXMLP(config)


def test_a_plain_mlp_the_kernel_cannot_take_keeps_its_forward_and_says_why():
    quick = _gpt_neox_mlp(hidden_act="quick_gelu")
    one_bias = _gpt_neox_mlp()
    one_bias.dense_4h_to_h.bias = None
    model = nn.ModuleDict({"quick": quick, "one_bias": one_bias, "served": _gpt_neox_mlp()})
    reference = copy.deepcopy(model)
    _kernelize(model)
    reasons = {row.path: row.reason for row in model.kernels_neuron_report.fallbacks}
    assert "activation QuickGELUActivation is not one the kernel implements" in reasons["quick"]
    assert "one projection has a bias and the other not" in reasons["one_bias"]
    assert [row.path for row in model.kernels_neuron_report.swapped] == ["served"]
    x = torch.randn(3, 5, 64)
    with sim.capture() as traces:
        for name in model:
            torch.testing.assert_close(model[name](x), reference[name](x), rtol=1e-5, atol=1e-5)
    assert _launches(traces, "plain_mlp_fwd") == 1


def test_a_plain_mlp_under_peft_lora_falls_back_with_the_reason():
    from peft import LoraConfig, get_peft_model  # the test extra installs PEFT

    model = get_peft_model(nn.ModuleDict({"mlp": _gpt_neox_mlp()}), LoraConfig(r=4, target_modules=["dense_h_to_4h"]))
    _kernelize(model)
    (row,) = [row for row in model.kernels_neuron_report if row.layer == "PlainMLP"]
    assert (
        row.status == "fallback" and "is a PEFT layer (Linear): the plain MLP kernel merges no adapters" in row.reason
    )


def test_gpt2s_dropout_runs_after_the_kernel_as_the_module_runs_it():
    """GPT-2's Conv1D projections and its output dropout in training: with the same RNG state the
    kernelized MLP drops the same elements as the original."""
    config = transformers.GPT2Config(n_embd=64, n_head=4, n_inner=160, resid_pdrop=0.5)
    torch.manual_seed(0)
    mlp = transformers.models.gpt2.modeling_gpt2.GPT2MLP(160, config).train()
    with torch.no_grad():
        mlp.c_fc.bias.normal_(0, 0.2)
    reference = copy.deepcopy(mlp)
    _kernelize(mlp, mode="training")
    assert [row.status for row in mlp.kernels_neuron_report] == ["swapped"]
    x = torch.randn(2, 7, 64)
    torch.manual_seed(3)
    got = mlp(x)
    torch.manual_seed(3)
    want = reference(x)
    assert (want == 0).float().mean() > 0.3  # the dropout did drop
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_compiled_model_with_plain_mlps_runs_the_kernel_without_graph_breaks():
    """GPT-NeoX under torch.compile(fullgraph=True): the plain layer's per-call checks trace (its
    class's form is read from source once, by kernelize, not on every call)."""
    config = transformers.GPTNeoXConfig(
        hidden_size=64, intermediate_size=160, num_attention_heads=4, num_hidden_layers=LAYERS, vocab_size=128
    )
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(config).eval()
    reference = copy.deepcopy(model)
    _kernelize(model, mode="inference+torch.compile")
    assert {r.status for r in _mlp_rows(model)} == {"swapped"}
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = input_ids()
    with sim.capture() as traces:
        out = logits(compiled, ids)
    assert _launches(traces, "plain_mlp_fwd") == LAYERS
    torch.testing.assert_close(out, logits(reference, ids), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["gated", "plain"])
def test_a_hook_on_the_activation_module_keeps_the_modules_forward_so_it_fires(kind):
    """Interpretability tools hook ``mlp.act``: the fused kernel would skip the hook."""
    mlp = (
        _gpt_neox_mlp()
        if kind == "plain"
        else transformers.models.llama.modeling_llama.LlamaMLP(
            transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4)
        )
    )
    attribute = "act" if kind == "plain" else "act_fn"
    seen = []
    getattr(mlp, attribute).register_forward_hook(lambda module, args, out: seen.append(out.shape))
    _kernelize(mlp)
    (row,) = mlp.kernels_neuron_report.rows
    assert row.status == "fallback" and f".{attribute} has hooks" in row.reason, row.reason
    mlp(torch.randn(2, 3, 64))
    assert seen == [torch.Size([2, 3, 160])]


def test_falcons_uncast_bias_under_autocast_falls_back_so_the_dtype_stays_the_modules():
    """FalconLinear adds its fp32 bias after the bf16 matmul: the module's output is fp32 under
    autocast; the layer runs the module's forward for such a call instead of returning bf16."""
    config = transformers.FalconConfig(hidden_size=64, num_attention_heads=4, bias=True)
    torch.manual_seed(0)
    mlp = transformers.models.falcon.modeling_falcon.FalconMLP(config)
    reference = copy.deepcopy(mlp)
    _kernelize(mlp)
    assert [row.status for row in mlp.kernels_neuron_report] == ["swapped"]
    x = torch.randn(2, 3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(UserWarning, match="adds its bias uncast"):
        got = mlp(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = reference(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want)
    with sim.capture() as traces:  # without autocast the kernel serves it
        torch.testing.assert_close(mlp(x), reference(x), rtol=1e-5, atol=1e-5)
    assert _launches(traces, "plain_mlp_fwd") == 1
