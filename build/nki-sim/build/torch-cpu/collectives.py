"""``nki.collectives``: data exchange between the ranks of a multi-rank launch (``sim.run_ranks``).

A collective job runs one kernel per rank; each rank is a (logical) NeuronCore with its own SBUF, PSUM
and HBM. A collective call blocks its program until the same program (same ``nl.program_id``) of every
rank of its replica group has made its matching call, the k-th collective call on a group matching the
k-th call of the others; then each participant reads what the others posted when they arrived and
writes its own destinations. Calls that do not match (another collective, other parameters) are an
error, and a wait nothing can satisfy is reported as a deadlock naming the ranks and the call (the
launch's programs are run by ``cores.Programs``, one at a time, handing over at waits).

Under LNC=2 each rank runs two programs, one per physical core, and each takes part in its own
collective with the same-numbered program of the other ranks (nki-library's SBUF all-gather kernels
gather each program's own tile this way).

Modelling choices where AWS's reference is silent (README, "How it differs from hardware"): reductions
accumulate in fp32 in the replica group's rank order and round once; sources and destinations of one
call have one dtype; ring collectives send to the next rank of the rank list (the last to the first),
on every channel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import dtypes, operands, runtime
from .errors import require_generation, rule
from .isa import VirtualRegister
from .language import NKIObject
from .ops import Op, as_alu
from .tensor import Tensor, innermost_run

REDUCE_OPS = ("add", "minimum", "maximum")
PRIORITY_LEVELS = (0, 1, 2, 3)  # DMA quality of service, 0 the highest; NeuronCore-v4+
PRIORITY_MIN_GENERATION = 4
# Channels of collective_permute_implicit[_reduce]: up to 4 for a replica group holding every device of
# a node, 2 for any other (their docstrings).
MAX_CHANNELS_WHOLE_NODE = 4
MAX_CHANNELS = 2
# A node's chips (trn1.32xlarge and trn2.48xlarge: 16 Trainium chips; trn3: the 16 Trainium3 devices of
# a Gen1 UltraServer's server, trn3-arch.rst) and physical NeuronCores per chip (2, 8, 8); a rank is one
# NeuronCore at LNC=1 and two at LNC=2 (neuron-runtime/about/collectives.rst, "System Connectivity").
CHIPS_PER_NODE = {"trn1": 16, "trn2": 16, "trn3": 16}
CORES_PER_CHIP = {"trn1": 2, "trn2": 8, "trn3": 8}
ALL_GATHER_V_RANKS = 4  # all_gather_v's rank lists: exactly 4 ranks, one chip at LNC=2
METADATA_ROWS = {False: 3, True: 4}  # by has_rdispls


class ReplicaGroup(NKIObject):
    """The ranks that take part in a collective: a list of rank lists (sub-groups), each rank in at most
    one. A call involves the sub-group holding the calling rank. AWS's reference does not name the
    field; AWS's kernels construct it positionally, ``ReplicaGroup([[0, 1, 2, 3]])``."""

    replica_groups: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        where = "ncc.ReplicaGroup"
        lists = self.replica_groups
        if not isinstance(lists, (list, tuple)) or not lists:
            raise rule(where, "replica_groups", "must be a non-empty list of rank lists", value=lists)
        seen: set[int] = set()
        groups = []
        for i, ranks in enumerate(lists):
            if not isinstance(ranks, (list, tuple)) or not ranks:
                raise rule(where, f"replica_groups[{i}]", "must be a non-empty list of ranks", value=ranks)
            group = tuple(int(r) for r in ranks)
            for rank in group:
                if rank < 0:
                    raise rule(where, f"replica_groups[{i}]", "ranks are non-negative", rank=rank)
                if rank in seen:
                    raise rule(where, f"replica_groups[{i}]", "sub-groups must not overlap", rank=rank)
                seen.add(rank)
            groups.append(group)
        object.__setattr__(self, "replica_groups", tuple(groups))


# ---------------------------------------------------------------------------------------------
# checks shared by the calls
# ---------------------------------------------------------------------------------------------
def _name(function: str) -> str:
    return f"ncc.{function}"


def _check_priority(instr: str, run: runtime.Run, priority: Any) -> None:
    if priority is None:
        return
    require_generation(instr, "priority", run.target, PRIORITY_MIN_GENERATION, "DMA priority")
    if int(priority) not in PRIORITY_LEVELS:
        raise rule(instr, "priority", "must be a level from 0 to 3", value=priority)


def _sub_group(instr: str, run: runtime.Run, replica_group: Any) -> tuple[int, ...]:
    """The rank list of ``replica_group`` that holds the calling rank."""
    if not isinstance(replica_group, ReplicaGroup):
        raise rule(instr, "replica_group", "must be a nki.collectives.ReplicaGroup", value=type(replica_group).__name__)
    for group in replica_group.replica_groups:
        for rank in group:
            if rank >= run.ranks:
                raise rule(
                    instr,
                    "replica_group",
                    "names a rank the launch does not have (launch several ranks with sim.run_ranks)",
                    rank=rank,
                    ranks=run.ranks,
                )
    for group in replica_group.replica_groups:
        if run.rank in group:
            return group
    raise rule(instr, "replica_group", "no rank list holds the calling rank", rank=run.rank)


def _tensors(instr: str, role: str, value: Any, exactly_one: bool = False) -> list[Tensor]:
    if not isinstance(value, (list, tuple)) or not value:
        raise rule(instr, role, "must be a non-empty list of tensors", value=type(value).__name__)
    if exactly_one and len(value) != 1:
        raise rule(instr, role, "must hold exactly one tensor (coalesced lists are not supported)", count=len(value))
    return [operands.tile(t, instr, f"{role}[{i}]") for i, t in enumerate(value)]


def _placed(instr: str, srcs: list[Tensor], dsts: list[Tensor], allowed: Sequence[str]) -> str:
    """Where the tensors of a call live, "hbm" or "sbuf": all in one, coalesced lists on HBM only."""
    named = [(f"srcs[{i}]", t) for i, t in enumerate(srcs)] + [(f"dsts[{i}]", t) for i, t in enumerate(dsts)]
    for role, t in named:
        operands.where(t, instr, role, allowed)
    kinds = {"sbuf" if t.on_chip else "hbm" for _, t in named}
    if len(kinds) > 1:
        mixed = ", ".join(f"{role}={t.buffer}" for role, t in named)
        raise rule(instr, "srcs/dsts", "all tensors must be on HBM or all on SBUF, not mixed", buffers=mixed)
    if len(srcs) != len(dsts):
        raise rule(instr, "dsts", "must hold one tensor per source", srcs=len(srcs), dsts=len(dsts))
    kind = kinds.pop()
    if kind == "sbuf" and len(srcs) > 1:
        raise rule(instr, "srcs", "coalesced collectives (several tensors) need HBM tensors", count=len(srcs))
    if kind == "sbuf":
        _two_dimensional(instr, srcs + dsts)
    return kind


def _same_dtype(instr: str, role: str, t: Tensor, src: Tensor) -> None:
    if t.dtype != src.dtype:
        raise rule(instr, role, "must have its source's dtype", dtype=dtypes.name(t.dtype), src=dtypes.name(src.dtype))


def _reduce_op(instr: str, op: Any) -> Op:
    resolved = as_alu(op, instr)
    if resolved.name not in REDUCE_OPS:
        raise rule(instr, "op", "must be nl.add, nl.minimum or nl.maximum", op=resolved.name)
    return resolved


def _collective_dim(instr: str, value: Any, allowed: Sequence[int], why: str) -> int:
    dim = int(value)
    if dim not in allowed:
        raise rule(instr, "collective_dim", why, value=dim, allowed=list(allowed))
    return dim


def _lnc(run: runtime.Run) -> int:
    """The launch's LNC degree: 2 for a launch of two programs per rank (``kernel[2]``), else 1."""
    return 2 if run.grid[0] == 2 and run.target.generation >= 3 else 1


def _ranks_per_chip(run: runtime.Run) -> int:
    return max(CORES_PER_CHIP[run.target.name] // _lnc(run), 1)


def _ranks_per_node(run: runtime.Run) -> int:
    return CHIPS_PER_NODE[run.target.name] * _ranks_per_chip(run)


def _whole_units(group: Sequence[int], size: int) -> bool:
    """Whether ``group`` holds every rank of each unit (chip, node) of ``size`` ranks it touches."""
    members = set(group)
    return all(set(range(r - r % size, r - r % size + size)) <= members for r in members)


# ---------------------------------------------------------------------------------------------
# meeting the other ranks
# ---------------------------------------------------------------------------------------------
Posted = list[tuple[np.ndarray, bool]]  # a participant's values, and whether they were computed


def _post(run: runtime.Run, tensors: Sequence[Tensor]) -> Posted:
    """What a participant contributes: a copy of its sources as they are when it arrives."""
    return [(np.array(t.read(), copy=True), run.computed(t._buf)) for t in tensors]


def _meet(instr: str, run: runtime.Run, group: tuple[int, ...], signature: tuple, posted: Any) -> dict[int, Any]:
    """Block until the same program of every rank in ``group`` has made this call; their posts, by rank."""
    if len(group) == 1:
        return {run.rank: posted}
    programs = run.cores
    state = programs.collectives
    counter = ("calls", run.rank, run.program_id, group)
    call = state.get(counter, 0)
    state[counter] = call + 1
    key = ("call", group, run.program_id, call)
    arrived: dict[int, tuple[str, tuple, Any]] = state.setdefault(key, {})
    arrived[run.rank] = (instr, signature, posted)

    def missing() -> list[int]:
        return [r for r in group if r not in arrived]

    program = f" program {list(run.program_id)}" if run.grid != (1,) else ""
    programs.wait(
        lambda: not missing(),
        lambda: (
            f"{instr} (collective call {call + 1}{program} of ranks {list(group)}; ranks {missing()} never make it)"
        ),
    )
    for rank in group:
        their_instr, their_signature, _ = arrived[rank]
        if (their_instr, their_signature) != (instr, signature):
            raise rule(
                instr,
                "replica_group",
                "every rank of the group must make the same collective call, with the same arguments, in the same order",
                rank=run.rank,
                call=f"{instr}{signature}",
                **{f"rank_{rank}": f"{their_instr}{their_signature}"},
            )
    result = {rank: arrived[rank][2] for rank in group}
    readers = ("read", key)
    state[readers] = state.get(readers, 0) + 1
    if state[readers] == len(group):  # everyone has what it needs: free the posts
        del state[key], state[readers]
    return result


def _write(instr: str, dst: Tensor, values: np.ndarray | None, computed: bool) -> None:
    if computed and values is not None:
        dst.write(values, instr)
    else:
        dst.write_uncomputed(instr)


def _signature(*tensors: Tensor) -> tuple:
    return tuple((t.shape, dtypes.name(t.dtype)) for t in tensors)


def _reduced(op: Op, parts: Sequence[np.ndarray]) -> np.ndarray:
    """``op`` over the parts in order, in the engines' fp32 (ints exact)."""
    combine = op.binary
    assert combine is not None  # _reduce_op accepts binary operators only
    total = dtypes.to_engine(np.asarray(parts[0]))
    for part in parts[1:]:
        total = combine(total, dtypes.to_engine(np.asarray(part)))
    return np.asarray(total)


def _contiguous_bytes(t: Tensor) -> int:
    view = t._view
    shape, strides = (view.shape[1:], view.strides[1:]) if t.on_chip else (view.shape, view.strides)
    return innermost_run(shape, strides, view.itemsize)


def _record(
    run: runtime.Run,
    function: str,
    reads: list[tuple[str, Tensor]],
    writes: list[tuple[str, Tensor]],
    group: Sequence[int],
    **attrs: Any,
) -> None:
    """Trace a collective as one DMA of the larger of what this rank reads and writes (docs/hardware.md)."""
    moved = max(sum(t.nbytes for _, t in reads), sum(t.nbytes for _, t in writes))
    data = [t for _, t in reads + writes]
    partitions = max(t.partition_size for t in data)
    run.record(
        "dma",
        function,
        reads=reads,
        writes=writes,
        bytes_moved=moved,
        partitions=partitions,
        bytes_per_partition=moved // partitions,
        contiguous_bytes=min(_contiguous_bytes(t) for t in data),
        replica_group=list(group),
        **attrs,
    )


def _roles(role: str, tensors: Sequence[Tensor]) -> list[tuple[str, Tensor]]:
    return [(f"{role}[{i}]", t) for i, t in enumerate(tensors)]


# ---------------------------------------------------------------------------------------------
# rank ids
# ---------------------------------------------------------------------------------------------
def rank_id(name: str | None = None) -> VirtualRegister:
    """The calling rank's id (its index in ``sim.run_ranks``), in a register: usable as an access
    pattern's ``scalar_offset``, as AWS's kernels use it."""
    return VirtualRegister(runtime.current().rank)


def collective_permute_implicit_current_processing_rank_id(
    iteration_id: int, replica_group: ReplicaGroup, channel_id: int = 0, name: str | None = None
) -> VirtualRegister:
    """The rank whose data a ring collective holds at step ``iteration_id``: the calling rank at step 0,
    then its predecessor's, its predecessor's predecessor's, ... around the rank list."""
    instr = _name("collective_permute_implicit_current_processing_rank_id")
    run = runtime.current()
    group = _sub_group(instr, run, replica_group)
    channel = int(channel_id)
    limit = _max_channels(run, group)
    if not 0 <= channel < limit:
        raise rule(
            instr, "channel_id", "must be a channel of the ring, 0 to num_channels - 1", value=channel, limit=limit
        )
    steps = int(iteration_id)
    return VirtualRegister(group[(group.index(run.rank) - steps) % len(group)])


# ---------------------------------------------------------------------------------------------
# all_reduce, all_gather, reduce_scatter, all_to_all
# ---------------------------------------------------------------------------------------------
def all_reduce(
    srcs: list[Tensor],
    dsts: list[Tensor],
    replica_group: ReplicaGroup,
    op: Any,
    priority: int | None = None,
    name: str | None = None,
) -> None:
    """Every rank of the group gets, in each ``dsts[i]``, ``op`` over the group's ``srcs[i]``."""
    instr = _name("all_reduce")
    run = runtime.current()
    srcs, dsts = _tensors(instr, "srcs", srcs), _tensors(instr, "dsts", dsts)
    _placed(instr, srcs, dsts, ("hbm", "sbuf"))
    _check_priority(instr, run, priority)
    reduce = _reduce_op(instr, op)
    group = _sub_group(instr, run, replica_group)
    for i, (src, dst) in enumerate(zip(srcs, dsts)):
        _same_dtype(instr, f"dsts[{i}]", dst, src)
        if dst.shape != src.shape:
            raise rule(instr, f"dsts[{i}]", "must have its source's shape", dst=list(dst.shape), src=list(src.shape))
    posts = _meet(instr, run, group, (reduce.name, _signature(*srcs)), _post(run, srcs))
    for i, dst in enumerate(dsts):
        parts = [posts[rank][i] for rank in group]
        computed = all(done for _, done in parts)
        _write(instr, dst, _reduced(reduce, [v for v, _ in parts]) if computed else None, computed)
    _record(run, "all_reduce", _roles("srcs", srcs), _roles("dsts", dsts), group, reduce_op=reduce.name)


def all_gather(
    srcs: list[Tensor],
    dsts: list[Tensor],
    replica_group: ReplicaGroup,
    collective_dim: int,
    priority: int | None = None,
    name: str | None = None,
) -> None:
    """Every rank gets, in each ``dsts[i]``, the group's ``srcs[i]`` concatenated along ``collective_dim``
    in rank-list order."""
    instr = _name("all_gather")
    run = runtime.current()
    srcs, dsts = _tensors(instr, "srcs", srcs), _tensors(instr, "dsts", dsts)
    kind = _placed(instr, srcs, dsts, ("hbm", "sbuf"))
    _check_priority(instr, run, priority)
    if kind == "hbm":
        dim = _collective_dim(instr, collective_dim, (0,), "HBM all-gathers concatenate along dim 0 only")
    else:
        dim = _collective_dim(instr, collective_dim, (0, 1), "SBUF all-gathers concatenate along dim 0 or 1")
    group = _sub_group(instr, run, replica_group)
    for i, (src, dst) in enumerate(zip(srcs, dsts)):
        _same_dtype(instr, f"dsts[{i}]", dst, src)
        _check_split(instr, f"dsts[{i}]", dst.shape, src.shape, dim, len(group), "concatenation")
    posts = _meet(instr, run, group, (dim, _signature(*srcs)), _post(run, srcs))
    for i, dst in enumerate(dsts):
        parts = [posts[rank][i] for rank in group]
        computed = all(done for _, done in parts)
        values = np.concatenate([v for v, _ in parts], axis=dim) if computed else None
        _write(instr, dst, values, computed)
    _record(run, "all_gather", _roles("srcs", srcs), _roles("dsts", dsts), group, collective_dim=dim)


def reduce_scatter(
    srcs: list[Tensor],
    dsts: list[Tensor],
    replica_group: ReplicaGroup,
    collective_dim: int,
    op: Any,
    priority: int | None = None,
    name: str | None = None,
) -> None:
    """``op`` over the group's ``srcs[i]``, split into equal chunks along ``collective_dim``: the rank at
    position p of the rank list gets chunk p in ``dsts[i]``."""
    instr = _name("reduce_scatter")
    run = runtime.current()
    srcs, dsts = _tensors(instr, "srcs", srcs), _tensors(instr, "dsts", dsts)
    _placed(instr, srcs, dsts, ("hbm", "sbuf"))
    _check_priority(instr, run, priority)
    dim = _collective_dim(instr, collective_dim, (0,), "reduce-scatters split along dim 0 only")
    reduce = _reduce_op(instr, op)
    group = _sub_group(instr, run, replica_group)
    for i, (src, dst) in enumerate(zip(srcs, dsts)):
        _same_dtype(instr, f"dsts[{i}]", dst, src)
        _check_split(instr, f"srcs[{i}]", src.shape, dst.shape, dim, len(group), "split")
    posts = _meet(instr, run, group, (dim, reduce.name, _signature(*srcs)), _post(run, srcs))
    me = group.index(run.rank)
    for i, dst in enumerate(dsts):
        parts = [posts[rank][i] for rank in group]
        computed = all(done for _, done in parts)
        values = None
        if computed:
            values = np.split(_reduced(reduce, [v for v, _ in parts]), len(group), axis=dim)[me]
        _write(instr, dst, values, computed)
    _record(run, "reduce_scatter", _roles("srcs", srcs), _roles("dsts", dsts), group, reduce_op=reduce.name)


def all_to_all(
    srcs: list[Tensor],
    dsts: list[Tensor],
    replica_group: ReplicaGroup,
    collective_dim: int,
    priority: int | None = None,
    name: str | None = None,
) -> None:
    """Each ``srcs[i]`` splits into equal chunks along ``collective_dim``, chunk p going to the rank at
    position p of the rank list; ``dsts[i]`` is the chunks received, in rank-list order."""
    instr = _name("all_to_all")
    run = runtime.current()
    srcs, dsts = _tensors(instr, "srcs", srcs), _tensors(instr, "dsts", dsts)
    _placed(instr, srcs, dsts, ("hbm",))
    _check_priority(instr, run, priority)
    dim = _collective_dim(instr, collective_dim, (0,), "all-to-alls split and concatenate along dim 0 only")
    group = _sub_group(instr, run, replica_group)
    for i, (src, dst) in enumerate(zip(srcs, dsts)):
        _same_dtype(instr, f"dsts[{i}]", dst, src)
        if dst.shape != src.shape:
            raise rule(instr, f"dsts[{i}]", "must have its source's shape", dst=list(dst.shape), src=list(src.shape))
        if src.shape[dim] % len(group):
            raise rule(
                instr,
                f"srcs[{i}]",
                f"dim {dim} must split into one equal chunk per rank",
                shape=list(src.shape),
                ranks=len(group),
            )
    posts = _meet(instr, run, group, (dim, _signature(*srcs)), _post(run, srcs))
    me = group.index(run.rank)
    for i, dst in enumerate(dsts):
        parts = [posts[rank][i] for rank in group]
        computed = all(done for _, done in parts)
        values = None
        if computed:
            values = np.concatenate([np.split(v, len(group), axis=dim)[me] for v, _ in parts], axis=dim)
        _write(instr, dst, values, computed)
    _record(run, "all_to_all", _roles("srcs", srcs), _roles("dsts", dsts), group, collective_dim=dim)


def _two_dimensional(instr: str, tensors: Sequence[Tensor]) -> None:
    for t in tensors:
        if t.ndim != 2:
            raise rule(
                instr, "srcs/dsts", "SBUF collectives take 2-D tensors (partitions, one free dim)", shape=list(t.shape)
            )


def _check_split(
    instr: str, role: str, whole: tuple[int, ...], part: tuple[int, ...], dim: int, ranks: int, what: str
) -> None:
    """``whole`` must be the shape of ``ranks`` tensors of shape ``part`` concatenated along ``dim``."""
    expected = list(part)
    expected[dim] *= ranks
    if list(whole) != expected:
        raise rule(
            instr,
            role,
            f"must be the {what} of one source chunk per rank along dim {dim}",
            shape=list(whole),
            expected=expected,
            ranks=ranks,
        )


# ---------------------------------------------------------------------------------------------
# all_gather_v, all_to_all_v: sizes from a metadata tensor
# ---------------------------------------------------------------------------------------------
def _metadata(instr: str, metadata: Any, rows: int, ranks: int) -> tuple[Tensor, Callable[[int], Tensor]]:
    """Check the metadata tensor; return it and a view of each of its rows."""
    t = operands.tile(metadata, instr, "metadata_tensor")
    operands.where(t, instr, "metadata_tensor", ("hbm", "sbuf"))
    if t.dtype != dtypes.uint32:
        raise rule(instr, "metadata_tensor", "must be uint32", dtype=dtypes.name(t.dtype))
    expected = (1, rows, ranks) if t.on_chip else (rows, ranks)
    if t.shape != expected:
        raise rule(
            instr,
            "metadata_tensor",
            f"must be {'(1, rows, ranks) on SBUF' if t.on_chip else '(rows, ranks) on HBM'}, with rows "
            "3 (4 with has_rdispls)",
            shape=list(t.shape),
            expected=list(expected),
        )
    if not t.is_contiguous():
        raise rule(instr, "metadata_tensor", "must be laid out contiguously", strides=list(t.strides))
    return t, (lambda row: t[0:1, row, :] if t.on_chip else t[row : row + 1, :])


def _row(instr: str, row: Tensor) -> list[int]:
    return [int(v) for v in np.asarray(row.computed_values(instr, "metadata_tensor")).reshape(-1)]


def _flat(instr: str, role: str, t: Tensor) -> Tensor:
    if not t.is_contiguous():
        raise rule(instr, role, "is read as a flat element buffer and must be contiguous", strides=list(t.strides))
    return t.reshape((t.size,))


def _v_collective_operands(instr: str, run: runtime.Run, srcs: Any, dsts: Any, priority: Any) -> tuple[Tensor, Tensor]:
    src, dst = _tensors(instr, "srcs", srcs, exactly_one=True)[0], _tensors(instr, "dsts", dsts, exactly_one=True)[0]
    for role, t in (("srcs[0]", src), ("dsts[0]", dst)):
        operands.where(t, instr, role, ("hbm",))
    _same_dtype(instr, "dsts[0]", dst, src)
    _check_priority(instr, run, priority)
    return src, dst


def _chunk(instr: str, flat_src: Tensor, posted: tuple[np.ndarray, bool], start: int, count: int, sender: int) -> tuple:
    size = flat_src.size
    if start + count > size:
        raise rule(
            instr,
            "metadata_tensor",
            "a send chunk runs past the end of srcs[0]",
            rank=sender,
            send_displ=start,
            send_count=count,
            src_elements=size,
        )
    values, computed = posted
    return values.reshape(-1)[start : start + count], computed


def _receive(
    instr: str,
    flat_dst: Tensor,
    chunks: list[tuple[np.ndarray, bool]],
    displacements: list[int],
    slot: int | None,
) -> list[int]:
    """Write each sender's chunk at its displacement; the element counts received, by sender position."""
    counts = []
    for position, ((values, computed), start) in enumerate(zip(chunks, displacements)):
        count = values.size
        if (slot is not None and count > slot) or start + count > flat_dst.size:
            raise rule(
                instr,
                "dsts[0]",
                "a received chunk does not fit its place in dsts[0]",
                from_rank_position=position,
                recv_displ=start,
                recv_count=count,
                slot_elements=slot,
                dst_elements=flat_dst.size,
            )
        if count:
            _write(instr, flat_dst[start : start + count], values, computed)
        counts.append(count)
    return counts


def _finish_v(
    instr: str,
    run: runtime.Run,
    op: str,
    operands: tuple[Tensor, Tensor, Tensor, Tensor],
    counts: list[int],
    recv_counts_known: bool,
    group: tuple[int, ...],
) -> None:
    """A v-form's end: the received counts into metadata row 2 (unless ``recv_counts_known``), and the
    trace record. ``operands``: src, dst, the metadata tensor and its row 2."""
    src, dst, metadata, counts_row = operands
    writes = [("dsts[0]", dst)]
    if not recv_counts_known:
        counts_row.write(np.asarray(counts, dtype=np.uint32).reshape(counts_row.shape), instr)
        writes.append(("metadata_tensor", counts_row))
    _record(run, op, [("srcs[0]", src), ("metadata_tensor", metadata)], writes, group)


def all_gather_v(
    srcs: list[Tensor],
    dsts: list[Tensor],
    replica_group: ReplicaGroup,
    metadata_tensor: Tensor,
    recv_counts_known: bool = False,
    has_rdispls: bool = False,
    priority: int | None = None,
    name: str | None = None,
) -> None:
    """Each rank broadcasts ``src[send_displ : send_displ + send_count]`` (metadata rows 0 and 1, first
    column) to the group; the chunk of the rank at position s lands at ``dst[s * slot : s * slot + count]``,
    ``slot = dst.size / ranks``. Row 2 receives the counts unless ``recv_counts_known``."""
    instr = _name("all_gather_v")
    run = runtime.current()
    src, dst = _v_collective_operands(instr, run, srcs, dsts, priority)
    if has_rdispls:
        raise rule(instr, "has_rdispls", "True is not supported yet", value=has_rdispls)
    if _lnc(run) != 2:
        raise rule(
            instr,
            "launch",
            "only LNC=2 launches are supported (kernel[2])",
            grid=list(run.grid),
            target=run.target.name,
        )
    group = _sub_group(instr, run, replica_group)
    if len(group) != ALL_GATHER_V_RANKS or not _whole_units(group, _ranks_per_chip(run)):
        raise rule(
            instr, "replica_group", "each rank list must hold exactly the 4 ranks of one chip", ranks=list(group)
        )
    metadata, row = _metadata(instr, metadata_tensor, METADATA_ROWS[False], len(group))
    send_count, send_displ = _row(instr, row(0))[0], _row(instr, row(1))[0]
    flat_src, flat_dst = _flat(instr, "srcs[0]", src), _flat(instr, "dsts[0]", dst)
    mine = _chunk(instr, flat_src, _post(run, [src])[0], send_displ, send_count, run.rank)
    posts = _meet(instr, run, group, (_signature(src, dst), recv_counts_known), mine)
    slot = dst.size // len(group)
    chunks = [posts[rank] for rank in group]
    counts = _receive(instr, flat_dst, chunks, [p * slot for p in range(len(group))], slot)
    _finish_v(instr, run, "all_gather_v", (src, dst, metadata, row(2)), counts, recv_counts_known, group)


def all_to_all_v(
    srcs: list[Tensor],
    dsts: list[Tensor],
    replica_group: ReplicaGroup,
    metadata_tensor: Tensor,
    recv_counts_known: bool = False,
    has_rdispls: bool = False,
    priority: int | None = None,
    name: str | None = None,
) -> None:
    """Each rank sends ``src[send_displs[p] : send_displs[p] + send_counts[p]]`` (metadata rows 0 and 1)
    to the rank at position p; the chunk from the rank at position s lands at ``recv_displs[s]`` (row 3,
    with ``has_rdispls``) or ``s * dst.size / ranks``. Row 2 receives the counts unless ``recv_counts_known``."""
    instr = _name("all_to_all_v")
    run = runtime.current()
    src, dst = _v_collective_operands(instr, run, srcs, dsts, priority)
    group = _sub_group(instr, run, replica_group)
    _check_all_to_all_v_topology(instr, run, group, bool(has_rdispls))
    metadata, row = _metadata(instr, metadata_tensor, METADATA_ROWS[bool(has_rdispls)], len(group))
    send_counts, send_displs = _row(instr, row(0)), _row(instr, row(1))
    flat_src, flat_dst = _flat(instr, "srcs[0]", src), _flat(instr, "dsts[0]", dst)
    posted = _post(run, [src])[0]
    mine = [_chunk(instr, flat_src, posted, send_displs[p], send_counts[p], run.rank) for p in range(len(group))]
    posts = _meet(instr, run, group, (_signature(src, dst), recv_counts_known, bool(has_rdispls)), mine)
    me = group.index(run.rank)
    chunks = [posts[rank][me] for rank in group]
    slot = dst.size // len(group)
    if has_rdispls:
        counts = _receive(instr, flat_dst, chunks, _row(instr, row(3)), None)
    else:
        counts = _receive(instr, flat_dst, chunks, [p * slot for p in range(len(group))], slot)
    _finish_v(instr, run, "all_to_all_v", (src, dst, metadata, row(2)), counts, recv_counts_known, group)


def _check_all_to_all_v_topology(instr: str, run: runtime.Run, group: tuple[int, ...], has_rdispls: bool) -> None:
    """all_to_all_v's current restrictions: on Trn3 (NeuronSwitch) an LNC=2 launch whose rank lists are
    whole devices, more than one; elsewhere inter-node rank lists (same-indexed ranks of different nodes),
    and no ``has_rdispls``."""
    if run.target.name == "trn3":
        if _lnc(run) != 2:
            raise rule(instr, "launch", "on NeuronSwitch instances (trn3) only LNC=2 is supported", grid=list(run.grid))
        per_device = _ranks_per_chip(run)
        devices = {r // per_device for r in group}
        if not _whole_units(group, per_device) or len(devices) < 2:
            raise rule(
                instr,
                "replica_group",
                "on NeuronSwitch instances (trn3) each rank list must hold every rank of each device it uses, "
                "on more than one device",
                ranks=list(group),
                ranks_per_device=per_device,
            )
        return
    if has_rdispls:
        raise rule(
            instr, "has_rdispls", "True is supported on NeuronSwitch instances (trn3) only", target=run.target.name
        )
    per_node = _ranks_per_node(run)
    nodes = [r // per_node for r in group]
    if len({r % per_node for r in group}) != 1 or len(set(nodes)) != len(group) or len(group) < 2:
        raise rule(
            instr,
            "replica_group",
            "outside NeuronSwitch instances, each rank list must hold same-indexed ranks of different nodes",
            ranks=list(group),
            ranks_per_node=per_node,
        )


# ---------------------------------------------------------------------------------------------
# permutes
# ---------------------------------------------------------------------------------------------
def collective_permute(
    srcs: list[Tensor],
    dsts: list[Tensor],
    source_target_pairs: list[tuple[int, int]],
    priority: int | None = None,
    name: str | None = None,
) -> None:
    """For each ``(source, target)`` pair, the target's ``dsts[0]`` receives the source's ``srcs[0]``.
    Only the ranks in the pairs take part; a rank that is no pair's target keeps its ``dsts[0]``."""
    instr = _name("collective_permute")
    run = runtime.current()
    src = _tensors(instr, "srcs", srcs, exactly_one=True)[0]
    dst = _tensors(instr, "dsts", dsts, exactly_one=True)[0]
    _placed(instr, [src], [dst], ("hbm",))
    _check_priority(instr, run, priority)
    _same_dtype(instr, "dsts[0]", dst, src)
    pairs = _pairs(instr, run, source_target_pairs)
    group = tuple(sorted({r for pair in pairs for r in pair}))
    if run.rank not in group:
        return
    posts = _meet(instr, run, group, (tuple(pairs), _signature(src)), _post(run, [src])[0])
    reads: list[tuple[str, Tensor]] = []
    writes: list[tuple[str, Tensor]] = []
    for source, target in pairs:
        if source == run.rank:
            reads = [("srcs[0]", src)]
        if target == run.rank:
            values, computed = posts[source]
            if values.size != dst.size:
                raise rule(
                    instr,
                    "dsts[0]",
                    "must hold as many elements as the source's srcs[0]",
                    dst=list(dst.shape),
                    src=list(values.shape),
                )
            _write(instr, dst, values, computed)
            writes = [("dsts[0]", dst)]
    _record(run, "collective_permute", reads, writes, group)


def _pairs(instr: str, run: runtime.Run, given: Any) -> list[tuple[int, int]]:
    if not isinstance(given, (list, tuple)) or not given:
        raise rule(instr, "source_target_pairs", "must be a non-empty list of (source, target) rank pairs", value=given)
    pairs = []
    for pair in given:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise rule(instr, "source_target_pairs", "each entry is a (source, target) pair", value=pair)
        source, target = int(pair[0]), int(pair[1])
        for rank in (source, target):
            if not 0 <= rank < run.ranks:
                raise rule(
                    instr,
                    "source_target_pairs",
                    "names a rank the launch does not have (launch several ranks with sim.run_ranks)",
                    rank=rank,
                    ranks=run.ranks,
                )
        pairs.append((source, target))
    for index, what in ((0, "source"), (1, "target")):
        ranks = [pair[index] for pair in pairs]
        if len(set(ranks)) != len(ranks):
            raise rule(instr, "source_target_pairs", f"a rank may be the {what} of one pair only", pairs=pairs)
    return pairs


def _max_channels(run: runtime.Run, group: Sequence[int]) -> int:
    return MAX_CHANNELS_WHOLE_NODE if _whole_units(group, _ranks_per_node(run)) else MAX_CHANNELS


def _channels(
    instr: str, run: runtime.Run, group: tuple[int, ...], channel_ids: Any, lists: dict[str, Any]
) -> list[list[Tensor]]:
    """Check the channel ids and the per-channel tensor lists; the tensors, by list then channel."""
    ids = [int(c) for c in channel_ids]
    if ids != list(range(len(ids))) or not ids:
        raise rule(instr, "channel_ids", "must be consecutive integers starting from 0", value=ids)
    limit = _max_channels(run, group)
    if len(ids) > limit:
        raise rule(
            instr,
            "channel_ids",
            "too many channels: 4 for a replica group holding every device of a node, 2 otherwise",
            channels=len(ids),
            limit=limit,
        )
    found = []
    for role, by_channel in lists.items():
        if not isinstance(by_channel, (list, tuple)) or len(by_channel) != len(ids):
            count = len(by_channel) if isinstance(by_channel, (list, tuple)) else type(by_channel).__name__
            raise rule(instr, role, "must hold one tensor list per channel", lists=count, channels=len(ids))
        found.append(
            [_tensors(instr, f"{role}[{c}]", inner, exactly_one=True)[0] for c, inner in enumerate(by_channel)]
        )
    return found


def _ring(
    instr: str,
    function: str,
    run: runtime.Run,
    replica_group: ReplicaGroup,
    channel_ids: Any,
    lists: dict[str, Any],
    priority: Any,
    op: Any = None,
) -> None:
    """Each rank sends each channel's source (``op`` over two, for the reducing form) to the next rank of
    its rank list and receives the previous rank's into that channel's destination."""
    group = _sub_group(instr, run, replica_group)
    *sources, dsts = _channels(instr, run, group, channel_ids, lists)
    _check_priority(instr, run, priority)
    reduce = _reduce_op(instr, op) if op is not None else None
    roles = list(lists)
    for channel, dst in enumerate(dsts):
        for role, by_channel in zip(roles, sources):
            _same_dtype(instr, f"{roles[-1]}[{channel}]", dst, by_channel[channel])
            if by_channel[channel].size != dst.size:
                raise rule(
                    instr,
                    f"{roles[-1]}[{channel}]",
                    f"must hold as many elements as {role}[{channel}]",
                    dst=list(dst.shape),
                    src=list(by_channel[channel].shape),
                )
    sent = []
    for channel in range(len(dsts)):
        parts = _post(run, [by_channel[channel] for by_channel in sources])
        computed = all(done for _, done in parts)
        if reduce is not None:
            values = _reduced(reduce, [v for v, _ in parts]) if computed else parts[0][0]
        else:
            values = parts[0][0]
        sent.append((values, computed))
    signature = (_signature(*dsts), reduce.name if reduce else None)
    posts = _meet(instr, run, group, signature, sent)
    previous = group[(group.index(run.rank) - 1) % len(group)]
    for channel, dst in enumerate(dsts):
        values, computed = posts[previous][channel]
        _write(instr, dst, values if computed else None, computed)
    reads = [(f"{role}[{c}]", t) for role, by_channel in zip(roles, sources) for c, t in enumerate(by_channel)]
    writes = [(f"{roles[-1]}[{c}]", t) for c, t in enumerate(dsts)]
    attrs: dict[str, Any] = {"channels": len(dsts)}
    if reduce is not None:
        attrs["reduce_op"] = reduce.name
    _record(run, function, reads, writes, group, **attrs)


def collective_permute_implicit(
    srcs_by_channel: list[list[Tensor]],
    dsts_by_channel: list[list[Tensor]],
    replica_group: ReplicaGroup,
    channel_ids: list[int] = [0],  # noqa: B006 - AWS's signature; never mutated
    priority: int | None = None,
    name: str | None = None,
) -> None:
    """A ring step: on each channel, send ``srcs_by_channel[c][0]`` to the next rank of the rank list and
    receive the previous rank's into ``dsts_by_channel[c][0]``."""
    instr = _name("collective_permute_implicit")
    run = runtime.current()
    lists = {"srcs_by_channel": srcs_by_channel, "dsts_by_channel": dsts_by_channel}
    _ring(instr, "collective_permute_implicit", run, replica_group, channel_ids, lists, priority)


def collective_permute_implicit_reduce(
    srcs0_by_channel: list[list[Tensor]],
    srcs1_by_channel: list[list[Tensor]],
    dsts_by_channel: list[list[Tensor]],
    replica_group: ReplicaGroup,
    op: Any,
    channel_ids: list[int] = [0],  # noqa: B006 - AWS's signature; never mutated
    priority: int | None = None,
    name: str | None = None,
) -> None:
    """A reducing ring step: on each channel, send ``op(srcs0[c][0], srcs1[c][0])`` to the next rank of
    the rank list and receive the previous rank's result into ``dsts_by_channel[c][0]``."""
    instr = _name("collective_permute_implicit_reduce")
    run = runtime.current()
    lists = {
        "srcs0_by_channel": srcs0_by_channel,
        "srcs1_by_channel": srcs1_by_channel,
        "dsts_by_channel": dsts_by_channel,
    }
    _ring(instr, "collective_permute_implicit_reduce", run, replica_group, channel_ids, lists, priority, op=op)
