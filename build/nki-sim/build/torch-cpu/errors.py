"""Errors the simulator raises when a kernel breaks an NKI or hardware rule."""

from __future__ import annotations

from typing import Any


class NkiValidationError(Exception):
    """A kernel broke a rule the NKI compiler or the NeuronCore enforces.

    Messages name the instruction, the operand, the offending value and the limit, so that the
    fix is obvious without reading the simulator.
    """


class CapacityError(NkiValidationError):
    """Live SBUF or PSUM tensors need more bytes per partition than the target has."""


class AliasingError(NkiValidationError):
    """A tile placed at an explicit address (``nl.ndarray(address=...)``) reads bytes another tile
    placed over it has written since: on hardware it would read that tile's data."""


class CapacityWarning(UserWarning):
    """Like :class:`CapacityError`, raised as a warning when the kernel asked for warnings."""


class AccumulateOntoNonMatmulWarning(UserWarning):
    """``nc_matmul`` accumulating onto PSUM that memset, tensor_copy or another non-matmul instruction
    wrote: undefined on NeuronCore-v2/v3 by AWS's docs, relied on by AWS's trn2 kernels; warned about."""


class AccumulateUninitializedWarning(UserWarning):
    """``nc_matmul(accumulate=True)`` onto PSUM no instruction has written: undefined on hardware,
    warned about as AWS's simulator does."""


class UncomputedValueError(RuntimeError):
    """A trace-only run (``numerics=False``) needed a value it did not compute: the kernel reads, while
    it traces, a value an instruction computed (a register load, a dynamic loop bound, an offset, a
    gather index). Such a kernel's trace depends on its data; run it with ``numerics=True``."""


class NoActiveKernel(RuntimeError):
    """An NKI call was made outside a running ``@nki.jit`` kernel."""


def rule(instruction: str, operand: str, problem: str, **facts: Any) -> NkiValidationError:
    """Build the error for a broken rule: ``nisa.nc_matmul: stationary: ... (value=..., limit=...)``."""
    detail = ", ".join(f"{key}={value}" for key, value in facts.items())
    message = f"{instruction}: {operand}: {problem}"
    if detail:
        message += f" ({detail})"
    return NkiValidationError(message)


def too_old(instruction: str, operand: str, target: str, generation: int, what: str = "") -> NkiValidationError:
    """The error for a feature of NeuronCore-v``generation`` and newer used on an older ``target``:
    ``nisa.rand2: target: rand2 needs NeuronCore-v4 or newer (target=trn2)``."""
    return rule(
        instruction, operand, f"{what + ' ' if what else ''}needs NeuronCore-v{generation} or newer", target=target
    )


def require_generation(instruction: str, operand: str, target: Any, generation: int, what: str = "") -> None:
    """Raise :func:`too_old` unless ``target`` (a ``targets.Target``) is NeuronCore-v``generation`` or newer."""
    if target.generation < generation:
        raise too_old(instruction, operand, target.name, generation, what)
