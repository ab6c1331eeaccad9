"""Flash attention for decoding, in NKI: a few queries per sequence against a long KV cache.

The prefill kernel (``attention.py``) puts 128 queries on the partitions and streams keys along the
free dimension. With one to a few queries per KV head that leaves most lanes idle and makes every
engine walk the whole key range on one partition, and its K^T comes through the (slow) DMA transpose.
This kernel turns the problem round: keys go on the partitions, the group's queries along the free
dimension, so each engine touches ``keys / 128`` elements per query, and the run is as fast as the
K/V bytes can be read.

Semantics are the prefill kernel's (``flash_attn_fwd`` without bias or packed segments): GQA,
causal masking aligned bottom-right (query i of Sq sees keys j <= i + Sk - Sq), a sliding window
(keys j > i + Sk - Sq - window), logit softcapping, and a zero output for a row that sees no key.

Dimensions
    B batch, H query heads, Hkv KV heads, G = H / Hkv, Sq queries, Sk keys, D head dim (1..MAX_HEAD_DIM).
    A KV group's rows are its G query heads x Sq queries, n = G * Sq <= MAX_GROUP_ROWS; row
    r = h * Sq + i, the order the heads already have in q's memory.

Tiling plan
    Per (batch, KV head) the group's Q^T [D, n] stays in SBUF, in 128-row blocks of D (above 128 the
    contraction over D is split: a K block's transpose and its S^T matmul are one per block of D). The
    visible keys are cut into chunks of up to ``128 x T`` keys, partition p holding the T consecutive
    keys ``k0 + p*T + t`` (one contiguous run of T*D elements per partition, so K and V load at full DMA
    efficiency; see ``keys_per_partition``).
    Per chunk:
      - K^T on TensorE, one 128-key block (the keys of one t) at a time, TRANSPOSE_GROUP blocks per
        PSUM tile, copied to SBUF by VectorE and ScalarE in turn, two of three on ScalarE from
        SHIFT_MIN_ROWS rows (GpSimd cannot read PSUM);
      - S^T [keys, n] = K Q^T per block into one PSUM bank (keys on partitions: K^T is the stationary
        operand, Q^T the moving one, n columns);
      - masked where the chunk crosses a causal or window edge (GpSimd ``affine_select`` on the key
        and query indices), softcapped on ScalarE;
      - the chunk's max per row: VectorE reduces each partition's T keys, GpSimd reduces across the
        partitions, a ones-row matmul broadcasts it back to every partition;
      - P^T = exp(scale * (S^T - max)) (VectorE subtract, ScalarE exp), already keys-on-partitions,
        so it is the stationary operand of [P V | rowsum P] with V's ones column appended;
      - the chunk's [P V | rowsum P] and max are merged into the running output (flash-decoding's
        split-key combine: acc = acc * exp(m_old - m) + pv * exp(m_chunk - m)).
    Chunks run through a software pipeline (``_STAGES``) across every (batch, KV head), so one
    chunk's loads and transposes overlap an earlier chunk's softmax. Chunks that the window makes
    invisible are never read. When every load fits in SBUF at once (a short batch, ``fits_resident``)
    each has buffers of its own, every K load goes before every V load (a paged load's K and V each in
    RESIDENT_LOAD_PIECES gathers), the keys' stages run alone (``_RESIDENT_STAGES``) and P V follows,
    the KV heads' chunks of the same keys together. Single keys a mask leaves on their own are joined
    to the neighbouring chunk (``_joined_single_rows``).
"""

import nki
import nki.isa as nisa
import nki.language as nl

from ._common import MASKED_LOGIT_FLOOR, SMALLEST_SBUF_BYTES, P, ceil_div, dtype_name, itemsize, tiles

MAX_HEAD_DIM = 2 * P  # above 128 the contraction over D is split in 128-row blocks (two matmuls per S^T block)
MAX_GROUP_ROWS = P  # query rows of one KV group: they are the matmul's stationary columns in P V
SCORE_BANK_COLUMNS = 512  # fp32 S^T columns per partition in one PSUM bank (2 KiB)
SCORE_BANKS = 2  # PSUM banks one chunk's S^T may span (two chunks are in flight in the pipeline)
# From this many query rows on, the max is subtracted from S^T in PSUM by TensorE (a ones-row matmul
# of 64 cycles per 128-key block at 2.4 GHz) rather than on VectorE (one cycle per score at 0.96 GHz),
# and the few keys a mask cuts get chunks of their own. By engine time the two subtractions cost the
# same at 26 rows, but the update adds a TensorE step to each chunk's dependency chain: in the cost
# model it pays from 64 rows (a Qwen3-8B layer with 16 queries: 39.8% -> 47.3% of the HBM roofline)
# and loses at 32 (8 queries: 62.8% -> 54.4%).
SHIFT_MIN_ROWS = 64
CHUNK_BYTES = 4 * 1024  # K bytes per partition per chunk: a DMA saturates from 4 KiB per partition
# A paged cache's chunks hold every KV head's keys, so they are large: up to PAGED_KEY_LOADS K tiles
# are live (in use, prefetched, being freed) beside the ring of V buffers; SBUF_RESERVE is left for the
# rest (K^T, probabilities, queries), there and beside resident loads (``fits_resident``). Measured on
# the ring: at T = 16, 8 KV heads, d = 128 the simulator's SBUF peak (each tile counted from its first
# use to its last, on the partitions it takes) is 206,808 of Trn2's 229,376 bytes per partition.
PAGED_KEY_LOADS = 3
# A resident paged load's K and V each arrive in this many gathers of consecutive key blocks (every
# KV head's), so that the transposes and P V start on the first to land (a contiguous cache's loads
# come whole: one KV head's run of T keys per partition is only 4 KiB). Modelled, Qwen3-8B batch 1,
# blocks of 16 (T = 16, every KV head's 2 KiB per key): K whole and V in 2 gathers 54.6 us, both in
# 4 (8 KiB runs) 53.5 us; K in 8 and V in 4 53.4 us, both in 8 53.6 us, V in 8 and K in 4 53.7 us.
RESIDENT_LOAD_PIECES = 4
MAX_PAGED_SLOTS = 2**24  # the block table becomes slot indices in fp32 arithmetic, exact to 2**24
SBUF_RESERVE = 24 * 1024
TRANSPOSE_GROUP = 4  # 128-key blocks transposed into one PSUM tile and copied out by one instruction
FP32_MIN = -3.4028234663852886e38


def check_key_ranges(key_ranges, batch, keys, op="flash_decode"):
    """Raise ValueError (naming ``op``) unless ``key_ranges`` is None or one (start, end) per batch row
    within the keys."""
    if key_ranges is None:
        return
    if len(key_ranges) != batch or any(not 0 <= start <= end <= keys for start, end in key_ranges):
        raise ValueError(
            f"{op}: key_ranges must be one (start, end) with 0 <= start <= end <= {keys} per batch row "
            f"({batch}), got {tuple(key_ranges)}"
        )


def check_shapes(q_shape, k_shape, v_shape):
    """Raise ValueError naming the op, the shape and the limit for shapes the decode kernel cannot take."""
    if len(q_shape) != 4 or len(k_shape) != 4 or tuple(k_shape) != tuple(v_shape):
        raise ValueError(
            f"flash_decode: q, k, v must be 4-D [B, H, S, D] with k and v alike, got {q_shape}, {k_shape}, {v_shape}"
        )
    b, h, sq, d = q_shape
    kb, hkv, sk, kd = k_shape
    if kb != b or kd != d or hkv < 1 or h % hkv:
        raise ValueError(
            f"flash_decode: q {tuple(q_shape)} does not fit k {tuple(k_shape)} (same B and D, H % Hkv == 0)"
        )
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"flash_decode: head_dim {d} is outside the supported 1..{MAX_HEAD_DIM}")
    if (h // hkv) * sq > MAX_GROUP_ROWS:
        raise ValueError(
            f"flash_decode: {h // hkv} query heads per KV head x {sq} queries = {(h // hkv) * sq} rows, above "
            f"the limit of {MAX_GROUP_ROWS}"
        )
    if sq < 1 or sk < 1 or b < 1:
        raise ValueError(f"flash_decode: empty input: q {tuple(q_shape)}, k {tuple(k_shape)}")


def _bank_blocks(rows):
    """128-key blocks of S^T [keys, rows] one PSUM bank holds."""
    return max(1, SCORE_BANK_COLUMNS // rows)


def keys_per_partition(head_dim, element_bytes, rows):
    """T, the consecutive keys each partition holds in a chunk: CHUNK_BYTES of K, and S^T for the
    group's ``rows`` within SCORE_BANKS PSUM banks."""
    return max(1, min(CHUNK_BYTES // (head_dim * element_bytes), SCORE_BANKS * _bank_blocks(rows)))


def fits_resident(planned, k, kv_heads, rows):
    """Whether the planned chunks' ``(k0, partitions, T)`` keys of every KV head (K, [V | 1] and the
    probabilities P^T of ``rows`` query rows) fit in an SBUF partition less SBUF_RESERVE; ``k`` is the
    cache (head dim last)."""
    item = itemsize(k.dtype)
    per_key = kv_heads * ((2 * k.shape[-1] + 1) * item + rows * item)
    return sum(t for _, _, t in planned) * per_key <= nl.tile_size.sbuf_fmax_bytes - SBUF_RESERVE


def _values_with_ones(shape, dtype):
    """An SBUF tile for V, ``shape[-1]`` = D + 1, whose last column GpSimd sets to ones: [P V | rowsum P]
    then comes out of one matmul."""
    values = nl.ndarray(shape, dtype, buffer=nl.sbuf)
    ones = (slice(None),) * (len(shape) - 1) + (slice(shape[-1] - 1, shape[-1]),)
    nisa.memset(dst=values[ones], value=1.0, engine=nisa.engine.gpsimd)
    return values


def _pieces(blocks, pieces):
    """(first block, blocks) of each of up to ``pieces`` gathers over ``blocks`` consecutive key blocks."""
    return list(tiles(blocks, ceil_div(blocks, pieces)))


def chunk_plan(first, end, per_partition):
    """(k0, partitions, T) chunks covering keys [first, end): full chunks of P x T keys, then the rest
    as whole 128-key rows, then one partial row of single keys."""
    chunks = []
    k0 = first
    while end - k0 >= P:
        t = min(per_partition, (end - k0) // P)
        chunks.append((k0, P, t))
        k0 += P * t
    if end > k0:
        chunks.append((k0, end - k0, 1))
    return chunks


def aligned_chunk_plan(first, end, per_partition):
    """As ``chunk_plan``, but every chunk's T divides ``per_partition`` (a power of two) and its first
    key is a multiple of T, so that a partition's T keys never straddle two blocks of a paged cache.
    A first key off the grid of the widest chunk the keys can fill (a window's start) first gets a
    chunk of the single keys up to it: without it every later chunk would start off that grid too (an
    odd first key: one key per partition throughout)."""
    chunks = []
    k0 = first
    widest = per_partition
    while widest > 1 and end - first < P * widest:
        widest //= 2
    lead = -first % widest
    if lead and end - first - lead >= P:
        chunks.append((first, lead, 1))
        k0 += lead
    while end - k0 >= P:
        t = min(per_partition, k0 & -k0) if k0 else per_partition  # the largest power of two dividing k0
        while t > 1 and end - k0 < P * t:
            t //= 2
        chunks.append((k0, P, t))
        k0 += P * t
    if end > k0:
        chunks.append((k0, end - k0, 1))
    return chunks


def value_buffers(kv_heads):
    """V buffers a paged cache's ring needs: the pipeline runs up to _LEAD chunks (each one KV head's)
    ahead of the last stage, and each shared load prefetches the next, so a buffer is written again
    only after every KV head's chunk of its previous keys has run."""
    return 2 + ceil_div(_LEAD + 1, kv_heads)


def _paged_slot_bytes(kv_heads, head_dim, element_bytes):
    """SBUF bytes per partition the paged cache's loads in flight take per key a partition holds: up to
    PAGED_KEY_LOADS K tiles and the ring of V buffers, a slot of every KV head each."""
    keys = PAGED_KEY_LOADS * kv_heads * head_dim * element_bytes
    return keys + value_buffers(kv_heads) * kv_heads * (head_dim + 1) * element_bytes


def paged_fits(kv_heads, head_dim, element_bytes, sbuf_bytes=SMALLEST_SBUF_BYTES):
    """Whether the paged kernel's loads fit an SBUF partition of ``sbuf_bytes`` (less SBUF_RESERVE) with
    one key per partition, its smallest chunk (by default on the smallest target's SBUF)."""
    return _paged_slot_bytes(kv_heads, head_dim, element_bytes) <= sbuf_bytes - SBUF_RESERVE


def paged_keys_per_partition(block_size, kv_heads, head_dim, element_bytes, rows, sbuf_bytes):
    """T for a paged cache: a power of two dividing ``block_size``, with S^T within SCORE_BANKS PSUM
    banks, and the loads in flight (``_paged_slot_bytes``) within the SBUF partition (``sbuf_bytes``)
    less SBUF_RESERVE."""
    t = block_size & -block_size
    slot_bytes = _paged_slot_bytes(kv_heads, head_dim, element_bytes)
    while t > 1 and (t * slot_bytes > sbuf_bytes - SBUF_RESERVE or t > SCORE_BANKS * _bank_blocks(rows)):
        t //= 2
    return t


def check_paged(k_shape, v_shape, table_shape, block_size, lengths, batch):
    """Raise ValueError naming the argument, the value and the limit for a paged cache the kernel cannot take."""
    if len(k_shape) != 3 or tuple(k_shape) != tuple(v_shape):
        raise ValueError(
            f"flash_decode_paged: k_slots and v_slots must be [slots, Hkv, D] alike, got {k_shape}, {v_shape}"
        )
    if block_size < 1 or k_shape[0] % block_size:
        raise ValueError(f"flash_decode_paged: block_size {block_size} does not divide the {k_shape[0]} slots")
    if k_shape[0] > MAX_PAGED_SLOTS:
        raise ValueError(
            f"flash_decode_paged: {k_shape[0]} cache slots, above the limit of {MAX_PAGED_SLOTS} (slot "
            "indices are computed on chip in fp32, exact up to 2**24)"
        )
    if len(table_shape) != 2 or table_shape[0] != batch:
        raise ValueError(f"flash_decode_paged: block_table must be [batch={batch}, max_blocks], got {table_shape}")
    capacity = table_shape[1] * block_size
    if len(lengths) != batch or any(not 0 <= n <= capacity for n in lengths):
        raise ValueError(
            f"flash_decode_paged: lengths must be one per batch row ({batch}), each 0..{capacity} (the block "
            f"table's {table_shape[1]} blocks of {block_size}), got {tuple(lengths)}"
        )


class _Group(nl.NKIObject):
    """One (batch, KV head): Q^T, the running max (one column per row) and the running [P V | rowsum P]."""

    def __init__(self, q, b, g, group, scale, softcap):
        sq, d = q.shape[2], q.shape[3]
        self.b, self.g, self.group, self.sq, self.d = b, g, group, sq, d
        self.rows = group * sq
        self.exp_scale = softcap if softcap else scale
        self.scale, self.softcap, self.dtype = scale, softcap, q.dtype
        self.q = q
        self.q_t = None  # Q^T, one [<= 128, rows] tile per 128-row block of D
        self.run_max = None  # [rows, 1] fp32, in logit units (exp_scale * logit is the exponent)
        self.weights = None  # the running state's and the chunk's weights, from weigh to accumulate
        self.acc = None  # [rows, D + 1] fp32

    def load_queries(self):
        """Q^T [D, rows] as one SBUF tile per 128-row block of D: the group's query heads are consecutive
        in q, so its rows are one [rows, D] block."""
        rows, d = self.rows, self.d
        src = self.q[self.b, self.g * self.group : (self.g + 1) * self.group, :, :].reshape((rows, d))
        q_rows = nl.ndarray((rows, d), self.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=q_rows, src=src)
        self.q_t = []
        for d0, dc in tiles(d, P):
            flipped = nl.ndarray((dc, rows), self.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=flipped, data=q_rows[:, d0 : d0 + dc])
            block = nl.ndarray((dc, rows), self.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=block, src=flipped)
            self.q_t.append(block)

    def weigh(self, chunk_max):
        """The new running max, and the weights of the running state and of the chunk (for ``accumulate``)."""
        rows = self.rows
        if self.run_max is None:
            self.run_max = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=self.run_max, src=chunk_max)
            return
        new_max = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=new_max, data1=self.run_max, data2=chunk_max, op=nl.maximum)
        neg_new = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(
            dst=neg_new, data=new_max, op0=nl.multiply, operand0=-self.exp_scale, engine=nisa.engine.gpsimd
        )
        old_weight = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=old_weight, op=nl.exp, data=self.run_max, scale=self.exp_scale, bias=neg_new)
        chunk_weight = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=chunk_weight, op=nl.exp, data=chunk_max, scale=self.exp_scale, bias=neg_new)
        self.weights = (old_weight, chunk_weight)
        self.run_max = new_max

    def accumulate(self, pv):
        """acc = acc * (the running state's weight) + pv * (the chunk's), or pv for the first chunk."""
        if self.acc is None:
            self.acc = nl.ndarray((self.rows, self.d + 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=self.acc, src=pv)
            return
        old_weight, chunk_weight = self.weights
        # The running state's rescale needs only the weights, so GpSimd does it ahead; after P V only
        # one VectorE instruction remains per KV head (the last merges of a layer's eight KV heads ran
        # one after another on VectorE, at two instructions each).
        gpsimd = nisa.engine.gpsimd
        nisa.tensor_scalar(dst=self.acc, data=self.acc, op0=nl.multiply, operand0=old_weight, engine=gpsimd)
        nisa.scalar_tensor_tensor(
            dst=self.acc, data=pv, op0=nl.multiply, operand0=chunk_weight, op1=nl.add, operand1=self.acc
        )
        self.weights = None

    def finish(self, out, lse_out):
        """out = acc / rowsum (zero for a row that saw no key), lse = exp_scale * max + log(rowsum)."""
        rows, d = self.rows, self.d
        gpsimd = nisa.engine.gpsimd
        heads = slice(self.g * self.group, (self.g + 1) * self.group)
        result = nl.ndarray((rows, d), self.dtype, buffer=nl.sbuf)
        lse = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        if self.acc is None:  # an empty key range: no key to see
            nisa.memset(dst=result, value=0.0, engine=gpsimd)
            nisa.memset(dst=lse, value=MASKED_LOGIT_FLOOR, engine=gpsimd)
        else:
            safe_sum = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=safe_sum, data=self.acc[:, d : d + 1], op0=nl.maximum, operand0=1e-30, engine=gpsimd)
            nisa.tensor_scalar(dst=result, data=self.acc[:, 0:d], op0=nl.divide, operand0=safe_sum, engine=gpsimd)
            nisa.activation(dst=lse, op=nl.log, data=safe_sum)
            nisa.scalar_tensor_tensor(
                dst=lse, data=self.run_max, op0=nl.multiply, operand0=self.exp_scale, op1=nl.add, operand1=lse
            )
        nisa.dma_copy(dst=out[self.b, heads, :, :].reshape((rows, d)), src=result)
        nisa.dma_copy(dst=lse_out[self.b, heads, :].reshape((rows, 1)), src=lse)
        self.q_t = self.acc = self.run_max = None


class _Common(nl.NKIObject):
    """What the chunks share: the matmul operands (ones rows, in the probabilities' dtype and fp32, that
    broadcast a row to every partition, and -1 / 1 that turn a row into a column) and whose turn the
    next K^T copy out of PSUM is."""

    def __init__(self, dtype):
        gpsimd = nisa.engine.gpsimd
        self.ones = nl.ndarray((1, P), dtype, buffer=nl.sbuf)
        nisa.memset(dst=self.ones, value=1.0, engine=gpsimd)
        self.minus_one = nl.ndarray((1, 1), dtype, buffer=nl.sbuf)
        nisa.memset(dst=self.minus_one, value=-1.0, engine=gpsimd)
        self.ones_fp32 = nl.ndarray((1, P), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=self.ones_fp32, value=1.0, engine=gpsimd)
        self.one_fp32 = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=self.one_fp32, value=1.0, engine=gpsimd)
        self.key_copies = 0  # K^T copies out of PSUM issued so far

    def next_key_copy_on_scalar(self, rows):
        """Whether the next K^T copy out of PSUM goes to ScalarE (else VectorE): every other one, or
        two of every three from SHIFT_MIN_ROWS rows. There VectorE reads each score once (the max)
        at 0.96 GHz and ScalarE once (the exp) at 1.2 GHz, so with the copies alternating VectorE
        bounds the keys' work (a Mistral-7B 16-query layer, resident: VectorE 46.4 us busy, ScalarE
        29.4 us, 65.2 us modelled; two of three: 40.0 and 34.6 us busy, 59.8 us)."""
        self.key_copies += 1
        return self.key_copies % 3 != 0 if rows >= SHIFT_MIN_ROWS else self.key_copies % 2 == 0


class _DenseCache(nl.NKIObject):
    """K/V [B, Hkv, Sk, D]: each chunk loads its own KV head's keys, one contiguous run per partition."""

    shares_loads = False

    def __init__(self, k, v):
        self.k, self.v = k, v
        self.resident = False  # every load has buffers of its own (reserve)

    def plan(self, first, end, per_partition):
        return chunk_plan(first, end, per_partition)

    def reserve(self, planned, kv_heads, rows):
        """Resident (as ``_PagedCache.reserve``) when every KV head's loads of every planned chunk and
        their probabilities fit in SBUF at once; otherwise each chunk loads its keys in its load stage."""
        self.resident = fits_resident(planned, self.k, kv_heads, rows)

    def head_source(self, b, g, k0, parts, per_partition):
        """What one KV head's chunk loads from: buffers of its own when resident, else the cache itself."""
        return _DenseLoad(self, b, g, k0, parts, per_partition) if self.resident else self

    def prepare(self):
        """Nothing to compute ahead: the chunks' addresses are static."""

    def issue_loads(self, sources):
        """Resident: every K load, then every V load (a chunk's keys' work needs only its K)."""
        if self.resident:
            _issue_resident_loads(sources, 1)

    def take(self, chunk):
        """Per key block t: K [parts, D] and [V | 1] [parts, D + 1] of the chunk's keys."""
        group, parts, t, d = chunk.group, chunk.parts, chunk.t, chunk.group.d
        span = slice(chunk.k0, chunk.k0 + parts * t)
        keys = nl.ndarray((parts, t, d), self.k.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=keys, src=self.k[group.b, group.g, span, :].reshape((parts, t, d)))
        # The ones column first: GpSimd runs its queue in order, and a memset issued behind the load
        # would hold up everything GpSimd does for earlier chunks until the load lands.
        values = _values_with_ones((parts, t, d + 1), self.v.dtype)
        nisa.dma_copy(dst=values[:, :, 0:d], src=self.v[group.b, group.g, span, :].reshape((parts, t, d)))
        return [keys[:, j, :] for j in range(t)], [values[:, j, :] for j in range(t)]


class _DenseLoad(nl.NKIObject):
    """One KV head's keys ``k0 + p*T + t`` of a contiguous cache in buffers of their own (a resident
    load): K, and V beside a ones column set when the buffer is made."""

    def __init__(self, cache, b, g, k0, parts, per_partition):
        self.cache, self.b, self.g, self.k0, self.parts, self.t = cache, b, g, k0, parts, per_partition
        d = cache.k.shape[3]
        self.keys = nl.ndarray((parts, per_partition, d), cache.k.dtype, buffer=nl.sbuf)
        self.values = _values_with_ones((parts, per_partition, d + 1), cache.v.dtype)
        self.loaded = False
        self.value_pieces = None

    def prepare(self):
        """Nothing to compute ahead: the addresses are static."""

    def _span(self, tensor):
        span = slice(self.k0, self.k0 + self.parts * self.t)
        return tensor[self.b, self.g, span, :].reshape((self.parts, self.t, tensor.shape[3]))

    def load_keys(self, pieces=1):
        source = self._span(self.cache.k)
        for j0, jc in _pieces(self.t, pieces):
            nisa.dma_copy(dst=self.keys[:, j0 : j0 + jc, :], src=source[:, j0 : j0 + jc, :])

    def load_values(self, pieces=1):
        d = self.cache.v.shape[3]
        self.value_pieces = _pieces(self.t, pieces)
        source = self._span(self.cache.v)
        for j0, jc in self.value_pieces:
            nisa.dma_copy(dst=self.values[:, j0 : j0 + jc, 0:d], src=source[:, j0 : j0 + jc, :])

    def take(self, chunk):
        keys, values = self.keys, self.values
        self.keys = self.values = None
        return [keys[:, j, :] for j in range(self.t)], [values[:, j, :] for j in range(self.t)]


def _issue_resident_loads(sources, pieces):
    """Every K load, then every V load, each in ``pieces`` transfers of consecutive key blocks, each
    load once though several chunks may name it."""
    loads = []
    for source in sources:
        if not source.loaded:
            source.loaded = True
            loads.append(source)
    for source in loads:
        source.load_keys(pieces)
    for source in loads:
        source.load_values(pieces)


class _PagedBlocks(nl.NKIObject):
    """Keys ``k0 + p*T + t`` of one sequence, every KV head, gathered from a paged cache: loaded once by
    the first KV head's chunk and shared by the others (a slot holds all KV heads, so reading them
    together keeps each partition's run contiguous: T slots x Hkv x D elements).

    The physical slot of partition p's first key comes from the block table on chip. When each
    partition holds one whole block (T = block_size), the table's entries land one per partition and a
    multiply by block_size makes them slots. Otherwise the entries for the chunk's blocks, as
    ``(block - logical block) * block_size`` shifts, are broadcast to every partition by a ones-row
    matmul; two ``affine_select``s keep, per partition, only the entry of the block its keys fall in;
    a row sum picks it, plus the key index (``iota``). Gather DMAs (``vector_offset``) then read T
    whole slots per partition, one for K and one for V, or, issued up front for resident loads
    (``_PagedCache.issue_loads``), a few each; otherwise the first chunk to take them issues them."""

    def __init__(self, cache, b, k0, parts, per_partition, kv_heads, common):
        self.cache, self.b, self.k0, self.parts, self.t = cache, b, k0, parts, per_partition
        self.takers, self.common = kv_heads, common
        self.keys = self.values = None
        self.loaded = False
        self.index = None  # [parts, 1] int32 physical slots (prepare)
        self.value_buffer = None  # the buffer V lands in (_PagedCache.chunk_source)
        self.value_pieces = None  # (first block, blocks) of each V gather
        self.next = None  # the next shared load, prefetched when this one starts

    def prepare(self):
        """The physical slot of each partition's first key, once for the KV heads' chunks."""
        if self.index is None:
            self.index = self._slots()

    def _slots(self):
        """[parts, 1] int32: the physical slot of each partition's first key."""
        cache, parts, t, k0 = self.cache, self.parts, self.t, self.k0
        size = cache.block_size
        gpsimd = nisa.engine.gpsimd
        first, last = k0 // size, (k0 + parts * t - 1) // size
        if t == size:  # partition p's keys are block first + p, whole: its slot is the block's first
            entries = nl.ndarray((parts, 1), nl.int32, buffer=nl.sbuf)
            nisa.dma_copy(dst=entries, src=cache.block_table[self.b, first : last + 1].reshape((parts, 1)))
            index = nl.ndarray((parts, 1), nl.int32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=index, data=entries, op0=nl.multiply, operand0=float(size), engine=gpsimd)
            return index
        blocks = last - first + 1
        table = nl.ndarray((1, blocks), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=table, src=cache.block_table[self.b, first : last + 1].reshape((1, blocks)))
        shift = nl.ndarray((1, blocks), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=shift, src=table, engine=gpsimd)
        logical = nl.ndarray((1, blocks), nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=logical, pattern=[[size, blocks]], offset=first * size)
        nisa.scalar_tensor_tensor(
            dst=shift, data=shift, op0=nl.multiply, operand0=float(size), op1=nl.subtract, operand1=logical
        )
        spread_psum = nl.ndarray((parts, blocks), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=spread_psum, stationary=self.common.ones_fp32[:, 0:parts], moving=shift)
        spread = nl.ndarray((parts, blocks), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=spread, op=nl.copy, data=spread_psum)
        # keep block e of partition p where (first + e) * size <= k0 + p*T < (first + e + 1) * size
        nisa.affine_select(
            dst=spread,
            pattern=[[-size, blocks]],
            channel_multiplier=t,
            on_true_tile=spread,
            on_false_value=0.0,
            cmp_op=nl.greater_equal,
            offset=k0 - first * size,
        )
        nisa.affine_select(
            dst=spread,
            pattern=[[size, blocks]],
            channel_multiplier=-t,
            on_true_tile=spread,
            on_false_value=0.0,
            cmp_op=nl.greater_equal,
            offset=(first + 1) * size - 1 - k0,
        )
        slot = nl.ndarray((parts, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=slot, op=nl.add, data=spread, axis=1)
        key = nl.ndarray((parts, 1), nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=key, pattern=[[0, 1]], offset=k0, channel_multiplier=t)
        nisa.tensor_tensor(dst=slot, data1=slot, data2=key, op=nl.add, engine=gpsimd)
        index = nl.ndarray((parts, 1), nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=index, src=slot, engine=gpsimd)
        return index

    def load_keys(self, pieces=1):
        """Gather K: T whole slots (every KV head) per partition, in ``pieces`` gathers of consecutive
        key blocks, so the transposes may start on the first to land."""
        cache, parts, t = self.cache, self.parts, self.t
        kv_heads, d = cache.k.shape[1], cache.k.shape[2]
        row = kv_heads * d
        self.keys = nl.ndarray((parts, t, kv_heads, d), cache.k.dtype, buffer=nl.sbuf)
        for j0, jc in _pieces(t, pieces):
            src = cache.k.ap(
                pattern=[[row, parts], [1, jc * row]], offset=j0 * row, vector_offset=self.index, indirect_dim=0
            )
            cache.order_gather(nisa.dma_copy(dst=self.keys[:, j0 : j0 + jc, :, :], src=src))

    def load_values(self, pieces=1):
        """Gather V into its buffer, beside the ones columns set when the buffer was made: ``pieces``
        gathers of consecutive key blocks (``value_pieces``), so P V may start on the first to land."""
        cache, parts, t = self.cache, self.parts, self.t
        kv_heads, d = cache.k.shape[1], cache.k.shape[2]
        row = kv_heads * d
        self.values = self.value_buffer[0:parts, 0:t, :, :]
        self.value_pieces = _pieces(t, pieces)
        for j0, jc in self.value_pieces:
            src = cache.v.ap(
                pattern=[[row, parts], [d, jc * kv_heads], [1, d]],
                offset=j0 * row,
                vector_offset=self.index,
                indirect_dim=0,
            )
            cache.order_gather(nisa.dma_copy(dst=self.values[:, j0 : j0 + jc, :, 0:d], src=src))

    def load(self):
        """K then V, once for the KV heads' chunks."""
        if not self.loaded:
            self.loaded = True
            self.load_keys()
            self.load_values()

    def take(self, chunk):
        """The chunk's KV head's K and V per key block (the last KV head to take them frees them)."""
        self.load()
        if self.next is not None:
            self.next.load()
        g, t = chunk.group.g, self.t
        keys, values = [self.keys[:, j, g, :] for j in range(t)], [self.values[:, j, g, :] for j in range(t)]
        self.takers -= 1
        if self.takers == 0:
            self.keys = self.values = None
        return keys, values


class _PagedCache(nl.NKIObject):
    """A paged KV cache: K/V slots [blocks * block_size, Hkv, D] and the block table [B, max_blocks]."""

    shares_loads = True

    def __init__(self, k, v, block_table, block_size, per_partition):
        self.k, self.v, self.block_table, self.block_size = k, v, block_table, block_size
        self.per_partition = per_partition
        self.resident = False  # every load has buffers of its own (reserve)
        self.value_ring = []
        self.loads = 0
        self.gathers = []  # the gather DMAs issued so far

    def reserve(self, planned, kv_heads, rows):
        """Decide where the loads land (``resident``).

        Resident, when every planned load and every chunk's probabilities fit in SBUF at once (a short
        batch): each load gets buffers of its own, every K gather is issued before every V gather
        (``issue_loads``), each in RESIDENT_LOAD_PIECES gathers, and ``_attend`` runs every chunk's keys'
        work (transposes, scores, softmax) while the values stream in, then P V load by load. Otherwise
        V lands in a ring of buffers (``value_buffers``) whose ones columns are set once, here (a
        memset per load would wait for GpSimd's queue), and each load starts the next, a chunk ahead."""
        self.resident = fits_resident(planned, self.k, kv_heads, rows)
        if self.resident:
            return
        d = self.k.shape[2]
        for _ in range(value_buffers(kv_heads)):
            self.value_ring.append(_values_with_ones((P, self.per_partition, kv_heads, d + 1), self.v.dtype))

    def plan(self, first, end, per_partition):
        return aligned_chunk_plan(first, end, per_partition)

    def chunk_source(self, b, k0, parts, per_partition, kv_heads, common):
        blocks = _PagedBlocks(self, b, k0, parts, per_partition, kv_heads, common)
        if self.resident:
            d = self.k.shape[2]
            blocks.value_buffer = _values_with_ones((parts, per_partition, kv_heads, d + 1), self.v.dtype)
        else:
            blocks.value_buffer = self.value_ring[self.loads % len(self.value_ring)]
        self.loads += 1
        return blocks

    def issue_loads(self, sources):
        """Resident: every K gather, then every V gather (a chunk's keys' work needs only its K)."""
        if self.resident:
            _issue_resident_loads(sources, RESIDENT_LOAD_PIECES)

    def order_gather(self, gather):
        """Keep the gathers' transfers in issue order, two in flight (one's fixed latency passes while
        the other moves data): a gather starts once the one issued two before it has landed. Left
        free, every gather is ready at once and the bandwidth goes to whichever can start first, which
        may be a later chunk's keys while the chunk in use still waits for its values."""
        if len(self.gathers) >= 2:
            gather.depends_on(self.gathers[-2])
        self.gathers.append(gather)


class _Chunk(nl.NKIObject):
    """Keys ``k0 + p*T + t`` (p < parts, t < T) of one group, on their way through the pipeline stages;
    each stage drops what no later stage reads."""

    def __init__(self, group, k0, parts, per_partition, causal_cut, window_cut, common, source):
        self.group, self.k0, self.parts, self.t = group, k0, parts, per_partition
        # the masks it crosses: the causal offset (query i sees keys <= i + offset) and the window's
        # lowest key (query i sees keys >= i + lowest), or None
        self.causal_cut, self.window_cut = causal_cut, window_cut
        self.common = common
        self.source = source  # _DenseCache (streaming), _DenseLoad (resident) or the _PagedBlocks it gathered into
        self.keys = self.values = self.keys_t = self.logits = self.probs = self.banks = self.pv = None
        self.row_max = None  # [1, rows] fp32, from max_scores to softmax
        self.last = False  # the group's last chunk
        self.query_groups = []  # groups whose queries this chunk's load stage loads (before its keys)

    def load(self):
        """The queries of ``query_groups`` first; then this chunk's K [parts, D] and [V | 1] [parts, D + 1]
        per key block, as views of what the source loaded."""
        for group in self.query_groups:
            group.load_queries()
        self.keys, self.values = self.source.take(self)
        self.source = None

    def transpose_keys(self):
        """K^T [D, T * parts] (block t at columns t*parts..), one SBUF tile per 128-row block of D:
        TensorE transposes, copied out by VectorE and ScalarE."""
        parts, t, d, dtype = self.parts, self.t, self.group.d, self.group.dtype
        blocks = list(tiles(d, P))
        self.keys_t = [nl.ndarray((dc, t * parts), dtype, buffer=nl.sbuf) for _, dc in blocks]
        for t0, tc in tiles(t, TRANSPOSE_GROUP):  # key blocks outermost: the scores need every block of D
            for keys_t, (d0, dc) in zip(self.keys_t, blocks):
                flipped = nl.ndarray((dc, tc * parts), dtype, buffer=nl.psum)
                for j in range(tc):
                    nisa.nc_transpose(
                        dst=flipped[:, j * parts : (j + 1) * parts], data=self.keys[t0 + j][:, d0 : d0 + dc]
                    )
                columns = keys_t[:, t0 * parts : (t0 + tc) * parts]
                if self.common.next_key_copy_on_scalar(self.group.rows):
                    nisa.activation(dst=columns, op=nl.copy, data=flipped)
                else:
                    nisa.tensor_copy(dst=columns, src=flipped)
        self.keys = None

    def scores(self):
        """S^T [parts, T, rows] = K Q^T in PSUM, one bank per ``_bank_blocks`` key blocks (a matmul per
        128-row block of D, accumulating); softcapped and masked where needed (then into SBUF)."""
        group, parts, t, rows = self.group, self.parts, self.t, self.group.rows
        per_bank = _bank_blocks(rows)
        self.banks = []
        for j0, jc in tiles(t, per_bank):
            bank = nl.ndarray((parts, jc, rows), nl.float32, buffer=nl.psum)
            for j in range(jc):
                columns = slice((j0 + j) * parts, (j0 + j + 1) * parts)
                for keys_t, q_t in zip(self.keys_t, group.q_t):
                    nisa.nc_matmul(dst=bank[:, j, :], stationary=keys_t[:, columns], moving=q_t)
            self.banks.append((j0, jc, bank))
        self.keys_t = None
        masked = self.causal_cut is not None or self.window_cut is not None
        self.logits = None
        if not (group.softcap or masked):
            return
        logits = nl.ndarray((parts, t, rows), nl.float32, buffer=nl.sbuf)
        for j0, jc, bank in self.banks:
            if group.softcap:
                nisa.activation(
                    dst=logits[:, j0 : j0 + jc, :], op=nl.tanh, data=bank, scale=group.scale / group.softcap
                )
            else:
                nisa.tensor_copy(dst=logits[:, j0 : j0 + jc, :], src=bank)
        self.banks = None
        # affine(p, t, h, i) over the free order (t, h, i): h (the query head) never matters.
        sq, heads = group.sq, group.group
        if self.causal_cut is not None:  # keep key <= i + offset: (offset - k0) - p*T - t + i >= 0
            nisa.affine_select(
                dst=logits,
                pattern=[[-1, t], [0, heads], [1, sq]],
                channel_multiplier=-t,
                on_true_tile=logits,
                on_false_value=FP32_MIN,
                cmp_op=nl.greater_equal,
                offset=self.causal_cut - self.k0,
            )
        if self.window_cut is not None:  # keep key >= i + lowest: (k0 - lowest) + p*T + t - i >= 0
            nisa.affine_select(
                dst=logits,
                pattern=[[1, t], [0, heads], [-1, sq]],
                channel_multiplier=t,
                on_true_tile=logits,
                on_false_value=FP32_MIN,
                cmp_op=nl.greater_equal,
                offset=self.k0 - self.window_cut,
            )
        self.logits = logits

    def _row_max(self, sources):
        """The chunk's max per row as one [1, rows] row: VectorE reduces each partition's keys of each
        source, GpSimd reduces across the partitions, floored so that a row seeing no key of the chunk
        keeps a finite max (its probabilities are then 0)."""
        parts, rows = self.parts, self.group.rows
        lane_max = nl.ndarray((parts, rows), nl.float32, buffer=nl.sbuf)
        for n, source in enumerate(sources):
            if n == 0:
                nisa.tensor_reduce(dst=lane_max, op=nl.maximum, data=source.permute((0, 2, 1)), axis=2)
            else:
                partial = nl.ndarray((parts, rows), nl.float32, buffer=nl.sbuf)
                nisa.tensor_reduce(dst=partial, op=nl.maximum, data=source.permute((0, 2, 1)), axis=2)
                nisa.tensor_tensor(dst=lane_max, data1=lane_max, data2=partial, op=nl.maximum)
        row_max = nl.ndarray((1, rows), nl.float32, buffer=nl.sbuf)
        nisa.tensor_partition_reduce(dst=row_max, op=nl.maximum, data=lane_max)
        nisa.tensor_scalar(
            dst=row_max,
            data=row_max,
            op0=nl.maximum,
            operand0=MASKED_LOGIT_FLOOR / self.group.exp_scale,
            engine=nisa.engine.gpsimd,
        )
        return row_max

    def _gathered_banks(self):
        """The PSUM banks' scores in one SBUF tile (for the VectorE subtract, which reads one PSUM input)."""
        logits = nl.ndarray((self.parts, self.t, self.group.rows), nl.float32, buffer=nl.sbuf)
        for j0, jc, bank in self.banks:
            nisa.activation(dst=logits[:, j0 : j0 + jc, :], op=nl.copy, data=bank)
        return logits

    def max_scores(self):
        """The chunk's max per row (``_row_max``), for ``softmax``; scores that VectorE will subtract
        the max from (few rows, or masked or softcapped) are gathered into one tile first."""
        if self.logits is None and self.group.rows >= SHIFT_MIN_ROWS:
            self.row_max = self._row_max([bank for _, _, bank in self.banks])
            return
        if self.logits is None:  # few rows: subtracting on VectorE is cheaper than the rank-1 updates
            self.logits = self.banks[0][2] if len(self.banks) == 1 else self._gathered_banks()
            self.banks = None
        self.row_max = self._row_max([self.logits])

    def softmax(self):
        """P^T = exp(exp_scale * (S^T - max)) with the chunk's max per row, and that max as a column.

        Scores still in PSUM get the max subtracted by TensorE: a ones-row matmul accumulates -max onto
        every block (a rank-1 update), so ScalarE exponentiates straight from PSUM and VectorE touches
        each score once, for the max. The max is rounded to the probabilities' dtype first, so the
        column the merge weighs the chunk by is exactly the value subtracted. Softcapped or masked
        scores (in SBUF), and those of fewer than SHIFT_MIN_ROWS rows, get it broadcast by a ones-row
        matmul and subtracted on VectorE."""
        group, parts, t, rows = self.group, self.parts, self.t, self.group.rows
        row_max, self.row_max = self.row_max, None
        self.probs = nl.ndarray((parts, t, rows), group.dtype, buffer=nl.sbuf)
        column = nl.ndarray((rows, 1), nl.float32, buffer=nl.psum)  # the max, one row per partition
        if self.logits is None and rows >= SHIFT_MIN_ROWS:
            negated = nl.ndarray((1, rows), group.dtype, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=negated, data=row_max, op0=nl.multiply, operand0=-1.0, engine=nisa.engine.gpsimd)
            for j0, jc, bank in self.banks:
                for j in range(jc):
                    nisa.nc_matmul(
                        dst=bank[:, j, :],
                        stationary=self.common.ones[:, 0:parts],
                        moving=negated,
                        is_stationary_onezero=True,
                        accumulate=True,
                    )
                nisa.activation(dst=self.probs[:, j0 : j0 + jc, :], op=nl.exp, data=bank, scale=group.exp_scale)
            nisa.nc_matmul(dst=column, stationary=negated, moving=self.common.minus_one)
            self.banks = None
        else:
            spread_psum = nl.ndarray((parts, rows), nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=spread_psum, stationary=self.common.ones_fp32[:, 0:parts], moving=row_max)
            spread = nl.ndarray((parts, rows), nl.float32, buffer=nl.sbuf)  # VectorE reads one PSUM input at most
            nisa.activation(dst=spread, op=nl.copy, data=spread_psum)
            shifted = nl.ndarray((parts, t, rows), nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(
                dst=shifted, data1=self.logits, data2=spread.expand_dims(1).broadcast(1, t), op=nl.subtract
            )
            self.logits = None
            nisa.activation(dst=self.probs, op=nl.exp, data=shifted, scale=group.exp_scale)
            nisa.nc_matmul(dst=column, stationary=row_max, moving=self.common.one_fp32)
        self.max_column = column

    def multiply_values(self):
        """[P V | rowsum P] over the chunk's T blocks in one PSUM bank, merged into the group's state."""
        self.multiply_blocks(0, self.t)
        self.weigh()
        self.fold()

    def multiply_blocks(self, first, end):
        """Accumulate [P V | rowsum P] of key blocks first..end-1 (the first call makes the PSUM tile)."""
        if self.pv is None:
            self.pv = nl.ndarray((self.group.rows, self.group.d + 1), nl.float32, buffer=nl.psum)
        for j in range(first, end):
            nisa.nc_matmul(dst=self.pv, stationary=self.probs[:, j, :], moving=self.values[j])

    def weigh(self):
        """The group's new running max and the weights of its state and of this chunk."""
        self.group.weigh(self.max_column)
        self.max_column = None

    def fold(self):
        """Fold the accumulated [P V | rowsum P] into the group's state with the weights."""
        self.probs = self.values = None
        self.group.accumulate(self.pv)
        self.pv = None


# (stage, chunks ahead of the last stage): each engine's issue order within a tick.
_STAGES = (
    ("load", 3),
    ("transpose_keys", 2),
    ("scores", 1),
    ("max_scores", 1),
    ("softmax", 1),
    ("multiply_values", 0),
)
_LEAD = max(lead for _, lead in _STAGES)
# With resident loads the keys' stages run alone (P V follows them all), each a chunk apart, so that
# no engine waits within a tick on what another engine does in it: TensorE runs without the stalls
# of the max's chain (VectorE, GpSimd, then TensorE's broadcast) that the stages above leave it. The
# same spacing in _STAGES (load 5 ... multiply_values 0) measured mixed: the Mistral-7B 4-query layer
# 61.3 -> 54.8 us, the contiguous batch 8 377.2 -> 378.6 us and the paged batch 8 411.4 -> 425.2 us.
# Within a tick the softmax and the max come first: their inputs are ready from earlier ticks, whereas
# the K^T copies wait for this tick's transposes. In the opposite order (load, transposes, scores, max,
# softmax) VectorE and ScalarE waited each tick for TensorE's transposes and TensorE for the copies, and
# ScalarE's exp behind its copies held up the next tick's rank-1 updates: the Mistral-7B 16-query
# layer (64 rows) modelled 75.2 us against 59.8 us in this order. With fewer rows the order moves the
# figures by at most 0.2 us (decode-1-of-4096 10.1 -> 10.3 us; the 4- and 16-query single groups
# 10.7 -> 10.5 and 11.4 -> 11.2 us; the layers and the paged cache unchanged).
_RESIDENT_STAGES = (("load", 4), ("softmax", 0), ("max_scores", 1), ("transpose_keys", 3), ("scores", 2))


@nki.jit
def flash_decode_fwd(q, k, v, scale, causal, window, softcap, key_ranges=None):
    """Attention of a few queries per sequence against a KV cache.

    Args:
        q: [B, H, Sq, D]; k, v: [B, Hkv, Sk, D] in HBM (bf16, fp16 or fp32, all one dtype), with
            (H / Hkv) * Sq <= MAX_GROUP_ROWS and D <= MAX_HEAD_DIM.
        scale: softmax scale (Python float).
        causal: bool (aligned bottom-right); window: 0 (none) or keys per query; softcap: 0.0 (none) or the cap.
        key_ranges: None (every row sees its Sk keys), or per batch row the (start, end) of the cache
            positions it holds (ragged lengths, left padding): keys outside are never read, and
            causality and the window align to the range's end, where the row's last query sits.

    IO shapes:
        returns (out [B, H, Sq, D] of q's dtype, lse [B, H, Sq] fp32 log-sum-exp of the scaled logits;
        a row that sees no key gets a zero output and an lse near -1e30), as ``flash_attn_fwd``.
    """
    check_shapes(q.shape, k.shape, v.shape)
    batch, heads, sq, d = q.shape
    kv_heads, sk = k.shape[1], k.shape[2]
    check_key_ranges(key_ranges, batch, sk)
    out = nl.ndarray((batch, heads, sq, d), q.dtype, buffer=nl.shared_hbm)
    lse_out = nl.ndarray((batch, heads, sq), nl.float32, buffer=nl.shared_hbm)
    per_partition = keys_per_partition(d, itemsize(k.dtype), (heads // kv_heads) * sq)
    spans = list(key_ranges) if key_ranges is not None else [(0, sk)] * batch
    _attend(q, scale, causal, window, softcap, kv_heads, spans, per_partition, _DenseCache(k, v), out, lse_out)
    return out, lse_out


@nki.jit
def flash_decode_paged_fwd(q, k_slots, v_slots, block_table, block_size, lengths, scale, causal, window, softcap):
    """``flash_decode_fwd`` against a paged KV cache, read through its block table by gather DMAs.

    Args:
        q: [B, H, Sq, D] in HBM; k_slots, v_slots: the cache's slots [blocks * block_size, Hkv, D]
            (FlashAttention's paged [blocks, block_size, Hkv, D], viewed flat: slot = block *
            block_size + position in the block); block_table: [B, max_blocks] int32, sequence b's
            logical block j is physical block ``block_table[b, j]``.
        block_size: slots per block; lengths: per batch row the cached keys it attends to (positions
            0..length-1, its queries the last Sq of them).
        scale, causal, window, softcap: as for ``flash_decode_fwd``.

    IO shapes:
        as ``flash_decode_fwd``.

    Tiling plan
        As ``flash_decode_fwd``, with T (keys per partition) a power of two dividing block_size, so a
        partition's keys lie in one block (``paged_keys_per_partition``), and each chunk's K and V
        gathered once for all KV heads (``_PagedBlocks``): T x Hkv x D contiguous elements per
        partition, two gathers in flight, in issue order. When every load fits in SBUF at once
        (``_PagedCache.reserve``), every K gather goes before every V gather, each load's K and V in
        pieces of consecutive key blocks, and every chunk's keys' work (``_RESIDENT_STAGES``) runs
        while the values land; then P V, load by load, each V gather's key blocks for every KV head
        before the next's, and the merges step by step across the KV heads, so that little follows
        the last value. Otherwise the next chunk's gathers are
        issued when a chunk's are first used and V lands in a ring of buffers whose ones columns are
        set once.
    """
    batch, heads, sq, d = q.shape
    kv_heads = k_slots.shape[1]
    check_shapes(q.shape, (batch, kv_heads, 1, d), (batch, kv_heads, 1, d))
    check_paged(k_slots.shape, v_slots.shape, block_table.shape, block_size, lengths, batch)
    out = nl.ndarray((batch, heads, sq, d), q.dtype, buffer=nl.shared_hbm)
    lse_out = nl.ndarray((batch, heads, sq), nl.float32, buffer=nl.shared_hbm)
    element_bytes, sbuf_bytes = itemsize(k_slots.dtype), nl.tile_size.sbuf_fmax_bytes
    if not paged_fits(kv_heads, d, element_bytes, sbuf_bytes):
        raise ValueError(
            f"flash_decode_paged: {kv_heads} KV heads x head_dim {d} ({dtype_name(k_slots.dtype)}) need "
            f"{_paged_slot_bytes(kv_heads, d, element_bytes):,} bytes per partition for one key of each load in "
            f"flight, above the {sbuf_bytes - SBUF_RESERVE:,} this target's SBUF leaves them; gather the "
            "blocks and use flash_decode_fwd"
        )
    per_partition = paged_keys_per_partition(
        block_size, kv_heads, d, element_bytes, (heads // kv_heads) * sq, sbuf_bytes
    )
    cache = _PagedCache(k_slots, v_slots, block_table, block_size, per_partition)
    _attend(q, scale, causal, window, softcap, kv_heads, [(0, n) for n in lengths], per_partition, cache, out, lse_out)
    return out, lse_out


def _attend(q, scale, causal, window, softcap, kv_heads, spans, per_partition, sources, out, lse_out):
    """The decode schedule: batch row b attends to keys ``spans[b] = (start, end)``, cut into chunks of
    at most ``per_partition`` keys per partition by ``sources.plan``; ``sources.chunk_source`` gives what a
    chunk's keys load from, shared by the row's KV heads. One ``_Chunk`` per (chunk, KV head), through
    the pipeline."""
    batch, heads, sq, d = q.shape
    group_size = heads // kv_heads
    rows = group_size * sq
    common = _Common(q.dtype)
    plans = []  # per batch row: (offset, its chunks)
    for b in range(batch):
        start, end = spans[b]
        offset = end - sq  # query i sees keys j <= i + offset (causal) and j >= i + offset - window + 1
        lowest = max(start, offset - window + 1) if window else start  # the first key any query sees
        # With many rows, the keys some query may not see (the window's first sq - 1, the causal
        # last sq - 1) get chunks of their own, so that only those few take the masked path.
        edges = {lowest, end}
        if rows >= SHIFT_MIN_ROWS:
            edges |= {min(max(lowest, sq - 1 + offset - window + 1), end)} if window else set()
            edges |= {min(max(lowest, offset + 1), end)} if causal else set()
        edges = sorted(edges)
        planned = [chunk for lo, hi in zip(edges, edges[1:]) for chunk in sources.plan(lo, hi, per_partition)]
        planned = _joined_single_rows(planned)
        plans.append((offset, planned))
    sources.reserve([chunk for _, planned in plans for chunk in planned], kv_heads, rows)
    chunks = []
    previous = None  # the last shared load planned
    for b, (offset, planned) in enumerate(plans):
        groups = [_Group(q, b, g, group_size, scale, softcap) for g in range(kv_heads)]
        if not planned:
            for group in groups:
                group.finish(out, lse_out)
        # A shared load serves every KV head's chunk of the same keys, so those run together, and
        # so do resident loads (their P V and merges then go step by step across the KV heads);
        # otherwise each KV head's chunks run in a row (which pipelines its loads best).
        order = (
            [(n, g) for n in range(len(planned)) for g in range(kv_heads)]
            if sources.shares_loads or sources.resident
            else [(n, g) for g in range(kv_heads) for n in range(len(planned))]
        )
        shared = (
            [sources.chunk_source(b, k0, parts, t, kv_heads, common) for k0, parts, t in planned]
            if sources.shares_loads
            else []
        )
        if sources.shares_loads:  # each shared load starts the next one's, a whole chunk ahead
            for source in shared:
                if previous is not None:
                    previous.next = source
                previous = source
        for n, g in order:
            k0, parts, t = planned[n]
            last_key = k0 + parts * t - 1
            chunk = _Chunk(
                groups[g],
                k0,
                parts,
                t,
                offset if causal and last_key > offset else None,
                offset - window + 1 if window and k0 < sq - 1 + offset - window + 1 else None,
                common,
                shared[n] if sources.shares_loads else sources.head_source(b, g, k0, parts, t),
            )
            chunk.last = n == len(planned) - 1
            if n == 0 and (g == 0 or not sources.shares_loads):  # with shared loads, one chunk loads every group's
                chunk.query_groups = groups if sources.shares_loads else [groups[g]]
            chunks.append(chunk)
    # The gathers' slot indices first: a few small instructions per chunk that would otherwise queue
    # on TensorE and GpSimd behind the bulk loads they precede.
    for chunk in chunks:
        chunk.source.prepare()
    if sources.resident:  # the bulk loads go up front, so the queries' small loads go before them
        for chunk in chunks:
            for group in chunk.query_groups:
                group.load_queries()
            chunk.query_groups = []
    sources.issue_loads([chunk.source for chunk in chunks])
    # A software pipeline over the chunks: at each tick every stage works on a different chunk,
    # LEAD chunks apart, so loads run ahead of the transposes and those ahead of the softmax. With
    # resident loads the values' stage runs after it, every chunk's keys' work done.
    waves = _waves(chunks, kv_heads) if sources.resident else []
    stages = _RESIDENT_STAGES if sources.resident else _STAGES
    for n in range(-max(lead for _, lead in stages), len(chunks)):
        for stage, lead in stages:
            if 0 <= n + lead < len(chunks):
                getattr(chunks[n + lead], stage)()
        if n >= 0 and chunks[n].last and not sources.resident:
            chunks[n].group.finish(out, lse_out)
    # Resident: P V wave by wave (every KV head's chunk of the same keys) in the order the values
    # land, each V piece's key blocks for every KV head before the next piece's, so that after the
    # last lands only its blocks remain.
    for pieces, sharing in waves:
        for first, count in pieces:
            for chunk in sharing:
                chunk.multiply_blocks(first, first + count)
        # each step for every KV head before the next step: a head's steps wait on each other
        for chunk in sharing:
            chunk.weigh()
        for chunk in sharing:
            chunk.fold()
        for chunk in sharing:
            if chunk.last:
                chunk.group.finish(out, lse_out)


def _joined_single_rows(planned):
    """The plan with adjacent chunks of one key per partition joined while they fit on the partitions
    (a segment's few leftover keys and the masked keys after it cost one chunk, not two)."""
    joined = []
    for k0, parts, t in planned:
        if joined and t == 1 and joined[-1][2] == 1 and joined[-1][1] + parts <= P:
            joined[-1] = (joined[-1][0], joined[-1][1] + parts, 1)
        else:
            joined.append((k0, parts, t))
    return joined


def _waves(chunks, kv_heads):
    """(value pieces, chunks) per run of ``kv_heads`` chunks: with resident loads every KV head's chunk
    of the same keys runs consecutively, and their loads (one shared, or one each) land in the same
    pieces."""
    waves = []
    for first in range(0, len(chunks), kv_heads):
        wave = chunks[first : first + kv_heads]
        waves.append((wave[0].source.value_pieces, wave))
    return waves
