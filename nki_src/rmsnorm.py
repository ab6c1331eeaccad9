"""RMSNorm forward and backward for Trainium, in NKI.

Three weight conventions, matching the transformers modules they replace:

- ``"llama"`` (Llama, Qwen2/3, Mistral, Mixtral, Phi3, Granite ...): normalise in fp32, round to
  the input dtype, then multiply by the weight: ``w * (x * rstd).to(x.dtype)``;
- ``"gemma"`` (Gemma, Gemma2, Gemma3): ``(x * rstd * (1 + w)).to(x.dtype)`` in fp32;
- ``"fp32_multiply"`` (OLMo2): ``(x * rstd * w).to(x.dtype)`` in fp32.

``rstd = 1 / sqrt(mean(x**2) + eps)`` per row is returned for the backward.

Dimensions
    N: rows (tokens), any count; a ragged last tile of fewer than 128 rows is handled.
    H: hidden size, MIN_HIDDEN..MAX_HIDDEN, any value (not only multiples of 128).

Tiling plan
    Rows go 128 to a tile, one row per partition; short rows (under PACKED_ROW_BYTES, e.g. per-head
    q/k norms) go several consecutive rows to a partition in the forward (``_packed_forward``), so
    each partition's DMA stays long. A tile's rows stay in SBUF while the free dim
    is processed in chunks of at most FREE_CHUNK elements: ScalarE squares each chunk and keeps
    a running sum in its reduce registers (``reduce_cmd``), so the whole row is read from HBM once.
    The weight is copied once per kernel by a single DMA to the partitions the row tiles use.

    Few rows (decode batches: ``decode_partitions``, up to 16 rows at hidden 4096) take the decode
    layout in the forward instead (``_decode_forward``): each row is spread over up to 128
    partitions, partition p holding columns [p c, (p + 1) c) of every row (c = H / partitions) as a
    [partitions, rows, c] tile, like AWS's decode kernel rmsnorm_tkg. The weight is then one
    [partitions, c] tile, read from HBM once (8 KB at hidden 4096, where a copy on 128 partitions
    moves 1 MB) and broadcast along the rows by a stride-0 access pattern. A ones matmul adds the
    partitions' partial sums of squares, one moving column per row, so every partition gets every
    row's total and a NaN stays in its own row. Rows go in groups of DECODE_GROUP_ROWS with their own
    DMAs, so one group's arithmetic overlaps the others' transfers.

    Why this layout. Three ways to stop moving 128 weight copies were weighed:
    (a) rows on partitions, the weight DMA-broadcast to the rows' partitions only (what the row tiles
    now do below 128 rows): the weight bytes fall with the row count, but each row's arithmetic
    stays on one partition (8 of 128 lanes at 8 rows): modelled 9.98 us at 8 x 4096 (12.7 us with
    128 weight copies), against 4.96 us in the decode layout;
    (b) each row on a block of 128 / N partitions: longer DMA runs (512 B at 8 rows), but every block
    needs its own weight (N copies through HBM, or a TensorE broadcast whose zeros turn a NaN weight
    into NaN in other columns), and the per-block sums need a block-diagonal matmul that mixes rows
    (0 x NaN) unless masked by extra GpSimd selects on the critical path;
    (c) hidden over the partitions (chosen): no weight copy at all, rows kept apart by construction.
    Its gain over the row tiles rests on AWS's documented per-instruction costs (each partition
    handles rows x c elements instead of H) and the HBM bandwidth (139 KB instead of 1.18 MB), not on
    the DMA-efficiency constant: its runs of c elements (64 B at hidden 4096) get the model's lowest
    efficiency like any run up to 1 KiB, while AWS's DMA guide calls runs under 256 B
    overhead-bound, so on hardware its transfers may be slower than modelled. That constant does set
    where the row tiles take over (DECODE_PARTITIONS_PER_ROW, from the modelled crossover).

Engine plan (forward)
    DMA: x in, out and rstd out. ScalarE: sum of squares (one pass) and rsqrt. VectorE: the
    normalise-and-scale pass (two instructions for "llama", which must round between them; one
    fused scalar_tensor_tensor for the fp32 conventions).
    Decode layout: ScalarE squares and takes rsqrt, and normalises row by row when a row's share is
    at least DECODE_ROWWISE_WIDTH; VectorE sums each row's squares per partition, scales by the
    weight (and normalises a group at once below that width); TensorE adds the partial sums over
    the partitions; GpSimd sets the constants and adds 1 to a Gemma weight off the rows' engines.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from ._common import (
    P,
    decode_constants,
    decode_partitions,
    decode_rows,
    itemsize,
    load_decode_groups,
    partition_sums,
    scale_decode_rows,
    tiles,
)

FREE_CHUNK = 2048
SBUF_RESERVE = 8 * 1024  # bytes per partition kept free for small columns and constants
MIN_HIDDEN = 1
# Rows shorter than PACKED_ROW_BYTES go several to a partition (consecutive rows, contiguous in HBM), so
# each partition's DMA moves at least that much: AWS's DMA guide asks for >= 2 KiB per partition, and
# a 256-byte row (Qwen3's per-head q/k norms) alone reaches a quarter of the bandwidth. At most
# MAX_PACKED_ROWS, as each packed row costs a ScalarE and a VectorE instruction.
PACKED_ROW_BYTES = 4096
MAX_PACKED_ROWS = 32
MAX_HIDDEN = 16384
CONVENTIONS = ("llama", "gemma", "fp32_multiply")


def check_shapes(x_shape, weight_shape, convention):
    """Raise ValueError naming the op, the shape and the limit when the kernel cannot take them."""
    if convention not in CONVENTIONS:
        raise ValueError(f"rmsnorm: convention {convention!r} is not one of {CONVENTIONS}")
    if len(x_shape) != 2:
        raise ValueError(f"rmsnorm: x must be 2-D [rows, hidden], got shape {tuple(x_shape)}")
    rows, hidden = x_shape
    if rows < 1:
        raise ValueError(f"rmsnorm: x has no rows (shape {tuple(x_shape)})")
    if not MIN_HIDDEN <= hidden <= MAX_HIDDEN:
        raise ValueError(f"rmsnorm: hidden size {hidden} is outside the supported range {MIN_HIDDEN}..{MAX_HIDDEN}")
    if tuple(weight_shape) != (hidden,):
        raise ValueError(f"rmsnorm: weight shape {tuple(weight_shape)} does not match hidden size {hidden}")


def _broadcast_weight(weight, hidden, dtype, plus_one, parts=P):
    """The weight on the first ``parts`` partitions, as ``dtype`` (plus one for the Gemma convention)."""
    spread = nl.ndarray((parts, hidden), dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=spread, src=weight.reshape((1, hidden)).broadcast(0, parts))
    if plus_one:
        nisa.tensor_scalar(dst=spread, data=spread, op0=nl.add, operand0=1.0)
    return spread


def _constant_column(value):
    column = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=column, value=value)
    return column


def rows_per_partition(hidden, dtype):
    """How many consecutive rows the forward packs into one partition (1: unpacked)."""
    return max(1, min(MAX_PACKED_ROWS, PACKED_ROW_BYTES // (hidden * itemsize(dtype))))


def _packed_forward(x, out, rstd_out, w, eps_column, r0, k, llama):
    """128 * k consecutive rows, k to a partition: row r0 + p k + j is columns [j H, (j + 1) H) of
    partition p. ScalarE squares and sums each row into its own column; VectorE normalises row by row
    and scales by the weight in one instruction over all k rows (the weight broadcast along them)."""
    hidden = x.shape[1]
    width = k * hidden
    tile = nl.ndarray((P, width), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x[r0 : r0 + P * k, :].reshape((P, width)))
    mean_square = nl.ndarray((P, k), nl.float32, buffer=nl.sbuf)
    for j in range(k):
        squares = nl.ndarray((P, hidden), nl.bfloat16, buffer=nl.sbuf)  # discarded; only the sum is kept
        nisa.activation(
            dst=squares,
            op=nl.square,
            data=tile[:, j * hidden : (j + 1) * hidden],
            scale=1.0 / (hidden**0.5),
            reduce_op=nl.add,
            reduce_cmd=nisa.reduce_cmd.reset_reduce,
            reduce_res=mean_square[:, j : j + 1],
        )
    rstd = nl.ndarray((P, k), nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=rstd, op=nl.rsqrt, data=mean_square, bias=eps_column)
    result = nl.ndarray((P, width), out.dtype, buffer=nl.sbuf)
    if llama:
        normed = nl.ndarray((P, width), x.dtype, buffer=nl.sbuf)  # rounded to x's dtype, as Llama does
        for j in range(k):
            row = slice(j * hidden, (j + 1) * hidden)
            nisa.tensor_scalar(dst=normed[:, row], data=tile[:, row], op0=nl.multiply, operand0=rstd[:, j : j + 1])
        nisa.tensor_tensor(
            dst=result.reshape((P, k, hidden)),
            data1=normed.reshape((P, k, hidden)),
            data2=w.reshape((P, 1, hidden)).broadcast(1, k),
            op=nl.multiply,
        )
    else:
        for j in range(k):
            row = slice(j * hidden, (j + 1) * hidden)
            nisa.scalar_tensor_tensor(
                dst=result[:, row],
                data=tile[:, row],
                op0=nl.multiply,
                operand0=rstd[:, j : j + 1],
                op1=nl.multiply,
                operand1=w,
            )
    nisa.dma_copy(dst=out[r0 : r0 + P * k, :].reshape((P, width)), src=result)
    nisa.dma_copy(dst=rstd_out[r0 : r0 + P * k, :].reshape((P, k)), src=rstd)


def _decode_forward(x, weight, eps, convention, out, rstd_out, parts):
    """Few rows, each spread over ``parts`` partitions: partition p holds columns [p c, (p + 1) c) of
    every row (c = H / parts), as a [parts, rows, c] tile. The weight is then one [parts, c] tile, read
    from HBM once and broadcast along the rows by the access pattern, never copied. Each partition's
    squares are summed per row on VectorE, and a matmul against a ones matrix adds those partial sums
    over the partitions and hands every partition every row's total (one moving column per row, so a
    NaN stays in its own row). Rows go in groups of DECODE_GROUP_ROWS, each with its own DMAs, so one
    group's arithmetic overlaps the next group's load and the previous group's store."""
    hidden = x.shape[1]
    width = hidden // parts
    llama = convention == "llama"
    groups = load_decode_groups(x, parts)
    # The weight and the constants are prepared on GpSimd, which the rows' arithmetic leaves idle, so no
    # engine that serves the rows waits for the weight's DMA.
    ones, eps_column = decode_constants(parts, eps)
    w = nl.ndarray((parts, width), weight.dtype if llama else nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=w, src=weight.reshape((parts, width)))
    if convention == "gemma":
        nisa.tensor_scalar(dst=w, data=w, op0=nl.add, operand0=1.0, engine=nisa.engine.gpsimd)
    for r0, count, tile in groups:
        squares = nl.ndarray((parts, count, width), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=squares, op=nl.square, data=tile, scale=1.0 / (hidden**0.5))  # sums to mean(x^2)
        mean_square = partition_sums(squares, ones)
        rstd = nl.ndarray((parts, count), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=rstd, op=nl.rsqrt, data=mean_square, bias=eps_column)
        # Llama rounds the normalised value to x's dtype before the weight; the fp32 conventions do not.
        normed = nl.ndarray((parts, count, width), x.dtype if llama else nl.float32, buffer=nl.sbuf)
        scale_decode_rows(normed, tile, rstd)
        result = nl.ndarray((parts, count, width), out.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(
            dst=result, data1=normed, data2=w.reshape((parts, 1, width)).broadcast(1, count), op=nl.multiply
        )
        nisa.dma_copy(dst=decode_rows(out, r0, count, parts), src=result)
        # every partition holds every row's rstd
        nisa.dma_copy(dst=rstd_out[r0 : r0 + count, :].reshape((1, count)), src=rstd[0:1, :])


def _row_rstd(tile, rows, hidden, eps_column):
    """rstd = rsqrt(mean(x^2) + eps) per row, squaring chunk by chunk into ScalarE's registers."""
    mean_square = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    scale = 1.0 / (hidden**0.5)  # square(x * scale) sums to mean(x^2)
    chunks = list(tiles(hidden, FREE_CHUNK))
    for i, (c0, c) in enumerate(chunks):
        squares = nl.ndarray((rows, c), nl.bfloat16, buffer=nl.sbuf)  # discarded; only the sum is kept
        nisa.activation(
            dst=squares,
            op=nl.square,
            data=tile[:, c0 : c0 + c],
            scale=scale,
            reduce_op=nl.add,
            reduce_cmd=nisa.reduce_cmd.reset_reduce if i == 0 else nisa.reduce_cmd.reduce,
            reduce_res=mean_square if i == len(chunks) - 1 else None,
        )
    rstd = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=rstd, op=nl.rsqrt, data=mean_square, bias=eps_column[:rows, :])
    return rstd


@nki.jit
def rmsnorm_fwd(x, weight, eps, convention, out_dtype):
    """RMSNorm forward.

    Args:
        x: [N, H] input in HBM (bf16 or fp32).
        weight: [H] weight in HBM.
        eps: variance epsilon (Python float).
        convention: "llama", "gemma" or "fp32_multiply" (see the module docstring).
        out_dtype: output dtype name; for "llama" the promotion of x's and weight's dtypes,
            otherwise x's dtype.

    IO shapes:
        returns (out [N, H] of out_dtype, rstd [N, 1] fp32), both in HBM.
    """
    check_shapes(x.shape, weight.shape, convention)
    rows_total, hidden = x.shape
    llama = convention == "llama"
    out = nl.ndarray((rows_total, hidden), out_dtype, buffer=nl.shared_hbm)
    rstd_out = nl.ndarray((rows_total, 1), nl.float32, buffer=nl.shared_hbm)
    parts = decode_partitions(rows_total, hidden, x.dtype)
    if parts:
        _decode_forward(x, weight, eps, convention, out, rstd_out, parts)
        return out, rstd_out
    w_dtype = weight.dtype if llama else nl.float32
    w = _broadcast_weight(weight, hidden, w_dtype, convention == "gemma", min(rows_total, P))
    eps_column = _constant_column(eps)
    k = rows_per_partition(hidden, x.dtype)
    packed = rows_total - rows_total % (P * k) if k > 1 else 0
    for r0 in range(0, packed, P * k):
        _packed_forward(x, out, rstd_out, w, eps_column, r0, k, llama)
    for r0, rows in tiles(rows_total - packed, P):
        r0 += packed
        tile = nl.ndarray((rows, hidden), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x[r0 : r0 + rows, :])
        rstd = _row_rstd(tile, rows, hidden, eps_column)
        for c0, c in tiles(hidden, FREE_CHUNK):
            result = nl.ndarray((rows, c), out_dtype, buffer=nl.sbuf)
            if llama:
                normed = nl.ndarray((rows, c), x.dtype, buffer=nl.sbuf)  # rounded to x's dtype, as Llama does
                nisa.tensor_scalar(dst=normed, data=tile[:, c0 : c0 + c], op0=nl.multiply, operand0=rstd)
                nisa.tensor_tensor(dst=result, data1=normed, data2=w[:rows, c0 : c0 + c], op=nl.multiply)
            else:
                nisa.scalar_tensor_tensor(
                    dst=result,
                    data=tile[:, c0 : c0 + c],
                    op0=nl.multiply,
                    operand0=rstd,
                    op1=nl.multiply,
                    operand1=w[:rows, c0 : c0 + c],
                )
            nisa.dma_copy(dst=out[r0 : r0 + rows, c0 : c0 + c], src=result)
        nisa.dma_copy(dst=rstd_out[r0 : r0 + rows, :], src=rstd)
        del tile  # last use: the next row tile may reuse this SBUF
    return out, rstd_out


def _backward_chunk(hidden, x_bytes, dy_bytes):
    """The widest free chunk whose fp32 temporaries fit beside the resident rows and weight."""
    resident = hidden * (4 + x_bytes + dy_bytes)  # weight (fp32) + x row + dy row, per partition
    budget = nl.tile_size.total_available_sbuf_size - resident - SBUF_RESERVE
    chunk = FREE_CHUNK
    while chunk > P and 4 * 4 * chunk > budget:  # four fp32 chunk temporaries per step
        chunk //= 2
    return chunk


@nki.jit
def rmsnorm_bwd(dy, x, weight, rstd, convention):
    """RMSNorm backward: dx and dweight from the saved per-row rstd.

    With n = x * rstd and g = dy * w' (w' = 1 + w for "gemma", else w):
        dx = rstd * g - x * rstd^3 * sum_j(g * x) / H
        dweight = sum over rows of dy * n

    Args:
        dy: [N, H] gradient of the output (the output's dtype).
        x: [N, H] forward input.
        weight: [H] forward weight.
        rstd: [N, 1] fp32 from the forward.
        convention: as in the forward.

    IO shapes:
        returns (dx [N, H] of x's dtype, dweight [H] fp32), both in HBM.

    Engine plan (two passes over a row tile's chunks)
        Pass 1: GpSimd forms q = dy * x and q * w'; TensorE accumulates dweight^T += q^T @ rstd
        (one PSUM bank for the whole kernel: column b holds hidden[128 b : 128 b + 128]);
        ScalarE sums q * w' into the row dot in its reduce registers.
        Pass 2: VectorE forms rstd * dy * w' and then dx = coef * x + that (coef = -rstd^3 *
        dot / H), writing dx over the resident x row, which then leaves in one DMA.
    """
    check_shapes(x.shape, weight.shape, convention)
    rows_total, hidden = x.shape
    dx = nl.ndarray((rows_total, hidden), x.dtype, buffer=nl.shared_hbm)
    dweight = nl.ndarray((hidden,), nl.float32, buffer=nl.shared_hbm)
    w = _broadcast_weight(weight, hidden, nl.float32, convention == "gemma")
    blocks = list(tiles(hidden, P))
    dweight_t = nl.ndarray((P, len(blocks)), nl.float32, buffer=nl.psum)
    chunks = list(tiles(hidden, _backward_chunk(hidden, itemsize(x.dtype), itemsize(dy.dtype))))
    for r0, rows in tiles(rows_total, P):
        x_tile = nl.ndarray((rows, hidden), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_tile, src=x[r0 : r0 + rows, :])
        dy_tile = nl.ndarray((rows, hidden), dy.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=dy_tile, src=dy[r0 : r0 + rows, :])
        r = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=r, src=rstd[r0 : r0 + rows, :])
        dot = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        for i, (c0, c) in enumerate(chunks):
            q = nl.ndarray((rows, c), nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(
                dst=q,
                data1=dy_tile[:, c0 : c0 + c],
                data2=x_tile[:, c0 : c0 + c],
                op=nl.multiply,
                engine=nisa.engine.gpsimd,
            )
            for b in range(c0 // P, (c0 + c + P - 1) // P):
                b0, width = blocks[b]
                nisa.nc_matmul(dst=dweight_t[:width, b : b + 1], stationary=q[:, b0 - c0 : b0 - c0 + width], moving=r)
            qw = nl.ndarray((rows, c), nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=qw, data1=q, data2=w[:rows, c0 : c0 + c], op=nl.multiply, engine=nisa.engine.gpsimd)
            nisa.activation(
                dst=qw,
                op=nl.copy,
                data=qw,
                reduce_op=nl.add,
                reduce_cmd=nisa.reduce_cmd.reset_reduce if i == 0 else nisa.reduce_cmd.reduce,
                reduce_res=dot if i == len(chunks) - 1 else None,
            )
        coef = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=coef, data1=r, data2=r, op=nl.multiply)
        nisa.tensor_tensor(dst=coef, data1=coef, data2=r, op=nl.multiply)
        nisa.scalar_tensor_tensor(
            dst=coef, data=coef, op0=nl.multiply, operand0=-1.0 / hidden, op1=nl.multiply, operand1=dot
        )
        for c0, c in chunks:
            scaled = nl.ndarray((rows, c), nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(
                dst=scaled,
                data=dy_tile[:, c0 : c0 + c],
                op0=nl.multiply,
                operand0=r,
                op1=nl.multiply,
                operand1=w[:rows, c0 : c0 + c],
            )
            # dx overwrites the x row it is computed from, so the whole row leaves in one wide DMA.
            nisa.scalar_tensor_tensor(
                dst=x_tile[:, c0 : c0 + c],
                data=x_tile[:, c0 : c0 + c],
                op0=nl.multiply,
                operand0=coef,
                op1=nl.add,
                operand1=scaled,
            )
        nisa.dma_copy(dst=dx[r0 : r0 + rows, :], src=x_tile)
        del x_tile, dy_tile  # last use: the next tile may reuse this SBUF
    evicted = nl.ndarray((P, len(blocks)), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=evicted, src=dweight_t)
    for b, (b0, width) in enumerate(blocks):
        nisa.dma_copy(dst=dweight[b0 : b0 + width].reshape((width, 1)), src=evicted[:width, b : b + 1])
    return dx, dweight
