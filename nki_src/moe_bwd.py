"""Grouped MoE experts backward (every routed expert's gated MLP backward, one launch) for Trainium, in NKI.

The gradients of ``nki_src/moe.py``'s forward, out[t] = sum over t's k choices (e, w) of w * y_e(x[t]),
y_e(x) = down_e(act(gate_e(x)) * up_e(x)). Per choice, the expert's MLP sees dy_e = w * dy[t] (rounded
to the input dtype, as autograd of transformers' module has it), and with Wg, Wu, Wd the expert's
gate, up and down weights:

    g = x Wg^T, u = x Wu^T, a = act(g) * u        (recomputed: the grouped forward saves nothing)
    da = dy_e Wd;  dg = da * u * act'(g);  du = da * act(g)
    dx[t] = the sum over t's choices of dg Wg + du Wu
    dWd = sum over the expert's choices of dy_e^T a;  dWg = dg^T x;  dWu = du^T x
    d w = dy[t] . y_e(x[t]) = a . (dy[t] Wd)      (the routing weight's gradient, from the unscaled da)

Dimensions
    As the forward's: T tokens, k choices, E experts, H hidden, I intermediate (any sizes, last tiles
    partial), x, dy and the weights in one of bfloat16, float16, float32; matmuls accumulate in fp32
    PSUM, dx's sums over the intermediate and the routing weights' gradients in fp32 SBUF. The
    forward's limits hold here too: at its hidden-size limits a block is one token tile
    (:func:`block_plan`).

Block layout
    The forward's (``nki_src/moe.py``: the choices sorted by expert, cut into blocks, read at run time
    from ``block_info`` and the slot tables), with this kernel's block size (:func:`routing_shape`:
    it keeps more of a block on chip) and two more runtime values per block: ``starts`` (the block is
    its expert's first) and ``continues`` (a later one). An expert's weight gradients are sums over its
    blocks: its first block writes them, a later block reads them back and adds (each a dynamic loop of
    zero or one trip). ``expert_idle`` marks the experts no choice is routed to: their weight gradients
    are zeroed, the only memory traffic they cost. dx is formed as the forward's output is: each
    choice's row at row t*k + j of a kernel-private buffer, then every token's k rows summed in fp32.
    The routing weights' gradients are scattered per slot (padding slots skipped).

Tiling plan (per used block, token-major: a token tile's slots on partitions)
    The block stays on chip: x's and dy_e's gathered rows (the weight gradients contract over tokens),
    x^T and dy^T (transposed on TensorE once; g, u and da contract over H) and dx's fp32 sums. The
    intermediate goes in parts (:func:`part_plan`: up to DA_PSUM_COLUMNS / block tiles columns, as many
    as SBUF holds), as the forward's:
      1. da for the part, per hidden tile: the down weight's row segment for the part is read in its own
         layout (the moving operand; nothing transposed) and each token tile's da accumulates over the
         hidden tiles in PSUM (DA_PSUM_COLUMNS per partition for the block), then goes to SBUF (fp32).
      2. per intermediate tile: its gate and up rows are read in 8 KiB rows and transposed on TensorE
         (each in turn, for g and u per token tile, x^T stationary); a, dg, du come from da times the
         routing weight (``mlp._elementwise_grads``: ScalarE, VectorE, GpSimd) and the routing weight's
         gradient adds a . da; dg and du are transposed and dx's sums add dg Wg + du Wu (the rows as
         read are the moving operand); dWg's and dWu's rows sum over the token tiles in PSUM (dg, du
         stationary, x's rows moving) and are written in 4 KiB row segments.
      3. dWd for the part, per hidden tile: dy_e's rows stationary, a moving, summed over the token
         tiles in PSUM, written as [hidden tile, part] segments.
    Every used block reads its expert's weights once, gate/up rows two tiles ahead when SBUF allows.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from ._common import P, ceil_div, dtype_name, itemsize, tiles
from .mlp import (
    PSUM_BANK_BYTES,
    SATURATING_ROW_BYTES,
    SBUF_RESERVE,
    WEIGHT_ROW_CHUNK,
    _elementwise_grads,
    _Evictions,
    _transpose_rows_into,
)
from .moe import (
    BLOCK_FIELDS,
    PLAN_SBUF_BYTES,
    _combine,
    check_shapes,
    check_tables,
    expert_rows,
    largest_block,
)
from .moe import routing_shape as _layout_shape

DA_PSUM_COLUMNS = 2048  # fp32 columns per partition (4 of PSUM's 8 banks) that hold a part's da for the block
MOVING_COLUMNS = PSUM_BANK_BYTES // 4  # moving free size of one matmul: a PSUM bank of fp32
DOWN_PREFETCH = 2  # down-weight row segments read ahead of the one in use


def part_width(block_tiles):
    """fp32 columns of one token tile's da in PSUM: the largest power of two that, for every token
    tile of the block, fits DA_PSUM_COLUMNS (a power of two, so no 512-column result crosses a bank)."""
    width = DA_PSUM_COLUMNS
    while width * block_tiles > DA_PSUM_COLUMNS:
        width //= 2
    return width


def _grad_row_columns(hidden, dtype):
    """Columns of a weight gradient's rows per SBUF tile and store: rows of SATURATING_ROW_BYTES."""
    return min(hidden, SATURATING_ROW_BYTES // itemsize(dtype))


def _sbuf_bytes(tile, block_tiles, hidden, inter, dtype, width, ahead):
    """SBUF per partition of a block of ``block_tiles`` token tiles with parts of up to ``width``
    intermediate columns (``ahead``: 1 when the next intermediate tile's gate/up rows are read while
    this one's are in use)."""
    size = itemsize(dtype)
    h_cols = ceil_div(hidden, P) * P
    part = min(width, ceil_div(inter, P) * P)
    per_tile = (
        2 * (h_cols // P) * tile * size  # x^T, dy^T
        + 2 * hidden * size  # x's and dy_e's rows
        + 4 * hidden  # dx's sums
        + part * (4 + size)  # the part's da (fp32) and a
        + 4 * P * size  # g, u, dg, du of an intermediate tile
        + 2 * 4  # the routing weight and its gradient's sum
    )
    fixed = (
        SBUF_RESERVE
        + (2 + 2 * ahead) * hidden * size  # gate and up rows in use (and the next tile's)
        + h_cols * size  # one of them transposed
        + (1 + DOWN_PREFETCH) * part * size  # down-weight row segments in flight
        + 2 * (_grad_row_columns(hidden, dtype) + part) * size  # weight-gradient rows, and their earlier sums
        + 2 * tile * size  # dg^T, du^T of a token tile
    )
    return fixed + block_tiles * per_tile


def part_plan(tile, block_tiles, hidden, inter, dtype, sbuf_bytes):
    """(width, ahead): the widest part (a power of two of columns, at most :func:`part_width`) that fits
    ``sbuf_bytes``, and 1 when reading gate/up rows ahead fits beside it too; None if no part fits."""
    width = part_width(block_tiles)
    while width >= P:
        if _sbuf_bytes(tile, block_tiles, hidden, inter, dtype, width, 0) <= sbuf_bytes:
            return width, int(_sbuf_bytes(tile, block_tiles, hidden, inter, dtype, width, 1) <= sbuf_bytes)
        width //= 2
    return None


def block_plan(tokens, hidden, inter, dtype):
    """(tile, block tiles) of the backward's block layout: the largest block for which some part fits
    PLAN_SBUF_BYTES (the layout depends on no target; the part and reading ahead do, :func:`moe_bwd`)."""

    def fits(tile, block_tiles):
        return part_plan(tile, block_tiles, hidden, inter, dtype, PLAN_SBUF_BYTES) is not None

    plan = largest_block(tokens, fits)
    if plan is None:
        raise ValueError(
            f"moe_experts backward: hidden size {hidden} ({dtype_name(dtype)}) does not fit the "
            f"{PLAN_SBUF_BYTES // 1024} KiB of SBUF per partition the backward's block layout is planned for "
            f"(a token tile's rows, their transposes and dx's fp32 sums beside one intermediate tile's weights)"
        )
    return plan


def routing_shape(tokens, top_k, experts, hidden, inter, dtype):
    """(tile, block, num_blocks) of the backward's block layout (``moe.routing_shape`` with
    :func:`block_plan`)."""
    return _layout_shape(tokens, top_k, experts, hidden, inter, dtype, plan=block_plan)


class _Block(nl.NKIObject):
    """One used block's runtime values (registers): its expert, token tiles, whether it starts its
    expert's gradients or continues them, and its slots' offset in the slot tables."""

    def __init__(self, expert, used_tiles, starts, continues, slot0):
        self.expert, self.used_tiles, self.starts, self.continues, self.slot0 = (
            expert,
            used_tiles,
            starts,
            continues,
            slot0,
        )


class _RowStream(nl.NKIObject):
    """A block's expert weight row tiles in use order, as read (no transpose): (weight, r0, rows, c0,
    cols) for weight[expert, r0 : r0 + rows, c0 : c0 + cols], each read ``ahead`` tiles before its use
    (DMA queues run in order: a read issued after a tile's gradient stores would wait for them)."""

    def __init__(self, dtype, expert, specs, ahead):
        self.dtype, self.expert, self.specs, self.ahead = dtype, expert, specs, ahead
        self.loaded = []
        self.issued = 0

    def _read(self):
        weight, r0, rows, c0, cols = self.specs[self.issued]
        raw = nl.ndarray((rows, cols), self.dtype, buffer=nl.sbuf)
        for k0, k in tiles(cols, WEIGHT_ROW_CHUNK):
            nisa.dma_copy(dst=raw[:, k0 : k0 + k], src=expert_rows(weight, self.expert, r0, rows, c0 + k0, k))
        self.loaded.append(raw)
        self.issued += 1

    def take(self):
        """The next tile, SBUF [rows, cols]."""
        while self.issued < len(self.specs) and len(self.loaded) <= self.ahead:
            self._read()
        return self.loaded.pop(0)


class _Grads(nl.NKIObject):
    """What the backward's steps share: inputs, routing tables, outputs, the plan, and the block's
    on-chip buffers (reused by every block, which orders a block's writes after the last one's reads).

    Token-major buffers put token tile j's slots on partitions and its columns at j * (row width):
    ``x_rows``/``dy_rows`` [tile, block tiles * H] (dy_e = w * dy), ``dx_sums`` (fp32), ``weight`` and
    ``d_weight`` (one fp32 column per tile), ``da`` and ``act`` (the part's, ``width`` per tile),
    ``gate_up`` and ``d_gate_up`` (an intermediate tile's g, u and dg, du: 2 * 128 per tile).
    Feature-major: ``x_t``/``dy_t`` [128, H tiles, block tiles * tile]."""

    def __init__(self, dy, x, w_gate_up, w_down, tables, outputs, plan, activation):
        self.dy, self.x, self.w_gate_up, self.w_down = dy, x, w_gate_up, w_down
        self.slot_token, self.slot_row, self.slot_weight = tables
        self.rows_out, self.d_weight_out, self.dw_gate_up, self.dw_down = outputs
        self.tile, self.block_tiles, self.width, self.ahead = plan
        self.activation = activation
        self.tokens, self.hidden = x.shape
        self.inter = w_down.shape[2]
        self.dtype = x.dtype
        self.evictions = _Evictions()
        tile, bt, hidden, dtype = self.tile, self.block_tiles, self.hidden, self.dtype
        h_tiles = ceil_div(hidden, P)
        self.x_t = nl.ndarray((P, h_tiles, bt * tile), dtype, buffer=nl.sbuf)
        self.dy_t = nl.ndarray((P, h_tiles, bt * tile), dtype, buffer=nl.sbuf)
        self.x_rows = nl.ndarray((tile, bt * hidden), dtype, buffer=nl.sbuf)
        self.dy_rows = nl.ndarray((tile, bt * hidden), dtype, buffer=nl.sbuf)
        self.dx_sums = nl.ndarray((tile, bt * hidden), nl.float32, buffer=nl.sbuf)
        self.weight = nl.ndarray((tile, bt), nl.float32, buffer=nl.sbuf)
        self.d_weight = nl.ndarray((tile, bt), nl.float32, buffer=nl.sbuf)
        self.da = nl.ndarray((tile, bt * self.width), nl.float32, buffer=nl.sbuf)
        self.act = nl.ndarray((tile, bt * self.width), dtype, buffer=nl.sbuf)
        self.gate_up = nl.ndarray((tile, bt * 2 * P), dtype, buffer=nl.sbuf)
        self.d_gate_up = nl.ndarray((tile, bt * 2 * P), dtype, buffer=nl.sbuf)
        self.ones = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)  # ScalarE bias constant (tanh-GELU)
        nisa.memset(dst=self.ones, value=1.0)

    def weight_stream(self, blk, parts):
        """The block's weight row tiles in use order: per part, the down weight's row segment of each
        hidden tile, then each intermediate tile's gate and up rows."""
        specs = []
        for part in parts:
            p0 = part[0][0]
            p_cols = part[-1][0] + part[-1][1] - p0
            for h0, hsz in tiles(self.hidden, P):
                specs.append((self.w_down, h0, hsz, p0, p_cols))
            for i0, isz in part:
                specs.append((self.w_gate_up, i0, isz, 0, self.hidden))
                specs.append((self.w_gate_up, self.inter + i0, isz, 0, self.hidden))
        return _RowStream(self.dtype, blk.expert, specs, 2 * self.ahead if self.ahead else 0)

    def _slot_column(self, table, start, dtype):
        """table[start : start + tile] as an SBUF [tile, 1] column: one value per partition."""
        column = nl.ndarray((self.tile, 1), dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=column, src=table[nl.ds(start, self.tile), :])
        return column

    def _gather_rows(self, rows, source, index):
        """rows = source's rows at ``index`` (padding slots, out of bounds, stay zero)."""
        tile, hidden = self.tile, self.hidden
        nisa.memset(dst=rows, value=0.0)
        view = source.ap(pattern=[[hidden, tile], [1, hidden]], offset=0, vector_offset=index, indirect_dim=0)
        nisa.dma_copy(dst=rows, src=view, oob_mode=nisa.oob_mode.skip)

    def gather(self, blk):
        """Per used token tile: x's rows and their transpose, dy's transpose (unscaled, for da) and
        dy_e = w * dy's rows (for dWd), the routing weights; the routing weights' gradient sums start at 0."""
        tile, hidden, dtype = self.tile, self.hidden, self.dtype
        for j in nl.dynamic_range(blk.used_tiles):
            start = blk.slot0 + j * tile
            index = self._slot_column(self.slot_token, start, nl.int32)
            weight = self.weight[:, nl.ds(j, 1)]
            nisa.dma_copy(dst=weight, src=self.slot_weight[nl.ds(start, tile), :])
            nisa.memset(dst=self.d_weight[:, nl.ds(j, 1)], value=0.0)
            x_rows = self.x_rows[:, nl.ds(j * hidden, hidden)]
            self._gather_rows(x_rows, self.x, index)
            _transpose_rows_into(self.x_t[:, :, nl.ds(j * tile, tile)], x_rows, tile, hidden, dtype, self.evictions)
            dy_rows = nl.ndarray((tile, hidden), dtype, buffer=nl.sbuf)
            self._gather_rows(dy_rows, self.dy, index)
            _transpose_rows_into(self.dy_t[:, :, nl.ds(j * tile, tile)], dy_rows, tile, hidden, dtype, self.evictions)
            nisa.tensor_scalar(
                dst=self.dy_rows[:, nl.ds(j * hidden, hidden)], data=dy_rows, op0=nl.multiply, operand0=weight
            )

    def down_input_grad(self, blk, part, stream):
        """Step 1: da = dy Wd[:, part] (unscaled) for every token tile, into ``da`` (fp32)."""
        tile, width = self.tile, self.width
        p0 = part[0][0]
        p_cols = part[-1][0] + part[-1][1] - p0
        sums = nl.ndarray((tile, self.block_tiles * width), nl.float32, buffer=nl.psum)
        for k, (_, hsz) in enumerate(tiles(self.hidden, P)):
            segment = stream.take()
            for j in nl.dynamic_range(blk.used_tiles):
                for c0, csz in tiles(p_cols, MOVING_COLUMNS):
                    nisa.nc_matmul(
                        dst=sums[:, nl.ds(j * width + c0, csz)],
                        stationary=self.dy_t[:hsz, k, nl.ds(j * tile, tile)],
                        moving=segment[:hsz, c0 : c0 + csz],
                    )
        for j in nl.dynamic_range(blk.used_tiles):
            self.evictions.evict(self.da[:, nl.ds(j * width, p_cols)], sums[:, nl.ds(j * width, p_cols)])

    def _project(self, blk, rows, isz, kind):
        """g (kind 0) or u (kind 1) of one intermediate tile for every token tile, from its weight rows."""
        tile = self.tile
        rows_t = nl.ndarray((P, ceil_div(self.hidden, P), isz), self.dtype, buffer=nl.sbuf)
        _transpose_rows_into(rows_t, rows, isz, self.hidden, self.dtype, self.evictions)
        for j in nl.dynamic_range(blk.used_tiles):
            acc = nl.ndarray((tile, isz), nl.float32, buffer=nl.psum)
            for k, (_, hsz) in enumerate(tiles(self.hidden, P)):
                nisa.nc_matmul(dst=acc, stationary=self.x_t[:hsz, k, nl.ds(j * tile, tile)], moving=rows_t[:hsz, k, :isz])
            self.evictions.evict(self.gate_up[:, nl.ds(j * 2 * P + kind * P, isz)], acc)

    def intermediate_tile(self, blk, i0, isz, column, stream, first):
        """Step 2 for one intermediate tile (``column``: its offset in the part; ``first``: the first
        tile of the intermediate, whose dx products start dx's sums)."""
        tile, hidden, dtype, width = self.tile, self.hidden, self.dtype, self.width
        w_gate, w_up = stream.take(), stream.take()
        self._project(blk, w_gate, isz, 0)
        self._project(blk, w_up, isz, 1)
        for j in nl.dynamic_range(blk.used_tiles):
            pair = j * 2 * P
            da = self.da[:, nl.ds(j * width + column, isz)]
            d_act = nl.ndarray((tile, isz), nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=d_act, data=da, op0=nl.multiply, operand0=self.weight[:, nl.ds(j, 1)])
            a = _elementwise_grads(
                d_act,
                self.gate_up[:, nl.ds(pair, isz)],
                self.gate_up[:, nl.ds(pair + P, isz)],
                self.d_gate_up[:, nl.ds(pair, isz)],
                self.d_gate_up[:, nl.ds(pair + P, isz)],
                tile,
                isz,
                self.activation,
                dtype,
                self.ones,
            )
            nisa.tensor_copy(dst=self.act[:, nl.ds(j * width + column, isz)], src=a, engine=nisa.engine.gpsimd)
            # the routing weight's gradient: a . da, over the intermediate
            product = nl.ndarray((tile, isz), nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=product, data1=a, data2=da, op=nl.multiply, engine=nisa.engine.gpsimd)
            share = nl.ndarray((tile, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=share, op=nl.add, data=product, axis=1)
            d_weight = self.d_weight[:, nl.ds(j, 1)]
            nisa.tensor_tensor(dst=d_weight, data1=d_weight, data2=share, op=nl.add)
            # dx's sums += dg Wg + du Wu, contracting over the tile's intermediate rows
            grads_t = nl.ndarray((P, 2, tile), dtype, buffer=nl.sbuf)
            for kind in range(2):
                _transpose_rows_into(
                    grads_t[:, kind : kind + 1, :],
                    self.d_gate_up[:, nl.ds(pair + kind * P, isz)],
                    tile,
                    isz,
                    dtype,
                    self.evictions,
                )
            for c0, csz in tiles(hidden, MOVING_COLUMNS):
                acc = nl.ndarray((tile, csz), nl.float32, buffer=nl.psum)
                for kind, rows in enumerate((w_gate, w_up)):
                    nisa.nc_matmul(dst=acc, stationary=grads_t[:isz, kind, :], moving=rows[:isz, c0 : c0 + csz])
                sums = self.dx_sums[:, nl.ds(j * hidden + c0, csz)]
                if first:
                    self.evictions.evict(sums, acc)
                else:
                    nisa.tensor_tensor(dst=sums, data1=acc, data2=sums, op=nl.add)
        for kind in range(2):

            def grad_rows(j, kind=kind):
                return self.d_gate_up[:, nl.ds(j * 2 * P + kind * P, isz)]

            for c0, cols in tiles(hidden, _grad_row_columns(hidden, dtype)):

                def x_rows(j, s0, ssz, c0=c0):
                    return self.x_rows[:, nl.ds(j * hidden + c0 + s0, ssz)]

                self._weight_grad(blk, self.dw_gate_up, (kind * self.inter + i0, isz, c0, cols), grad_rows, x_rows)

    def down_weight_grad(self, blk, part):
        """Step 3: dWd[:, part] = dy_e^T a, per hidden tile."""
        p0 = part[0][0]
        p_cols = part[-1][0] + part[-1][1] - p0
        hidden, width = self.hidden, self.width
        for h0, hsz in tiles(hidden, P):

            def dy_rows(j, h0=h0, hsz=hsz):
                return self.dy_rows[:, nl.ds(j * hidden + h0, hsz)]

            def act(j, s0, ssz):
                return self.act[:, nl.ds(j * width + s0, ssz)]

            self._weight_grad(blk, self.dw_down, (h0, hsz, p0, p_cols), dy_rows, act)

    def _weight_grad(self, blk, grad, region, stationary, moving):
        """grad[expert, r0 : r0 + rows, c0 : c0 + cols] (``region``) = the sum over the block's token
        tiles j of stationary(j)^T moving(j, s0, size), contracting over the tile's slots; a block that
        continues its expert's gradients adds the earlier blocks' sums (read back, added in fp32)."""
        r0, rows, c0, cols = region
        view = expert_rows(grad, blk.expert, r0, rows, c0, cols)
        earlier = nl.ndarray((rows, cols), self.dtype, buffer=nl.sbuf)
        for _ in nl.dynamic_range(blk.continues):
            nisa.dma_copy(dst=earlier, src=view)
        out = nl.ndarray((rows, cols), self.dtype, buffer=nl.sbuf)
        for s0, ssz in tiles(cols, MOVING_COLUMNS):
            acc = nl.ndarray((rows, ssz), nl.float32, buffer=nl.psum)
            for j in nl.dynamic_range(blk.used_tiles):
                nisa.nc_matmul(dst=acc, stationary=stationary(j), moving=moving(j, s0, ssz))
            for _ in nl.dynamic_range(blk.starts):
                self.evictions.evict(out[:, s0 : s0 + ssz], acc)
            for _ in nl.dynamic_range(blk.continues):
                nisa.tensor_tensor(dst=out[:, s0 : s0 + ssz], data1=acc, data2=earlier[:, s0 : s0 + ssz], op=nl.add)
        nisa.dma_copy(dst=view, src=out)

    def scatter(self, blk):
        """Each used token tile's dx rows (rounded once) to its choices' rows, and its routing weights'
        gradients to theirs."""
        tile, hidden = self.tile, self.hidden
        for j in nl.dynamic_range(blk.used_tiles):
            index = self._slot_column(self.slot_row, blk.slot0 + j * tile, nl.int32)
            rows = nl.ndarray((tile, hidden), self.dtype, buffer=nl.sbuf)
            self.evictions.evict(rows, self.dx_sums[:, nl.ds(j * hidden, hidden)])
            target = self.rows_out.ap(
                pattern=[[hidden, tile], [1, hidden]], offset=0, vector_offset=index, indirect_dim=0
            )
            nisa.dma_copy(dst=target, src=rows, oob_mode=nisa.oob_mode.skip)
            target = self.d_weight_out.ap(pattern=[[1, tile], [1, 1]], offset=0, vector_offset=index, indirect_dim=0)
            nisa.dma_copy(dst=target, src=self.d_weight[:, nl.ds(j, 1)], oob_mode=nisa.oob_mode.skip)


def _zero_idle_experts(expert_idle, grads, dtype):
    """Zero the weight gradients (``grads``, each [E, rows, cols]) of the experts ``expert_idle`` marks."""
    experts = expert_idle.shape[0]
    widest = max(min(g.shape[2], WEIGHT_ROW_CHUNK) for g in grads)
    zeros = nl.ndarray((P, widest), dtype, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0.0)
    flags = nl.ndarray((1, experts), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=flags, src=expert_idle.reshape((1, experts)))
    for e in range(experts):
        idle = nisa.register_alloc()
        nisa.register_load(idle, flags[0:1, e : e + 1])
        for _ in nl.dynamic_range(idle):
            for grad in grads:
                _, rows, cols = grad.shape
                for r0, rsz in tiles(rows, P):
                    for c0, csz in tiles(cols, WEIGHT_ROW_CHUNK):
                        nisa.dma_copy(dst=grad[e, r0 : r0 + rsz, c0 : c0 + csz], src=zeros[:rsz, :csz])


@nki.jit
def moe_bwd(dy, x, w_gate_up, w_down, block_info, slot_token, slot_row, slot_weight, expert_idle, top_k, activation):
    """Grouped MoE experts backward: every block of routed tokens through its expert's gated MLP
    backward (the forward's projections recomputed), in one launch.

    Args:
        dy: [T, H] gradient of the output. x: [T, H] the forward's tokens.
        w_gate_up: [E, 2I, H] each expert's gate rows, then its up rows. w_down: [E, H, I].
        block_info: int32 [NB, BLOCK_FIELDS] per block slot (expert, used token tiles, used 0/1,
            starts 0/1: the expert's first block, continues 0/1: a later one).
        slot_token, slot_row, slot_weight: [NB * block, 1] as the forward's (token, choice t*k + j,
            routing weight per slot; padding T, T*k, 0).
        expert_idle: int32 [E, 1], 1 for an expert no choice is routed to.
        top_k: k. activation: "silu" or "gelu_tanh".
        (tile, block, NB) are this module's :func:`routing_shape`'s, not the forward's.

    IO shapes:
        returns (dx [T, H], d_weight fp32 [T*k, 1] (row t*k + j: choice j of token t), dw_gate_up
        [E, 2I, H], dw_down [E, H, I]); dx and the weight gradients in x's dtype.

    Tiling plan: the module docstring's; per used block (a static loop over NB, each body a dynamic
    loop of zero or one trip): gather, per part steps 1-3, scatter; the idle experts' zeros first and
    the per-token sum of dx's k rows last.

    Engine plan
        TensorE: x, dy, weight and dg/du transposes and the eight products (g, u, da, dx twice, dWg,
        dWu, dWd). ScalarE: the activation and its derivative, half the evictions. VectorE: the products
        with da, dx's sums, the routing-weight scaling, half the evictions. GpSimd: SBUF-only products.
        DMA: gathers/scatters (indirect), weight rows, weight-gradient rows.
    """
    dtype = x.dtype
    check_shapes(x.shape, w_gate_up.shape, w_down.shape, activation, [dtype, dy.dtype, w_gate_up.dtype, w_down.dtype])
    if tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"moe_experts backward: grad_out of shape {tuple(dy.shape)} does not match x {tuple(x.shape)}")
    tokens, hidden = x.shape
    experts, _, inter = w_down.shape
    tile, block, num_blocks = routing_shape(tokens, top_k, experts, hidden, inter, dtype)
    tables = (slot_token, slot_row, slot_weight)
    check_tables("moe_experts backward", (tokens, top_k, experts), (block, num_blocks), block_info, *tables)
    if tuple(expert_idle.shape) != (experts, 1):
        raise ValueError(f"moe_experts backward: expert_idle of shape {tuple(expert_idle.shape)} is not ({experts}, 1)")
    block_tiles = block // tile
    plan = part_plan(tile, block_tiles, hidden, inter, dtype, nl.tile_size.total_available_sbuf_size)
    width, ahead = plan if plan is not None else (P, 0)
    i_tiles = list(tiles(inter, P))
    n_part = min(len(i_tiles), width // P)
    parts = [i_tiles[k : k + n_part] for k in range(0, len(i_tiles), n_part)]
    dx = nl.ndarray((tokens, hidden), dtype, buffer=nl.shared_hbm)
    d_weight = nl.ndarray((tokens * top_k, 1), nl.float32, buffer=nl.shared_hbm)
    dw_gate_up = nl.ndarray(tuple(w_gate_up.shape), dtype, buffer=nl.shared_hbm)
    dw_down = nl.ndarray(tuple(w_down.shape), dtype, buffer=nl.shared_hbm)
    rows_out = nl.ndarray((tokens * top_k, hidden), dtype, buffer=nl.hbm)
    _zero_idle_experts(expert_idle, (dw_gate_up, dw_down), dtype)
    grads = _Grads(
        dy,
        x,
        w_gate_up,
        w_down,
        tables,
        (rows_out, d_weight, dw_gate_up, dw_down),
        (tile, block_tiles, width, ahead),
        activation,
    )
    info = nl.ndarray((1, BLOCK_FIELDS), nl.int32, buffer=nl.sbuf)
    for b in range(num_blocks):
        nisa.dma_copy(dst=info, src=block_info[b : b + 1, :])
        registers = [nisa.register_alloc() for _ in range(BLOCK_FIELDS)]
        for field, register in enumerate(registers):
            nisa.register_load(register, info[0:1, field : field + 1])
        expert, used_tiles, used, starts, continues = registers
        for _ in nl.dynamic_range(used):
            blk = _Block(expert, used_tiles, starts, continues, b * block)
            stream = grads.weight_stream(blk, parts)
            grads.gather(blk)
            for part in parts:
                grads.down_input_grad(blk, part, stream)
                p0 = part[0][0]
                for i0, isz in part:
                    grads.intermediate_tile(blk, i0, isz, i0 - p0, stream, first=i0 == 0)
                grads.down_weight_grad(blk, part)
            grads.scatter(blk)
    _combine(rows_out, dx, top_k, dtype)
    return dx, d_weight, dw_gate_up, dw_down
