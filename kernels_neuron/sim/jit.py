"""``nki.jit`` / ``nki.simulate``: run a kernel function on NumPy arrays or torch CPU tensors.

Arguments become HBM tensors that share the caller's memory (so in-place writes reach the
caller); returned HBM tensors come back as arrays of the caller's kind (torch in, torch out).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
import pickle
import sys
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import cores, dtypes, runtime
from .errors import NkiValidationError
from .gc_pause import full_collections_paused
from .targets import Target, resolve
from .tensor import Tensor
from .trace import Trace


def _shared_captures() -> threading.local:
    """The open ``capture`` blocks, per thread, shared by every copy of the simulator in the process:
    kernels loaded from the Hub run on the ``nki-sim`` repo's copy of this code (a separate module
    object), and ``kernels_neuron.sim.capture()`` must see their launches too. The state lives on one
    module object registered under a fixed name in ``sys.modules``, which every copy finds."""
    holder = sys.modules.get(_CAPTURES_MODULE)
    if holder is None:
        holder = sys.modules.setdefault(_CAPTURES_MODULE, types.ModuleType(_CAPTURES_MODULE))
    if not hasattr(holder, "local"):
        vars(holder)["local"] = threading.local()  # ModuleType declares no ``local``: set it in the namespace
    return holder.local


_CAPTURES_MODULE = "_nki_simulator_captures"
_captures = _shared_captures()


class KernelInterfaceError(NkiValidationError, TypeError):
    """A kernel's arguments or return value break NKI's calling rules (also a ``TypeError``)."""


@dataclass
class SimResult:
    """What a simulated launch produced: the kernel's return value and its instruction trace.

    A trace-only launch (``numerics=False``) computes no results: its ``outputs`` are None.
    """

    outputs: Any
    trace: Trace
    numerics: bool = True


class Kernel:
    """A function decorated with ``@nki.jit``: call it to simulate, index it to launch an SPMD grid."""

    func: Callable[..., Any]

    def __init__(self, func: Callable[..., Any], grid: tuple[int, ...] | None = None, **options: Any) -> None:
        if isinstance(func, Kernel):
            func = func.func
        if not callable(func):
            raise TypeError(f"nki.jit expects a function, got {type(func).__name__}")
        self.func = func
        self.grid = grid
        self.options = options
        functools.update_wrapper(self, func)

    def __getitem__(self, grid: Any) -> Kernel:
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
        if not grid or any(int(g) < 1 for g in grid):
            raise ValueError(f"SPMD grid sizes must be positive integers, got {grid}")
        return Kernel(self.func, tuple(int(g) for g in grid), **self.options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if runtime.active() is not None and self.grid is None:
            # A jit kernel called from inside a running kernel is inlined, as the compiler does:
            # same run, same memory accounting, same trace.
            return self.func(*args, **kwargs)
        return launch(self, args, kwargs).outputs

    def __repr__(self) -> str:
        grid = f"[{', '.join(map(str, self.grid))}]" if self.grid else ""
        return f"<nki kernel {self.func.__name__}{grid}>"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickled by reference, as Python pickles functions: a process pool (``kernels-neuron bench
        # --jobs``) sends kernels to workers, which import the kernel's module themselves.
        where = (self.func.__module__, self.func.__qualname__)
        try:
            found = _kernel_named(*where)
        except (ImportError, AttributeError):
            found = None
        if found is not self.func:
            raise pickle.PicklingError(f"cannot pickle {self!r}: it is not reachable as {'.'.join(where)}")
        return _launchable, (*where, self.grid, self.options)


def _kernel_named(module: str, qualname: str) -> Callable[..., Any]:
    """The function behind the module-level kernel (or plain function) ``module.qualname``."""
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found.func if isinstance(found, Kernel) else found


def _launchable(module: str, qualname: str, grid: tuple[int, ...] | None, options: dict[str, Any]) -> Kernel:
    """A pickled :class:`Kernel`, rebuilt (see ``Kernel.__reduce__``)."""
    return Kernel(_kernel_named(module, qualname), grid, **options)


def jit(func: Callable[..., Any] | None = None, mode: str = "auto", **kwargs: Any) -> Any:
    """Decorate an NKI kernel; usable bare (``@nki.jit``) or with options (``@nki.jit(mode=...)``)."""
    if func is None:
        return lambda f: Kernel(f, mode=mode, **kwargs)
    return Kernel(func, mode=mode, **kwargs)


def simulate(kernel: Callable[..., Any]) -> Kernel:
    """``nki.simulate(kernel)(*args)``: run ``kernel`` on the CPU simulator (also ``[grid]``-indexable)."""
    return kernel if isinstance(kernel, Kernel) else Kernel(kernel)


def run(
    kernel: Callable[..., Any],
    *args: Any,
    target: str | Target | None = None,
    grid: Any = None,
    capacity: str = "error",
    seed: int = 0,
    strict_lnc: bool | None = None,
    numerics: bool = True,
    **kwargs: Any,
) -> SimResult:
    """Simulate one launch and return its outputs together with its trace.

    ``target`` is "trn1", "trn2" (default) or "trn3" (else ``NEURON_PLATFORM_TARGET_OVERRIDE``);
    ``capacity="warn"`` turns SBUF/PSUM overflow errors into warnings; ``strict_lnc=True`` (or
    ``KERNELS_NEURON_STRICT_LNC=1``) accepts only the launch brackets NKI documents, ``[1]`` and ``[2]``.

    ``numerics=False`` is a trace-only run, for cost modelling: every instruction checks its
    operands and records the same trace, but the engines' arithmetic is skipped. The inputs keep
    their values and data moved from them stays exact, so a kernel that reads input-derived values
    while it traces (routing tables into registers, gather indices) traces as it would; one that
    reads a value an instruction computed raises ``UncomputedValueError``. ``outputs`` is None, and
    an argument array the kernel wrote with uncomputed values is filled as never-written memory reads
    (NaN for floats).
    """
    k = simulate(kernel)
    if grid is not None:
        k = k[grid]
    return launch(
        k, args, kwargs, target=target, capacity=capacity, seed=seed, strict_lnc=strict_lnc, numerics=numerics
    )


class capture:
    """Collect the traces of every kernel launched inside a ``with`` block (e.g. a model forward)."""

    def __enter__(self) -> list[Trace]:
        self.traces: list[Trace] = []
        stack = getattr(_captures, "stack", None)
        if stack is None:
            stack = _captures.stack = []
        stack.append(self.traces)
        return self.traces

    def __exit__(self, *exc: object) -> None:
        _captures.stack.remove(self.traces)


STRICT_LNC_ENV = "KERNELS_NEURON_STRICT_LNC"


def _check_lnc_bracket(kernel: Kernel) -> None:
    """NKI's launch bracket holds one number, the LNC degree: 1 or 2 (lnc.rst, "Launching a kernel
    on multiple cores"). Wider or multi-dimensional SPMD grids are this simulator's extension."""
    grid = kernel.grid
    if grid is not None and (len(grid) != 1 or grid[0] not in (1, 2)):
        raise NkiValidationError(
            f"{kernel!r}: launch bracket: NKI takes one LNC degree, 1 or 2 (grid={list(grid)}); SPMD grids of "
            f"any shape are a kernels-neuron simulator extension, available without strict_lnc / {STRICT_LNC_ENV}"
        )


def launch(
    kernel: Kernel,
    args: tuple,
    kwargs: dict,
    *,
    target: str | Target | None = None,
    capacity: str = "error",
    seed: int = 0,
    strict_lnc: bool | None = None,
    numerics: bool = True,
) -> SimResult:
    outputs, trace = _launch_ranks(kernel, [(args, kwargs)], target, capacity, seed, strict_lnc, numerics)
    return SimResult(outputs[0] if numerics else None, trace, numerics)


def run_ranks(
    kernel: Callable[..., Any],
    rank_args: Sequence[tuple | list | Mapping[str, Any]],
    *,
    target: str | Target | None = None,
    grid: Any = None,
    capacity: str = "error",
    seed: int = 0,
    strict_lnc: bool | None = None,
    numerics: bool = True,
    **kwargs: Any,
) -> SimResult:
    """Launch ``kernel`` as ``len(rank_args)`` ranks, the way a collective job runs one kernel per rank,
    and return every rank's outputs (a list, by rank) with one trace.

    ``rank_args[r]`` is rank ``r``'s arguments: a tuple (or list) of positional arguments or a mapping of
    keyword arguments; ``kwargs`` go to every rank. Each rank is its own (logical) NeuronCore with its own
    SBUF, PSUM and HBM tensors; ``grid`` is each rank's launch (``grid=2``: LNC=2, two programs per rank).
    ``nki.collectives`` calls exchange data between ranks: ``rank_id()`` is ``r``, and a collective blocks
    until every rank of its replica group has made the matching call. Each trace record names its rank
    (``Instruction.rank``), and the cost model models each rank's programs on their own cores. The other
    options are :func:`run`'s; a trace-only run (``numerics=False``) has ``outputs`` None.
    """
    if not rank_args:
        raise ValueError("run_ranks: rank_args must hold each rank's arguments (at least one rank)")
    inputs: list[tuple[tuple, dict]] = []
    for rank, given in enumerate(rank_args):
        if isinstance(given, Mapping):
            inputs.append(((), {**kwargs, **given}))
        elif isinstance(given, (tuple, list)):
            inputs.append((tuple(given), dict(kwargs)))
        else:
            raise TypeError(
                f"run_ranks: rank_args[{rank}] must be a tuple of positional or a mapping of keyword arguments, "
                f"got {type(given).__name__}"
            )
    k = simulate(kernel)
    if grid is not None:
        k = k[grid]
    outputs, trace = _launch_ranks(k, inputs, target, capacity, seed, strict_lnc, numerics)
    return SimResult(outputs if numerics else None, trace, numerics)


@full_collections_paused()
def _launch_ranks(
    kernel: Kernel,
    inputs: list[tuple[tuple, dict]],
    target: str | Target | None,
    capacity: str,
    seed: int,
    strict_lnc: bool | None,
    numerics: bool,
) -> tuple[list[Any], Trace]:
    """Run every program of every rank (``inputs[r]`` is rank r's (args, kwargs)); each rank's outputs."""
    if strict_lnc is None:
        strict_lnc = os.environ.get(STRICT_LNC_ENV, "") not in ("", "0")
    if strict_lnc:
        _check_lnc_bracket(kernel)
    chosen = resolve(target)
    torch_in = any(_is_torch(a) for args, kwargs in inputs for a in itertools.chain(args, kwargs.values()))
    trace = Trace(chosen.name, kernel=getattr(kernel.func, "__name__", ""))
    grid = kernel.grid or (1,)
    ranks = len(inputs)
    shared: list[dict[int, runtime.Buffer]] = [{} for _ in inputs]  # each rank's own shared_hbm
    outputs: list[Any] = [None] * ranks
    programs: cores.Programs | None = None
    uncomputed: set[int] = set()  # shared by the programs, as their arguments' memory is
    arguments: list[runtime.Buffer] = []

    def run_program(rank: int, program: tuple[int, ...]) -> None:
        args, kwargs = inputs[rank]
        rt = runtime.Run(
            chosen,
            capacity=capacity,
            program_id=tuple(int(p) for p in program),
            grid=grid,
            trace=trace,
            shared=shared[rank],
            seed=seed,
            explicit_grid=kernel.grid is not None,
            numerics=numerics,
            uncomputed=uncomputed,
            rank=rank,
            ranks=ranks,
        )
        rt.cores = programs
        with runtime.activate(rt):
            hbm_args = [_to_hbm(rt, a, f"arg{i}") for i, a in enumerate(args)]
            hbm_kwargs = {k: _to_hbm(rt, v, k) for k, v in kwargs.items()}
            arguments.extend(t._buf for t in _tensors(hbm_args) + _tensors(list(hbm_kwargs.values())))
            returned = kernel.func(*hbm_args, **hbm_kwargs)
            rt.memory.finish()
            outputs[rank] = _from_hbm(returned, torch_in) if numerics else None

    every_program = [(rank, p) for rank in range(ranks) for p in np.ndindex(*grid)]
    if len(every_program) == 1:
        run_program(*every_program[0])
    else:
        # One program at a time, in order; cores.Programs lets programs that wait for each other
        # (sendrecv, core_barrier, collectives) hand over.
        labels = None
        if ranks > 1:
            labels = [f"rank {rank}" + (f" program {list(p)}" if grid != (1,) else "") for rank, p in every_program]
        programs = cores.Programs([functools.partial(run_program, *rp) for rp in every_program], labels)
        programs.run()
        # run_program's closure holds the scheduler, which holds run_program: dropping it breaks the cycle,
        # so the trace is freed with its last reference rather than at the next full garbage collection.
        programs = None
    for buf in arguments:
        if buf.address in uncomputed:
            # In-place results a trace-only run did not compute must not pass for results.
            buf.data[...] = dtypes.uninitialized_fill(buf.dtype)
    for sink in getattr(_captures, "stack", None) or ():
        sink.append(trace)
    return outputs, trace


def _tensors(values: list) -> list[Tensor]:
    """The tensors among kernel arguments (lists and tuples of them included)."""
    found: list[Tensor] = []
    for value in values:
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(_tensors(list(value)))
    return found


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _to_hbm(rt: runtime.Run, value: Any, name: str) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_to_hbm(rt, v, f"{name}[{i}]") for i, v in enumerate(value))
    if _is_torch(value):
        value = dtypes.torch_to_numpy(value)
    if isinstance(value, np.ndarray):
        if value.dtype == np.float64 or value.dtype == np.int64:
            raise KernelInterfaceError(
                f"nki.jit: argument {name!r}: dtype {value.dtype} has no NKI engine support "
                f"(shape={list(value.shape)}); pass float32/bfloat16/int32 data"
            )
        if not value.flags.writeable:
            value = value.copy()
        return Tensor(rt.wrap_hbm(value, name))
    return value


def _single_program_hbm(value: Tensor) -> bool:
    """An ``nl.hbm`` tensor returned by a kernel launched without a grid: AWS's API examples
    (``nki.isa.nonzero_with_count``) return one, so it is an output like ``nl.shared_hbm``."""
    return value.buffer == "hbm" and runtime.current().grid == (1,)


def _from_hbm(value: Any, torch_out: bool) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_from_hbm(v, torch_out) for v in value)
    if isinstance(value, dict):
        return {k: _from_hbm(v, torch_out) for k, v in value.items()}
    if isinstance(value, Tensor):
        if value.on_chip:
            raise KernelInterfaceError(
                f"nki.jit: return value: {value!r} is in {value.buffer.upper()}; kernels return HBM tensors: "
                "dma_copy it into an nl.shared_hbm tensor first"
            )
        if value.buffer != "shared_hbm" and not _single_program_hbm(value):
            raise KernelInterfaceError(
                f"nki.jit: return value: {value!r} is in private HBM ({value.buffer}); kernel outputs "
                "must be allocated with buffer=nl.shared_hbm (an nl.hbm output is accepted only "
                "without an SPMD grid, where the one program's HBM is the kernel's)"
            )
        array = np.array(value.read(), copy=True)
        return dtypes.numpy_to_torch(array) if torch_out else array
    return value
