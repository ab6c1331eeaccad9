"""How long one instruction keeps its engine busy, from AWS's published per-instruction costs.

Engine cycles follow the NC-v2 estimates AWS published (docs/hardware.md), with N the free elements
per partition and a fixed minimum of ~64 cycles:

- matmul: max(min(64, M), N) cycles (M stationary columns, N moving columns), x4 for fp32, /2 for
  fp8 double-row; TensorE transpose: max(P, min(64, F));
- activation: max(64, N), +64 with a reduction; tensor_scalar / tensor_copy: max(64, N);
  tensor_tensor: max(64, N) with a PSUM input or all-bf16, else max(64, 2N);
  tensor_reduce: N (N/2 for bf16); reciprocal: max(64, 8N); quantize_mx: max(64, N/4); nc_matmul_mx:
  as matmul, N its x4 columns; iota / affine_select: 150 + N;
  memset: N (N/2 for a bf16 zero fill); GpSimd topk: 4n + K (n snake elements, K results);
- Trn2+ VectorE fast modes: 4x for all-bf16 SBUF copies / tensor_scalar, 2x for all-bf16 SBUF
  tensor_tensor.

DMA: a transfer occupies the core's share of HBM bandwidth for ``bytes / (bandwidth x
efficiency)``, where efficiency grows with the contiguous bytes per partition, plus a fixed
latency that overlaps across the 16 queues. DMA transposes move at their own derived rate.
"""

from __future__ import annotations

from ..sim.trace import Instruction
from .hardware import Hardware

# The Hardware field that holds each compute engine's clock.
_CLOCK_FIELD = {"tensor": "tensor_ghz", "vector": "vector_ghz", "scalar": "scalar_ghz", "gpsimd": "gpsimd_ghz"}


# Per-partition scalars ([P, 1] operands, bias, scale) ride along with an instruction; only the
# streamed tiles decide whether VectorE's bf16 fast modes apply.
_SCALAR_ROLES = frozenset({"operand0", "operand1", "bias", "scale", "imm0", "imm1", "reduce_res", "max_value"})


def _all_bf16_in_sbuf(inst: Instruction) -> bool:
    return all(o.dtype == "bfloat16" and o.buffer == "sbuf" for o in inst.operands if o.role not in _SCALAR_ROLES)


def _any_psum_input(inst: Instruction) -> bool:
    return any(o.buffer == "psum" for o in inst.operands if o.role not in ("dst",) and o.role not in _SCALAR_ROLES)


def matmul_slowdown(attrs: dict) -> float:
    """TensorE cycles relative to bf16: fp32 x4 (x2 with a one/zero operand), fp8 double-row /2."""
    if attrs.get("fp32"):
        return 2.0 if attrs.get("onezero") else 4.0
    return 0.5 if attrs.get("double_row") else 1.0


def engine_cycles(inst: Instruction, hw: Hardware) -> float:
    """Busy cycles of a compute-engine instruction."""
    op, engine, attrs = inst.op, inst.engine, inst.attrs
    if op == "core_barrier":  # a semaphore update and wait; the time spent waiting for the other core is not modelled
        return hw.min_instruction_cycles
    if engine == "tensor":
        # An MX matmul streams its x4 columns at the bf16 rate: 4x the multiply-accumulates per cycle.
        if op == "nc_matmul" or op == "nc_matmul_mx":
            return max(min(64, attrs["M"]), attrs["N"]) * matmul_slowdown(attrs)
        # nc_transpose on TensorE: a pass of the data through the array against an identity.
        n = max(inst.free_elements, 1)
        return max(attrs.get("K", inst.partitions), min(64, attrs.get("N", n))) * matmul_slowdown(attrs)
    n = max(inst.free_elements, 1)
    floor = hw.min_instruction_cycles
    if engine == "scalar":
        if op == "activation":
            return max(floor, n) + (64 if attrs.get("reduce") else 0)
        return max(floor, n)
    if engine == "gpsimd":
        if op in ("iota", "affine_select"):
            return 150 + n
        if op == "topk":  # AWS's nisa.topk reference: 4 * n + K cycles per partition
            return 4 * attrs["n"] + attrs["k"]
        return max(floor, n)
    # VectorE
    speedup = 1.0
    if hw.vector_fast_modes and _all_bf16_in_sbuf(inst):
        speedup = 2.0 if op == "tensor_tensor" else 4.0 if op in ("tensor_copy", "tensor_scalar") else 1.0
    if op == "tensor_tensor":
        per_element = 1 if (_any_psum_input(inst) or _all_bf16_in_sbuf(inst)) else 2
        return max(floor, per_element * n / speedup)
    if op in ("tensor_reduce", "tensor_partition_reduce"):
        bf16 = all(o.dtype == "bfloat16" for o in inst.operands[1:])
        return max(1.0, n / 2 if bf16 else n)
    if op == "reciprocal":
        return max(floor, 8 * n)
    if op == "quantize_mx":  # Trainium3 guide: four input elements per partition per cycle
        return max(floor, n / 4)
    if op == "memset":
        return max(1.0, n / 2 if attrs.get("zero") and inst.operands[0].dtype == "bfloat16" else n)
    return max(floor, n / speedup)


def engine_ns(inst: Instruction, hw: Hardware) -> float:
    return engine_cycles(inst, hw) / getattr(hw, _CLOCK_FIELD[inst.engine])


def dma_efficiency(contiguous_bytes: int, hw: Hardware) -> float:
    """Fraction of bandwidth a transfer reaches with this many contiguous bytes per partition."""
    if contiguous_bytes >= hw.dma_saturation_bytes:
        return 1.0
    if contiguous_bytes <= hw.dma_small_bytes:
        return hw.dma_small_efficiency
    span = hw.dma_saturation_bytes - hw.dma_small_bytes
    return hw.dma_small_efficiency + (1 - hw.dma_small_efficiency) * (contiguous_bytes - hw.dma_small_bytes) / span


def dma_transfer_ns(inst: Instruction, hw: Hardware) -> float:
    """Time a DMA instruction holds the bandwidth (its fixed latency is added by the scheduler)."""
    attrs = inst.attrs
    if inst.op == "dma_transpose":
        return inst.bytes_moved / hw.dma_transpose_bytes_per_s * 1e9
    per_partition = attrs.get("bytes_per_partition", inst.bytes_moved)
    contiguous = min(per_partition, attrs.get("contiguous_bytes", per_partition))
    return inst.bytes_moved / (hw.hbm_bytes_per_s * dma_efficiency(contiguous, hw)) * 1e9
