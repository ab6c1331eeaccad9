"""The microbenchmark suite: ``kernels-neuron bench`` runs these cases.

Each case is a kernel on a shape from a real model, with the PyTorch op it replaces. Until the
hub kernels land, the suite runs the calibration matmuls (``benchmarks/calibration.py``) on
projection shapes: ``x[tokens, hidden] @ W.T`` with ``lhs_t = x.T`` and ``rhs = W.T``.
"""

from __future__ import annotations

from functools import partial

import ml_dtypes
import numpy as np

from kernels_neuron import sim
from kernels_neuron.bench import Case

sim.install()  # the kernels import ``nki``: real NKI on a Trainium host, else the simulator
from kernels_neuron.sim.examples import tiled_matmul  # noqa: E402

from nki_src.rmsnorm import rmsnorm_bwd, rmsnorm_fwd  # noqa: E402

from .calibration import basic_tiled, blocked_free, fully_optimized, operands  # noqa: E402

PREFILL_TOKENS = 2048
DECODE_TOKENS = 128


def _linear_reference(lhs_t, rhs):
    """What ``torch.nn.Linear`` computes for the same operands: ``x @ W.T`` with x = lhs_t.T."""
    return lhs_t.T @ rhs


def _projection(name: str, kernel, model: str, m: int, k: int, n: int, **kwargs) -> Case:
    return Case(
        name=name, kernel=kernel, make_inputs=partial(lambda m, k, n, seed: operands(m, k, n, seed), m, k, n),
        shape={"M": m, "K": k, "N": n}, dtype="bfloat16", model=model,
        reference_name="torch.matmul (nn.Linear)", reference=_linear_reference, kwargs=kwargs,
    )


def _rmsnorm_inputs(rows: int, hidden: int, backward: bool, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, hidden)).astype(ml_dtypes.bfloat16)
    weight = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(ml_dtypes.bfloat16)
    if not backward:
        return x, weight
    rstd = (1.0 / np.sqrt((x.astype(np.float32) ** 2).mean(axis=1, keepdims=True) + 1e-6)).astype(np.float32)
    return rng.standard_normal((rows, hidden)).astype(ml_dtypes.bfloat16), x, weight, rstd


def _rmsnorm_reference(convention: str):
    from kernels_neuron.ops.rmsnorm import rms_norm_reference

    return lambda x, weight: rms_norm_reference(x, weight, 1e-6, convention)


def _rmsnorm(name: str, model: str, rows: int, hidden: int, convention: str, backward: bool = False) -> Case:
    module = {"llama": "LlamaRMSNorm", "gemma": "GemmaRMSNorm", "fp32_multiply": "Olmo2RMSNorm"}[convention]
    return Case(
        name=name, kernel=rmsnorm_bwd if backward else rmsnorm_fwd,
        make_inputs=partial(lambda r, h, b, seed: _rmsnorm_inputs(r, h, b, seed), rows, hidden, backward),
        shape={"rows": rows, "hidden": hidden}, dtype="bfloat16", model=model,
        reference_name=f"{module} {'backward (autograd)' if backward else 'forward'} (torch)",
        reference=_rmsnorm_reference(convention),
        kwargs={"convention": convention} if backward else {"eps": 1e-6, "convention": convention, "out_dtype": "bfloat16"},
    )


CASES: list[Case] = [
    _rmsnorm("rmsnorm-fwd/llama3-8b/4096-tokens", "Llama-3-8B", 4096, 4096, "llama"),
    _rmsnorm("rmsnorm-bwd/llama3-8b/4096-tokens", "Llama-3-8B", 4096, 4096, "llama", backward=True),
    _rmsnorm("rmsnorm-fwd/gemma2-9b/4096-tokens", "Gemma-2-9B", 4096, 3584, "gemma"),
    _rmsnorm("rmsnorm-bwd/gemma2-9b/4096-tokens", "Gemma-2-9B", 4096, 3584, "gemma", backward=True),
    _rmsnorm("rmsnorm-fwd/qwen3-8b-q_norm/2048-tokens", "Qwen3-8B", 2048 * 32, 128, "llama"),
    _rmsnorm("rmsnorm-fwd/mistral-7b/decode-8", "Mistral-7B", 8, 4096, "llama"),
    _projection("matmul-optimised/llama3-8b-q_proj/prefill", fully_optimized, "Llama-3-8B", PREFILL_TOKENS, 4096, 4096),
    _projection("matmul-optimised/mistral-7b-kv_proj/prefill", fully_optimized, "Mistral-7B", PREFILL_TOKENS, 4096, 1024),
    _projection("matmul-optimised/gemma2-9b-q_proj/prefill", fully_optimized, "Gemma-2-9B", PREFILL_TOKENS, 3584, 4096,
                tiles_k=7),
    _projection("matmul-blocked/qwen3-8b-o_proj/prefill", blocked_free, "Qwen3-8B", PREFILL_TOKENS, 4096, 4096),
    _projection("matmul-basic/qwen3-8b-o_proj/prefill", basic_tiled, "Qwen3-8B", PREFILL_TOKENS, 4096, 4096),
    _projection("matmul-tiled/llama3-8b-q_proj/decode128", tiled_matmul, "Llama-3-8B", DECODE_TOKENS, 4096, 4096),
]
