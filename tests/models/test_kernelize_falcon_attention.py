"""Falcon's attention through ``kernelize``: FalconAttention calls sdpa itself rather than transformers'
attention interface, so the neuron-flash-attn repo serves it with a layer (``FalconAttention`` in its
``layers``). Tiny Falcon models in the new-decoder layout (4 query heads in 2 KV groups) and the
multi-query layout (one KV head), head sizes 64 and 16: the report lists the attention swapped, the NKI
kernel runs (forward and backward), fp32 logits (with left padding), greedy generation with a dynamic
cache and training gradients match the un-kernelized model, bf16 logits stay within twice torch's own
bf16 error; ALiBi models, ``output_attentions`` and FalconFlashAttention2 keep their own forward."""

import copy

import pytest
import torch
import transformers
from tiny_models import input_ids
from torch import nn
from transformers.models.falcon.modeling_falcon import FalconFlashAttention2

import kernels_neuron
from kernels_neuron import sim

LAYERS = 2
LAYOUTS = {
    "new_decoder": {"new_decoder_architecture": True, "num_kv_heads": 2},
    "multi_query": {"new_decoder_architecture": False, "multi_query": True},
    "per_head": {"new_decoder_architecture": False, "multi_query": False},
}
KV_HEADS = {"new_decoder": 2, "multi_query": 1, "per_head": 4}  # the layer's cache
OWN_KV_HEADS = {"new_decoder": 4, "multi_query": 1, "per_head": 4}  # the module's own forward's cache
KERNEL = "kernels-neuron/neuron-flash-attn:FalconAttention"
TOL = dict(rtol=1e-5, atol=1e-5)


def falcon(layout: str, head_dim: int = 64, **overrides) -> nn.Module:
    """A tiny FalconForCausalLM: 4 heads of ``head_dim``, 2 layers, vocab 128, with biases (random)."""
    config = transformers.FalconConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_hidden_layers=LAYERS,
        vocab_size=128,
        bias=True,
        **{**LAYOUTS[layout], **overrides},
    )
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    return model


def kernelized(model: nn.Module, **kwargs) -> nn.Module:
    return kernels_neuron.kernelize(copy.deepcopy(model), device="neuron", **kwargs)


def attention_rows(model: nn.Module) -> list:
    return [row for row in model.kernels_neuron_report if row.path.endswith("self_attention")]


def launches(traces, kernel: str = "flash_attn_fwd") -> int:
    return sum(t.kernel == kernel for t in traces)


def left_padded(pads=(0, 5)) -> tuple[torch.Tensor, torch.Tensor]:
    ids = input_ids()
    mask = torch.ones_like(ids)
    for b, pad in enumerate(pads):
        mask[b, :pad] = 0
    return ids, mask


def right_padded(pads=(0, 5)) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = left_padded(pads)
    return ids, mask.flip(1)


@pytest.fixture(scope="module", params=[(layout, d) for layout in LAYOUTS for d in (64, 16)], ids=str)
def pair(request):
    """(layout, the un-kernelized model, the kernelized one), shared by the inference tests."""
    layout, head_dim = request.param
    own = falcon(layout, head_dim)
    return layout, own, kernelized(own)


def test_the_report_lists_falcons_attention_swapped(pair):
    _, own, model = pair
    rows = attention_rows(model)
    assert [(r.path, r.layer, r.kernel, r.status) for r in rows] == [
        (f"transformer.h.{i}.self_attention", "FalconAttention", KERNEL, "swapped") for i in range(LAYERS)
    ]
    assert "not routed" not in str(model.kernels_neuron_report)
    assert model.config._attn_implementation == own.config._attn_implementation == "sdpa"


def test_fp32_logits_match_with_and_without_padding(pair):
    _, own, model = pair
    ids, left = left_padded()
    _, right = right_padded()
    with torch.no_grad(), sim.capture() as traces:
        plain = model(ids).logits
        padded = {side: model(ids, attention_mask=mask).logits for side, mask in (("left", left), ("right", right))}
    assert launches(traces) == 3 * LAYERS  # the NKI kernel served every layer of every call
    with torch.no_grad():
        torch.testing.assert_close(plain, own(ids).logits, **TOL)
        for side, mask in (("left", left), ("right", right)):
            real = mask.bool()
            torch.testing.assert_close(padded[side][real], own(ids, attention_mask=mask).logits[real], **TOL)
            assert not padded[side].isnan().any()
    real = left.bool()
    assert (padded["left"][real] - plain[real]).abs().max() > 1e-3  # the padding changed row 1: the mask mattered


def test_greedy_generate_gives_the_same_tokens_and_caches_only_the_kv_heads(pair):
    layout, own, model = pair
    ids, mask = left_padded(pads=(0, 4))
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    with torch.no_grad(), sim.capture() as traces:
        got = model.generate(ids, attention_mask=mask, **settings)
    want = own.generate(ids, attention_mask=mask, **settings)
    assert torch.equal(got.sequences, want.sequences)
    # the prefill on the flash-attention kernel; four decode steps on the decode kernel, one launch for
    # both rows (each reads only its own run of keys: their left padding differs)
    assert (launches(traces), launches(traces, "flash_decode_fwd")) == (LAYERS, 4 * LAYERS)
    assert got.past_key_values.layers[0].keys.shape[1] == KV_HEADS[layout]
    assert want.past_key_values.layers[0].keys.shape[1] == OWN_KV_HEADS[layout]


def test_called_without_a_mask_it_is_causal_as_the_modules_sdpa_call():
    """The model always passes a mask; called directly without one, the module's sdpa call is causal for
    more than one query and sees every key for one (decoding against its cache)."""
    own = falcon("new_decoder")
    model = kernelized(own)
    attention, own_attention = model.transformer.h[0].self_attention, own.transformer.h[0].self_attention
    hidden = torch.randn(2, 16, 256, generator=torch.Generator().manual_seed(2))
    caches = transformers.DynamicCache(), transformers.DynamicCache()
    for rows in (slice(0, 15), slice(15, 16)):  # a prefill of 15 tokens, then one decoded
        x = hidden[:, rows]
        rotary = own.transformer.rotary_emb(x, position_ids=torch.arange(16)[rows][None])
        with torch.no_grad(), sim.capture() as traces:
            got, _ = attention(x, None, None, layer_past=caches[0], position_embeddings=rotary)
            want, _ = own_attention(x, None, None, layer_past=caches[1], position_embeddings=rotary)
        assert launches(traces) + launches(traces, "flash_decode_fwd") == 1  # one kernel launch per call
        torch.testing.assert_close(got, want, **TOL)


def test_a_cache_started_by_the_models_own_attention_is_continued():
    """The module's own forward caches the KV heads broadcast to every query head (new decoder); the layer
    continues such a cache in that layout."""
    own = falcon("new_decoder")
    model = kernelized(own)
    ids = input_ids(batch=1)
    with torch.no_grad():
        cache = own(ids[:, :10], use_cache=True).past_key_values
        got = model(ids[:, 10:], past_key_values=copy.deepcopy(cache)).logits
        want = own(ids[:, 10:], past_key_values=cache).logits
    torch.testing.assert_close(got, want, **TOL)


def test_bf16_logits_within_twice_torchs_own_bf16_error():
    for layout in LAYOUTS:
        own = falcon(layout)
        ids, mask = left_padded()
        real = mask.bool()
        with torch.no_grad():
            exact = own(ids, attention_mask=mask).logits[real]
            torch_bf16 = copy.deepcopy(own).to(torch.bfloat16)(ids, attention_mask=mask).logits[real].float()
            model = kernelized(copy.deepcopy(own).to(torch.bfloat16), only=["neuron-flash-attn"])
            kernel_bf16 = model(ids, attention_mask=mask).logits[real].float()
        torch_error, kernel_error = (torch_bf16 - exact).abs().max(), (kernel_bf16 - exact).abs().max()
        assert 0 < torch_error and kernel_error <= 2 * torch_error, (layout, float(kernel_error), float(torch_error))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_loss_and_gradients_match(layout):
    """Falcon's rotary path applies no attention dropout, so the layer serves training even with
    attention_dropout set (no other dropout is left in these models)."""
    own = falcon(layout, attention_dropout=0.1, hidden_dropout=0.0).train()
    model = kernelized(own)
    assert {r.status for r in attention_rows(model)} == {"swapped"} and model.kernels_neuron_report.mode == "training"
    ids, mask = left_padded()
    predicted_from_padding = torch.cat([torch.ones_like(mask[:, :1]), mask[:, :-1]], dim=1) == 0
    labels = ids.masked_fill((mask == 0) | predicted_from_padding, -100)
    with sim.capture() as traces:
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
    assert launches(traces, "flash_attn_bwd") >= LAYERS  # the NKI backward ran
    expected = own(ids, attention_mask=mask, labels=labels).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    attention_grads = [p.grad for n, p in model.named_parameters() if "query_key_value" in n]
    assert attention_grads and all(g is not None and g.abs().max() > 0 for g in attention_grads)
    for (name, p), (_, q) in zip(model.named_parameters(), own.named_parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_eager_models_additive_mask_is_served():
    own = falcon("new_decoder", attn_implementation="eager")
    model = kernelized(own)
    assert {r.status for r in attention_rows(model)} == {"swapped"}
    ids, mask = left_padded()
    real = mask.bool()
    with torch.no_grad(), sim.capture() as traces:
        got = model(ids, attention_mask=mask).logits
    assert launches(traces) == LAYERS
    with torch.no_grad():
        torch.testing.assert_close(got[real], own(ids, attention_mask=mask).logits[real], **TOL)


@pytest.mark.parametrize("mode", ["inference", pytest.param("training", marks=pytest.mark.slow)])
def test_compiles_without_graph_breaks_and_matches(mode):
    """Under torch.compile (fullgraph: a graph break raises) the layer's checks pass while tracing, so the
    kernel runs inside the graph rather than the module's own forward (a fallback is not recorded then)."""
    own = falcon("new_decoder", hidden_dropout=0.0).train(mode == "training")
    model = kernelized(own, mode=f"{mode}+torch.compile", only=["neuron-flash-attn"])  # see the report
    assert {r.status for r in attention_rows(model)} == {"swapped"}
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids, mask = left_padded()
    real = mask.bool()
    with torch.set_grad_enabled(mode == "training"), sim.capture() as traces:
        got = compiled(ids, attention_mask=mask).logits
        if mode == "training":
            got[real].sum().backward()
    torch._dynamo.reset()
    assert launches(traces) == LAYERS and launches(traces, "flash_attn_bwd") == (LAYERS if mode == "training" else 0)
    with torch.set_grad_enabled(mode == "training"):
        want = own(ids, attention_mask=mask).logits
        torch.testing.assert_close(got[real], want[real], **TOL)
        if mode == "training":
            want[real].sum().backward()
            for (name, p), (_, q) in zip(model.named_parameters(), own.named_parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# --- what the layer does not serve --------------------------------------------------------------------------


def test_head_dim_above_the_kernels_limit_keeps_the_modules_own_forward():
    own = falcon("new_decoder", head_dim=320)
    model = kernelized(own, only=["neuron-flash-attn"])
    rows = attention_rows(model)
    assert [r.status for r in rows] == ["fallback"] * LAYERS
    assert all("head_dim 320 is above the kernel's limit of 256" in r.reason for r in rows)
    ids = input_ids()
    with torch.no_grad(), sim.capture() as traces:
        torch.testing.assert_close(model(ids).logits, own(ids).logits, **TOL)
    assert launches(traces) == 0


def test_alibi_models_keep_their_own_attention_with_the_reason_in_the_report():
    own = falcon("multi_query", alibi=True)
    model = kernelized(own)
    rows = attention_rows(model)
    assert [r.status for r in rows] == ["fallback"] * LAYERS
    assert all("ALiBi positions (config.alibi=True)" in r.reason for r in rows)
    ids, mask = left_padded()
    real = mask.bool()
    with torch.no_grad(), sim.capture() as traces:
        got = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(got[real], own(ids, attention_mask=mask).logits[real], **TOL)
    assert launches(traces) == 0


def test_output_attentions_falls_back_for_that_call():
    own = falcon("new_decoder")
    model = kernelized(own)
    ids = input_ids()
    with torch.no_grad(), pytest.warns(UserWarning, match="output_attentions=True"):
        got = model(ids, output_attentions=True)
    assert len(got.attentions) == LAYERS and got.attentions[0].shape == (2, 4, 16, 16)
    rows = attention_rows(model)
    assert all("output_attentions=True" in (r.call_time_fallback or "") for r in rows)
    assert "fell back at call time" in str(model.kernels_neuron_report)
    with torch.no_grad(), sim.capture() as traces:
        model(ids)
    assert launches(traces) == LAYERS  # the next call is served again


def test_a_fallback_onto_a_cache_the_layer_filled_is_a_clear_error():
    """The module's own forward (new decoder) appends every query head's K/V; the layer's cache holds the
    KV heads, so continuing it that way cannot work, and the error says why rather than torch.cat's."""
    model = kernelized(falcon("new_decoder"))
    ids = input_ids(batch=1)
    with torch.no_grad():
        cache = model(ids[:, :10], use_cache=True).past_key_values
        with pytest.raises(
            ValueError, match=r"\(output_attentions=True: .*caches 4 KV heads, but the KV cache holds 2"
        ):
            model(ids[:, 10:], past_key_values=cache, output_attentions=True)


def test_falcon_flash_attention2_keeps_its_own_forward():
    """A model built with flash_attention_2 gets FalconFlashAttention2, a subclass with its own forward
    (flash-attention masks and dropout): it inherits FalconAttention's tag, and the layer refuses it."""
    config = transformers.FalconConfig(
        hidden_size=128, num_attention_heads=2, num_hidden_layers=1, vocab_size=64, **LAYOUTS["new_decoder"]
    )
    attention = FalconFlashAttention2(config, layer_idx=0)
    model = kernels_neuron.kernelize(nn.ModuleDict({"attention": attention}), device="neuron")
    (row,) = model.kernels_neuron_report.rows
    assert row.status == "fallback" and "not the FalconAttention.forward the layer reproduces" in row.reason
    assert "forward" not in vars(attention)


def test_excluding_the_attention_kernel_gives_falcon_its_own_attention_back():
    model = kernelized(falcon("new_decoder"))
    kernels_neuron.kernelize(model, device="neuron", exclude=["neuron-flash-attn"])
    assert attention_rows(model) == []
    assert all("forward" not in vars(m) for _, m in model.named_modules() if type(m).__name__ == "FalconAttention")
    with torch.no_grad(), sim.capture() as traces:
        model(input_ids())
    assert launches(traces) == 0
