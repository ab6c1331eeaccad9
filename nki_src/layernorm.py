"""LayerNorm forward and backward for Trainium, in NKI.

``y = (x - mean) * rstd * weight + bias`` over the last dim, with ``rstd = 1 / sqrt(var + eps)`` and
the population variance, all in fp32 and rounded once to x's dtype: what ``torch.nn.LayerNorm`` (and
Cohere's LayerNorm, which has no bias) computes. The weight and the bias are optional
(``elementwise_affine=False``, ``bias=False``). The forward returns the per-row mean and rstd for the
backward.

Dimensions
    N: rows (tokens), any count; a ragged last tile of fewer than 128 rows is handled.
    H: hidden size, 1..max_hidden(dtype), any value.

Tiling plan
    Rows go 128 to a tile, one row per partition; a tile's rows stay in SBUF while the free dim is
    processed in chunks of at most FREE_CHUNK elements. The weight and bias are broadcast once per
    kernel to the partitions the row tiles use. Rows SBUF cannot hold with their result
    (``_StreamedRows``; in the backward ``_BackwardPlan.streamed``) stream through twice in chunks of
    STREAM_CHUNK elements.

Engine plan (forward), per row tile
    VectorE: ``bn_stats`` over 512-element pieces and one ``bn_aggr`` give each row's mean and
    variance (combined the way Welford's algorithm combines partial results: exact where
    E[x^2] - mean^2 would cancel).
    ScalarE: n = x * rstd - mean * rstd in fp32, one pass (with neither weight nor bias, straight
    into x's dtype). Fused this way, n's absolute error is about 2^-24 |mean| / std where torch's
    (x - mean) * rstd has 2^-24: below bf16's resolution until |mean| / std nears 10^5, visible in fp32
    beyond |mean| / std of about 10^2 (tests/ops/test_layernorm.py measures it).
    GpSimd: n * weight, then + bias, rounded to x's dtype. With both a weight and a bias, that is two
    GpSimd passes against one on each other engine, so for CENTRED_SHARE of the columns VectorE forms
    (x - mean) * weight instead (``scalar_tensor_tensor``'s subtract-then-multiply form, one cycle per
    element for bf16 x and weight in AWS's table), ScalarE scales it by rstd and GpSimd only adds the
    bias. Every engine's work on a tile depends only on work issued before it, so the tiles pipeline
    in program order.

Decode layout (forward)
    Few rows (``forward_decode_partitions``, the RMSNorm forward's choice: up to 16 rows at hidden
    4096, 8 without a weight or a bias) are spread over the partitions instead (``_decode_forward``):
    partition p holds columns [p c, (p + 1) c) of every row (c = H / partitions), so the weight and
    the bias are [partitions, c] tiles read from HBM once (two 9 KB reads at Starcoder2-7B's hidden
    4608, where copies on 128 partitions move 2.4 MB) and broadcast along the rows by the access
    pattern. The statistics take two passes, as torch's:
    VectorE sums each row's elements per partition and a ones matmul adds the partitions' sums (every
    partition gets every row's total, one moving column per row, so a NaN stays in its own row); then
    the same for the squares of x - mean, so the variance never comes from E[x^2] - mean^2. ScalarE
    squares, takes rsqrt and normalises (row by row from DECODE_ROWWISE_WIDTH columns, else VectorE
    over the group), VectorE scales by the weight and GpSimd adds the bias, in fp32, rounded once.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from ._common import (
    DECODE_PARTITIONS_PER_ROW,
    SMALLEST_SBUF_BYTES,  # the op and the layers accept a hidden size only where the kernels fit it on every target
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
# With a weight and a bias, this fraction of each chunk's columns goes VectorE's way (see _RowTile):
# per element, VectorE's statistics cost 1 cycle at 0.96 GHz and the centring 1 more, GpSimd's two
# passes 1 cycle each at 1.2 GHz, so moving f of the columns balances 1 + f against (2 - f) * 0.8:
# f = 1/3 on Trn2's clocks (AWS's documented per-instruction costs, docs/hardware.md).
CENTRED_SHARE = (1, 3)
# The backward's per-element passes, spread so that VectorE (one cycle per element at 0.96 GHz on Trn2),
# ScalarE and GpSimd (one cycle at 1.2 GHz) are equally busy (AWS's documented per-instruction costs and
# clocks, docs/hardware.md). VectorE always forms p, ScalarE always the two sums, GpSimd always p * w and
# dx's final add; g = dy * w and dx's affine term k1 x + k0 are split by column. With a of g's columns on
# GpSimd and b of the affine's on VectorE, the engines' passes are (1 - a) + 1 + b at 1.04 ns,
# 2 + (1 - b) at 0.83 ns plus the reductions' overhead, and a + 2 at 0.83 ns: equal at a = 0.59,
# b = 0.65, taken as 5/8 each. Modelled on Trn2 at 4096 x 4096, shares 9/16 .. 11/16 each stay within 2%
# of it (README, LayerNorm).
G_ON_GPSIMD = (5, 8)
DX_ON_VECTOR = (5, 8)
GROUP = 2  # chunks whose pass-1 temporaries are alive at once in the backward (bounds its SBUF use)
# Rows SBUF cannot hold with their result (where depends on the dtypes and the target: forward_bytes and
# lean_backward_bytes; on trn1 from about 10K columns all fp32, 18K all bf16) stream through in chunks of
# STREAM_CHUNK columns, STREAM_BUFFERS of them in flight (double buffering).
STREAM_CHUNK = 1024
STREAM_BUFFERS = 2
MIN_HIDDEN = 1
MAX_HIDDEN = 32768
BACKWARD_TEMPORARIES = 4 + 4 + 4 + 2 + 4  # bytes per column of a chunk: g, p, p * w, a discarded copy, dx's affine


def forward_bytes(hidden, x_size, weight_size, bias_size):
    """SBUF per partition the forward needs (element sizes in bytes, 0 for an absent weight or bias):
    a row tile and its result, the broadcast weight and bias, and a chunk's fp32 temporaries."""
    return hidden * (2 * x_size + weight_size + bias_size) + min(hidden, FREE_CHUNK) * 4 * 3 + SBUF_RESERVE


def streamed_forward_bytes(hidden, x_size, weight_size, bias_size):
    """SBUF per partition the streamed forward needs (``_StreamedRows``): the broadcast weight and bias,
    and STREAM_BUFFERS chunks of x, result and fp32 temporaries in flight."""
    chunk = min(hidden, STREAM_CHUNK)
    return hidden * (weight_size + bias_size) + STREAM_BUFFERS * chunk * (2 * x_size + 4 * 3) + SBUF_RESERVE


def lean_backward_bytes(hidden, x_size, dy_size, weight_size):
    """SBUF per partition the backward needs at the least (``_BackwardPlan``'s one-tile schedule): x,
    g * rstd (fp32) and the weight per row, and one chunk of dy and of temporaries."""
    return (
        hidden * (weight_size + x_size + 4) + min(hidden, FREE_CHUNK) * (dy_size + BACKWARD_TEMPORARIES) + SBUF_RESERVE
    )


def streamed_backward_bytes(hidden, x_size, dy_size, weight_size):
    """SBUF per partition the streamed backward needs: the weight per row, and STREAM_BUFFERS chunks of x,
    dy and temporaries in flight."""
    chunk = min(hidden, STREAM_CHUNK)
    return hidden * weight_size + STREAM_BUFFERS * chunk * (x_size + dy_size + BACKWARD_TEMPORARIES) + SBUF_RESERVE


def max_hidden(x_dtype, weight_dtype=None, bias_dtype=None, sbuf_bytes=SMALLEST_SBUF_BYTES):
    """The largest hidden size (at most MAX_HIDDEN) whose forward and backward fit ``sbuf_bytes`` per
    partition with these dtypes (None: no weight, or no bias; dy has x's dtype)."""
    sx = itemsize(x_dtype)
    sw = 0 if weight_dtype is None else itemsize(weight_dtype)
    sb = 0 if bias_dtype is None else itemsize(bias_dtype)

    def fits(hidden):
        forward = min(forward_bytes(hidden, sx, sw, sb), streamed_forward_bytes(hidden, sx, sw, sb))
        backward = min(lean_backward_bytes(hidden, sx, sx, sw), streamed_backward_bytes(hidden, sx, sx, sw))
        return max(forward, backward) <= sbuf_bytes

    lo, hi = MIN_HIDDEN, MAX_HIDDEN
    if fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def check_shapes(x_shape, x_dtype, weight_shape, weight_dtype, bias_shape, bias_dtype):
    """Raise ValueError naming the op, the shape and the limit when the kernel cannot take them (on this
    target's SBUF)."""
    if len(x_shape) != 2:
        raise ValueError(f"layernorm: x must be 2-D [rows, hidden], got shape {tuple(x_shape)}")
    rows, hidden = x_shape
    if rows < 1:
        raise ValueError(f"layernorm: x has no rows (shape {tuple(x_shape)})")
    limit = max_hidden(x_dtype, weight_dtype, bias_dtype, nl.tile_size.total_available_sbuf_size)
    if not MIN_HIDDEN <= hidden <= limit:
        raise ValueError(
            f"layernorm: hidden size {hidden} is outside the supported range {MIN_HIDDEN}..{limit} for these "
            "dtypes on this target's SBUF"
        )
    for name, shape in (("weight", weight_shape), ("bias", bias_shape)):
        if shape is not None and tuple(shape) != (hidden,):
            raise ValueError(f"layernorm: {name} shape {tuple(shape)} does not match hidden size {hidden}")


def _broadcast(vector, hidden, parts=P):
    """A [H] vector on the first ``parts`` partitions, in its own dtype."""
    spread = nl.ndarray((parts, hidden), vector.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=spread, src=vector.reshape((1, hidden)).broadcast(0, parts))
    return spread


def _constant_column(value):
    column = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=column, value=value)
    return column


def _bn_pieces(hidden):
    """bn_stats pieces (at most bn_stats_fmax elements each) covering a row, none of one element: each
    piece's statistics come as an even-element and an odd-element half, and AWS documents no result
    for an empty half."""
    pieces = list(tiles(hidden, nl.tile_size.bn_stats_fmax))
    if len(pieces) > 1 and pieces[-1][1] == 1:
        (c0, c), (last, _) = pieces[-2], pieces[-1]
        pieces[-2:] = [(c0, c - 1), (last - 1, 2)]
    return pieces


def _statistics(tile, rows, hidden, eps_column):
    """(mean, rstd, -mean * rstd) per row, from VectorE's bn_stats/bn_aggr (a one-element row is its own
    mean, with variance 0)."""
    moments = nl.ndarray((rows, 2), nl.float32, buffer=nl.sbuf)  # mean, variance
    if hidden == 1:
        nisa.tensor_copy(dst=moments[:, 0:1], src=tile)
        nisa.memset(dst=moments[:, 1:2], value=0.0)
    else:
        pieces = _bn_pieces(hidden)
        stats = nl.ndarray((rows, 6 * len(pieces)), nl.float32, buffer=nl.sbuf)
        for i, (c0, c) in enumerate(pieces):
            nisa.bn_stats(dst=stats[:, 6 * i : 6 * i + 6], data=tile[:, c0 : c0 + c])
        nisa.bn_aggr(dst=moments, data=stats)
    return _normalizers(moments, rows, eps_column)


def _normalizers(moments, rows, eps_column):
    """(mean, rstd, -mean * rstd) per row from its (mean, variance)."""
    rstd = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=rstd, op=nl.rsqrt, data=moments[:, 1:2], bias=eps_column[:rows, :])
    shift = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(
        dst=shift, data=moments[:, 0:1], op0=nl.multiply, operand0=-1.0, op1=nl.multiply, operand1=rstd
    )
    return moments[:, 0:1], rstd, shift


class _RowTile(nl.NKIObject):
    """Up to 128 rows of x resident in SBUF (one per partition) and their statistics."""

    def __init__(self, x, r0, rows, eps_column):
        self.r0, self.rows = r0, rows
        self.tile = nl.ndarray((rows, x.shape[1]), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=self.tile, src=x[r0 : r0 + rows, :])
        self.mean, self.rstd, self.shift = _statistics(self.tile, rows, x.shape[1], eps_column)

    def normalize(self, out, mean_out, rstd_out, w, b, chunks):
        """Write the rows' LayerNorm, mean and rstd (see the module's engine plan)."""
        r0, rows, tile = self.r0, self.rows, self.tile
        # One DMA per row tile: a chunk's rows can be short enough for the DMA to lose efficiency.
        row_result = nl.ndarray(tile.shape, tile.dtype, buffer=nl.sbuf)
        for c0, c in chunks:
            result = row_result[:, c0 : c0 + c]
            self._chunk(tile[:, c0 : c0 + c], result, c0, w, b)
        nisa.dma_copy(dst=out[r0 : r0 + rows, :], src=row_result)
        self._store_statistics(mean_out, rstd_out)

    def _store_statistics(self, mean_out, rstd_out):
        nisa.dma_copy(dst=mean_out[self.r0 : self.r0 + self.rows, :], src=self.mean)
        nisa.dma_copy(dst=rstd_out[self.r0 : self.r0 + self.rows, :], src=self.rstd)

    def _chunk(self, x, result, c0, w, b):
        """LayerNorm of the chunk ``x`` (columns c0 onwards) into ``result``. With both a weight and a bias,
        the last CENTRED_SHARE of the columns are centred and scaled by the weight on VectorE, which leaves
        GpSimd one pass there instead of two."""
        c = x.shape[1]
        split = c - _even(c * CENTRED_SHARE[0] // CENTRED_SHARE[1]) if w is not None and b is not None else c
        for lo, hi in ((0, split), (split, c)):
            if hi > lo:
                self._columns(x[:, lo:hi], result[:, lo:hi], c0 + lo, w, b, centred=lo > 0)

    def _columns(self, x, result, c0, w, b, centred):
        """LayerNorm of the columns ``x`` (c0 onwards) into ``result``: n = x * rstd - mean * rstd on
        ScalarE, then * weight and + bias on GpSimd; or, ``centred``, (x - mean) * weight on VectorE,
        * rstd on ScalarE and + bias on GpSimd."""
        rows, c = self.rows, x.shape[1]
        last = result if b is None else nl.ndarray((rows, c), nl.float32, buffer=nl.sbuf)
        if centred:
            weighted = nl.ndarray((rows, c), nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(
                dst=weighted,
                data=x,
                op0=nl.subtract,
                operand0=self.mean,
                op1=nl.multiply,
                operand1=w[:rows, c0 : c0 + c],
            )
            nisa.activation(dst=last, op=nl.copy, data=weighted, scale=self.rstd)
        else:
            normed = last if w is None else nl.ndarray((rows, c), nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=normed, op=nl.copy, data=x, scale=self.rstd, bias=self.shift)
            if w is not None:
                nisa.tensor_tensor(
                    dst=last, data1=normed, data2=w[:rows, c0 : c0 + c], op=nl.multiply, engine=nisa.engine.gpsimd
                )
        if b is not None:
            nisa.tensor_tensor(
                dst=result, data1=last, data2=b[:rows, c0 : c0 + c], op=nl.add, engine=nisa.engine.gpsimd
            )


def _load_columns(tensor, r0, rows, c0, c):
    """Rows [r0, r0 + rows), columns [c0, c0 + c) of an HBM tensor, into a new SBUF tile."""
    chunk = nl.ndarray((rows, c), tensor.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=chunk, src=tensor[r0 : r0 + rows, c0 : c0 + c])
    return chunk


class _StreamedRows(_RowTile):
    """Up to 128 rows too wide for SBUF to hold them with their result: x streams through twice, once
    for the statistics (bn_stats piece by piece) and once to normalise, STREAM_CHUNK columns at a time,
    each chunk's result leaving in its own DMA (STREAM_CHUNK columns are at least 2 KiB per partition,
    where the DMA keeps most of its efficiency)."""

    def __init__(self, x, r0, rows, eps_column):
        self.r0, self.rows, self.x = r0, rows, x
        pieces = _bn_pieces(x.shape[1])
        stats = nl.ndarray((rows, 6 * len(pieces)), nl.float32, buffer=nl.sbuf)
        first = 0
        while first < len(pieces):
            last = first + 1  # the pieces of one load: consecutive, at most STREAM_CHUNK columns in all
            while last < len(pieces) and pieces[last][0] + pieces[last][1] - pieces[first][0] <= STREAM_CHUNK:
                last += 1
            g0 = pieces[first][0]
            chunk = self._load(g0, pieces[last - 1][0] + pieces[last - 1][1] - g0)
            for i in range(first, last):
                c0, c = pieces[i]
                nisa.bn_stats(dst=stats[:, 6 * i : 6 * i + 6], data=chunk[:, c0 - g0 : c0 - g0 + c])
            first = last
        moments = nl.ndarray((rows, 2), nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=moments, data=stats)
        self.mean, self.rstd, self.shift = _normalizers(moments, rows, eps_column)

    def _load(self, c0, c):
        return _load_columns(self.x, self.r0, self.rows, c0, c)

    def normalize(self, out, mean_out, rstd_out, w, b, chunks):
        for c0, c in chunks:
            result = nl.ndarray((self.rows, c), self.x.dtype, buffer=nl.sbuf)
            self._chunk(self._load(c0, c), result, c0, w, b)
            nisa.dma_copy(dst=out[self.r0 : self.r0 + self.rows, c0 : c0 + c], src=result)
        self._store_statistics(mean_out, rstd_out)


def _even(n):
    return n - n % 2


def forward_decode_partitions(rows, hidden, dtype, affine):
    """``decode_partitions`` for this forward. Without a weight or a bias (``affine`` False) the decode
    layout saves no copies, it only spreads the work, and pays while each row gets twice the
    partitions (benchmarks/norm_decode_sweep.py: with DECODE_PARTITIONS_PER_ROW, 13 to 16 fp32 rows at
    hidden 1152 to 2304 modelled up to 7% slower than the row tiles)."""
    per_row = DECODE_PARTITIONS_PER_ROW if affine else 2 * DECODE_PARTITIONS_PER_ROW
    return decode_partitions(rows, hidden, dtype, per_row)


def _decode_forward(x, weight, bias, eps, out, mean_out, rstd_out, parts):
    """Few rows, each spread over ``parts`` partitions (the module's decode layout): a [parts, rows, c]
    tile per group of DECODE_GROUP_ROWS rows, each group with its own DMAs so that one group's
    arithmetic overlaps the others' transfers; the weight and the bias as [parts, c] tiles."""
    hidden = x.shape[1]
    width = hidden // parts
    groups = load_decode_groups(x, parts)
    ones, eps_column = decode_constants(parts, eps)
    affine = []
    for vector in (weight, bias):
        spread = None
        if vector is not None:
            spread = nl.ndarray((parts, width), vector.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=spread, src=vector.reshape((parts, width)))
        affine.append(spread)
    w, b = affine
    # Stage by stage across the groups: each engine's queue then holds the next group's work of a stage
    # behind this group's, instead of the whole of a group's chain before the next group's first step.
    means = [_partition_total(tile, ones, 1.0 / hidden) for _, _, tile in groups]
    centred, rstds = [], []
    for (_, count, tile), mean in zip(groups, means):
        shifted = nl.ndarray((parts, count, width), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(
            dst=shifted, data1=tile, data2=mean.reshape((parts, count, 1)).broadcast(2, width), op=nl.subtract
        )
        centred.append(shifted)
    for shifted in centred:
        squares = nl.ndarray(shifted.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=squares, op=nl.square, data=shifted, scale=1.0 / (hidden**0.5))  # sums to the variance
        variance = _partition_total(squares, ones, 1.0)
        rstd = nl.ndarray(variance.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=rstd, op=nl.rsqrt, data=variance, bias=eps_column)
        rstds.append(rstd)
    # n = (x - mean) * rstd, then * weight and + bias, in fp32; the last step writes x's dtype.
    steps = [(op, spread) for op, spread in ((nl.multiply, w), (nl.add, b)) if spread is not None]
    for (r0, count, _), shifted, mean, rstd in zip(groups, centred, means, rstds):
        normed = nl.ndarray((parts, count, width), x.dtype if not steps else nl.float32, buffer=nl.sbuf)
        scale_decode_rows(normed, shifted, rstd)
        result = normed
        for i, (op, spread) in enumerate(steps):
            step = nl.ndarray((parts, count, width), x.dtype if i == len(steps) - 1 else nl.float32, buffer=nl.sbuf)
            engine = nisa.engine.gpsimd if op == nl.add else nisa.engine.vector
            nisa.tensor_tensor(
                dst=step,
                data1=result,
                data2=spread.reshape((parts, 1, width)).broadcast(1, count),
                op=op,
                engine=engine,
            )
            result = step
        nisa.dma_copy(dst=decode_rows(out, r0, count, parts), src=result)
        # every partition holds every row's mean and rstd
        nisa.dma_copy(dst=mean_out[r0 : r0 + count, :].reshape((1, count)), src=mean[0:1, :])
        nisa.dma_copy(dst=rstd_out[r0 : r0 + count, :].reshape((1, count)), src=rstd[0:1, :])


def _partition_total(values, ones, scale):
    """``scale`` x ``partition_sums(values, ones)``, scaled out of PSUM into SBUF by ScalarE."""
    total = partition_sums(values, ones)
    scaled = nl.ndarray(total.shape, nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=scaled, op=nl.copy, data=total, scale=scale)
    return scaled


@nki.jit
def layernorm_fwd(x, weight, bias, eps):
    """LayerNorm forward.

    Args:
        x: [N, H] input in HBM (bf16, fp16 or fp32).
        weight: [H] weight in HBM, or None (no affine scale).
        bias: [H] bias in HBM, or None.
        eps: variance epsilon (Python float).

    IO shapes:
        returns (out [N, H] of x's dtype, mean [N, 1] fp32, rstd [N, 1] fp32), all in HBM.
    """
    check_shapes(
        x.shape,
        x.dtype,
        None if weight is None else weight.shape,
        None if weight is None else weight.dtype,
        None if bias is None else bias.shape,
        None if bias is None else bias.dtype,
    )
    rows_total, hidden = x.shape
    out = nl.ndarray((rows_total, hidden), x.dtype, buffer=nl.shared_hbm)
    mean_out = nl.ndarray((rows_total, 1), nl.float32, buffer=nl.shared_hbm)
    rstd_out = nl.ndarray((rows_total, 1), nl.float32, buffer=nl.shared_hbm)
    parts = forward_decode_partitions(rows_total, hidden, x.dtype, weight is not None or bias is not None)
    if parts:
        _decode_forward(x, weight, bias, eps, out, mean_out, rstd_out, parts)
        return out, mean_out, rstd_out
    used = min(rows_total, P)  # the partitions the row tiles use
    w = None if weight is None else _broadcast(weight, hidden, used)
    b = None if bias is None else _broadcast(bias, hidden, used)
    eps_column = _constant_column(eps)
    sizes = (itemsize(x.dtype), *(0 if t is None else itemsize(t.dtype) for t in (weight, bias)))
    if forward_bytes(hidden, *sizes) <= nl.tile_size.total_available_sbuf_size:
        rows_class, chunks = _RowTile, list(tiles(hidden, FREE_CHUNK))
    else:
        rows_class, chunks = _StreamedRows, list(tiles(hidden, STREAM_CHUNK))
    for r0, rows in tiles(rows_total, P):
        rows_class(x, r0, rows, eps_column).normalize(out, mean_out, rstd_out, w, b, chunks)
    return out, mean_out, rstd_out


def _summed(data, scale, total, dtype):
    """ScalarE: ``data * scale``, returned in ``dtype``, and its sum over each row into ``total``."""
    out = nl.ndarray(data.shape, dtype, buffer=nl.sbuf)
    nisa.activation(
        dst=out,
        op=nl.copy,
        data=data,
        scale=scale,
        reduce_op=nl.add,
        reduce_cmd=nisa.reduce_cmd.reset_reduce,
        reduce_res=total,
    )
    return out


def _weighted(dy_chunk, w, c0):
    """g = dy * weight over a chunk (columns c0 onwards) in fp32, dy itself without a weight: VectorE's
    one-cycle (dy - 0) * w form, and GpSimd's plain product for the last G_ON_GPSIMD of the columns."""
    if w is None:
        return dy_chunk
    rows, c = dy_chunk.shape
    g = nl.ndarray((rows, c), nl.float32, buffer=nl.sbuf)
    split = c - _even(c * G_ON_GPSIMD[0] // G_ON_GPSIMD[1])
    if split:
        nisa.scalar_tensor_tensor(
            dst=g[:, :split],
            data=dy_chunk[:, :split],
            op0=nl.subtract,
            operand0=0.0,
            op1=nl.multiply,
            operand1=w[:rows, c0 : c0 + split],
        )
    if split < c:
        nisa.tensor_tensor(
            dst=g[:, split:],
            data1=dy_chunk[:, split:],
            data2=w[:rows, c0 + split : c0 + c],
            op=nl.multiply,
            engine=nisa.engine.gpsimd,
        )
    return g


class _GradientRows(nl.NKIObject):
    """Up to 128 rows of the backward: ``first_pass`` issues pass 1 and the row constants, ``finish``
    pass 2. x stays resident in SBUF unless the plan streams it (then both passes load x and dy chunk
    by chunk, and pass 2 forms g * rstd again rather than keeping it)."""

    def __init__(self, dy, x, mean, rstd, r0, rows, plan):
        """Load the rows' mean and rstd, x unless the plan streams it, and dy if the plan pipelines."""
        self.r0, self.rows, self.chunks, self.group = r0, rows, plan.chunks, plan.group
        self.dy_hbm, self.x_hbm = dy, x
        self.tile = None
        if not plan.streamed:
            self.tile = nl.ndarray((rows, x.shape[1]), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=self.tile, src=x[r0 : r0 + rows, :])
        self.dy = None
        if plan.pipelined:
            self.dy = nl.ndarray((rows, x.shape[1]), dy.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=self.dy, src=dy[r0 : r0 + rows, :])
        self.mean = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=self.mean, src=mean[r0 : r0 + rows, :])
        self.rstd = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=self.rstd, src=rstd[r0 : r0 + rows, :])

    def first_pass(self, w, hidden, accumulators, previous=None, dx=None):
        """Pass 1 and the row constants, a group of chunks at a time: VectorE forms g = (dy - 0) * w (GpSimd
        the last G_ON_GPSIMD of each chunk's columns, as a plain product) and p = (x - mean) * dy (its
        one-cycle subtract-then-multiply form) while TensorE accumulates the parameter gradients, then
        GpSimd forms p * w, then ScalarE writes g * rstd (kept for pass 2) and sums it and p * w, each
        chunk's sums in their own column.

        ``previous`` (another ``_GradientRows``, whose pass 1 is issued) has its pass 2 into ``dx`` issued
        after the first group's products and before their sums. Each engine's queue then finds its inputs
        ready in order: ScalarE forms the previous tile's affine term while VectorE and GpSimd form this
        tile's products, and GpSimd adds the previous tile's dx while ScalarE sums this tile's. (Issued
        after this tile's sums instead, GpSimd's share of the next tile's g would queue behind that add,
        and ScalarE would idle waiting for it.)"""
        rows, r, m, n = self.rows, self.rstd, self.mean, len(self.chunks)
        sums = nl.ndarray((rows, 2, n), nl.float32, buffer=nl.sbuf)  # per chunk: sum(g * rstd), sum(p * w)
        self.scaled_g, self.w = [], w
        for first in range(0, n, self.group):
            group = self.chunks[first : first + self.group]
            gs, ps = [], []
            for c0, c in group:
                dy_chunk = self.dy[:, c0 : c0 + c] if self.dy is not None else self._load(self.dy_hbm, c0, c)
                g = _weighted(dy_chunk, w, c0)
                p = nl.ndarray((rows, c), nl.float32, buffer=nl.sbuf)  # (x - mean) * dy = dy * n / rstd
                nisa.scalar_tensor_tensor(
                    dst=p,
                    data=self._x(c0, c),
                    op0=nl.subtract,
                    operand0=m,
                    op1=nl.multiply,
                    operand1=dy_chunk,
                )
                accumulators.add(p, dy_chunk, r, c0, c)
                gs.append(g)
                ps.append(p)
            pws = ps
            if w is not None:
                pws = []
                for (c0, c), p in zip(group, ps):
                    pw = nl.ndarray((rows, c), nl.float32, buffer=nl.sbuf)
                    nisa.tensor_tensor(
                        dst=pw, data1=p, data2=w[:rows, c0 : c0 + c], op=nl.multiply, engine=nisa.engine.gpsimd
                    )
                    pws.append(pw)
            if first == 0 and previous is not None:
                previous.finish(dx)
            for i, g in enumerate(gs, first):
                # Kept for pass 2 unless the rows stream (then only the sum is kept, as for p * w).
                scaled = _summed(g, r, sums[:, 0, i : i + 1], nl.float32 if self.tile is not None else nl.bfloat16)
                if self.tile is not None:
                    self.scaled_g.append(scaled)
            for i, pw in enumerate(pws, first):
                _summed(pw, 1.0, sums[:, 1, i : i + 1], nl.bfloat16)  # only the sum is kept
        totals = nl.ndarray((rows, 2), nl.float32, buffer=nl.sbuf)
        for j in range(2):
            _summed(sums[:, j, :], 1.0, totals[:, j : j + 1], nl.float32)
        self.k1, self.k0 = self._constants(totals[:, 0:1], totals[:, 1:2], hidden)
        self.dy = None  # pass 2 does not read dy: its SBUF is free for the next tile

    def _load(self, tensor, c0, c):
        return _load_columns(tensor, self.r0, self.rows, c0, c)

    def _x(self, c0, c):
        return self.tile[:, c0 : c0 + c] if self.tile is not None else self._load(self.x_hbm, c0, c)

    def finish(self, dx):
        """Pass 2: dx = g * rstd + k1 * x + k0 over the resident x row, which then leaves in one DMA (or,
        streamed, over each chunk of x loaded again, with g * rstd formed again from dy, each chunk
        leaving in its own DMA)."""
        r0, rows = self.r0, self.rows
        if self.tile is not None:
            for (c0, c), gr in zip(self.chunks, self.scaled_g):
                self._dx_columns(self.tile[:, c0 : c0 + c], gr)
            nisa.dma_copy(dst=dx[r0 : r0 + rows, :], src=self.tile)
            return
        for c0, c in self.chunks:
            x_chunk = self._load(self.x_hbm, c0, c)
            gr = nl.ndarray((rows, c), nl.float32, buffer=nl.sbuf)
            nisa.activation(
                dst=gr, op=nl.copy, data=_weighted(self._load(self.dy_hbm, c0, c), self.w, c0), scale=self.rstd
            )
            self._dx_columns(x_chunk, gr)
            nisa.dma_copy(dst=dx[r0 : r0 + rows, c0 : c0 + c], src=x_chunk)

    def _dx_columns(self, x_chunk, gr):
        """dx = g * rstd + k1 * x + k0 over a chunk, written over x: ScalarE forms k1 * x + k0 (VectorE for
        the last DX_ON_VECTOR of the columns), and GpSimd adds g * rstd."""
        rows, k1, k0, c = self.rows, self.k1, self.k0, x_chunk.shape[1]
        split = c - _even(c * DX_ON_VECTOR[0] // DX_ON_VECTOR[1])
        for lo, hi in ((0, split), (split, c)):
            if hi == lo:
                continue
            x_part = x_chunk[:, lo:hi]
            affine = nl.ndarray((rows, hi - lo), nl.float32, buffer=nl.sbuf)
            if lo == 0:
                nisa.activation(dst=affine, op=nl.copy, data=x_part, scale=k1, bias=k0)
            else:
                nisa.tensor_scalar(
                    dst=affine,
                    data=x_part,
                    op0=nl.multiply,
                    operand0=k1,
                    op1=nl.add,
                    operand1=k0,
                    engine=nisa.engine.vector,
                )
            # dx overwrites the x it is computed from, so a resident row leaves in one wide DMA.
            nisa.tensor_tensor(dst=x_part, data1=affine, data2=gr[:, lo:hi], op=nl.add, engine=nisa.engine.gpsimd)

    def _constants(self, sum_gr, sum_pw, hidden):
        """k1 = -rstd^2 c = -rstd^3 sum(p * w) / H and k0 = -rstd a - k1 mean = -sum(g * rstd) / H - k1 mean,
        on ScalarE (a few one-element-per-row instructions), so that pass 2 follows on the same engine."""
        rows, r = self.rows, self.rstd
        column = [nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf) for _ in range(5)]
        r2, r3, k1, neg_mean, k0 = column
        nisa.activation(dst=r2, op=nl.copy, data=r, scale=r)
        nisa.activation(dst=r3, op=nl.copy, data=r2, scale=r)
        nisa.activation(dst=r3, op=nl.copy, data=r3, scale=-1.0 / hidden)
        nisa.activation(dst=k1, op=nl.copy, data=sum_pw, scale=r3)
        nisa.activation(dst=neg_mean, op=nl.copy, data=self.mean, scale=-1.0)
        nisa.activation(dst=k0, op=nl.copy, data=sum_gr, scale=-1.0 / hidden)  # -rstd * a
        nisa.activation(dst=k0, op=nl.copy, data=k1, scale=neg_mean, bias=k0)
        return k1, k0


class _ParameterGradients(nl.NKIObject):
    """dweight^T and dbias^T accumulated over all rows in PSUM (column b holds hidden[128 b : 128 b + 128])
    by TensorE: dweight += p^T @ rstd (p = (x - mean) * dy), dbias += dy^T @ 1."""

    def __init__(self, hidden, dy_dtype):
        self.blocks = list(tiles(hidden, P))
        self.dweight_t = nl.ndarray((P, len(self.blocks)), nl.float32, buffer=nl.psum)
        self.dbias_t = nl.ndarray((P, len(self.blocks)), nl.float32, buffer=nl.psum)
        self.ones = nl.ndarray((P, 1), dy_dtype, buffer=nl.sbuf)  # dbias's matmul pairs dy with its own dtype
        nisa.memset(dst=self.ones, value=1.0)

    def add(self, p, dy_chunk, rstd, c0, c):
        rows = p.shape[0]
        for b in range(c0 // P, (c0 + c + P - 1) // P):
            b0, width = self.blocks[b]
            block = slice(b0 - c0, b0 - c0 + width)
            nisa.nc_matmul(dst=self.dweight_t[:width, b : b + 1], stationary=p[:, block], moving=rstd)
            nisa.nc_matmul(
                dst=self.dbias_t[:width, b : b + 1], stationary=dy_chunk[:, block], moving=self.ones[:rows, :]
            )

    def store(self, dweight, dbias):
        for accumulated, target in ((self.dweight_t, dweight), (self.dbias_t, dbias)):
            evicted = nl.ndarray((P, len(self.blocks)), nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=evicted, src=accumulated)
            for b, (b0, width) in enumerate(self.blocks):
                nisa.dma_copy(dst=target[b0 : b0 + width].reshape((width, 1)), src=evicted[:width, b : b + 1])


class _BackwardPlan(nl.NKIObject):
    """How the backward holds its rows in SBUF (bytes per partition): ``pipelined`` keeps three row tiles
    alive (the next one loading; this one with x, dy, g * rstd and GROUP chunks of pass-1 temporaries;
    the previous one's x and g * rstd awaiting pass 2); otherwise one tile at a time, dy streamed chunk
    by chunk and one chunk of temporaries; ``streamed`` where even that does not fit: x streams too,
    twice (``_GradientRows``). Raises when not even that fits."""

    def __init__(self, hidden, x_dtype, dy_dtype, w_dtype):
        sx, sdy, sw = itemsize(x_dtype), itemsize(dy_dtype), 0 if w_dtype is None else itemsize(w_dtype)
        available = nl.tile_size.total_available_sbuf_size
        width = min(hidden, FREE_CHUNK)
        pipelined = (
            hidden * (sw + (sx + sdy) + (sx + sdy + 4) + (sx + 4)) + GROUP * width * BACKWARD_TEMPORARIES + SBUF_RESERVE
        )
        self.pipelined = pipelined < available
        self.streamed = lean_backward_bytes(hidden, sx, sdy, sw) > available
        self.group = GROUP if self.pipelined else 1
        self.chunks = list(tiles(hidden, STREAM_CHUNK if self.streamed else FREE_CHUNK))
        streamed = streamed_backward_bytes(hidden, sx, sdy, sw)
        if self.streamed and streamed > available:
            raise ValueError(
                f"layernorm: hidden size {hidden} needs {streamed:,} bytes of SBUF per partition in the backward, "
                f"over the {available:,} available"
            )


@nki.jit
def layernorm_bwd(dy, x, weight, mean, rstd):
    """LayerNorm backward: dx, dweight and dbias from the saved per-row mean and rstd.

    With n = (x - mean) * rstd and g = dy * weight (g = dy without a weight), per row
    a = sum(g) / H and c = sum(g * n) / H:
        dx = rstd * (g - a - n * c)
        dweight = sum over rows of dy * n;  dbias = sum over rows of dy

    Args:
        dy: [N, H] gradient of the output (x's dtype).
        x: [N, H] forward input.
        weight: [H] forward weight, or None.
        mean, rstd: [N, 1] fp32 from the forward.

    IO shapes:
        returns (dx [N, H] of x's dtype, dweight [H] fp32, dbias [H] fp32), all in HBM (dweight and
        dbias are computed whether or not the module has them; they cost TensorE time only).

    Engine plan, per row tile, in two passes over its chunks
        Pass 1 (``_GradientRows.first_pass``): VectorE forms g = (dy - 0) * weight (GpSimd
        G_ON_GPSIMD of the columns) and p = (x - mean) * dy (the documented one-cycle
        subtract-then-multiply form); TensorE accumulates the weight and bias gradients
        (``_ParameterGradients``); GpSimd forms p * weight; ScalarE writes g * rstd (kept for pass 2)
        while summing it, and sums p * weight: sum(g * n) = rstd * sum(p * w).
        Pass 2 (``_GradientRows.finish``): ScalarE forms k1 * x + k0 (VectorE for DX_ON_VECTOR of the
        columns), GpSimd adds g * rstd.
        Where SBUF holds three row tiles (``_BackwardPlan``), the next tile loads while this one works and
        a tile's pass 2 is issued inside the next tile's pass 1, so each engine's in-order queue has work
        whose inputs are ready; otherwise tiles go one at a time with dy streamed chunk by chunk; and where
        SBUF cannot hold even x's row (``_BackwardPlan.streamed``), x streams too, in STREAM_CHUNK columns,
        read in both passes, and pass 2 forms g * rstd again instead of keeping it.
    """
    check_shapes(
        x.shape, x.dtype, None if weight is None else weight.shape, None if weight is None else weight.dtype, None, None
    )
    rows_total, hidden = x.shape
    dx = nl.ndarray((rows_total, hidden), x.dtype, buffer=nl.shared_hbm)
    dweight = nl.ndarray((hidden,), nl.float32, buffer=nl.shared_hbm)
    dbias = nl.ndarray((hidden,), nl.float32, buffer=nl.shared_hbm)
    w = None if weight is None else _broadcast(weight, hidden)
    accumulators = _ParameterGradients(hidden, dy.dtype)
    plan = _BackwardPlan(hidden, x.dtype, dy.dtype, None if weight is None else weight.dtype)
    row_tiles = list(tiles(rows_total, P))
    if not plan.pipelined:
        for r0, rows in row_tiles:
            rows_tile = _GradientRows(dy, x, mean, rstd, r0, rows, plan)
            rows_tile.first_pass(w, hidden, accumulators)
            rows_tile.finish(dx)
    else:
        # The next tile is loaded before this one's work is issued, into its own buffers (dx is written
        # over x, so a load into a reused buffer would wait for this tile's last instruction), and a
        # tile's pass 2 is issued within the next tile's pass 1 (after its first products), so VectorE's
        # share of pass 2 (which waits for ScalarE's constants) never holds up VectorE's pass 1, which
        # every other engine waits for.
        loaded = _GradientRows(dy, x, mean, rstd, *row_tiles[0], plan)
        previous = None
        for following in row_tiles[1:] + [None]:
            current = loaded
            loaded = None if following is None else _GradientRows(dy, x, mean, rstd, *following, plan)
            current.first_pass(w, hidden, accumulators, previous, dx)
            previous = current
        previous.finish(dx)
    accumulators.store(dweight, dbias)
    return dx, dweight, dbias
