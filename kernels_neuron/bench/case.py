"""A benchmark case and the record it produces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

# How a case was simulated (``Record.simulation``).
TRACE_ONLY = "trace-only"
CHECKED = "trace-only, checked against a full simulation"


class NkiKernel(Protocol):
    """An ``@nki.jit`` kernel (the simulator's or real NKI's): called to launch it, indexed by an SPMD
    grid to launch that grid."""

    __name__: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __getitem__(self, grid: Any) -> NkiKernel: ...


@dataclass(frozen=True)
class Case:
    """One kernel on one shape from a real model, beside the PyTorch computation it replaces.

    ``make_inputs(seed, values=True)`` returns the kernel's positional arguments (arrays as NumPy
    arrays); ``kwargs`` are passed to the kernel unchanged. With ``values=False`` the drawn data (and
    what is computed from them) are zeros of the same shapes and dtypes, allocated, never drawn: the
    kernels' traces do not depend on those values, and drawing a full-size model's weights takes longer
    than simulating the kernel. What the trace depends on (a block table, an MoE routing) is the same
    either way.

    ``prepare_reference`` takes exactly the kernel's arguments and keyword arguments, with the arrays as
    torch tensors, and returns the call a device timing loop repeats: the PyTorch computation the kernel replaces, returning what the kernel
    returns (the leading outputs, where the kernel also returns state saved for a backward). Work
    that is not part of that computation (a backward's forward graph) is done before it returns.
    """

    name: str
    kernel: NkiKernel
    make_inputs: Callable[..., tuple]  # (seed: int, values: bool = True) -> the kernel's arguments
    shape: dict[str, int | float | str]  # the dimensions, and options that shape the work (window, packing)
    dtype: str
    model: str
    reference_name: str
    prepare_reference: Callable[..., Callable[[], Any]]
    kwargs: dict[str, Any] = field(default_factory=dict)
    grid: Any = None
    # The FLOPs the field reports for this op (e.g. attention's 4*Sq*Sk*d, halved when causal);
    # None counts every TensorE FLOP in the trace (transposes included).
    standard_flops: int | None = None


@dataclass
class Record:
    """What one case produced. ``modelled_*`` come from the cost model; ``measured_*`` only from a device."""

    name: str
    kernel: str
    model: str
    shape: dict[str, int | float | str]
    dtype: str
    target: str
    reference: str
    modelled_us: float
    roofline_us: float
    bound: str
    pct_of_roofline: float
    flops: int
    tflops: float
    pct_tensor_peak: float
    hbm_bytes: int
    hbm_gbps: float
    pct_hbm_peak: float
    sim_wall_s: float
    instructions: int
    measured_us: float | None = None
    reference_measured_us: float | None = None
    # How the case was simulated: "trace-only" (the engines' arithmetic skipped; the cost model
    # reads only the trace), or also in full with the traces checked identical (--check-numerics).
    simulation: str = TRACE_ONLY

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
