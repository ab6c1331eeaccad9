"""How the torch ops reach an NKI kernel: the simulator for CPU tensors, TorchNeuron on Trainium.

This module is copied into every Hub kernel repo, so it imports nothing from kernels_neuron.
Before any kernel module is imported, ``nki`` must resolve: the real one on a Trainium host,
the simulator elsewhere (the Hub's cpu variant installs it from its ``nki-sim`` dependency).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

NEURON_DEVICE = "neuron"
SUPPORTED_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def op_namespace(module_name: str) -> str:
    """A torch.library namespace unique to the package that defines the ops.

    The same op source is loaded both as part of kernels_neuron and as Hub kernel packages
    (under names the kernels library chooses), so the namespace follows the top-level package.
    """
    return re.sub(r"\W", "_", module_name.split(".")[0])


def dtype_name(dtype: torch.dtype) -> str:
    """The NKI name of a torch dtype ("bfloat16", "float32", ...)."""
    return str(dtype).removeprefix("torch.")


def define_op(qualname: str, mutates_args: tuple = ()) -> Callable[[Callable[..., Any]], Any]:
    """Register a typed op: through TorchNeuron's ``nki_op`` on a Trainium host, else
    ``torch.library.custom_op``. Either way the result takes ``register_fake`` and
    ``register_autograd``. (The TorchNeuron branch cannot run here; it is kept import-safe.)"""
    try:
        from torch_neuronx import nki_op
    except ImportError:
        return torch.library.custom_op(qualname, mutates_args=mutates_args)
    return nki_op(qualname, mutates_args=set(mutates_args))


def run_kernel(kernel: Callable[..., Any], *args: Any) -> Any:
    """Launch an ``@nki.jit`` kernel on torch tensors.

    CPU tensors run on the simulator (``nki`` is the simulator there) and share memory with it;
    ``neuron`` tensors go to the device through TorchNeuron, whose ``nki.jit`` kernels accept
    device tensors directly.
    """
    devices = {a.device.type for a in args if isinstance(a, torch.Tensor)}
    if devices - {"cpu", NEURON_DEVICE}:
        raise RuntimeError(f"NKI kernels run on CPU (simulated) or neuron tensors, not on {sorted(devices)}")
    if len(devices) > 1:
        raise RuntimeError(f"kernel arguments are on several devices: {sorted(devices)}")
    return kernel(*args)


def check_float_tensor(op: str, name: str, tensor: torch.Tensor, contiguous: bool = True) -> None:
    """Clear errors for tensors an NKI kernel cannot take (``contiguous=False``: the caller makes
    them contiguous itself)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} has dtype {tensor.dtype}; supported: float32, bfloat16, float16")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{op}: {name} of shape {tuple(tensor.shape)} is not contiguous; call .contiguous() first")


def check_operands(op: str, named: list[tuple[str, torch.Tensor]], together: str) -> None:
    """``check_float_tensor`` for each named tensor, then one dtype and one device for all of them
    (``together`` names them in the errors, e.g. "x and the weights")."""
    for name, tensor in named:
        check_float_tensor(op, name, tensor)
    dtypes = {name: t.dtype for name, t in named}
    if len(set(dtypes.values())) != 1:
        raise TypeError(
            f"{op}: {together} must share one dtype, got "
            + ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
        )
    devices = {t.device for _, t in named}
    if len(devices) != 1:
        raise ValueError(f"{op}: {together} are on different devices: {sorted(map(str, devices))}")


def autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs matmul-like ops in on ``tensor``'s device, or None when
    autocast is off there. The ops cast to it as ``nn.Linear`` and sdpa do under autocast; the
    custom ops themselves are not autocast-aware (torch passes their inputs through unchanged)."""
    device_type = tensor.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def is_dtensor(tensor: Any) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a ``torch.distributed`` DTensor (a sharded or replicated parameter)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def tensor_reasons(name: str, tensor: torch.Tensor) -> list[str]:
    """Why a layer cannot hand ``tensor`` (a module's weight, or its input) to a kernel: a DTensor, or a
    dtype the kernels do not take; empty when it can."""
    if is_dtensor(tensor):
        return [f"{name} is a DTensor (sharded or replicated across ranks)"]
    if tensor.dtype not in SUPPORTED_FLOAT_DTYPES:
        return [f"{name} has dtype {tensor.dtype} (the kernel takes float32, bfloat16, float16)"]
    return []


def input_reasons(x: torch.Tensor, hidden: int) -> list[str]:
    """Why a norm layer cannot hand its input ``x`` to a kernel normalising over ``hidden``: the tensor's
    own reasons, an empty input, a last dim that is not ``hidden``; empty when it can."""
    reasons = tensor_reasons("the input", x)
    if x.numel() == 0:
        reasons.append(f"the input of shape {tuple(x.shape)} is empty")
    elif x.shape[-1] != hidden:
        reasons.append(f"the input's last dim {x.shape[-1]} differs from the hidden size {hidden}")
    return reasons


FALLBACK_ATTRIBUTE = "kernels_neuron_fallback"  # why a swapped module last ran its own forward
_warned: set[tuple[str, str]] = set()


def record_fallback(module: torch.nn.Module, reason: str) -> None:
    """Keep on ``module`` why the kernel did not serve this call (kernelize's report shows it) and
    warn once per class and reason. Nothing is recorded while torch.compile traces the call."""
    if torch.compiler.is_compiling():
        return
    setattr(module, FALLBACK_ATTRIBUTE, reason)
    key = (type(module).__qualname__, reason)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"kernels-neuron: {type(module).__name__} runs its own forward: {reason}", stacklevel=4)


def own_forward(module: torch.nn.Module, reason: str, *args: Any, **kwargs: Any) -> Any:
    """Run the forward ``module``'s class defines (the one a layer replaced) because the kernel cannot
    serve this call, recording why (``record_fallback``)."""
    record_fallback(module, reason)
    return type(module).forward(module, *args, **kwargs)


def nki_source(package: str | None, name: str) -> Any:
    """The NKI kernel module ``name``: bundled beside the ops in a Hub repo, else ``nki_src``."""
    import importlib
    import importlib.util

    if package and importlib.util.find_spec(f"{package}.nki_src") is not None:
        return importlib.import_module(f"{package}.nki_src.{name}")
    return importlib.import_module(f"nki_src.{name}")
