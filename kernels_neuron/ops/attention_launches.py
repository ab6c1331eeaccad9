"""Attention of any length from kernel launches that fit in SBUF.

The NKI kernel keeps a KV head's K and V resident in SBUF, and its backward also the fp32 dK/dV
and one head's query side (``MAX_RESIDENT_KV_BYTES``, ``MAX_RESIDENT_BWD_BYTES`` in
``nki_src/attention.py``). That bounds what one launch takes, not what the op takes: longer
attention is cut into launches over blocks of queries and keys (``Launch``).

- Forward: each launch returns its block's output and log-sum-exp; blocks of the same queries are
  merged by their lse (``out = sum_b exp(lse_b - lse) out_b``, ``lse = logsumexp_b lse_b``), the
  same rescaling the kernel applies between its own key steps.
- Backward: each launch runs the kernel's backward with the *merged* output and lse. With the
  final lse the kernel rebuilds the block's exact probabilities, and ``delta = rowsum(dO * O)``
  uses the final output, so each launch yields its block's exact share of dq, dk and dv (the
  ring-attention argument); the shares are summed in fp32.

Visibility, in absolute positions with ``O = Sk - Sq``: query ``i`` sees key ``j`` when
``j <= i + O`` (causal, aligned bottom-right) and ``j > i + O - window``. A launch over queries
``[q0, q1)`` and keys ``[k0, k1)`` applies the kernel's own rule to its block, whose offset is
``(k1 - k0) - (q1 - q0)``; the two agree when the block ends at ``k1 = q1 + O`` (the top block
of a query block, which holds every key the causal mask cuts) or needs no causal cut, and the
window carries over as ``window + k1 - q1 - O``. A block whose window cut the kernel cannot
express that way gets it as an additive bias. Packed sequences are launched a group of whole
sequences at a time; a sequence longer than one launch holds is cut like a batch of one.

When everything fits (every case the kernel took before), the plan is the one launch it always was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._backend import run_kernel

# Queries per block in the forward: the top block of a query block also holds that block's
# causally cut keys, so a forward block of up to half the launch's key capacity leaves the other
# half for keys every query sees.
_FORWARD_QUERY_SHARE = 2


@dataclass(frozen=True)
class Launch:
    """One kernel launch: queries ``[q0, q1)`` against keys ``[k0, k1)`` with the kernel's own
    ``causal``/``window`` (in the block's coordinates) and packed ``segments`` (relative to
    ``q0``, queries and keys alike), or ``bias_window`` > 0 when the window must be applied as a bias."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    window: int
    segments: tuple[tuple[int, int], ...] | None = None
    bias_window: int = 0


class Capacity:
    """What one launch of the kernel holds, from its residency limits."""

    def __init__(self, kernels: Any, head_dim: int, itemsize: int) -> None:
        self.kernels, self.head_dim, self.itemsize = kernels, head_dim, itemsize
        self.block = kernels.P  # the kernel's query tile and key block

    def forward_fits(self, keys: int) -> bool:
        return self.kernels.resident_kv_bytes(keys, self.head_dim, self.itemsize) <= self.kernels.MAX_RESIDENT_KV_BYTES

    def backward_fits(self, queries: int, keys: int) -> bool:
        return (
            self.forward_fits(keys)
            and self.kernels.resident_bwd_bytes(queries, keys, self.head_dim, self.itemsize)
            <= self.kernels.MAX_RESIDENT_BWD_BYTES
        )

    def fits(self, queries: int, keys: int, backward: bool) -> bool:
        return self.backward_fits(queries, keys) if backward else self.forward_fits(keys)

    def block_sizes(self, backward: bool) -> tuple[int, int]:
        """(queries per block, keys per launch), both whole 128-blocks, keys >= queries."""
        block = self.block
        keys = block
        while self.forward_fits(keys + block):
            keys += block
        if not backward:
            return max(block, (keys // _FORWARD_QUERY_SHARE) // block * block), keys
        # The backward holds both sides: the largest equal split, then the keys take what is left.
        queries = block
        while self.backward_fits(queries + block, queries + block):
            queries += block
        keys = queries
        while self.backward_fits(queries, keys + block):
            keys += block
        return queries, keys


def plan(
    sq: int,
    sk: int,
    causal: bool,
    window: int,
    segments: tuple[tuple[int, int], ...] | None,
    capacity: Capacity,
    backward: bool,
) -> list[Launch]:
    """The launches that together compute attention of ``sq`` queries over ``sk`` keys."""
    if segments is None:
        return _plan_dense(0, sq, sk, causal, window, capacity, backward)
    if capacity.fits(sq, sk, backward):
        return [Launch(0, sq, 0, sk, causal, window, segments)]
    launches: list[Launch] = []
    group: list[tuple[int, int]] = []
    for start, end in segments:
        if group and not capacity.fits(end - group[0][0], end - group[0][0], backward):
            launches.append(_packed_group(group, causal, window))
            group = []
        if capacity.fits(end - start, end - start, backward):
            group.append((start, end))
        else:  # alone too long: a batch of one, cut into blocks
            launches += _plan_dense(start, end - start, end - start, causal, window, capacity, backward)
    if group:
        launches.append(_packed_group(group, causal, window))
    return launches


def _packed_group(group: list[tuple[int, int]], causal: bool, window: int) -> Launch:
    first, last = group[0][0], group[-1][1]
    relative = tuple((start - first, end - first) for start, end in group)
    return Launch(first, last, first, last, causal, window, relative)


def _plan_dense(
    base: int, sq: int, sk: int, causal: bool, window: int, capacity: Capacity, backward: bool
) -> list[Launch]:
    """Queries ``base + [0, sq)`` against keys ``base + [0, sk)`` (a packed sequence has ``base``)."""
    if capacity.fits(sq, sk, backward):
        return [Launch(base, base + sq, base, base + sk, causal, window)]
    queries_per_block, keys_per_launch = capacity.block_sizes(backward)
    offset = sk - sq
    launches = []
    for q0 in range(0, sq, queries_per_block):
        q1 = min(sq, q0 + queries_per_block)
        top = min(sk, q1 + offset) if causal else sk
        lowest = max(0, q0 + offset - window + 1) if window else 0
        while top > lowest:  # from the top block (which holds the causally cut keys) down
            bottom = max(lowest, top - keys_per_launch)
            launches.append(_dense_launch(base, q0, q1, bottom, top, offset, causal, window))
            top = bottom
    return launches


def _dense_launch(base: int, q0: int, q1: int, k0: int, k1: int, offset: int, causal: bool, window: int) -> Launch:
    cut_by_causal = causal and k1 - 1 > q0 + offset
    assert not cut_by_causal or k1 == q1 + offset, "a causally cut block must end at the diagonal"
    launch_window = 0
    bias_window = 0
    if window and k0 < q1 + offset - window:  # some key is too old for the block's last query
        launch_window = window + k1 - q1 - offset
        if launch_window < 1:
            launch_window, bias_window = 0, window
    return Launch(base + q0, base + q1, base + k0, base + k1, cut_by_causal, launch_window, bias_window=bias_window)


# --- running a plan -------------------------------------------------------------------------------------


def _window_bias(launch: Launch, offset: int, device: torch.device) -> torch.Tensor:
    """The block's window cut as an additive fp32 bias [1, 1, queries, keys] (-inf drops)."""
    i = torch.arange(launch.q0, launch.q1, device=device)[:, None]
    j = torch.arange(launch.k0, launch.k1, device=device)[None, :]
    keep = j > i + offset - launch.bias_window
    return torch.zeros(keep.shape, device=device).masked_fill(~keep, float("-inf"))[None, None]


def _block_bias(bias: torch.Tensor | None, launch: Launch, offset: int, device: torch.device) -> torch.Tensor | None:
    piece = None if bias is None else bias[:, :, launch.q0 : launch.q1, launch.k0 : launch.k1]
    if launch.bias_window:
        window = _window_bias(launch, offset, device)
        piece = window if piece is None else piece + window
    return None if piece is None else piece.contiguous()


def _block(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return x[:, :, start:end].contiguous()


def forward(
    kernel: Callable[..., Any],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool,
    window: int,
    softcap: float,
    segments: tuple[tuple[int, int], ...] | None,
    kernels: Any,
    no_key_lse: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the whole attention from launches of ``kernel`` (the NKI forward)."""
    sq, sk, d = q.shape[2], k.shape[2], q.shape[3]
    launches = plan(sq, sk, causal, window, segments, Capacity(kernels, d, k.element_size()), backward=False)
    if len(launches) == 1 and (launches[0].q1 - launches[0].q0, launches[0].k1 - launches[0].k0) == (sq, sk):
        return run_kernel(kernel, q, k, v, bias, scale, causal, window, softcap, segments)
    offset = 0 if segments is not None else sk - sq
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
    for launch in launches:
        block_bias = _block_bias(bias, launch, offset, q.device)
        block_out, block_lse = run_kernel(
            kernel,
            _block(q, launch.q0, launch.q1),
            _block(k, launch.k0, launch.k1),
            _block(v, launch.k0, launch.k1),
            block_bias,
            scale,
            launch.causal,
            launch.window,
            softcap,
            launch.segments,
        )
        rows = slice(launch.q0, launch.q1)
        merged = torch.logaddexp(lse[:, :, rows], block_lse)
        out[:, :, rows] = (
            out[:, :, rows] * torch.exp(lse[:, :, rows] - merged)[..., None]
            + block_out.float() * torch.exp(block_lse - merged)[..., None]
        )
        lse[:, :, rows] = merged
    return out.to(q.dtype), lse.masked_fill(torch.isneginf(lse), no_key_lse)


def backward(
    kernel: Callable[..., Any],
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool,
    window: int,
    softcap: float,
    segments: tuple[tuple[int, int], ...] | None,
    kernels: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from launches of ``kernel`` (the NKI backward), each against the final out and lse."""
    sq, sk, d = q.shape[2], k.shape[2], q.shape[3]
    launches = plan(sq, sk, causal, window, segments, Capacity(kernels, d, k.element_size()), backward=True)
    if len(launches) == 1 and (launches[0].q1 - launches[0].q0, launches[0].k1 - launches[0].k0) == (sq, sk):
        return run_kernel(kernel, q, k, v, out, grad_out, lse, bias, scale, causal, window, softcap, segments)
    offset = 0 if segments is not None else sk - sq
    dq = q.new_zeros(q.shape, dtype=torch.float32)
    dk = k.new_zeros(k.shape, dtype=torch.float32)
    dv = v.new_zeros(v.shape, dtype=torch.float32)
    for launch in launches:
        queries, keys = (launch.q0, launch.q1), (launch.k0, launch.k1)
        block_dq, block_dk, block_dv = run_kernel(
            kernel,
            _block(q, *queries),
            _block(k, *keys),
            _block(v, *keys),
            _block(out, *queries),
            _block(grad_out, *queries),
            lse[:, :, launch.q0 : launch.q1].contiguous(),
            _block_bias(bias, launch, offset, q.device),
            scale,
            launch.causal,
            launch.window,
            softcap,
            launch.segments,
        )
        dq[:, :, launch.q0 : launch.q1] += block_dq.float()
        dk[:, :, launch.k0 : launch.k1] += block_dk.float()
        dv[:, :, launch.k0 : launch.k1] += block_dv.float()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
