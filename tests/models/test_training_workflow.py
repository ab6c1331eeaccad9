"""The training workflow around a kernelized model: autocast (what TRL's ``bf16=True`` means on the CPU),
PEFT LoRA added before or after ``kernelize``, constraints that change after ``kernelize`` (a dtype, a
non-contiguous weight, a hook), packed sequences (TRL's padding-free batches) and padded batches on the
kernel's sequence path, and sequences longer than one kernel launch holds.

Where the kernel cannot serve a call the module's own forward runs, the report says so and a warning
is given once; every check compares with the un-kernelized model and checks that the kernels ran."""

import copy
import sys
import warnings

import pytest
import torch
from tiny_models import build_tiny, input_ids
from torch import nn

import kernels_neuron
from kernels_neuron import sim

TOL = dict(rtol=1e-5, atol=1e-5)


def _qwen3(**overrides):
    return build_tiny("qwen3", use_cache=False, **overrides).train()


def _kernelized(model, **kwargs):
    return kernels_neuron.kernelize(copy.deepcopy(model), device="neuron", **kwargs)


def _kernel_names(traces):
    return {t.kernel for t in traces}


def _hub_module(model, suffix):
    """The Hub package's module ``suffix`` (``flash_attn_interface`` ...) the kernelized model runs."""
    names = [n for n in sys.modules if n.startswith("_neuron_flash_attn_") and n.split(".")[1:] == [suffix]]
    assert names, f"no loaded hub module ends with {suffix}"
    return sys.modules[names[0]]


# --- autocast -------------------------------------------------------------------------------------------


def _step(model, ids, autocast):
    with sim.capture() as traces:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(ids, labels=ids)
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.logits.detach(), grads, _kernel_names(traces)


def test_a_training_step_under_bf16_autocast_matches_the_model_under_the_same_autocast():
    """q/k reach attention in fp32 (rotary, q/k norms) beside a bf16 v; the MLP computes in bf16."""
    model = _qwen3()
    ids = input_ids(seq=24)  # above DECODE_MAX_QUERIES: the flash-attention kernel, not the decode one
    exact_logits, exact_grads, _ = _step(copy.deepcopy(model), ids, autocast=False)
    torch_logits, torch_grads, _ = _step(copy.deepcopy(model), ids, autocast=True)
    kernelized = _kernelized(model)
    kernel_logits, kernel_grads, kernels = _step(kernelized, ids, autocast=True)
    assert {"flash_attn_fwd", "flash_attn_bwd", "mlp_fwd", "mlp_bwd", "rmsnorm_fwd", "rmsnorm_bwd"} <= kernels
    assert kernelized.kernels_neuron_report.call_time_fallbacks == []
    assert kernel_logits.dtype == torch_logits.dtype == torch.bfloat16
    torch_error = (torch_logits.float() - exact_logits).abs().max()
    assert 0 < torch_error and (kernel_logits.float() - exact_logits).abs().max() <= 2 * torch_error

    def relative(grads):
        return max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in exact_grads.items())

    assert 0 < relative(torch_grads) and relative(kernel_grads) <= 3 * relative(torch_grads)


# --- PEFT LoRA, before and after kernelize ------------------------------------------------------------------


def _lora(model, dropout=0.0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)  # the same adapters for every copy; b non-zero so that they change the output
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=dropout, init_lora_weights=False)
    return get_peft_model(model, config)


def _train(model, steps=3):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses, first_grads, kernels = [], None, set()
    for n in range(steps):
        ids = input_ids(seed=10 + n)
        with sim.capture() as traces:
            loss = model(ids, labels=ids).loss
            loss.backward()
        kernels |= _kernel_names(traces)
        if first_grads is None:
            first_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, first_grads, kernels


@pytest.mark.parametrize("order", ["kernelize-then-lora", "lora-then-kernelize"])
def test_lora_training_keeps_the_fused_mlp_and_matches_the_unkernelized_lora_run(order):
    base = _qwen3()
    reference = _lora(copy.deepcopy(base))
    if order == "kernelize-then-lora":
        model = _lora(_kernelized(base))
        report = model.base_model.model.kernels_neuron_report
    else:
        model = kernels_neuron.kernelize(_lora(copy.deepcopy(base)), device="neuron")
        report = model.kernels_neuron_report
    want_losses, want_grads, _ = _train(reference)
    losses, grads, kernels = _train(model)
    assert {"mlp_fwd", "mlp_bwd"} <= kernels and report.fallbacks == [] and report.call_time_fallbacks == []
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=0)
    assert grads.keys() == want_grads.keys()
    assert len([n for n in want_grads if ".mlp." in n]) == 2 * 3 * 2  # lora_A and lora_B of 3 projections, 2 layers
    for name, want in want_grads.items():
        scale = want.abs().max()
        assert scale > 0, f"{name}: no gradient, the comparison would prove nothing"
        torch.testing.assert_close(
            grads[name], want, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("order", ["kernelize-then-lora", "lora-then-kernelize"])
def test_merge_and_unload_gives_the_same_weights_and_a_model_with_the_same_logits(order):
    base = _qwen3().eval()
    reference = _lora(copy.deepcopy(base))
    model = (
        _lora(_kernelized(base))
        if order == "kernelize-then-lora"
        else (kernels_neuron.kernelize(_lora(copy.deepcopy(base)), device="neuron"))
    )
    ids = input_ids()
    with torch.no_grad():
        before = model(ids).logits
        merged, want = model.merge_and_unload(), reference.merge_and_unload()
        assert merged.state_dict().keys() == want.state_dict().keys()
        for name, tensor in want.state_dict().items():
            assert torch.equal(merged.state_dict()[name], tensor), name
        torch.testing.assert_close(merged(ids).logits, before, **TOL)


def test_lora_dropout_in_training_runs_the_modules_own_forward_and_says_why():
    base = _qwen3()
    reference, model = _lora(copy.deepcopy(base), dropout=0.1), _lora(_kernelized(base), dropout=0.1)
    ids = input_ids()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = []
        for m in (model, model, reference):
            torch.manual_seed(5)  # the same dropout masks: the kernels draw no random numbers
            outputs.append(m(ids).logits)
    torch.testing.assert_close(outputs[0], outputs[2], **TOL)
    ours = [str(w.message) for w in caught if "kernels-neuron" in str(w.message)]
    assert len(ours) == 1 and "Qwen3MLP runs its own forward" in ours[0] and "dropout 0.1 in training" in ours[0]
    rows = model.base_model.model.kernels_neuron_report.call_time_fallbacks
    assert {r.path for r in rows} == {"model.layers.0.mlp", "model.layers.1.mlp"}
    assert "lora_dropout=0 keeps the kernel" in rows[0].call_time_fallback


# --- constraints that change after kernelize ------------------------------------------------------------


def test_a_module_that_no_longer_fits_runs_its_own_forward_with_one_warning():
    """bf16 hidden 4160 fits the MLP kernel (limit 8192); after model.float() it is past the fp32 limit."""
    model = build_tiny(
        "llama",
        hidden_size=4160,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=65,
        num_key_value_heads=65,
        vocab_size=32,
    ).to(torch.bfloat16)
    kernelized = _kernelized(model)
    assert [r.path for r in kernelized.kernels_neuron_report.swapped if r.layer == "GatedMLP"] == ["model.layers.0.mlp"]
    ids = input_ids(1, 4) % 32
    kernelized.float()
    model.float()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(2):
            torch.testing.assert_close(kernelized(ids).logits, model(ids).logits, **TOL)
    ours = [str(w.message) for w in caught if "kernels-neuron" in str(w.message)]
    assert ours == [
        "kernels-neuron: LlamaMLP runs its own forward: hidden size 4160 is above the kernel's 4096 for float32"
    ]
    (row,) = kernelized.kernels_neuron_report.call_time_fallbacks
    assert row.path == "model.layers.0.mlp" and "4160" in row.call_time_fallback
    assert "fell back at call time" in str(kernelized.kernels_neuron_report)


@pytest.mark.parametrize(
    "change, reason",
    [
        (
            lambda mlp: setattr(mlp.down_proj, "weight", nn.Parameter(mlp.down_proj.weight.t().contiguous().t())),
            "down_proj.weight is not contiguous",
        ),
        (lambda mlp: mlp.gate_proj.register_forward_hook(lambda module, args, out: out * 2), "gate_proj has hooks"),
        (lambda mlp: setattr(mlp, "up_proj", nn.Linear(256, 512, bias=True)), "up_proj has a bias"),
    ],
    ids=["non-contiguous", "hook", "bias"],
)
def test_a_projection_changed_after_kernelize_runs_the_modules_own_forward(change, reason):
    model = build_tiny("llama")
    kernelized = _kernelized(model)
    for m in (model, kernelized):
        torch.manual_seed(0)
        change(m.model.layers[0].mlp)
    ids = input_ids()
    with warnings.catch_warnings(record=True), torch.no_grad():
        warnings.simplefilter("always")
        torch.testing.assert_close(kernelized(ids).logits, model(ids).logits, **TOL)
    (row,) = kernelized.kernels_neuron_report.call_time_fallbacks
    assert row.path == "model.layers.0.mlp" and reason in row.call_time_fallback, row.call_time_fallback


# --- packed and padded batches on the sequence path ---------------------------------------------------------


@pytest.fixture
def varlen_calls(monkeypatch):
    """Counts the calls of the hub's flash_attn_varlen (the kernel's packed-sequence path) made by
    flash_attn_forward."""
    calls = []

    def install(model):
        interface = _hub_module(model, "flash_attn_interface")
        real = interface.flash_attn_varlen
        monkeypatch.setattr(interface, "flash_attn_varlen", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
        return calls

    return install


def test_packed_sequences_take_the_kernels_sequence_path(varlen_calls):
    """TRL's padding-free batches (cu_seq_lens_q/k) and restarting position_ids alone: no dense mask."""
    model = _qwen3().eval()
    kernelized = _kernelized(model)
    calls = varlen_calls(kernelized)
    lengths = [70, 30, 150, 6]
    ids = input_ids(1, sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 70, 100, 250, 256], dtype=torch.int32)
    packed = dict(position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=150, max_length_k=150)
    with torch.no_grad():
        expected = model(ids, position_ids=positions).logits  # transformers' block-diagonal mask, sdpa
        torch.testing.assert_close(kernelized(ids, **packed).logits, expected, **TOL)
        torch.testing.assert_close(kernelized(ids, position_ids=positions).logits, expected, **TOL)
    assert len(calls) == 4 and all(torch.equal(c, cu) for c in calls)
    separate = torch.cat([model(ids[:, a:b]).logits for a, b in zip(cu[:-1], cu[1:])], dim=1)
    torch.testing.assert_close(expected, separate, **TOL)  # the reference itself keeps the sequences apart


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_match_and_left_padding_takes_the_sequence_path(side, varlen_calls):
    model = _qwen3().eval()
    kernelized = _kernelized(model)
    calls = varlen_calls(kernelized)
    ids = input_ids(2, 40)
    mask = torch.ones_like(ids)
    if side == "left":
        mask[0, :13] = 0
    else:
        mask[1, 25:] = 0
    with torch.no_grad():
        torch.testing.assert_close(
            kernelized(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits, **TOL
        )
    assert len(calls) == (2 if side == "left" else 0)


# --- longer than one launch ---------------------------------------------------------------------------------


def test_a_sequence_longer_than_one_launch_trains_like_the_reference(monkeypatch):
    """The hub kernel's residency limits lowered to 128 keys of head_dim 64 per forward launch: a
    300-token step needs several launches, forward and backward, and matches."""
    model = _qwen3()
    kernelized = _kernelized(model)
    nki_attention = _hub_module(kernelized, "attention")._kernels
    monkeypatch.setattr(nki_attention, "MAX_RESIDENT_KV_BYTES", nki_attention.resident_kv_bytes(128, 64, 4))
    monkeypatch.setattr(nki_attention, "MAX_RESIDENT_BWD_BYTES", nki_attention.resident_bwd_bytes(128, 128, 64, 4))
    ids = input_ids(1, 300)
    with sim.capture() as traces:
        loss = kernelized(ids, labels=ids).loss
        loss.backward()
    launches = sum(t.kernel == "flash_attn_fwd" for t in traces)
    assert launches > 2 * 2, launches  # several per layer
    expected = model(ids, labels=ids).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(kernelized.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_position_ids_that_jump_do_not_make_a_plain_causal_mask_packed(varlen_calls):
    """Positions with a gap (e.g. a prompt continued after skipped tokens) and a mask that is plainly
    causal (with the sliding window): the mask is what counts, not the positions."""
    model = build_tiny("mistral", sliding_window=4, use_cache=False).eval()
    kernelized = _kernelized(model)
    calls = varlen_calls(kernelized)
    ids = input_ids(1, 8)
    positions = torch.tensor([[0, 1, 2, 3, 10, 11, 12, 13]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, position_ids=positions).logits
        torch.testing.assert_close(kernelized(ids, attention_mask=mask, position_ids=positions).logits, expected, **TOL)
    assert [c.tolist() for c in calls] == [[0, 8], [0, 8]]  # one sequence per layer, not split at the jump
