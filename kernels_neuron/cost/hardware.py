"""Speeds of one NeuronCore per target: the only numbers the cost model is built from.

Each constant names its source. "hardware.md" is ``docs/hardware.md``, which restates each fact with
its primary source in AWS's Neuron documentation (architecture guides, DMA guides, ISA reference). Values
marked *calibrated* were fitted to AWS's published Trn1 matmul-tutorial latencies (see
``kernels_neuron/bench/calibration.py`` and the README's calibration table); values marked *assumed*
have no published source and are the model's own estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sim import targets

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """Per-target speeds; fields with defaults are the same on Trn1, Trn2 and Trn3."""

    name: str
    tensor_ghz: float  # hardware.md: TensorE clock
    vector_ghz: float  # hardware.md: VectorE clock
    scalar_ghz: float  # hardware.md: ScalarE clock
    gpsimd_ghz: float  # hardware.md: GpSimd clock
    hbm_bytes_per_s: float  # hardware.md: chip HBM bandwidth / NeuronCores per chip
    # DMA transposes (``dma_transpose``) move 2-byte elements, not contiguous rows, so the
    # row-efficiency rule below does not describe them. Derived: AWS's production attention
    # (nki-library ``attention_cte``) transposes every bf16 probability tile with the DMA and
    # measures ~46% of TensorE peak at 16K tokens on Trn2 (hardware.md: a figure whose primary source
    # has not been located, so this constant is no better than it). At that speed one
    # 128x512 tile (33.5 MFLOP useful, 128 KiB of probabilities) takes ~927 ns, so the DMA
    # transposes at least 128 KiB / 927 ns ~ 141 GB/s per core. The model uses that lower bound,
    # which assumes the measured run executed those transposes on the DMA engines as written.
    dma_transpose_bytes_per_s: float
    vector_fast_modes: bool  # hardware.md: Trn2 VectorE 2-4x modes for bf16 SBUF->SBUF work
    pe_rows: int = 128  # hardware.md: 128x128 processing elements
    pe_cols: int = 128
    dma_queues: int = 16  # hardware.md: 16 DMA engines per NeuronCore
    dma_latency_ns: float = 1300.0  # hardware.md: ~1.3 us fixed latency per transfer
    # DMA efficiency by contiguous bytes per partition (calibrated): transfers of at most
    # ``dma_small_bytes`` per partition reach ``dma_small_efficiency`` of the bandwidth, rising
    # linearly to full bandwidth at ``dma_saturation_bytes`` (hardware.md: >= 2 KiB per partition
    # to be efficient, >= 4 KiB to saturate).
    dma_small_bytes: int = 1024
    dma_small_efficiency: float = 0.25
    dma_saturation_bytes: int = 4096
    min_instruction_cycles: int = 64  # hardware.md: fixed minimum of ~64 engine cycles per instruction
    cross_engine_sync_ns: float = 50.0  # assumed: semaphore hand-off between engines

    @property
    def tensor_peak_flops(self) -> float:
        """bf16 dense peak: 2 FLOP per PE per cycle (hardware.md: ~78.6 TFLOPS on a Trn2 core)."""
        return 2.0 * self.pe_rows * self.pe_cols * self.tensor_ghz * GB


# Derived (see ``Hardware.dma_transpose_bytes_per_s``) from AWS's published attention figure:
# a 128x512 bf16 probability tile (128 KiB, 4*128*512*128 useful FLOPs) at 46% of Trn2's peak.
ATTENTION_CTE_TRN2_PEAK_FRACTION = 0.46
_TILE_SECONDS = 4 * 128 * 512 * 128 / (ATTENTION_CTE_TRN2_PEAK_FRACTION * 2 * 128 * 128 * 2.4 * GB)
_TRN2_DMA_TRANSPOSE = 128 * 512 * 2 / _TILE_SECONDS


TRN1 = Hardware(
    name="trn1",
    tensor_ghz=2.8,
    vector_ghz=1.12,
    scalar_ghz=1.4,
    gpsimd_ghz=1.4,
    hbm_bytes_per_s=820 * GB / 2,  # 820 GB/s per chip, 2 NeuronCores
    dma_transpose_bytes_per_s=_TRN2_DMA_TRANSPOSE,  # assumed: NC-v2 and NC-v3 DMA engines are equally fast
    vector_fast_modes=False,
)
TRN2 = Hardware(
    name="trn2",
    tensor_ghz=2.4,
    vector_ghz=0.96,
    scalar_ghz=1.2,
    gpsimd_ghz=1.2,
    hbm_bytes_per_s=2900 * GB / 8,  # 2.9 TB/s per chip, 8 NeuronCores
    dma_transpose_bytes_per_s=_TRN2_DMA_TRANSPOSE,
    vector_fast_modes=True,
)
TRN3 = Hardware(
    name="trn3",
    tensor_ghz=2.4,
    vector_ghz=1.2,
    scalar_ghz=1.2,
    gpsimd_ghz=1.2,
    hbm_bytes_per_s=4900 * GB / 8,  # 4.9 TB/s per chip, 8 NeuronCores
    # assumed: scaled by per-engine DMA speed (AWS's NKI DMA overview: 27.2 GB/s per engine on
    # NeuronCore-v2/v3, 38.4 GB/s on v4)
    dma_transpose_bytes_per_s=_TRN2_DMA_TRANSPOSE * 38.4 / 27.2,
    vector_fast_modes=True,
)

HARDWARE: dict[str, Hardware] = {h.name: h for h in (TRN1, TRN2, TRN3)}


def hardware(target: str) -> Hardware:
    """The cost table of a target, named as the simulator names targets (trn2, gen3, ...)."""
    return HARDWARE[targets.resolve(target).name]
