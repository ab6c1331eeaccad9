"""Rules AWS's NKI docs state, each checked both ways: the illegal form raises an error naming the
instruction, the argument, the value and the limit, and its nearest legal form still runs.

Every case names the doc (a path in the aws-neuron-sdk repository) that states the rule.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from kernels_neuron import sim
from kernels_neuron.sim import isa as nisa
from kernels_neuron.sim import language as nl

DUMMY = np.zeros((1, 1), np.float32)
F32 = nl.float32


def run_body(body, target="trn2"):
    """Run ``body()`` as the whole of a kernel."""

    def kernel(x):
        body()

    return sim.run(kernel, DUMMY, target=target)


def sb(shape, dtype=F32, value=1.0):
    t = nl.ndarray(tuple(shape), dtype, buffer=nl.sbuf)
    nisa.memset(t, value)
    return t


def ps(shape):
    return nl.ndarray(tuple(shape), F32, buffer=nl.psum)


def hbm(shape, dtype=F32):
    return nl.ndarray(tuple(shape), dtype, buffer=nl.shared_hbm)


# ---------------------------------------------------------------------------------------------
# bodies: (illegal, legal) pairs
# ---------------------------------------------------------------------------------------------
def _shuffle(src_part, dst_part):
    def body():
        nisa.nc_stream_shuffle(dst=sb((128, 4))[dst_part], src=sb((128, 4))[src_part], shuffle_mask=list(range(32)))

    return body


def _reciprocal(bias):
    def body():
        nisa.activation(sb((8, 4)), nl.reciprocal, sb((8, 4)), bias=None if bias is None else sb((8, 1), value=bias))

    return body


def _predicated(dtype):
    return lambda: nisa.tensor_copy_predicated(sb((8, 4)), sb((8, 4)), sb((8, 4), dtype))


def _select(dtype):
    return lambda: nisa.select_reduce(sb((8, 4)), sb((8, 4), dtype), sb((8, 4)), 0.0)


def _range_select(dtype):
    def body():
        bound = sb((8, 1), dtype, value=2)
        nisa.range_select(sb((8, 4)), sb((8, 4)), nl.greater_equal, nl.less, bound, bound, reduce_res=sb((8, 1)))

    return body


def _cumulative(dtype):
    return lambda: nisa.tensor_scalar_cumulative(sb((8, 4), dtype), sb((8, 4), dtype), nl.multiply, nl.add, 1.0)


def _reduce(op):
    return lambda: nisa.tensor_reduce(sb((8, 1)), op, sb((8, 4)), axis=1)


def _abs_max():
    nisa.tensor_tensor(sb((8, 4)), sb((8, 4)), sb((8, 4)), op=nl.abs_max)


def _dma(**kwargs):
    return lambda: nisa.dma_copy(dst=hbm((8, 4)), src=sb((8, 4)), **kwargs)


def _gather(buffer, dge_mode=nisa.dge_mode.unknown):
    def body():
        rows = sb((2, 1), nl.uint32, value=1)
        data = hbm((4, 4)) if buffer == "hbm" else sb((4, 4))
        view = data.ap(pattern=[[4, 2], [1, 4]], offset=0, vector_offset=rows, indirect_dim=0)
        nisa.dma_copy(dst=sb((2, 4)), src=view, dge_mode=dge_mode)

    return body


def _transpose(oob=nisa.oob_mode.error, dge_mode=nisa.dge_mode.unknown, shape=(8, 4)):
    def body():
        src = hbm(shape, nl.bfloat16)
        nisa.dma_transpose(dst=sb(shape[::-1], nl.bfloat16), src=src, oob_mode=oob, dge_mode=dge_mode)

    return body


def _gather_transpose(dge_mode):
    def body():
        rows = sb((16, 1), nl.uint32, value=1)
        view = hbm((32, 8), nl.bfloat16).ap(pattern=[[8, 16], [1, 8]], offset=0, vector_offset=rows, indirect_dim=0)
        nisa.dma_transpose(dst=sb((8, 16), nl.bfloat16), src=view, dge_mode=dge_mode)

    return body


CASES = [
    # (id, illegal, legal, target, error pattern)
    (
        # nki/api/nki/isa/__init__.py, nc_stream_shuffle constraint 3: the starts follow the active
        # partitions of the larger side (here 64: start 0 or 64), even where each side alone is legal.
        "stream-shuffle-start",
        _shuffle(slice(32, 52), slice(0, 40)),
        _shuffle(slice(64, 104), slice(0, 40)),
        "trn2",
        r"nisa\.nc_stream_shuffle: src: with 64 active partitions the start partition must be one of \(0, 64\) "
        r"\(start_partition=32, src_partitions=20, dst_partitions=40\)",
    ),
    (
        # nki/api/nki.api.shared.rst, engine selection: activation(op=nl.reciprocal) has no bias on NeuronCore-v2.
        "reciprocal-bias-trn1",
        _reciprocal(0.5),
        _reciprocal(None),
        "trn1",
        r"nisa\.activation: bias: activation\(op=nl\.reciprocal\) takes no bias on NeuronCore-v2 \(target=trn1\)",
    ),
    (
        # nki/api/nki/isa/__init__.py, tensor_copy_predicated: "predicate must be of type uint8, uint16, or uint32".
        "predicated-copy-int8-predicate",
        _predicated(nl.int8),
        _predicated(nl.uint16),
        "trn2",
        r"nisa\.tensor_copy_predicated: predicate: must be uint8, uint16 or uint32 \(dtype=int8\)",
    ),
    (
        # nki/api/nki/isa/__init__.py, select_reduce: "predicate dtype can be ... int8, uint8, int16, uint16".
        "select-reduce-uint32-predicate",
        _select(nl.uint32),
        _select(nl.int16),
        "trn2",
        r"nisa\.select_reduce: predicate: must be int8, uint8, int16 or uint16 \(dtype=uint32\)",
    ),
    (
        # nki/api/nki/isa/__init__.py, range_select: "bound0/bound1 must be FP32 types".
        "range-select-bf16-bounds",
        _range_select(nl.bfloat16),
        _range_select(nl.float32),
        "trn2",
        r"nisa\.range_select: bound0: must be float32 \(dtype=bfloat16\)",
    ),
    (
        # nki/api/nki/isa/__init__.py, tensor_scalar_cumulative: "INT32/UINT32 are not supported".
        "cumulative-int32",
        _cumulative(nl.int32),
        _cumulative(nl.int16),
        "trn2",
        r"nisa\.tensor_scalar_cumulative: src: dtype not supported .* \(dtype=int32\)",
    ),
    (
        # nki/api/nki.api.shared.rst, operator table, "Legal Reduction op" column: power is N.
        "reduce-power",
        _reduce(nl.power),
        _reduce(nl.multiply),
        "trn2",
        r"nisa\.tensor_reduce: op: not a legal reduction operator \(op=power, legal=add/bitwise_and/",
    ),
    (
        "reduce-equal",
        _reduce(nl.equal),
        _reduce(nl.maximum),
        "trn2",
        r"nisa\.tensor_reduce: op: not a legal reduction operator \(op=equal, ",
    ),
    (
        # nki/api/nki/language/__init__.py, abs_max: "Available only on NeuronCore-v4 (trn3) and newer".
        "abs-max-before-trn3",
        _abs_max,
        None,
        "trn2",
        r"nisa\.tensor_tensor: op: nl\.abs_max needs NeuronCore-v4 or newer \(target=trn2\)",
    ),
    (
        # nki/api/nki/isa/__init__.py, dma_copy, ``engine``: sync or scalar, only with dge_mode=hwdge.
        "dma-engine-without-hwdge",
        _dma(engine=nisa.engine.scalar),
        _dma(engine=nisa.engine.scalar, dge_mode=nisa.dge_mode.hwdge),
        "trn2",
        r"nisa\.dma_copy: engine: only valid with dge_mode=hwdge \(engine=scalar, dge_mode=unknown\)",
    ),
    (
        "dma-hwdge-on-gpsimd",
        _dma(engine=nisa.engine.gpsimd, dge_mode=nisa.dge_mode.hwdge),
        _dma(engine=nisa.engine.sync, dge_mode=nisa.dge_mode.hwdge),
        "trn2",
        r"nisa\.dma_copy: engine: hardware DGE is driven by the sync or scalar engine \(engine=gpsimd\)",
    ),
    (
        # nki/api/nki/isa/__init__.py, dma_copy: gather/scatter "when sw_dge is selected"; the
        # indexed tensor "must be in HBM".
        "gather-with-hwdge",
        _gather("hbm", nisa.dge_mode.hwdge),
        _gather("hbm", nisa.dge_mode.swdge),
        "trn2",
        r"nisa\.dma_copy: dge_mode: indirect \(vector_offset\) access needs software DGE \(dge_mode=hwdge\)",
    ),
    (
        "gather-from-sbuf",
        _gather("sbuf"),
        _gather("hbm"),
        "trn2",
        r"nisa\.dma_copy: src: an indirect \(vector_offset\) access must index an HBM tensor \(buffer=sbuf\)",
    ),
    (
        # nki/api/nki/isa/__init__.py, dma_transpose, ``oob_mode``: skip "Only valid when ``src``
        # uses indirect indexing" (dma_copy's docs state no such limit, so it is not enforced there).
        "dma-transpose-skip-without-indirect",
        _transpose(nisa.oob_mode.skip),
        _transpose(nisa.oob_mode.error),
        "trn2",
        r"nisa\.dma_transpose: oob_mode: skip is only valid when src uses indirect indexing \(oob_mode=skip\)",
    ),
    (
        # nki/api/nki/isa/__init__.py, dma_transpose, "DMA Direct Transpose Constraints": dge_mode
        # unknown or hwdge; with hwdge a 2-D src has 16 rows and at most 128 columns.
        "dma-transpose-direct-swdge",
        _transpose(dge_mode=nisa.dge_mode.swdge),
        _transpose(dge_mode=nisa.dge_mode.hwdge, shape=(16, 64)),
        "trn2",
        r"nisa\.dma_transpose: dge_mode: a direct transpose takes unknown or hwdge \(dge_mode=swdge\)",
    ),
    (
        # ... a 3-D src has 1/2/4/8/16 rows with shape[0] * shape[-2] a multiple of 16.
        "dma-transpose-hwdge-3d-rows",
        _transpose(dge_mode=nisa.dge_mode.hwdge, shape=(3, 16, 8)),
        _transpose(dge_mode=nisa.dge_mode.hwdge, shape=(2, 8, 8)),
        "trn2",
        r"nisa\.dma_transpose: src: a hardware-DGE transpose needs .* \(shape=\[3, 16, 8\]\)",
    ),
    (
        # "DMA Indirect Transpose Constraints": dge_mode unknown or swdge, src on HBM.
        "dma-transpose-indirect-hwdge",
        _gather_transpose(nisa.dge_mode.hwdge),
        _gather_transpose(nisa.dge_mode.swdge),
        "trn2",
        r"nisa\.dma_transpose: dge_mode: an indirect transpose takes unknown or swdge \(dge_mode=hwdge\)",
    ),
    (
        # nki/api/nki/language/__init__.py, NkiTensor.broadcast: "On-chip tensors: dim must not be 0".
        "broadcast-partition-dim",
        lambda: sb((1, 4)).broadcast(0, 8),
        lambda: (hbm((1, 4)).broadcast(0, 8), sb((8, 1)).broadcast(1, 4)),
        "trn2",
        r"broadcast: .*: the partition dim \(0\) of an on-chip tensor cannot be broadcast "
        r"\(shape=\[1, 4\], to=\[8, 4\]\)",
    ),
]


@pytest.mark.parametrize("illegal, legal, target, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_illegal_form_raises_and_legal_form_runs(illegal, legal, target, pattern):
    with pytest.raises(sim.NkiValidationError, match=pattern):
        run_body(illegal, target)
    run_body(legal or illegal, "trn3" if legal is None else target)


def test_dma_engine_is_recorded():
    trace = run_body(_dma(engine=nisa.engine.sync, dge_mode=nisa.dge_mode.hwdge)).trace
    assert [i.attrs.get("dge_engine") for i in trace if i.op == "dma_copy"] == ["sync"]


def test_accumulating_onto_unwritten_psum_warns_as_aws_simulator_does():
    """nki/api/nki/isa/__init__.py, nc_matmul: accumulate=True on an uninitialized PSUM location is
    undefined behaviour on all targets; AWS's simulator warns and runs on."""

    def first_accumulates():
        nisa.nc_matmul(ps((32, 16)), sb((64, 32)), sb((64, 16)), accumulate=True)

    def group_started():
        acc = ps((32, 16))
        nisa.nc_matmul(acc, sb((64, 32)), sb((64, 16)), accumulate=False)
        nisa.nc_matmul(acc, sb((64, 32)), sb((64, 16)), accumulate=True)

    with pytest.warns(sim.AccumulateUninitializedWarning, match=r"nisa\.nc_matmul: accumulate=True onto PSUM"):
        run_body(first_accumulates)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_body(group_started)


@pytest.mark.parametrize("target, accumulate", [("trn2", True), ("trn1", None)])
def test_accumulating_onto_memset_psum_on_trn1_trn2_warns_and_accumulates(target, accumulate):
    """nki/api/nki/isa/__init__.py, nc_matmul, Accumulation mode: on NeuronCore-v2/v3 accumulating onto
    PSUM initialised by memset/tensor_copy is undefined; AWS's own trn2 kernel (nki-library's
    attention_bwd) relies on it summing, so the simulator warns and accumulates. accumulate=False
    starts the group without a warning, and on Trn3 the rule does not apply."""

    def kernel(x, accumulate):
        out = nl.ndarray((32, 16), nl.float32, buffer=nl.shared_hbm)
        acc = ps((32, 16))
        nisa.memset(acc, 1.0)
        nisa.nc_matmul(acc, sb((64, 32), value=1.0), sb((64, 16), value=1.0), accumulate=accumulate)
        result = sb((32, 16))
        nisa.tensor_copy(dst=result, src=acc)
        nisa.dma_copy(dst=out, src=result)
        return out

    with pytest.warns(
        sim.AccumulateOntoNonMatmulWarning,
        match=rf"nisa\.nc_matmul: dst: accumulating onto PSUM written by a non-matmul .* \(target={target}\)",
    ):
        summed = sim.run(kernel, DUMMY, accumulate, target=target).outputs
    np.testing.assert_array_equal(summed, 65.0)  # the memset's 1 plus 64 products of 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(sim.run(kernel, DUMMY, False, target=target).outputs, 64.0)
        np.testing.assert_array_equal(sim.run(kernel, DUMMY, accumulate, target="trn3").outputs, 65.0)


@pytest.mark.parametrize("key", ["empty", "reversed", "slice-method"])
def test_slices_need_start_below_end(key):
    """nki/api/nki/language/__init__.py, NkiTensor.slice: ``0 <= start < end <= t.shape[dim]``."""
    views = {
        "empty": lambda t: t[:, 3:3],
        "reversed": lambda t: t[:, 3:1],
        "slice-method": lambda t: t.slice(1, 3, 3),
    }

    def body():
        views[key](sb((8, 4)))

    with pytest.raises(IndexError, match=r"slice 3:\d of dim 1 .* is empty: start must be below end"):
        run_body(body)
    run_body(lambda: sb((8, 4))[:, 3:4].slice(1, 0, 1))


def _spmd(x):
    out = nl.ndarray((1, 1), F32, buffer=nl.shared_hbm)
    if nl.program_id(0) == 0:
        nisa.dma_copy(dst=out, src=x)
    return out


@pytest.mark.parametrize("grid", [4, (2, 2), 3])
def test_strict_lnc_takes_one_degree_of_1_or_2(grid, monkeypatch):
    """nki/get-started/about/lnc.rst: "The bracket syntax must contain only one number, the number
    of cores to use" (1 or 2). Wider SPMD grids stay available as the simulator's extension."""
    with pytest.raises(sim.NkiValidationError, match=r"launch bracket: NKI takes one LNC degree, 1 or 2 .*extension"):
        sim.run(_spmd, DUMMY, grid=grid, strict_lnc=True)
    monkeypatch.setenv("KERNELS_NEURON_STRICT_LNC", "1")
    with pytest.raises(sim.NkiValidationError, match="launch bracket"):
        sim.run(_spmd, DUMMY, grid=grid)
    monkeypatch.delenv("KERNELS_NEURON_STRICT_LNC")
    sim.run(_spmd, DUMMY, grid=grid)  # the extension, outside strict mode
    sim.run(_spmd, DUMMY, grid=2, strict_lnc=True)
    sim.run(_spmd, DUMMY, strict_lnc=True)


def test_tensor_scalar_on_gpsimd_takes_more_than_rsqrt_as_the_readme_states():
    """A deliberate difference (README, "How it differs from hardware"): AWS's docstring allows an explicit
    GpSimd engine for rsqrt only; the simulator accepts the arithmetic operators GpSimd implements, as this
    project's attention kernel uses them, and computes them exactly."""

    def kernel(x):
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        data, result = sb((4, 8), value=3.0), sb((4, 8), value=0.0)
        nisa.tensor_scalar(result, data, nl.maximum, 5.0, op1=nl.divide, operand1=2.0, engine=nisa.engine.gpsimd)
        nisa.dma_copy(dst=out, src=result)
        return out

    result = sim.run(kernel, DUMMY)
    np.testing.assert_array_equal(result.outputs, 2.5)
    assert [i.engine for i in result.trace if i.op == "tensor_scalar"] == ["gpsimd"]
