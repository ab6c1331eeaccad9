"""How much of AWS's documented NKI API the simulator runs.

``DOCUMENTED`` lists the public names of AWS's API pages (the ``nki/api/nki/**/__init__.py`` stubs
of the aws-neuron-sdk docs, NKI 0.6/0.7): module functions, classes and constants, the ``NkiTensor``
methods and the ``tile_size`` attributes. The simulator runs every one of them, and the README's
coverage figure says so.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernels_neuron import sim

sim.install()

import nki  # noqa: E402
import nki.collectives as ncc  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

DOCUMENTED = {
    "nki": """
        jit simulate
    """.split(),
    "nki.language": """
        bool_ int8 int16 int32 uint8 uint16 uint32 float16 float32 bfloat16 tfloat32 float8_e4m3
        float8_e4m3fn float8_e5m2 float8_e5m2_x4 float8_e4m3fn_x4 float8_e8m0fnu float4_e2m1fn_x4 sbuf
        psum hbm private_hbm shared_hbm tile_size average prelu bypass MemoryRegion NKIObject NkiTensor
        NkiTensor.shape NkiTensor.strides NkiTensor.offset NkiTensor.name NkiTensor.dtype
        NkiTensor.buffer NkiTensor.ndim NkiTensor.size NkiTensor.is_contiguous NkiTensor.get_pattern
        NkiTensor.is_indirect NkiTensor.permute NkiTensor.broadcast NkiTensor.expand_dim
        NkiTensor.squeeze_dim NkiTensor.reshape_dim NkiTensor.flatten_dims NkiTensor.reshape
        NkiTensor.rearrange NkiTensor.slice NkiTensor.select NkiTensor.vector_select NkiTensor.ap
        NkiTensor.view NkiTensor.indirect tile_size.pmax tile_size.psum_fmax tile_size.psum_bank_fmax
        tile_size.psum_bank_fmax_bytes tile_size.gemm_stationary_fmax tile_size.gemm_moving_fmax
        tile_size.bn_stats_fmax tile_size.psum_min_align tile_size.sbuf_min_align
        tile_size.psum_num_banks tile_size.sbuf_size_bytes tile_size.sbuf_fmax tile_size.sbuf_fmax_bytes
        tile_size.total_available_sbuf_size is_hbm is_on_chip is_psum is_sbuf add subtract multiply
        divide maximum minimum abs_max abs_min abs square power equal not_equal less less_equal greater
        greater_equal bitwise_and bitwise_or bitwise_xor invert left_shift right_shift logical_and
        logical_or logical_xor logical_not exp log sqrt rsqrt tanh sigmoid relu gelu gelu_apprx_sigmoid
        gelu_apprx_tanh gelu_dx gelu_apprx_sigmoid_dx silu silu_dx softplus mish erf erf_dx reciprocal
        copy sin cos tan arctan ceil floor trunc negative sign fmod mod sum max min mean prod var all
        softmax rms_norm where dropout ones full zeros_like empty_like random_seed expand_dims
        broadcast_to transpose matmul no_reorder load_transpose2d gather_flattened ds affine_range
        sequential_range static_range dynamic_range fori_loop while_loop ndarray zeros load store
        program_id num_programs program_ndim shared_constant shared_identity_matrix device_print rand
    """.split(),
    "nki.isa": """
        tensor_engine vector_engine scalar_engine gpsimd_engine unknown_engine engine reduce_cmd
        dge_mode oob_mode matmul_perf_mode nc_version dma_engine NkiInstruction
        NkiInstruction.depends_on NkiValidationError VirtualRegister get_nc_sub_version get_nc_version
        dma_copy tensor_copy memset tensor_copy_predicated nc_matmul nc_matmul_mx nc_transpose
        dma_transpose tensor_tensor tensor_scalar tensor_reduce tensor_partition_reduce
        tensor_scalar_cumulative activation activation_reduce activate2 iota affine_select local_gather
        nc_n_gather bn_stats bn_aggr tensor_tensor_scan nc_stream_shuffle rng dropout set_rng_seed
        rand_set_state rand_get_state rand2 exponential reciprocal max8 sequence_bounds
        scalar_tensor_tensor tensor_scalar_reduce core_barrier dma_compute quantize_mx range_select
        select_reduce sendrecv register_alloc register_move register_load register_store nc_find_index8
        nc_match_replace8 nonzero_with_count topk
    """.split(),
    "nki.collectives": """
        ReplicaGroup all_reduce all_gather all_gather_v reduce_scatter all_to_all all_to_all_v
        collective_permute collective_permute_implicit collective_permute_implicit_reduce
        collective_permute_implicit_current_processing_rank_id rank_id
    """.split(),
}
MODULES = {"nki": nki, "nki.language": nl, "nki.isa": nisa, "nki.collectives": ncc}


def _lookup(module: str, name: str):
    """The simulator's object for a documented name (AttributeError when it has none)."""
    if module not in MODULES:
        raise AttributeError(module)
    parts = name.split(".")
    obj = nl.NkiTensor if parts[0] == "NkiTensor" else MODULES[module]
    for part in parts[1:] if parts[0] == "NkiTensor" else parts:
        obj = getattr(obj, part)
    return obj


def _documented():
    return [(module, name) for module, names in DOCUMENTED.items() for name in names]


@pytest.mark.parametrize("module, name", _documented())
def test_documented_name_is_there(module, name):
    _lookup(module, name)


def test_readme_states_the_coverage():
    total = len(_documented())
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    stated = re.search(r"\*\*(\d+) of\s+(\d+)\*\*", readme)
    assert stated is not None and (int(stated[1]), int(stated[2])) == (total, total) == (254, 254)
