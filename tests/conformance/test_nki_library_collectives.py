"""AWS nki-library's collective kernels (``nkilib.experimental.collectives``), unmodified, on a multi-rank
launch (``sim.run_ranks``) against NumPy references.

Shapes, dtypes, rank counts, LNC degrees and tolerances come from nki-library's own tests
(``test/integration/nkilib/experimental/collectives/``): their active cases, and for the HBM paths the
cases they keep commented out (they time out on AWS's pipeline). Inputs are drawn as those tests draw
them (standard normal, our own seed); each rank gets its slice, as their per-rank input generators give.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernels_neuron import sim

from .test_nki_library import assert_matches

pytestmark = [pytest.mark.conformance, pytest.mark.usefixtures("nki_library_src")]

BF16 = ml_dtypes.bfloat16
RNG_SEED = 0


def _group(ranks: int):
    from nki.collectives import ReplicaGroup

    return ReplicaGroup([list(range(ranks))])


# test_fg_allgather.py: m1024_K4096_bf16_tp4_lnc2 (active) and m512_K8192_bf16_tp4_lnc2_hbm (commented);
# absolute and relative accuracy 1e-3.
@pytest.mark.parametrize("m, k, force_hbm_cc", [(1024, 4096, False), (512, 8192, True)], ids=["sbuf", "hbm"])
def test_fine_grained_allgather(m, k, force_hbm_cc):
    from nkilib.experimental.collectives.fg_allgather import fine_grained_allgather

    tp = 4
    lhs = np.random.default_rng(RNG_SEED).standard_normal((m * tp, k)).astype(BF16)
    result = sim.run_ranks(
        fine_grained_allgather,
        [{"lhs": lhs[r * m : (r + 1) * m]} for r in range(tp)],
        tp_degree=tp,
        num_groups=1,
        force_hbm_cc=force_hbm_cc,
        grid=2,
    )
    for out in result.outputs:
        assert_matches(out.reshape(m * tp, k), lhs, rtol=1e-3, atol=1e-3)


# test_fgcc.py: m1024_K4096_N4096_bf16_tp4_lnc2 (active) and m256_K1024_N1024_bf16_tp4_lnc2_hbm
# (commented); absolute and relative accuracy 1e-2; lhs row-sharded, rhs column-sharded by rank.
@pytest.mark.parametrize(
    "m, k, n, force_hbm_cc", [(1024, 4096, 4096, False), (256, 1024, 1024, True)], ids=["sbuf", "hbm"]
)
def test_allgather_compute_matmul(m, k, n, force_hbm_cc):
    from nkilib.experimental.collectives.fgcc import allgather_compute_matmul

    tp = 4
    rng = np.random.default_rng(RNG_SEED)
    lhs, rhs = rng.standard_normal((m * tp, k)).astype(BF16), rng.standard_normal((k, n)).astype(BF16)
    expected = (lhs.astype(np.float32) @ rhs.astype(np.float32)).astype(BF16)
    width = n // tp
    result = sim.run_ranks(
        allgather_compute_matmul,
        [{"lhs": lhs[r * m : (r + 1) * m], "rhs": rhs[:, r * width : (r + 1) * width]} for r in range(tp)],
        tp_degree=tp,
        num_groups=1,
        force_hbm_cc=force_hbm_cc,
        grid=2,
    )
    for rank, out in enumerate(result.outputs):
        assert_matches(out.reshape(m * tp, width), expected[:, rank * width : (rank + 1) * width], rtol=1e-2, atol=1e-2)


# test_sb2sb_allgather.py: m128_k512_bf16_tp8 and m128_k256_bf16_tp64 (allgather_sb2sb, LNC=1),
# m256_k512_bf16_tp8_lnc2 and m512_k1024_fp16_tp4_lnc2 (allgather_sb2sb_tiled); accuracy 1e-3.
@pytest.mark.parametrize(
    "tiled, m, k, dtype, tp, lnc",
    [
        (False, 128, 512, BF16, 8, 1),
        (False, 128, 256, BF16, 64, 1),
        (True, 256, 512, BF16, 8, 2),
        (True, 512, 1024, np.float16, 4, 2),
    ],
    ids=["m128-k512-tp8", "m128-k256-tp64", "tiled-m256-k512-tp8-lnc2", "tiled-m512-k1024-fp16-tp4-lnc2"],
)
def test_allgather_sb2sb(tiled, m, k, dtype, tp, lnc):
    from nkilib.experimental.collectives.sb2sb_allgather import allgather_sb2sb, allgather_sb2sb_tiled

    x = np.random.default_rng(RNG_SEED).standard_normal((tp, m, k)).astype(dtype)
    result = sim.run_ranks(
        allgather_sb2sb_tiled if tiled else allgather_sb2sb,
        [{"inp": x[r]} for r in range(tp)],
        replica_groups=_group(tp),
        tp_degree=tp,
        grid=lnc if lnc > 1 else None,
    )
    expected = np.concatenate(list(x), axis=1)
    for out in result.outputs:
        assert_matches(out, expected, rtol=1e-3, atol=1e-3)
