"""The simulator's front door: nki.jit / nki.simulate, torch and NumPy arguments, SPMD launches,
``sim.install()``, ``python -m kernels_neuron.sim``, target selection and tile-size constants."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
import torch

from kernels_neuron import sim
from kernels_neuron.sim import isa as nisa
from kernels_neuron.sim import language as nl
from kernels_neuron.sim.targets import TARGET_ENV_VAR


@sim.jit
def scale_by_three(x):
    tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x)
    nisa.tensor_scalar(dst=tile, data=tile, op0=nl.multiply, operand0=3.0)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


@sim.jit
def negate_in_place(x):
    tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x)
    nisa.tensor_scalar(dst=tile, data=tile, op0=nl.multiply, operand0=-1.0)
    nisa.dma_copy(dst=x, src=tile)


# -- torch and NumPy arguments ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32])
def test_torch_in_torch_out_same_dtype(dtype):
    x = (torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6) - 7).to(dtype)
    out = scale_by_three(x)
    assert isinstance(out, torch.Tensor)
    assert out.dtype == dtype and out.shape == x.shape and out.device.type == "cpu"
    torch.testing.assert_close(out, (x.to(torch.float32) * 3).to(dtype), rtol=0, atol=0)


def test_numpy_in_numpy_out():
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    out = scale_by_three(x)
    assert isinstance(out, np.ndarray) and out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out, (x.astype(np.float32) * 3).astype(ml_dtypes.bfloat16))


def test_in_place_write_reaches_a_numpy_argument():
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert negate_in_place(x) is None
    np.testing.assert_array_equal(x, -np.arange(8, dtype=np.float32).reshape(2, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_write_reaches_a_torch_argument(dtype):
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4).to(dtype)
    negate_in_place(x)
    torch.testing.assert_close(x, -torch.arange(8, dtype=torch.float32).reshape(2, 4).to(dtype), rtol=0, atol=0)


def test_keyword_and_non_tensor_arguments_pass_through():
    @sim.jit(mode="simulation")
    def add_const(x, value=0.0, times=1):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        for _ in range(times):
            nisa.tensor_scalar(dst=tile, data=tile, op0=nl.add, operand0=value)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out, times

    out, times = add_const(np.zeros((2, 3), np.float32), value=1.5, times=3)
    assert times == 3
    np.testing.assert_array_equal(out, 4.5)


# -- SPMD ---------------------------------------------------------------------------------------
def _write_row(out_row, values):
    tile = nl.ndarray((1, len(values)), nl.float32, buffer=nl.sbuf)
    for j, v in enumerate(values):
        nisa.memset(tile[:, j : j + 1], float(v))
    nisa.dma_copy(dst=out_row, src=tile)


@sim.jit
def spmd_1d(x):
    out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
    i = nl.program_id(0)
    _write_row(out[i], [i, nl.program_id(), nl.num_programs(), nl.program_ndim()])
    return out


@sim.jit
def spmd_2d(x):
    out = nl.ndarray((2, 3, 6), nl.float32, buffer=nl.shared_hbm)
    i, j = nl.program_id(0), nl.program_id(axis=1)
    _write_row(
        out[i, j], [i, j, nl.num_programs(), nl.num_programs(axes=1), nl.num_programs(axes=(0, 1)), nl.program_ndim()]
    )
    return out


def test_spmd_1d_grid():
    out = spmd_1d[4](np.zeros((1, 1), np.float32))
    expected = np.array([[i, i, 4, 1] for i in range(4)], np.float32)
    np.testing.assert_array_equal(out, expected)


def test_spmd_2d_grid():
    result = sim.run(spmd_2d, np.zeros((1, 1), np.float32), grid=(2, 3))
    expected = np.array([[[i, j, 2, 3, 6, 2] for j in range(3)] for i in range(2)], np.float32)
    np.testing.assert_array_equal(result.outputs, expected)
    np.testing.assert_array_equal(spmd_2d[2, 3](np.zeros((1, 1), np.float32)), expected)
    programs = sorted({inst.program for inst in result.trace})
    assert programs == [(i, j) for i in range(2) for j in range(3)]


def test_no_grid_is_one_program_with_ndim_zero():
    @sim.jit
    def ids(x):
        return nl.program_id(0), nl.num_programs(), nl.program_ndim()

    assert ids(np.zeros((1, 1), np.float32)) == (0, 1, 0)


def test_program_id_outside_the_grid_is_an_error():
    with pytest.raises(IndexError, match=r"nl\.program_id: axis 1 outside a 1-d launch grid \(4,\)"):
        sim.jit(lambda x: nl.program_id(1))[4](np.zeros((1, 1), np.float32))


# -- nki.simulate, install, python -m ------------------------------------------------------------
def test_install_makes_import_nki_the_simulator(monkeypatch):
    for name in ("nki", "nki.language", "nki.isa"):  # restored after the test, whatever it does
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert sim.real_nki_available() is False
    assert sim.install() == "simulator"
    import nki
    import nki.isa
    import nki.language

    assert nki.language is nl and nki.isa is nisa and nki.jit is sim.jit
    assert getattr(nki, "__kernels_neuron_simulator__", False)
    assert sim.install() == "simulator"  # idempotent
    assert sim.real_nki_available() is False  # the simulator does not count as real NKI
    sim.uninstall()
    assert "nki" not in sys.modules


def test_nki_simulate_runs_a_plain_function():
    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=x)
        return out

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    sim.install()
    import nki

    np.testing.assert_array_equal(nki.simulate(kernel)(x), x)
    np.testing.assert_array_equal(nki.simulate(scale_by_three)(x), 3 * x)
    np.testing.assert_array_equal(nki.simulate(spmd_1d)[4](x)[:, 0], np.arange(4))


def test_python_m_runs_a_script_with_nki(tmp_path):
    script = tmp_path / "uses_nki.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        import numpy as np
        import nki
        import nki.isa as nisa
        import nki.language as nl

        @nki.jit
        def add_one(x):
            t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x)
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
            out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out, src=t)
            return out

        print("RESULT", add_one(np.arange(3, dtype=np.float32).reshape(1, 3)).tolist(), sys.argv[1:])
    """)
    )
    done = subprocess.run(
        [sys.executable, "-m", "kernels_neuron.sim", str(script), "a", "b"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "RESULT [[1.0, 2.0, 3.0]] ['a', 'b']" in done.stdout
    assert "nki backend: simulator" in done.stderr


# -- targets --------------------------------------------------------------------------------------
@sim.jit
def target_facts(x):
    return (
        nisa.get_nc_version(),
        nl.tile_size.pmax,
        nl.tile_size.gemm_stationary_fmax,
        nl.tile_size.gemm_moving_fmax,
        nl.tile_size.psum_fmax,
        nl.tile_size.total_available_sbuf_size,
    )


@pytest.mark.parametrize(
    "env, version, name, moving, sbuf",
    [
        ("trn1", "gen2", "trn1", 512, 192 * 1024),
        ("gen3", "gen3", "trn2", 512, 224 * 1024),
        ("trn3", "gen4", "trn3", 512, 256 * 1024),
        (None, "gen3", "trn2", 512, 224 * 1024),
    ],
)
def test_target_from_environment(monkeypatch, env, version, name, moving, sbuf):
    if env is None:
        monkeypatch.delenv(TARGET_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(TARGET_ENV_VAR, env)
    result = sim.run(target_facts, np.zeros((1, 1), np.float32))
    assert result.trace.target == name
    assert result.outputs == (nisa.nc_version(version), 128, 128, moving, 512, sbuf)
    assert target_facts(np.zeros((1, 1), np.float32))[0] == nisa.nc_version(version)


def test_explicit_target_beats_the_environment(monkeypatch):
    monkeypatch.setenv(TARGET_ENV_VAR, "trn1")
    result = sim.run(target_facts, np.zeros((1, 1), np.float32), target="trn3")
    assert result.trace.target == "trn3" and result.outputs[0] == nisa.nc_version.gen4


def test_unknown_target_is_an_error(monkeypatch):
    monkeypatch.setenv(TARGET_ENV_VAR, "trn9")
    with pytest.raises(ValueError, match=r"unknown NeuronCore target 'trn9'"):
        sim.run(target_facts, np.zeros((1, 1), np.float32))


def test_tile_size_constants_outside_a_kernel(monkeypatch):
    monkeypatch.delenv(TARGET_ENV_VAR, raising=False)
    assert nl.tile_size.pmax == 128
    assert nl.tile_size.gemm_stationary_fmax == 128
    assert nl.tile_size.gemm_moving_fmax == 512
    assert nl.tile_size.psum_fmax == 512
    assert nl.tile_size.bn_stats_fmax == 512
    # AWS's Trn3-only MX matmul examples size their moving tiles with it as 512 (nc_matmul on
    # NeuronCore-v4 accepts up to 4096 fp32 columns; that limit is checked by the instruction).
    monkeypatch.setenv(TARGET_ENV_VAR, "trn3")
    assert nl.tile_size.gemm_moving_fmax == 512


def test_nki_calls_need_a_running_kernel():
    with pytest.raises(sim.NoActiveKernel, match=r"only work inside a running kernel"):
        nl.ndarray((2, 2), nl.float32, buffer=nl.sbuf)


def test_a_jit_kernel_called_inside_a_kernel_is_inlined():
    @sim.jit
    def outer(x):
        doubled = scale_by_three(x)  # another @nki.jit kernel: runs in the same launch
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=doubled)
        nisa.tensor_scalar(dst=tile, data=tile, op0=nl.add, operand0=1.0)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    result = sim.run(outer, x, target="trn1")
    np.testing.assert_array_equal(result.outputs, 3 * x + 1)
    assert [i.op for i in result.trace] == [
        "dma_copy",
        "tensor_scalar",
        "dma_copy",
        "dma_copy",
        "tensor_scalar",
        "dma_copy",
    ]
    assert result.trace.target == "trn1"


# --- API surface nki-library kernels rely on --------------------------------------------------


@sim.jit
def _enum_spellings(x):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x, dge_mode=3)  # nki-library passes the raw int for dge_mode.none
    acc = nl.ndarray((x.shape[1], x.shape[1]), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(acc, t, t, perf_mode="none")
    nisa.activation(dst=t, op=nl.copy, data=t, reduce_cmd="idle")
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t, dge_mode=nisa.dge_mode.none, oob_mode="error")
    return out


def test_enum_arguments_accept_members_names_and_indices():
    x = np.arange(128 * 16, dtype=np.float32).reshape(128, 16)
    np.testing.assert_array_equal(_enum_spellings(x), x)
    assert (
        nisa.dge_mode(3) is nisa.dge_mode.none
        and nisa.matmul_perf_mode("double_row") is nisa.matmul_perf_mode.double_row
    )
    with pytest.raises(ValueError):
        nisa.dge_mode("warp")


def test_nc_version_is_ordered():
    assert nisa.nc_version.gen2 < nisa.nc_version.gen3 < nisa.nc_version.gen4
    assert nisa.nc_version.gen4 >= nisa.nc_version.gen3


@sim.jit
def _view_facts(x):
    t = nl.ndarray((128, 4, 8), nl.float32, buffer=nl.sbuf, name=None, address=(0, 0))
    v = t[:, 1:3, ::2].permute(dims=[0, 2, 1])
    facts = {
        "strides": v.strides,
        "offset": v.offset,
        "pattern": v.get_pattern(),
        "contiguous": (t.is_contiguous(), v.is_contiguous()),
        "indirect": v.is_indirect(),
        "cast": t.reinterpret_cast(nl.bfloat16).shape,
        "par_dim": nl.par_dim(7),
    }
    return facts


def test_view_introspection():
    facts = _view_facts(np.zeros((1, 1), np.float32))
    assert facts["strides"] == (32, 2, 8) and facts["offset"] == 8
    assert facts["pattern"] == [[32, 128], [2, 4], [8, 2]]
    assert facts["contiguous"] == (True, False) and facts["indirect"] is False
    assert facts["cast"] == (128, 4, 16) and facts["par_dim"] == 7


@sim.jit
def _loops(x):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nl.fori_loop(0, 3, lambda i: nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0))
    remaining = [2]

    def body(r):
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        remaining[0] -= 1
        nisa.register_move(r, remaining[0])
        return r

    nl.while_loop(nisa.register_alloc(1), body)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_fori_loop_and_while_loop():
    x = np.zeros((128, 4), np.float32)
    np.testing.assert_array_equal(_loops(x), np.full((128, 4), 12.0, np.float32))  # (0+3)*2*2


@sim.jit
def _rsqrt_engine(x, explicit):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    if explicit:
        nisa.tensor_scalar(dst=t, data=t, op0=nl.rsqrt, operand0=0.0, engine=nisa.engine.vector)
    else:
        nisa.tensor_scalar(dst=t, data=t, op0=nl.rsqrt, operand0=0.0)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_alu_operators_run_only_on_the_engines_that_implement_them():
    x = np.full((128, 4), 4.0, np.float32)
    result = sim.run(_rsqrt_engine, x, False)
    np.testing.assert_allclose(result.outputs, 0.5)
    assert [i.engine for i in result.trace if i.op == "tensor_scalar"] == ["gpsimd"]
    with pytest.raises(sim.NkiValidationError, match="vector cannot run this instruction"):
        _rsqrt_engine(x, True)
