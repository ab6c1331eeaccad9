"""How fast the NKI simulator itself runs: the kernel author's inner loop.

Measures wall time per simulated instruction for small tiles (128x64 fp32 VectorE ops) and for
full-size tiles (128x512 bf16 matmuls with their DMA), and the time to simulate a 2048^3 bf16
tiled matmul. Each figure is the best of ``--repeat`` runs, measured with time.perf_counter on
whatever cores this process may use (pin it with ``taskset -c 0`` to measure one core).

    python benchmarks/sim_speed.py [--repeat 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import ml_dtypes
import numpy as np

from kernels_neuron import sim

sim.install()
import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

from kernels_neuron.sim.examples import tiled_matmul  # noqa: E402

SMALL_OPS = 2000


@nki.jit
def small_tile_chain(x):
    """SMALL_OPS dependent VectorE/ScalarE instructions on one 128x64 fp32 tile."""
    tile = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x)
    for _ in range(SMALL_OPS // 2):
        nisa.tensor_scalar(dst=tile, data=tile, op0=nl.multiply, operand0=1.0, op1=nl.add, operand1=0.0)
        nisa.activation(dst=tile, op=nl.copy, data=tile)
    out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


def _best(fn, repeat: int) -> tuple[float, sim.SimResult]:
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def measure(repeat: int = 3) -> dict[str, float]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 64)).astype(np.float32)
    small_s, small = _best(lambda: sim.run(small_tile_chain, x), repeat)
    a = rng.standard_normal((2048, 2048)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((2048, 2048)).astype(ml_dtypes.bfloat16)
    big_s, big = _best(lambda: sim.run(tiled_matmul, a, b), repeat)
    return {
        "small_tile_us_per_instruction": small_s / len(small.trace) * 1e6,
        "small_tile_instructions_per_s": len(small.trace) / small_s,
        "matmul_2048_cubed_bf16_s": big_s,
        "matmul_2048_instructions": len(big.trace),
        "full_tile_us_per_instruction": big_s / len(big.trace) * 1e6,
        "full_tile_instructions_per_s": len(big.trace) / big_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    figures = measure(args.repeat)
    for key, value in figures.items():
        print(f"{key:34} {value:,.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)


if __name__ == "__main__":
    main()
