"""What the NKI kernels share: the partition count, tiling, element sizes, and the floor below which an
attention logit counts as masked. Shipped beside the kernels in every kernel repo's ``nki_src``
(``kernels-neuron build``), so each Hub repo stays self-contained.
"""

P = 128  # partitions of SBUF and PSUM: the rows of an on-chip tile, the contraction of a matmul


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
