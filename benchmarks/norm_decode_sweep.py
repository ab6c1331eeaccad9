"""Where the norms' decode layout pays off: modelled time against the row tiles.

For every shape where a forward chooses the decode layout (``nki_src._common.decode_partitions``; 1..16
rows, a spread of hidden sizes, bf16 and fp32), model the RMSNorm forward (every convention) and the LayerNorm
forward (every affine form) on Trn2 as chosen and with the row tiles forced, and print the slowest
ratios. The decode layout's switch point (``DECODE_PARTITIONS_PER_ROW``, ``DECODE_MIN_PARTITIONS``)
rests on this sweep; it exits non-zero if the decode layout is modelled slower anywhere it is chosen.
Takes about 20 seconds.

    python benchmarks/norm_decode_sweep.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType

import ml_dtypes
import numpy as np

from kernels_neuron import cost, sim

sim.install()
import nki_src._common as common  # noqa: E402
import nki_src.layernorm as layernorm  # noqa: E402
import nki_src.rmsnorm as rmsnorm  # noqa: E402

HIDDEN = [200, 384, 576, 640, 896, 960, 1000, 1152, 1536, 2304, 2880, 3000, 3584, 4000, 5120, 8192, 12288, 16384]
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
EPS = 1e-6
# (kernel module, variant name, the forward's arguments from x, a weight, a bias and the dtype's name,
# the forward's layout choice: its decode partitions for (rows, hidden, dtype), 0 for the row tiles)
VARIANTS: list[tuple[ModuleType, str, Callable, Callable]] = [
    *(
        (rmsnorm, c, lambda x, w, b, dtype, c=c: (x, w, EPS, c, dtype), rmsnorm.decode_partitions)
        for c in rmsnorm.CONVENTIONS
    ),
    *(
        (
            layernorm,
            name,
            lambda x, w, b, dtype, keep=keep: (x, w if keep[0] else None, b if keep[1] else None, EPS),
            lambda rows, hidden, dtype, keep=keep: layernorm.forward_decode_partitions(rows, hidden, dtype, any(keep)),
        )
        for name, keep in (
            ("weight+bias", (True, True)),
            ("weight", (True, False)),
            ("bias", (False, True)),
            ("none", (False, False)),
        )
    ),
]


def modelled_us(module: ModuleType, arguments: Callable, rows: int, hidden: int, dtype: str, row_tiles: bool) -> float:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, hidden)).astype(DTYPES[dtype])
    w = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(DTYPES[dtype])
    b = (0.1 * rng.standard_normal(hidden)).astype(DTYPES[dtype])
    chosen = module.decode_partitions
    if row_tiles:
        module.decode_partitions = lambda *args: 0
    try:
        forward = module.rmsnorm_fwd if module is rmsnorm else module.layernorm_fwd
        report = cost.estimate(forward, *arguments(x, w, b, dtype))
    finally:
        module.decode_partitions = chosen
    return report.time_us


def main() -> int:
    ratios = []
    for hidden in HIDDEN:
        for dtype in DTYPES:
            for module, variant, arguments, chooses in VARIANTS:
                for rows in range(1, common.P // common.DECODE_PARTITIONS_PER_ROW + 1):
                    if not chooses(rows, hidden, dtype):
                        break
                    decode = modelled_us(module, arguments, rows, hidden, dtype, row_tiles=False)
                    row_tiles = modelled_us(module, arguments, rows, hidden, dtype, row_tiles=True)
                    ratios.append((decode / row_tiles, module.__name__.split(".")[-1], variant, rows, hidden, dtype))
    ratios.sort(reverse=True)
    print(f"{len(ratios)} (kernel, shape) pairs take the decode layout; decode / row tiles, slowest first:")
    for ratio, kernel, variant, rows, hidden, dtype in ratios[:8]:
        print(f"  {ratio:.3f}  {kernel} {variant} rows={rows} hidden={hidden} {dtype}")
    return 1 if ratios and ratios[0][0] > 1 else 0


if __name__ == "__main__":
    sys.exit(main())
