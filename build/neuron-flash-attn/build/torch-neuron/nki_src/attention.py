"""Flash attention for Trainium, in NKI: tiled online softmax, forward and backward.

Semantics are ``torch.nn.functional.scaled_dot_product_attention`` plus what transformers'
models need: grouped-query attention, causal masking aligned as transformers aligns it (the
last query sees the last key, so query i of Sq sees keys j <= i + Sk - Sq), a sliding window
(query i sees keys i + Sk - Sq - window < j), logit softcapping (``cap * tanh(s / cap)``), an
additive bias (padding masks), and packed variable-length sequences. A query row that can see
no key returns zeros.

Dimensions
    B batch, H query heads, G = H / Hkv query heads per KV head, Sq queries, Sk keys,
    D head dim (1..MAX_HEAD_DIM; above 128 the contraction over D is split in 128-row halves).

Tiling plan (forward)
    Per (batch, KV head): K^T [D, Sk] (D on partitions) and V [keys, D] plus a ones column stay
    in SBUF, loaded 128 keys at a time as the pipeline first needs them (bf16/fp16 K is
    transposed by the DMA engines); every query head of the group and every query tile reuses
    them (no KV replication in HBM). The work is a list of (128-query tile, FWD_KEY_TILE-key step)
    items run through a software pipeline (``_FWD_STAGES``): at each tick TensorE computes
    S = Q K^T for a later item into PSUM; VectorE copies an earlier item's S to SBUF, masked
    (range_select) or not (tensor_scalar_reduce), taking the row max in the same pass; GpSimd
    updates the running max; ScalarE computes P = exp(scale * S - m); P is transposed per
    128-key block, DMA_TRANSPOSE_SHARE of the blocks by the DMA engines straight into SBUF and
    the rest on TensorE (then copied out of PSUM, mostly by ScalarE); TensorE accumulates
    [P V | rowsum P] over the step in PSUM (the ones column of V yields the softmax denominator);
    VectorE rescales the running output. Items of LANES query tiles interleave, so consecutive
    items belong to different tiles whenever there are at least two. Key steps wholly outside
    the mask are skipped, which is where causal attention halves the work. The S x S scores
    never reach HBM: the forward writes only the output and the log-sum-exp.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from ._common import MASKED_LOGIT_FLOOR, P, itemsize, tiles

KEY_TILE = 512  # backward key tile: one fp32 PSUM bank of scores per query tile
FWD_KEY_TILE = 1024  # forward key step: two PSUM banks of scores, one running-max update per step
MATMUL_COLUMNS = 512  # moving columns per matmul: one fp32 PSUM bank
MAX_HEAD_DIM = 256
# SBUF bytes per partition (of Trn2's 224 KiB) for what stays resident: in the forward a KV
# head's K^T and V, in the backward also its fp32 dK/dV accumulators and one head's query side.
# The rest holds working tiles; both limits are tested at their edge.
MAX_RESIDENT_KV_BYTES = 184 * 1024
MAX_RESIDENT_BWD_BYTES = 200 * 1024
LANES = 4  # forward query tiles whose key steps interleave in the pipeline
# Of every 8 128-key probability blocks, 3 are transposed by the DMA engines and 5 on TensorE,
# whose PSUM results ScalarE copies out, except blocks numbered -1 mod VECTOR_EVICTION_PERIOD,
# which VectorE takes. The split balances DMA, ScalarE and VectorE in the Trn2 cost model.
DMA_TRANSPOSE_SHARE = (3, 8)
VECTOR_EVICTION_PERIOD = 4
BWD_INTERLEAVE = 2  # the backward holds S and dP per query tile, plus dK/dV for the key tile, in PSUM
FP32_MIN = -3.4028234663852886e38


def resident_kv_bytes(keys, head_dim, element_bytes):
    """SBUF bytes per partition the forward holds for one KV head: K^T per 128 of D, V + ones column."""
    return ((head_dim + P - 1) // P) * keys * element_bytes + ((keys + P - 1) // P) * (head_dim + 1) * element_bytes


def resident_bwd_bytes(queries, keys, head_dim, element_bytes):
    """SBUF bytes per partition the backward holds: per 128 keys fp32 dK and dV; per 128 queries
    Q and dO both ways round, the fp32 dQ accumulator, lse and delta."""
    d_blocks = (head_dim + P - 1) // P
    per_key_block = 2 * head_dim * 4
    per_query_block = 2 * (d_blocks * P + head_dim) * element_bytes + head_dim * 4 + 8
    return ((keys + P - 1) // P) * per_key_block + ((queries + P - 1) // P) * per_query_block


def _check_residency(what, needed, limit):
    if needed > limit:
        raise ValueError(
            f"flash_attn: {what} need {needed:,} bytes of SBUF per partition, above the limit of {limit:,}"
        )


def check_forward_residency(keys, head_dim, element_bytes):
    """One launch holds a KV head's keys in SBUF: raise ValueError naming the bytes and the limit
    beyond that (the torch op splits longer attention into several launches)."""
    _check_residency(
        f"{keys} keys of head_dim {head_dim} ({element_bytes}-byte K and V)",
        resident_kv_bytes(keys, head_dim, element_bytes),
        MAX_RESIDENT_KV_BYTES,
    )


def check_shapes(q_shape, k_shape, v_shape, bias_shape=None):
    """Raise ValueError naming the op, the shape and the limit for shapes the kernel cannot take
    (what one launch holds in SBUF is ``check_forward_residency``'s)."""
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        raise ValueError(f"flash_attn: q, k, v must be 4-D [B, H, S, D], got {q_shape}, {k_shape}, {v_shape}")
    b, h, sq, d = q_shape
    if tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"flash_attn: k {tuple(k_shape)} and v {tuple(v_shape)} must have the same shape")
    kb, hkv, sk, kd = k_shape
    if kb != b or kd != d:
        raise ValueError(f"flash_attn: q {tuple(q_shape)} and k {tuple(k_shape)} differ in batch or head dim")
    if hkv < 1 or h % hkv:
        raise ValueError(f"flash_attn: {h} query heads are not a multiple of {hkv} KV heads")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"flash_attn: head_dim {d} is outside the supported 1..{MAX_HEAD_DIM}")
    if sq < 1 or sk < 1 or b < 1:
        raise ValueError(f"flash_attn: empty input: q {tuple(q_shape)}, k {tuple(k_shape)}")
    if bias_shape is not None:
        bb, bh, bq, bk = bias_shape
        if bb not in (1, b) or bh not in (1, h) or (bq, bk) != (sq, sk):
            raise ValueError(
                f"flash_attn: mask/bias of shape {tuple(bias_shape)} does not broadcast to [{b}, {h}, {sq}, {sk}]"
            )


def _transposed_blocks(src, rows, cols, dtype, keep_rows=False):
    """src[rows, cols] (HBM) -> SBUF tiles [<=128 cols, rows], one per 128-column block, via TensorE.

    With ``keep_rows`` it also returns the row-major 128-row tiles it loaded on the way."""
    blocks = [nl.ndarray((c, rows), dtype, buffer=nl.sbuf) for _, c in tiles(cols, P)]
    row_tiles = []
    for r0, r in tiles(rows, P):
        tile = nl.ndarray((r, cols), dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=src[r0 : r0 + r, :])
        for block, (c0, c) in zip(blocks, tiles(cols, P)):
            flipped = nl.ndarray((c, r), dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=flipped, data=tile[:, c0 : c0 + c])
            nisa.tensor_copy(dst=block[:, r0 : r0 + r], src=flipped)
        if keep_rows:
            row_tiles.append(tile)
    return (blocks, row_tiles) if keep_rows else blocks


def _column(value, rows, engine=nisa.engine.unknown):
    column = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=column, value=value, engine=engine)
    return column


class _Visibility(nl.NKIObject):
    """Which keys each query row of a tile may see: keys in [lower_i, upper_i], plus the key span
    [first, end) that covers every row (``first`` aligned down to a 128-key tile)."""

    def __init__(self, q0, rows, causal, window, offset, seg_lo, seg_hi):
        self.q0, self.rows, self.causal, self.window, self.offset = q0, rows, causal, window, offset
        self.seg_lo = seg_lo
        self.end = min(seg_hi, q0 + rows + offset) if causal else seg_hi
        lowest = max(seg_lo, q0 + offset - window + 1) if window else seg_lo
        self.first = max(0, (min(lowest, self.end) // P) * P)
        self.lowest = lowest
        self.limits = None

    def masks(self, k0, kc):
        """Whether some row of the tile may not see some key of [k0, k0 + kc)."""
        cut_above = (self.causal and k0 + kc - 1 > self.offset + self.q0) or k0 + kc > self.end
        # The highest per-row lower bound: the last row's window start, never below the segment.
        top_lower = max(self.seg_lo, self.offset + self.q0 + self.rows - self.window) if self.window else self.seg_lo
        return cut_above or k0 < top_lower

    def sees(self, k0, kc):
        """Whether some row of the tile sees some key of [k0, k0 + kc)."""
        return k0 < self.end and k0 + kc > self.lowest

    def bounds(self):
        """Per-row [lower, upper] key bounds, built on GpSimd the first time they are asked for."""
        if self.limits is None:
            rows, q0, offset, window = self.rows, self.q0, self.offset, self.window
            gpsimd = nisa.engine.gpsimd
            lower = _column(float(self.seg_lo), rows, gpsimd)
            if window:
                nisa.iota(dst=lower, pattern=[[0, 1]], offset=offset + q0 - window + 1, channel_multiplier=1)
                nisa.tensor_scalar(dst=lower, data=lower, op0=nl.maximum, operand0=float(self.seg_lo), engine=gpsimd)
            upper = _column(float(self.end - 1), rows, gpsimd)
            if self.causal:
                nisa.iota(dst=upper, pattern=[[0, 1]], offset=offset + q0, channel_multiplier=1)
            self.limits = (lower, upper)
        return self.limits


@nki.jit
def flash_attn_fwd(q, k, v, bias, scale, causal, window, softcap, segments):
    """Flash attention forward.

    Args:
        q: [B, H, Sq, D]; k, v: [B, Hkv, Sk, D] in HBM (bf16, fp16 or fp32).
        bias: None or an additive fp32 mask/bias [B or 1, H or 1, Sq, Sk] (0 keeps, -inf drops).
        scale: softmax scale (Python float).
        causal: bool; window: 0 (none) or keys per query; softcap: 0.0 (none) or the cap.
        segments: None, or for packed sequences (B = 1, Sq = Sk) a tuple of (start, end) token
            ranges; tokens attend only within their own range.

    IO shapes:
        returns (out [B, H, Sq, D] of q's dtype, lse [B, H, Sq] fp32 log-sum-exp of the scaled
        logits; a row that sees no key gets a zero output and an lse near -1e30).
    """
    check_shapes(q.shape, k.shape, v.shape, None if bias is None else bias.shape)
    check_forward_residency(k.shape[2], k.shape[3], itemsize(k.dtype))
    batch, heads, sq, d = q.shape
    kv_heads, sk = k.shape[1], k.shape[2]
    group = heads // kv_heads
    out = nl.ndarray((batch, heads, sq, d), q.dtype, buffer=nl.shared_hbm)
    lse_out = nl.ndarray((batch, heads, sq), nl.float32, buffer=nl.shared_hbm)
    spans = list(segments) if segments else [(0, sq)]
    offset = 0 if segments else sk - sq
    for b in range(batch):
        for g in range(kv_heads):
            keys = _KeysAndValues(k, v, b, g, bias)
            query_tiles = [
                _QueryTile(
                    q,
                    b,
                    h,
                    _Visibility(lo + q0, rows, causal, window, offset, lo, hi if segments else sk),
                    scale,
                    softcap,
                    keys,
                )
                for h in range(g * group, (g + 1) * group)
                for lo, hi in spans
                for q0, rows in tiles(hi - lo, P)
            ]
            for tile in query_tiles:
                if not tile.steps:  # sees no key at all (queries before the first key): zeros
                    tile.start()
                    tile.finish(out, lse_out)
            items = _pipeline_order(query_tiles)
            # A software pipeline over (query tile, key step) items: at each tick every stage
            # works on a different item, LEAD items apart, so each engine's queue always holds
            # work whose inputs another engine finished a tick earlier (DMA transposes get more).
            for n in range(-_FWD_LEAD, len(items)):
                for stage, lead in _FWD_STAGES:
                    if 0 <= n + lead < len(items):
                        tile, step = items[n + lead]
                        getattr(tile, stage)(step)
                if n >= 0:
                    tile, step = items[n]
                    if step == tile.steps - 1:  # the tile's last key step is through every stage
                        tile.finish(out, lse_out)
            del keys, query_tiles, items
    return out, lse_out


# (stage, items ahead of the last stage): the order is each engine's issue order within a tick.
_FWD_STAGES = (
    ("load_inputs", 11),
    ("scores", 8),
    ("row_max", 7),
    ("exponentiate", 6),
    ("transpose_probs", 4),
    ("evict_probs", 3),
    ("multiply_values", 1),
    ("rescale", 0),
)
_FWD_LEAD = max(lead for _, lead in _FWD_STAGES)  # ticks before the last stage reaches the first item


def _pipeline_order(query_tiles):
    """(tile, step) items: tiles dealt longest first to the least-loaded of LANES lanes (which
    balances the lanes), each lane running its tiles shortest first (so keys are first needed,
    and loaded, gradually), and the lanes' items interleaved, so that consecutive items belong to
    different tiles."""
    dealt = [[] for _ in range(min(LANES, len(query_tiles)))]
    for tile in sorted(query_tiles, key=lambda t: -t.steps):
        min(dealt, key=lambda lane: sum(t.steps for t in lane)).append(tile)
    lanes = [[(tile, step) for tile in reversed(lane) for step in range(tile.steps)] for lane in dealt]
    items = []
    for i in range(max(len(lane) for lane in lanes)):
        items.extend(lane[i] for lane in lanes if i < len(lane))
    return items


def _two_byte(dtype):
    return itemsize(dtype) == 2


class _KeysAndValues(nl.NKIObject):
    """One (batch, KV head): K^T per 128 of D ([<=128, Sk]), V in 128-key tiles with a ones
    column appended (so P V also yields the softmax row sum), and the bias tensor. Keys are
    loaded 128 at a time when a pipeline item first needs them, so the first items do not wait
    behind the whole of K and V."""

    def __init__(self, k, v, b, g, bias):
        sk, d = k.shape[2], k.shape[3]
        self.k, self.v, self.b, self.g, self.bias, self.d = k, v, b, g, bias, d
        self.k_t = [nl.ndarray((dc, sk), k.dtype, buffer=nl.sbuf) for _, dc in tiles(d, P)]
        self.v_tiles = [None] * ((sk + P - 1) // P)

    def load(self, k0, kc):
        """Make keys [k0, k0 + kc) resident."""
        k, v, b, g, d = self.k, self.v, self.b, self.g, self.d
        sk = k.shape[2]
        for index in range(k0 // P, (k0 + kc - 1) // P + 1):
            if self.v_tiles[index] is not None:
                continue
            c0, cc = index * P, min(P, sk - index * P)
            for block, (d0, dc) in zip(self.k_t, tiles(d, P)):
                if _two_byte(k.dtype):
                    nisa.dma_transpose(dst=block[:, c0 : c0 + cc], src=k[b, g, c0 : c0 + cc, d0 : d0 + dc])
                else:
                    rows = nl.ndarray((cc, dc), k.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=rows, src=k[b, g, c0 : c0 + cc, d0 : d0 + dc])
                    flipped = nl.ndarray((dc, cc), k.dtype, buffer=nl.psum)
                    nisa.nc_transpose(dst=flipped, data=rows)
                    nisa.tensor_copy(dst=block[:, c0 : c0 + cc], src=flipped)
            v_tile = nl.ndarray((cc, d + 1), v.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=v_tile[:, 0:d], src=v[b, g, c0 : c0 + cc, :])
            nisa.memset(dst=v_tile[:, d : d + 1], value=1.0, engine=nisa.engine.gpsimd)
            self.v_tiles[index] = v_tile


class _KeyStep(nl.NKIObject):
    """One key step of a query tile on its way through the forward pipeline: what each stage leaves
    for the next. A stage drops what no later stage reads, so its tiles are freed as soon as they can be."""

    def __init__(self, k0, kc):
        self.k0, self.kc = k0, kc
        self.scores = None  # S in PSUM, or its softcapped/biased copy in SBUF (scores)
        self.in_psum = False
        self.logits = None  # the masked scores in SBUF (row_max)
        self.old_neg_max = self.neg_max = None  # the running max (negated) before and after the step
        self.probs = None  # P = exp(logits - max) (exponentiate)
        self.correction = None  # exp(old max - new max), for the running output
        self.blocks = None  # P^T per 128-key block: (c0, cc, tile, by DMA?) (transpose_probs, evict_probs)
        self.pv = None  # [P V | rowsum P] in PSUM (multiply_values)


class _QueryTile(nl.NKIObject):
    """The online-softmax state of one 128-query tile, advanced one key step (FWD_KEY_TILE keys)
    at a time by the pipeline stages; ``pending`` holds the ``_KeyStep`` of each step in flight."""

    def __init__(self, q, b, h, seen, scale, softcap, keys):
        self.q, self.b, self.h, self.seen, self.scale, self.softcap, self.keys = q, b, h, seen, scale, softcap, keys
        self.rows, self.d, self.dtype = seen.rows, q.shape[3], q.dtype
        # Logits are exp_scale * t, t being the raw score (or tanh(scale * s / cap) with softcap).
        self.exp_scale = softcap if softcap else scale
        self.steps = (max(0, seen.end - seen.first) + FWD_KEY_TILE - 1) // FWD_KEY_TILE
        self.pending = {}

    def _keys(self, step):
        k0 = self.seen.first + step * FWD_KEY_TILE
        return k0, min(FWD_KEY_TILE, self.seen.end - k0)

    def start(self):
        """The running state: max (negated) at its floor, and [sum_k P V | sum_k P] = 0."""
        self.neg_running_max = _column(-MASKED_LOGIT_FLOOR, self.rows, nisa.engine.gpsimd)
        self.acc = nl.ndarray((self.rows, self.d + 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=self.acc, value=0.0, engine=nisa.engine.gpsimd)

    def load_inputs(self, step):
        """The step's keys; for the first step also Q^T (D on partitions) and the running state."""
        self.keys.load(*self._keys(step))
        if step:
            return
        rows, d, q0 = self.rows, self.d, self.seen.q0
        src = self.q[self.b, self.h, q0 : q0 + rows, :]
        if _two_byte(self.dtype):
            self.q_t = []
            for c0, dc in tiles(d, P):
                block = nl.ndarray((dc, rows), self.dtype, buffer=nl.sbuf)
                nisa.dma_transpose(dst=block, src=src[:, c0 : c0 + dc])
                self.q_t.append(block)
        else:
            self.q_t = _transposed_blocks(src, rows, d, self.dtype)
        if any(self.seen.masks(*self._keys(j)) for j in range(self.steps)):
            self.seen.bounds()
        self.start()

    def scores(self, step):
        """S = Q K^T for key step ``step`` into PSUM (then tanh for softcap, plus the bias)."""
        seen, rows = self.seen, self.rows
        k0, kc = self._keys(step)
        scores = nl.ndarray((rows, kc), nl.float32, buffer=nl.psum)
        for c0, cw in tiles(kc, MATMUL_COLUMNS):
            for q_block, k_block in zip(self.q_t, self.keys.k_t):
                nisa.nc_matmul(
                    dst=scores[:, c0 : c0 + cw], stationary=q_block, moving=k_block[:, k0 + c0 : k0 + c0 + cw]
                )
        t = scores
        if self.softcap:
            capped = nl.ndarray((rows, kc), nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=capped, op=nl.tanh, data=scores, scale=self.scale / self.softcap)
            t = capped
        bias = self.keys.bias
        if bias is not None:
            bias_tile = nl.ndarray((rows, kc), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(
                dst=bias_tile,
                src=bias[
                    min(self.b, bias.shape[0] - 1),
                    min(self.h, bias.shape[1] - 1),
                    seen.q0 : seen.q0 + rows,
                    k0 : k0 + kc,
                ],
            )
            biased = nl.ndarray((rows, kc), nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(
                dst=biased, data=bias_tile, op0=nl.multiply, operand0=1.0 / self.exp_scale, op1=nl.add, operand1=t
            )
            t = biased
        item = _KeyStep(k0, kc)
        item.scores, item.in_psum = t, t is scores
        self.pending[step] = item

    def row_max(self, step):
        """One VectorE pass: the scores out of PSUM into SBUF, masked, with their row max; then
        the new running max (kept negated: it is the exp's bias) on GpSimd."""
        item = self.pending[step]
        k0, kc, t, in_psum = item.k0, item.kc, item.scores, item.in_psum
        rows = self.rows
        tile_max = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        masked = self.seen.masks(k0, kc)
        if not (masked or in_psum):
            nisa.tensor_reduce(dst=tile_max, op=nl.maximum, data=t, axis=1)
            logits = t
        else:
            lower, upper = self.seen.bounds() if masked else (None, None)
            logits = nl.ndarray((rows, kc), nl.float32, buffer=nl.sbuf)
            # One PSUM bank per instruction; the max accumulates across them in VectorE's register.
            for c0, cw in tiles(kc, MATMUL_COLUMNS):
                command = nisa.reduce_cmd.reset_reduce if c0 == 0 else nisa.reduce_cmd.reduce
                if masked:
                    nisa.range_select(
                        dst=logits[:, c0 : c0 + cw],
                        on_true_tile=t[:, c0 : c0 + cw],
                        comp_op0=nl.greater_equal,
                        comp_op1=nl.less_equal,
                        bound0=lower,
                        bound1=upper,
                        reduce_cmd=command,
                        reduce_res=tile_max,
                        reduce_op=nl.maximum,
                        range_start=k0 + c0,
                    )
                else:
                    nisa.tensor_scalar_reduce(
                        dst=logits[:, c0 : c0 + cw],
                        data=t[:, c0 : c0 + cw],
                        op0=nl.multiply,
                        operand0=1.0,
                        reduce_op=nl.maximum,
                        reduce_res=tile_max,
                        reduce_cmd=command,
                    )
        neg_max = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(
            dst=neg_max,
            data=tile_max,
            op0=nl.multiply,
            operand0=-self.exp_scale,
            op1=nl.minimum,
            operand1=self.neg_running_max,
            engine=nisa.engine.gpsimd,
        )
        item.logits, item.old_neg_max, item.neg_max, item.scores = logits, self.neg_running_max, neg_max, None
        self.neg_running_max = neg_max

    def exponentiate(self, step):
        """P = exp(logits - max) on ScalarE, and the rescale factor of what came before."""
        item = self.pending[step]
        kc, logits, neg_max = item.kc, item.logits, item.neg_max
        rows = self.rows
        correction = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)  # exp(old max - new max)
        nisa.activation(dst=correction, op=nl.exp, data=item.old_neg_max, scale=-1.0, bias=neg_max)
        probs = nl.ndarray((rows, kc), self.dtype, buffer=nl.sbuf)
        nisa.activation(dst=probs, op=nl.exp, data=logits, bias=neg_max, scale=self.exp_scale)
        item.probs, item.correction = probs, correction
        item.logits = item.old_neg_max = item.neg_max = None

    def transpose_probs(self, step):
        """P^T (keys onto partitions) per 128-key block: DMA_TRANSPOSE_SHARE of the blocks by the
        DMA engines straight into SBUF, the rest on TensorE into PSUM."""
        item = self.pending[step]
        k0, kc, probs = item.k0, item.kc, item.probs
        blocks = []
        for c0, cc in tiles(kc, P):
            index = (k0 + c0) // P
            share, period = DMA_TRANSPOSE_SHARE
            by_dma = _two_byte(self.dtype) and index * share // period != (index + 1) * share // period
            if by_dma:
                probs_t = nl.ndarray((cc, self.rows), self.dtype, buffer=nl.sbuf)
                nisa.dma_transpose(dst=probs_t, src=probs[:, c0 : c0 + cc])
            else:
                probs_t = nl.ndarray((cc, self.rows), self.dtype, buffer=nl.psum)
                nisa.nc_transpose(dst=probs_t, data=probs[:, c0 : c0 + cc])
            blocks.append((c0, cc, probs_t, by_dma))
        item.blocks = blocks

    def evict_probs(self, step):
        """The TensorE-transposed blocks out of PSUM: mostly on ScalarE, as VectorE already makes a
        full pass over the scores (see VECTOR_EVICTION_PERIOD)."""
        item = self.pending[step]
        k0 = item.k0
        evicted = []
        for c0, cc, probs_t, by_dma in item.blocks:
            if not by_dma:
                in_sbuf = nl.ndarray((cc, self.rows), self.dtype, buffer=nl.sbuf)
                if ((k0 + c0) // P) % VECTOR_EVICTION_PERIOD == VECTOR_EVICTION_PERIOD - 1:
                    nisa.tensor_copy(dst=in_sbuf, src=probs_t)
                else:
                    nisa.activation(dst=in_sbuf, op=nl.copy, data=probs_t)
                probs_t = in_sbuf
            evicted.append((c0, cc, probs_t, by_dma))
        item.blocks, item.probs = evicted, None

    def multiply_values(self, step):
        """[P V | rowsum P] for the step, accumulated over its 128-key blocks in one PSUM bank."""
        item = self.pending[step]
        pv = nl.ndarray((self.rows, self.d + 1), nl.float32, buffer=nl.psum)
        for c0, cc, probs_t, _ in item.blocks:
            v_tile = self.keys.v_tiles[(item.k0 + c0) // P]
            first = (item.k0 + c0) % P
            nisa.nc_matmul(dst=pv, stationary=probs_t, moving=v_tile[first : first + cc, :])
        item.pv, item.blocks = pv, None

    def rescale(self, step):
        """acc = acc * correction + [P V | rowsum P]."""
        item = self.pending.pop(step)
        nisa.scalar_tensor_tensor(
            dst=self.acc, data=self.acc, op0=nl.multiply, operand0=item.correction, op1=nl.add, operand1=item.pv
        )

    def finish(self, out, lse_out):
        """out = acc / sum on GpSimd (a row that saw no key has acc = 0 and sum = 0, and stays 0); lse."""
        rows, d, q0 = self.rows, self.d, self.seen.q0
        gpsimd = nisa.engine.gpsimd
        safe_sum = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=safe_sum, data=self.acc[:, d : d + 1], op0=nl.maximum, operand0=1e-30, engine=gpsimd)
        result = nl.ndarray((rows, d), self.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=result, data=self.acc[:, 0:d], op0=nl.divide, operand0=safe_sum, engine=gpsimd)
        nisa.dma_copy(dst=out[self.b, self.h, q0 : q0 + rows, :], src=result)
        lse = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=lse, op=nl.log, data=safe_sum)
        nisa.tensor_tensor(dst=lse, data1=lse, data2=self.neg_running_max, op=nl.subtract, engine=gpsimd)
        nisa.dma_copy(dst=lse_out[self.b, self.h, q0 : q0 + rows].reshape((rows, 1)), src=lse)
        self.q_t = self.acc = None


@nki.jit
def flash_attn_bwd(q, k, v, out, dout, lse, bias, scale, causal, window, softcap, segments):
    """Flash attention backward: dq, dk, dv, recomputing the probabilities from the saved lse.

    Args:
        q, k, v, bias, scale, causal, window, softcap, segments: as for the forward.
        out: [B, H, Sq, D] forward output; dout: its gradient; lse: [B, H, Sq] from the forward.

    IO shapes:
        returns (dq [B, H, Sq, D] of q's dtype, dk and dv [B, Hkv, Sk, D] of k's dtype; for GQA the
        group's query heads are summed into their KV head).

    Tiling plan
        Per (batch, query head) the query side stays in SBUF: Q and dO in 128-row tiles and
        transposed (D on partitions), the lse, delta = rowsum(dO * O) and an fp32 dQ accumulator.
        Key tiles of KEY_TILE keys go outside, query tiles inside, so that dK and dV accumulate in
        PSUM over all query tiles and are added once per key tile into per-KV-head fp32 SBUF
        accumulators (which also sum a GQA group). Per (query tile, key tile):
        S = Q K^T and dP = dO V^T on TensorE; P = exp(logits - lse) on ScalarE (masked first on
        VectorE only where the tile crosses a mask edge); dS = P * (dP - delta) in one VectorE
        instruction; dV += P^T dO and dK += dS^T Q straight from the query-major P and dS; dS^T
        on TensorE for dQ += dS K.
    """
    element_bytes = itemsize(k.dtype)
    check_shapes(q.shape, k.shape, v.shape, None if bias is None else bias.shape)
    check_forward_residency(k.shape[2], k.shape[3], element_bytes)
    batch, heads, sq, d = q.shape
    kv_heads, sk = k.shape[1], k.shape[2]
    _check_residency(
        f"the backward of {sq} queries and {sk} keys of head_dim {d}",
        resident_bwd_bytes(sq, sk, d, element_bytes),
        MAX_RESIDENT_BWD_BYTES,
    )
    group = heads // kv_heads
    dq = nl.ndarray((batch, heads, sq, d), q.dtype, buffer=nl.shared_hbm)
    dk = nl.ndarray((batch, kv_heads, sk, d), k.dtype, buffer=nl.shared_hbm)
    dv = nl.ndarray((batch, kv_heads, sk, d), v.dtype, buffer=nl.shared_hbm)
    spans = list(segments) if segments else [(0, sq)]
    offset = 0 if segments else sk - sq
    exp_scale = softcap if softcap else scale
    key_blocks = list(tiles(sk, P))
    for b in range(batch):
        for g in range(kv_heads):
            dk_acc = [_zeros((kr, d)) for _, kr in key_blocks]
            dv_acc = [_zeros((kr, d)) for _, kr in key_blocks]
            for h in range(g * group, (g + 1) * group):
                rows_of = [
                    _QuerySide(
                        q,
                        out,
                        dout,
                        lse,
                        b,
                        h,
                        _Visibility(lo + q0, rows, causal, window, offset, lo, hi if segments else sk),
                    )
                    for lo, hi in spans
                    for q0, rows in tiles(hi - lo, P)
                ]
                for k0, kc in tiles(sk, KEY_TILE):
                    keys = _KeySide(k, v, b, g, k0, kc)
                    dk_psum = [nl.ndarray((kr, d), nl.float32, buffer=nl.psum) for _, kr in tiles(kc, P)]
                    dv_psum = [nl.ndarray((kr, d), nl.float32, buffer=nl.psum) for _, kr in tiles(kc, P)]
                    active = [side for side in rows_of if side.seen.sees(k0, kc)]
                    # BWD_INTERLEAVE query tiles at a time, each phase issued for all of them before the
                    # next: one tile's TensorE work overlaps the other's element-wise work.
                    for i in range(0, len(active), BWD_INTERLEAVE):
                        sides = active[i : i + BWD_INTERLEAVE]
                        for side in sides:
                            side.products(keys)
                        for side in sides:
                            side.probabilities(keys, bias, scale, softcap, exp_scale)
                        for side in sides:
                            side.score_gradients(scale, softcap)
                        for side in sides:
                            side.key_gradients(dk_psum, dv_psum)
                        for side in sides:
                            side.query_gradient(keys)
                        for side in sides:
                            side.add_query_gradient()
                    for j, (c0, _) in enumerate(tiles(kc, P)):
                        block = (k0 + c0) // P
                        if any(side.seen.sees(k0, kc) for side in rows_of):
                            nisa.tensor_tensor(dst=dk_acc[block], data1=dk_acc[block], data2=dk_psum[j], op=nl.add)
                            nisa.tensor_tensor(dst=dv_acc[block], data1=dv_acc[block], data2=dv_psum[j], op=nl.add)
                    del keys, dk_psum, dv_psum
                for side in rows_of:
                    side.store_dq(dq, scale if not softcap else 1.0)
                del rows_of
            for block, (k0, kr) in enumerate(key_blocks):
                dk_tile = nl.ndarray((kr, d), k.dtype, buffer=nl.sbuf)
                nisa.tensor_scalar(
                    dst=dk_tile, data=dk_acc[block], op0=nl.multiply, operand0=scale if not softcap else 1.0
                )
                nisa.dma_copy(dst=dk[b, g, k0 : k0 + kr, :], src=dk_tile)
                dv_tile = nl.ndarray((kr, d), v.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=dv_tile, src=dv_acc[block])
                nisa.dma_copy(dst=dv[b, g, k0 : k0 + kr, :], src=dv_tile)
            del dk_acc, dv_acc
    return dq, dk, dv


def _zeros(shape):
    tile = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=tile, value=0.0)
    return tile


class _KeySide(nl.NKIObject):
    """One key tile: K^T and V^T (D on partitions) for S and dP, K in 128-key blocks for dQ."""

    def __init__(self, k, v, b, g, k0, kc):
        self.k0, self.kc = k0, kc
        self.k_t, self.k_rows = _transposed_blocks(k[b, g, k0 : k0 + kc, :], kc, k.shape[3], k.dtype, keep_rows=True)
        self.v_t = _transposed_blocks(v[b, g, k0 : k0 + kc, :], kc, v.shape[3], v.dtype)


class _QuerySide(nl.NKIObject):
    """One 128-query tile of one head, resident for the whole backward of that head."""

    def __init__(self, q, out, dout, lse, b, h, seen):
        self.b, self.h, self.seen = b, h, seen
        rows, d = seen.rows, q.shape[3]
        q0 = seen.q0
        self.rows, self.d, self.dtype = rows, d, q.dtype
        self.q_t, (self.q_rows,) = _transposed_blocks(q[b, h, q0 : q0 + rows, :], rows, d, q.dtype, keep_rows=True)
        self.do_t, (self.do_rows,) = _transposed_blocks(
            dout[b, h, q0 : q0 + rows, :], rows, d, dout.dtype, keep_rows=True
        )
        self.neg_lse = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=self.neg_lse, src=lse[b, h, q0 : q0 + rows].reshape((rows, 1)))
        nisa.tensor_scalar(dst=self.neg_lse, data=self.neg_lse, op0=nl.multiply, operand0=-1.0)
        o_rows = nl.ndarray((rows, d), out.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=o_rows, src=out[b, h, q0 : q0 + rows, :])
        products = nl.ndarray((rows, d), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=products, data1=o_rows, data2=self.do_rows, op=nl.multiply)
        self.delta = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=self.delta, op=nl.add, data=products, axis=1)
        self.dq_acc = _zeros((rows, d))
        self.scores = self.dprobs = self.probs = self.tanh = self.dscores = self.ds_t_psum = self.dq_psum = None

    def products(self, keys):
        """S = Q K^T and dP = dO V^T for this key tile, on TensorE."""
        rows, kc = self.rows, keys.kc
        self.scores = nl.ndarray((rows, kc), nl.float32, buffer=nl.psum)
        for q_block, k_block in zip(self.q_t, keys.k_t):
            nisa.nc_matmul(dst=self.scores, stationary=q_block, moving=k_block)
        self.dprobs = nl.ndarray((rows, kc), nl.float32, buffer=nl.psum)
        for do_block, v_block in zip(self.do_t, keys.v_t):
            nisa.nc_matmul(dst=self.dprobs, stationary=do_block, moving=v_block)

    def probabilities(self, keys, bias, scale, softcap, exp_scale):
        """P = exp(logits - lse), masked where the tile crosses a mask edge."""
        rows, k0, kc = self.rows, keys.k0, keys.kc
        t = self.scores
        if softcap:
            capped = nl.ndarray((rows, kc), nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=capped, op=nl.tanh, data=t, scale=scale / softcap)
            t = capped
        self.tanh = t
        logits = t
        if bias is not None:
            bias_tile = nl.ndarray((rows, kc), nl.float32, buffer=nl.sbuf)
            q0 = self.seen.q0
            nisa.dma_copy(
                dst=bias_tile,
                src=bias[min(self.b, bias.shape[0] - 1), min(self.h, bias.shape[1] - 1), q0 : q0 + rows, k0 : k0 + kc],
            )
            biased = nl.ndarray((rows, kc), nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(
                dst=biased, data=bias_tile, op0=nl.multiply, operand0=1.0 / exp_scale, op1=nl.add, operand1=t
            )
            logits = biased
        if self.seen.masks(k0, kc):
            lower, upper = self.seen.bounds()
            masked = nl.ndarray((rows, kc), nl.float32, buffer=nl.sbuf)
            nisa.range_select(
                dst=masked,
                on_true_tile=logits,
                comp_op0=nl.greater_equal,
                comp_op1=nl.less_equal,
                bound0=lower,
                bound1=upper,
                range_start=k0,
            )
            logits = masked
        self.probs = nl.ndarray((rows, kc), self.dtype, buffer=nl.sbuf)
        nisa.activation(dst=self.probs, op=nl.exp, data=logits, bias=self.neg_lse, scale=exp_scale)
        self.scores = None

    def score_gradients(self, scale, softcap):
        """dS = P * (dP - delta) (times the softcap's tanh derivative)."""
        rows, kc = self.rows, self.probs.shape[1]
        dscores = nl.ndarray((rows, kc), self.dtype if not softcap else nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(
            dst=dscores, data=self.dprobs, op0=nl.subtract, operand0=self.delta, op1=nl.multiply, operand1=self.probs
        )
        if softcap:
            # d(cap * tanh(u)) / du = cap * (1 - tanh^2) with u = scale * s / cap: ds = dL * scale * (1 - t^2)
            one_minus = nl.ndarray((rows, kc), nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=one_minus, data1=self.tanh, data2=self.tanh, op=nl.multiply)
            nisa.tensor_scalar(
                dst=one_minus, data=one_minus, op0=nl.multiply, operand0=-scale, op1=nl.add, operand1=scale
            )
            scaled = nl.ndarray((rows, kc), self.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=scaled, data1=dscores, data2=one_minus, op=nl.multiply)
            dscores = scaled
        self.dscores, self.dprobs, self.tanh = dscores, None, None

    def key_gradients(self, dk_psum, dv_psum):
        """dV += P^T dO and dK += dS^T Q (P and dS are query-major already); dS^T for dQ."""
        kc = self.probs.shape[1]
        self.ds_t_psum = []
        for j, (c0, cr) in enumerate(tiles(kc, P)):
            nisa.nc_matmul(dst=dv_psum[j], stationary=self.probs[:, c0 : c0 + cr], moving=self.do_rows)
            nisa.nc_matmul(dst=dk_psum[j], stationary=self.dscores[:, c0 : c0 + cr], moving=self.q_rows)
            flipped = nl.ndarray((cr, self.rows), self.dscores.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=flipped, data=self.dscores[:, c0 : c0 + cr])
            self.ds_t_psum.append(flipped)
        self.probs = None

    def query_gradient(self, keys):
        """dQ += dS K, the transposed dS evicted by ScalarE."""
        dq_psum = nl.ndarray((self.rows, self.d), nl.float32, buffer=nl.psum)
        for j, flipped in enumerate(self.ds_t_psum):
            ds_t = nl.ndarray(flipped.shape, flipped.dtype, buffer=nl.sbuf)
            nisa.activation(dst=ds_t, op=nl.copy, data=flipped)
            nisa.nc_matmul(dst=dq_psum, stationary=ds_t, moving=keys.k_rows[j])
        self.dq_psum, self.ds_t_psum, self.dscores = dq_psum, None, None

    def add_query_gradient(self):
        nisa.tensor_tensor(dst=self.dq_acc, data1=self.dq_acc, data2=self.dq_psum, op=nl.add)
        self.dq_psum = None

    def store_dq(self, dq, factor):
        result = nl.ndarray((self.rows, self.d), self.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=result, data=self.dq_acc, op0=nl.multiply, operand0=factor)
        q0 = self.seen.q0
        nisa.dma_copy(dst=dq[self.b, self.h, q0 : q0 + self.rows, :], src=result)
