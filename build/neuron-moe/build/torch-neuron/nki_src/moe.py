"""Grouped MoE experts (every routed expert's gated MLP, one launch), forward and backward, for Trainium, in NKI.

For each token t and each of its top-k choices (expert e, routing weight w):

    out[t] = sum over its k choices of  w * down_e(act(gate_e(x[t])) * up_e(x[t]))

with the experts' weights in the transformers layout of Mixtral, Qwen3-MoE, DeepSeek-V3 and OLMoE
(``MixtralExperts``): ``w_gate_up`` [E, 2I, H] (each expert's gate rows, then its up rows) and
``w_down`` [E, H, I]. ``act`` is ``"silu"`` or ``"gelu_tanh"``.

Dimensions
    T: tokens, k: choices per token (any T*k >= 1), E: experts, H: hidden (1..max_hidden(dtype)),
    I: each expert's intermediate size (1..MAX_INTERMEDIATE). Dtypes: x and the weights share one
    of bfloat16, float16, float32; matmuls accumulate in fp32 PSUM, the down projection's output is
    rounded to the input dtype before the routing weight multiplies it (as transformers rounds it),
    and the k weighted rows of a token are summed in fp32 and rounded once.

How ragged groups are handled: a block layout
    How many tokens each expert gets is data, known only at run time. The caller (the torch op,
    :func:`routing_shape` for the sizes) sorts the T*k choices by expert and cuts each expert's group
    into blocks of up to ``block`` slots, ``tile`` slots to a token tile, the last tile padded. The
    number of blocks is bounded by a static ``num_blocks`` (every expert could end one block partly
    full), so the kernel's outer loop is static over the block slots, and everything that depends on
    the routing is a runtime value:
      - ``block_info[b] = (expert, used token tiles, used, ...)``, read into engine registers: a block with
        ``used = 0`` runs nothing (a dynamic loop of zero trips), so experts with no token read none of
        their weights; the expert register offsets the weight reads (``.ap(scalar_offset=...)``); the
        token tiles of a block are dynamic loops: one tile at a time for the gathers, transposes and
        scatters, and for the projections' matmuls in runs of 4, 2 and 1 tiles (RUN_TILES), each width
        a dynamic loop between two more columns of ``block_info``, where the runs of 4 and of 2 end
        (:func:`run_ends`: the used tiles rounded down to a multiple of 4, of 2);
      - ``slot_token`` (a padding slot: T, out of bounds) gathers x's rows per token tile, and
        ``slot_row`` (padding: T*k) scatters the weighted output rows, with indirect DMAs
        (``vector_offset``) that skip out-of-bounds rows; ``slot_weight`` is the routing weight.
    Each choice's weighted row lands at row t*k + j of a kernel-private [T*k, H] buffer; a last pass
    sums every token's k rows. No atomics, no ordering between blocks: the result is deterministic.

Tiling plan (per used block, :func:`block_plan` and :func:`part_tiles`)
    The block's x^T [H on partitions, block tokens] stays in SBUF (gathered rows, transposed on
    TensorE). The expert's intermediate is produced in parts, as in the dense kernel
    (``nki_src/mlp.py``): per intermediate tile, the expert's gate and up rows are read in 8 KiB
    rows and transposed once, g^T and u^T accumulate over H in PSUM per run of token tiles (up to 4
    tiles, 512 moving columns as in the dense kernel: a [128, 512] fp32 accumulator fills one of the
    eight PSUM banks), ScalarE applies the activation and VectorE multiplies into a^T, a run per
    instruction (the activation's [128, <=512] fp32 temporary, 2 KiB a partition, is among the small
    tiles SBUF_RESERVE keeps room for, as in the dense kernel); per hidden tile, the expert's down rows
    for the part are read and transposed once and y^T accumulates over the part's tiles, a PSUM bank
    per run. A block of n used token tiles so issues n // 4 + (n // 2) % 2 + n % 2 matmuls per weight
    tile and contraction tile instead of n. PSUM holds a bank each for gate, up, the down projection's
    sums and each transpose group (weights, x's rows, y^T back): fewer than its eight banks even with
    a block's gather, projections and scatter all in flight. Partial sums over parts go through a
    kernel-private fp32 HBM buffer, a whole hidden tile ([128, block]) per transfer.
    The weight tiles stream in use order (:class:`_WeightStream`): each read two tiles ahead (DMA queues
    run in order, so a read issued after a tile's stores would wait for them) and transposed one tile
    ahead (its PSUM evictions overlap the matmuls of the tile before). The last part writes the finished y^T (input
    dtype) into the x^T buffer, which it no longer needs; each token tile is then transposed back
    to rows, multiplied by its routing weights in the PSUM eviction, and scattered.
    Every used block reads its expert's weights once, so an expert with up to ``block`` slots reads
    them once.

Backward (:func:`moe_bwd`, one launch)
    The gradients of out[t] = sum over t's k choices (e, w) of w * y_e(x[t]). Per choice, the expert's
    MLP sees dy_e = w * dy[t] (rounded to the input dtype, as autograd of transformers' module has it),
    and with Wg, Wu, Wd the expert's gate, up and down weights:

        g = x Wg^T, u = x Wu^T, a = act(g) * u        (recomputed: the grouped forward saves nothing)
        da = dy_e Wd;  dg = da * u * act'(g);  du = da * act(g)
        dx[t] = the sum over t's choices of dg Wg + du Wu
        dWd = sum over the expert's choices of dy_e^T a;  dWg = dg^T x;  dWu = du^T x
        d w = dy[t] . y_e(x[t]) = a . (dy[t] Wd)      (the routing weight's gradient, from the unscaled da)

Backward dimensions
    As the forward's: T tokens, k choices, E experts, H hidden, I intermediate (any sizes, last tiles
    partial), x, dy and the weights in one of bfloat16, float16, float32; matmuls accumulate in fp32
    PSUM, dx's sums over the intermediate and the routing weights' gradients in fp32 SBUF. The
    forward's limits hold here too: at its hidden-size limits a block is one token tile
    (:func:`backward_block_plan`).

Backward block layout
    The forward's (the choices sorted by expert, cut into blocks, read at run time
    from ``block_info`` and the slot tables), with this kernel's block size (:func:`backward_routing_shape`:
    it keeps more of a block on chip) and two more runtime values per block: ``starts`` (the block is
    its expert's first) and ``continues`` (a later one). An expert's weight gradients are sums over its
    blocks: its first block writes them, a later block reads them back and adds (each a dynamic loop of
    zero or one trip). ``expert_idle`` marks the experts no choice is routed to: their weight gradients
    are zeroed, the only memory traffic they cost. dx is formed as the forward's output is: each
    choice's row at row t*k + j of a kernel-private buffer, then every token's k rows summed in fp32.
    The routing weights' gradients are scattered per slot (padding slots skipped).

Backward tiling plan (per used block, token-major: a token tile's slots on partitions)
    The block stays on chip: x's and dy_e's gathered rows (the weight gradients contract over tokens),
    x^T and dy^T (transposed on TensorE once; g, u and da contract over H) and dx's fp32 sums. The
    intermediate goes in parts (:func:`backward_part_plan`: up to 4 KiB of a down-weight row, as SBUF
    allows), as the forward's:
      1. da for the part: the down weight's row segment of each hidden tile is read in its own layout
         (the moving operand; nothing transposed), DOWN_GROUP of them summed in PSUM per token tile and
         added into the part's da in SBUF (fp32). The next part's step 1 runs beside this part's step
         2, a slice of hidden tiles after each intermediate tile, so the down weight's reads spread
         over the part instead of stalling TensorE at its start.
      2. per intermediate tile: its gate and up rows are read in 8 KiB rows and transposed on TensorE.
         With ``paired`` (:func:`backward_part_plan`: when SBUF holds both transposes) they sit side by
         side, one moving operand of 2 * 128 columns, so g and u of a token tile (x^T stationary) take
         one matmul per hidden tile into one PSUM tile and one eviction; otherwise one matmul each.
         (The token tiles cannot be the moving operand here: a block of this layout often has only one
         or two, and TensorE's 128x128 transposes of the weights, which no layout avoids, stay.) a, dg,
         du come from da and the routing weight (``mlp._elementwise_grads``: ScalarE, VectorE, GpSimd;
         the weight folded into VectorE's two products with da, a written straight into the part's
         buffer); each tile's share of the routing weight's gradient, a . da, goes to its own column
         and the part's shares are summed into it once per part. dg and du are transposed (into one
         PSUM bank, one eviction, when the tile is whole) and dx's sums add dg Wg + du Wu (the rows as
         read are the moving operand, 512 columns); dWg's and dWu's rows sum over the token tiles in
         PSUM (dg, du stationary, x's rows moving, 512 columns) and are written in 4 KiB row segments,
         the earlier blocks' sums (a continuing block) read a segment ahead, the first while the tile
         computes.
      3. dWd for the part, per hidden tile: dy_e's rows stationary, a moving, summed over the token
         tiles in PSUM, written as [hidden tile, part] segments.
    Every used block reads its expert's weights once, gate/up rows two tiles ahead when SBUF allows.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from ._common import SMALLEST_SBUF_BYTES, P, ceil_div, dtype_name, itemsize, tiles

# The fused MLP's limits and activations, which each expert's MLP shares.
from .mlp import (  # noqa: F401  (ACTIVATIONS, DTYPES, MAX_HIDDEN*, max_hidden: this kernel's limits too)
    ACTIVATIONS,
    DTYPES,
    MAX_HIDDEN,
    MAX_HIDDEN_FP32,
    MAX_INTERMEDIATE,
    PSUM_BANK_BYTES,
    SATURATING_ROW_BYTES,
    SBUF_RESERVE,
    WEIGHT_ROW_CHUNK,
    _act_op,
    _elementwise_grads,
    _Evictions,
    _group_size,
    _transpose_rows_into,
    check_sizes_and_dtype,
    max_hidden,
)

TOKEN_TILE = 128  # slots per token tile: one gather of rows onto partitions, one transpose
MAX_BLOCK_TOKENS = 1024  # slots of one block, whose x^T stays in SBUF while the expert's weights stream past
PLAN_SBUF_BYTES = SMALLEST_SBUF_BYTES  # the block layout is planned for Trn1's SBUF, the smallest target's
MOVING_COLUMNS = PSUM_BANK_BYTES // 4  # moving free size of one matmul: a PSUM bank of fp32
# Token tiles per matmul of the forward's projections, widest first: a block's used token tiles go in runs
# of 4 (MOVING_COLUMNS), then at most one run of 2 and one of 1 (the count's binary digits), so a block of
# n used tiles issues at most n // 4 + 2 matmuls per weight tile (and ceil(n / 4) when n % 4 is 0, 1 or 2).
WIDEST_RUN = MOVING_COLUMNS // TOKEN_TILE
RUN_TILES = tuple(WIDEST_RUN >> s for s in range(WIDEST_RUN.bit_length()))  # (4, 2, 1)
# block_info columns: expert, used token tiles, used (0 or 1); for the backward, which accumulates an
# expert's weight gradients over its blocks: starts (1: the expert's first block), continues (1: a later one);
# then for the forward, where the runs of each width but the last end (:func:`run_ends`, in token tiles)
RUN_END_FIELDS = tuple(range(5, 5 + len(RUN_TILES) - 1))
BLOCK_FIELDS = 5 + len(RUN_END_FIELDS)
# Weight tiles whose reads are issued ahead of the tile in use: DMA queues run in order, so a read issued
# after a tile's stores (partial sums, scattered rows) would wait for them and stall TensorE.
PREFETCH = 2


def check_shapes(x_shape, gate_up_shape, down_shape, activation, dtypes=None):
    """Raise ValueError naming the op, the argument, the value and the limit when the kernel cannot take them."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe_experts: activation {activation!r} is not one of {ACTIVATIONS}")
    if len(x_shape) != 2 or x_shape[0] < 1:
        raise ValueError(f"moe_experts: x must be 2-D [tokens >= 1, hidden], got shape {tuple(x_shape)}")
    hidden = x_shape[1]
    if len(down_shape) != 3 or down_shape[1] != hidden:
        raise ValueError(
            f"moe_experts: down weight of shape {tuple(down_shape)} does not match hidden size {hidden} "
            f"(expected [experts, {hidden}, intermediate])"
        )
    experts, _, inter = down_shape
    if tuple(gate_up_shape) != (experts, 2 * inter, hidden):
        raise ValueError(
            f"moe_experts: gate_up weight of shape {tuple(gate_up_shape)} does not match "
            f"[{experts}, 2 * {inter}, {hidden}] (from down weight {tuple(down_shape)} and x {tuple(x_shape)})"
        )
    if experts < 1:
        raise ValueError(f"moe_experts: the weights hold no expert (shape {tuple(down_shape)})")
    check_sizes_and_dtype("moe_experts", hidden, inter, dtypes, "x and the weights")


def _fixed_bytes(block, hidden, dtype):
    """SBUF per partition that does not grow with the part: weight staging, x^T, the row tiles."""
    size = itemsize(dtype)
    h_tiles = ceil_div(hidden, P)
    # gate/up rows: PREFETCH + 1 raw tiles in flight, two transposed (the gate and up of the tile in use)
    staging = (PREFETCH + 1 + 2) * h_tiles * P * size
    rows = 2 * hidden * size  # the gathered x rows and the weighted output rows of one token tile
    partial = 4 * block * 4  # a hidden tile's earlier sums (this one's and the next's) and new sums, fp32
    return SBUF_RESERVE + staging + rows + h_tiles * block * size + partial


def _part_tile_bytes(block, dtype):
    """SBUF per partition per intermediate tile of a part: its a^T and the down weight's staging (PREFETCH
    + 1 raw tiles in flight, one transposed)."""
    size = itemsize(dtype)
    return block * size + (PREFETCH + 2) * P * size


def largest_block(tokens, fits):
    """(tile, block tiles): slots per token tile and the most token tiles per block (up to
    MAX_BLOCK_TOKENS, in powers of two of tiles) for which ``fits(tile, block_tiles)``, or None."""
    tile = min(TOKEN_TILE, tokens)
    block_tiles = min(ceil_div(tokens, tile), MAX_BLOCK_TOKENS // tile)
    while block_tiles >= 1:
        if fits(tile, block_tiles):
            return tile, block_tiles
        block_tiles //= 2
    return None


def block_plan(tokens, hidden, inter, dtype):
    """(tile, block tiles) of the forward: the largest block whose x^T leaves room for one intermediate
    tile in PLAN_SBUF_BYTES. The routing layout depends on it, so it depends on no target."""

    def fits(tile, block_tiles):
        block = block_tiles * tile
        return _fixed_bytes(block, hidden, dtype) + _part_tile_bytes(block, dtype) <= PLAN_SBUF_BYTES

    plan = largest_block(tokens, fits)
    if plan is None:
        raise ValueError(
            f"moe_experts: hidden size {hidden} ({dtype_name(dtype)}) does not fit the "
            f"{PLAN_SBUF_BYTES // 1024} KiB of SBUF per partition the block layout is planned for"
        )
    return plan


def part_tiles(block, hidden, inter, dtype, sbuf_bytes):
    """Intermediate tiles per part: as many as the target's SBUF holds beside the fixed buffers."""
    fit = (sbuf_bytes - _fixed_bytes(block, hidden, dtype)) // _part_tile_bytes(block, dtype)
    return max(1, min(ceil_div(inter, P), fit))


def routing_shape(tokens, top_k, experts, hidden, inter, dtype, plan=block_plan):
    """(tile, block, num_blocks): the block layout's sizes, from ``plan`` (the forward's
    :func:`block_plan`, or the backward's). ``num_blocks`` bounds the blocks any routing needs: an
    expert's n choices take ceil(n / block) blocks, at most (n + block - 1) / block, and the choices of
    all experts sum to T*k (each block also holds at least one choice)."""
    tile, block_tiles = plan(tokens, hidden, inter, dtype)
    block = tile * block_tiles
    choices = tokens * top_k
    return tile, block, min(choices, (choices + experts * (block - 1)) // block)


def run_ends(used_tiles):
    """Where a block's runs of each width of RUN_TILES but the last (1) end, in token tiles: ``used_tiles``
    rounded down to a multiple of the width (ints, or integer tensors elementwise). The runs of a width
    start where the wider ones end, and the runs of one tile end at ``used_tiles``."""
    return [used_tiles // width * width for width in RUN_TILES[:-1]]


def expert_rows(weight, expert, r0, rows, c0, cols):
    """weight[expert, r0 : r0 + rows, c0 : c0 + cols] of an [E, R, C] weight, the expert a register: an
    access pattern whose start moves by whole experts (``scalar_offset``)."""
    width = weight.shape[2]
    return weight.ap(pattern=[[width, rows], [1, cols]], offset=r0 * width + c0, scalar_offset=expert)


def check_tables(kernel, routing, layout, block_info, slot_token, slot_row, slot_weight):
    """Raise ValueError naming ``kernel`` when a routing table's shape is not the block layout's
    (``routing``: tokens, top_k, experts; ``layout``: block and num_blocks from a routing_shape)."""
    tokens, top_k, experts = routing
    block, num_blocks = layout
    expected = {
        "block_info": (block_info, (num_blocks, BLOCK_FIELDS)),
        "slot_token": (slot_token, (num_blocks * block, 1)),
        "slot_row": (slot_row, (num_blocks * block, 1)),
        "slot_weight": (slot_weight, (num_blocks * block, 1)),
    }
    for name, (table, shape) in expected.items():
        if tuple(table.shape) != shape:
            raise ValueError(
                f"{kernel}: {name} of shape {tuple(table.shape)} is not {shape} (the block layout of "
                f"{tokens} tokens, top-{top_k}, {experts} experts: routing_shape)"
            )


class _Block(nl.NKIObject):
    """One used block's buffers and runtime values: its expert and token-tile count (registers), its
    runs of token tiles for the projections ((tiles per run, first tile, end tile), the bounds registers
    or 0), its slots' offset in the slot tables, x^T (then y^T), a^T of the current part."""

    def __init__(self, expert, used_tiles, runs, slot0, x_t, act_t):
        self.expert, self.used_tiles, self.runs, self.slot0 = expert, used_tiles, runs, slot0
        self.x_t, self.act_t = x_t, act_t


class _WeightStream(nl.NKIObject):
    """One block's expert weight tiles in the order the block uses them: (weight, r0, rows, c0, cols) for
    weight[expert, r0 : r0 + rows, c0 : c0 + cols]. Each tile is read PREFETCH tiles ahead of its use and
    transposed on TensorE one tile ahead, so TensorE finds its operands loaded and evicted."""

    def __init__(self, experts, expert, specs):
        self.experts, self.expert, self.specs = experts, expert, specs
        self.loaded = []
        self.issued, self.transposed, self.ready = 0, 0, None

    def _read(self):
        weight, r0, rows, c0, cols = self.specs[self.issued]
        raw = nl.ndarray((rows, cols), self.experts.dtype, buffer=nl.sbuf)
        for k0, k in tiles(cols, WEIGHT_ROW_CHUNK):
            nisa.dma_copy(dst=raw[:, k0 : k0 + k], src=expert_rows(weight, self.expert, r0, rows, c0 + k0, k))
        self.loaded.append((raw, rows, cols))
        self.issued += 1

    def _transpose_next(self):
        while self.issued < len(self.specs) and len(self.loaded) <= PREFETCH:
            self._read()
        raw, rows, cols = self.loaded.pop(0)
        out = nl.ndarray((P, ceil_div(cols, P), rows), self.experts.dtype, buffer=nl.sbuf)
        _transpose_rows_into(out, raw, rows, cols, self.experts.dtype, self.experts.evictions)
        self.transposed += 1
        return out

    def take(self):
        """The next tile, transposed: SBUF [P, ceil(cols/128), rows]. The tile after it is transposed now,
        before this one's matmuls, so its PSUM evictions overlap them."""
        if self.ready is None:
            self.ready = self._transpose_next()
        current = self.ready
        self.ready = self._transpose_next() if self.transposed < len(self.specs) else None
        return current


def _load_fields(info, fields):
    """Registers holding the block_info columns ``fields`` of the block row in ``info`` (SBUF [1, BLOCK_FIELDS])."""
    registers = []
    for field in fields:
        registers.append(nisa.register_alloc())
        nisa.register_load(registers[-1], info[0:1, field : field + 1])
    return registers


def _slot_column(table, start, tile, dtype):
    """table[start : start + tile] as an SBUF [tile, 1] column: one value per partition."""
    column = nl.ndarray((tile, 1), dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=column, src=table[nl.ds(start, tile), :])
    return column


class _Experts(nl.NKIObject):
    """What the forward's steps share: inputs, the routing tables, outputs and the plan."""

    def __init__(self, x, w_gate_up, w_down, slot_token, slot_row, slot_weight, rows_out, partial, plan, activation):
        self.x, self.w_gate_up, self.w_down = x, w_gate_up, w_down
        self.slot_token, self.slot_row, self.slot_weight = slot_token, slot_row, slot_weight
        self.rows_out, self.partial, self.activation = rows_out, partial, activation
        self.tile, self.block = plan
        self.hidden = x.shape[1]
        self.inter = w_down.shape[2]
        self.dtype = x.dtype
        self.evictions = _Evictions()

    def weight_stream(self, blk, parts):
        """The block's weight tiles in use order: per part, each intermediate tile's gate and up rows,
        then each hidden tile's down row segment for the part."""
        specs = []
        for part in parts:
            for i0, isz in part:
                specs.append((self.w_gate_up, i0, isz, 0, self.hidden))
                specs.append((self.w_gate_up, self.inter + i0, isz, 0, self.hidden))
            p0 = part[0][0]
            p_cols = part[-1][0] + part[-1][1] - p0
            for h0, hsz in tiles(self.hidden, P):
                specs.append((self.w_down, h0, hsz, p0, p_cols))
        return _WeightStream(self, blk.expert, specs)

    def gather(self, blk):
        """x^T of the block's used token tiles: x's rows gathered by slot (padding slots stay zero)."""
        tile, hidden = self.tile, self.hidden
        for j in nl.dynamic_range(blk.used_tiles):
            index = _slot_column(self.slot_token, blk.slot0 + j * tile, tile, nl.int32)
            rows = nl.ndarray((tile, hidden), self.dtype, buffer=nl.sbuf)
            nisa.memset(dst=rows, value=0.0)
            source = self.x.ap(pattern=[[hidden, tile], [1, hidden]], offset=0, vector_offset=index, indirect_dim=0)
            nisa.dma_copy(dst=rows, src=source, oob_mode=nisa.oob_mode.skip)
            _transpose_rows_into(blk.x_t[:, :, nl.ds(j * tile, tile)], rows, tile, hidden, self.dtype, self.evictions)

    def gate_up(self, blk, part, stream):
        """a^T = act(g^T) * u^T for the part's intermediate tiles, a run of token tiles per matmul."""
        h_tiles = list(tiles(self.hidden, P))
        tile = self.tile
        for j_part, (_, isz) in enumerate(part):
            wg_t = stream.take()
            wu_t = stream.take()
            for run_tiles, first_tile, end_tile in blk.runs:
                width = run_tiles * tile
                for j in nl.dynamic_range(first_tile, end_tile, run_tiles):
                    columns = nl.ds(j * tile, width)
                    gate = nl.ndarray((isz, width), nl.float32, buffer=nl.psum)
                    up = nl.ndarray((isz, width), nl.float32, buffer=nl.psum)
                    for k, (_, hsz) in enumerate(h_tiles):
                        nisa.nc_matmul(dst=gate, stationary=wg_t[:hsz, k, :isz], moving=blk.x_t[:hsz, k, columns])
                    for k, (_, hsz) in enumerate(h_tiles):
                        nisa.nc_matmul(dst=up, stationary=wu_t[:hsz, k, :isz], moving=blk.x_t[:hsz, k, columns])
                    activated = nl.ndarray((isz, width), nl.float32, buffer=nl.sbuf)
                    nisa.activation(dst=activated, op=_act_op(self.activation), data=gate)
                    nisa.tensor_tensor(dst=blk.act_t[:isz, j_part, columns], data1=activated, data2=up, op=nl.multiply)

    def down(self, blk, part, stream, first, last):
        """y^T (+)= Wd[:, part] a^T[part] per hidden tile; the last part leaves y^T (input dtype) in x^T's buffer.

        Partial sums over parts move between parts a whole hidden tile at a time ([128, block] fp32: long
        rows, full DMA efficiency; columns past the used token tiles carry nothing and are never read as
        results), and each tile's earlier sums are read before the previous tile's are stored."""
        tile, block = self.tile, self.block
        h_tiles = list(tiles(self.hidden, P))

        def read_earlier(h0, hsz):
            earlier = nl.ndarray((hsz, block), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=earlier, src=self.partial[h0 : h0 + hsz, :])
            return earlier

        upcoming = None if first else read_earlier(*h_tiles[0])
        for h, (h0, hsz) in enumerate(h_tiles):
            wd_t = stream.take()
            earlier = upcoming
            if not first and h + 1 < len(h_tiles):
                upcoming = read_earlier(*h_tiles[h + 1])
            total = None if last else nl.ndarray((hsz, block), nl.float32, buffer=nl.sbuf)
            for run_tiles, first_tile, end_tile in blk.runs:
                width = run_tiles * tile
                for j in nl.dynamic_range(first_tile, end_tile, run_tiles):
                    columns = nl.ds(j * tile, width)
                    acc = nl.ndarray((hsz, width), nl.float32, buffer=nl.psum)
                    for j_part, (_, isz) in enumerate(part):
                        nisa.nc_matmul(
                            dst=acc, stationary=wd_t[:isz, j_part, :hsz], moving=blk.act_t[:isz, j_part, columns]
                        )
                    target = blk.x_t[:hsz, h, columns] if last else total[:, columns]
                    if first:
                        self.evictions.evict(target, acc)
                    else:
                        nisa.tensor_tensor(dst=target, data1=acc, data2=earlier[:, columns], op=nl.add)
            if not last:
                nisa.dma_copy(dst=self.partial[h0 : h0 + hsz, :], src=total)

    def scatter(self, blk):
        """Each used token tile of y^T back to rows, times its routing weights, to its choices' rows."""
        tile, hidden, dtype = self.tile, self.hidden, self.dtype
        h_tiles = list(tiles(hidden, P))
        group = _group_size(dtype)  # 128-column transposed tiles per PSUM bank
        for j in nl.dynamic_range(blk.used_tiles):
            start = blk.slot0 + j * tile
            weight = _slot_column(self.slot_weight, start, self.tile, nl.float32)
            index = _slot_column(self.slot_row, start, self.tile, nl.int32)
            rows = nl.ndarray((tile, hidden), dtype, buffer=nl.sbuf)
            for g0 in range(0, len(h_tiles), group):
                members = h_tiles[g0 : g0 + group]
                bank = nl.ndarray((tile, group * P), dtype, buffer=nl.psum)
                for m, (_, hsz) in enumerate(members):
                    nisa.nc_transpose(
                        dst=bank[:, m * P : m * P + hsz], data=blk.x_t[:hsz, g0 + m, nl.ds(j * tile, tile)]
                    )
                c0 = members[0][0]
                cols = members[-1][0] + members[-1][1] - c0
                nisa.tensor_scalar(
                    dst=rows[:, c0 : c0 + cols], data=bank[:, :cols], op0=nl.multiply, operand0=weight[:, 0:1]
                )
            target = self.rows_out.ap(
                pattern=[[hidden, tile], [1, hidden]], offset=0, vector_offset=index, indirect_dim=0
            )
            nisa.dma_copy(dst=target, src=rows, oob_mode=nisa.oob_mode.skip)


def _combine(rows_out, out, top_k, dtype):
    """out[t] = the sum of rows_out[t*k : t*k + k], in fp32, rounded once; 128 tokens per step."""
    tokens, hidden = out.shape
    per_token = rows_out.reshape((tokens, top_k * hidden))
    for t0, tsz in tiles(tokens, P):
        result = nl.ndarray((tsz, hidden), dtype, buffer=nl.sbuf)
        first = nl.ndarray((tsz, hidden), dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=first, src=per_token[t0 : t0 + tsz, :hidden])
        if top_k == 1:
            nisa.tensor_copy(dst=result, src=first)
        total = first
        for c in range(1, top_k):
            row = nl.ndarray((tsz, hidden), dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=row, src=per_token[t0 : t0 + tsz, c * hidden : (c + 1) * hidden])
            target = result if c == top_k - 1 else nl.ndarray((tsz, hidden), nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=target, data1=total, data2=row, op=nl.add)
            total = target
        nisa.dma_copy(dst=out[t0 : t0 + tsz, :], src=result)


@nki.jit
def moe_fwd(x, w_gate_up, w_down, block_info, slot_token, slot_row, slot_weight, top_k, activation):
    """Grouped MoE experts forward: every block of routed tokens through its expert's gated MLP,
    weighted by the routing weights and summed per token.

    Args:
        x: [T, H] the tokens (each token's row once; the slots index it).
        w_gate_up: [E, 2I, H] each expert's gate rows, then its up rows. w_down: [E, H, I].
        block_info: int32 [NB, BLOCK_FIELDS] per block slot (expert, used token tiles, used 0/1, the
            backward's starts/continues flags, unused here, and where the used tiles' runs of 4 and 2 end).
        slot_token: int32 [NB * block, 1] the token of each slot (T for padding).
        slot_row: int32 [NB * block, 1] the choice t*k + j of each slot (T*k for padding).
        slot_weight: float32 [NB * block, 1] the routing weight of each slot (0 for padding).
        top_k: k, choices per token. activation: "silu" or "gelu_tanh".
        (tile, block, NB) are :func:`routing_shape`'s.

    IO shapes:
        returns out [T, H] in x's dtype.

    Tiling plan: the module docstring's; per used block (a static loop over NB, each body a dynamic
    loop of zero or one trip), gather, then per part gate_up and down (their matmuls over runs of up
    to 4 token tiles), then scatter; finally the per-token sum of the k weighted rows.

    Engine plan
        TensorE: x and weight transposes, the projections, y's transposes back. ScalarE: the
        activation and half the evictions. VectorE: gate*up, partial sums, the weighted evictions,
        the k-way sum, half the evictions. DMA: gathers/scatters (indirect), weight rows, partials.
    """
    dtype = x.dtype
    check_shapes(x.shape, w_gate_up.shape, w_down.shape, activation, [dtype, w_gate_up.dtype, w_down.dtype])
    tokens, hidden = x.shape
    experts, _, inter = w_down.shape
    tile, block, num_blocks = routing_shape(tokens, top_k, experts, hidden, inter, dtype)
    check_tables(
        "moe_experts", (tokens, top_k, experts), (block, num_blocks), block_info, slot_token, slot_row, slot_weight
    )
    n_part = part_tiles(block, hidden, inter, dtype, nl.tile_size.total_available_sbuf_size)
    i_tiles = list(tiles(inter, P))
    parts = [i_tiles[k : k + n_part] for k in range(0, len(i_tiles), n_part)]
    out = nl.ndarray((tokens, hidden), dtype, buffer=nl.shared_hbm)
    rows_out = nl.ndarray((tokens * top_k, hidden), dtype, buffer=nl.hbm)
    partial = nl.ndarray((hidden, block), nl.float32, buffer=nl.hbm) if len(parts) > 1 else None
    experts_run = _Experts(
        x, w_gate_up, w_down, slot_token, slot_row, slot_weight, rows_out, partial, (tile, block), activation
    )
    x_t = nl.ndarray((P, ceil_div(hidden, P), block), dtype, buffer=nl.sbuf)
    act_t = nl.ndarray((P, n_part, block), dtype, buffer=nl.sbuf)
    info = nl.ndarray((1, BLOCK_FIELDS), nl.int32, buffer=nl.sbuf)
    for b in range(num_blocks):
        nisa.dma_copy(dst=info, src=block_info[b : b + 1, :])
        expert, used_tiles, used, *ends = _load_fields(info, (0, 1, 2) + RUN_END_FIELDS)
        # runs of RUN_TILES token tiles, each width's from where the wider ones end; a width wider than
        # the block is left out (its runs end at 0, where the next width's start)
        bounds = [0, *ends, used_tiles]
        runs = [(width, bounds[n], bounds[n + 1]) for n, width in enumerate(RUN_TILES) if width * tile <= block]
        for _ in nl.dynamic_range(used):
            blk = _Block(expert, used_tiles, runs, b * block, x_t, act_t)
            stream = experts_run.weight_stream(blk, parts)
            experts_run.gather(blk)
            for n, part in enumerate(parts):
                experts_run.gate_up(blk, part, stream)
                experts_run.down(blk, part, stream, first=n == 0, last=n == len(parts) - 1)
            experts_run.scatter(blk)
    _combine(rows_out, out, top_k, dtype)
    return out


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------
# Down-weight row segments whose da products sum in PSUM before one fp32 add into the part's da in SBUF
DOWN_GROUP = 4
DOWN_PREFETCH = 2  # down-weight row segments read ahead of the one in use


def backward_part_width(dtype):
    """The widest part, in intermediate columns: down-weight and dWd row segments of
    SATURATING_ROW_BYTES (the DMA's full rate)."""
    return SATURATING_ROW_BYTES // itemsize(dtype)


def _grad_row_columns(hidden, dtype):
    """Columns of a weight gradient's rows per SBUF tile and store: rows of SATURATING_ROW_BYTES."""
    return min(hidden, SATURATING_ROW_BYTES // itemsize(dtype))


def _backward_sbuf_bytes(tile, block_tiles, hidden, inter, dtype, width, ahead, paired):
    """SBUF per partition of a block of ``block_tiles`` token tiles with parts of up to ``width``
    intermediate columns (``ahead``: 1 when the next intermediate tile's gate/up rows are read while
    this one's are in use; ``paired``: 1 when an intermediate tile's gate and up rows are transposed side
    by side, one moving operand for g and u)."""
    size = itemsize(dtype)
    h_cols = ceil_div(hidden, P) * P
    part = min(width, ceil_div(inter, P) * P)
    per_tile = (
        2 * (h_cols // P) * tile * size  # x^T, dy^T
        + 2 * hidden * size  # x's and dy_e's rows
        + 4 * hidden  # dx's sums
        + part * (4 + size)  # the part's da (fp32) and a
        + 4 * part // P  # the part's shares of the routing weight's gradient
        + 4 * P * size  # g, u, dg, du of an intermediate tile
        + 2 * 4  # the routing weight and its gradient's sum
    )
    fixed = (
        SBUF_RESERVE
        + (2 + 2 * ahead) * hidden * size  # gate and up rows in use (and the next tile's)
        + (1 + paired) * h_cols * size  # one of them transposed, or both side by side
        + (DOWN_GROUP + DOWN_PREFETCH) * part * size  # down-weight row segments in use and in flight
        # weight-gradient row segments: the one being written and the earlier blocks' sums of it and of the
        # next (read a segment ahead), for gate/up's rows and for dWd's
        + 3 * (_grad_row_columns(hidden, dtype) + part) * size
        + 2 * tile * size  # dg^T, du^T of a token tile
    )
    return fixed + block_tiles * per_tile


def backward_part_plan(tile, block_tiles, hidden, inter, dtype, sbuf_bytes):
    """(width, ahead, paired): the widest part (a power of two of columns, at most
    :func:`backward_part_width`) that fits ``sbuf_bytes``; ``paired`` 1 when an intermediate tile's gate
    and up rows transposed side by side fit beside it (g and u from one matmul per hidden tile and token
    tile, twice the moving columns: half the matmuls), then ``ahead`` 1 when reading gate/up rows ahead
    fits beside those too; None if no part fits."""

    def fits(width, ahead, paired):
        return _backward_sbuf_bytes(tile, block_tiles, hidden, inter, dtype, width, ahead, paired) <= sbuf_bytes

    width = backward_part_width(dtype)
    while width >= P:
        if fits(width, 0, 0):
            paired = int(fits(width, 0, 1))
            return width, int(fits(width, 1, paired)), paired
        width //= 2
    return None


def backward_block_plan(tokens, hidden, inter, dtype):
    """(tile, block tiles) of the backward's block layout: the largest block for which some part fits
    PLAN_SBUF_BYTES (the layout depends on no target; the part and reading ahead do, :func:`moe_bwd`)."""

    def fits(tile, block_tiles):
        return backward_part_plan(tile, block_tiles, hidden, inter, dtype, PLAN_SBUF_BYTES) is not None

    plan = largest_block(tokens, fits)
    if plan is None:
        raise ValueError(
            f"moe_experts backward: hidden size {hidden} ({dtype_name(dtype)}) does not fit the "
            f"{PLAN_SBUF_BYTES // 1024} KiB of SBUF per partition the backward's block layout is planned for "
            f"(a token tile's rows, their transposes and dx's fp32 sums beside one intermediate tile's weights)"
        )
    return plan


def backward_routing_shape(tokens, top_k, experts, hidden, inter, dtype):
    """(tile, block, num_blocks) of the backward's block layout (:func:`routing_shape` with
    :func:`backward_block_plan`)."""
    return routing_shape(tokens, top_k, experts, hidden, inter, dtype, plan=backward_block_plan)


class _BackwardBlock(nl.NKIObject):
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


class _Part(nl.NKIObject):
    """A run of intermediate tiles ((start, size) each): its first column and width, its da (fp32, summed
    over the hidden tiles) and a, token-major, ``width`` columns per token tile, and each intermediate
    tile's share of the routing weights' gradients (fp32, a column per intermediate tile and token tile);
    ``started`` once a group of hidden tiles has written da (later groups add to it)."""

    def __init__(self, intermediate_tiles, da, act, shares):
        self.first = intermediate_tiles[0][0]
        self.cols = intermediate_tiles[-1][0] + intermediate_tiles[-1][1] - self.first
        self.tiles, self.da, self.act, self.shares = intermediate_tiles, da, act, shares
        self.started = False


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
    ``d_weight`` (one fp32 column per tile); per part (:class:`_Part`) da and a, ``width`` per tile, and the
    routing-weight gradient's shares; per intermediate tile g, u (u right after g's columns, as one
    paired matmul leaves them) and dg, du (128 apart: a whole tile's pair is transposed in one call), 2 * 128 per
    tile (fresh buffers: the next tile's need not wait for this one's last reads). Feature-major:
    ``x_t``/``dy_t`` [128, H tiles, block tiles * tile]."""

    def __init__(self, dy, x, w_gate_up, w_down, tables, outputs, plan, activation):
        self.dy, self.x, self.w_gate_up, self.w_down = dy, x, w_gate_up, w_down
        self.slot_token, self.slot_row, self.slot_weight = tables
        self.rows_out, self.d_weight_out, self.dw_gate_up, self.dw_down = outputs
        self.tile, self.block_tiles, self.width, self.ahead, self.paired = plan
        self.part_tiles = self.width // P  # intermediate tiles of a whole part
        self.activation = activation
        self.hidden = x.shape[1]
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
        self.ones = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)  # ScalarE bias constant (tanh-GELU)
        nisa.memset(dst=self.ones, value=1.0)

    def da_slices(self, part_tiles):
        """The hidden tiles (index, start, size) of the next part's da that each intermediate tile of a
        part with ``part_tiles`` tiles accumulates after its own work, evenly."""
        h_tiles = [(k, h0, hsz) for k, (h0, hsz) in enumerate(tiles(self.hidden, P))]
        per = ceil_div(ceil_div(len(h_tiles), part_tiles), DOWN_GROUP) * DOWN_GROUP  # whole PSUM groups
        return [h_tiles[t * per : (t + 1) * per] for t in range(part_tiles)]

    def weight_stream(self, blk, parts):
        """The block's weight row tiles in use order: the first part's down-weight row segments (one per
        hidden tile), then per part each intermediate tile's gate and up rows followed by its slice of
        the next part's down-weight segments (:meth:`da_slices`)."""

        def segments(part, h_slice):
            p0 = part[0][0]
            p_cols = part[-1][0] + part[-1][1] - p0
            return [(self.w_down, h0, hsz, p0, p_cols) for _, h0, hsz in h_slice]

        specs = segments(parts[0], [h for hs in self.da_slices(1) for h in hs])
        for n, part in enumerate(parts):
            slices = self.da_slices(len(part))
            for t, (i0, isz) in enumerate(part):
                specs.append((self.w_gate_up, i0, isz, 0, self.hidden))
                specs.append((self.w_gate_up, self.inter + i0, isz, 0, self.hidden))
                if n + 1 < len(parts):
                    specs += segments(parts[n + 1], slices[t])
        return _RowStream(self.dtype, blk.expert, specs, 2 * self.ahead if self.ahead else 0)

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
            index = _slot_column(self.slot_token, start, self.tile, nl.int32)
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

    def new_part(self, intermediate_tiles):
        """A part's buffers (:class:`_Part`)."""
        tile, width, bt = self.tile, self.width, self.block_tiles
        return _Part(
            intermediate_tiles,
            nl.ndarray((tile, bt * width), nl.float32, buffer=nl.sbuf),
            nl.ndarray((tile, bt * width), self.dtype, buffer=nl.sbuf),
            nl.ndarray((tile, bt * self.part_tiles), nl.float32, buffer=nl.sbuf),
        )

    def add_weight_grad_shares(self, blk, part):
        """Each token tile's routing-weight gradients += the sum of the part's shares (one reduce per part)."""
        tile, n = self.tile, len(part.tiles)
        for j in nl.dynamic_range(blk.used_tiles):
            total = nl.ndarray((tile, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=total, op=nl.add, data=part.shares[:, nl.ds(j * self.part_tiles, n)], axis=1)
            d_weight = self.d_weight[:, nl.ds(j, 1)]
            nisa.tensor_tensor(dst=d_weight, data1=d_weight, data2=total, op=nl.add)

    def accumulate_da(self, blk, part, h_slice, stream):
        """Step 1 over some hidden tiles (``h_slice``: index, start, size): da += dy[:, h] Wd[h, part]
        (unscaled) for every token tile, DOWN_GROUP hidden tiles summed in PSUM per add into da."""
        tile, width = self.tile, self.width
        for g0 in range(0, len(h_slice), DOWN_GROUP):
            group = [(k, hsz, stream.take()) for k, _, hsz in h_slice[g0 : g0 + DOWN_GROUP]]
            for j in nl.dynamic_range(blk.used_tiles):
                for c0, csz in tiles(part.cols, MOVING_COLUMNS):
                    acc = nl.ndarray((tile, csz), nl.float32, buffer=nl.psum)
                    for k, hsz, segment in group:
                        nisa.nc_matmul(
                            dst=acc,
                            stationary=self.dy_t[:hsz, k, nl.ds(j * tile, tile)],
                            moving=segment[:hsz, c0 : c0 + csz],
                        )
                    da = part.da[:, nl.ds(j * width + c0, csz)]
                    if part.started:
                        nisa.tensor_tensor(dst=da, data1=acc, data2=da, op=nl.add)
                    else:
                        self.evictions.evict(da, acc)
            part.started = True

    def _project(self, blk, w_gate, w_up, isz, gate_up):
        """g and u of one intermediate tile for every token tile, from its gate and up rows: token tile j's
        g at gate_up's columns j * 256 + [0, isz), its u right after. Paired (:func:`backward_part_plan`),
        both rows transposed side by side are one moving operand of 2 * isz columns; else one each."""
        tile, hidden, dtype, h_tiles = self.tile, self.hidden, self.dtype, ceil_div(self.hidden, P)
        if self.paired:
            both_t = nl.ndarray((P, h_tiles, 2 * isz), dtype, buffer=nl.sbuf)
            for half, rows in enumerate((w_gate, w_up)):
                _transpose_rows_into(
                    both_t[:, :, half * isz : (half + 1) * isz], rows, isz, hidden, dtype, self.evictions
                )
            groups = [(both_t, 0, 2 * isz)]
        else:
            groups = []
            for half, rows in enumerate((w_gate, w_up)):
                rows_t = nl.ndarray((P, h_tiles, isz), dtype, buffer=nl.sbuf)
                _transpose_rows_into(rows_t, rows, isz, hidden, dtype, self.evictions)
                groups.append((rows_t, half * isz, isz))
        for moving_t, c0, cols in groups:
            for j in nl.dynamic_range(blk.used_tiles):
                acc = nl.ndarray((tile, cols), nl.float32, buffer=nl.psum)
                for k, (_, hsz) in enumerate(tiles(hidden, P)):
                    nisa.nc_matmul(
                        dst=acc, stationary=self.x_t[:hsz, k, nl.ds(j * tile, tile)], moving=moving_t[:hsz, k, :cols]
                    )
                self.evictions.evict(gate_up[:, nl.ds(j * 2 * P + c0, cols)], acc)

    def intermediate_tile(self, blk, part, i0, isz, stream):
        """Step 2 for one intermediate tile of ``part``; the first of the intermediate starts dx's sums."""
        tile, hidden, dtype, width = self.tile, self.hidden, self.dtype, self.width
        column = i0 - part.first
        w_gate, w_up = stream.take(), stream.take()
        regions = [
            (kind * self.inter + i0, isz, c0, cols)
            for kind in range(2)
            for c0, cols in tiles(hidden, _grad_row_columns(hidden, dtype))
        ]
        upcoming = self._read_earlier(blk, self.dw_gate_up, regions[0])  # read while the tile computes
        gate_up = nl.ndarray((tile, self.block_tiles * 2 * P), dtype, buffer=nl.sbuf)
        grads = nl.ndarray((tile, self.block_tiles * 2 * P), dtype, buffer=nl.sbuf)  # dg, du
        self._project(blk, w_gate, w_up, isz, gate_up)
        for j in nl.dynamic_range(blk.used_tiles):
            pair = j * 2 * P
            da = part.da[:, nl.ds(j * width + column, isz)]
            a = _elementwise_grads(
                da,
                gate_up[:, nl.ds(pair, isz)],
                gate_up[:, nl.ds(pair + isz, isz)],
                grads[:, nl.ds(pair, isz)],
                grads[:, nl.ds(pair + P, isz)],
                tile,
                isz,
                self.activation,
                dtype,
                self.ones,
                scale=self.weight[:, nl.ds(j, 1)],
                a_out=part.act[:, nl.ds(j * width + column, isz)],
            )
            # the routing weight's gradient: a . da over the intermediate, this tile's share in its column
            # of the part's shares (summed into d_weight once per part, :meth:`add_weight_grad_shares`)
            product = nl.ndarray((tile, isz), nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=product, data1=a, data2=da, op=nl.multiply, engine=nisa.engine.gpsimd)
            share = part.shares[:, nl.ds(j * self.part_tiles + column // P, 1)]
            nisa.tensor_reduce(dst=share, op=nl.add, data=product, axis=1)
            # dx's sums += dg Wg + du Wu, contracting over the tile's intermediate rows; dg and du transposed
            # into one PSUM bank (one eviction) when the tile is whole
            grads_t = nl.ndarray((P, 2, tile), dtype, buffer=nl.sbuf)
            if isz == P:
                _transpose_rows_into(grads_t, grads[:, nl.ds(pair, 2 * P)], tile, 2 * P, dtype, self.evictions)
            else:
                for kind in range(2):
                    src = grads[:, nl.ds(pair + kind * P, isz)]
                    _transpose_rows_into(grads_t[:, kind : kind + 1, :], src, tile, isz, dtype, self.evictions)
            for c0, csz in tiles(hidden, MOVING_COLUMNS):
                acc = nl.ndarray((tile, csz), nl.float32, buffer=nl.psum)
                for kind, rows in enumerate((w_gate, w_up)):
                    nisa.nc_matmul(dst=acc, stationary=grads_t[:isz, kind, :], moving=rows[:isz, c0 : c0 + csz])
                sums = self.dx_sums[:, nl.ds(j * hidden + c0, csz)]
                if i0 == 0:
                    self.evictions.evict(sums, acc)
                else:
                    nisa.tensor_tensor(dst=sums, data1=acc, data2=sums, op=nl.add)
        for r, region in enumerate(regions):
            kind, c0 = region[0] // self.inter, region[2]
            before = upcoming
            if r + 1 < len(regions):
                upcoming = self._read_earlier(blk, self.dw_gate_up, regions[r + 1])

            def grad_rows(j, kind=kind):
                return grads[:, nl.ds(j * 2 * P + kind * P, isz)]

            def x_rows(j, s0, ssz, c0=c0):
                return self.x_rows[:, nl.ds(j * hidden + c0 + s0, ssz)]

            self._weight_grad(blk, self.dw_gate_up, region, before, grad_rows, x_rows)

    def down_weight_grad(self, blk, part):
        """Step 3: dWd[:, part] = dy_e^T a, per hidden tile (the next tile's earlier sums read meanwhile)."""
        hidden, width = self.hidden, self.width
        regions = [(h0, hsz, part.first, part.cols) for h0, hsz in tiles(hidden, P)]
        upcoming = self._read_earlier(blk, self.dw_down, regions[0])

        def act(j, s0, ssz):
            return part.act[:, nl.ds(j * width + s0, ssz)]

        for h, (h0, hsz, _, _) in enumerate(regions):
            before = upcoming
            if h + 1 < len(regions):
                upcoming = self._read_earlier(blk, self.dw_down, regions[h + 1])

            def dy_rows(j, h0=h0, hsz=hsz):
                return self.dy_rows[:, nl.ds(j * hidden + h0, hsz)]

            self._weight_grad(blk, self.dw_down, regions[h], before, dy_rows, act)

    def _read_earlier(self, blk, grad, region):
        """grad[expert, region] as the expert's earlier blocks left it, when this block continues them
        (``region``: r0, rows, c0, cols); nothing is read otherwise."""
        r0, rows, c0, cols = region
        earlier = nl.ndarray((rows, cols), self.dtype, buffer=nl.sbuf)
        for _ in nl.dynamic_range(blk.continues):
            nisa.dma_copy(dst=earlier, src=expert_rows(grad, blk.expert, r0, rows, c0, cols))
        return earlier

    def _weight_grad(self, blk, grad, region, earlier, stationary, moving):
        """grad[expert, r0 : r0 + rows, c0 : c0 + cols] (``region``) = the sum over the block's token
        tiles j of stationary(j)^T moving(j, s0, size), contracting over the tile's slots, plus the
        ``earlier`` blocks' sums (:meth:`_read_earlier`, added in fp32) when the block continues them."""
        r0, rows, c0, cols = region
        out = nl.ndarray((rows, cols), self.dtype, buffer=nl.sbuf)
        for s0, ssz in tiles(cols, MOVING_COLUMNS):
            acc = nl.ndarray((rows, ssz), nl.float32, buffer=nl.psum)
            for j in nl.dynamic_range(blk.used_tiles):
                nisa.nc_matmul(dst=acc, stationary=stationary(j), moving=moving(j, s0, ssz))
            for _ in nl.dynamic_range(blk.starts):
                self.evictions.evict(out[:, s0 : s0 + ssz], acc)
            for _ in nl.dynamic_range(blk.continues):
                nisa.tensor_tensor(dst=out[:, s0 : s0 + ssz], data1=acc, data2=earlier[:, s0 : s0 + ssz], op=nl.add)
        nisa.dma_copy(dst=expert_rows(grad, blk.expert, r0, rows, c0, cols), src=out)

    def scatter(self, blk):
        """Each used token tile's dx rows (rounded once) to its choices' rows, and its routing weights'
        gradients to theirs."""
        tile, hidden = self.tile, self.hidden
        for j in nl.dynamic_range(blk.used_tiles):
            index = _slot_column(self.slot_row, blk.slot0 + j * tile, tile, nl.int32)
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
        (tile, block, NB) are :func:`backward_routing_shape`'s, not the forward's.

    IO shapes:
        returns (dx [T, H], d_weight fp32 [T*k, 1] (row t*k + j: choice j of token t), dw_gate_up
        [E, 2I, H], dw_down [E, H, I]); dx and the weight gradients in x's dtype.

    Tiling plan: the module docstring's; per used block (a static loop over NB, each body a dynamic
    loop of zero or one trip): gather, per part steps 1-3, scatter; the idle experts' zeros first and
    the per-token sum of dx's k rows last.

    Engine plan
        TensorE: x, dy, weight and dg/du transposes and the products (g and u, one matmul when paired,
        da, dx twice, dWg, dWu, dWd). ScalarE: the activation and its derivative, half the evictions. VectorE: the products
        with da, dx's sums, the routing-weight scaling, half the evictions. GpSimd: SBUF-only products.
        DMA: gathers/scatters (indirect), weight rows, weight-gradient rows.
    """
    dtype = x.dtype
    check_shapes(x.shape, w_gate_up.shape, w_down.shape, activation, [dtype, dy.dtype, w_gate_up.dtype, w_down.dtype])
    if tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"moe_experts backward: grad_out of shape {tuple(dy.shape)} does not match x {tuple(x.shape)}")
    tokens, hidden = x.shape
    experts, _, inter = w_down.shape
    tile, block, num_blocks = backward_routing_shape(tokens, top_k, experts, hidden, inter, dtype)
    tables = (slot_token, slot_row, slot_weight)
    check_tables("moe_experts backward", (tokens, top_k, experts), (block, num_blocks), block_info, *tables)
    if tuple(expert_idle.shape) != (experts, 1):
        raise ValueError(f"moe_experts backward: expert_idle of shape {tuple(expert_idle.shape)} is not ({experts}, 1)")
    block_tiles = block // tile
    plan = backward_part_plan(tile, block_tiles, hidden, inter, dtype, nl.tile_size.total_available_sbuf_size)
    width, ahead, paired = plan if plan is not None else (P, 0, 0)
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
        (tile, block_tiles, width, ahead, paired),
        activation,
    )
    info = nl.ndarray((1, BLOCK_FIELDS), nl.int32, buffer=nl.sbuf)
    for b in range(num_blocks):
        nisa.dma_copy(dst=info, src=block_info[b : b + 1, :])
        expert, used_tiles, used, starts, continues = _load_fields(info, range(RUN_END_FIELDS[0]))
        for _ in nl.dynamic_range(used):
            blk = _BackwardBlock(expert, used_tiles, starts, continues, b * block)
            stream = grads.weight_stream(blk, parts)
            grads.gather(blk)
            # Step 1 of the next part runs beside step 2 of this one, a slice of hidden tiles after each
            # intermediate tile, so the down weight's reads spread over the part instead of stalling at its start.
            part = grads.new_part(parts[0])
            grads.accumulate_da(blk, part, grads.da_slices(1)[0], stream)
            for n in range(len(parts)):
                upcoming = grads.new_part(parts[n + 1]) if n + 1 < len(parts) else None
                slices = grads.da_slices(len(part.tiles))
                for t, (i0, isz) in enumerate(part.tiles):
                    grads.intermediate_tile(blk, part, i0, isz, stream)
                    if upcoming is not None:
                        grads.accumulate_da(blk, upcoming, slices[t], stream)
                grads.add_weight_grad_shares(blk, part)
                grads.down_weight_grad(blk, part)
                part = upcoming
            grads.scatter(blk)
    _combine(rows_out, dx, top_k, dtype)
    return dx, d_weight, dw_gate_up, dw_down
