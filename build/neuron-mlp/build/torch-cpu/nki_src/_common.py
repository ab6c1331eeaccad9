"""What the NKI kernels share: the partition count, tiling, element sizes, the floor below which an
attention logit counts as masked, and the norms' decode layout choice. Shipped beside the kernels in
every kernel repo's ``nki_src`` (``kernels-neuron build``), so each Hub repo stays self-contained.
"""

import nki.isa as nisa
import nki.language as nl

P = 128  # partitions of SBUF and PSUM: the rows of an on-chip tile, the contraction of a matmul
# SBUF per partition on trn1, the smallest target (docs/hardware.md): what the ops accept must fit every target.
SMALLEST_SBUF_BYTES = 192 * 1024


def tiles(total, size):
    """(start, size) of consecutive tiles of ``size`` over ``total``; the last may be partial."""
    for start in range(0, total, size):
        yield start, min(size, total - start)


def ceil_div(a, b):
    return (a + b - 1) // b


def dtype_name(dtype):
    """An NKI, NumPy or torch dtype's name: "bfloat16", "float32" ..."""
    return str(dtype).removeprefix("torch.").removeprefix("numpy.")


def itemsize(dtype):
    """Bytes per element of the dtypes the kernels take: 4 for the 32-bit ones, 2 for bf16/fp16."""
    return 4 if dtype_name(dtype) in ("float32", "int32", "uint32") else 2


# Attention's running max never drops below this, so a row that has seen only masked keys keeps
# exp(masked - max) = 0 instead of exp(0) = 1 (masked scores are filled with the fp32 minimum); a row
# whose logits all lie at or below it has seen no key (its output is zero).
MASKED_LOGIT_FLOOR = -1.0e30


# Few rows (decode batches) of a norm go through the decode layout (the RMSNorm and LayerNorm forwards'
# ``_decode_forward``): each row spread over many partitions instead of one, the weight read from HBM
# once. It is used while it gives every row at least DECODE_PARTITIONS_PER_ROW partitions (16 rows over
# 128) and spreads rows over at least DECODE_MIN_PARTITIONS: beyond that the row tiles win, as every
# partition of the decode layout works on every row and its DMAs move short runs. Both from the
# modelled crossover (Trn2, benchmarks/norm_decode_sweep.py reruns it): over the shapes where it is
# chosen (1..16 rows, 18 hidden sizes from 200 to 16384, bf16 and fp32), every RMSNorm convention and
# every LayerNorm affine form models no slower than the row tiles. (A LayerNorm without a weight or a
# bias asks for twice as many partitions per row: it has no copies for the layout to save.)
DECODE_PARTITIONS_PER_ROW = 8
DECODE_MIN_PARTITIONS = 32
# The decode layout reads each partition's share of a row as one run of at least this many bytes: the
# shortest AWS's rmsnorm_tkg reads in this layout straight from HBM (it does so above hidden 2048, 17 bf16
# elements from hidden 2176, and loads contiguously and transposes on chip below). Hidden sizes whose
# 128-way split gives shorter runs spread over fewer partitions.
DECODE_MIN_RUN_BYTES = 34
# Rows per group in the decode layout (each group loads, normalises and stores on its own): modelled for
# RMSNorm at 8 rows of 4096 (Trn2, bf16), 5.0 us in groups of 4 against 5.6 us in one group and 5.3 us in
# groups of 2; at 16 rows groups of 4 and 8 are within 2%.
DECODE_GROUP_ROWS = 4
# The decode layout normalises row by row on ScalarE (per row one instruction of max(64, c) cycles at
# 1.2 GHz, c = H / partitions) when that beats one VectorE instruction over the group (two cycles per
# element at 0.96 GHz, as the rstd operand is fp32): from 26 columns on (64 / 1.2 = 2 c / 0.96 at
# c = 25.6, by AWS's per-instruction costs).
DECODE_ROWWISE_WIDTH = 26


def decode_partitions(rows, hidden, dtype, per_row=DECODE_PARTITIONS_PER_ROW):
    """Partitions a norm's decode layout spreads each row over, or 0 when the row tiles serve ``rows``.

    The largest divisor of ``hidden`` up to P whose share of a row is at least DECODE_MIN_RUN_BYTES, if
    that gives each row ``per_row`` partitions and is at least DECODE_MIN_PARTITIONS.
    """
    shortest = ceil_div(DECODE_MIN_RUN_BYTES, itemsize(dtype))
    for parts in range(min(P, hidden // shortest), DECODE_MIN_PARTITIONS - 1, -1):
        if hidden % parts == 0:
            return parts if rows * per_row <= parts else 0
    return 0


def decode_rows(t, r0, count, parts):
    """Rows [r0, r0 + count) of the HBM tensor ``t`` [rows, H] in the decode layout, [parts, count, H / parts]:
    partition p holds columns [p c, (p + 1) c) of every row (a DMA's source or destination)."""
    width = t.shape[1] // parts
    return t[r0 : r0 + count, :].reshape((count, parts, width)).permute((1, 0, 2))


def load_decode_groups(x, parts):
    """Every group of DECODE_GROUP_ROWS rows of ``x`` loaded in the decode layout, as (r0, count, tile):
    each group with its own DMA, so one group's arithmetic overlaps the others' transfers, and every
    load issued before the weights', which wait behind them."""
    groups = []
    for r0, count in tiles(x.shape[0], DECODE_GROUP_ROWS):
        tile = nl.ndarray((parts, count, x.shape[1] // parts), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=decode_rows(x, r0, count, parts))
        groups.append((r0, count, tile))
    return groups


def decode_constants(parts, eps):
    """The decode layout's ones matrix (for ``partition_sums``) and eps column, [parts, parts] and
    [parts, 1] fp32, set on GpSimd, which the rows' arithmetic leaves idle."""
    ones = nl.ndarray((parts, parts), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0, engine=nisa.engine.gpsimd)
    eps_column = nl.ndarray((parts, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=eps_column, value=eps, engine=nisa.engine.gpsimd)
    return ones, eps_column


def scale_decode_rows(dst, data, rstd):
    """dst = data * rstd, each row of a [parts, count, c] tile by its own [parts, count] column: row by row
    on ScalarE from DECODE_ROWWISE_WIDTH columns, else one VectorE instruction over the group."""
    parts, count, width = data.shape
    if width >= DECODE_ROWWISE_WIDTH:
        for j in range(count):
            nisa.activation(dst=dst[:, j, :], op=nl.copy, data=data[:, j, :], scale=rstd[:, j : j + 1])
    else:
        along_rows = rstd.reshape((parts, count, 1)).broadcast(2, width)
        nisa.tensor_tensor(dst=dst, data1=data, data2=along_rows, op=nl.multiply)


def partition_sums(values, ones):
    """Each row's sum over the partitions and the last dim of ``values`` [parts, rows, c], as [parts, rows]
    fp32 in PSUM with every partition holding every row's sum (the norms' decode layout): VectorE sums
    each partition's share, a matmul against ``ones`` [parts, parts] fp32 adds the partitions, one moving
    column per row, so a NaN or inf stays in its own row."""
    parts, count = values.shape[0], values.shape[1]
    partial = nl.ndarray((parts, count), nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=partial, op=nl.add, data=values, axis=2)
    total = nl.ndarray((parts, count), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=total, stationary=ones, moving=partial, is_stationary_onezero=True)
    return total
