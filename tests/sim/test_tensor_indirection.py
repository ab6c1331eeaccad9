"""Tensor indirection, ``NkiTensor.indirect(index, num_elem)`` (NeuronCore-v4): what it gathers and
scatters, the rules of each instruction's "Tensor indirection" paragraph (aws-neuron-sdk
``nki/api/nki/isa/__init__.py``), and what the trace records."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_io import nisa, nki, nl, run_body, to_hbm, to_sbuf

from kernels_neuron import sim
from kernels_neuron.cost.hardware import HARDWARE
from kernels_neuron.cost.schedule import schedule
from kernels_neuron.sim import dtypes

RNG = np.random.default_rng(14)


def snake(offsets: np.ndarray, group: int, parts: int) -> np.ndarray:
    """An index tile holding ``offsets[g]`` (one list per partition group) as NKI reads it: offset ``i`` of
    the group starting at partition ``s`` sits at ``[s + i % group, i // group]``."""
    groups = offsets.shape[0]
    assert groups * group == parts and offsets.shape[1] % group == 0
    columns = offsets.shape[1] // group
    tile = offsets.reshape(groups, columns, group).transpose(0, 2, 1).reshape(parts, columns)
    return tile.astype(np.uint16)


def test_vector_engine_gathers_each_groups_columns():
    """AWS's tutorial kernel (``output = data[:, index]``, a tensor_copy of ``data.indirect(idx,
    num_elem=...)`` on VectorE), with a different column list for each 16-partition group."""
    data = RNG.random((128, 64), dtype=np.float32)
    per_group = RNG.integers(0, 64, (8, 32))
    index = snake(per_group, 16, 128)

    def body(d, i):
        out = nl.ndarray((128, 32), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(out, d.indirect(i, num_elem=32), engine=nisa.engine.vector)
        return out

    out = run_body(body, data, index, target="trn3").outputs
    expected = np.concatenate([data[16 * g : 16 * (g + 1), per_group[g]] for g in range(8)])
    np.testing.assert_array_equal(out, expected)


def test_num_elem_defaults_to_the_index_size():
    data = RNG.random((16, 40), dtype=np.float32)
    columns = RNG.integers(0, 40, (1, 32))

    def body(d, i):
        view = d.indirect(i)
        assert view.shape == (16, 32) and view.is_indirect()
        out = nl.ndarray((16, 32), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(out, view)
        return out

    out = run_body(body, data, snake(columns, 16, 16), target="trn3").outputs
    np.testing.assert_array_equal(out, data[:, columns[0]])


def test_scatter_writes_only_the_indexed_columns():
    base = RNG.random((32, 24), dtype=np.float32)
    values = RNG.random((32, 16), dtype=np.float32)
    columns = RNG.permutation(24)[:16].reshape(1, 16).repeat(2, axis=0)  # the same list in both groups

    def body(b, v, i):
        nisa.tensor_scalar(b.indirect(i, num_elem=16), v, nl.multiply, 2.0)
        return b

    out = run_body(body, base, values, snake(columns, 16, 32), target="trn3").outputs
    expected = base.copy()
    expected[:, columns[0]] = 2 * values
    np.testing.assert_array_equal(out, expected)


def test_gather_and_scatter_in_one_instruction_with_a_multi_dim_data_view():
    """Offsets count a data view's free elements row-major; ``tensor_tensor`` gathers ``data1`` and
    scatters ``dst`` through their own indices."""
    a = RNG.random((16, 4, 6), dtype=np.float32)
    b = RNG.random((16, 16), dtype=np.float32)
    dst = np.zeros((16, 24), np.float32)
    read_at = RNG.integers(0, 24, (1, 16))
    write_at = RNG.permutation(24)[:16].reshape(1, 16)

    def body(x, y, d, ri, wi):
        nisa.tensor_tensor(d.indirect(wi), x.indirect(ri), y, nl.add)
        return d

    out = run_body(body, a, b, dst, snake(read_at, 16, 16), snake(write_at, 16, 16), target="trn3").outputs
    expected = dst.copy()
    expected[:, write_at[0]] = a.reshape(16, 24)[:, read_at[0]] + b
    np.testing.assert_array_equal(out, expected)


def test_tensor_engine_groups_32_partitions():
    """nc_matmul reads a stationary view's offsets in 32-partition groups: one list of 32 offsets per
    group, which a 16-partition reading would scramble."""
    k = 64
    stationary = RNG.standard_normal((k, 48)).astype(np.float32)
    moving = RNG.standard_normal((k, 8)).astype(np.float32)
    per_group = np.stack([RNG.permutation(48)[:32] for _ in range(2)])

    def body(s, m, i):
        s16, m16 = nl.ndarray((k, 48), nl.bfloat16, buffer=nl.sbuf), nl.ndarray((k, 8), nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(s16, s)
        nisa.tensor_copy(m16, m)
        dst = nl.ndarray((32, 8), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst, s16.indirect(i, num_elem=32), m16)
        return dst

    out = run_body(body, stationary, moving, snake(per_group, 32, k), target="trn3").outputs
    as_bf16 = dtypes.cast(stationary, nl.bfloat16).astype(np.float32)
    m_bf16 = dtypes.cast(moving, nl.bfloat16).astype(np.float32)
    gathered = np.concatenate([as_bf16[32 * g : 32 * (g + 1), per_group[g]] for g in range(2)])
    np.testing.assert_allclose(out, gathered.T @ m_bf16, rtol=1e-5, atol=1e-5)


def test_matmul_scatters_into_psum_and_accumulates_per_written_column():
    """A scattered matmul result marks only its columns written, so ``accumulate=None`` adds where an
    earlier matmul wrote and overwrites elsewhere."""
    ones = np.ones((32, 32), np.float32)
    first, second = np.arange(8).reshape(1, 8), np.arange(4, 12).reshape(1, 8)

    def body(o, i1, i2):
        lhs = nl.ndarray((32, 32), nl.bfloat16, buffer=nl.sbuf)
        rhs = nl.ndarray((32, 8), nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(lhs, o)
        nisa.memset(rhs, 1.0)
        acc = nl.ndarray((32, 16), nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(acc.indirect(i1, num_elem=8), lhs, rhs)
        nisa.nc_matmul(acc.indirect(i2, num_elem=8), lhs, rhs)
        out = nl.ndarray((32, 12), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(out, acc[:, 0:12])
        return out

    pad = np.zeros((32, 8), np.int64)
    i1 = np.concatenate([first.T, pad[:24, :1]]).astype(np.uint16)
    i2 = np.concatenate([second.T, pad[:24, :1]]).astype(np.uint16)
    out = run_body(body, ones, i1, i2, target="trn3").outputs
    np.testing.assert_array_equal(out[:, 0:4], 32)  # first only
    np.testing.assert_array_equal(out[:, 4:8], 64)  # both: accumulated
    np.testing.assert_array_equal(out[:, 8:12], 32)  # second only: overwritten, not added to garbage


def _quantized(parts, columns, rng):
    values = rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], size=(parts, 4 * columns)).astype(np.float32)
    return dtypes.cast(values, nl.bfloat16)


def test_nc_matmul_mx_gathers_data_and_scales_through_one_index():
    x = _quantized(32, 8, RNG)
    rows = RNG.permutation(8)

    def kernel(src, idx, permuted):
        q = nl.ndarray((32, 8), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        scale = nl.ndarray((32, 8), nl.uint8, buffer=nl.sbuf)
        nisa.quantize_mx(dst=q, src=to_sbuf(src), dst_scale=scale)
        i = to_sbuf(idx)
        dst = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
        if permuted:
            nisa.nc_matmul_mx(dst, q.indirect(i, 8), q, scale.indirect(i, 8), scale)
        else:
            nisa.nc_matmul_mx(dst, q, q, scale, scale)
        return to_hbm(dst)

    index = np.zeros((32, 1), np.uint16)
    index[:8, 0] = rows
    gathered = sim.run(kernel, x, index, True, target="trn3").outputs
    plain = sim.run(kernel, x, index, False, target="trn3").outputs
    np.testing.assert_array_equal(gathered, plain[rows])


# ---------------------------------------------------------------------------------------------
# rules: each illegal form raises naming the instruction, the operand and the values
# ---------------------------------------------------------------------------------------------
def sb(shape, dtype=nl.float32, value=1.0):
    t = nl.ndarray(tuple(shape), dtype, buffer=nl.sbuf)
    nisa.memset(t, value)
    return t


def idx(parts, columns=1, value=0):
    return sb((parts, columns), nl.uint16, value)


def ps(shape, dtype=nl.float32):
    return nl.ndarray(tuple(shape), dtype, buffer=nl.psum)


def _run(body, target="trn3"):
    def kernel():
        body()

    return sim.run(kernel, target=target)


def _mx_through_one_index(**tiling):
    """nc_matmul_mx with stationary and its scale indirect through the same index (the legal pairing)."""
    index = idx(32)
    data = nl.zeros((32, 8), nl.uint32).view(nl.float8_e5m2_x4)
    scale = nl.zeros((32, 8), nl.uint8)
    nisa.nc_matmul_mx(ps((8, 8)), data.indirect(index, 8), data, scale.indirect(index, 8), scale, **tiling)


RULES = {
    "trn2": (
        lambda: nisa.tensor_copy(sb((16, 8)), sb((16, 8)).indirect(idx(16), 8)),
        r"nisa\.tensor_copy: src: tensor indirection needs NeuronCore-v4 or newer \(target=trn2\)",
        "trn2",
    ),
    "operand-not-listed": (
        lambda: nisa.tensor_tensor(sb((16, 8)), sb((16, 8)), sb((16, 8)).indirect(idx(16), 8), nl.add),
        r"nisa\.tensor_tensor: data2: does not support tensor indirection .*\(supported=data1/dst\)",
    ),
    "predicated-src": (
        lambda: nisa.tensor_copy_predicated(sb((16, 8)), sb((16, 8)).indirect(idx(16), 8), sb((16, 8), nl.uint8)),
        r"nisa\.tensor_copy_predicated: src: does not support tensor indirection .*\(supported=dst/predicate\)",
    ),
    "instruction-not-listed": (
        lambda: nisa.dma_copy(dst=sb((16, 8)), src=sb((16, 8)).indirect(idx(16), 8)),
        r"nisa\.dma_copy: src: does not support tensor indirection .*\(supported=none\)",
    ),
    "engine": (
        lambda: nisa.tensor_copy(sb((16, 8)), sb((16, 8)).indirect(idx(16), 8), engine=nisa.engine.gpsimd),
        r"nisa\.tensor_copy: engine: with tensor indirection it runs on vector/scalar only \(engine=gpsimd\)",
    ),
    "index-quadrant": (
        lambda: nisa.tensor_copy(sb((64, 8))[32:48].indirect(idx(32)[16:32], 8), ps((16, 8))),
        r"nisa\.tensor_copy: dst index: must start on a quadrant boundary \(a multiple of 32\) \(start=16\)",
    ),
    "input-at-its-index": (
        lambda: nisa.tensor_copy(sb((32, 8)), sb((64, 8))[32:64].indirect(idx(64)[0:32], 8)),
        r"nisa\.tensor_copy: src: an indirect input starts on the same partition as its index "
        r"\(start=32, index_start=0\)",
    ),
    "dst-index-at-sbuf-input": (
        lambda: nisa.tensor_scalar(sb((32, 8)).indirect(idx(64)[32:64], 8), sb((32, 8)), nl.add, 1.0),
        r"nisa\.tensor_scalar: dst index: must start on the same partition as data \(dst_index_start=32, data_start=0\)",
    ),
    "dst-index-at-psum-input-index": (
        lambda: nisa.tensor_copy(
            sb((32, 8)).indirect(idx(64)[32:64], 8), ps((32, 8))[0:32].indirect(idx(32), 8), engine=nisa.engine.vector
        ),
        r"nisa\.tensor_copy: dst index: must start on the same partition as src's index "
        r"\(dst_index_start=32, src_index_start=0\)",
    ),
    "scalar-engine-psum-scatter": (
        lambda: nisa.activation(ps((16, 8)).indirect(idx(16), 8), nl.exp, sb((16, 8))),
        r"nisa\.activation: dst: on the Scalar engine a scattered dst cannot be in PSUM",
    ),
    "matmul-transpose-moving": (
        lambda: nisa.nc_matmul(
            ps((32, 32), nl.bfloat16),
            sb((32, 32), nl.bfloat16),
            sb((32, 32), nl.bfloat16).indirect(idx(32), 32),
            is_transpose=True,
        ),
        r"nisa\.nc_matmul: moving: cannot use tensor indirection when is_transpose=True",
    ),
    "matmul-tiling": (
        lambda: nisa.nc_matmul(
            ps((32, 8)),
            sb((32, 32), nl.bfloat16).indirect(idx(32), 32),
            sb((32, 8), nl.bfloat16),
            tile_position=(32, 0),
            tile_size=(32, 128),
        ),
        r"nisa\.nc_matmul: tile_position: must be \(0, 0\) or unset with tensor indirection .*\(tile_position=\(32, 0\)\)",
    ),
    "matmul-dtype": (
        lambda: nisa.nc_matmul(ps((32, 8)), sb((32, 32)).indirect(idx(32), 32), sb((32, 8))),
        r"nisa\.nc_matmul: stationary: an indirect operand must be a Tensor-Engine float dtype \(dtype=float32",
    ),
    "mx-pair": (
        lambda: nisa.nc_matmul_mx(
            ps((8, 8)),
            nl.zeros((32, 8), nl.uint32).view(nl.float8_e5m2_x4).indirect(idx(32), 8),
            nl.zeros((32, 8), nl.uint32).view(nl.float8_e5m2_x4),
            nl.zeros((32, 8), nl.uint8),
            nl.zeros((32, 8), nl.uint8),
        ),
        r"nisa\.nc_matmul_mx: stationary/stationary_scale: must both use \.indirect\(\) with the same index, or "
        r"neither \(stationary=True, stationary_scale=False\)",
    ),
    "indirect-view-viewed": (
        lambda: sb((16, 64)).indirect(idx(16, 3), 48)[:, 0:8],
        r"index: .*an \.indirect\(\) view cannot be viewed further",
    ),
    "num-elem-over-group": (
        lambda: nisa.tensor_copy(sb((32, 40)), sb((32, 64)).indirect(idx(32, 2), 40)),
        r"nisa\.tensor_copy: src index: num_elem exceeds the offsets one partition group holds .*"
        r"\(num_elem=40, limit=32, group=16\)",
    ),
    "offset-out-of-range": (
        lambda: nisa.tensor_copy(sb((16, 8)), sb((16, 4)).indirect(idx(16, 1, value=4), 8)),
        r"nisa\.tensor_copy: src index: tensor-indirection offset outside the data view's free dims "
        r"\(offsets=\[4\], free_elements=4\)",
    ),
    "index-in-psum": (
        lambda: sb((16, 8)).indirect(ps((16, 1), nl.uint16), 8),
        r"indirect: index: must be an SBUF tensor of free-dim offsets",
    ),
    "mx-tiling": (
        lambda: _mx_through_one_index(tile_position=(32, 0), tile_size=(32, 128)),
        r"nisa\.nc_matmul_mx: tile_position: must be \(0, 0\) or unset with tensor indirection",
    ),
    "index-dtype": (
        lambda: sb((16, 8)).indirect(sb((16, 1), nl.int32), 8),
        r"indirect: index: offsets must be uint16 \(dtype=int32\)",
    ),
    "index-shape": (
        lambda: sb((16, 8)).indirect(idx(32), 8),
        r"indirect: index: must have shape \(P, K\) with P the data's partitions \(index=\[32, 1\], P=16\)",
    ),
    "hbm-data": (
        lambda: nl.ndarray((16, 8), nl.float32, buffer=nl.shared_hbm).indirect(idx(16), 8),
        r"indirect: .*tensor indirection selects columns of an SBUF or PSUM tensor \(buffer=shared_hbm\)",
    ),
}


@pytest.mark.parametrize("case", sorted(RULES))
def test_rule(case):
    body, pattern, *target = RULES[case]
    with pytest.raises(nisa.NkiValidationError, match=pattern):
        _run(body, target[0] if target else "trn3")


def test_legal_placements_run():
    """The nearest legal forms of the placement rules: an input at its index, a dst index at the input's
    partition, the Vector engine scattering into PSUM."""

    def body():
        nisa.tensor_copy(sb((32, 8)), sb((64, 8))[32:64].indirect(idx(64)[32:64], 8))
        nisa.tensor_scalar(sb((32, 8)).indirect(idx(32), 8), sb((32, 8)), nl.add, 1.0)
        nisa.tensor_copy(ps((16, 8)).indirect(idx(16), 8), sb((16, 8)), engine=nisa.engine.vector)
        _mx_through_one_index(tile_position=(0, 0), tile_size=(32, 128))

    _run(body)


# ---------------------------------------------------------------------------------------------
# the trace: what an indirect instruction reads and writes
# ---------------------------------------------------------------------------------------------
@nki.jit
def index_built_in_kernel(data):
    """Gathers columns whose offsets an instruction computes (an iota), so a trace-only run cannot read them."""
    d = to_sbuf(data)
    index = nl.ndarray((16, 2), nl.uint16, buffer=nl.sbuf)
    nisa.iota(index, [[2, 2]], offset=0, channel_multiplier=4)
    out = nl.ndarray((16, 32), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(out, d.indirect(index), engine=nisa.engine.vector)
    scattered = nl.ndarray((16, 64), nl.float32, buffer=nl.sbuf)
    nisa.memset(scattered, 0.0)
    nisa.tensor_copy(scattered.indirect(index), out)
    return to_hbm(scattered)


def test_trace_records_the_index_and_the_data_view_and_orders_them():
    data = RNG.random((16, 64), dtype=np.float32)
    trace = sim.run(index_built_in_kernel, data, target="trn3").trace
    iota, gather, memset, scatter = (i for i in trace if i.op in ("iota", "tensor_copy", "memset"))
    index_region = iota.writes[0]
    assert index_region in gather.reads and index_region in scatter.reads
    (data_write,) = [i for i in trace if i.op == "dma_copy"][0].writes
    assert data_write in gather.reads  # the whole data view the columns come from
    assert scatter.writes == memset.writes  # the view the columns land in
    assert [o.role for o in gather.operands] == ["dst", "src", "src_index"]
    slots = schedule(trace.instructions, HARDWARE["trn3"]).slots
    assert slots[gather.index].start >= slots[iota.index].end
    assert slots[scatter.index].start >= max(slots[memset.index].end, slots[gather.index].end)


def test_trace_only_run_through_computed_offsets_leaves_the_same_trace():
    data = RNG.random((16, 64), dtype=np.float32)
    full = sim.run(index_built_in_kernel, data, target="trn3")
    traced = sim.run(index_built_in_kernel, data, target="trn3", numerics=False)
    assert traced.trace.instructions == full.trace.instructions
    assert traced.outputs is None


@nki.jit
def rows_gathered_by_dma(data):
    rows = nl.ndarray((4, 1), nl.int32, buffer=nl.sbuf)
    nisa.iota(rows, [[1, 1]], offset=2, channel_multiplier=3)  # rows 2, 5, 8, 11
    out = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=out, src=data.ap(pattern=[[8, 4], [1, 8]], offset=0, vector_offset=rows))
    return to_hbm(out)


def test_a_dma_gather_reads_its_vector_offset_rows_and_waits_for_them():
    """The gather's row indices are an input of the DMA: recorded as a read, so the cost model cannot
    start the transfer before the instruction that computes them has finished."""
    data = RNG.random((16, 8), dtype=np.float32)
    result = sim.run(rows_gathered_by_dma, data)
    np.testing.assert_array_equal(result.outputs, data[[2, 5, 8, 11]])
    iota, gather, _store = (i for i in result.trace if i.op in ("iota", "dma_copy"))
    assert [o.role for o in gather.operands] == ["dst", "src", "src_vector_offset"]
    assert iota.writes[0] in gather.reads
    slots = schedule(result.trace.instructions, HARDWARE["trn2"]).slots
    assert slots[gather.index].start >= slots[iota.index].end
