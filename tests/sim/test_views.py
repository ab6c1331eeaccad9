"""Tensor views against NumPy: data goes into HBM, comes back through a view with dma_copy.

Each property builds a view in a kernel (of the HBM argument itself, or of an SBUF copy of it),
DMAs it into a fresh HBM tensor and compares with the NumPy equivalent. Distinct values
everywhere (``arange``) make any misplaced element show. Writes through views are checked the
other way round: write through the view, read back the whole tensor.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kernels_neuron import sim
from kernels_neuron.sim import isa as nisa
from kernels_neuron.sim import language as nl

BF16 = ml_dtypes.bfloat16
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def arange(shape, dtype=np.float32) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape).astype(dtype)


def through_view(x: np.ndarray, make_view, buffer: str = "hbm"):
    """DMA ``make_view(t)`` into a new HBM tensor, where ``t`` holds ``x`` in HBM or SBUF."""

    def kernel(x):
        src = x
        if buffer == "sbuf":
            src = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=src, src=x)
        view = make_view(src)
        out = nl.ndarray(view.shape, view.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=view)
        return out

    return sim.run(kernel, x).outputs


def same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# -- strategies ---------------------------------------------------------------------------------
def shapes(min_dims=2, max_dims=4, max_side=6):
    return st.lists(st.integers(1, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


@st.composite
def index_keys(draw, shape, on_chip):
    """(key for the simulator, equivalent full NumPy key) over ``shape``."""
    full = []
    for dim, n in enumerate(shape):
        kind = draw(st.sampled_from(["int", "slice", "ds", "all"]))
        if kind == "int":
            full.append(draw(st.integers(-n, n - 1)))
        elif kind == "slice":
            start = draw(st.integers(0, n - 1))
            stop = draw(st.integers(start + 1, n))
            step = 1 if (on_chip and dim == 0) else draw(st.integers(1, 3))
            if draw(st.booleans()):  # the same slice spelt with a negative start / open stop
                full.append(slice(start - n, None if stop == n else stop, step))
            else:
                full.append(slice(start, stop, step))
        elif kind == "ds":
            start = draw(st.integers(0, n - 1))
            full.append(nl.ds(start, draw(st.integers(1, n - start))))
        else:
            full.append(slice(None))
    numpy_key = tuple(k.as_slice() if isinstance(k, type(nl.ds(0, 1))) else k for k in full)
    form = draw(st.sampled_from(["full", "prefix", "ellipsis"]))
    key = list(full)
    if form == "prefix":
        while key and key[-1] == slice(None):
            key.pop()
    elif form == "ellipsis":
        alls = [i for i, k in enumerate(full) if k == slice(None)]
        i = draw(st.sampled_from(alls)) if alls else draw(st.integers(0, len(full)))
        j = i
        while j < len(full) and full[j] == slice(None):
            j += 1
        key = full[:i] + [Ellipsis] + full[j:]
    return tuple(key), numpy_key


def on_chip_shape(shape, numpy_key) -> tuple[int, ...]:
    """NKI's rule: the partition dim always stays; free ints drop, but the last stays if all are ints."""
    out = []
    ints = [isinstance(k, int) for k in numpy_key]
    for dim, (n, k) in enumerate(zip(shape, numpy_key)):
        if isinstance(k, int):
            if dim == 0 or (dim == len(shape) - 1 and all(ints[1:])):
                out.append(1)
        else:
            out.append(len(range(*k.indices(n))))
    return tuple(out)


# -- indexing -----------------------------------------------------------------------------------
@PROPERTY
@given(data=st.data(), shape=shapes())
def test_hbm_indexing_matches_numpy(data, shape):
    key, numpy_key = data.draw(index_keys(shape, on_chip=False))
    x = arange(shape)
    out = through_view(x, lambda t: t[key])
    expected = x[numpy_key]
    assert out.shape == expected.shape
    np.testing.assert_array_equal(out, expected)


@PROPERTY
@given(data=st.data(), shape=shapes())
def test_sbuf_indexing_matches_numpy_and_stays_2d(data, shape):
    key, numpy_key = data.draw(index_keys(shape, on_chip=True))
    x = arange(shape)
    out = through_view(x, lambda t: t[key], "sbuf")
    expected_shape = on_chip_shape(shape, numpy_key)
    assert out.shape == expected_shape and len(expected_shape) >= 2
    np.testing.assert_array_equal(out, x[numpy_key].reshape(expected_shape))


@PROPERTY
@given(data=st.data(), shape=shapes(2, 4), buffer=st.sampled_from(["hbm", "sbuf"]), hops=st.integers(1, 3))
def test_indexing_derives_the_offset_numpy_reports(data, shape, buffer, hops):
    """Indexing computes a view's byte offset from its parent's (regions and dependencies rest on it);
    after every hop of a chain, and through a permuted parent, it is NumPy's own answer."""

    def numpy_offset(t):
        return t._view.__array_interface__["data"][0] - t._buf.address

    def kernel(x):
        t = x
        if buffer == "sbuf":
            t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x)
        if buffer == "hbm" and data.draw(st.booleans()):
            t = t.permute(tuple(reversed(range(t.ndim))))
        for _ in range(hops):
            key, _ = data.draw(index_keys(t.shape, on_chip=buffer == "sbuf"))
            t = t[key]
            assert t.byte_offset() == numpy_offset(t)
            assert t.region() == sim.tensor.Tensor(t._buf, t._view, t.dtype).region()
        return x

    sim.run(kernel, arange(shape))


def test_on_chip_indexing_rule_examples():
    def kernel(x):
        t = nl.ndarray((64, 4, 32), nl.float32, buffer=nl.sbuf)
        p = nl.ndarray((32, 8), nl.float32, buffer=nl.psum)
        h = nl.ndarray((128, 4, 32), nl.float32, buffer=nl.shared_hbm)
        return (
            t[:, 0, 10].shape,
            t[0, :, :].shape,
            t[0, 0, 10].shape,
            t[:, 1].shape,
            t[..., 2].shape,
            t[5].shape,
            h[0, :, :].shape,
            h[:, 0, 10].shape,
            h[0, 0, 10].shape,
            t[..., ::2].shape,
            p[:, 3].shape,
            p[7, 3].shape,
            p[7].shape,
            p[nl.ds(8, 4), -1].shape,
        )

    assert sim.run(kernel, np.zeros((1, 1), np.float32)).outputs == (
        (64, 1),
        (1, 4, 32),
        (1, 1),
        (64, 32),
        (64, 4),
        (1, 4, 32),
        (4, 32),
        (128,),
        (),
        (64, 4, 16),
        (32, 1),
        (1, 1),
        (1, 8),
        (4, 1),
    )


def test_an_int_index_on_a_one_d_on_chip_view_is_its_partition():
    """A 1-D on-chip view has no free dim to keep: ``v[3]`` is partition 3, one element (this once
    raised a TypeError from inside the indexing rule)."""

    def kernel(x):
        column = nl.ndarray((8, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=column, src=x)
        row = column.reshape((8,))[3]
        out = nl.ndarray(row.shape, row.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=row)
        return out

    out = sim.run(kernel, arange((8, 1))).outputs
    assert out.shape == (1,) and out[0] == 3.0


def test_integer_index_on_hbm_is_a_live_zero_d_view():
    x = arange((3, 4))

    def kernel(x):
        t = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(t, -7.0)
        nisa.dma_copy(dst=x[1, 2], src=t)  # write through a 0-d view
        out = nl.ndarray((), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=x[2, 3])
        return out

    out = sim.run(kernel, x).outputs
    assert out.shape == () and out == 11.0
    assert x[1, 2] == -7.0


# -- reshaping views ----------------------------------------------------------------------------
def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def regroupings(draw, total):
    """A shape with ``total`` elements, with at most one -1."""
    dims, left = [], total
    while left > 1 and draw(st.booleans()):
        d = draw(st.sampled_from(_divisors(left)))
        dims.append(d)
        left //= d
    dims.append(left)
    dims = draw(st.permutations(dims))
    if draw(st.booleans()):
        dims[draw(st.integers(0, len(dims) - 1))] = -1
    return tuple(dims)


@PROPERTY
@given(data=st.data(), shape=shapes(1, 4))
def test_hbm_reshape_matches_numpy(data, shape):
    new = data.draw(regroupings(int(np.prod(shape))))
    x = arange(shape)
    out = through_view(x, lambda t: t.reshape(new))
    np.testing.assert_array_equal(out, x.reshape(new))


@PROPERTY
@given(data=st.data(), shape=shapes(2, 4))
def test_sbuf_reshape_keeps_partitions(data, shape):
    free = data.draw(regroupings(int(np.prod(shape[1:]))))
    new = (shape[0],) + free
    x = arange(shape)
    out = through_view(x, lambda t: t.reshape(new), "sbuf")
    np.testing.assert_array_equal(out, x.reshape(new))


@PROPERTY
@given(data=st.data(), shape=shapes(2, 4))
def test_flatten_dims_and_reshape_dim(data, shape):
    x = arange(shape)
    start = data.draw(st.integers(0, len(shape) - 1))
    end = data.draw(st.integers(start, len(shape) - 1))
    merged = shape[:start] + (-1,) + shape[end + 1 :]
    np.testing.assert_array_equal(through_view(x, lambda t: t.flatten_dims(start, end)), x.reshape(merged))
    dim = data.draw(st.integers(0, len(shape) - 1))
    split = data.draw(regroupings(shape[dim]))
    target = shape[:dim] + split + shape[dim + 1 :]
    np.testing.assert_array_equal(through_view(x, lambda t: t.reshape_dim(dim, split)), x.reshape(target))
    if start >= 1:  # on chip: free dims only
        np.testing.assert_array_equal(through_view(x, lambda t: t.flatten_dims(start, end), "sbuf"), x.reshape(merged))


def test_reshape_of_a_row_slice_and_of_a_strided_slice():
    x = arange((6, 8))
    np.testing.assert_array_equal(through_view(x, lambda t: t[2:5].reshape((-1,))), x[2:5].reshape(-1))
    np.testing.assert_array_equal(
        through_view(x, lambda t: t[:, 0:4].reshape((6, 2, 2)), "sbuf"), x[:, 0:4].reshape(6, 2, 2)
    )
    with pytest.raises(sim.NkiValidationError, match=r"reshape: cannot view \[6, 3\] as \[18\] without copying"):
        through_view(x, lambda t: t[:, 0:8:3].reshape((18,)))


@PROPERTY
@given(data=st.data(), shape=shapes(2, 4))
def test_permute_matches_numpy(data, shape):
    x = arange(shape)
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    np.testing.assert_array_equal(through_view(x, lambda t: t.permute(perm)), x.transpose(perm))
    on_chip = (0,) + tuple(data.draw(st.permutations(range(1, len(shape)))))
    np.testing.assert_array_equal(through_view(x, lambda t: t.permute(on_chip), "sbuf"), x.transpose(on_chip))


def test_permute_takes_one_sequence_as_nki_documents():
    """nki/api/nki/language: ``NkiTensor.permute(self, dims: tuple[int, ...])``; torch's variadic form
    would not trace on the device's compiler."""
    x = arange((4, 6))
    np.testing.assert_array_equal(through_view(x, lambda t: t.permute(dims=[1, 0])), x.T)
    with pytest.raises(TypeError, match=r"pass the dims as one tuple"):
        through_view(x, lambda t: t.permute(1, 0))


# -- broadcasting and unit dims -----------------------------------------------------------------
@PROPERTY
@given(data=st.data(), shape=shapes(2, 4, max_side=4))
def test_broadcast_matches_numpy(data, shape):
    ones = data.draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)))
    src_shape = tuple(1 if (o and d > 0) else n for d, (n, o) in enumerate(zip(shape, ones)))
    x = arange(src_shape)
    np.testing.assert_array_equal(through_view(x, lambda t: t.broadcast_to(shape)), np.broadcast_to(x, shape))
    np.testing.assert_array_equal(through_view(x, lambda t: t.broadcast_to(shape), "sbuf"), np.broadcast_to(x, shape))
    np.testing.assert_array_equal(
        through_view(x, lambda t: nl.broadcast_to(t, shape), "sbuf"), np.broadcast_to(x, shape)
    )
    unit = [d for d, n in enumerate(src_shape) if n == 1 and d > 0]
    if unit:
        dim = data.draw(st.sampled_from(unit))
        size = data.draw(st.integers(1, 5))
        want = list(src_shape)
        want[dim] = size
        for buffer in ("hbm", "sbuf"):
            np.testing.assert_array_equal(
                through_view(x, lambda t: t.broadcast(dim, size), buffer), np.broadcast_to(x, want)
            )


@PROPERTY
@given(data=st.data(), shape=shapes(2, 3))
def test_expand_and_squeeze_dims(data, shape):
    x = arange(shape)
    axis = data.draw(st.integers(0, len(shape)))
    np.testing.assert_array_equal(through_view(x, lambda t: t.expand_dims(axis)), np.expand_dims(x, axis))
    np.testing.assert_array_equal(through_view(x, lambda t: nl.expand_dims(t, axis)), np.expand_dims(x, axis))
    on_chip_axis = max(axis, 1)
    np.testing.assert_array_equal(
        through_view(x, lambda t: t.expand_dim(on_chip_axis), "sbuf"), np.expand_dims(x, on_chip_axis)
    )
    np.testing.assert_array_equal(through_view(x, lambda t: t.expand_dims(axis).squeeze_dim(axis)), x)
    np.testing.assert_array_equal(
        through_view(x, lambda t: t.expand_dims(on_chip_axis).squeeze_dim(on_chip_axis), "sbuf"), x
    )


# -- slice / select -----------------------------------------------------------------------------
@PROPERTY
@given(data=st.data(), shape=shapes(2, 4))
def test_slice_and_select_match_numpy(data, shape):
    x = arange(shape)
    dim = data.draw(st.integers(0, len(shape) - 1))
    n = shape[dim]
    start = data.draw(st.integers(0, n - 1))
    end = data.draw(st.integers(start + 1, n))
    step = data.draw(st.integers(1, 3))
    key = [slice(None)] * len(shape)
    key[dim] = slice(start, end, step)
    np.testing.assert_array_equal(through_view(x, lambda t: t.slice(dim, start, end, step)), x[tuple(key)])
    if dim > 0:
        np.testing.assert_array_equal(through_view(x, lambda t: t.slice(dim, start, end, step), "sbuf"), x[tuple(key)])
    else:
        np.testing.assert_array_equal(through_view(x, lambda t: t.slice(0, start, end), "sbuf"), x[start:end])
    index = data.draw(st.integers(0, n - 1))
    np.testing.assert_array_equal(through_view(x, lambda t: t.select(dim, index)), np.take(x, index, axis=dim))
    if dim > 0:
        expected = np.take(x, index, axis=dim)
        if expected.ndim < 2:  # on chip the last free dim stays (size 1)
            expected = expected.reshape(-1, 1)
        np.testing.assert_array_equal(through_view(x, lambda t: t.select(dim, index), "sbuf"), expected)


# -- reinterpreting dtypes ----------------------------------------------------------------------
@pytest.mark.parametrize("buffer", ["hbm", "sbuf"])
@pytest.mark.parametrize(
    "src, dst, factor",
    [
        (np.float32, BF16, 2),
        (np.float32, np.int32, 1),
        (np.float32, np.uint8, 4),
        (BF16, np.int16, 1),
        (np.int32, np.uint16, 2),
    ],
)
def test_view_dtype_rescales_last_dim(buffer, src, dst, factor):
    x = (arange((4, 6)) * 1.37 - 5).astype(src)
    out = through_view(x, lambda t: t.view(dst), buffer)
    assert out.shape == (4, 6 * factor)
    same_bits(out, x.view(dst))
    # a row/column slice reinterprets just those elements
    out = through_view(x, lambda t: t[1:3, 2:5].view(dst), buffer)
    same_bits(out, np.ascontiguousarray(x[1:3, 2:5]).view(dst))


# -- access patterns ----------------------------------------------------------------------------
def pattern_values(flat: np.ndarray, pattern, offset) -> np.ndarray:
    """What an access pattern reads: flat[offset + sum(i_k * step_k)], built index by index."""
    nums = [n for _, n in pattern]
    grids = np.meshgrid(*[np.arange(n) for n in nums], indexing="ij")
    index = offset + sum(g * s for g, (s, _) in zip(grids, pattern))
    return flat[index]


@st.composite
def hbm_patterns(draw, size):
    dims = draw(st.integers(1, 3))
    pattern = [[draw(st.integers(0, 9)), draw(st.integers(1, 4))] for _ in range(dims)]
    span = sum((n - 1) * s for s, n in pattern)
    assume(span < size)
    return pattern, draw(st.integers(0, size - 1 - span))


@PROPERTY
@given(data=st.data(), shape=shapes(1, 3, max_side=8))
def test_hbm_ap_matches_index_arithmetic(data, shape):
    x = arange(shape)
    pattern, offset = data.draw(hbm_patterns(x.size))
    out = through_view(x, lambda t: t.ap(pattern=pattern, offset=offset))
    np.testing.assert_array_equal(out, pattern_values(x.reshape(-1), pattern, offset))


@st.composite
def sbuf_patterns(draw, parts, cols):
    p = draw(st.integers(1, parts))
    row = draw(st.integers(0, parts - p))
    free = [[draw(st.integers(0, 4)), draw(st.integers(1, 4))] for _ in range(draw(st.integers(1, 2)))]
    span = sum((n - 1) * s for s, n in free)
    assume(span < cols)
    col = draw(st.integers(0, cols - 1 - span))
    return [[cols, p]] + free, row * cols + col


@PROPERTY
@given(data=st.data(), parts=st.integers(1, 8), cols=st.integers(1, 12))
def test_sbuf_ap_matches_index_arithmetic(data, parts, cols):
    x = arange((parts, cols))
    pattern, offset = data.draw(sbuf_patterns(parts, cols))
    out = through_view(x, lambda t: t.ap(pattern=pattern, offset=offset), "sbuf")
    np.testing.assert_array_equal(out, pattern_values(x.reshape(-1), pattern, offset))


@PROPERTY
@given(data=st.data(), parts=st.integers(1, 6), cols=st.integers(1, 6), buffer=st.sampled_from(["hbm", "sbuf"]))
def test_ap_with_dtype_reinterprets(data, parts, cols, buffer):
    x = arange((parts, cols)) * 3.7 - 1
    halves = x.view(BF16)  # (parts, 2 * cols)
    pattern, offset = data.draw(sbuf_patterns(parts, 2 * cols))
    out = through_view(x, lambda t: t.ap(pattern=pattern, offset=offset, dtype=nl.bfloat16), buffer)
    same_bits(out, pattern_values(halves.reshape(-1), pattern, offset))


@pytest.mark.parametrize("buffer", ["hbm", "sbuf"])
def test_ap_documented_example_and_inherited_offset(buffer):
    x = arange((16, 16))
    out = through_view(x, lambda t: t.ap(pattern=[[16, 16], [1, 8]], offset=8), buffer)
    np.testing.assert_array_equal(out, x[0:16, 8:16])
    # offset=None starts where the view starts; the pattern itself ignores the view's shape.
    out = through_view(x, lambda t: t[3:, 5:].ap(pattern=[[16, 4], [2, 3]]), buffer)
    np.testing.assert_array_equal(out, x[3:7, 5:11:2])
    # an explicit offset addresses the allocation, whatever the view
    out = through_view(x, lambda t: t[3:, 5:].ap(pattern=[[16, 2], [1, 4]], offset=0), buffer)
    np.testing.assert_array_equal(out, x[0:2, 0:4])


# -- writes through views -----------------------------------------------------------------------
@PROPERTY
@given(data=st.data(), shape=shapes(2, 4))
def test_memset_through_a_view_lands_in_the_tile(data, shape):
    key, numpy_key = data.draw(index_keys(shape, on_chip=True))
    first_partition = np.arange(shape[0])[numpy_key[0] if isinstance(numpy_key, tuple) else numpy_key]
    assume(np.atleast_1d(first_partition)[0] % 32 == 0)  # compute engines start small accesses at 0/32/64/96
    x = arange(shape)

    def kernel(x):
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.memset(t[key], -1.0)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    expected = x.copy()
    expected[numpy_key] = -1.0
    np.testing.assert_array_equal(sim.run(kernel, x).outputs, expected)


@PROPERTY
@given(data=st.data(), shape=shapes(2, 4))
def test_dma_writes_through_permuted_and_reshaped_hbm_views(data, shape):
    x = arange(shape)
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    new = data.draw(regroupings(x.size))

    def kernel(x):
        a = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=a.permute(perm), src=x.permute(perm))  # permuted on both sides: a == x
        b = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=b.reshape(new), src=x.reshape(new))
        return a, b

    a, b = sim.run(kernel, x).outputs
    np.testing.assert_array_equal(a, x)
    np.testing.assert_array_equal(b, x)


@PROPERTY
@given(data=st.data(), parts=st.integers(1, 8), cols=st.integers(1, 12))
def test_dma_writes_through_an_sbuf_ap(data, parts, cols):
    pattern, offset = data.draw(sbuf_patterns(parts, cols))
    nums = [n for _, n in pattern]
    grids = np.meshgrid(*[np.arange(n) for n in nums], indexing="ij")
    index = offset + sum(g * s for g, (s, _) in zip(grids, pattern))
    assume(np.unique(index).size == index.size)  # overlapping destinations have no defined order
    src = -arange(nums) - 1

    def kernel(src):
        t = nl.ndarray((parts, cols), nl.float32, buffer=nl.sbuf)
        nisa.memset(t, 0.0)
        nisa.dma_copy(dst=t.ap(pattern=pattern, offset=offset), src=src)
        out = nl.ndarray((parts, cols), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    expected = np.zeros(parts * cols, np.float32)
    expected[index] = src
    np.testing.assert_array_equal(sim.run(kernel, src).outputs, expected.reshape(parts, cols))


def test_in_place_write_through_argument_view():
    x = arange((4, 6))
    original = x.copy()

    def kernel(x):
        t = nl.ndarray((4, 3), nl.float32, buffer=nl.sbuf)
        nisa.memset(t, 0.5)
        nisa.dma_copy(dst=x[:, ::2], src=t)

    sim.run(kernel, x)
    original[:, ::2] = 0.5
    np.testing.assert_array_equal(x, original)


# -- on-chip view rules -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make_view, pattern",
    [
        (lambda t: t.permute((1, 0, 2)), r"permute: .*on-chip tensors keep dim 0 as the partition dim"),
        (lambda t: t.select(0, 1), r"select: .*cannot drop the partition dim of an on-chip tensor"),
        (lambda t: t[0:1].squeeze_dim(0), r"squeeze_dim: .*axis 0 is the partition dim"),
        (lambda t: t.expand_dims(0), r"expand_dims: .*axis 0 is the partition dim"),
        (lambda t: t.expand_dims(-4), r"expand_dims: .*axis 0 is the partition dim"),
        (lambda t: t.select(-3, 0), r"select: .*cannot drop the partition dim"),
        (lambda t: t.reshape((8, 3, 4)), r"reshape: .*dim 0 of an on-chip view must step exactly one partition"),
        (lambda t: t[0:4:2], r"index: .*the partition dimension cannot be strided \(step=2\)"),
    ],
)
def test_on_chip_views_keep_the_partition_dim(make_view, pattern):
    with pytest.raises(sim.NkiValidationError, match=pattern):
        through_view(arange((4, 6, 4)), make_view, "sbuf")


def test_the_same_views_are_fine_in_hbm():
    x = arange((4, 6, 4))
    np.testing.assert_array_equal(through_view(x, lambda t: t.permute((1, 0, 2))), x.transpose(1, 0, 2))
    np.testing.assert_array_equal(through_view(x, lambda t: t.select(0, 1)), x[1])
    np.testing.assert_array_equal(through_view(x, lambda t: t.reshape((8, 3, 4))), x.reshape(8, 3, 4))
    np.testing.assert_array_equal(through_view(x, lambda t: t[0:4:2]), x[0:4:2])


def test_select_takes_a_register_or_a_one_element_tile():
    x = arange((3, 5, 2))

    def kernel(x):
        idx = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(idx, 3)
        reg = nisa.register_alloc(4)
        a = nl.ndarray((3, 2), nl.float32, buffer=nl.shared_hbm)
        b = nl.ndarray((3, 2), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=a, src=x.select(1, idx))
        nisa.dma_copy(dst=b, src=x.select(1, reg))
        return a, b

    a, b = sim.run(kernel, x).outputs
    np.testing.assert_array_equal(a, x[:, 3])
    np.testing.assert_array_equal(b, x[:, 4])


def test_an_indirect_access_pattern_cannot_be_viewed_further():
    x = arange((8, 4))

    def kernel(x):
        rows = nl.ndarray((2, 1), nl.int32, buffer=nl.sbuf)
        nisa.iota(rows, [[1, 1]], offset=1, channel_multiplier=3)  # rows 1 and 4
        gathered = x.ap(pattern=[[4, 2], [1, 4]], offset=0, vector_offset=rows, indirect_dim=0)
        out = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=gathered)
        gathered[0:1]
        return out

    with pytest.raises(
        sim.NkiValidationError,
        match=r"index: .*indirect \(vector_offset\) access pattern cannot be "
        r"viewed further",
    ):
        sim.run(kernel, x)

    def gather_only(x):
        rows = nl.ndarray((2, 1), nl.int32, buffer=nl.sbuf)
        nisa.iota(rows, [[1, 1]], offset=1, channel_multiplier=3)
        out = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=x.ap(pattern=[[4, 2], [1, 4]], offset=0, vector_offset=rows, indirect_dim=0))
        return out

    np.testing.assert_array_equal(sim.run(gather_only, x).outputs, x[[1, 4]])


def test_writes_through_psum_views_land_in_the_tile():
    def kernel(x):
        p = nl.ndarray((40, 6), nl.float32, buffer=nl.psum)
        nisa.memset(p, 0.0)
        nisa.memset(p[32:35, 1::2], 3.0)  # a small access starts on a quadrant boundary
        nisa.memset(p.reshape((40, 2, 3))[:, 1, 0], 5.0)  # column 3 of every partition
        s = nl.ndarray((40, 6), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(s, p)
        out = nl.ndarray((40, 6), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=s)
        return out

    expected = np.zeros((40, 6), np.float32)
    expected[32:35, 1::2] = 3.0
    expected[:, 3] = 5.0
    np.testing.assert_array_equal(sim.run(kernel, np.zeros((1, 1), np.float32)).outputs, expected)
