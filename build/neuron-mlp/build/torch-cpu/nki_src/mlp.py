"""Fused MLPs forward and backward for Trainium, in NKI: gated (SwiGLU / GeGLU) and plain.

    gated:  y = down(act(gate(x)) * up(x)) = (act(x Wg^T) * (x Wu^T)) Wd^T
    plain:  y = down(act(up(x)))           = act(x Wu^T + bu) Wd^T + bd

with the weights in the transformers (``nn.Linear``) layout: ``w_gate`` [I, H], ``w_up`` [I, H],
``w_down`` [H, I]; or Phi3's fused ``gate_up_proj`` [2I, H] (gate rows first) passed as
``w_gate`` with ``w_up=None``. The gated ``act`` is ``"silu"`` (SwiGLU: Llama, Qwen, Mistral ...)
or ``"gelu_tanh"`` (GeGLU with the tanh-approximated GELU: Gemma). The plain MLP (Starcoder2,
GPT-NeoX, Falcon, GPT-2, Phi-2) takes ``"gelu"`` (exact, erf), ``"gelu_tanh"``, ``"relu"`` or
``"silu"``, and optionally both biases (``bu`` [I], ``bd`` [H]). Both share one implementation:
the input projections are a list (gate and up, or up alone) that every phase walks.

Dimensions
    T: tokens, any count >= 1; a ragged last tile is handled everywhere.
    H: hidden size, I: intermediate size; any values in 1..max_hidden(dtype) (8192 for 2-byte
    dtypes, 4096 for fp32: one intermediate tile's transposed gate and up weights, double-buffered,
    must sit in SBUF beside x^T) and 1..MAX_INTERMEDIATE. The last 128-row tile of each may be
    partial: partial tiles are sliced, never padded.
    Dtypes: x, all weights and the biases share one dtype, bfloat16, float16 or float32. Matmuls
    accumulate in fp32 PSUM; the biases, the activation and the gate*up product are computed in
    fp32 and the down projection's operand is rounded once, to the input dtype.

Why transposes
    TensorE contracts over the partition dim of both operands. Weights arrive [out, in] row-major,
    x as [T, H]: the forward contracts over H (gate/up) and over I (down), so x and every weight
    tile is transposed once per read on TensorE (128x128, SBUF -> PSUM) and evicted to SBUF, eight
    tiles to a PSUM bank and one eviction per bank. The backward contracts the weights over the
    dims they already have on partitions (da over H with Wd, dx over I with Wg/Wu), so it
    transposes no weight; it transposes dy and its [T, I] gradients instead.

Tiling plan (forward, :func:`mlp_fwd`)
    Token blocks of up to MAX_TOKEN_BLOCK keep x^T in SBUF; the intermediate is produced in parts
    (a run of 128-row tiles, :func:`forward_plan`) into a^T in SBUF and consumed by the down
    projection before the next part, so the [T, I] intermediate never reaches HBM. Each weight is
    read (and transposed) once per token block.

Tiling plan (backward, :func:`mlp_bwd`)
    Four phases, each a contraction over the partition dim with operands read in long rows
    (:func:`backward_plan`): dy^T; da^T = Wd^T dy^T with the element-wise gradients; dx = dg Wg +
    du Wu over 2I; dWd, dWg, dWu over the tokens. Their [T, I] gradients pass between phases
    through kernel-private HBM in partition-major layouts.

What the training forward saves
    The gate and up projections (before the activation, in x's dtype, :func:`saved_shape`): the
    backward needs g for act(g) and act'(g) and u for dg. Recomputing them would repeat two of the
    forward's three GEMMs and their weight transposes; saving costs one [T, 2I] write and read.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from ._common import P, ceil_div, dtype_name, itemsize, tiles

TOKEN_TILE = 512  # tokens per matmul: the moving free size that fills one fp32 PSUM bank
SAVED_TOKEN_TILE = 256  # tokens per tile in the saved gate/up and the backward's token-tiled buffers
MAX_TOKEN_BLOCK = 1024  # tokens whose x^T stays in SBUF while every weight tile streams past once
MIN_TOKEN_BLOCK = 128  # the smallest block the forward plan falls back to when SBUF is short
PSUM_BANK_BYTES = 2048  # one PSUM bank per partition: 512 fp32 or 1024 bf16 elements
WEIGHT_ROW_CHUNK = 4096  # weight columns per DMA: 8 KiB rows (bf16) reach full modelled bandwidth
SATURATING_ROW_BYTES = 4096  # docs/hardware.md: DMA needs >= 4 KiB per partition to saturate
SBUF_RESERVE = 16 * 1024  # bytes per partition kept free for small tiles (activations, eviction buffers)
MAX_HIDDEN = 8192  # 2-byte dtypes
MAX_HIDDEN_FP32 = 4096
MAX_INTERMEDIATE = 65536
ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's
PLAIN_ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
DTYPES = ("bfloat16", "float16", "float32")

GELU_TANH_SCALE = 0.7978845608028654  # sqrt(2 / pi)
GELU_TANH_CUBIC = 0.044715


def max_hidden(dtype):
    """The largest hidden size the kernels take for ``dtype`` (their SBUF plans fit Trn1 and up)."""
    return MAX_HIDDEN_FP32 if itemsize(dtype) == 4 else MAX_HIDDEN


def _act_op(activation):
    return {"silu": nl.silu, "gelu_tanh": nl.gelu_apprx_tanh, "gelu": nl.gelu, "relu": nl.relu}[activation]


def check_shapes(x_shape, gate_shape, up_shape, down_shape, activation, dtypes=None):
    """Raise ValueError naming the op, the shapes and the limit when the kernel cannot take them.

    ``up_shape`` is None for a fused gate_up weight [2I, H] passed as the gate weight.
    ``dtypes`` (names of x's and the weights' dtypes), when given, must be one supported dtype.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"mlp: activation {activation!r} is not one of {ACTIVATIONS}")
    if len(x_shape) != 2:
        raise ValueError(f"mlp: x must be 2-D [tokens, hidden], got shape {tuple(x_shape)}")
    tokens, hidden = x_shape
    if tokens < 1:
        raise ValueError(f"mlp: x has no tokens (shape {tuple(x_shape)})")
    if len(down_shape) != 2 or down_shape[0] != hidden:
        raise ValueError(
            f"mlp: down weight of shape {tuple(down_shape)} does not match hidden size {hidden} "
            f"(expected [{hidden}, intermediate])"
        )
    inter = down_shape[1]
    if up_shape is None:
        if tuple(gate_shape) != (2 * inter, hidden):
            raise ValueError(
                f"mlp: fused gate_up weight of shape {tuple(gate_shape)} does not match "
                f"[2 * {inter}, {hidden}] (from down weight {tuple(down_shape)} and x {tuple(x_shape)})"
            )
    else:
        for name, shape in (("gate", gate_shape), ("up", up_shape)):
            if tuple(shape) != (inter, hidden):
                raise ValueError(
                    f"mlp: {name} weight of shape {tuple(shape)} does not match [{inter}, {hidden}] "
                    f"(from down weight {tuple(down_shape)} and x {tuple(x_shape)})"
                )
    check_sizes_and_dtype("mlp", hidden, inter, dtypes, "x and the weights")


def check_sizes_and_dtype(kernel, hidden, inter, dtypes, operands):
    """Raise ValueError naming ``kernel`` when the sizes are past the limits or the ``operands`` (their
    description, e.g. "x and the weights") have mixed or unsupported dtypes (``dtypes``, or None)."""
    if not 1 <= inter <= MAX_INTERMEDIATE:
        raise ValueError(f"{kernel}: intermediate size {inter} is outside the supported range 1..{MAX_INTERMEDIATE}")
    name = None
    if dtypes is not None:
        names = {dtype_name(d) for d in dtypes}
        if len(names) != 1:
            raise ValueError(f"{kernel}: {operands} must share one dtype, got {sorted(names)}")
        (name,) = names
        if name not in DTYPES:
            raise ValueError(f"{kernel}: dtype {name} is not supported; use one of {DTYPES}")
    limit = MAX_HIDDEN if name is None else max_hidden(name)
    if not 1 <= hidden <= limit:
        raise ValueError(
            f"{kernel}: hidden size {hidden} is outside the supported range 1..{limit}"
            + ("" if name is None else f" for {name}")
        )


def check_plain_shapes(x_shape, up_shape, down_shape, up_bias_shape, down_bias_shape, activation, dtypes=None):
    """Raise ValueError naming the op, the shapes and the limit when the plain MLP kernel cannot take
    them. The biases (shapes or None) come both or neither."""
    if activation not in PLAIN_ACTIVATIONS:
        raise ValueError(f"plain_mlp: activation {activation!r} is not one of {PLAIN_ACTIVATIONS}")
    if len(x_shape) != 2 or x_shape[0] < 1:
        raise ValueError(f"plain_mlp: x must be 2-D [tokens >= 1, hidden], got shape {tuple(x_shape)}")
    hidden = x_shape[1]
    if len(up_shape) != 2 or up_shape[1] != hidden:
        raise ValueError(f"plain_mlp: up weight of shape {tuple(up_shape)} does not match x {tuple(x_shape)}")
    inter = up_shape[0]
    if tuple(down_shape) != (hidden, inter):
        raise ValueError(
            f"plain_mlp: down weight of shape {tuple(down_shape)} does not match [{hidden}, {inter}] "
            f"(from x {tuple(x_shape)} and up weight {tuple(up_shape)})"
        )
    if (up_bias_shape is None) != (down_bias_shape is None):
        raise ValueError("plain_mlp: the up and down biases come both or neither")
    if up_bias_shape is not None and (tuple(up_bias_shape) != (inter,) or tuple(down_bias_shape) != (hidden,)):
        raise ValueError(
            f"plain_mlp: biases of shapes {tuple(up_bias_shape)} and {tuple(down_bias_shape)} do not match "
            f"[{inter}] and [{hidden}]"
        )
    check_sizes_and_dtype("plain_mlp", hidden, inter, dtypes, "x, the weights and the biases")


# ---------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------
class _Evictions(nl.NKIObject):
    """PSUM -> SBUF copies (with a cast), on ScalarE and VectorE in turn so that they share the two evictions."""

    def __init__(self):
        self.count = 0

    def evict(self, dst, src, column=None):
        """dst = src, or src + column (an fp32 [rows, 1] per-partition bias) when given."""
        self.count += 1
        if self.count % 2 == 0:
            nisa.activation(dst=dst, op=nl.copy, data=src, bias=column)
        elif column is None:
            nisa.tensor_copy(dst=dst, src=src)
        else:
            nisa.tensor_scalar(dst=dst, data=src, op0=nl.add, operand0=column)


def _group_size(dtype):
    """How many 128-wide transposed tiles of ``dtype`` share one PSUM bank."""
    return PSUM_BANK_BYTES // (P * itemsize(dtype))


def _transpose_rows_into(dst, src_rows, rows, cols, dtype, evictions):
    """dst[:c, j, :rows] = src_rows[:rows, j*128 : j*128 + c]^T for every 128-column block j.

    ``src_rows`` is an SBUF tile [rows, cols]; ``dst`` an SBUF tile [P, ceil(cols/128), >= rows].
    Blocks are transposed on TensorE into a PSUM bank, a bank's worth at a time, and evicted with
    one instruction per bank.
    """
    blocks = list(tiles(cols, P))
    group = _group_size(dtype)
    for g0 in range(0, len(blocks), group):
        members = blocks[g0 : g0 + group]
        bank = nl.ndarray((P, group * P), dtype, buffer=nl.psum)
        for j, (c0, c) in enumerate(members):
            nisa.nc_transpose(dst=bank[:c, j * P : j * P + rows], data=src_rows[:rows, c0 : c0 + c])
        width = members[0][1]  # full blocks share one eviction; a partial last block is evicted alone
        full = [m for m in members if m[1] == width]
        view = bank[:width, : len(full) * P].reshape((width, len(full), P))
        evictions.evict(dst[:width, g0 : g0 + len(full), :rows], view[:, :, :rows])
        if len(full) < len(members):
            (c0, c), j = members[-1], len(members) - 1
            evictions.evict(dst[:c, g0 + j, :rows], bank[:c, j * P : j * P + rows])


def _load_transposed_tokens(out, src, t0, tokens, width, dtype, evictions):
    """out[:, :, :tokens] = src[t0 : t0 + tokens, :width]^T, feature-major: out is [P, ceil(width/128), >= tokens]."""
    for r0, rows in tiles(tokens, P):
        tile = nl.ndarray((rows, width), dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=src[t0 + r0 : t0 + r0 + rows, :])
        _transpose_rows_into(out[:, :, r0 : r0 + rows], tile, rows, width, dtype, evictions)


def _column_chunks(cols, dtype):
    """(start, size) chunks of ``cols`` weight columns of at most WEIGHT_ROW_CHUNK. A last chunk whose
    rows would be shorter than SATURATING_ROW_BYTES is avoided by evening the chunks out (in 128-column
    multiples): 4608 bf16 columns are read as 2 x 2304, not 4096 + 512, whose 1 KiB rows would move at
    a fraction of the DMA bandwidth; 14336 stay 3 x 4096 + 2048, all saturating."""
    tail = cols % WEIGHT_ROW_CHUNK
    if tail == 0 or tail * itemsize(dtype) >= SATURATING_ROW_BYTES:
        return tiles(cols, WEIGHT_ROW_CHUNK)
    count = ceil_div(cols, WEIGHT_ROW_CHUNK)
    return tiles(cols, ceil_div(ceil_div(cols, count), P) * P)


def _load_weight_transposed(weight, r0, rows, cols, dtype, evictions):
    """weight[r0 : r0 + rows, :cols]^T as an SBUF tile [P, ceil(cols/128), rows], read in wide rows."""
    out = nl.ndarray((P, ceil_div(cols, P), rows), dtype, buffer=nl.sbuf)
    for c0, c in _column_chunks(cols, dtype):
        raw = nl.ndarray((rows, c), dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=raw, src=weight[r0 : r0 + rows, c0 : c0 + c])
        _transpose_rows_into(out[:, c0 // P :, :], raw, rows, c, dtype, evictions)
    return out


def _load_columns(vector):
    """An fp32 SBUF tile [P, ceil(n/128)] holding ``vector[k*128 + p]`` at [p, k] (``vector`` [n] in HBM):
    a bias laid out per partition, as the transposed activations and outputs need it."""
    (size,), dtype = vector.shape, vector.dtype
    n_tiles = ceil_div(size, P)
    raw = nl.ndarray((P, n_tiles), dtype, buffer=nl.sbuf)
    out = nl.ndarray((P, n_tiles), nl.float32, buffer=nl.sbuf)
    full, rest = size // P, size % P
    if full:
        nisa.dma_copy(dst=raw[:, :full], src=vector[: full * P].reshape((full, P)).permute((1, 0)))
        nisa.tensor_copy(dst=out[:, :full], src=raw[:, :full])
    if rest:
        nisa.dma_copy(dst=raw[:rest, full : full + 1], src=vector[full * P : size].reshape((rest, 1)))
        nisa.tensor_copy(dst=out[:rest, full : full + 1], src=raw[:rest, full : full + 1])
    return out


def _store_columns(vector, columns):
    """``vector[k*128 + p] = columns[p, k]`` (fp32, rounded once to the vector's dtype): :func:`_load_columns`
    reversed."""
    (size,), dtype = vector.shape, vector.dtype
    n_tiles = ceil_div(size, P)
    rounded = nl.ndarray((P, n_tiles), dtype, buffer=nl.sbuf)
    full, rest = size // P, size % P
    if full:
        nisa.tensor_copy(dst=rounded[:, :full], src=columns[:, :full])
        nisa.dma_copy(dst=vector[: full * P].reshape((full, P)).permute((1, 0)), src=rounded[:, :full])
    if rest:
        nisa.tensor_copy(dst=rounded[:rest, full : full + 1], src=columns[:rest, full : full + 1])
        nisa.dma_copy(dst=vector[full * P : size].reshape((rest, 1)), src=rounded[:rest, full : full + 1])


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
def saved_shape(tokens, inter, projections=2):
    """Shape of what the training forward saves: the input projections (gate and up, or the plain
    MLP's up with its bias), before the activation, intermediate-major in blocks of token tiles:
    ``saved[b, p, k, it, t] = projection k[token b*TT + t, intermediate it*128 + p]`` with
    TT = min(SAVED_TOKEN_TILE, tokens). Partition-major, so the backward reads long contiguous runs."""
    tt = min(SAVED_TOKEN_TILE, tokens)
    return (ceil_div(tokens, tt), P, projections, ceil_div(inter, P), tt)


def forward_plan(tokens, hidden, inter, dtype, sbuf_bytes, projections=2):
    """(token block, intermediate tiles per part) for the forward, from the SBUF budget
    (``projections``: input projections per intermediate tile, 2 gated, 1 plain).

    A token block's x^T stays resident; its activations a^T are produced one part (a run of
    intermediate tiles) at a time and consumed by the down projection before the next part, so
    the intermediate never leaves the chip. More than one part means the down projection's
    partial sums over the parts are kept in fp32 in a kernel-private HBM buffer.
    """
    size = itemsize(dtype)
    h_tiles, i_tiles = ceil_div(hidden, P), ceil_div(inter, P)
    chunk = min(hidden, WEIGHT_ROW_CHUNK)
    stage_gate_up = projections * 2 * (chunk + h_tiles * P) * size  # each, raw and transposed, double-buffered
    first = min(MAX_TOKEN_BLOCK, tokens)
    # Smaller blocks are powers of two times 128, so token tiles stay aligned to TOKEN_TILE.
    for block in [first] + [b for b in (512, 256, MIN_TOKEN_BLOCK) if b < first]:
        fixed = SBUF_RESERVE + stage_gate_up + h_tiles * block * size  # staging + x^T
        fixed += 2 * block * 4 + ceil_div(block, P) * P * size  # y^T partial (fp32) and the y rows
        per_tile = block * size + 2 * 2 * P * size  # a^T, and the down weight raw + transposed, double
        fit = (sbuf_bytes - fixed) // per_tile
        if fit >= 1:
            return block, min(i_tiles, fit)
    raise ValueError(
        f"mlp: hidden size {hidden} with intermediate size {inter} ({dtype_name(dtype)}) does not "
        f"fit the {sbuf_bytes // 1024} KiB of SBUF per partition"
    )


class _Forward(nl.NKIObject):
    """What the forward's steps share: the input projections' weights (gate and up, or up alone), the
    down weight, the activation, the biases as fp32 per-partition columns (or None), the output (and
    saved) buffers, the partial sums of a multi-part intermediate, and the x^T and a^T SBUF buffers that
    every token block and part reuses (their reuse orders the next block's writes after this block's
    last reads, as the hardware would need)."""

    def __init__(self, projections, w_down, activation, out, saved, partial, x_t, act_t, evictions, biases=None):
        self.projections, self.w_down, self.activation = projections, w_down, activation
        self.out, self.saved, self.partial, self.x_t, self.act_t = out, saved, partial, x_t, act_t
        self.hidden, self.dtype, self.evictions = w_down.shape[0], out.dtype, evictions
        self.up_bias, self.down_bias = biases if biases is not None else (None, None)

    def project(self, part, t0, t_block):
        """a^T for the part's intermediate tiles, into ``act_t``: act(x Wg^T)^T * (x Wu^T)^T (gated)
        or act(x Wu^T + bu)^T (plain)."""
        h_tiles = list(tiles(self.hidden, P))
        for j, (i0, isz) in enumerate(part):
            weights_t = [
                _load_weight_transposed(w, i0, isz, self.hidden, self.dtype, self.evictions) for w in self.projections
            ]
            for tt0, tt in tiles(t_block, TOKEN_TILE):
                sums = []
                for w_t in weights_t:
                    acc = nl.ndarray((isz, tt), nl.float32, buffer=nl.psum)
                    for k, (_, hsz) in enumerate(h_tiles):
                        nisa.nc_matmul(dst=acc, stationary=w_t[:hsz, k, :isz], moving=self.x_t[:hsz, k, tt0 : tt0 + tt])
                    sums.append(acc)
                act_tile = self.act_t[:isz, j, tt0 : tt0 + tt]
                bias = None if self.up_bias is None else self.up_bias[:isz, i0 // P : i0 // P + 1]
                if len(sums) == 2:
                    activated = nl.ndarray((isz, tt), nl.float32, buffer=nl.sbuf)
                    nisa.activation(dst=activated, op=_act_op(self.activation), data=sums[0])
                    nisa.tensor_tensor(dst=act_tile, data1=activated, data2=sums[1], op=nl.multiply)
                else:
                    nisa.activation(dst=act_tile, op=_act_op(self.activation), data=sums[0], bias=bias)
                if self.saved is not None:
                    self._save_projections(sums, bias, t0 + tt0, tt, i0 // P, isz)

    def _save_projections(self, sums, bias, t_start, tt, i_tile, isz):
        """saved[..., k, i_tile, ...] = projection k (+ the up bias), rounded to the input dtype, split at
        saved token tiles."""
        width = self.saved.shape[4]
        for k, src in enumerate(sums):
            rounded = nl.ndarray((isz, tt), self.dtype, buffer=nl.sbuf)
            self.evictions.evict(rounded, src, bias)
            for c0, c in tiles(tt, width):
                block, col = (t_start + c0) // width, (t_start + c0) % width
                nisa.dma_copy(dst=self.saved[block, :isz, k, i_tile, col : col + c], src=rounded[:, c0 : c0 + c])

    def down(self, part, t0, t_block, first, last):
        """y^T (+)= Wd[:, part] a^T[part] for every hidden tile; the last part writes y."""
        dtype = self.dtype
        p0 = part[0][0]
        p_cols = part[-1][0] + part[-1][1] - p0
        for h0, hsz in tiles(self.hidden, P):
            wd_t = _load_weight_transposed(self.w_down[:, p0 : p0 + p_cols], h0, hsz, p_cols, dtype, self.evictions)
            y_t = nl.ndarray((hsz, t_block), dtype if last else nl.float32, buffer=nl.sbuf)
            for tt0, tt in tiles(t_block, TOKEN_TILE):
                acc = nl.ndarray((hsz, tt), nl.float32, buffer=nl.psum)
                for j, (_, isz) in enumerate(part):
                    nisa.nc_matmul(dst=acc, stationary=wd_t[:isz, j, :hsz], moving=self.act_t[:isz, j, tt0 : tt0 + tt])
                if first:
                    bias = None if self.down_bias is None else self.down_bias[:hsz, h0 // P : h0 // P + 1]
                    self.evictions.evict(y_t[:, tt0 : tt0 + tt], acc, bias)
                else:
                    earlier = nl.ndarray((hsz, tt), nl.float32, buffer=nl.sbuf)
                    nisa.dma_copy(dst=earlier, src=self.partial[h0 : h0 + hsz, tt0 : tt0 + tt])
                    nisa.tensor_tensor(dst=y_t[:, tt0 : tt0 + tt], data1=acc, data2=earlier, op=nl.add)
            if last:
                self._store_rows(y_t, t0, t_block, h0, hsz)
            else:
                nisa.dma_copy(dst=self.partial[h0 : h0 + hsz, :t_block], src=y_t)

    def _store_rows(self, y_t, t0, t_block, h0, hsz):
        """out[t0 : t0 + t_block, h0 : h0 + hsz] = y_t^T, transposed back on TensorE."""
        rows = nl.ndarray((P, ceil_div(t_block, P), hsz), self.dtype, buffer=nl.sbuf)
        _transpose_rows_into(rows, y_t, hsz, t_block, self.dtype, self.evictions)
        full = t_block // P
        if full:
            dst = self.out[t0 : t0 + full * P, h0 : h0 + hsz].reshape((full, P, hsz)).permute((1, 0, 2))
            nisa.dma_copy(dst=dst, src=rows[:, :full, :])
        if t_block % P:
            r = t_block % P
            nisa.dma_copy(dst=self.out[t0 + full * P : t0 + t_block, h0 : h0 + hsz], src=rows[:r, full, :])


@nki.jit
def mlp_fwd(x, w_gate, w_up, w_down, activation, save_gate_up):
    """Fused gated MLP forward.

    Args:
        x: [T, H] input in HBM.
        w_gate: [I, H] gate projection weight, or the fused [2I, H] gate_up weight (w_up None).
        w_up: [I, H] up projection weight, or None.
        w_down: [H, I] down projection weight.
        activation: "silu" or "gelu_tanh".
        save_gate_up: also return the gate and up projections for the backward (training).

    IO shapes:
        returns y [T, H] (x's dtype) and, with ``save_gate_up``, saved ``saved_shape(T, I)``
        (x's dtype; see :func:`saved_shape`). Nothing [T, I]-sized is written otherwise.

    Tiling plan
        Tokens go in blocks of up to MAX_TOKEN_BLOCK (:func:`forward_plan`); a block's x^T
        [H on partitions, tokens] stays in SBUF. For each part of the intermediate tiles:
        (A) per intermediate tile, the gate and up weight rows are read in 8 KiB rows, transposed,
        and g^T, u^T [128, <=512 tokens] accumulate over the hidden tiles in two PSUM banks;
        ScalarE applies the activation from PSUM and VectorE multiplies by u^T into a^T (SBUF);
        (B) per hidden tile, the down weight's row segment for the part is read and transposed,
        and y^T [128, <=512 tokens] accumulates over the part's tiles in PSUM. With one part, y^T
        is transposed back and stored; with several, partial sums go through an fp32 HBM buffer.
        Every weight is read once per token block: at 2048 tokens, twice.

    Engine plan
        TensorE: all transposes and the three projections. ScalarE: the activation and half the
        PSUM evictions. VectorE: gate*up, partial-sum adds and half the evictions. DMA: x, weight
        rows, y, partial sums, saved gate/up.
    """
    up_shape = None if w_up is None else w_up.shape
    dtype = x.dtype
    check_shapes(
        x.shape,
        w_gate.shape,
        up_shape,
        w_down.shape,
        activation,
        [dtype, w_gate.dtype, w_down.dtype] + ([] if w_up is None else [w_up.dtype]),
    )
    inter = w_down.shape[1]
    if w_up is None:
        w_gate, w_up = w_gate[:inter, :], w_gate[inter:, :]
    return _run_forward(x, [w_gate, w_up], w_down, activation, save_gate_up, None)


@nki.jit
def plain_mlp_fwd(x, w_up, w_down, b_up, b_down, activation, save_up):
    """Fused plain MLP forward: y = act(x Wu^T + bu) Wd^T + bd.

    Args:
        x: [T, H] input in HBM.
        w_up: [I, H] up projection weight. w_down: [H, I] down projection weight.
        b_up: [I] and b_down: [H] biases, or both None.
        activation: "gelu" (exact), "gelu_tanh", "relu" or "silu".
        save_up: also return the up projection with its bias (before the activation) for the backward.

    IO shapes:
        returns y [T, H] (x's dtype) and, with ``save_up``, saved ``saved_shape(T, I, 1)``
        (x's dtype). Nothing [T, I]-sized is written otherwise.

    Tiling plan
        :func:`mlp_fwd`'s, with one input projection: per intermediate tile the up weight's rows
        are read and transposed, u^T accumulates over the hidden tiles in one PSUM bank and ScalarE
        applies act(u^T + bu) from PSUM straight into a^T (the bias is its per-partition bias
        operand). The down projection's first eviction adds bd (a per-partition column of y^T).
        The biases are read once, into fp32 per-partition columns.

    Engine plan
        TensorE: all transposes and the two projections. ScalarE: the activation and half the
        PSUM evictions. VectorE: partial-sum adds and half the evictions. DMA: x, weight rows, y.
    """
    dtype = x.dtype
    with_bias = b_up is not None
    check_plain_shapes(
        x.shape,
        w_up.shape,
        w_down.shape,
        b_up.shape if with_bias else None,
        b_down.shape if b_down is not None else None,
        activation,
        [dtype, w_up.dtype, w_down.dtype] + ([b_up.dtype, b_down.dtype] if with_bias else []),
    )
    biases = (_load_columns(b_up), _load_columns(b_down)) if with_bias else None
    return _run_forward(x, [w_up], w_down, activation, save_up, biases)


def _run_forward(x, projections, w_down, activation, save, biases):
    """The forward of both MLPs (module docstring; ``projections``: gate and up, or up alone)."""
    dtype = x.dtype
    tokens, hidden = x.shape
    inter = w_down.shape[1]
    out = nl.ndarray((tokens, hidden), dtype, buffer=nl.shared_hbm)
    n_proj = len(projections)
    saved = nl.ndarray(saved_shape(tokens, inter, n_proj), dtype, buffer=nl.shared_hbm) if save else None
    block, part_tiles = forward_plan(tokens, hidden, inter, dtype, nl.tile_size.total_available_sbuf_size, n_proj)
    i_tiles = list(tiles(inter, P))
    parts = [i_tiles[k : k + part_tiles] for k in range(0, len(i_tiles), part_tiles)]
    partial = nl.ndarray((hidden, block), nl.float32, buffer=nl.hbm) if len(parts) > 1 else None
    evictions = _Evictions()
    x_t = nl.ndarray((P, ceil_div(hidden, P), block), dtype, buffer=nl.sbuf)
    act_t = nl.ndarray((P, part_tiles, block), dtype, buffer=nl.sbuf)
    forward = _Forward(projections, w_down, activation, out, saved, partial, x_t, act_t, evictions, biases)
    for t0, t_block in tiles(tokens, block):
        _load_transposed_tokens(x_t[:, :, :t_block], x, t0, t_block, hidden, dtype, evictions)
        for n, part in enumerate(parts):
            forward.project(part, t0, t_block)
            forward.down(part, t0, t_block, first=n == 0, last=n == len(parts) - 1)
    if save:
        _zero_saved_padding(saved, tokens, inter, dtype)
        return out, saved
    return out


def _zero_saved_padding(saved, tokens, inter, dtype):
    """Zero the parts of the saved layout no token or intermediate row maps to (a partial last
    intermediate tile's partitions, a partial last token tile's columns), so the output is
    deterministic. The backward never reads them."""
    n_blocks, _, n_proj, i_tiles, width = saved.shape
    rows = inter - (i_tiles - 1) * P
    used = tokens - (n_blocks - 1) * width
    if rows < P:
        zeros = nl.ndarray((P - rows, n_proj, width), dtype, buffer=nl.sbuf)
        nisa.memset(dst=zeros, value=0.0)
        for b in range(n_blocks):
            cols = width if b < n_blocks - 1 else used  # the last block's unused columns are zeroed below
            nisa.dma_copy(dst=saved[b, rows:, :, i_tiles - 1, :cols], src=zeros[:, :, :cols])
    if used < width:
        step = max(1, 4096 // (n_proj * (width - used)))  # intermediate tiles per zero-fill DMA
        zeros = nl.ndarray((P, n_proj, step, width - used), dtype, buffer=nl.sbuf)
        nisa.memset(dst=zeros, value=0.0)
        for it0, n in tiles(i_tiles, step):
            nisa.dma_copy(dst=saved[n_blocks - 1, :, :, it0 : it0 + n, used:], src=zeros[:, :, :n, :])


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------
MAX_I_BLOCK_TILES = 8  # intermediate tiles whose down-weight columns stay resident in the backward's phase 1
DX_K_TILES = 8  # contraction tiles per SBUF block of the dx GEMM (partial sums in fp32 SBUF)
TOKEN_K_TILES = 16  # token tiles the weight-gradient GEMMs contract in PSUM before adding partial sums
PIPELINE_DEPTH = 2  # phase 1: intermediate tiles between a tile's matmuls and its transposes
GEMM_ROWS = 2048  # widest block of output rows of a GEMM (lhs panel columns)
GEMM_COLS = 2048  # widest block of output columns of a GEMM (rhs panel columns)
DX_COLS = 1024  # output columns per block of the dx GEMM (its fp32 partial sums cover all block rows)


def _phase1_bytes(hidden, tokens, i_block_tiles, size, projections=2):
    """SBUF per partition of phase 1: two down-weight blocks, double-buffered token-tile operands
    and results, and the fp32 element-wise temporaries."""
    tt = min(SAVED_TOKEN_TILE, tokens)
    cols = i_block_tiles * P
    n = projections
    streamed = ceil_div(hidden, P) * tt + 2 * n * i_block_tiles * tt + (1 + n) * ceil_div(tt, P) * cols + 2 * tt
    return 2 * ceil_div(hidden, P) * cols * size + 2 * streamed * size + 8 * tt * 4


def _gemm_bytes(nk, m_cols, n_cols, size, multi, cached):
    """SBUF per partition of a GEMM block: panels (a cached one single, streamed ones double),
    fp32 partial sums when the contraction spans several groups, and output rows."""
    lhs = (1 if cached == "lhs" else 2) * nk * m_cols * size
    rhs = (1 if cached == "rhs" else 2) * nk * n_cols * size
    acc = ceil_div(m_cols, P) * n_cols * 4 if multi else 0
    return lhs + rhs + acc + 2 * n_cols * size


def _fit_gemm(nk, m_cols, n_cols, size, multi, cached, budget, shrink="m"):
    """Halve the block (rows first, or columns first) until it fits ``budget``."""
    while _gemm_bytes(nk, m_cols, n_cols, size, multi, cached) > budget:
        if (shrink == "m" and m_cols > P) or n_cols <= P:
            if m_cols <= P:
                return None
            m_cols //= 2
        else:
            n_cols //= 2
    return m_cols, n_cols


class BackwardPlan(nl.NKIObject):
    """Block sizes of the backward's phases: i_block_tiles (phase 1's intermediate tiles per block),
    dx_rows/dx_cols (phase 2's output block), down_rows (phase 3's dWd hidden rows per block),
    gate_cols (phase 3's dWg/dWu hidden columns per block)."""

    def __init__(self, i_block_tiles, dx_rows, dx_cols, down_rows, gate_cols):
        self.i_block_tiles, self.dx_rows, self.dx_cols = i_block_tiles, dx_rows, dx_cols
        self.down_rows, self.gate_cols = down_rows, gate_cols


def backward_plan(tokens, hidden, inter, dtype, sbuf_bytes, projections=2):
    """The ``BackwardPlan`` for the SBUF budget (raises when nothing fits); ``projections``: input
    projections, 2 gated, 1 plain."""
    size = itemsize(dtype)
    budget = sbuf_bytes - SBUF_RESERVE
    ib = min(MAX_I_BLOCK_TILES, ceil_div(inter, P))
    while ib > 1 and _phase1_bytes(hidden, tokens, ib, size, projections) > budget:
        ib -= 1
    token_tiles = ceil_div(tokens, P)
    nk = min(TOKEN_K_TILES, token_tiles)
    multi = token_tiles > TOKEN_K_TILES
    dx = _fit_gemm(
        DX_K_TILES,
        min(GEMM_ROWS, token_tiles * P),
        min(DX_COLS, hidden),
        size,
        projections * ceil_div(inter, P) > DX_K_TILES,
        None,
        budget,
    )
    down = _fit_gemm(nk, min(GEMM_ROWS, ceil_div(hidden, P) * P), ib * P, size, multi, None if multi else "lhs", budget)
    gate = _fit_gemm(nk, ib * P, min(GEMM_COLS, hidden), size, multi, None if multi else "rhs", budget, "n")
    if _phase1_bytes(hidden, tokens, ib, size, projections) > budget or None in (dx, down, gate):
        raise ValueError(
            f"mlp: backward with hidden size {hidden} and intermediate size {inter} "
            f"({dtype_name(dtype)}) does not fit the {sbuf_bytes // 1024} KiB of SBUF per partition"
        )
    return BackwardPlan(ib, dx[0], dx[1], down[0], gate[1])


def _activation_and_grad(gate, rows, cols, activation, columns, act_dtype=nl.float32):
    """(act(g), act'(g)) in SBUF from the projection ``gate`` (SBUF): act(g) in ``act_dtype``, act'(g) in
    fp32. ``columns`` holds [P, 1] fp32 constants (1.0) for ScalarE biases."""
    act = nl.ndarray((rows, cols), act_dtype, buffer=nl.sbuf)
    grad = nl.ndarray((rows, cols), nl.float32, buffer=nl.sbuf)
    if activation in ("silu", "gelu"):
        nisa.activation(dst=act, op=_act_op(activation), data=gate)
        nisa.activation(dst=grad, op=nl.silu_dx if activation == "silu" else nl.gelu_dx, data=gate)
        return act, grad
    if activation == "relu":  # relu'(0) = 0, as torch's threshold_backward has it
        nisa.activation(dst=act, op=nl.relu, data=gate)
        nisa.tensor_scalar(dst=grad, data=gate, op0=nl.greater, operand0=0.0)
        return act, grad
    # GELU, tanh approximation, with s = (1 + tanh(k (g + c g^3))) / 2 = sigmoid(2k (g + c g^3)):
    #   act = g s,   act' = s + 2k g s (1 - s) (1 + 3 c g^2)
    # SBUF products on GpSimd (fp32 tensor_tensor costs it N cycles, VectorE 2N), the affine steps
    # and the sigmoid on ScalarE, the rest on VectorE (which also has the caller's PSUM products).
    k, c = GELU_TANH_SCALE, GELU_TANH_CUBIC
    one = columns[:rows, 0:1]
    gpsimd = nisa.engine.gpsimd
    square = nl.ndarray((rows, cols), nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=square, data1=gate, data2=gate, op=nl.multiply, engine=gpsimd)
    inner = nl.ndarray((rows, cols), nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=inner, op=nl.copy, data=square, scale=c, bias=one)  # 1 + c g^2
    nisa.tensor_tensor(dst=inner, data1=inner, data2=gate, op=nl.multiply, engine=gpsimd)  # g + c g^3
    sig = nl.ndarray((rows, cols), nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sig, op=nl.sigmoid, data=inner, scale=2.0 * k)
    nisa.tensor_tensor(dst=act, data1=sig, data2=gate, op=nl.multiply, engine=gpsimd)
    slope = nl.ndarray((rows, cols), nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=slope, op=nl.copy, data=sig, scale=-1.0, bias=one)  # 1 - s
    nisa.tensor_tensor(dst=slope, data1=slope, data2=sig, op=nl.multiply, engine=gpsimd)  # s (1 - s)
    nisa.tensor_scalar(dst=square, data=square, op0=nl.multiply, operand0=3.0 * c, op1=nl.add, operand1=1.0)
    nisa.tensor_tensor(dst=slope, data1=slope, data2=square, op=nl.multiply, engine=gpsimd)
    nisa.tensor_tensor(dst=slope, data1=slope, data2=gate, op=nl.multiply, engine=gpsimd)
    nisa.scalar_tensor_tensor(dst=grad, data=slope, op0=nl.multiply, operand0=2.0 * k, op1=nl.add, operand1=sig)
    return act, grad


class _Backward(nl.NKIObject):
    """The backward's operands, sizes and plan, and the kernel-private HBM scratch its phases pass the
    [T, I] gradients through: dy^T (``dy_t``), the input projections' gradients dg^T/du^T (``dgu_t``,
    intermediate-major, for dx) and a, dg, du token-major (``grad_rows``, for the weight gradients).
    ``projections``: the gate and up weights, or the plain MLP's up alone. With ``with_bias`` (plain
    MLP) the bias gradients, sums over tokens of du and dy, accumulate in fp32 per-partition columns
    (``bias_sums``: up's [P, I/128], down's [P, H/128])."""

    def __init__(self, dy, x, projections, w_down, saved, activation, plan, evictions, with_bias=False):
        self.dy, self.x, self.projections, self.w_down, self.saved = dy, x, projections, w_down, saved
        self.activation, self.plan, self.evictions, self.dtype = activation, plan, evictions, x.dtype
        (self.tokens, self.hidden), self.inter = x.shape, w_down.shape[1]
        token_tiles, h_tiles, i_tiles = saved.shape[0], ceil_div(self.hidden, P), ceil_div(self.inter, P)
        self.token_tile, ib, n = saved.shape[4], plan.i_block_tiles, len(projections)
        self.dy_t = nl.ndarray((token_tiles, P, h_tiles, self.token_tile), self.dtype, buffer=nl.hbm)
        self.dgu_t = nl.ndarray((token_tiles, P, n * i_tiles, self.token_tile), self.dtype, buffer=nl.hbm)
        self.grad_rows = nl.ndarray(
            (1 + n, ceil_div(i_tiles, ib), P, ceil_div(self.tokens, P), min(self.inter, ib * P)),
            self.dtype,
            buffer=nl.hbm,
        )
        self.bias_sums = None
        if with_bias:
            self.bias_sums = tuple(nl.ndarray((P, t), nl.float32, buffer=nl.sbuf) for t in (i_tiles, h_tiles))
            for sums in self.bias_sums:
                nisa.memset(dst=sums, value=0.0)

    def transpose_dy(self):
        """Phase 0: dy_t[b, p, k, t] = dy[b * token_tile + t, k * 128 + p], token tile by token tile
        (and, with biases, the down bias's gradient: dy's sums over tokens, from the transposed tiles)."""
        for b, (t0, tsz) in enumerate(tiles(self.tokens, self.token_tile)):
            buf = nl.ndarray((P, ceil_div(self.hidden, P), tsz), self.dtype, buffer=nl.sbuf)
            _load_transposed_tokens(buf, self.dy, t0, tsz, self.hidden, self.dtype, self.evictions)
            nisa.dma_copy(dst=self.dy_t[b, :, :, :tsz], src=buf)
            if self.bias_sums is not None:
                for k, (_, hsz) in enumerate(tiles(self.hidden, P)):
                    _add_row_sums(self.bias_sums[1][:hsz, k : k + 1], buf[:hsz, k, :tsz])

    def store_bias_grads(self, d_up_bias, d_down_bias):
        """The bias gradients, from their fp32 sums, rounded once to the input dtype."""
        _store_columns(d_up_bias, self.bias_sums[0])
        _store_columns(d_down_bias, self.bias_sums[1])

    def intermediate_grads(self):
        """Phase 1: da^T = Wd^T dy^T per intermediate block and token tile, and from it (with the saved
        gate/up) dg = da * u * act'(g), du = da * act(g), a = act(g) * u. dg^T, du^T go to ``dgu_t``
        (intermediate-major, for dx); a, dg, du transposed to token-major go to ``grad_rows`` (for the
        weight gradients).

        Pipelining: the down-weight block is double-buffered (the next block loads while this one
        is used); each step's token-tile loads are issued one step ahead; a tile's transposes are
        issued after the next tile's matmuls, so TensorE never waits for the element-wise chain."""
        dy_t, saved, w_down, dgu_t, grad_rows = self.dy_t, self.saved, self.w_down, self.dgu_t, self.grad_rows
        i_block_tiles, tokens, hidden, inter = self.plan.i_block_tiles, self.tokens, self.hidden, self.inter
        activation, dtype, evictions = self.activation, self.dtype, self.evictions
        token_tile = saved.shape[4]
        i_tiles = list(tiles(inter, P))
        h_tiles = list(tiles(hidden, P))
        blocks = [i_tiles[k : k + i_block_tiles] for k in range(0, len(i_tiles), i_block_tiles)]
        token_tiles = list(tiles(tokens, token_tile))
        steps = [(ib, b) for ib in range(len(blocks)) for b in range(len(token_tiles))]
        width = min(inter, i_block_tiles * P)
        w_d = [nl.ndarray((P, len(h_tiles), width), dtype, buffer=nl.sbuf) for _ in range(min(2, len(blocks)))]
        columns = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)  # ScalarE bias constant 1.0
        nisa.memset(dst=columns, value=1.0)
        n_proj = len(self.projections)

        def load_block(ib, part=0, parts=1):
            """Rows [part/parts] of block ib's down-weight columns (a block loads in slices, one per
            step of the block before it, so its DMA shares bandwidth with those steps' loads)."""
            c0 = blocks[ib][0][0]
            cols = blocks[ib][-1][0] + blocks[ib][-1][1] - c0
            per = ceil_div(len(h_tiles), parts)
            for k, (r0, rows) in enumerate(h_tiles[part * per : (part + 1) * per], start=part * per):
                nisa.dma_copy(dst=w_d[ib % 2][:rows, k, :cols], src=w_down[r0 : r0 + rows, c0 : c0 + cols])

        def load_step(ib, b):
            tsz, it0, nbt = token_tiles[b][1], ib * i_block_tiles, len(blocks[ib])
            dyt = nl.ndarray((P, len(h_tiles), tsz), dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=dyt, src=dy_t[b, :, :, :tsz])
            gate_up = nl.ndarray((P, n_proj, nbt, tsz), dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=gate_up, src=saved[b, :, :, it0 : it0 + nbt, :tsz])
            return dyt, gate_up

        load_block(0)
        loaded = load_step(*steps[0])
        # Deferred TensorE transposes (and the stores that follow them): a tile's go after the matmuls of
        # the tile PIPELINE_DEPTH places later, so the element-wise chain between has time to finish.
        depth = min(PIPELINE_DEPTH, i_block_tiles)
        pending = []
        for s, (ib, b) in enumerate(steps):
            if ib + 1 < len(blocks):
                load_block(ib + 1, b, len(token_tiles))
            dyt, gate_up = loaded
            if s + 1 < len(steps):
                loaded = load_step(*steps[s + 1])
            block, (t0, tsz) = blocks[ib], token_tiles[b]
            it0, nbt = ib * i_block_tiles, len(block)
            cols = block[-1][0] + block[-1][1] - block[0][0]
            grads_t = nl.ndarray((P, n_proj, nbt, tsz), dtype, buffer=nl.sbuf)  # dg^T, du^T (or du^T)
            rows = nl.ndarray((P, 1 + n_proj, ceil_div(tsz, P), cols), dtype, buffer=nl.sbuf)  # a, dg, du token-major
            for j, (i0, isz) in enumerate(block):
                d_act = nl.ndarray((isz, tsz), nl.float32, buffer=nl.psum)
                for k, (_, hsz) in enumerate(h_tiles):
                    nisa.nc_matmul(
                        dst=d_act, stationary=w_d[ib % 2][:hsz, k, j * P : j * P + isz], moving=dyt[:hsz, k, :]
                    )
                while len(pending) >= depth:
                    _run(pending.pop(0))
                if n_proj == 2:
                    a = _elementwise_grads(
                        d_act,
                        gate_up[:isz, 0, j, :],
                        gate_up[:isz, 1, j, :],
                        grads_t[:isz, 0, j, :],
                        grads_t[:isz, 1, j, :],
                        isz,
                        tsz,
                        activation,
                        dtype,
                        columns,
                    )
                else:
                    a = _plain_elementwise_grads(
                        d_act, gate_up[:isz, 0, j, :], grads_t[:isz, 0, j, :], isz, tsz, activation, dtype, columns
                    )
                    if self.bias_sums is not None:
                        _add_row_sums(self.bias_sums[0][:isz, i0 // P : i0 // P + 1], grads_t[:isz, 0, j, :])
                sources = [a] + [grads_t[:isz, k, j, :] for k in range(n_proj)]
                pending.append(
                    [
                        (_transpose_rows_into, (rows[:, kind, :, j * P : j * P + isz], src, isz, tsz, dtype, evictions))
                        for kind, src in enumerate(sources)
                    ]
                )
            i_total, r0 = len(i_tiles), t0 // P
            pending[-1] += [
                (nisa.dma_copy, (dgu_t[b, :, k * i_total + it0 : k * i_total + it0 + nbt, :tsz], grads_t[:, k, :, :]))
                for k in range(n_proj)
            ] + [(nisa.dma_copy, (grad_rows[:, ib, :, r0 : r0 + ceil_div(tsz, P), :cols].permute((1, 0, 2, 3)), rows))]
        for group in pending:
            _run(group)

    def input_grad(self, dx):
        """Phase 2: dx = dg Wg + du Wu (or du Wu), contracting over the input projections' intermediate
        rows (dg^T, du^T from phase 1)."""
        dgu_t, plan = self.dgu_t, self.plan
        tokens, hidden, inter, dtype, evictions = self.tokens, self.hidden, self.inter, self.dtype, self.evictions
        token_tile = dgu_t.shape[3]
        i_tiles = list(tiles(inter, P))
        k_src = [(weight, i0, isz) for weight in self.projections for i0, isz in i_tiles]
        k_tiles = [isz for _, _, isz in k_src]
        m_blocks = [_output_rows(m0, rows) for m0, rows in tiles(tokens, plan.dx_rows)]

        def load_lhs(mb, k0, nk, into):
            m0 = mb[0].row
            rows = _panel_columns(mb)
            out = nl.ndarray((P, nk, rows), dtype, buffer=nl.sbuf)
            for t0, tsz in tiles(rows, token_tile):
                nisa.dma_copy(dst=out[:, :, t0 : t0 + tsz], src=dgu_t[(m0 + t0) // token_tile, :, k0 : k0 + nk, :tsz])
            return out

        def load_rhs(nb, k0, nk, into):
            n0, ncols = nb
            out = nl.ndarray((P, nk, ncols), dtype, buffer=nl.sbuf)
            for kk in range(nk):
                weight, r0, ksz = k_src[k0 + kk]
                nisa.dma_copy(dst=out[:ksz, kk, :], src=weight[r0 : r0 + ksz, n0 : n0 + ncols])
            return out

        def store(rows, nb, tile):
            nisa.dma_copy(dst=dx[rows.row : rows.row + tile.shape[0], nb[0] : nb[0] + nb[1]], src=tile)

        _gemm_tn(
            k_tiles,
            m_blocks,
            list(tiles(hidden, plan.dx_cols)),
            load_lhs,
            load_rhs,
            store,
            DX_K_TILES,
            None,
            dtype,
            evictions,
        )

    def weight_grads(self, dw_projections, dw_down):
        """Phase 3: dWd = dy^T a, and dWg = dg^T x, dWu = du^T x (``dw_projections``: the gradients
        of the input projections, in their order), contracting over tokens."""
        dy, x, grad_rows, plan = self.dy, self.x, self.grad_rows, self.plan
        tokens, hidden, inter = self.tokens, self.hidden, self.inter
        dtype, evictions = self.dtype, self.evictions
        k_tiles = [size for _, size in tiles(tokens, P)]
        nk = min(TOKEN_K_TILES, len(k_tiles))
        ib_cols = plan.i_block_tiles * P
        i_blocks = list(tiles(inter, ib_cols))

        # dWd [H, I]: rows are hidden (dy's columns), columns the intermediate blocks (a, token-major).
        down_rows = plan.down_rows
        h_blocks = [_output_rows(m0, rows) for m0, rows in tiles(hidden, down_rows)]

        def load_dy(mb, k0, n, into):
            into = into if into is not None else nl.ndarray((P, n, down_rows), dtype, buffer=nl.sbuf)
            return _load_token_major(dy, tokens, mb[0].row, _panel_columns(mb), k0, n, into)

        def load_a(nb, k0, n, into):
            c0, cols = nb
            out = into if into is not None else nl.ndarray((P, n, cols), dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=out[:, :n, :cols], src=grad_rows[0, c0 // ib_cols, :, k0 : k0 + n, :cols])
            return out

        def store_down(rows, nb, tile):
            nisa.dma_copy(dst=dw_down[rows.row : rows.row + tile.shape[0], nb[0] : nb[0] + nb[1]], src=tile)

        _gemm_tn(k_tiles, h_blocks, i_blocks, load_dy, load_a, store_down, nk, "lhs", dtype, evictions)

        # dWg, dWu [I, H]: rows are intermediate blocks (dg or du, token-major), columns hidden blocks of x.
        gate_cols = plan.gate_cols
        g_blocks = [
            _output_rows(c0, cols, target=target, kind=kind, block=ib)
            for kind, target in enumerate(dw_projections, start=1)
            for ib, (c0, cols) in enumerate(i_blocks)
        ]

        def load_grad(mb, k0, n, into):
            cols = _panel_columns(mb)
            out = into if into is not None else nl.ndarray((P, n, cols), dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=out[:, :n, :cols], src=grad_rows[mb[0].kind, mb[0].block, :, k0 : k0 + n, :cols])
            return out

        def load_x(nb, k0, n, into):
            into = into if into is not None else nl.ndarray((P, n, gate_cols), dtype, buffer=nl.sbuf)
            return _load_token_major(x, tokens, nb[0], nb[1], k0, n, into)

        def store_gate_up(rows, nb, tile):
            nisa.dma_copy(dst=rows.target[rows.row : rows.row + tile.shape[0], nb[0] : nb[0] + nb[1]], src=tile)

        _gemm_tn(
            k_tiles,
            g_blocks,
            list(tiles(hidden, gate_cols)),
            load_grad,
            load_x,
            store_gate_up,
            nk,
            "rhs",
            dtype,
            evictions,
        )


def _run(pending):
    """Issue deferred instructions (a list of (function, args))."""
    for function, args in pending:
        function(*args)


def _elementwise_grads(
    d_act, gate, up, d_gate_out, d_up_out, rows, cols, activation, dtype, columns, scale=None, a_out=None
):
    """From da (PSUM) and the saved g, u: writes dg = da * u * act'(g) and du = da * act(g); returns
    a = act(g) * u (written into ``a_out`` when given). With ``scale`` (an fp32 [rows, 1] column) da is
    first multiplied by it, in the same VectorE instructions as its products. ScalarE: the activation and
    its derivative; VectorE: the products with da (PSUM); GpSimd: the SBUF-only products."""
    act, grad = _activation_and_grad(gate, rows, cols, activation, columns)
    a = nl.ndarray((rows, cols), dtype, buffer=nl.sbuf) if a_out is None else a_out
    nisa.tensor_tensor(dst=a, data1=act, data2=up, op=nl.multiply, engine=nisa.engine.gpsimd)
    d_gate = nl.ndarray((rows, cols), nl.float32, buffer=nl.sbuf)
    for dst, other in ((d_up_out, act), (d_gate, up)):
        if scale is None:
            nisa.tensor_tensor(dst=dst, data1=d_act, data2=other, op=nl.multiply)
        else:
            nisa.scalar_tensor_tensor(
                dst=dst, data=d_act, op0=nl.multiply, operand0=scale, op1=nl.multiply, operand1=other
            )
    nisa.tensor_tensor(dst=d_gate_out, data1=d_gate, data2=grad, op=nl.multiply, engine=nisa.engine.gpsimd)
    return a


def _plain_elementwise_grads(d_act, up, d_up_out, rows, cols, activation, dtype, columns):
    """From da (PSUM) and the saved u (with its bias): writes du = da * act'(u) and returns a = act(u),
    in ``dtype``. The activation and its derivative as :func:`_activation_and_grad` forms them (ScalarE
    for SiLU and GELU, relu's step on VectorE, tanh-GELU's chain over three engines); VectorE: the
    product with da (PSUM)."""
    act, grad = _activation_and_grad(up, rows, cols, activation, columns, act_dtype=dtype)
    nisa.tensor_tensor(dst=d_up_out, data1=d_act, data2=grad, op=nl.multiply)
    return act


def _add_row_sums(sums, data):
    """sums (an fp32 [rows, 1] column) += data's sums along its free dim (a bias gradient's share)."""
    part = nl.ndarray(tuple(sums.shape), nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=part, op=nl.add, data=data, axis=1)
    nisa.tensor_tensor(dst=sums, data1=sums, data2=part, op=nl.add, engine=nisa.engine.gpsimd)


class _OutputRows(nl.NKIObject):
    """Up to 128 output rows of a GEMM block: columns [col, col + rows) of the block's lhs panel, which
    go to row ``row`` of the output (of ``target``, when the GEMM fills several; ``kind`` and ``block``
    name the lhs source they come from)."""

    def __init__(self, col, rows, row, target=None, kind=None, block=None):
        self.col, self.rows, self.row = col, rows, row
        self.target, self.kind, self.block = target, kind, block


def _output_rows(row0, rows, **where):
    """``_OutputRows`` of a block of ``rows`` output rows from ``row0``, 128 at a time."""
    return [_OutputRows(c0, c, row0 + c0, **where) for c0, c in tiles(rows, P)]


def _panel_columns(m_block):
    return m_block[-1].col + m_block[-1].rows


def _gemm_tn(k_tiles, m_blocks, n_blocks, load_lhs, load_rhs, store, k_group, cache, dtype, evictions):
    """out[m, n] = sum_k lhs_t[k, m] rhs[k, n], contraction on partitions, in blocks.

    k_tiles: sizes of the contraction tiles (rows on partitions, <= 128 each).
    m_blocks: blocks of output rows; each a list of ``_OutputRows``.
    n_blocks: (n0, ncols) blocks of output columns.
    load_lhs(m_block, k0, nk, into) -> SBUF [P, nk, >= panel columns]; load_rhs(n_block, k0, nk, into)
    -> [P, nk, >= ncols]; ``into`` is a buffer to reuse, or None for a fresh one.
    store(output_rows, n_block, tile) with tile [rows, ncols] in ``dtype``.
    k_group: contraction tiles per block; the partial sums of several blocks add up in fp32 SBUF.
    cache: "lhs" (m-blocks outer, each m-block's panel loaded once) or "rhs" (n-blocks outer),
    when one k group covers the whole contraction; the cached panel lives in one reused buffer.
    """
    groups = [(k0, min(k_group, len(k_tiles) - k0)) for k0 in range(0, len(k_tiles), k_group)]
    single = len(groups) == 1
    cache = cache if single else None
    if cache == "rhs":
        pairs = [(mb, nb) for nb in n_blocks for mb in m_blocks]
    else:
        pairs = [(mb, nb) for mb in m_blocks for nb in n_blocks]
    steps = [(mb, nb, g) for mb, nb in pairs for g in range(len(groups))]

    def load_streamed(step):
        """The operands not cached, issued one step ahead so their DMAs never wait behind stores."""
        mb, nb, g = step
        k0, nk = groups[g]
        return (
            None if cache == "lhs" else load_lhs(mb, k0, nk, None),
            None if cache == "rhs" else load_rhs(nb, k0, nk, None),
        )

    cached_for, panel = None, None
    ahead = load_streamed(steps[0])
    # fp32 partial sums when the contraction spans several groups: one buffer, reused by every block
    widest = max(len(mb) for mb in m_blocks), max(nb[1] for nb in n_blocks)
    acc = None if single else nl.ndarray((P, widest[0], widest[1]), nl.float32, buffer=nl.sbuf)
    for s, (mb, nb, g) in enumerate(steps):
        k0, nk = groups[g]
        lhs, rhs = ahead
        if cache == "lhs" and cached_for is not mb:
            panel, cached_for = load_lhs(mb, k0, nk, panel), mb
        if cache == "rhs" and cached_for is not nb:
            panel, cached_for = load_rhs(nb, k0, nk, panel), nb
        if s + 1 < len(steps):
            ahead = load_streamed(steps[s + 1])
        lhs = panel if cache == "lhs" else lhs
        rhs = panel if cache == "rhs" else rhs
        n_cols = nb[1]
        last = g == len(groups) - 1
        for j, part in enumerate(mb):
            col, rows = part.col, part.rows
            out_tile = nl.ndarray((rows, n_cols), dtype, buffer=nl.sbuf) if last else None
            for n0, nsz in tiles(n_cols, TOKEN_TILE):
                ps = nl.ndarray((rows, nsz), nl.float32, buffer=nl.psum)
                for kk in range(nk):
                    ksz = k_tiles[k0 + kk]
                    nisa.nc_matmul(
                        dst=ps, stationary=lhs[:ksz, kk, col : col + rows], moving=rhs[:ksz, kk, n0 : n0 + nsz]
                    )
                if single:
                    evictions.evict(out_tile[:, n0 : n0 + nsz], ps)
                elif g == 0:
                    evictions.evict(acc[:rows, j, n0 : n0 + nsz], ps)
                else:
                    target = out_tile[:, n0 : n0 + nsz] if last else acc[:rows, j, n0 : n0 + nsz]
                    nisa.tensor_tensor(dst=target, data1=ps, data2=acc[:rows, j, n0 : n0 + nsz], op=nl.add)
            if last:
                store(part, nb, out_tile)


def _load_token_major(src, tokens, c0, cols, k0, nk, out):
    """out[p, kk, :cols] = src[(k0 + kk) * 128 + p, c0 : c0 + cols]: tokens on partitions, 128 per k tile."""
    t0 = k0 * P
    full = max(0, min(nk, (tokens - t0) // P))
    if full:
        view = src[t0 : t0 + full * P, c0 : c0 + cols].reshape((full, P, cols)).permute((1, 0, 2))
        nisa.dma_copy(dst=out[:, :full, :cols], src=view)
    if full < nk:
        rest = tokens - (t0 + full * P)
        nisa.dma_copy(dst=out[:rest, full, :cols], src=src[t0 + full * P : tokens, c0 : c0 + cols])
    return out


@nki.jit
def mlp_bwd(dy, x, w_gate, w_up, w_down, saved, activation):
    """Fused gated MLP backward, from the forward's saved gate/up projections.

    With g = x Wg^T, u = x Wu^T, a = act(g) * u, y = a Wd^T:
        da = dy Wd;  du = da * act(g);  dg = da * u * act'(g)
        dx = dg Wg + du Wu;  dWd = dy^T a;  dWg = dg^T x;  dWu = du^T x

    Args:
        dy: [T, H] gradient of the output. x: [T, H] forward input.
        w_gate, w_up, w_down: as in :func:`mlp_fwd` (w_up None for a fused gate_up weight).
        saved: the forward's ``saved_shape(T, I)`` gate/up projections.
        activation: "silu" or "gelu_tanh".

    IO shapes:
        returns (dx [T, H], dw_gate [I, H], dw_up [I, H], dw_down [H, I]), or with a fused weight
        (dx, dw_gate_up [2I, H], dw_down); all in x's dtype.

    Plan (block sizes from :func:`backward_plan`): four phases, each contracting over the
    partition dim with its operands read in long rows; the [T, I] gradients pass between phases
    through kernel-private HBM, partition-major so they are read back in long runs.
        0. dy^T, token tile by token tile (TensorE transposes).
        1. per block of intermediate tiles (the down weight's columns resident in SBUF, the next
           block's loading into a second buffer meanwhile) and token tile: da^T accumulates over
           hidden tiles in PSUM, the down weight in its own layout as the stationary operand;
           ScalarE forms act(g), act'(g) from the saved gate; VectorE (the PSUM products) and
           GpSimd (the SBUF ones) form a, dg, du; TensorE transposes them to token-major two
           tiles later, so it never waits for the element-wise chain.
        2. dx: contraction over 2I in groups of DX_K_TILES, dg^T/du^T stationary and the gate/up
           weights in their own layout as the moving operand; fp32 partial sums in SBUF.
        3. dWd, dWg, dWu: contraction over tokens, up to TOKEN_K_TILES token tiles in PSUM
           (fp32 SBUF partial sums beyond), one operand panel cached per block.
    No weight is transposed: every weight is read in its own layout, once per phase that needs it.
    """
    up_shape = None if w_up is None else w_up.shape
    dtype = x.dtype
    check_shapes(
        x.shape,
        w_gate.shape,
        up_shape,
        w_down.shape,
        activation,
        [dtype, dy.dtype, w_gate.dtype, w_down.dtype] + ([] if w_up is None else [w_up.dtype]),
    )
    tokens, hidden = x.shape
    inter = w_down.shape[1]
    if tuple(dy.shape) != (tokens, hidden):
        raise ValueError(f"mlp: grad_out of shape {tuple(dy.shape)} does not match x {tuple(x.shape)}")
    if tuple(saved.shape) != saved_shape(tokens, inter):
        raise ValueError(f"mlp: saved gate/up of shape {tuple(saved.shape)} is not {saved_shape(tokens, inter)}")
    plan = backward_plan(tokens, hidden, inter, dtype, nl.tile_size.total_available_sbuf_size)
    fused = w_up is None
    dx = nl.ndarray((tokens, hidden), dtype, buffer=nl.shared_hbm)
    dw_gate = nl.ndarray(tuple(w_gate.shape), dtype, buffer=nl.shared_hbm)
    dw_up = None if fused else nl.ndarray((inter, hidden), dtype, buffer=nl.shared_hbm)
    dw_down = nl.ndarray((hidden, inter), dtype, buffer=nl.shared_hbm)
    if fused:
        w_gate, w_up = w_gate[:inter, :], w_gate[inter:, :]
        dwg, dwu = dw_gate[:inter, :], dw_gate[inter:, :]
    else:
        dwg, dwu = dw_gate, dw_up
    backward = _Backward(dy, x, [w_gate, w_up], w_down, saved, activation, plan, _Evictions())
    backward.transpose_dy()
    backward.intermediate_grads()
    backward.input_grad(dx)
    backward.weight_grads([dwg, dwu], dw_down)
    if fused:
        return dx, dw_gate, dw_down
    return dx, dw_gate, dw_up, dw_down


@nki.jit
def plain_mlp_bwd(dy, x, w_up, w_down, saved, activation, with_bias):
    """Fused plain MLP backward, from the forward's saved up projection (with its bias).

    With u = x Wu^T + bu, a = act(u), y = a Wd^T + bd:
        da = dy Wd;  du = da * act'(u);  dx = du Wu;  dWd = dy^T a;  dWu = du^T x;
        dbu = sum_t du;  dbd = sum_t dy

    Args:
        dy: [T, H] gradient of the output. x: [T, H] forward input.
        w_up: [I, H], w_down: [H, I] as in :func:`plain_mlp_fwd`.
        saved: the forward's ``saved_shape(T, I, 1)`` up projection.
        activation: as in the forward. with_bias: also return the biases' gradients.

    IO shapes:
        returns (dx [T, H], dw_up [I, H], dw_down [H, I]), with ``with_bias`` followed by
        (db_up [I], db_down [H]); all in x's dtype.

    Plan: :func:`mlp_bwd`'s four phases with one input projection (phase 2 contracts over I, not
    2I). The bias gradients are row sums of tiles the phases already hold, accumulated in fp32
    per-partition columns: dy^T's in phase 0, du^T's in phase 1 (row sums on VectorE, accumulated on GpSimd).
    """
    dtype = x.dtype
    check_plain_shapes(
        x.shape, w_up.shape, w_down.shape, None, None, activation, [dtype, dy.dtype, w_up.dtype, w_down.dtype]
    )
    tokens, hidden = x.shape
    inter = w_down.shape[1]
    if tuple(dy.shape) != (tokens, hidden):
        raise ValueError(f"plain_mlp: grad_out of shape {tuple(dy.shape)} does not match x {tuple(x.shape)}")
    if tuple(saved.shape) != saved_shape(tokens, inter, 1):
        raise ValueError(f"plain_mlp: saved up of shape {tuple(saved.shape)} is not {saved_shape(tokens, inter, 1)}")
    plan = backward_plan(tokens, hidden, inter, dtype, nl.tile_size.total_available_sbuf_size, 1)
    dx = nl.ndarray((tokens, hidden), dtype, buffer=nl.shared_hbm)
    dw_up = nl.ndarray((inter, hidden), dtype, buffer=nl.shared_hbm)
    dw_down = nl.ndarray((hidden, inter), dtype, buffer=nl.shared_hbm)
    backward = _Backward(dy, x, [w_up], w_down, saved, activation, plan, _Evictions(), with_bias)
    backward.transpose_dy()
    backward.intermediate_grads()
    backward.input_grad(dx)
    backward.weight_grads([dw_up], dw_down)
    if not with_bias:
        return dx, dw_up, dw_down
    db_up = nl.ndarray((inter,), dtype, buffer=nl.shared_hbm)
    db_down = nl.ndarray((hidden,), dtype, buffer=nl.shared_hbm)
    backward.store_bias_grads(db_up, db_down)
    return dx, dw_up, dw_down, db_up, db_down
