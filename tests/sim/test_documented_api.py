"""AWS's documented NKI API that the simulator gained: each name against the behaviour its API page
states, with the page's own example where it has one (``nki/api/nki/{language,isa}/__init__.py`` and
the ``nki/test`` example files of the aws-neuron-sdk docs). Expected values are computed here with
NumPy from the docs' description, never with the simulator's helpers.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from kernel_io import to_hbm, to_sbuf

from kernels_neuron import sim

sim.install()

import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

BF16 = ml_dtypes.bfloat16


# ---------------------------------------------------------------------------------------------
# modules and constants
# ---------------------------------------------------------------------------------------------
def test_nki_typing_annotations_as_aws_examples_use_them():
    """The average-pool example does ``from nki.typing import tensor``; the nki-library tests use
    ``nt.tensor[n, m]`` and ``nt.mutable_tensor``."""
    import nki.typing as nt
    from nki.typing import tensor

    @nki.jit
    def double(in_tensor: tensor):
        tile: tensor[4, 8] = nl.load(in_tensor)
        return to_hbm(nl.multiply(tile, 2.0))

    np.testing.assert_array_equal(double(np.ones((4, 8), np.float32)), np.full((4, 8), 2.0, np.float32))
    assert repr(nt.tensor[4, 8]) == "tensor[4, 8]"
    assert issubclass(nt.mutable_tensor, nt.tensor)


def test_nki_dtype_module_holds_the_documented_dtypes():
    import nki.dtype as ndt

    assert nki.dtype is ndt
    # Usable as NumPy dtypes, as the nki-library tests do (np.zeros(..., dtype=nt.float8_e4m3)).
    assert np.zeros(2, dtype=ndt.float8_e4m3).dtype == np.dtype(ml_dtypes.float8_e4m3)
    assert ndt.bfloat16 == nl.bfloat16 and ndt.float8_e8m0fnu == nl.float8_e8m0fnu


def test_nki_isa_constants_as_nki_library_imports_them():
    """13 nki-library files do ``from nki.isa.constants import dge_mode, oob_mode``."""
    from nki.isa import constants
    from nki.isa.constants import dge_mode, oob_mode

    assert dge_mode is nisa.dge_mode and oob_mode is nisa.oob_mode and constants.engine is nisa.engine


def test_float8_e8m0fnu_holds_powers_of_two():
    scales = np.array([[0.25, 1.0, 3.0, 1024.0]], np.float32)

    @nki.jit
    def kernel(x):
        tile = nl.ndarray(x.shape, nl.float8_e8m0fnu, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)  # converts through fp32 to the exponent-only format
        back = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=back, src=tile)
        return to_hbm(back)

    out = kernel(scales)
    assert set(np.log2(out).ravel()) <= set(range(-127, 128))  # every value a power of two
    np.testing.assert_array_equal(out[0, [0, 1, 3]], [0.25, 1.0, 1024.0])


def test_memory_region_members_are_buffers():
    @nki.jit
    def kernel(x):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.MemoryRegion.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        assert nl.is_sbuf(tile.buffer)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.MemoryRegion.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(kernel(x), x)
    assert [m.value for m in nl.MemoryRegion] == ["sbuf", "psum", "private_hbm", "shared_hbm"]


@pytest.mark.parametrize(
    "target, sbuf_per_partition", [("trn1", 192 * 1024), ("trn2", 224 * 1024), ("trn3", 256 * 1024)]
)
def test_tile_size_bytes_aware_constants(target, sbuf_per_partition):
    seen = {}

    def kernel():
        ts = nl.tile_size
        seen.update(
            psum_bank_fmax=ts.psum_bank_fmax,
            psum_bank_fmax_bytes=ts.psum_bank_fmax_bytes,
            psum_num_banks=ts.psum_num_banks,
            sbuf_size_bytes=ts.sbuf_size_bytes,
            sbuf_fmax=ts.sbuf_fmax,
            sbuf_fmax_bytes=ts.sbuf_fmax_bytes,
        )

    sim.run(kernel, target=target)
    assert seen == {
        "psum_bank_fmax": 512,
        "psum_bank_fmax_bytes": 2048,
        "psum_num_banks": 8,
        "sbuf_size_bytes": 128 * sbuf_per_partition,
        "sbuf_fmax": sbuf_per_partition // 4,
        "sbuf_fmax_bytes": sbuf_per_partition,
    }


@pytest.mark.parametrize("target, banks", [("trn1", 8), ("trn2", 7), ("trn3", 7)])
def test_psum_num_banks_keeps_bank_7_for_pe_lowered_dma_transposes(monkeypatch, target, banks):
    monkeypatch.setenv("NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE", "true")
    seen = []
    sim.run(lambda: seen.append(nl.tile_size.psum_num_banks), target=target)
    assert seen == [banks]


def test_get_nc_sub_version_is_the_first_revision():
    seen = []
    sim.run(lambda: seen.append(nisa.get_nc_sub_version()))
    assert seen == [0]


# ---------------------------------------------------------------------------------------------
# nki.language
# ---------------------------------------------------------------------------------------------
def test_softmax_over_two_axes():
    x = np.random.default_rng(1).standard_normal((4, 3, 5)).astype(np.float32)

    @nki.jit
    def kernel(t):
        return to_hbm(nl.softmax(nl.load(t), axis=[1, 2]))

    e = np.exp(x.astype(np.float64) - x.max(axis=(1, 2), keepdims=True))
    np.testing.assert_allclose(kernel(x), e / e.sum(axis=(1, 2), keepdims=True), rtol=1e-5, atol=1e-7)


def test_softmax_of_the_last_axis_of_a_3d_tile_keeps_the_middle_axis_apart():
    x = np.random.default_rng(2).standard_normal((4, 3, 5)).astype(np.float32)

    @nki.jit
    def kernel(t):
        return to_hbm(nl.softmax(nl.load(t), axis=2))

    e = np.exp(x.astype(np.float64) - x.max(axis=2, keepdims=True))
    np.testing.assert_allclose(kernel(x), e / e.sum(axis=2, keepdims=True), rtol=1e-5, atol=1e-7)


def test_softmax_docs_example_uniform_input_gives_uniform_output():
    @nki.jit
    def kernel():
        a = nl.full((128, 512), 1.0, dtype=nl.float32, buffer=nl.sbuf)
        return to_hbm(nl.softmax(a, axis=1))

    np.testing.assert_allclose(kernel(), np.full((128, 512), 1 / 512), rtol=1e-6)


@pytest.mark.parametrize("axis", [2, [1, 2]])
def test_var_keeps_the_reduced_dims(axis):
    x = (np.random.default_rng(3).standard_normal((8, 3, 16)) * 3 + 2).astype(np.float32)
    axes = (2,) if axis == 2 else (1, 2)

    @nki.jit
    def kernel(t):
        return to_hbm(nl.var(nl.load(t), axis=axis))

    out = kernel(x)
    assert out.shape == x.var(axis=axes, keepdims=True).shape
    np.testing.assert_allclose(out, x.astype(np.float64).var(axis=axes, keepdims=True), rtol=1e-5)


def test_all_is_a_logical_and_over_the_axis():
    x = np.ones((4, 6), np.float32)
    x[1, 3] = 0.0
    x[2, :] = 0.0

    @nki.jit
    def kernel(t):
        return to_hbm(nl.all(nl.load(t), axis=1))

    np.testing.assert_array_equal(kernel(x).reshape(-1), [1.0, 0.0, 0.0, 1.0])


def test_rms_norm_docs_example_and_a_general_case():
    @nki.jit
    def docs_example():
        x = nl.full((128, 512), 2.0, dtype=nl.float32, buffer=nl.sbuf)
        w = nl.full((128, 512), 1.0, dtype=nl.float32, buffer=nl.sbuf)
        return to_hbm(nl.rms_norm(x, w, axis=1, n=512))

    np.testing.assert_allclose(docs_example(), 1.0, rtol=1e-6)

    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    w = rng.standard_normal((16, 64)).astype(np.float32)

    @nki.jit
    def kernel(xs, ws):
        return to_hbm(nl.rms_norm(nl.load(xs), nl.load(ws), axis=1, n=64, epsilon=1e-3))

    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + 1e-3) * w
    np.testing.assert_allclose(kernel(x, w), expected, rtol=1e-5, atol=1e-6)


def test_random_seed_and_rand_docs_example():
    """The same seed gives the same values; the docs check it with ``assert nl.equal(a, b)``."""

    @nki.jit
    def kernel():
        seed = nl.full((1, 1), 42, dtype=nl.int32, buffer=nl.sbuf)
        nl.random_seed(seed)
        a = nl.rand((128, 512), dtype=nl.float32)
        nl.random_seed(seed)
        b = nl.rand((128, 512), dtype=nl.float32)
        assert nl.equal(a, b)
        c = nl.rand((128, 512), dtype=nl.float32)
        return to_hbm(a), to_hbm(c)

    a, c = kernel()
    assert 0.0 <= a.min() and a.max() < 1.0
    assert 0.45 < a.mean() < 0.55  # uniform on [0, 1)
    assert not np.array_equal(a, c)  # the stream moves on


def test_rand_into_hbm():
    @nki.jit
    def kernel():
        out = nl.rand((4, 8), dtype=nl.bfloat16, buffer=nl.shared_hbm)
        assert out.buffer == nl.shared_hbm
        return out

    out = kernel().astype(np.float32)
    assert out.shape == (4, 8) and 0.0 <= out.min() and out.max() <= 1.0


def test_an_assert_on_a_tile_fails_when_an_element_is_zero():
    @nki.jit
    def kernel(x, y):
        assert nl.equal(nl.load(x), nl.load(y))
        return x

    x = np.ones((2, 4), np.float32)
    y = x.copy()
    kernel(x, y)
    y[1, 2] = 5.0
    with pytest.raises(AssertionError):
        kernel(x, y)


def test_gather_flattened_docs_example():
    """nki/test/test_nki_nl_gather_flattened.py: every 5th element of each row. The docs' example fills
    the indices one element at a time (``indices[i, j] = j * 5``), single-partition writes at
    partitions 1..31 that the documented start-partition rule (trainium_inferentia2_arch.rst: an
    access of at most 32 partitions starts at 0/32/64/96) forbids and the simulator enforces; the
    same indices come from one iota here."""

    @nki.jit
    def kernel(data_in):
        data = nl.load(data_in)
        indices = nl.ndarray((32, 10), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.iota(indices, [[5, 10]], offset=0, channel_multiplier=0)
        return to_hbm(nl.gather_flattened(data=data, indices=indices))

    data = np.random.default_rng(5).standard_normal((32, 64)).astype(np.float32)
    np.testing.assert_array_equal(kernel(data), data[:, ::5][:, :10])


def test_gather_flattened_takes_int32_indices_and_casts_the_result():
    data = np.arange(24, dtype=np.float32).reshape(2, 12)
    idx = np.array([[11, 0, 3], [2, 2, 7]], np.int32)

    @nki.jit
    def kernel(d, i):
        return to_hbm(nl.gather_flattened(nl.load(d), nl.load(i), dtype=nl.bfloat16))

    out = kernel(data, idx)
    assert out.dtype == BF16
    np.testing.assert_array_equal(out.astype(np.float32), np.take_along_axis(data, idx, axis=1))


def test_fori_loop_step():
    visited = []
    sim.run(lambda: nl.fori_loop(1, 10, visited.append, step=3))
    assert visited == [1, 4, 7]
    with pytest.raises(nisa.NkiValidationError, match=r"nl\.fori_loop: step: must be a compile-time positive"):
        sim.run(lambda: nl.fori_loop(0, 4, visited.append, step=0))


def test_shared_constant_from_an_npy_file(tmp_path):
    path = tmp_path / "table.npy"
    table = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(path, table)

    @nki.jit
    def kernel():
        constant = nl.shared_constant(str(path))
        assert constant.buffer == nl.shared_hbm
        return to_hbm(to_sbuf(constant))

    np.testing.assert_array_equal(kernel(), table)


def test_shared_identity_matrix_docs_example_in_sbuf_and_transposed():
    @nki.jit
    def kernel(expected_tensor):
        identity = nl.shared_identity_matrix(n=128, dtype=nl.float32)
        assert identity.buffer == nl.sbuf
        expected = nl.load(expected_tensor[0:128, 0:128])
        assert nl.equal(identity, expected)
        return to_hbm(identity), to_hbm(nl.transpose(identity))

    eye = np.eye(128, dtype=np.float32)
    identity, transposed = kernel(eye)
    np.testing.assert_array_equal(identity, eye)
    np.testing.assert_array_equal(transposed, eye)


def test_shared_identity_matrix_into_dst_and_its_limits():
    @nki.jit
    def kernel():
        dst = nl.ndarray((16, 16), nl.bfloat16, buffer=nl.sbuf)
        returned = nl.shared_identity_matrix(16, dtype=nl.bfloat16, dst=dst)
        assert returned is dst
        return to_hbm(dst)

    np.testing.assert_array_equal(kernel().astype(np.float32), np.eye(16))
    with pytest.raises(nisa.NkiValidationError, match=r"n rows exceed the partition count \(n=200, limit=128\)"):
        sim.run(lambda: nl.shared_identity_matrix(200))
    with pytest.raises(nisa.NkiValidationError, match=r"dst: must be an \[n, n\] SBUF tile for n=8.*buffer=psum"):
        sim.run(lambda: nl.shared_identity_matrix(8, dst=nl.ndarray((8, 8), nl.float32, buffer=nl.psum)))


# ---------------------------------------------------------------------------------------------
# tensor views
# ---------------------------------------------------------------------------------------------
def test_rearrange_docs_example_and_a_merge():
    x = np.arange(128 * 24, dtype=np.float32).reshape(128, 24)

    @nki.jit
    def kernel(t):
        tile = nl.load(t)
        view = tile.rearrange(("b", ("h", "w")), ("b", "w", "h"), {"h": 4})
        assert view.shape == (128, 6, 4)
        copied = nl.ndarray(view.shape, view.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=copied, src=view)
        merged = copied.rearrange(("b", "w", "h"), ("b", ("w", "h")))
        assert merged.shape == (128, 24)
        return to_hbm(copied)

    np.testing.assert_array_equal(kernel(x), x.reshape(128, 4, 6).transpose(0, 2, 1))


def test_vector_select_docs_shape_and_gathered_rows():
    table = np.random.default_rng(6).standard_normal((64, 16, 8)).astype(np.float32)
    rows = np.random.default_rng(7).integers(0, 64, size=(128, 1)).astype(np.int32)

    @nki.jit
    def kernel(hbm_t, offsets_in):
        offsets = nl.load(offsets_in)
        view = hbm_t.vector_select(0, offsets)
        assert view.shape == (128, 16, 8) and view.is_indirect
        tile = nl.ndarray(view.shape, view.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=view)
        return to_hbm(tile)

    np.testing.assert_array_equal(kernel(table, rows), table[rows[:, 0]])


def test_vector_select_rules():
    def on_chip():
        tile = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        tile.vector_select(0, nl.zeros((4, 1), nl.int32))

    with pytest.raises(nisa.NkiValidationError, match="vector_select applies to HBM tensors only"):
        sim.run(on_chip)

    def second_dim():
        table = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        table.vector_select(1, nl.zeros((4, 1), nl.int32))

    with pytest.raises(nisa.NkiValidationError, match=r"vector_select: dim: must be 0 \(dim=1\)"):
        sim.run(second_dim)


# ---------------------------------------------------------------------------------------------
# nki.isa
# ---------------------------------------------------------------------------------------------
def test_instructions_return_handles_with_dependencies():
    handles = {}

    def kernel():
        a = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        b = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        handles["first"] = nisa.memset(dst=a, value=1.0)
        handles["second"] = nisa.memset(dst=b, value=2.0)
        handles["second"].depends_on(handles["first"])

    result = sim.run(kernel)
    first, second = handles["first"], handles["second"]
    assert isinstance(first, nisa.NkiInstruction) and first.instruction.op == "memset"
    assert result.trace.instructions[1].attrs["depends_on"] == [0]
    assert second.depends_on(first) is second
    with pytest.raises(nisa.NkiValidationError, match="a producer must come earlier in program order"):
        first.depends_on(second)


def test_depends_on_orders_the_cost_models_schedule():
    from kernels_neuron.cost.hardware import HARDWARE
    from kernels_neuron.cost.schedule import schedule

    def kernel(with_edge):
        a = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf)
        b = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf)
        first = nisa.memset(dst=a, value=1.0, engine=nisa.vector_engine)
        second = nisa.memset(dst=b, value=2.0, engine=nisa.gpsimd_engine)
        if with_edge:
            second.depends_on(first)

    hw = HARDWARE["trn2"]
    free = schedule(sim.run(kernel, False).trace.instructions, hw).slots
    ordered = schedule(sim.run(kernel, True).trace.instructions, hw).slots
    assert free[1].start == 0.0  # independent engines overlap...
    assert ordered[1].start >= ordered[0].end > 0.0  # ...unless told to wait


def test_depends_on_kind_runtime_waits_for_the_producer_and_schedule_only_for_its_issue():
    """NKI 2.33's ``kind=``: ``dependency.runtime`` is a semaphore wait (as omitting ``kind`` was);
    ``dependency.schedule`` orders issue only, so work on another engine may overlap the producer."""
    from kernels_neuron.cost.hardware import HARDWARE
    from kernels_neuron.cost.schedule import schedule

    def kernel(kind):
        x = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf)
        a = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf)
        b = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=x, value=0.5, engine=nisa.gpsimd_engine)
        first = nisa.activation(dst=a, op=nl.exp, data=x)  # ScalarE, after the memset
        second = nisa.memset(dst=b, value=2.0, engine=nisa.vector_engine)  # free to start at 0
        if kind != "none":
            second.depends_on(first, kind=kind)

    hw = HARDWARE["trn2"]
    slots = {
        kind: schedule(sim.run(kernel, kind).trace.instructions, hw).slots for kind in ("none", "runtime", "schedule")
    }
    producer = slots["none"][1]
    assert slots["none"][2].start == 0.0 < producer.start
    assert slots["runtime"][2].start >= producer.end
    assert producer.start <= slots["schedule"][2].start < producer.end
    scheduled = sim.run(kernel, "schedule").trace.instructions[2].attrs
    assert scheduled["issued_after"] == [1] and "depends_on" not in scheduled
    assert sim.run(kernel, nisa.dependency.runtime).trace.instructions[2].attrs["depends_on"] == [1]
    with pytest.raises(
        nisa.NkiValidationError,
        match=r"depends_on: kind: must be nki.isa.dependency.runtime or .schedule \(kind=hard\)",
    ):
        sim.run(kernel, "hard")


def test_nonzero_with_count_docs_example():
    """The reference's example row: [0, 1, 1, 0, 0, 1, 0, 0] with index_offset=16."""

    @nki.jit
    def nonzero_with_count_kernel(in_tensor):
        in_shape = in_tensor.shape
        in_tile = nl.ndarray(in_shape, dtype=in_tensor.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=in_tile, src=in_tensor)
        out_tile = nl.ndarray((in_shape[0], in_shape[1] + 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=out_tile, value=7)
        nisa.nonzero_with_count(dst=out_tile, src=in_tile, index_offset=16, padding_val=-1)
        out_tensor = nl.ndarray(out_tile.shape, dtype=out_tile.dtype, buffer=nl.hbm)
        nisa.dma_copy(dst=out_tensor, src=out_tile)
        return out_tensor

    x = np.zeros((32, 8), np.float32)
    x[0] = [0, 1, 1, 0, 0, 1, 0, 0]
    x[1] = 1.0  # not a core's first partition: neither read nor written
    x[16, 7] = 2.0
    out = nonzero_with_count_kernel(x)
    np.testing.assert_array_equal(out[0], [17, 18, 21, -1, -1, -1, -1, -1, 3])
    np.testing.assert_array_equal(out[1], [7] * 9)
    np.testing.assert_array_equal(out[16], [23, -1, -1, -1, -1, -1, -1, -1, 1])


def test_nonzero_with_count_rules():
    def kernel(target_dtype, extra):
        src = nl.zeros((16, 8), nl.float32)
        nisa.nonzero_with_count(dst=nl.ndarray((16, 8 + extra), target_dtype, buffer=nl.sbuf), src=src)

    with pytest.raises(nisa.NkiValidationError, match=r"nonzero_with_count: target: needs NeuronCore-v3"):
        sim.run(kernel, nl.int32, 1, target="trn1")
    with pytest.raises(nisa.NkiValidationError, match=r"dst: dtype must be int32 \(dtype=float32\)"):
        sim.run(kernel, nl.float32, 1)
    with pytest.raises(nisa.NkiValidationError, match=r"one more element than src per partition \(dst=8, src=8\)"):
        sim.run(kernel, nl.int32, 0)


def test_sequence_bounds_docs_example():
    """nki/test/test_nki_isa_sequence_bounds.py's worked example."""

    @nki.jit
    def kernel(segment_ids):
        m, n = segment_ids.shape
        out_tile = nl.ndarray([m, 2, n], dtype=segment_ids.dtype, buffer=nl.sbuf)
        nisa.sequence_bounds(dst=out_tile, segment_ids=nl.load(segment_ids))
        return to_hbm(out_tile)

    out = kernel(np.array([[0, 1, 1, 2, 2, 2, 0, 3, 3]], dtype=np.int32))
    np.testing.assert_array_equal(out, [[[9, 1, 1, 3, 3, 3, 9, 7, 7], [-1, 3, 3, 6, 6, 6, -1, 9, 9]]])


def _sequence_bounds_reference(sequence):
    """The docs' NumPy reference, restated."""
    n = len(sequence)
    lo, hi = np.zeros(n), np.zeros(n)
    for i in range(n):
        lo[i] = n if sequence[i] == 0 else lo[i - 1] if i and sequence[i] == sequence[i - 1] else i
    for i in reversed(range(n)):
        hi[i] = -1 if sequence[i] == 0 else hi[i + 1] if i < n - 1 and sequence[i] == sequence[i + 1] else i + 1
    return np.stack([lo, hi])


def test_sequence_bounds_random_sorted_segments_in_fp32():
    ids = np.sort(np.random.default_rng(0).integers(0, 32, size=32)).reshape(1, 32).astype(np.float32)

    @nki.jit
    def kernel(segment_ids):
        out_tile = nl.ndarray([1, 2, 32], dtype=nl.float32, buffer=nl.sbuf)
        nisa.sequence_bounds(dst=out_tile, segment_ids=nl.load(segment_ids))
        return to_hbm(out_tile)

    np.testing.assert_array_equal(kernel(ids)[0], _sequence_bounds_reference(ids[0]))


def test_local_gather_docs_example():
    """nki/test/test_nki_isa_local_gather.py: 4 elements per index, 64 valid indices per core."""
    rng = np.random.default_rng(8)
    src_buffer = (rng.random((128, 512, 4)) * 100).astype(np.float32)
    index_per_core = rng.integers(0, 512, size=(16, 4)).astype(np.uint16)
    index = np.tile(index_per_core, (8, 1))

    @nki.jit
    def kernel(src, idx):
        output_tile = nl.ndarray((128, 4, 16, 4), nl.float32, buffer=nl.sbuf)
        nisa.local_gather(output_tile, nl.load(src), nl.load(idx), 4, 64)
        return to_hbm(output_tile)

    out = kernel(src_buffer, index * 4)
    expected = np.empty((128, 64, 4), np.float32)
    for core in range(8):
        rows = slice(16 * core, 16 * core + 16)
        expected[rows] = np.take(src_buffer[rows], index[rows].flatten(order="F")[:64], axis=1)
    np.testing.assert_array_equal(out, expected.reshape(128, 4, 16, 4))


def test_local_gather_rules():
    def kernel(index_dtype, per_index, parts):
        src = nl.zeros((parts, 64), nl.float32)
        idx = nl.zeros((parts, 2), index_dtype)
        nisa.local_gather(nl.ndarray((parts, 32 * per_index), nl.float32, buffer=nl.sbuf), src, idx, per_index)

    with pytest.raises(nisa.NkiValidationError, match=r"local_gather: index: dtype must be uint16 \(dtype=int32\)"):
        sim.run(kernel, nl.int32, 1, 16)
    with pytest.raises(nisa.NkiValidationError, match=r"num_elem_per_idx: must be one of .*\(num_elem_per_idx=3\)"):
        sim.run(kernel, nl.uint16, 3, 16)
    with pytest.raises(nisa.NkiValidationError, match=r"multiple of 16 .*\(partitions=8\)"):
        sim.run(kernel, nl.uint16, 1, 8)


def test_topk_docs_example_shapes_and_the_largest_values():
    n, k = 42, 8
    values = np.random.default_rng(9).permutation(64)[:48].astype(BF16).reshape(16, 3, order="F")

    @nki.jit
    def topk_kernel(in_tensor):
        par_dim = in_tensor.shape[0]
        src = nl.ndarray((par_dim, (n + 15) // 16), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=src, src=in_tensor)
        val_dst = nl.ndarray((par_dim, k), dtype=nl.bfloat16, buffer=nl.sbuf)
        idx_dst = nl.ndarray((par_dim, k), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.topk(val_dst=val_dst, idx_dst=idx_dst, src=src, n=n)
        return to_hbm(val_dst), to_hbm(idx_dst)

    result = sim.run(topk_kernel, values)
    top, positions = result.outputs
    snake = values.flatten(order="F")[:n].astype(np.float32)  # position s: partition s % 16, column s // 16
    expected = np.sort(snake)[-k:]
    for p in range(16):
        np.testing.assert_array_equal(top[p].astype(np.float32), expected)  # ascending
        np.testing.assert_array_equal(snake[positions[p].astype(np.int64)], expected)
    (inst,) = [i for i in result.trace if i.op == "topk"]
    assert (inst.engine, inst.attrs["n"], inst.attrs["k"]) == ("gpsimd", n, k)


def test_topk_cost_is_the_documented_4n_plus_k_cycles():
    from kernels_neuron.cost.hardware import HARDWARE
    from kernels_neuron.cost.timing import engine_cycles

    def kernel():
        src = nl.zeros((16, 64), nl.bfloat16)
        nisa.topk(
            val_dst=nl.ndarray((16, 32), nl.bfloat16, buffer=nl.sbuf),
            idx_dst=nl.ndarray((16, 32), nl.uint32, buffer=nl.sbuf),
            src=src,
            n=1000,
        )

    (inst,) = [i for i in sim.run(kernel).trace if i.op == "topk"]
    assert engine_cycles(inst, HARDWARE["trn2"]) == 4 * 1000 + 32


def test_topk_rules():
    def kernel(n, k, src_dtype):
        nisa.topk(
            val_dst=nl.ndarray((16, k), nl.bfloat16, buffer=nl.sbuf),
            idx_dst=nl.ndarray((16, k), nl.uint32, buffer=nl.sbuf),
            src=nl.zeros((16, 8), src_dtype),
            n=n,
        )

    with pytest.raises(nisa.NkiValidationError, match=r"topk: n: must be in \[8, 65536\) \(n=4\)"):
        sim.run(kernel, 4, 2, nl.bfloat16)
    with pytest.raises(nisa.NkiValidationError, match=r"K \(its free size\) .* at most n \(k=20, n=10\)"):
        sim.run(kernel, 10, 20, nl.bfloat16)
    with pytest.raises(nisa.NkiValidationError, match=r"free dim must be at least ceil\(n / 16\) \(free=8, n=200\)"):
        sim.run(kernel, 200, 4, nl.bfloat16)
    with pytest.raises(nisa.NkiValidationError, match=r"topk: src: dtype must be bfloat16 \(dtype=float32\)"):
        sim.run(kernel, 16, 4, nl.float32)


def _xorwow(state, count):
    """Marsaglia's XORWOW, written out for the test: five xorshift words and a Weyl counter."""
    x, y, z, w, v, d = (int(s) for s in state)
    out = []
    for _ in range(count):
        t = x ^ (x >> 2)
        x, y, z, w = y, z, w, v
        v = (v ^ ((v << 4) & 0xFFFFFFFF)) ^ (t ^ ((t << 1) & 0xFFFFFFFF))
        d = (d + 362437) & 0xFFFFFFFF
        out.append((v + d) & 0xFFFFFFFF)
    return out, [x, y, z, w, v, d]


def test_rand_set_state_get_state_and_rng_draws_from_the_state():
    seeds = np.random.default_rng(10).integers(1, 2**32, size=(16, 6), dtype=np.uint64).astype(np.uint32)

    @nki.jit
    def kernel(seeds_in):
        state = to_sbuf(seeds_in)
        nisa.rand_set_state(src_seeds=state)
        before = nl.ndarray((16, 6), nl.uint32, buffer=nl.sbuf)
        nisa.rand_get_state(dst=before)
        bits = nl.ndarray((16, 3), nl.uint32, buffer=nl.sbuf)
        nisa.rng(dst=bits, engine=nisa.gpsimd_engine)
        after = nl.ndarray((16, 6), nl.uint32, buffer=nl.sbuf)
        nisa.rand_get_state(dst=after)
        return to_hbm(before), to_hbm(bits), to_hbm(after)

    before, bits, after = kernel(seeds)
    np.testing.assert_array_equal(before, seeds)
    for lane in range(16):
        expected_bits, expected_state = _xorwow(seeds[lane], 3)
        np.testing.assert_array_equal(bits[lane], expected_bits)
        np.testing.assert_array_equal(after[lane], expected_state)


def test_rand_state_rules():
    def kernel(engine, words, dtype=nl.uint32):
        nisa.rand_set_state(src_seeds=nl.zeros((4, words), dtype), engine=engine)

    with pytest.raises(nisa.NkiValidationError, match=r"rand_set_state: target: needs NeuronCore-v3.*trn1"):
        sim.run(kernel, nisa.gpsimd_engine, 6, target="trn1")
    with pytest.raises(nisa.NkiValidationError, match=r"rand_set_state: engine: vector cannot run"):
        sim.run(kernel, nisa.vector_engine, 24, target="trn2")
    sim.run(kernel, nisa.vector_engine, 24, target="trn3")  # four generators per lane on NeuronCore-v4
    with pytest.raises(nisa.NkiValidationError, match=r"6 state words per partition on the gpsimd engine \(words=24\)"):
        sim.run(kernel, nisa.gpsimd_engine, 24)
    with pytest.raises(nisa.NkiValidationError, match=r"src_seeds: must be uint32 \(dtype=int32\)"):
        sim.run(kernel, nisa.gpsimd_engine, 6, nl.int32)


def test_tensor_partition_reduce_average():
    x = np.random.default_rng(11).standard_normal((32, 8)).astype(np.float32)

    @nki.jit
    def kernel(t):
        out = nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf)
        nisa.tensor_partition_reduce(dst=out, op=nl.average, data=nl.load(t))
        return to_hbm(out)

    np.testing.assert_allclose(kernel(x)[0], x.astype(np.float64).mean(axis=0), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("op, reference", [("relu", lambda x: np.maximum(x, 0)), ("square", np.square)])
@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_tensor_scalar_unary_alu_operators(op, reference, target):
    """AWS's operator table lists square and relu as unary arithmetic ALU operators."""
    x = np.random.default_rng(12).standard_normal((8, 16)).astype(np.float32)

    def kernel(t):
        out = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=out, data=to_sbuf(t), op0=getattr(nl, op), operand0=0.0, op1=nl.multiply, operand1=2.0)
        return to_hbm(out)

    np.testing.assert_allclose(sim.run(kernel, x, target=target).outputs, 2 * reference(x), rtol=1e-6)


def test_tensor_scalar_reduce_negates_only_the_reduction_result():
    x = np.random.default_rng(13).standard_normal((8, 16)).astype(np.float32)

    @nki.jit
    def kernel(t):
        tile = nl.load(t)
        out = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        res = nl.ndarray((8, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(
            dst=out, data=tile, op0=nl.multiply, operand0=3.0, reduce_op=nl.add, reduce_res=res, reduce_res_negate=True
        )
        return to_hbm(out), to_hbm(res)

    out, res = kernel(x)
    np.testing.assert_allclose(out, 3 * x, rtol=1e-6)
    np.testing.assert_allclose(res[:, 0], -(3 * x.astype(np.float64)).sum(axis=1), rtol=1e-5, atol=1e-5)


def test_dma_copy_with_hardware_dge_converts_dtypes():
    x = np.random.default_rng(14).standard_normal((16, 32)).astype(np.float32)

    @nki.jit
    def kernel(t):
        tile = nl.ndarray(t.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=t, dge_mode=nisa.dge_mode.hwdge)
        return to_hbm(tile)

    np.testing.assert_array_equal(kernel(x), x.astype(BF16))


@pytest.mark.parametrize("shape", [(16, 128), (16, 40), (1, 16, 64), (4, 4, 128), (2, 3, 8, 32)])
def test_dma_transpose_hardware_dge_shapes_of_the_api_reference(shape):
    x = np.random.default_rng(15).standard_normal(shape).astype(BF16)
    axes = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}[len(shape)]

    @nki.jit
    def kernel(src):
        dst = nl.ndarray(np.transpose(x, axes).shape, src.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=dst, src=src, axes=axes, dge_mode=nisa.dge_mode.hwdge)
        return to_hbm(dst)

    np.testing.assert_array_equal(kernel(x), np.transpose(x, axes))


def test_dma_compute_gather_read_modify_write():
    """dst(SB) = dst(SB) + src(HBM)[indices], indices from an SBUF vector_offset tile."""
    rng = np.random.default_rng(16)
    table = rng.standard_normal((40, 8)).astype(np.float32)
    acc = rng.standard_normal((16, 8)).astype(np.float32)
    rows = rng.permutation(40)[:16].reshape(16, 1).astype(np.int32)

    @nki.jit
    def kernel(table_in, acc_in, rows_in):
        dst = to_sbuf(acc_in)
        gathered = table_in.ap([[8, 16], [1, 8]], offset=0, vector_offset=to_sbuf(rows_in), indirect_dim=0)
        nisa.dma_compute(dst=dst, srcs=[gathered, dst], reduce_op=nl.add)
        return to_hbm(dst)

    np.testing.assert_allclose(kernel(table, acc, rows), acc + table[rows[:, 0]], rtol=1e-6)


def test_dma_compute_scatter_read_modify_write_and_skipped_indices():
    """dst(HBM)[indices] = dst(HBM)[indices] + src(SB); with oob_mode=skip an out-of-range row is left alone."""
    rng = np.random.default_rng(17)
    table = rng.standard_normal((40, 8)).astype(np.float32)
    update = rng.standard_normal((16, 8)).astype(np.float32)
    rows = rng.permutation(40)[:16].reshape(16, 1).astype(np.int32)
    rows[5, 0] = 1000

    @nki.jit
    def kernel(table_in, update_in, rows_in):
        out = nl.ndarray(table_in.shape, table_in.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=table_in)
        target = out.ap([[8, 16], [1, 8]], offset=0, vector_offset=to_sbuf(rows_in), indirect_dim=0)
        nisa.dma_compute(dst=target, srcs=[target, to_sbuf(update_in)], reduce_op=nl.add, oob_mode=nisa.oob_mode.skip)
        return out

    expected = table.copy()
    inside = rows[:, 0] < 40
    expected[rows[inside, 0]] += update[inside]
    np.testing.assert_allclose(kernel(table, update, rows), expected, rtol=1e-6)


def test_dma_compute_read_modify_write_rules():
    def kernel(problem):
        table = nl.ndarray((40, 8), nl.float32, buffer=nl.shared_hbm)
        idx = nl.zeros((16, 1), nl.int32)
        gathered = table.ap([[8, 16], [1, 8]], offset=0, vector_offset=idx, indirect_dim=0)
        dst = nl.zeros((16, 8), nl.float32)
        other = nl.zeros((16, 8), nl.float32)
        if problem == "three sources":
            nisa.dma_compute(dst=dst, srcs=[gathered, dst, dst], reduce_op=nl.add)
        elif problem == "not unique":
            nisa.dma_compute(dst=dst, srcs=[gathered, dst], reduce_op=nl.add, unique_indices=False)
        else:
            nisa.dma_compute(dst=dst, srcs=[gathered, other], reduce_op=nl.add)

    with pytest.raises(nisa.NkiValidationError, match=r"exactly 2 sources \(count=3\)"):
        sim.run(kernel, "three sources")
    with pytest.raises(nisa.NkiValidationError, match=r"unique_indices: must be True with vector_offset"):
        sim.run(kernel, "not unique")
    with pytest.raises(nisa.NkiValidationError, match=r"other source must be dst itself"):
        sim.run(kernel, "other source")
