"""Where the RMSNorm forward's decode layout pays off: modelled time against the row tiles.

For every shape where ``nki_src.rmsnorm.decode_partitions`` chooses the decode layout (1..16 rows, a
spread of hidden sizes, bf16 and fp32, every convention), model the forward on Trn2 as chosen and
with the row tiles forced, and print the slowest ratio. The decode layout's switch point
(``DECODE_PARTITIONS_PER_ROW``, ``DECODE_MIN_PARTITIONS``) rests on this sweep; it exits non-zero if
the decode layout is modelled slower anywhere it is chosen. Takes about 15 seconds.

    python benchmarks/rmsnorm_decode_sweep.py
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

from kernels_neuron import cost, sim

sim.install()
import nki_src.rmsnorm as kernels  # noqa: E402

HIDDEN = [200, 384, 576, 640, 896, 960, 1000, 1152, 1536, 2304, 2880, 3000, 3584, 4000, 5120, 8192, 12288, 16384]
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
EPS = 1e-6


def modelled_us(rows: int, hidden: int, dtype: str, convention: str, row_tiles: bool) -> float:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, hidden)).astype(DTYPES[dtype])
    w = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(DTYPES[dtype])
    chosen = kernels.decode_partitions
    if row_tiles:
        kernels.decode_partitions = lambda *args: 0
    try:
        return cost.estimate(kernels.rmsnorm_fwd, x, w, EPS, convention, dtype).time_us
    finally:
        kernels.decode_partitions = chosen


def main() -> int:
    ratios = []
    for hidden in HIDDEN:
        for dtype in DTYPES:
            for convention in kernels.CONVENTIONS:
                for rows in range(1, kernels.P // kernels.DECODE_PARTITIONS_PER_ROW + 1):
                    if not kernels.decode_partitions(rows, hidden, dtype):
                        break
                    decode = modelled_us(rows, hidden, dtype, convention, row_tiles=False)
                    row_tiles = modelled_us(rows, hidden, dtype, convention, row_tiles=True)
                    ratios.append((decode / row_tiles, rows, hidden, dtype, convention))
    ratios.sort(reverse=True)
    print(f"{len(ratios)} shapes take the decode layout; decode / row tiles, slowest first:")
    for ratio, rows, hidden, dtype, convention in ratios[:5]:
        print(f"  {ratio:.3f}  rows={rows} hidden={hidden} {dtype} {convention}")
    return 1 if ratios and ratios[0][0] > 1 else 0


if __name__ == "__main__":
    sys.exit(main())
