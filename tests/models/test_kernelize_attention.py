"""Flash attention in tiny transformers models (Llama, Qwen3, Mistral with a sliding window, Gemma2 with
softcap and window, Gemma3, Phi3), through both routes:

- ``kernelize``: ``kernels_neuron.kernelize(model, device="neuron")`` registers the hub's
  ``flash_attn_forward`` with transformers' AttentionInterface (and the sdpa mask with
  AttentionMaskInterface) as "kernels_neuron_attention";
- ``hub``: ``attn_implementation="kernels-neuron/neuron-flash-attn"``, transformers loading the repo
  through the kernels library (offline, LOCAL_KERNELS) and, as the name contains "flash", running
  its flash-attention path over the repo's FlashAttention-2 functions.

Logits (fp32) match the model's own sdpa/eager attention, with and without left padding, and bf16
logits stay within twice torch's own bf16 error; in training, loss and gradients match; greedy ``generate`` with a KV cache gives eager's tokens. The NKI
kernels run on the CPU simulator, and each test checks that they did.
"""

import copy
import json
import sys

import pytest
import torch
import transformers
from tiny_models import BASE, build_tiny, fresh_process_check, input_ids
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.utils.generic import is_flash_attention_requested

import kernels_neuron
from kernels_neuron import registry as registry_module
from kernels_neuron import sim
from kernels_neuron.hub import build

REGISTRY = registry_module.load()
HUB = REGISTRY.repo_id("neuron-flash-attn")
ATTENTION_NAME = REGISTRY.attention[0].name
# head_dim 64 everywhere (tiny_models.BASE); windows of 6 keys matter for 16-token inputs; Gemma2's
# softcap is set low enough to change the logits of a tiny model (its default 50 would not).
ARCHS = {
    "llama": {},
    "qwen3": {},
    "mistral": {"sliding_window": 6},
    "gemma2": {"sliding_window": 6, "attn_logit_softcapping": 0.5},
    "gemma3": {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {"sliding_window": 6},
}
OWN_ATTENTION = {"gemma2": "eager"}  # transformers' sdpa has no softcap
ROUTES = ["kernelize", "hub"]
LAYERS = BASE["num_hidden_layers"]
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _local_kernels(monkeypatch):
    """The kernels library finds the built repos (and their simulator dependency) in this checkout."""
    entries = [f"{REGISTRY.repo_id(name)}={build.BUILD_DIR / name}" for name in REGISTRY.repos]
    monkeypatch.setenv("LOCAL_KERNELS", ":".join(entries))


def reference(arch, implementation=None, **overrides):
    model = build_tiny(arch, **{**ARCHS[arch], **overrides})
    model.set_attn_implementation(implementation or OWN_ATTENTION.get(arch, "sdpa"))
    return model


def with_kernel(model, route, **kwargs):
    model = copy.deepcopy(model)
    if route == "kernelize":
        kernels_neuron.kernelize(model, device="neuron", **kwargs)
        rows = [r for r in model.kernels_neuron_report if r.layer == "attention"]
        assert [r.status for r in rows] == ["swapped"] * LAYERS, rows
        assert model.config._attn_implementation == ATTENTION_NAME
    else:
        model.set_attn_implementation(HUB)
        assert model.config._attn_implementation == HUB
    return model


def left_padded(batch=2, seq=16, pads=(0, 5)):
    ids = input_ids(batch, seq)
    mask = torch.ones_like(ids)
    for b, pad in enumerate(pads):
        mask[b, :pad] = 0
    return ids, mask


def attention_launches(traces):
    """Launches of either attention forward kernel: flash attention, or decode for a few queries."""
    return sum(t.kernel in ("flash_attn_fwd", "flash_decode_fwd") for t in traces)


# --- inference ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_the_models_own_attention_with_and_without_left_padding(arch, route):
    own = reference(arch)
    model = with_kernel(own, route)
    ids, mask = left_padded()
    with torch.no_grad(), sim.capture() as traces:
        plain = model(ids).logits
        padded = model(ids, attention_mask=mask).logits
        expected_plain, expected_padded = own(ids).logits, own(ids, attention_mask=mask).logits
    torch.testing.assert_close(plain, expected_plain, **TOL)
    real = mask.bool()  # padded positions' logits are meaningless (transformers leaves them to the kernel)
    torch.testing.assert_close(padded[real], expected_padded[real], **TOL)
    assert not padded.isnan().any()
    assert attention_launches(traces) >= 2 * LAYERS  # the NKI kernel served every layer, both calls


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_generate_with_a_kv_cache_gives_eagers_tokens_with_and_without_left_padding(arch, route):
    own = reference(arch, "eager")
    model = with_kernel(own, route)
    ids, mask = left_padded(pads=(0, 4))
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad(), sim.capture() as traces:
        for kwargs in ({}, {"attention_mask": mask}):
            assert torch.equal(model.generate(ids, **kwargs, **settings), own.generate(ids, **kwargs, **settings))
    assert attention_launches(traces) >= 2 * 6 * LAYERS  # prefill and every decode step


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_bf16_logits_within_twice_torchs_own_bf16_error(arch, route):
    own = reference(arch)
    ids, mask = left_padded()
    real = mask.bool()
    with torch.no_grad():
        exact = own(ids, attention_mask=mask).logits[real]
        torch_bf16 = copy.deepcopy(own).to(torch.bfloat16)(ids, attention_mask=mask).logits[real].float()
        kernel_bf16 = with_kernel(own, route).to(torch.bfloat16)(ids, attention_mask=mask).logits[real].float()
    torch_error, kernel_error = (torch_bf16 - exact).abs().max(), (kernel_bf16 - exact).abs().max()
    assert 0 < torch_error and kernel_error <= 2 * torch_error, (float(kernel_error), float(torch_error))


# --- training -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_training_loss_and_gradients_match(arch, route):
    own = reference(arch).train()
    model = with_kernel(own, route)
    ids, mask = left_padded()
    # A label counts only when the position predicting it is real: the logits at padded positions
    # differ between kernels (zeros here and in sdpa, a uniform average in eager).
    predicted_from_padding = torch.cat([torch.ones_like(mask[:, :1]), mask[:, :-1]], dim=1) == 0
    labels = ids.masked_fill((mask == 0) | predicted_from_padding, -100)
    with sim.capture() as traces:
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
    assert sum(t.kernel == "flash_attn_bwd" for t in traces) >= LAYERS  # the NKI backward ran
    expected = own(ids, attention_mask=mask, labels=labels).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), own.named_parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


# --- the features matter, and a missing mask registration would be caught ----------------------------------


@pytest.mark.parametrize(
    "arch, change", [("mistral", {"sliding_window": None}), ("gemma2", {"attn_logit_softcapping": None})]
)
def test_window_and_softcap_change_these_tiny_models_logits(arch, change):
    """Negative control: a kernel that ignored the window or the softcap would fail the logits test."""
    ids = input_ids()
    with torch.no_grad():
        with_feature, without = reference(arch)(ids).logits, reference(arch, "eager", **change)(ids).logits
    assert (with_feature - without).abs().max() > 100 * TOL["atol"]


def test_without_the_mask_registration_padded_batches_would_be_wrong(monkeypatch):
    """Why kernelize registers transformers' sdpa mask too: with no mask function for the name, the
    padded batch's logits are silently wrong (and the test above would catch it)."""
    own = reference("llama")
    model = with_kernel(own, "kernelize")
    ids, mask = left_padded()
    monkeypatch.delitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, ATTENTION_NAME)
    with torch.no_grad():
        wrong, expected = model(ids, attention_mask=mask).logits, own(ids, attention_mask=mask).logits
    assert (wrong[mask.bool()] - expected[mask.bool()]).abs().max() > 1e-2


# --- kernelize: the report and fallbacks --------------------------------------------------------------------


def test_kernelize_reports_every_attention_module():
    model = kernels_neuron.kernelize(reference("qwen3"), device="neuron")
    rows = [r for r in model.kernels_neuron_report if r.layer == "attention"]
    assert [r.path for r in rows] == [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    assert {r.kernel for r in rows} == {f"{HUB}:flash_attn_forward"} and {r.status for r in rows} == {"swapped"}
    assert "model.layers.0.self_attn" in str(model.kernels_neuron_report)
    assert ATTENTION_NAME in transformers.AttentionInterface._global_mapping
    assert ALL_MASK_ATTENTION_FUNCTIONS[ATTENTION_NAME] is transformers.masking_utils.sdpa_mask


def test_kernelize_attention_false_leaves_attention_alone():
    model = kernels_neuron.kernelize(reference("llama"), device="neuron", attention=False)
    assert model.config._attn_implementation == "sdpa"
    assert all(r.layer != "attention" for r in model.kernels_neuron_report)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # the model's own attention: sdpa; eager with softcap
def test_head_dim_above_256_keeps_the_models_own_attention(arch):
    own = reference(arch, head_dim=320)
    model = copy.deepcopy(own)
    kernels_neuron.kernelize(model, device="neuron")
    rows = [r for r in model.kernels_neuron_report if r.layer == "attention"]
    assert [r.status for r in rows] == ["fallback"] * LAYERS
    assert all("head_dim 320 is above the kernel's limit of 256" in r.reason for r in rows)
    ids, mask = left_padded()
    with torch.no_grad(), sim.capture() as traces:
        got, got_unpadded = model(ids, attention_mask=mask).logits, model(ids).logits
        torch.testing.assert_close(got[mask.bool()], own(ids, attention_mask=mask).logits[mask.bool()], **TOL)
        torch.testing.assert_close(got_unpadded, own(ids).logits, **TOL)  # no mask: causal all the same
    assert attention_launches(traces) == 0
    reason = model.model.layers[0].self_attn.kernels_neuron_fallback  # the call's reason, as it warned
    assert reason.count("head_dim 320 is above") == 1, reason  # the module's and the query's, named once


def test_attention_dropout_in_training_keeps_the_models_own_attention():
    model = reference("llama", attention_dropout=0.1).train()
    kernels_neuron.kernelize(model, device="neuron")
    rows = [r for r in model.kernels_neuron_report if r.layer == "attention"]
    assert model.kernels_neuron_report.mode == "training"
    assert all(r.status == "fallback" and "attention dropout 0.1 in training" in r.reason for r in rows)
    with sim.capture() as traces:
        model(input_ids()).logits.sum().backward()
    assert attention_launches(traces) == 0  # sdpa with dropout ran instead
    model.eval()  # in inference the same modules use the kernel
    with torch.no_grad(), sim.capture() as traces:
        model(input_ids())
    assert attention_launches(traces) == LAYERS


def test_attention_sinks_keep_gpt_oss_own_attention():
    """GPT-OSS's attention sinks are an architecture feature the kernel lacks: fallback, logits intact."""
    config = transformers.GptOssConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=256,
        num_hidden_layers=2,
        vocab_size=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=6,
    )
    torch.manual_seed(0)
    own = transformers.GptOssForCausalLM(config).eval()
    model = kernels_neuron.kernelize(copy.deepcopy(own), device="neuron")
    rows = [r for r in model.kernels_neuron_report if r.layer == "attention"]
    assert [r.reason for r in rows] == ["attention sinks (s_aux) are not supported"] * 2
    ids, mask = left_padded()
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, attention_mask=mask).logits[mask.bool()],
            own(ids, attention_mask=mask).logits[mask.bool()],
            **TOL,
        )


def test_kernelized_model_compiles_without_graph_breaks():
    own = reference("mistral")
    model = with_kernel(own, "kernelize", mode="inference+torch.compile")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = input_ids()
    with torch.no_grad(), sim.capture() as traces:
        got = compiled(ids).logits
    assert attention_launches(traces) == LAYERS
    with torch.no_grad():
        torch.testing.assert_close(got, own(ids).logits, **TOL)
    torch._dynamo.reset()


# --- the attn_implementation routes -------------------------------------------------------------------------


def test_from_pretrained_with_the_hub_repo_and_with_the_registered_name(tmp_path):
    own = reference("qwen3")
    own.save_pretrained(tmp_path)
    ids, mask = left_padded()
    with torch.no_grad():
        expected = own(ids, attention_mask=mask).logits[mask.bool()]
        hub = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=HUB)
        kernels_neuron.register_attention()
        named = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=ATTENTION_NAME)
        for model, implementation in ((hub, HUB), (named, ATTENTION_NAME)):
            assert model.config._attn_implementation == implementation
            with sim.capture() as traces:
                torch.testing.assert_close(model(ids, attention_mask=mask).logits[mask.bool()], expected, **TOL)
            assert attention_launches(traces) >= LAYERS


def test_the_hub_name_is_a_flash_request_and_runs_the_flash_path():
    """The mandated name contains "flash", so transformers takes its flash-attention path: the flash mask
    (a 2-D padding mask) and unpadding into the repo's flash_attn_varlen_func. The repo exports the
    whole FA2 API for that. kernelize's name has no "flash" (the registry refuses one)."""
    assert is_flash_attention_requested(requested_attention_implementation=HUB)
    assert not is_flash_attention_requested(requested_attention_implementation=ATTENTION_NAME)
    model = with_kernel(reference("llama"), "hub")
    assert ALL_MASK_ATTENTION_FUNCTIONS[HUB] is ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]
    ids, mask = left_padded()
    calls = []
    kernel = sys.modules[
        next(name for name in sys.modules if name.startswith("_neuron_flash_attn_") and "." not in name)
    ]
    real = transformers.modeling_flash_attention_utils._flash_varlen_fn
    assert real is kernel.flash_attn_varlen_func
    transformers.modeling_flash_attention_utils._flash_varlen_fn = lambda *a, **k: calls.append(k) or real(*a, **k)
    try:
        with torch.no_grad():
            model(ids, attention_mask=mask)
    finally:
        transformers.modeling_flash_attention_utils._flash_varlen_fn = real
    assert len(calls) == LAYERS and calls[0]["causal"] is True


@pytest.mark.slow
def test_a_model_with_its_own_flash_kernels_replaces_the_hub_name(fresh_process):
    """The pitfall of the mandated name: a model that lists ``_compatible_flash_implementations``
    (GPT-OSS, ...) swaps any other "…flash…" string for its own kernel (offline: a load error naming that
    kernel, not ours). kernelize's name has no "flash" and is left alone (see the sinks test above).
    In a fresh process (conftest.py's, fresh_process.compatible_flash): it would try to download."""
    result = fresh_process_check(fresh_process, "compatible_flash")
    compatible = transformers.GptOssForCausalLM._compatible_flash_implementations
    assert HUB not in compatible
    assert result.get("implementation") != HUB
    assert any(name in json.dumps(result) for name in compatible) or "flash-attn3" in json.dumps(result), result


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("arch, head_dim", [("llama", 64), ("gemma2", 64), ("gemma2", 256)])  # Gemma-2's 256
def test_generate_with_a_static_cache_decodes_with_the_decode_kernel_and_gives_eagers_tokens(arch, head_dim, route):
    own = reference(arch, "eager", num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim)
    model = with_kernel(own, route)
    ids = input_ids(2, 20)  # a prompt above DECODE_MAX_QUERIES, so the prefill runs flash attention
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad(), sim.capture() as traces:
        got = model.generate(ids, **settings)
    assert torch.equal(got, own.generate(ids, **settings))
    kernels = [t.kernel for t in traces]
    # The prompt runs the flash-attention kernel; each of the 4 decode steps runs the decode kernel per layer.
    assert kernels.count("flash_decode_fwd") >= 4 * LAYERS, kernels
    assert kernels.count("flash_attn_fwd") >= LAYERS
