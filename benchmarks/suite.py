"""The microbenchmark suite: ``kernels-neuron bench`` runs these cases.

Each case is a kernel on a shape from a real model, with the PyTorch op it replaces. Until the
hub kernels land, the suite runs the calibration matmuls (``benchmarks/calibration.py``) on
projection shapes: ``x[tokens, hidden] @ W.T`` with ``lhs_t = x.T`` and ``rhs = W.T``.
"""

from __future__ import annotations

from functools import partial

from kernels_neuron import sim
from kernels_neuron.bench import Case

sim.install()  # the kernels import ``nki``: real NKI on a Trainium host, else the simulator
from kernels_neuron.sim.examples import tiled_matmul  # noqa: E402

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


CASES: list[Case] = [
    _projection("matmul-optimised/llama3-8b-q_proj/prefill", fully_optimized, "Llama-3-8B", PREFILL_TOKENS, 4096, 4096),
    _projection("matmul-optimised/mistral-7b-kv_proj/prefill", fully_optimized, "Mistral-7B", PREFILL_TOKENS, 4096, 1024),
    _projection("matmul-optimised/gemma2-9b-q_proj/prefill", fully_optimized, "Gemma-2-9B", PREFILL_TOKENS, 3584, 4096,
                tiles_k=7),
    _projection("matmul-blocked/qwen3-8b-o_proj/prefill", blocked_free, "Qwen3-8B", PREFILL_TOKENS, 4096, 4096),
    _projection("matmul-basic/qwen3-8b-o_proj/prefill", basic_tiled, "Qwen3-8B", PREFILL_TOKENS, 4096, 4096),
    _projection("matmul-tiled/llama3-8b-q_proj/decode128", tiled_matmul, "Llama-3-8B", DECODE_TOKENS, 4096, 4096),
]
