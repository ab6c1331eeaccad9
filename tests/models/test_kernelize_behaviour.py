"""kernelize's contract beyond numerics: modes, argument errors, constraints (fallbacks and the report),
torch.compile, transformers' own ``use_kernels=True`` route, and logging hygiene."""

import copy
import logging
import re
import types

import kernels
import pytest
import torch
import transformers
from kernels import Mode
from tiny_models import (
    KERNEL_PACKAGE,
    assert_bf16_like_torch,
    assert_logits_match,
    assert_runs_kernel_layer,
    build_tiny,
    forward_of,
    fresh_process_check,
    input_ids,
    logits,
    norm_modules,
)
from torch import nn

import kernels_neuron
from kernels_neuron import sim


def _kernelize(model, **kwargs):
    # attention=False, mlp=False: these tests check the norm layers' contract in isolation; attention has
    # tests/models/test_kernelize_attention.py, the MLP tests/models/test_kernelize_mlp.py.
    return kernels_neuron.kernelize(model, device="neuron", attention=False, mlp=False, **kwargs)


# --- modes --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("training, expected", [(False, "inference"), (True, "training")])
def test_mode_none_follows_model_training(training, expected):
    model = _kernelize(build_tiny("llama").train(training))
    assert model.kernels_neuron_report.mode == expected
    assert len(model.kernels_neuron_report.swapped) == 5


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("inference", "inference"),
        ("training", "training"),
        ("inference+torch.compile", "inference+torch.compile"),
        ("training+torch.compile", "training+torch.compile"),
        (" Training | torch.compile ", "training+torch.compile"),
        (Mode.INFERENCE, "inference"),
        (Mode.TRAINING, "training"),
        (Mode.INFERENCE | Mode.TORCH_COMPILE, "inference+torch.compile"),
    ],
    ids=str,
)
def test_explicit_modes(mode, expected):
    model = _kernelize(build_tiny("llama"), mode=mode)  # an eval model: the explicit mode wins
    report = model.kernels_neuron_report
    assert report.mode == expected
    assert len(report.swapped) == 5 and report.fallbacks == []


@pytest.mark.parametrize("mode, named", [("bogus", "'bogus'"), ("inference+infrence", "'infrence'"), ("", "''")])
def test_an_unknown_mode_string_is_a_value_error_naming_it(mode, named):
    with pytest.raises(ValueError, match=f"unknown mode {named}"):
        _kernelize(build_tiny("llama"), mode=mode)


@pytest.mark.parametrize("mode", ["torch.compile", "inference+training", "training+inference+torch.compile"])
def test_a_mode_string_must_name_one_of_inference_and_training(mode):
    expected = f"mode {mode!r} must name exactly one of 'inference' and 'training'"
    with pytest.raises(ValueError, match=re.escape(expected)):
        _kernelize(build_tiny("llama"), mode=mode)


def test_a_mode_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="mode must be"):
        _kernelize(build_tiny("llama"), mode=1)


@pytest.mark.parametrize("not_a_model", ["llama", None, torch.zeros(3)], ids=["str", "None", "tensor"])
def test_a_non_module_is_a_type_error(not_a_model):
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        kernels_neuron.kernelize(not_a_model, device="neuron")


# --- constraints and the report -----------------------------------------------------------------------


def test_tiny_hidden_sizes_are_served():
    """Checkpoint-style tiny models (hidden 32, head_dim 16): every norm swaps and the logits match."""
    model = build_tiny(
        "qwen3", hidden_size=32, head_dim=16, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
    )
    reference = copy.deepcopy(model)
    _kernelize(model)
    report = model.kernels_neuron_report
    assert report.fallbacks == [] and [row.path for row in report.swapped] == list(norm_modules(model))
    assert_logits_match(model, reference, input_ids())


def test_a_module_outside_the_kernels_limits_keeps_its_own_forward():
    model = build_tiny("llama").double()
    reference = copy.deepcopy(model)
    _kernelize(model)
    report = model.kernels_neuron_report
    assert report.swapped == []
    assert [row.path for row in report.fallbacks] == list(norm_modules(model)) and len(report) == 5
    for row in report:
        assert row.status == "fallback" and row.layer == "RMSNorm"
        assert "weight has dtype torch.float64" in row.reason, row.reason
    for module in norm_modules(model).values():
        assert module.forward.__func__ is type(module).forward  # the module's own forward
    ids = input_ids()
    assert torch.equal(logits(model, ids), logits(reference, ids))


def _qk_norms_already_replaced(model):
    """Qwen3 whose q_norm/k_norm forwards something else already replaced (as an accelerate hook or a
    tensor-parallel plan does): kernelize must leave those modules alone."""
    for path, module in norm_modules(model).items():
        if path.endswith(("q_norm", "k_norm")):
            module.forward = types.MethodType(type(module).forward, module)
    return model


def test_constraints_are_checked_per_module():
    """Qwen3 whose q_norm/k_norm forwards were already replaced: those keep it, the other norms swap."""
    model = _qk_norms_already_replaced(build_tiny("qwen3"))
    reference = copy.deepcopy(model)
    _kernelize(model)
    report = model.kernels_neuron_report
    fallback_paths = {row.path for row in report.fallbacks}
    assert fallback_paths == {p for p in norm_modules(model) if p.endswith(("q_norm", "k_norm"))}
    assert len(fallback_paths) == 4 and len(report.swapped) == 5
    assert all("forward was replaced" in row.reason for row in report.fallbacks)
    for row in report.swapped:
        assert_runs_kernel_layer(model.get_submodule(row.path), "RMSNorm")
    assert_logits_match(model, reference, input_ids())


def test_the_report_prints_as_a_table():
    model = _kernelize(_qk_norms_already_replaced(build_tiny("qwen3")))
    text = str(model.kernels_neuron_report)
    assert "kernelize report (device=neuron, mode=inference): 5 swapped, 4 kept their own forward" in text
    for row in model.kernels_neuron_report:
        assert row.path in text
    assert text.count("swapped") == 1 + 5 and text.count("fallback") == 4  # title + one per row
    assert "┃ module" in text  # a rich table with its header


# --- torch.compile ------------------------------------------------------------------------------------


def test_compiled_kernelized_model_has_no_graph_breaks_and_matches_eager():
    model = build_tiny("llama")
    reference = copy.deepcopy(model)
    _kernelize(model, mode="inference+torch.compile")
    assert model.kernels_neuron_report.mode == "inference+torch.compile"
    assert len(model.kernels_neuron_report.swapped) == 5
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    ids = input_ids()
    with sim.capture() as traces:
        out = logits(compiled, ids)
    assert len(traces) == 5  # the NKI kernel ran inside the compiled graph, once per norm
    torch.testing.assert_close(out, logits(model, ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, logits(reference, ids), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


# --- transformers' own route --------------------------------------------------------------------------


def test_use_kernels_true_picks_up_the_registered_mapping(tmp_path):
    original = build_tiny("llama")
    original.save_pretrained(tmp_path)
    kernels_neuron.register_mapping()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=True)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    norms = norm_modules(model)
    assert len(norms) == 5
    for module in norms.values():
        assert module.forward.__func__.__qualname__ == "RMSNorm.forward"
        assert module.forward.__func__.__module__.startswith(KERNEL_PACKAGE)  # from our kernel package
    assert_logits_match(model, plain, input_ids())


@pytest.mark.slow
def test_use_kernels_true_maps_each_class_like_kernelize(fresh_process):
    """In a fresh process (hooks and mappings are process-wide): through ``use_kernels=True``, OLMo2
    (tagged "RMSNorm" by transformers, but fp32-multiply numerics) gets RMSNormFP32Multiply, Gemma
    (not tagged) gets GemmaRMSNorm, and a checkpoint-style tiny Llama (hidden 32) gets RMSNorm; bf16
    logits round like the plain model's (conftest.py's fresh process, fresh_process.use_kernels)."""
    result = fresh_process_check(fresh_process, "use_kernels")
    assert result["imported_before"] == []
    for name, layer in [("olmo2", "RMSNormFP32Multiply"), ("gemma", "GemmaRMSNorm")]:
        [(forward, package)] = result[name]["forwards"]
        assert forward == f"{layer}.forward" and package.startswith(KERNEL_PACKAGE + "cpu_"), result[name]
        assert_bf16_like_torch(result[name]["errors"])
    [(forward, package)] = result["llama32"]["forwards"]
    assert forward == "RMSNorm.forward" and package.startswith(KERNEL_PACKAGE + "cpu_"), result["llama32"]
    assert_bf16_like_torch(result["llama32"]["errors"])


# --- side effects -------------------------------------------------------------------------------------


def test_kernelize_leaves_no_handler_on_the_root_logger():
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    root.handlers[:] = []  # pytest's own capture handlers would hide a basicConfig() call
    try:
        _kernelize(build_tiny("llama"))
        assert root.handlers == [] and root.level == saved_level
        # The control: the kernels library itself, called directly, does install one.
        kernels.kernelize(build_tiny("llama"), mode=Mode.INFERENCE, device="neuron", use_fallback=True)
        assert root.handlers != []
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)


# --- arguments and models kernelize has nothing for ---------------------------------------------------------


@pytest.mark.parametrize("device", ["nueron", "cuda", "Neuron", 3])
def test_an_unknown_device_is_a_clear_error(device):
    with pytest.raises(ValueError, match=rf"device {device!r} is not one kernels-neuron serves; use 'neuron'"):
        kernels_neuron.kernelize(build_tiny("llama"), device=device)


def test_modules_of_kinds_the_hub_has_no_kernel_for_are_reported():
    """Bloom: its LayerNorms are swapped; an MLP of another form (it adds the residual itself) and an
    attention module kernelize cannot route (its model calls no attention function) have no kernel, and
    the report lists each with why."""
    config = transformers.BloomConfig(hidden_size=128, n_layer=1, n_head=2, vocab_size=64)
    model = kernels_neuron.kernelize(transformers.BloomForCausalLM(config).eval(), device="neuron")
    report = model.kernels_neuron_report
    assert {row.layer for row in report.swapped} == {"LayerNorm"} and report.fallbacks == []
    kinds = {row.path: (row.layer, row.reason) for row in report.no_kernel}
    assert kinds == {
        "transformer.h.0.mlp": (
            "MLP",
            "BloomMLP: neither a gated MLP down(act(gate(x)) * up(x)) nor a plain one down(act(up(x))), the MLPs "
            "the hub has kernels for",
        ),
        "transformer.h.0.self_attention": (
            "attention",
            "BloomAttention: not routed: its model does not call transformers' AttentionInterface for it, and no "
            "layer of the hub replaces its forward (the hub has one for FalconAttention only)",
        ),
    }
    assert "4 swapped, 0 kept their own forward, 2 with no kernel" in str(report)


def test_a_layer_norm_class_the_hub_has_no_kernel_for_is_reported():
    class T5StyleLayerNorm(nn.Module):  # a model's own LayerNorm class, not torch's
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(64))

        def forward(self, x):
            return x * self.weight

    report = kernels_neuron.kernelize(nn.Sequential(T5StyleLayerNorm()), device="neuron").kernels_neuron_report
    (row,) = report.no_kernel
    assert row.layer == "LayerNorm" and "serves torch.nn.LayerNorm and CohereLayerNorm only" in row.reason


def test_moe_experts_of_another_form_are_reported_as_having_no_kernel():
    class RoutedExperts(nn.Module):  # an experts module whose forward is not MixtralExperts'
        def forward(self, x):
            return x

    report = kernels_neuron.kernelize(nn.Sequential(RoutedExperts()), device="neuron").kernels_neuron_report
    (row,) = report.no_kernel
    assert (row.layer, row.status) == ("MoE experts", "no kernel")
    assert "RoutedExperts: not MixtralExperts' forward" in row.reason


@pytest.mark.parametrize("device", [torch.device("cpu"), "neuron:0"], ids=str)
def test_a_torch_device_or_an_indexed_device_name_is_accepted(device):
    model = kernels_neuron.kernelize(build_tiny("llama"), device=device, attention=False, mlp=False)
    assert (
        model.kernels_neuron_report.device == str(device).split(":")[0]
        and len(model.kernels_neuron_report.swapped) == 5
    )


@pytest.mark.parametrize("argument", ["attention", "mlp"])
def test_the_switches_must_be_bools(argument):
    with pytest.raises(TypeError, match=f"{argument} must be True or False, got 'yes'"):
        kernels_neuron.kernelize(build_tiny("llama"), device="neuron", **{argument: "yes"})


def test_kernelizing_again_with_attention_false_gives_the_model_its_own_attention_back():
    model = kernels_neuron.kernelize(build_tiny("llama"), device="neuron")
    assert model.config._attn_implementation == "kernels_neuron_attention"
    kernels_neuron.kernelize(model, device="neuron", attention=False)
    assert model.config._attn_implementation == "sdpa"
    with sim.capture() as traces:
        model(input_ids())
    assert not any(t.kernel.startswith("flash_attn") for t in traces)


def test_modules_kept_on_their_own_forward_are_warned_about_once_per_kernelize():
    with pytest.warns(
        UserWarning,
        match=r"kernelize kept 4 module\(s\) on their own forward, e.g. "
        r"model.layers.0.self_attn.q_norm: Qwen3RMSNorm's forward was replaced",
    ):
        _kernelize(_qk_norms_already_replaced(build_tiny("qwen3")))


# --- choosing kernels by name ----------------------------------------------------------------------------------


def test_only_and_exclude_choose_kernels_by_name():
    model = kernels_neuron.kernelize(build_tiny("llama"), device="neuron", only=["neuron-rmsnorm"])
    rows = model.kernels_neuron_report.rows
    assert {row.layer for row in rows} == {"RMSNorm"} and len(rows) == 5
    assert model.config._attn_implementation == "sdpa"
    model = kernels_neuron.kernelize(build_tiny("llama"), device="neuron", exclude=["neuron-mlp"])
    assert {row.layer for row in model.kernels_neuron_report} == {"RMSNorm", "attention"}
    mlp = model.model.layers[0].mlp
    assert forward_of(mlp) is type(mlp).forward


def test_the_mlp_keyword_is_exclude_neuron_mlp_and_undoes_an_earlier_swap():
    model = kernels_neuron.kernelize(build_tiny("llama"), device="neuron")
    mlp = model.model.layers[0].mlp
    assert forward_of(mlp) is not type(mlp).forward
    kernels_neuron.kernelize(model, device="neuron", mlp=False)
    assert forward_of(mlp) is type(mlp).forward
    assert not any(row.layer.startswith("GatedMLP") for row in model.kernels_neuron_report)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"only": ["neuron-mlpp"]}, ValueError, r"only names unknown kernels \['neuron-mlpp'\]; the kernels are"),
        ({"exclude": ["nki-sim"]}, ValueError, r"exclude names unknown kernels \['nki-sim'\]"),
        ({"exclude": "neuron-mlp"}, TypeError, "exclude must be a list of kernel names"),
    ],
)
def test_unknown_kernel_names_are_a_clear_error(kwargs, error, match):
    with pytest.raises(error, match=match):
        kernels_neuron.kernelize(build_tiny("llama"), device="neuron", **kwargs)
