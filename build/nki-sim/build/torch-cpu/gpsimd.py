"""``nki.isa``'s GpSimd index instructions: gathers within a core's partitions, segment bounds,
nonzero positions and top-k.

GpSimd has eight cores, each wired to 16 contiguous SBUF partitions; these instructions work per
core (a 16-partition group), which is why their tiles come in multiples of 16 partitions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import dtypes, operands, runtime
from .errors import require_generation, rule
from .tensor import Tensor

PARTITIONS_PER_CORE = 16
LOCAL_GATHER_ELEMENTS_PER_INDEX = (1, 2, 4, 8, 16, 32)
LOCAL_GATHER_MAX_INDICES_PER_CORE = 4096
TOPK_MIN_N, TOPK_MAX_N = 8, 65536  # 8 <= n < 65536
TOPK_MAX_K = 32768  # 1 <= K < 32768


def _sbuf_tile(t: Any, instr: str, role: str) -> Tensor:
    return operands.compute_tile(t, instr, role, "gpsimd", ("sbuf",))


def _dtype_in(t: Tensor, instr: str, role: str, allowed: tuple[str, ...]) -> None:
    if dtypes.name(t.dtype) not in allowed:
        raise rule(instr, role, f"dtype must be {' or '.join(allowed)}", dtype=dtypes.name(t.dtype))


def _whole_cores(t: Tensor, instr: str, role: str) -> None:
    if t.partition_size % PARTITIONS_PER_CORE:
        raise rule(
            instr,
            role,
            "partition dim must be a multiple of 16 (one GpSimd core per 16 partitions)",
            partitions=t.partition_size,
        )


def local_gather(
    dst: Tensor,
    src_buffer: Tensor,
    index: Tensor,
    num_elem_per_idx: int = 1,
    num_valid_indices: int | None = None,
    name: str | None = None,
) -> None:
    """Gather within each GpSimd core's 16 partitions.

    Each core flattens its 16-partition slice of ``index`` partition dim first (column-major) and
    keeps the first ``num_valid_indices``; every partition of the core then reads, for each index
    ``i``, the ``num_elem_per_idx`` elements starting at element ``i`` of its own flattened free dims.
    ``dst`` holds ``num_valid_indices * num_elem_per_idx`` elements per partition, in that order.
    """
    instr = "nisa.local_gather"
    dst = _sbuf_tile(dst, instr, "dst")
    src_buffer = _sbuf_tile(src_buffer, instr, "src_buffer")
    index = _sbuf_tile(index, instr, "index")
    _dtype_in(index, instr, "index", ("uint16",))
    if dst.dtype != src_buffer.dtype:
        raise rule(
            instr,
            "dst",
            "must have src_buffer's dtype (no casting)",
            dst=dtypes.name(dst.dtype),
            src_buffer=dtypes.name(src_buffer.dtype),
        )
    parts = src_buffer.partition_size
    if index.partition_size != parts or dst.partition_size != parts:
        raise rule(
            instr,
            "index/dst",
            "partition dims must match src_buffer's",
            src_buffer=parts,
            index=index.partition_size,
            dst=dst.partition_size,
        )
    _whole_cores(src_buffer, instr, "src_buffer")
    if num_elem_per_idx not in LOCAL_GATHER_ELEMENTS_PER_INDEX:
        raise rule(
            instr,
            "num_elem_per_idx",
            f"must be one of {list(LOCAL_GATHER_ELEMENTS_PER_INDEX)}",
            num_elem_per_idx=num_elem_per_idx,
        )
    per_core = index.size // (parts // PARTITIONS_PER_CORE)
    valid = per_core if num_valid_indices is None else int(num_valid_indices)
    if not 0 < valid <= per_core:
        raise rule(instr, "num_valid_indices", "must be in 1..(index elements per core)", value=valid, limit=per_core)
    if valid > LOCAL_GATHER_MAX_INDICES_PER_CORE:
        raise rule(instr, "index", "too many indices per core", indices=valid, limit=LOCAL_GATHER_MAX_INDICES_PER_CORE)
    if dst.free_size != valid * num_elem_per_idx:
        raise rule(
            instr,
            "dst",
            "must hold num_valid_indices * num_elem_per_idx elements per partition",
            dst_free=dst.free_size,
            expected=valid * num_elem_per_idx,
        )
    source = np.asarray(src_buffer.read()).reshape(parts, -1)
    # The indices decide a check (gathers past the end), so a trace-only run needs them computed.
    indices = np.asarray(index.computed_values(instr, "index")).reshape(parts, -1).astype(np.int64)
    offsets = np.arange(num_elem_per_idx)
    gathered = np.empty((parts, valid * num_elem_per_idx), dtype=source.dtype)
    for first in range(0, parts, PARTITIONS_PER_CORE):
        core = slice(first, first + PARTITIONS_PER_CORE)
        starts = indices[core].flatten(order="F")[:valid]
        columns = (starts[:, None] + offsets[None, :]).reshape(-1)
        if columns.max() >= source.shape[1]:
            # AWS leaves an out-of-bounds gather undefined; a simulator that made one up would hide the bug.
            raise rule(
                instr,
                "index",
                "gathers past the end of src_buffer's partition",
                core=first // PARTITIONS_PER_CORE,
                last_element=int(columns.max()),
                elements_per_partition=source.shape[1],
            )
        gathered[core] = source[core][:, columns]
    dst.write(gathered.reshape(dst.shape), instr)
    runtime.current().record(
        "gpsimd",
        "local_gather",
        reads=[("src_buffer", src_buffer), ("index", index)],
        writes=[("dst", dst)],
    )


def _segment_bounds(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per element: the first index of its segment and one past the last (padding, id 0: n and -1)."""
    n = ids.size
    starts = np.empty(n, dtype=np.int64)
    ends = np.empty(n, dtype=np.int64)
    for i in range(n):
        starts[i] = n if ids[i] == 0 else starts[i - 1] if i and ids[i] == ids[i - 1] else i
    for i in range(n - 1, -1, -1):
        ends[i] = -1 if ids[i] == 0 else ends[i + 1] if i < n - 1 and ids[i] == ids[i + 1] else i + 1
    return starts, ends


def sequence_bounds(dst: Tensor, segment_ids: Tensor, name: str | None = None) -> None:
    """For each element of a [1, n] tile of segment ids, its segment's [start, end) into dst [1, 2, n].

    Segment id 0 is padding: its start is ``n`` and its end ``-1``.
    """
    instr = "nisa.sequence_bounds"
    dst = _sbuf_tile(dst, instr, "dst")
    segment_ids = _sbuf_tile(segment_ids, instr, "segment_ids")
    for role, t in (("dst", dst), ("segment_ids", segment_ids)):
        _dtype_in(t, instr, role, ("float32", "int32"))
        if t.partition_size != 1:
            raise rule(instr, role, "the partition dim must be 1", shape=list(t.shape))
    n = segment_ids.free_size
    if dst.free_size != 2 * n:
        raise rule(instr, "dst", "must have shape (1, 2, n)", dst=list(dst.shape), n=n)
    ids = np.asarray(segment_ids.read()).reshape(-1)
    if (ids < 0).any():
        raise rule(instr, "segment_ids", "must be non-negative", smallest=float(ids.min()))
    starts, ends = _segment_bounds(ids)
    dst.write(np.stack([starts, ends]).astype(np.float64).reshape(dst.shape), instr)
    runtime.current().record("gpsimd", "sequence_bounds", reads=[("segment_ids", segment_ids)], writes=[("dst", dst)])


def nonzero_with_count(
    dst: Tensor, src: Tensor, index_offset: int = 0, padding_val: int = -1, name: str | None = None
) -> None:
    """Positions (plus ``index_offset``) of the nonzero elements of each core's first partition, then
    ``padding_val`` up to the input length, then the count; partitions 1..15 of each core are untouched."""
    instr = "nisa.nonzero_with_count"
    run = runtime.current()
    require_generation(instr, "target", run.target, 3)
    dst, src = _sbuf_tile(dst, instr, "dst"), _sbuf_tile(src, instr, "src")
    _dtype_in(src, instr, "src", ("float32", "int32"))
    _dtype_in(dst, instr, "dst", ("int32",))
    if dst.partition_size != src.partition_size:
        raise rule(instr, "dst", "partition dim must match src's", dst=dst.partition_size, src=src.partition_size)
    length = src.free_size
    if dst.free_size != length + 1:
        raise rule(instr, "dst", "must have one more element than src per partition", dst=dst.free_size, src=length)
    values = np.asarray(src.read()).reshape(src.partition_size, -1)
    result = np.asarray(dst.read()).reshape(dst.partition_size, -1).astype(np.int64)
    for lane in range(0, src.partition_size, PARTITIONS_PER_CORE):
        found = np.flatnonzero(values[lane]) + int(index_offset)
        result[lane, :] = int(padding_val)
        result[lane, : found.size] = found
        result[lane, length] = found.size
    dst.write(result.reshape(dst.shape), instr)
    run.record("gpsimd", "nonzero_with_count", reads=[("src", src)], writes=[("dst", dst)])


def topk(val_dst: Tensor, idx_dst: Tensor, src: Tensor, n: int, name: str | None = None) -> None:
    """The K largest of the ``n`` bf16 values in each 16-partition snake, ascending, with their positions.

    Snake position ``s`` is partition ``s % 16``, column ``s // 16`` of the core's slice of ``src``; K is
    ``val_dst``'s free size. AWS's reference does not say how the K results are laid out over a core's
    16 partitions; here every partition of the core receives all K (values ascending, ``idx_dst`` the
    snake positions).
    """
    instr = "nisa.topk"
    val_dst = _sbuf_tile(val_dst, instr, "val_dst")
    idx_dst = _sbuf_tile(idx_dst, instr, "idx_dst")
    src = _sbuf_tile(src, instr, "src")
    _dtype_in(src, instr, "src", ("bfloat16",))
    _dtype_in(val_dst, instr, "val_dst", ("bfloat16",))
    _dtype_in(idx_dst, instr, "idx_dst", ("uint32",))
    n = int(n)
    k = val_dst.free_size
    if not TOPK_MIN_N <= n < TOPK_MAX_N:
        raise rule(instr, "n", f"must be in [{TOPK_MIN_N}, {TOPK_MAX_N})", n=n)
    if not 1 <= k < TOPK_MAX_K or k > n:
        raise rule(instr, "val_dst", f"K (its free size) must be in [1, {TOPK_MAX_K}) and at most n", k=k, n=n)
    if src.free_size < -(-n // PARTITIONS_PER_CORE):
        raise rule(instr, "src", "free dim must be at least ceil(n / 16)", free=src.free_size, n=n)
    _whole_cores(src, instr, "src")
    for role, t in (("val_dst", val_dst), ("idx_dst", idx_dst)):
        if t.partition_size != src.partition_size or t.free_size != k:
            raise rule(
                instr,
                role,
                "must have shape [src partitions, K]",
                shape=list(t.shape),
                expected=[src.partition_size, k],
            )
    values = np.asarray(src.read()).reshape(src.partition_size, -1).astype(np.float32)
    top_values = np.empty((src.partition_size, k), dtype=np.float32)
    top_positions = np.empty((src.partition_size, k), dtype=np.int64)
    for first in range(0, src.partition_size, PARTITIONS_PER_CORE):
        core = slice(first, first + PARTITIONS_PER_CORE)
        snake = values[core].flatten(order="F")[:n]
        chosen = np.argsort(-snake, kind="stable")[:k][::-1]  # the K largest, then ascending
        top_values[core] = snake[chosen]
        top_positions[core] = chosen
    val_dst.write(top_values.reshape(val_dst.shape), instr)
    idx_dst.write(top_positions.reshape(idx_dst.shape), instr)
    runtime.current().record(
        "gpsimd",
        "topk",
        reads=[("src", src)],
        writes=[("val_dst", val_dst), ("idx_dst", idx_dst)],
        n=n,
        k=k,
    )
