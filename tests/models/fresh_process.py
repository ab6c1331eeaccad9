"""What a fresh interpreter runs for the model tests whose subject is process-wide state (transformers'
kernel hooks and mappings, its hub-kernel loading), offline, in one process so the imports are paid once.

``python fresh_process.py '<json>'`` with ``{"checks": [check, ...], "hub": the flash-attention repo
id, "checkpoints": {name: saved tiny model}}`` runs the named checks in order and prints one JSON line:
each check's result, or ``{"error": traceback}`` for a check that raised, so that the test asserting on
it fails naming that check while the others still report.

``compatible_flash`` goes first: it imports no kernels_neuron, registers nothing, and none of the
modeling modules ``use_kernels`` needs unimported (that check asserts it).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import traceback

gc.disable()  # while the imports create their lasting objects (see tests/conftest.py)

import torch  # noqa: E402
import transformers  # noqa: E402

gc.freeze()
gc.enable()


def compatible_flash(request: dict) -> dict:
    """GPT-OSS lists ``_compatible_flash_implementations``: asked for our Hub repo by name, it loads its
    own kernel instead (offline, a load error naming that kernel)."""
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
    )
    model = transformers.GptOssForCausalLM(config)
    try:
        model.set_attn_implementation(request["hub"])
        return {"implementation": model.config._attn_implementation}
    except Exception as exc:
        return {"load_error": f"{type(exc).__name__}: {exc}"}


def use_kernels(request: dict) -> dict:
    """``register_mapping`` (the norm layers only), then each checkpoint loaded with ``use_kernels=True``:
    which forward its norms run, and its bf16 logits' errors against the fp32 model, beside torch's own."""
    # The modeling modules must not be imported yet: register_mapping hooks them as they load.
    before = [m for m in ("olmo2", "llama", "gemma") if f"transformers.models.{m}.modeling_{m}" in sys.modules]
    import kernels_neuron
    from kernels_neuron import registry

    # The norm layers only: this checks where their bf16 rounding happens (the MLP's model tests are
    # in test_kernelize_mlp.py, and its kernel rounds less often than the module it replaces).
    reg = registry.load()
    kernels_neuron.register_mapping(
        reg=dataclasses.replace(reg, layers=tuple(layer for layer in reg.layers if layer.repo == "neuron-rmsnorm"))
    )
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    result: dict = {"imported_before": before}
    load = transformers.AutoModelForCausalLM.from_pretrained
    for name, path in request["checkpoints"].items():
        exact, plain = load(path, dtype=torch.float32), load(path, dtype=torch.bfloat16)
        model = load(path, dtype=torch.bfloat16, use_kernels=True)
        forwards = sorted(
            {
                (m.forward.__func__.__qualname__, m.forward.__func__.__module__.split(".")[0])
                for m in model.modules()
                if "RMSNorm" in type(m).__name__
            }
        )
        with torch.no_grad():
            ref, eager, kernel = (m(ids).logits.float() for m in (exact, plain, model))
        result[name] = {
            "forwards": forwards,
            "errors": {
                "torch": (eager - ref).abs().max().item(),
                "kernel": (kernel - ref).abs().max().item(),
                "kernel_vs_torch": (kernel - eager).abs().max().item(),
            },
        }
    return result


CHECKS = {"compatible_flash": compatible_flash, "use_kernels": use_kernels}


def main(request: dict) -> dict:
    results = {}
    for name in request["checks"]:
        try:
            results[name] = CHECKS[name](request)
        except Exception:  # reported to the test that asserts on this check, which fails naming it
            results[name] = {"error": traceback.format_exc()}
    return results


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
