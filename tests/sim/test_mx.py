"""NeuronCore-v4's microscaling instructions, ``nisa.quantize_mx`` and ``nisa.nc_matmul_mx``, against
AWS's documented layout (the API references, the Trainium3 guide, the MXFP matmul deep dive): x4
elements pack four contraction values, one e8m0 scale per 8 partitions x one x4 column, scales kept in
their data's 32-partition quadrant. References decode with ml_dtypes, not with the simulator.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from kernel_io import to_hbm

from kernels_neuron import sim

sim.install()

import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

BF16 = ml_dtypes.bfloat16
E4M3FN = ml_dtypes.float8_e4m3fn
FP4 = ml_dtypes.float4_e2m1fn


def _load(x, dtype=None):
    tile = nl.ndarray(x.shape, x.dtype if dtype is None else dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x if dtype is None else x.ap([[x.shape[1], x.shape[0]], [1, x.shape[1]]], dtype=dtype))
    return tile


def _scale_row(group):
    """The documented placement: group g of 8 partitions in its quadrant, rows 0..3 of each 32."""
    return 32 * (group // 4) + group % 4


def _exactly_quantizable(parts, columns, rng):
    """bf16 data whose MXFP8 (e4m3fn) quantization is lossless, with the scale exponent of each group.

    Every [8, 4] group holds e4m3fn values times 2**s, one of them in [128, 256) * 2**s, so the
    documented scale 2**(floor(log2 max) - 7) is exactly 2**s.
    """
    groups = (parts // 8, columns)
    exponents = rng.integers(-6, 6, size=groups)
    mantissas = rng.choice([-96.0, -40.0, -3.0, -0.5, 0.0, 1.0, 7.0, 52.0, 112.0], size=(parts // 8, 8, columns, 4))
    mantissas[:, 0, :, 0] = rng.choice([-240.0, 128.0, 176.0, 208.0], size=groups)
    values = mantissas * np.exp2(exponents)[:, None, :, None]
    return values.reshape(parts, columns * 4).astype(BF16), exponents


@pytest.mark.parametrize("parts", [32, 128])
def test_quantize_mx_is_lossless_on_representable_groups_and_places_scales_by_quadrant(parts):
    rng = np.random.default_rng(0)
    columns = 16
    data, exponents = _exactly_quantizable(parts, columns, rng)

    def kernel(x):
        src = _load(x)
        dst = nl.ndarray((parts, columns), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        scale = nl.ndarray((parts, columns), nl.uint8, buffer=nl.sbuf)
        nisa.memset(dst=scale, value=0)
        nisa.quantize_mx(dst=dst, src=src, dst_scale=scale)
        bits = nl.ndarray((parts, columns), nl.uint32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=bits, src=dst.view(nl.uint32))
        return to_hbm(bits), to_hbm(scale)

    bits, scale = sim.run(kernel, data, target="trn3").outputs
    values = (
        np.ascontiguousarray(bits).view(np.uint8).view(E4M3FN).astype(np.float32).reshape(parts // 8, 8, columns, 4)
    )
    np.testing.assert_array_equal(
        values * np.exp2(exponents)[:, None, :, None], data.astype(np.float32).reshape(parts // 8, 8, columns, 4)
    )
    rows = [_scale_row(g) for g in range(parts // 8)]
    np.testing.assert_array_equal(scale[rows], exponents + 127)
    assert not scale[[r for r in range(parts) if r not in rows]].any()  # other partitions untouched


def test_quantize_mx_scale_of_an_all_zero_group_and_the_documented_doubling():
    """max |v| = 3 with e4m3fn: scale 2**(floor(log2 3) - (8 - 1)) = 2**-6, byte 121 (OCP's would be 120)."""
    data = np.zeros((32, 8), BF16)
    data[0:8, 0:4] = 3.0

    def kernel(x):
        dst = nl.ndarray((32, 2), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        scale = nl.ndarray((4, 2), nl.float8_e8m0fnu, buffer=nl.sbuf)
        nisa.quantize_mx(dst=dst, src=_load(x), dst_scale=scale)
        bits = nl.ndarray((4, 2), nl.uint8, buffer=nl.sbuf)
        nisa.tensor_copy(dst=bits, src=scale.view(nl.uint8))
        return to_hbm(bits)

    scale = sim.run(kernel, data, target="trn3").outputs
    assert scale[0, 0] == 121
    assert scale[0, 1] == 0 and scale[1, 0] == 0  # all-zero groups: 2**-127


def _pack_fp4(values):
    """Four e2m1 values per 16-bit word, the first in the lowest nibble."""
    nibbles = values.astype(FP4).view(np.uint8).astype(np.uint16) & 0xF
    grouped = nibbles.reshape(values.shape[0], -1, 4)
    return (grouped << (4 * np.arange(4, dtype=np.uint16))).sum(axis=2, dtype=np.uint16)


@pytest.mark.parametrize("dst_dtype", [np.float32, BF16])
def test_nc_matmul_mx_fp8_stationary_fp4_moving_against_dequantized_math(dst_dtype):
    rng = np.random.default_rng(1)
    k, m, n = 64, 32, 48
    st_values = rng.choice(np.array([-448, -20, -1.5, 0, 0.25, 3, 96, 448], np.float32), size=(k, m * 4))
    mv_values = rng.choice(np.array([-6, -1.5, -0.5, 0, 0.5, 1, 2, 4], np.float32), size=(k, n * 4))
    st_bits = st_values.astype(E4M3FN).view(np.uint32)
    mv_bits = _pack_fp4(mv_values)
    st_scale = rng.integers(120, 134, size=(k // 8, m)).astype(np.uint8)
    mv_scale = rng.integers(118, 130, size=(k // 8, n)).astype(np.uint8)
    # Scales in the documented layout: k = 64 spans two quadrants.
    st_scale_hw = np.zeros((k, m), np.uint8)
    mv_scale_hw = np.zeros((k, n), np.uint8)
    for g in range(k // 8):
        st_scale_hw[_scale_row(g)] = st_scale[g]
        mv_scale_hw[_scale_row(g)] = mv_scale[g]
    out_dtype = nl.float32 if dst_dtype == np.float32 else nl.bfloat16

    def kernel(st, mv, sts, mvs):
        dst = nl.ndarray((m, n), out_dtype, buffer=nl.psum)
        nisa.nc_matmul_mx(
            dst=dst,
            stationary=_load(st, nl.float8_e4m3fn_x4),
            moving=_load(mv, nl.float4_e2m1fn_x4),
            stationary_scale=_load(sts),
            moving_scale=_load(mvs),
        )
        return to_hbm(dst)

    result = sim.run(kernel, st_bits, mv_bits, st_scale_hw, mv_scale_hw, target="trn3")
    st_deq = st_values.astype(np.float64).reshape(k, m, 4) * np.exp2(np.repeat(st_scale, 8, axis=0) - 127.0)[:, :, None]
    mv_deq = mv_values.astype(np.float64).reshape(k, n, 4) * np.exp2(np.repeat(mv_scale, 8, axis=0) - 127.0)[:, :, None]
    expected = np.einsum("kiq,kjq->ij", st_deq, mv_deq)
    # fp32 sums of 4k products (each error <= 4k * 2**-24 * sum |products|), then one dst rounding.
    magnitude = np.einsum("kiq,kjq->ij", np.abs(st_deq), np.abs(mv_deq))
    bound = 4 * k * 2**-24 * magnitude + np.abs(expected) * (0 if dst_dtype == np.float32 else 2**-8)
    assert np.all(np.abs(result.outputs.astype(np.float64) - expected) <= bound)
    close = 1e-5 if dst_dtype == np.float32 else 2**-7  # catches a wrong scale or nibble order
    assert np.abs(result.outputs.astype(np.float64) - expected).max() < close * np.abs(expected).max()
    (inst,) = [i for i in result.trace if i.op == "nc_matmul_mx"]
    assert (inst.engine, inst.attrs["K"], inst.attrs["M"], inst.attrs["N"]) == ("tensor", 4 * k, m, n)


def test_quantize_then_matmul_with_packed_scales_as_the_deep_dive_does():
    """One scale tile for both operands: stationary's at rows 0..3 of each quadrant, moving's at 4..7."""
    rng = np.random.default_rng(2)
    st, _ = _exactly_quantizable(128, 32, rng)
    mv, _ = _exactly_quantizable(128, 64, rng)

    def kernel(st_in, mv_in):
        packed = nl.ndarray((128, 64), nl.uint8, buffer=nl.sbuf)
        st_q = nl.ndarray((128, 32), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        mv_q = nl.ndarray((128, 64), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        nisa.quantize_mx(dst=st_q, src=_load(st_in), dst_scale=packed[0:, :32])
        nisa.quantize_mx(dst=mv_q, src=_load(mv_in), dst_scale=packed[4:, :])
        dst = nl.ndarray((32, 64), nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(dst, st_q, mv_q, packed[0:, :32], packed[4:, :])
        return to_hbm(dst)

    out = sim.run(kernel, st, mv, target="trn3").outputs
    expected = np.einsum(
        "kiq,kjq->ij", st.astype(np.float64).reshape(128, 32, 4), mv.astype(np.float64).reshape(128, 64, 4)
    )
    magnitude = np.einsum(
        "kiq,kjq->ij",
        np.abs(st.astype(np.float64)).reshape(128, 32, 4),
        np.abs(mv.astype(np.float64)).reshape(128, 64, 4),
    )
    assert np.all(np.abs(out - expected) <= 512 * 2**-24 * magnitude)


def test_nc_matmul_mx_accumulates_into_psum():
    rng = np.random.default_rng(3)
    st, _ = _exactly_quantizable(32, 8, rng)

    def kernel(x):
        q = nl.ndarray((32, 8), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        scale = nl.ndarray((4, 8), nl.uint8, buffer=nl.sbuf)
        nisa.quantize_mx(dst=q, src=_load(x), dst_scale=scale)
        dst = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(dst, q, q, scale, scale)
        nisa.nc_matmul_mx(dst, q, q, scale, scale)  # auto-detected: accumulates
        return to_hbm(dst)

    values = st.astype(np.float64).reshape(32, 8, 4)
    gram = np.einsum("kiq,kjq->ij", values, values)
    magnitude = np.einsum("kiq,kjq->ij", np.abs(values), np.abs(values))
    out = sim.run(kernel, st, target="trn3").outputs
    assert np.all(np.abs(out - 2 * gram) <= 2 * 256 * 2**-24 * magnitude)
    assert np.abs(out - gram).max() > 0.1 * np.abs(gram).max()  # not a single product


def test_mx_costs_follow_the_documented_rates():
    from kernels_neuron.cost.hardware import HARDWARE
    from kernels_neuron.cost.timing import engine_cycles

    def kernel():
        src = nl.zeros((128, 2048), nl.bfloat16)
        q = nl.ndarray((128, 512), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        scale = nl.ndarray((128, 512), nl.uint8, buffer=nl.sbuf)
        nisa.quantize_mx(dst=q, src=src, dst_scale=scale)
        dst = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(dst, q[:, 0:128], q, scale[:, 0:128], scale)

    trace = sim.run(kernel, target="trn3").trace
    hw = HARDWARE["trn3"]
    by_op = {i.op: engine_cycles(i, hw) for i in trace}
    assert by_op["quantize_mx"] == 2048 / 4  # four input elements per partition per cycle
    assert by_op["nc_matmul_mx"] == 512  # x4 columns stream at the bf16 matmul rate


@pytest.mark.parametrize(
    "problem, pattern",
    [
        ("trn2", r"nisa\.quantize_mx: target: needs NeuronCore-v4 or newer \(target=trn2\)"),
        ("fp32 source", r"quantize_mx: src: must be float16 or bfloat16 \(dtype=float32\)"),
        ("16 partitions", r"quantize_mx: src: partition dim must be a multiple of 32, at most 128 \(partitions=16\)"),
        ("scale too small", r"dst_scale: too small .*needs_partitions=100, needs_columns=4"),
    ],
)
def test_quantize_mx_rules(problem, pattern):
    def kernel():
        parts = 16 if problem == "16 partitions" else 128
        src = nl.zeros((parts, 16), nl.float32 if problem == "fp32 source" else nl.bfloat16)
        scale = nl.ndarray((64 if problem == "scale too small" else parts, 4), nl.uint8, buffer=nl.sbuf)
        nisa.quantize_mx(nl.ndarray((parts, 4), nl.float8_e5m2_x4, buffer=nl.sbuf), src, scale)

    with pytest.raises(nisa.NkiValidationError, match=pattern):
        sim.run(kernel, target="trn2" if problem == "trn2" else "trn3")


def test_nc_matmul_mx_rules():
    def kernel(problem):
        data = nl.zeros((32, 8), nl.uint32).view(nl.float8_e5m2_x4)
        scale = nl.zeros((4, 8), nl.uint8)
        dst = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
        if problem == "bf16 data":
            nisa.nc_matmul_mx(dst, nl.zeros((32, 8), nl.bfloat16), data, scale, scale)
        elif problem == "column tiling":
            nisa.nc_matmul_mx(dst, data, data, scale, scale, tile_position=(0, 0), tile_size=(32, 64))
        else:
            nisa.nc_matmul_mx(dst, data, data, scale, scale, tile_position=(32, 0), tile_size=(32, 128))

    with pytest.raises(nisa.NkiValidationError, match=r"stationary: must be float8_e5m2_x4, float8_e4m3fn_x4"):
        sim.run(kernel, "bf16 data", target="trn3")
    with pytest.raises(nisa.NkiValidationError, match=r"tile_size: must be \(32, 64 or 128, 128\)"):
        sim.run(kernel, "column tiling", target="trn3")
    sim.run(kernel, "row tile", target="trn3")  # rows 32..63 of the array: legal
