"""What a fresh interpreter runs in the hub loading tests: the built repos loaded through the kernels
library alone (``kernels.get_kernel``), each run against the reference it ships, on the simulator that
came with it (the nki-sim dependency).

``python hub_loads.py '<json>'`` with ``{"repos": {short name: repo id}, "loads": [load, ...]}`` runs
the named loads in order, in one process (the imports are paid once), and prints one JSON line: each
load's result, or ``{"error": traceback}`` for a load that raised, so that the test asserting on it
fails naming that load while the others still report. Nothing here imports kernels_neuron (the loads
record whether anything did), except ``sim_capture``, which is why it goes last.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback

gc.disable()  # while the imports create their lasting objects (see tests/conftest.py)

import kernels  # noqa: E402
import torch  # noqa: E402

gc.freeze()
gc.enable()

RMSNORM_LAYERS = ("RMSNorm", "GemmaRMSNorm", "RMSNormFP32Multiply")


def _shipped_simulator():
    """The nki-sim dependency as the kernels library loaded it (a top-level ``_nki_sim_cpu_*`` module)."""
    return next(m for name, m in sys.modules.items() if name.startswith("_nki_sim_cpu_") and "." not in name)


def rmsnorm(repos: dict) -> dict:
    """neuron-rmsnorm v1: what it exports, and rms_norm against the reference in every convention."""
    kernel = kernels.get_kernel(repos["rmsnorm"], version=1)
    x, w = torch.randn(3, 5, 256), torch.randn(256) * 0.1 + 1.0
    errors = {}
    with _shipped_simulator().capture() as traces:
        for convention in ("llama", "gemma", "fp32_multiply"):
            got, ref = kernel.rms_norm(x, w, 1e-6, convention), kernel.rms_norm_reference(x, w, 1e-6, convention)
            errors[convention] = (got - ref).abs().max().item()
    layers = {
        name: isinstance(getattr(kernel.layers, name, None), type)
        and issubclass(getattr(kernel.layers, name), torch.nn.Module)
        for name in RMSNORM_LAYERS
    }
    return {
        "name": kernel.__name__,
        "file": kernel.__file__,
        "all": sorted(kernel.__all__),
        "exports": {n: callable(getattr(kernel, n, None)) for n in ("rms_norm", "rms_norm_reference")},
        "layers": layers,
        "errors": errors,
        "launches": len(traces),
        "nki_is_simulator": getattr(sys.modules.get("nki"), "__kernels_neuron_simulator__", False),
        "checkout_imported": "kernels_neuron" in sys.modules,
    }


def flash_attn(repos: dict) -> dict:
    """neuron-flash-attn v1: its attention entry points, forward and backward, against its reference."""
    kernel = kernels.get_kernel(repos["flash_attn"], version=1)
    q, k, v = (torch.randn(2, h, 40, 64) for h in (4, 2, 2))
    ref = kernel.attention_reference(q, k, v, causal=True, window=9)
    errors = {}
    with _shipped_simulator().capture() as traces:
        errors["flash_attention"] = (kernel.flash_attention(q, k, v, causal=True, window=9) - ref).abs().max().item()
        out = kernel.flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, window_size=(8, 8)
        )
        errors["flash_attn_func"] = (out.transpose(1, 2) - ref).abs().max().item()
        out, _ = kernel.flash_attn_forward(None, q, k, v, None, sliding_window=9)
        errors["flash_attn_forward"] = (out.transpose(1, 2) - ref).abs().max().item()
        leaf = q.clone().requires_grad_(True)
        kernel.flash_attention(leaf, k, v, causal=True).sum().backward()
        ref_leaf = q.clone().requires_grad_(True)
        kernel.attention_reference(ref_leaf, k, v, causal=True).sum().backward()
        errors["dq"] = (leaf.grad - ref_leaf.grad).abs().max().item()
    return {
        "name": kernel.__name__,
        "file": kernel.__file__,
        "all": sorted(kernel.__all__),
        "has_layers": hasattr(kernel, "layers"),
        "errors": errors,
        "kernels": sorted(t.kernel for t in traces),
        "checkout_imported": "kernels_neuron" in sys.modules,
    }


def mlp(repos: dict) -> dict:
    """neuron-mlp v1: gated_mlp in both activations and its backward (fused gate/up) against its reference."""
    kernel = kernels.get_kernel(repos["mlp"], version=1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 70, 96, generator=gen)
    w_gate, w_up = (torch.randn(200, 96, generator=gen) / 10 for _ in range(2))
    w_down = torch.randn(96, 200, generator=gen) / 14
    errors = {}
    with _shipped_simulator().capture() as traces:
        for act in ("silu", "gelu_tanh"):
            got = kernel.gated_mlp(x, w_gate, w_up, w_down, act)
            errors[act] = (got - kernel.gated_mlp_reference(x, w_gate, w_up, w_down, act)).abs().max().item()
        fused = torch.cat([w_gate, w_up]).requires_grad_(True)
        kernel.gated_mlp(x, fused, None, w_down).square().sum().backward()
        ref = fused.detach().clone().requires_grad_(True)
        kernel.gated_mlp_reference(x, ref, None, w_down).square().sum().backward()
        errors["d_gate_up"] = ((fused.grad - ref.grad).abs().max() / ref.grad.abs().max()).item()
    layers = sorted(
        n for n in ("GatedMLP", "GatedMLPFusedGateUp") if issubclass(getattr(kernel.layers, n), torch.nn.Module)
    )
    return {
        "name": kernel.__name__,
        "file": kernel.__file__,
        "all": sorted(kernel.__all__),
        "layers": layers,
        "errors": errors,
        "kernels": sorted(t.kernel for t in traces),
        "checkout_imported": "kernels_neuron" in sys.modules,
    }


def sim_capture(repos: dict) -> dict:
    """A Hub kernel loaded first brings its own copy of the simulator as ``nki``; kernels_neuron.sim,
    imported afterwards, must still see its launches."""
    kernel = kernels.get_kernel(repos["rmsnorm"], version=1)
    from kernels_neuron import sim  # noqa: I001 (first: importing it must leave the Hub copy as nki)
    import nki

    with sim.capture() as traces:
        kernel.rms_norm(torch.randn(3, 256), torch.ones(256), 1e-6)
    return {
        "launches": len(traces),
        "kernel": traces[0].kernel if traces else None,
        "nki_is_the_hub_copy": not nki.__name__.startswith("kernels_neuron"),
    }


LOADS = {"rmsnorm": rmsnorm, "flash_attn": flash_attn, "mlp": mlp, "sim_capture": sim_capture}


def main(request: dict) -> dict:
    results = {}
    for name in request["loads"]:
        try:
            results[name] = LOADS[name](request["repos"])
        except Exception:  # reported to the test that asserts on this load, which fails naming it
            results[name] = {"error": traceback.format_exc()}
    return results


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
