"""The NeuronCore generations the simulator can check a kernel against.

Limits are the ones AWS documents for NKI (see ``docs/hardware.md`` for each with its source, and the
``nki.isa`` API reference). The cost model keeps its own table of speeds; this one holds only what decides
whether a kernel is legal.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

TARGET_ENV_VAR = "NEURON_PLATFORM_TARGET_OVERRIDE"
KIB = 1024


@dataclass(frozen=True)
class Target:
    name: str
    nc_version: str  # "gen2" | "gen3" | "gen4", as nki.isa.nc_version names them
    partitions: int
    sbuf_bytes_per_partition: int
    psum_bytes_per_partition: int
    psum_bank_bytes: int
    gemm_stationary_fmax: int
    gemm_moving_fmax: int
    matmul_dst_dtypes: tuple[str, ...]
    has_hwdge: bool
    has_fp8_double_row: bool
    has_exponential: bool
    bias_scalar_allowed: bool
    scalar_engine_tensor_copy: bool

    generation: int = field(init=False)  # the number in nc_version, asked for on every instruction

    def __post_init__(self) -> None:
        object.__setattr__(self, "generation", int(self.nc_version.removeprefix("gen")))


TRN1 = Target(
    name="trn1",
    nc_version="gen2",
    partitions=128,
    sbuf_bytes_per_partition=192 * KIB,
    psum_bytes_per_partition=16 * KIB,
    psum_bank_bytes=2 * KIB,
    gemm_stationary_fmax=128,
    gemm_moving_fmax=512,
    matmul_dst_dtypes=("float32",),
    has_hwdge=False,
    has_fp8_double_row=False,
    has_exponential=False,
    bias_scalar_allowed=False,
    scalar_engine_tensor_copy=False,
)
TRN2 = Target(
    name="trn2",
    nc_version="gen3",
    partitions=128,
    sbuf_bytes_per_partition=224 * KIB,
    psum_bytes_per_partition=16 * KIB,
    psum_bank_bytes=2 * KIB,
    gemm_stationary_fmax=128,
    gemm_moving_fmax=512,
    matmul_dst_dtypes=("float32",),
    has_hwdge=True,
    has_fp8_double_row=True,
    has_exponential=False,
    bias_scalar_allowed=True,
    scalar_engine_tensor_copy=True,
)
TRN3 = Target(
    name="trn3",
    nc_version="gen4",
    partitions=128,
    sbuf_bytes_per_partition=256 * KIB,
    psum_bytes_per_partition=16 * KIB,
    psum_bank_bytes=2 * KIB,
    # NC-v4's moving operand may span all 8 PSUM banks: 4096 fp32 (8192 bf16) columns.
    gemm_stationary_fmax=128,
    gemm_moving_fmax=4096,
    matmul_dst_dtypes=("float32", "bfloat16"),
    has_hwdge=True,
    has_fp8_double_row=True,
    has_exponential=True,
    bias_scalar_allowed=True,
    scalar_engine_tensor_copy=True,
)

TARGETS: dict[str, Target] = {t.name: t for t in (TRN1, TRN2, TRN3)}
_ALIASES = {"gen2": "trn1", "gen3": "trn2", "gen4": "trn3", "inf2": "trn1"}
DEFAULT_TARGET = "trn2"


def resolve(target: str | Target | None = None) -> Target:
    """The target named by the argument, else by ``NEURON_PLATFORM_TARGET_OVERRIDE``, else trn2."""
    if isinstance(target, Target):
        return target
    chosen = target or os.environ.get(TARGET_ENV_VAR) or DEFAULT_TARGET
    key = _ALIASES.get(chosen.lower(), chosen.lower())
    if key not in TARGETS:
        known = sorted(TARGETS) + sorted(_ALIASES)
        raise ValueError(f"unknown NeuronCore target {chosen!r}; choose one of {known}")
    return TARGETS[key]
