"""kernelize(model, device="neuron") on tiny Llama, Qwen2/3, Mistral, Mixtral, Phi3, OLMo2, Granite and
Gemma 1/2/3 models: every norm is swapped for the right NKI layer, and logits (fp32, bf16), loss and
gradients match the un-kernelized model. The NKI kernels run on the CPU simulator."""

import copy
import sys

import pytest
import torch
from tiny_models import (
    ARCHS,
    KERNEL_REPO,
    assert_bf16_like_torch,
    assert_gradients_match,
    assert_logits_match,
    assert_runs_kernel_layer,
    bf16_errors,
    build_tiny,
    forward_of,
    input_ids,
    norm_modules,
)

import kernels_neuron
from kernels_neuron import sim


# Gemma3 transposes q/k to [batch, heads, seq, head_dim] before q_norm/k_norm, so those norms get a
# non-contiguous input, which kernels_neuron/ops/rmsnorm.py:rms_norm rejects ("x ... is not
# contiguous; call .contiguous() first") instead of making it contiguous. Strict: once the op is
# fixed these cases XPASS and fail, so the marker must then be removed.
def _kernelize(model, **kwargs):
    # attention, the MLP and the MoE experts left out: these tests check norm numerics in isolation; the
    # others have tests/models/test_kernelize_{attention,mlp,moe}.py.
    return kernels_neuron.kernelize(
        model, device="neuron", attention=False, mlp=False, exclude=["neuron-moe"], **kwargs
    )


def test_every_norm_is_swapped_for_the_right_layer(arch, tiny):
    model = _kernelize(tiny(arch))
    report = model.kernels_neuron_report
    norms = norm_modules(model)
    layer = ARCHS[arch].layer
    assert len(norms) == ARCHS[arch].norms
    assert report.fallbacks == []
    assert [row.path for row in report.swapped] == list(norms)  # every norm, each once, nothing else
    served = [row for row in report if row.status != "no kernel"]
    assert {row.layer for row in served} == {layer}
    assert {row.kernel for row in served} == {f"{KERNEL_REPO}:{layer}"}
    for module in norms.values():
        assert_runs_kernel_layer(module, layer)
    assert report.device == "neuron" and report.mode == "inference"


def test_fp32_logits_match_the_original_model(arch, tiny):
    model = tiny(arch)
    reference = copy.deepcopy(model)
    _kernelize(model)
    ids = input_ids()
    with sim.capture() as traces:
        assert_logits_match(model, reference, ids)
    assert len(traces) == ARCHS[arch].norms  # the NKI forward ran once per norm


def test_bf16_logits_stay_within_torchs_own_bf16_error(arch, tiny):
    assert_bf16_like_torch(bf16_errors(tiny(arch), input_ids(), _kernelize))


def test_training_loss_and_every_gradient_match(arch, tiny):
    model = tiny(arch).train()
    reference = copy.deepcopy(model)
    _kernelize(model)  # mode None follows model.training
    report = model.kernels_neuron_report
    assert report.mode == "training" and len(report.swapped) == ARCHS[arch].norms
    ids = input_ids()
    with sim.capture() as traces:
        loss = model(ids, labels=ids).loss
        loss.backward()
    assert len(traces) == 2 * ARCHS[arch].norms  # the NKI forward and backward ran for every norm
    expected = reference(ids, labels=ids).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert_gradients_match(model, reference)


# --- negative controls: the checks above would catch a broken kernel --------------------------------


def _layer_globals(model):
    """The globals of the hub layers module the swapped forwards run in (where ``rms_norm`` lives)."""
    return forward_of(next(iter(norm_modules(model).values()))).__globals__


def _force_convention(monkeypatch, model, convention_map):
    namespace = _layer_globals(model)
    real = namespace["rms_norm"]
    monkeypatch.setitem(
        namespace, "rms_norm", lambda x, w, eps, convention: real(x, w, eps, convention_map.get(convention, convention))
    )


def test_a_gemma_layer_with_the_llama_convention_fails_the_logits_check(monkeypatch):
    model = build_tiny("gemma")
    reference = copy.deepcopy(model)
    _kernelize(model)
    assert_logits_match(model, reference, input_ids())
    _force_convention(monkeypatch, model, {"gemma": "llama"})
    with pytest.raises(AssertionError, match="not close"):
        assert_logits_match(model, reference, input_ids())


def test_an_olmo2_layer_that_rounds_like_llama_fails_the_bf16_check(monkeypatch):
    """In fp32 the llama and fp32_multiply conventions agree; only where bf16 rounds tells them apart."""
    model = build_tiny("olmo2")
    ids = input_ids()
    assert_bf16_like_torch(bf16_errors(model, ids, _kernelize))
    _force_convention(monkeypatch, _kernelize(copy.deepcopy(model)), {"fp32_multiply": "llama"})
    with pytest.raises(AssertionError, match="rounds elsewhere than the module"):
        assert_bf16_like_torch(bf16_errors(model, ids, _kernelize))


def test_a_wrong_weight_gradient_fails_the_gradient_check(monkeypatch):
    model = build_tiny("llama").train()
    reference = copy.deepcopy(model)
    _kernelize(model)
    ops_module = sys.modules[_layer_globals(model)["rms_norm"].__module__]  # the hub package's rmsnorm.py
    nki_kernels = ops_module._kernels
    real_bwd = nki_kernels.rmsnorm_bwd

    def skewed_bwd(*args):
        dx, dweight = real_bwd(*args)
        return dx, dweight * 1.001

    monkeypatch.setattr(nki_kernels, "rmsnorm_bwd", skewed_bwd)
    ids = input_ids()
    model(ids, labels=ids).loss.backward()
    reference(ids, labels=ids).loss.backward()
    with pytest.raises(AssertionError, match="layernorm.weight|norm.weight"):
        assert_gradients_match(model, reference)


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_greedy_decoding_through_the_decode_layout_gives_the_same_tokens(arch):
    """At hidden 1024 (fp32: 64 partitions) each generated token's norms see 2 rows (batch 2), which the
    forward spreads over the partitions (its decode layout); greedy generation matches the original
    model token for token."""
    model = build_tiny(arch, hidden_size=1024)
    reference = copy.deepcopy(model)
    _kernelize(model)
    ids = input_ids(batch=2, seq=8)
    settings = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with torch.no_grad(), sim.capture() as traces:
        got = model.generate(ids, **settings)
    with torch.no_grad():
        want = reference.generate(ids, **settings)
    assert torch.equal(got, want)
    # the decode layout is the only RMSNorm forward that runs a matmul (its sum over the partitions)
    decode_launches = [t for t in traces if any(i.op == "nc_matmul" for i in t.instructions)]
    assert len(decode_launches) == 3 * ARCHS[arch].norms  # the 3 steps after the prompt's
