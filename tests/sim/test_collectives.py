"""``nki.collectives`` on a multi-rank launch (``sim.run_ranks``): each call's semantics against NumPy
(several ranks, sub-groups, LNC=2), its documented rules, deadlocks, the trace and trace-only runs."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_neuron import cost, sim

sim.install()

import nki  # noqa: E402
import nki.collectives as ncc  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402
from kernel_io import to_hbm, to_sbuf  # noqa: E402
from nki.collectives import ReplicaGroup  # noqa: E402

RNG = np.random.default_rng(7)


def _data(ranks, *shape, dtype=np.float32):
    return [RNG.standard_normal(shape).astype(dtype) for _ in range(ranks)]


def _hbm_like(x, shape=None, name=""):
    """An internal HBM tensor, as AWS's kernels give collectives (never the kernel's own arguments)."""
    return nl.ndarray(tuple(shape or x.shape), x.dtype, buffer=nl.shared_hbm, name=name)


def _copied(x):
    src = _hbm_like(x, name="src")
    nisa.dma_copy(dst=src, src=x)
    return src


def _out(t):
    out = _hbm_like(t)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def all_reduce_hbm(x, y, group, op):
    """A coalesced all-reduce of two tensors."""
    srcs = [_copied(x), _copied(y)]
    dsts = [_hbm_like(x, name="dx"), _hbm_like(y, name="dy")]
    ncc.all_reduce(srcs=srcs, dsts=dsts, replica_group=group, op=op)
    return _out(dsts[0]), _out(dsts[1])


NP_OPS = {"add": np.add, "minimum": np.minimum, "maximum": np.maximum}


@pytest.mark.parametrize("op", ["add", "minimum", "maximum"])
def test_all_reduce_combines_each_sub_group_separately(op):
    xs, ys = _data(4, 3, 8), _data(4, 16)
    group = ReplicaGroup([[0, 2], [3, 1]])
    result = sim.run_ranks(all_reduce_hbm, [(xs[r], ys[r]) for r in range(4)], group=group, op=getattr(nl, op))
    for rank, (x_out, y_out) in enumerate(result.outputs):
        members = [0, 2] if rank in (0, 2) else [3, 1]
        np.testing.assert_allclose(x_out, NP_OPS[op](xs[members[0]], xs[members[1]]), rtol=1e-6)
        np.testing.assert_allclose(y_out, NP_OPS[op](ys[members[0]], ys[members[1]]), rtol=1e-6)


def test_all_reduce_in_sbuf_under_lnc2_reduces_each_program_with_its_counterparts():
    """Each of a rank's two programs reduces its own tile with the same program of the other ranks."""
    xs = _data(3, 2, 4, 8)

    @nki.jit
    def kernel(x, group):
        program = nl.program_id(0)
        tile = to_sbuf(x[program])
        total = nl.ndarray(tile.shape, tile.dtype, buffer=nl.sbuf)
        ncc.all_reduce(srcs=[tile], dsts=[total], replica_group=group, op=nl.add)
        out = nl.ndarray((2, 4, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[program], src=total)
        return out

    result = sim.run_ranks(kernel, [(x,) for x in xs], group=ReplicaGroup([[0, 1, 2]]), grid=2)
    for out in result.outputs:
        np.testing.assert_allclose(out, xs[0] + xs[1] + xs[2], rtol=1e-6)
    reduces = [(i.rank, i.program) for i in result.trace if i.op == "all_reduce"]
    assert sorted(reduces) == [(r, (p,)) for r in range(3) for p in range(2)]


def test_all_reduce_rounds_once_after_an_fp32_sum():
    xs = [np.full((2, 4), v, dtype=np.float16) for v in (2048.0, 1.0, 1.0)]

    @nki.jit
    def kernel(x, group):
        dst = _hbm_like(x, name="dst")
        ncc.all_reduce(srcs=[_copied(x)], dsts=[dst], replica_group=group, op=nl.add)
        return _out(dst)

    outs = sim.run_ranks(kernel, [(x,) for x in xs], group=ReplicaGroup([[0, 1, 2]])).outputs
    # fp16 rounding after each addition would give 2048 (2049 rounds to even); once, 2050.
    assert outs[0][0, 0] == 2050.0


@nki.jit
def all_gather_hbm(x, group, ranks):
    dst = _hbm_like(x, (x.shape[0] * ranks, *x.shape[1:]), name="dst")
    ncc.all_gather(srcs=[_copied(x)], dsts=[dst], replica_group=group, collective_dim=0)
    return _out(dst)


def test_all_gather_on_hbm_concatenates_in_rank_list_order():
    xs = _data(4, 2, 3, 4)
    group = ReplicaGroup([[1, 0], [2, 3]])
    outs = sim.run_ranks(all_gather_hbm, [(x,) for x in xs], group=group, ranks=2).outputs
    for rank in (0, 1):
        np.testing.assert_array_equal(outs[rank], np.concatenate([xs[1], xs[0]]))
    for rank in (2, 3):
        np.testing.assert_array_equal(outs[rank], np.concatenate([xs[2], xs[3]]))


@pytest.mark.parametrize("dim", [0, 1])
def test_all_gather_in_sbuf_along_partitions_or_the_free_dim(dim):
    xs = _data(2, 16, 8)

    @nki.jit
    def kernel(x, group):
        tile = to_sbuf(x)
        shape = (32, 8) if dim == 0 else (16, 16)
        gathered = nl.ndarray(shape, x.dtype, buffer=nl.sbuf)
        ncc.all_gather(srcs=[tile], dsts=[gathered], replica_group=group, collective_dim=dim)
        return to_hbm(gathered)

    outs = sim.run_ranks(kernel, [(x,) for x in xs], group=ReplicaGroup([[0, 1]])).outputs
    for out in outs:
        np.testing.assert_array_equal(out, np.concatenate(xs, axis=dim))


@nki.jit
def reduce_scatter_hbm(x, group, ranks, op):
    dst = _hbm_like(x, (x.shape[0] // ranks, *x.shape[1:]), name="dst")
    ncc.reduce_scatter(srcs=[_copied(x)], dsts=[dst], replica_group=group, collective_dim=0, op=op)
    return _out(dst)


def test_reduce_scatter_gives_each_rank_its_chunk_of_the_reduction():
    xs = _data(4, 6, 5)
    group = ReplicaGroup([[0, 1, 2], [3]])
    per_rank = [{"x": x, "ranks": 1 if rank == 3 else 3} for rank, x in enumerate(xs)]
    outs = sim.run_ranks(reduce_scatter_hbm, per_rank, group=group, op=nl.maximum).outputs
    total = np.maximum(np.maximum(xs[0], xs[1]), xs[2])
    for position, out in enumerate(outs[:3]):
        np.testing.assert_array_equal(out, total[2 * position : 2 * position + 2])
    np.testing.assert_array_equal(outs[3], xs[3])


def test_reduce_scatter_of_a_one_rank_group_is_a_copy():
    x = _data(1, 4, 5)[0]
    out = sim.run(reduce_scatter_hbm, x, ReplicaGroup([[0]]), 1, nl.add).outputs
    np.testing.assert_array_equal(out, x)


def test_reduce_scatter_in_sbuf():
    xs = _data(2, 8, 4)

    @nki.jit
    def kernel(x, group):
        part = nl.ndarray((4, 4), x.dtype, buffer=nl.sbuf)
        ncc.reduce_scatter(srcs=[to_sbuf(x)], dsts=[part], replica_group=group, collective_dim=0, op=nl.add)
        return to_hbm(part)

    outs = sim.run_ranks(kernel, [(x,) for x in xs], group=ReplicaGroup([[0, 1]])).outputs
    np.testing.assert_allclose(outs[0], (xs[0] + xs[1])[:4], rtol=1e-6)
    np.testing.assert_allclose(outs[1], (xs[0] + xs[1])[4:], rtol=1e-6)


def test_all_to_all_sends_chunk_p_to_the_rank_at_position_p():
    xs = _data(3, 6, 4)

    @nki.jit
    def kernel(x, group):
        dst = _hbm_like(x, name="dst")
        ncc.all_to_all(srcs=[_copied(x)], dsts=[dst], replica_group=group, collective_dim=0)
        return _out(dst)

    outs = sim.run_ranks(kernel, [(x,) for x in xs], group=ReplicaGroup([[0, 1, 2]])).outputs
    for rank, out in enumerate(outs):
        np.testing.assert_array_equal(out, np.concatenate([x[2 * rank : 2 * rank + 2] for x in xs]))


def _metadata(rows):
    return np.asarray(rows, dtype=np.uint32)


@nki.jit
def all_gather_v_kernel(x, metadata, group, size, known):
    """Each program gathers into its own half of the output (LNC=2)."""
    program = nl.program_id(0)
    src = _copied(x)
    dst = nl.ndarray((1, size), x.dtype, buffer=nl.shared_hbm, name="dst")
    nisa.dma_copy(dst=dst, src=nl.full((1, size), -1.0, x.dtype))
    md = nl.ndarray(metadata.shape, metadata.dtype, buffer=nl.shared_hbm, name="md")
    nisa.dma_copy(dst=md, src=metadata)
    ncc.all_gather_v(srcs=[src], dsts=[dst], replica_group=group, metadata_tensor=md, recv_counts_known=known)
    out = nl.ndarray((2, size), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[program], src=dst)
    counts = nl.ndarray((2, 4), nl.uint32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=counts[program], src=md[2])
    return out, counts


@pytest.mark.parametrize("known", [False, True])
def test_all_gather_v_broadcasts_each_ranks_chunk_into_its_slot(known):
    xs = [np.arange(10, dtype=np.float32) + 100 * r for r in range(4)]
    counts, displs = [3, 0, 5, 2], [1, 0, 4, 8]
    metadata = [_metadata([[counts[r]] * 4, [displs[r]] * 4, [7] * 4]) for r in range(4)]
    group = ReplicaGroup([[0, 1, 2, 3]])
    size = 20  # slots of 5
    result = sim.run_ranks(
        all_gather_v_kernel, [(xs[r], metadata[r]) for r in range(4)], group=group, size=size, known=known, grid=2
    )
    expected = np.full(size, -1.0, np.float32)
    for position in range(4):
        expected[5 * position : 5 * position + counts[position]] = xs[position][displs[position] :][: counts[position]]
    for out, received in result.outputs:
        np.testing.assert_array_equal(out, np.stack([expected, expected]))
        np.testing.assert_array_equal(received, np.full((2, 4), 7) if known else np.stack([counts, counts]))


def test_all_gather_v_takes_its_metadata_from_sbuf_too():
    """An SBUF metadata tensor is (1, rows, ranks): one partition; row 2 receives the counts there."""

    @nki.jit
    def kernel(x, metadata, group):
        dst = nl.ndarray((1, 8), x.dtype, buffer=nl.shared_hbm, name="dst")
        md = to_sbuf(metadata)
        ncc.all_gather_v(srcs=[_copied(x)], dsts=[dst], replica_group=group, metadata_tensor=md)
        return _out(dst), to_hbm(md)

    xs = [np.arange(4, dtype=np.float32) + 10 * r for r in range(4)]
    metadata = [_metadata([[[2] * 4, [r % 3] * 4, [0] * 4]]) for r in range(4)]
    outs = sim.run_ranks(kernel, list(zip(xs, metadata)), group=FOUR, grid=2).outputs
    for out, md in outs:
        np.testing.assert_array_equal(out[0], np.concatenate([xs[r][r % 3 : r % 3 + 2] for r in range(4)]))
        np.testing.assert_array_equal(md[0, 2], [2, 2, 2, 2])


@nki.jit
def all_to_all_v_kernel(x, metadata, group, size):
    src = _copied(x)
    dst = nl.ndarray((1, size), x.dtype, buffer=nl.shared_hbm, name="dst")
    nisa.dma_copy(dst=dst, src=nl.full((1, size), -1.0, x.dtype))
    md = nl.ndarray(metadata.shape, metadata.dtype, buffer=nl.shared_hbm, name="md")
    nisa.dma_copy(dst=md, src=metadata)
    has_rdispls = metadata.shape[0] == 4
    ncc.all_to_all_v(srcs=[src], dsts=[dst], replica_group=group, metadata_tensor=md, has_rdispls=has_rdispls)
    program = nl.program_id(0)
    out = nl.ndarray((2, size), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[program], src=dst)
    received = nl.ndarray((2, 8), nl.uint32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=received[program], src=md[2])
    return out, received


@pytest.mark.parametrize("has_rdispls", [False, True])
def test_all_to_all_v_on_trn3_routes_each_chunk_by_the_metadata(has_rdispls):
    """Two Trn3 devices (8 ranks at LNC=2) in one rank list; rank s sends (s + d) % 3 elements to rank d."""
    ranks, size = 8, 32  # slots of 4 elements
    xs = [np.arange(24, dtype=np.float32) + 100 * r for r in range(ranks)]
    count = [[(s + d) % 3 for d in range(ranks)] for s in range(ranks)]
    displ = [[3 * d for d in range(ranks)] for s in range(ranks)]
    recv_displ = [[size - 4 * (s + 1) for s in range(ranks)] for _ in range(ranks)]  # slots in reverse
    metadata = []
    for r in range(ranks):
        rows = [count[r], displ[r], [0] * ranks] + ([recv_displ[r]] if has_rdispls else [])
        metadata.append(_metadata(rows))
    group = ReplicaGroup([list(range(ranks))])
    result = sim.run_ranks(
        all_to_all_v_kernel, [(xs[r], metadata[r]) for r in range(ranks)], group=group, size=size, grid=2, target="trn3"
    )
    for d, (out, received) in enumerate(result.outputs):
        expected = np.full(size, -1.0, np.float32)
        for s in range(ranks):
            start = recv_displ[d][s] if has_rdispls else 4 * s
            n = count[s][d]
            expected[start : start + n] = xs[s][displ[s][d] : displ[s][d] + n]
        np.testing.assert_array_equal(out[0], expected)
        np.testing.assert_array_equal(received[0], [count[s][d] for s in range(ranks)])


@nki.jit
def permute_kernel(x, pairs):
    dst = _hbm_like(x, name="dst")
    nisa.dma_copy(dst=dst, src=nl.full(x.shape, -1.0, x.dtype))
    ncc.collective_permute(srcs=[_copied(x)], dsts=[dst], source_target_pairs=pairs)
    return _out(dst)


def test_collective_permute_follows_the_pairs_and_leaves_other_ranks_alone():
    xs = _data(5, 4, 8)
    pairs = [(0, 1), (1, 2), (2, 0), (3, 4)]  # a 3-ring and a one-way send; rank 3 receives nothing
    outs = sim.run_ranks(permute_kernel, [(x,) for x in xs], pairs=pairs).outputs
    for source, target in pairs:
        np.testing.assert_array_equal(outs[target], xs[source])
    np.testing.assert_array_equal(outs[3], np.full((4, 8), -1.0, np.float32))


@nki.jit
def ring_all_gather(x, group, ranks, channels):
    """An all-gather as ranks - 1 ring steps, each on ``channels`` channels, placing the chunk by the rank
    the ring says it holds (as nki-library's fine-grained all-gather does)."""
    rows = x.shape[0] // channels
    out = nl.ndarray((ranks, *x.shape), x.dtype, buffer=nl.shared_hbm)
    buffers = [_copied(x), _hbm_like(x, name="other")]
    for step in range(ranks):
        current = buffers[step % 2]
        for channel in range(channels):
            holder = ncc.collective_permute_implicit_current_processing_rank_id(
                iteration_id=step, replica_group=group, channel_id=channel
            )
            chunk = current[channel * rows : (channel + 1) * rows]
            w = x.shape[1]
            nisa.dma_copy(
                dst=out.ap(
                    pattern=[[w, rows], [1, w]], offset=channel * rows * w, scalar_offset=holder, indirect_dim=0
                ),
                src=chunk,
            )
        if step < ranks - 1:
            nxt = buffers[(step + 1) % 2]
            ncc.collective_permute_implicit(
                srcs_by_channel=[[current[c * rows : (c + 1) * rows]] for c in range(channels)],
                dsts_by_channel=[[nxt[c * rows : (c + 1) * rows]] for c in range(channels)],
                replica_group=group,
                channel_ids=list(range(channels)),
            )
    return out


@pytest.mark.parametrize("channels", [1, 2])
def test_a_ring_of_implicit_permutes_gathers_every_ranks_data(channels):
    xs = _data(4, 4, 6)
    outs = sim.run_ranks(
        ring_all_gather, [(x,) for x in xs], group=ReplicaGroup([[0, 1, 2, 3]]), ranks=4, channels=channels
    ).outputs
    for out in outs:
        np.testing.assert_array_equal(out, np.stack(xs))


def test_the_processing_rank_walks_back_around_the_rank_list():
    @nki.jit
    def kernel(group):
        holders = [
            ncc.collective_permute_implicit_current_processing_rank_id(iteration_id=i, replica_group=group).value
            for i in range(4)
        ]
        out = nl.ndarray((1, 4), nl.int32, buffer=nl.shared_hbm)
        for i, holder in enumerate(holders):
            nisa.dma_copy(dst=out[0:1, i : i + 1], src=nl.full((1, 1), holder, nl.int32))
        return out

    outs = sim.run_ranks(kernel, [()] * 4, group=ReplicaGroup([[2, 0, 3, 1]])).outputs
    assert outs[0].tolist() == [[0, 2, 1, 3]]  # rank 0 follows 2, which follows 1, which follows 3
    assert outs[2].tolist() == [[2, 1, 3, 0]]


def test_implicit_permute_reduce_sends_the_reduction_to_the_next_rank():
    xs, ys = _data(3, 4, 8), _data(3, 4, 8)

    @nki.jit
    def kernel(x, y, group):
        a, b = to_sbuf(x), to_sbuf(y)
        got = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        ncc.collective_permute_implicit_reduce(
            srcs0_by_channel=[[a]], srcs1_by_channel=[[b]], dsts_by_channel=[[got]], replica_group=group, op=nl.add
        )
        return to_hbm(got)

    outs = sim.run_ranks(kernel, [(xs[r], ys[r]) for r in range(3)], group=ReplicaGroup([[0, 1, 2]])).outputs
    for rank, out in enumerate(outs):
        previous = (rank - 1) % 3
        np.testing.assert_allclose(out, xs[previous] + ys[previous], rtol=1e-6)


def test_rank_id_selects_each_ranks_slice_as_awss_kernel_does():
    data = RNG.standard_normal((3, 4, 5)).astype(np.float32)

    @nki.jit
    def kernel(in_tensor):
        _, h, w = in_tensor.shape
        out = nl.ndarray((h, w), in_tensor.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=in_tensor.ap(pattern=[[w, h], [1, w]], scalar_offset=ncc.rank_id(), indirect_dim=0))
        return out

    outs = sim.run_ranks(kernel, [(data,)] * 3).outputs
    for rank, out in enumerate(outs):
        np.testing.assert_array_equal(out, data[rank])


# ---------------------------------------------------------------------------------------------
# rules
# ---------------------------------------------------------------------------------------------
def _expect_rule(kernel, ranks, pattern, **options):
    with pytest.raises(nisa.NkiValidationError, match=pattern):
        sim.run_ranks(kernel, [()] * ranks, **options)


PAIR = ReplicaGroup([[0, 1]])


def _sb(shape=(4, 8), dtype=nl.float32, buffer=None):
    return nl.ndarray(shape, dtype, buffer=buffer or nl.sbuf)


def _hbm(shape=(4, 8), dtype=nl.float32):
    return nl.ndarray(shape, dtype, buffer=nl.shared_hbm)


RULES = {
    "mixed": (
        lambda: ncc.all_reduce(srcs=[_sb()], dsts=[_hbm()], replica_group=PAIR, op=nl.add),
        r"ncc\.all_reduce: srcs/dsts: all tensors must be on HBM or all on SBUF, not mixed \(buffers=srcs\[0\]=sbuf, dsts\[0\]=shared_hbm\)",
    ),
    "coalesced sbuf": (
        lambda: ncc.all_gather(
            srcs=[_sb(), _sb()], dsts=[_sb((8, 8)), _sb((8, 8))], replica_group=PAIR, collective_dim=0
        ),
        r"ncc\.all_gather: srcs: coalesced collectives \(several tensors\) need HBM tensors \(count=2\)",
    ),
    "psum": (
        lambda: ncc.all_reduce(srcs=[_sb(buffer=nl.psum)], dsts=[_sb(buffer=nl.psum)], replica_group=PAIR, op=nl.add),
        r"ncc\.all_reduce: srcs\[0\]: must be in HBM/SBUF, not PSUM",
    ),
    "hbm gather dim": (
        lambda: ncc.all_gather(srcs=[_hbm()], dsts=[_hbm((4, 16))], replica_group=PAIR, collective_dim=1),
        r"ncc\.all_gather: collective_dim: HBM all-gathers concatenate along dim 0 only \(value=1, allowed=\[0\]\)",
    ),
    "sbuf gather dim": (
        lambda: ncc.all_gather(srcs=[_sb()], dsts=[_sb((4, 16))], replica_group=PAIR, collective_dim=2),
        r"ncc\.all_gather: collective_dim: SBUF all-gathers concatenate along dim 0 or 1 \(value=2, allowed=\[0, 1\]\)",
    ),
    "sbuf 3-d": (
        lambda: ncc.all_gather(srcs=[_sb((4, 2, 4))], dsts=[_sb((4, 4, 4))], replica_group=PAIR, collective_dim=1),
        r"ncc\.all_gather: srcs/dsts: SBUF collectives take 2-D tensors",
    ),
    "scatter dim": (
        lambda: ncc.reduce_scatter(srcs=[_hbm()], dsts=[_hbm((4, 4))], replica_group=PAIR, collective_dim=1, op=nl.add),
        r"ncc\.reduce_scatter: collective_dim: reduce-scatters split along dim 0 only \(value=1",
    ),
    "op": (
        lambda: ncc.all_reduce(srcs=[_hbm()], dsts=[_hbm()], replica_group=PAIR, op=nl.multiply),
        r"ncc\.all_reduce: op: must be nl\.add, nl\.minimum or nl\.maximum \(op=multiply\)",
    ),
    "all_to_all sbuf": (
        lambda: ncc.all_to_all(srcs=[_sb()], dsts=[_sb()], replica_group=PAIR, collective_dim=0),
        r"ncc\.all_to_all: srcs\[0\]: must be in HBM, not SBUF",
    ),
    "all_to_all dim": (
        lambda: ncc.all_to_all(srcs=[_hbm()], dsts=[_hbm()], replica_group=PAIR, collective_dim=1),
        r"ncc\.all_to_all: collective_dim: .* dim 0 only \(value=1",
    ),
    "gather shape": (
        lambda: ncc.all_gather(srcs=[_hbm()], dsts=[_hbm((4, 8))], replica_group=PAIR, collective_dim=0),
        r"ncc\.all_gather: dsts\[0\]: must be the concatenation of one source chunk per rank along dim 0 "
        r"\(shape=\[4, 8\], expected=\[8, 8\], ranks=2\)",
    ),
    "dtype": (
        lambda: ncc.all_reduce(srcs=[_hbm()], dsts=[_hbm(dtype=nl.bfloat16)], replica_group=PAIR, op=nl.add),
        r"ncc\.all_reduce: dsts\[0\]: must have its source's dtype \(dtype=bfloat16, src=float32\)",
    ),
    "permute sbuf": (
        lambda: ncc.collective_permute(srcs=[_sb()], dsts=[_sb()], source_target_pairs=[(0, 1), (1, 0)]),
        r"ncc\.collective_permute: srcs\[0\]: must be in HBM, not SBUF",
    ),
    "permute coalesced": (
        lambda: ncc.collective_permute(srcs=[_hbm(), _hbm()], dsts=[_hbm(), _hbm()], source_target_pairs=[(0, 1)]),
        r"ncc\.collective_permute: srcs: must hold exactly one tensor \(coalesced lists are not supported\) \(count=2\)",
    ),
    "permute target twice": (
        lambda: ncc.collective_permute(srcs=[_hbm()], dsts=[_hbm()], source_target_pairs=[(0, 1), (1, 1)]),
        r"ncc\.collective_permute: source_target_pairs: a rank may be the target of one pair only",
    ),
    "channel ids": (
        lambda: ncc.collective_permute_implicit(
            srcs_by_channel=[[_sb()]], dsts_by_channel=[[_sb()]], replica_group=PAIR, channel_ids=[1]
        ),
        r"ncc\.collective_permute_implicit: channel_ids: must be consecutive integers starting from 0 \(value=\[1\]\)",
    ),
    "channels": (
        lambda: ncc.collective_permute_implicit(
            srcs_by_channel=[[_sb()]] * 3, dsts_by_channel=[[_sb()]] * 3, replica_group=PAIR, channel_ids=[0, 1, 2]
        ),
        r"collective_permute_implicit: channel_ids: too many channels: 4 for a replica group holding every device of "
        r"a node, 2 otherwise \(channels=3, limit=2\)",
    ),
    "channel lists": (
        lambda: ncc.collective_permute_implicit(
            srcs_by_channel=[[_sb()]], dsts_by_channel=[[_sb()], [_sb()]], replica_group=PAIR, channel_ids=[0, 1]
        ),
        r"ncc\.collective_permute_implicit: srcs_by_channel: must hold one tensor list per channel \(lists=1, channels=2\)",
    ),
    "channel inner list": (
        lambda: ncc.collective_permute_implicit_reduce(
            srcs0_by_channel=[[_sb(), _sb()]],
            srcs1_by_channel=[[_sb()]],
            dsts_by_channel=[[_sb()]],
            replica_group=PAIR,
            op=nl.add,
        ),
        r"collective_permute_implicit_reduce: srcs0_by_channel\[0\]: must hold exactly one tensor",
    ),
    "processing channel": (
        lambda: ncc.collective_permute_implicit_current_processing_rank_id(
            iteration_id=0, replica_group=PAIR, channel_id=2
        ),
        r"current_processing_rank_id: channel_id: must be a channel of the ring, 0 to num_channels - 1 \(value=2, limit=2\)",
    ),
    "priority": (
        lambda: ncc.all_reduce(srcs=[_hbm()], dsts=[_hbm()], replica_group=PAIR, op=nl.add, priority=0),
        r"ncc\.all_reduce: priority: DMA priority needs NeuronCore-v4 or newer \(target=trn2\)",
    ),
    "group type": (
        lambda: ncc.all_reduce(srcs=[_hbm()], dsts=[_hbm()], replica_group=[[0, 1]], op=nl.add),
        r"ncc\.all_reduce: replica_group: must be a nki\.collectives\.ReplicaGroup \(value=list\)",
    ),
    "rank beyond launch": (
        lambda: ncc.all_reduce(srcs=[_hbm()], dsts=[_hbm()], replica_group=ReplicaGroup([[0, 1, 2]]), op=nl.add),
        r"ncc\.all_reduce: replica_group: names a rank the launch does not have .* \(rank=2, ranks=2\)",
    ),
    "caller in no list": (
        lambda: ncc.all_reduce(srcs=[_hbm()], dsts=[_hbm()], replica_group=ReplicaGroup([[1]]), op=nl.add),
        r"ncc\.all_reduce: replica_group: no rank list holds the calling rank \(rank=0\)",
    ),
    "list not a list": (
        lambda: ncc.all_reduce(srcs=_hbm(), dsts=[_hbm()], replica_group=PAIR, op=nl.add),
        r"ncc\.all_reduce: srcs: must be a non-empty list of tensors",
    ),
}


@pytest.mark.parametrize("problem", list(RULES))
def test_documented_rules(problem):
    call, pattern = RULES[problem]
    _expect_rule(call, 2, pattern)


def test_priority_on_neuroncore_v4_takes_levels_0_to_3():
    def kernel(level):
        ncc.all_reduce(srcs=[_hbm()], dsts=[_hbm()], replica_group=ReplicaGroup([[0]]), op=nl.add, priority=level)

    assert [i.op for i in sim.run(kernel, 3, target="trn3").trace] == ["all_reduce"]
    with pytest.raises(nisa.NkiValidationError, match=r"priority: must be a level from 0 to 3 \(value=4\)"):
        sim.run(kernel, 4, target="trn3")


def test_replica_groups_must_not_overlap():
    with pytest.raises(
        nisa.NkiValidationError, match=r"ncc\.ReplicaGroup: replica_groups\[1\]: sub-groups must not overlap \(rank=1\)"
    ):
        ReplicaGroup([[0, 1], [1, 2]])
    assert ReplicaGroup([[0, 1], [2, 3]]) == ReplicaGroup(((0, 1), (2, 3)))


def _md(rows, ranks, buffer=None, dtype=nl.uint32, sbuf=False):
    shape = (1, rows, ranks) if sbuf else (rows, ranks)
    return nl.ndarray(shape, dtype, buffer=nl.sbuf if sbuf else nl.shared_hbm)


FOUR = ReplicaGroup([[0, 1, 2, 3]])
V_RULES = {
    "metadata dtype": (
        lambda: ncc.all_gather_v(
            srcs=[_hbm()], dsts=[_hbm()], replica_group=FOUR, metadata_tensor=_md(3, 4, dtype=nl.int32)
        ),
        r"ncc\.all_gather_v: metadata_tensor: must be uint32 \(dtype=int32\)",
        {},
    ),
    "metadata rows": (
        lambda: ncc.all_gather_v(srcs=[_hbm()], dsts=[_hbm()], replica_group=FOUR, metadata_tensor=_md(4, 4)),
        r"ncc\.all_gather_v: metadata_tensor: must be \(rows, ranks\) on HBM, .* \(shape=\[4, 4\], expected=\[3, 4\]\)",
        {},
    ),
    "metadata sbuf": (
        lambda: ncc.all_gather_v(
            srcs=[_hbm()], dsts=[_hbm()], replica_group=FOUR, metadata_tensor=_sb((3, 4), nl.uint32)
        ),
        r"ncc\.all_gather_v: metadata_tensor: must be \(1, rows, ranks\) on SBUF.* \(shape=\[3, 4\], expected=\[1, 3, 4\]\)",
        {},
    ),
    "v exactly one": (
        lambda: ncc.all_gather_v(srcs=[_hbm(), _hbm()], dsts=[_hbm()], replica_group=FOUR, metadata_tensor=_md(3, 4)),
        r"ncc\.all_gather_v: srcs: must hold exactly one tensor",
        {},
    ),
    "v sbuf": (
        lambda: ncc.all_gather_v(srcs=[_sb()], dsts=[_sb()], replica_group=FOUR, metadata_tensor=_md(3, 4)),
        r"ncc\.all_gather_v: srcs\[0\]: must be in HBM, not SBUF",
        {},
    ),
    "gather_v rdispls": (
        lambda: ncc.all_gather_v(
            srcs=[_hbm()], dsts=[_hbm()], replica_group=FOUR, metadata_tensor=_md(4, 4), has_rdispls=True
        ),
        r"ncc\.all_gather_v: has_rdispls: True is not supported yet",
        {},
    ),
    "gather_v lnc1": (
        lambda: ncc.all_gather_v(srcs=[_hbm()], dsts=[_hbm()], replica_group=FOUR, metadata_tensor=_md(3, 4)),
        r"ncc\.all_gather_v: launch: only LNC=2 launches are supported \(kernel\[2\]\) \(grid=\[1\], target=trn2\)",
        {"grid": None},
    ),
    "gather_v two ranks": (
        lambda: ncc.all_gather_v(
            srcs=[_hbm()], dsts=[_hbm()], replica_group=ReplicaGroup([[0, 1], [2, 3]]), metadata_tensor=_md(3, 2)
        ),
        r"ncc\.all_gather_v: replica_group: each rank list must hold exactly the 4 ranks of one chip \(ranks=\[0, 1\]\)",
        {},
    ),
    "a2av intra-node on trn2": (
        lambda: ncc.all_to_all_v(srcs=[_hbm()], dsts=[_hbm()], replica_group=FOUR, metadata_tensor=_md(3, 4)),
        r"ncc\.all_to_all_v: replica_group: outside NeuronSwitch instances, each rank list must hold same-indexed ranks "
        r"of different nodes \(ranks=\[0, 1, 2, 3\], ranks_per_node=64\)",
        {},
    ),
    "a2av rdispls on trn2": (
        lambda: ncc.all_to_all_v(
            srcs=[_hbm()], dsts=[_hbm()], replica_group=FOUR, metadata_tensor=_md(4, 4), has_rdispls=True
        ),
        r"ncc\.all_to_all_v: has_rdispls: True is supported on NeuronSwitch instances \(trn3\) only \(target=trn2\)",
        {},
    ),
    "a2av one device on trn3": (
        lambda: ncc.all_to_all_v(srcs=[_hbm()], dsts=[_hbm()], replica_group=FOUR, metadata_tensor=_md(3, 4)),
        r"ncc\.all_to_all_v: replica_group: on NeuronSwitch instances \(trn3\) each rank list must hold every rank of "
        r"each device it uses, on more than one device \(ranks=\[0, 1, 2, 3\], ranks_per_device=4\)",
        {"target": "trn3"},
    ),
    "a2av lnc1 on trn3": (
        lambda: ncc.all_to_all_v(srcs=[_hbm()], dsts=[_hbm()], replica_group=FOUR, metadata_tensor=_md(3, 4)),
        r"ncc\.all_to_all_v: launch: on NeuronSwitch instances \(trn3\) only LNC=2 is supported \(grid=\[1\]\)",
        {"target": "trn3", "grid": None},
    ),
}


@pytest.mark.parametrize("problem", list(V_RULES))
def test_documented_rules_of_the_variable_length_collectives(problem):
    call, pattern, options = V_RULES[problem]
    _expect_rule(call, 4, pattern, **{"grid": 2, **options})


def test_a_chunk_larger_than_its_slot_is_refused_at_run_time():
    xs = [np.arange(10, dtype=np.float32)] * 4
    metadata = [_metadata([[6] * 4, [0] * 4, [0] * 4])] * 4  # 6 elements into slots of 5
    with pytest.raises(
        nisa.NkiValidationError, match=r"all_gather_v: dsts\[0\]: a received chunk does not fit its place"
    ):
        sim.run_ranks(all_gather_v_kernel, list(zip(xs, metadata)), group=FOUR, size=20, known=True, grid=2)


def test_ranks_that_make_different_calls_are_refused():
    def kernel():
        if ncc.rank_id().value == 0:
            ncc.all_reduce(srcs=[_hbm()], dsts=[_hbm()], replica_group=PAIR, op=nl.add)
        else:
            ncc.all_reduce(srcs=[_hbm()], dsts=[_hbm()], replica_group=PAIR, op=nl.maximum)

    with pytest.raises(nisa.NkiValidationError, match=r"every rank of the group must make the same collective call"):
        sim.run_ranks(kernel, [()] * 2)


def test_a_collective_one_rank_never_reaches_is_a_deadlock_naming_ranks_and_call():
    def kernel():
        if ncc.rank_id().value != 2:
            ncc.all_reduce(srcs=[_hbm()], dsts=[_hbm()], replica_group=ReplicaGroup([[0, 1, 2]]), op=nl.add)

    pattern = (
        r"deadlock: rank 0 waits at ncc\.all_reduce \(collective call 1 of ranks \[0, 1, 2\]; ranks \[2\] never make it\); "
        r"rank 1 waits at ncc\.all_reduce .* and no program can continue"
    )
    with pytest.raises(nisa.NkiValidationError, match=pattern):
        sim.run_ranks(kernel, [()] * 3)


def test_an_error_in_one_rank_surfaces_while_the_others_wait():
    def kernel():
        if ncc.rank_id().value == 1:
            raise ValueError("rank 1 failed")
        ncc.all_reduce(srcs=[_hbm()], dsts=[_hbm()], replica_group=PAIR, op=nl.add)

    with pytest.raises(ValueError, match="rank 1 failed"):
        sim.run_ranks(kernel, [()] * 2)


# ---------------------------------------------------------------------------------------------
# trace, cost model, trace-only runs
# ---------------------------------------------------------------------------------------------
def test_the_trace_records_each_ranks_collective_with_its_regions_and_bytes():
    xs, ys = _data(2, 4, 8), _data(2, 16)
    result = sim.run_ranks(all_reduce_hbm, [(xs[r], ys[r]) for r in range(2)], group=PAIR, op=nl.add)
    reduces = [i for i in result.trace if i.op == "all_reduce"]
    assert sorted(i.rank for i in reduces) == [0, 1]
    for inst in reduces:
        assert inst.engine == "dma" and inst.bytes_moved == (4 * 8 + 16) * 4
        assert inst.hbm_bytes_read == inst.hbm_bytes_written == (4 * 8 + 16) * 4
        assert len(inst.reads) == len(inst.writes) == 2 and inst.attrs["replica_group"] == [0, 1]
        # The copy out of the reduced tensor reads what the all-reduce wrote: a dependency.
        later = [i for i in result.trace if i.rank == inst.rank and i.index > inst.index and i.op == "dma_copy"]
        assert any(set(inst.writes) & set(later_inst.reads) for later_inst in later)
    report = cost.estimate_trace(result.trace)
    assert report.cores == 2 and report.time_us > 0


def test_an_all_gather_is_priced_as_a_dma_of_what_the_rank_writes():
    xs = _data(4, 2, 128)
    trace = sim.run_ranks(all_gather_hbm, [(x,) for x in xs], group=ReplicaGroup([[0, 1, 2, 3]]), ranks=4).trace
    gathers = [i for i in trace if i.op == "all_gather"]
    assert {i.bytes_moved for i in gathers} == {4 * 2 * 128 * 4}


def test_trace_only_runs_record_the_same_trace_and_compute_nothing():
    xs = _data(3, 6, 5)
    options = dict(group=ReplicaGroup([[0, 1, 2]]), ranks=3, op=nl.add)
    full = sim.run_ranks(reduce_scatter_hbm, [(x,) for x in xs], **options)
    traced = sim.run_ranks(reduce_scatter_hbm, [(x,) for x in xs], numerics=False, **options)
    assert traced.outputs is None and full.outputs is not None
    assert traced.trace.instructions == full.trace.instructions


def test_a_trace_only_run_knows_a_collectives_result_was_not_computed():
    """An all-gather of input data stays exact (a kernel may read it while tracing); one of computed
    data does not, and reading it while tracing raises."""

    @nki.jit
    def kernel(x, group, compute_first):
        tile = to_sbuf(x)
        if compute_first:
            nisa.tensor_scalar(dst=tile, data=tile, op0=nl.add, operand0=1)
        gathered = nl.ndarray((1, 2), x.dtype, buffer=nl.sbuf)
        ncc.all_gather(srcs=[tile], dsts=[gathered], replica_group=group, collective_dim=1)
        trips = nisa.register_alloc()
        nisa.register_load(trips, gathered[0:1, 1:2])
        return None

    xs = [np.array([[r + 1]], np.int32) for r in range(2)]
    sim.run_ranks(kernel, [(x,) for x in xs], group=PAIR, compute_first=False, numerics=False)
    with pytest.raises(sim.UncomputedValueError, match="register_load"):
        sim.run_ranks(kernel, [(x,) for x in xs], group=PAIR, compute_first=True, numerics=False)


def test_run_ranks_takes_positional_or_keyword_arguments_per_rank():
    xs = _data(2, 2, 4)
    by_keyword = sim.run_ranks(all_gather_hbm, [{"x": x} for x in xs], group=PAIR, ranks=2).outputs
    by_position = sim.run_ranks(all_gather_hbm, [(x, PAIR, 2) for x in xs]).outputs
    for a, b in zip(by_keyword, by_position):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match=r"run_ranks: rank_args\[0\] must be a tuple"):
        sim.run_ranks(all_gather_hbm, [xs[0]])
