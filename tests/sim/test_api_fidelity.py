"""The simulator against the behaviour AWS's NKI API documents, case by case.

Each test follows one statement of the spec (the ``nki/api`` package and the ``nki`` rst pages of
aws-neuron-sdk; the page is named in the test's docstring) and uses the docs' own example where
there is one. Expected values are written out here, never computed with the simulator's helpers.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass

import ml_dtypes
import numpy as np
import pytest
from kernel_io import run_body, to_hbm, to_sbuf

from kernels_neuron import sim

sim.install()

import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

BF16 = ml_dtypes.bfloat16


def sb(shape, dtype):
    return nl.ndarray(tuple(shape), dtype, buffer=nl.sbuf)


# ---------------------------------------------------------------------------------------------
# operators
# ---------------------------------------------------------------------------------------------
def test_right_shift_is_a_logical_shift():
    """nki.api.shared.rst, the operator table: "Logical Shift Right: nki.language.right_shift";
    an arithmetic shift right is "Not supported"."""
    x = np.full((4, 8), -8, np.int32)

    def body(t):
        by_isa = sb(t.shape, nl.int32)
        nisa.tensor_scalar(dst=by_isa, data=t, op0=nl.right_shift, operand0=1)
        return by_isa, nl.right_shift(t, 1)

    by_isa, by_language = run_body(body, x).outputs
    np.testing.assert_array_equal(by_isa, np.full((4, 8), 2147483644, np.int32))
    np.testing.assert_array_equal(by_language, np.full((4, 8), 2147483644, np.int32))


# ---------------------------------------------------------------------------------------------
# casts on write
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, values, expected",
    [
        ("int32", [3e9, -3e9, 2.5, -2.5, 3.5], [2**31 - 1, -(2**31), 2, -2, 4]),
        ("uint32", [5e9, -1.0, 4294967040.0, 0.5, 1.5], [2**32 - 1, 0, 4294967040, 0, 2]),
    ],
)
def test_float_to_int32_writes_round_to_nearest_even_and_saturate(dtype, values, expected):
    """nki/api/nki/isa/__init__.py (tensor_copy and others): results are cast on write; casts
    round to nearest even and saturate. The clip must happen where 2**31 - 1 is exact."""
    x = np.tile(np.array(values, np.float32), (2, 1))

    def body(t):
        dst = sb(t.shape, getattr(nl, dtype))
        nisa.tensor_copy(dst=dst, src=t)
        return dst

    out = run_body(body, x).outputs
    np.testing.assert_array_equal(out, np.tile(np.array(expected, dtype=dtype), (2, 1)))


# ---------------------------------------------------------------------------------------------
# nki.language
# ---------------------------------------------------------------------------------------------
def test_nl_copy_is_a_bit_exact_vector_engine_copy():
    """nki/api/nki/language/__init__.py, copy: "Create a copy of the input tile"; only a differing
    ``dtype`` may lose precision. 2**24 + 1 does not survive an fp32 activation."""
    x = np.full((8, 4), 16777217, np.int32)

    def body(t):
        return nl.copy(t)

    result = run_body(body, x)
    np.testing.assert_array_equal(result.outputs, x)
    ops = [(i.engine, i.op) for i in result.trace if i.engine != "dma"]
    assert ops == [("vector", "tensor_copy")]


def test_activation_sin_extrapolates_a_cubic_outside_pi_and_nl_sin_reduces_the_range():
    """nki.api.shared.rst, the note under the activation table: ``activation(op=nl.sin)`` does no
    range reduction, extrapolates a cubic outside [-PI, PI] and ``sin(9.0)`` returns ~27.65;
    ``nl.sin`` reduces the range first and stays accurate."""
    x = np.tile(np.array([9.0, -9.0, 1.0, -2.5], np.float32), (4, 1))

    def body(t):
        raw = sb(t.shape, nl.float32)
        nisa.activation(dst=raw, op=nl.sin, data=t)
        return raw, nl.sin(t)

    raw, reduced = run_body(body, x).outputs
    assert raw[0, 0] == pytest.approx(27.65, abs=0.01)
    assert raw[0, 1] == pytest.approx(-27.65, abs=0.01)
    np.testing.assert_allclose(raw[:, 2:], np.sin(x[:, 2:]), rtol=1e-6)
    np.testing.assert_allclose(reduced, np.sin(x.astype(np.float64)), atol=2e-6)


def test_while_loop_passes_the_condition_register_to_the_body():
    """nki/api/nki/language/__init__.py, while_loop: ``r = init; while r != 0: r = body_fun(r)``;
    the docs' example counts a register down through SBUF."""
    count = np.full((1, 1), 3, np.int32)
    val = np.full((1, 1), 2.5, np.float32)

    @nki.jit
    def kernel(count_input, data):
        v = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=v, src=data)
        acc = nl.zeros((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        count_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=count_sb, src=count_input)
        one_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=one_sb, value=1)
        reg = nisa.register_alloc()
        nisa.register_load(reg, count_sb)
        seen = []

        def body(r):
            seen.append(int(r))
            nisa.tensor_tensor(dst=acc, data1=acc, data2=v, op=nl.add)
            nisa.tensor_tensor(dst=count_sb, data1=count_sb, data2=one_sb, op=nl.subtract)
            nisa.register_load(r, count_sb)
            return r

        nl.while_loop(reg, body)
        assert seen == [3, 2, 1]
        return to_hbm(acc)

    np.testing.assert_array_equal(kernel(count, val), np.full((1, 1), 7.5, np.float32))


def test_fori_loop_takes_a_step():
    """nki/api/nki/language/__init__.py: ``fori_loop(lower, upper, body_fun, step=1)``."""
    seen = []

    @nki.jit
    def kernel(x):
        nl.fori_loop(1, 8, seen.append, step=3)
        with pytest.raises(sim.NkiValidationError, match=r"nl\.fori_loop: step: must be a compile-time positive"):
            nl.fori_loop(0, 4, seen.append, step=0)
        return to_hbm(to_sbuf(x))

    kernel(np.zeros((1, 1), np.float32))
    assert seen == [1, 4, 7]


def test_mean_keeps_fp32_intermediates():
    """nki/api/nki/language/__init__.py, mean: "Float32 intermediate values are used for the
    computation": the bf16 result is rounded once, from the fp32 mean."""
    rng = np.random.default_rng(7)
    x = rng.uniform(0.5, 4.0, size=(128, 96)).astype(BF16)

    def body(t):
        return nl.mean(t, axis=1)

    out = run_body(body, x).outputs
    expected = (x.astype(np.float64).sum(axis=1) / 96).astype(np.float32).astype(BF16)
    np.testing.assert_array_equal(out.reshape(-1).view(np.uint16), expected.view(np.uint16))


# ---------------------------------------------------------------------------------------------
# nki.isa search instructions
# ---------------------------------------------------------------------------------------------
def test_nc_find_index8_pairs_duplicates_in_order_and_marks_absent_values():
    """nki/api/nki/isa/__init__.py: nc_find_index8 gives an absent value the all-ones sentinel
    (0xFFFFFFFF for uint32, 0xFFFF for uint16); nc_match_replace8's docstring: find_index8 pairs
    duplicate vals with their matching positions in ascending order."""
    data = np.tile(np.array([1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8], np.float32), (2, 1))
    vals = np.tile(np.array([3, 8, 8, 8, 8, 8, 8, 7], np.float32), (2, 1))

    def body(d, v):
        d32, d16 = sb((2, 8), nl.uint32), sb((2, 8), nl.uint16)
        nisa.nc_find_index8(dst=d32, data=d, vals=v)
        nisa.nc_find_index8(dst=d16, data=d, vals=v)
        return d32, d16

    d32, d16 = run_body(body, data, vals).outputs
    np.testing.assert_array_equal(d32[0], [2, 4, 5, 6, 7, 8, 9, 0xFFFFFFFF])
    np.testing.assert_array_equal(d16[0], [2, 4, 5, 6, 7, 8, 9, 0xFFFF])


def test_nc_match_replace8_processes_vals_in_reverse():
    """nki/api/nki/isa/__init__.py, nc_match_replace8: data [1, 2, 3, 4, 8 x 7] with vals
    [3, 8 x 7] gives dst_idx [2, 10, 9, 8, 7, 6, 5, 4]."""
    data = np.tile(np.array([1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8], np.float32), (2, 1))
    vals = np.tile(np.array([3, 8, 8, 8, 8, 8, 8, 8], np.float32), (2, 1))

    def body(d, v):
        dst, idx = sb(d.shape, nl.float32), sb((2, 8), nl.uint32)
        nisa.nc_match_replace8(dst=dst, data=d, vals=v, imm=-1.0, dst_idx=idx)
        return dst, idx

    dst, idx = run_body(body, data, vals).outputs
    np.testing.assert_array_equal(idx[0], [2, 10, 9, 8, 7, 6, 5, 4])
    np.testing.assert_array_equal(dst[0], [1, 2, -1, 4, -1, -1, -1, -1, -1, -1, -1])


# ---------------------------------------------------------------------------------------------
# enums
# ---------------------------------------------------------------------------------------------
def test_enum_integers_are_the_documented_values():
    """nki/api/nki/isa/__init__.py: engine.unknown = 0, engine.tensor = 1, ... engine.vector = 5;
    dma_engine.dma = 1; nc_version.gen2/3/4 = 2/3/4; dge_mode.none = 3."""
    assert nisa.engine(0) is nisa.engine.unknown
    assert nisa.engine(1) is nisa.engine.tensor
    assert nisa.engine(5) is nisa.engine.vector
    assert nisa.dma_engine(1) is nisa.dma_engine.dma
    assert nisa.nc_version(3) is nisa.nc_version.gen3
    assert nisa.dge_mode(3) is nisa.dge_mode.none
    assert nisa.reduce_cmd(3) is nisa.reduce_cmd.reset_reduce
    assert nisa.engine.tensor.value == 1 and nisa.nc_version.gen4.value == 4
    assert nisa.engine("VECTOR") is nisa.engine.vector  # names still resolve, as nki-library passes them


def test_an_engine_given_by_its_documented_integer_selects_that_engine():
    x = np.ones((4, 8), np.float32)

    def body(t):
        dst = sb(t.shape, nl.float32)
        nisa.tensor_scalar(dst=dst, data=t, op0=nl.multiply, operand0=2.0, engine=5)  # vector, not sync
        return dst

    result = run_body(body, x)
    assert [i.engine for i in result.trace if i.op == "tensor_scalar"] == ["vector"]


# ---------------------------------------------------------------------------------------------
# user classes and optional arguments
# ---------------------------------------------------------------------------------------------
@dataclass
class _SectionParams(nl.NKIObject):  # the shape of nki-library's attention_cte.SectionParams
    section_idx = None
    section_offset = None
    section_contains_prefix = None


class _Plain(nl.NKIObject):  # the docs' class C, without @dataclass
    x: int
    y: bool = False

    def toggle(self):
        self.y = not self.y


@dataclass
class _Decorated(nl.NKIObject):
    x: int
    y: bool = False


@dataclass(frozen=True)
class _Frozen(nl.NKIObject):  # nki-library's mlp_cte tile info is a frozen dataclass
    x: int = 0


def test_nki_objects_behave_like_dataclasses_with_or_without_the_decorator():
    """nki-language-guide.rst, "Class Support": classes with and without @dataclass compile the
    same way; the default initializer is ``__init__(self, x=None, y=False)``."""
    params = _SectionParams(section_idx=2, section_offset=128)
    assert (params.section_idx, params.section_offset, params.section_contains_prefix) == (2, 128, None)
    c = _Plain(1)
    c.toggle()
    assert (c.x, c.y) == (1, True)
    assert _Plain().x is None and _Plain(y=True).y is True
    assert _Plain(1) == _Plain(x=1) and _Plain(1) != _Plain(2)
    assert (_Decorated(1).x, _Decorated(1).y) == (1, False)
    assert _Decorated(1) != _Decorated(2) and _SectionParams(section_idx=1) != _SectionParams(section_idx=2)
    with pytest.raises(TypeError, match="no field 'z'"):
        _Plain(z=1)
    frozen = _Frozen(3)
    assert frozen.x == 3
    with pytest.raises(FrozenInstanceError):
        frozen.x = 4  # type: ignore[misc]


def test_a_tensor_compared_with_none_is_a_python_check():
    """nki-library compares optional tensor arguments with None (``if bias != None``): NKI's front
    end answers those in Python; they are not element-wise instructions."""
    x = np.ones((4, 8), np.float32)
    answers = []

    def body(t):
        answers.extend([t == None, t != None])  # noqa: E711  (the NKI idiom under test)
        return t

    result = run_body(body, x)
    assert answers == [False, True]
    assert [i.op for i in result.trace] == ["dma_copy", "dma_copy"]


# -- nl.broadcast_to over the partition dim ----------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32])
def test_broadcast_to_repeats_one_partition_as_a_new_tile(dtype):
    """nki/api/nki/language ``broadcast_to`` returns "a tile with the target shape containing broadcast
    values from x"; the architecture guide (trainium_inferentia2_arch.rst, "Partition Broadcast") says NKI
    makes it with ``nc_matmul(ones, x, is_stationary_onezero=True)``. AWS's mamba tutorial relies on it:
    ``nl.broadcast_to(B_i, (128, seq_len))`` of a [1, seq_len] SBUF tile. Wider than one matmul (512 columns),
    and with a free dim broadcast on top."""
    row = (np.arange(1, 1301).reshape(1, 1300, 1) * 3).astype(dtype)

    def body(x):
        return nl.broadcast_to(x, (128, 1300, 2))

    result = run_body(body, row)
    np.testing.assert_array_equal(result.outputs, np.broadcast_to(row, (128, 1300, 2)))
    matmuls = [i for i in result.trace if i.op == "nc_matmul"]
    assert [i.attrs["N"] for i in matmuls] == [512, 512, 276] and all(i.attrs["onezero"] for i in matmuls)


def test_broadcast_to_casts_to_the_dtype_asked_for():
    row = np.array([[0.1, 0.2, 0.3]], np.float32)

    def body(x):
        out = nl.broadcast_to(x, (4, 3), dtype=nl.bfloat16)
        assert out.dtype == nl.bfloat16 and out.buffer == nl.sbuf
        return out

    expected = np.broadcast_to(row.astype(ml_dtypes.bfloat16), (4, 3))
    np.testing.assert_array_equal(run_body(body, row).outputs, expected)


def test_an_instruction_operand_still_cannot_broadcast_the_partition_dim():
    """NkiTensor.broadcast / broadcast_to views: "On-chip tensors: dim must not be 0"; only the language
    function materialises a partition broadcast."""

    def body(x):
        return x.broadcast_to((4, 3))

    with pytest.raises(
        sim.NkiValidationError, match=r"the partition dim \(0\) of an on-chip tensor cannot be broadcast"
    ):
        run_body(body, np.ones((1, 3), np.float32))
