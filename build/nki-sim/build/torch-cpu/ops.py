"""NKI's math operators: ALU operators for Vector/GpSimd and activation functions for ScalarE.

In NKI the same object (``nl.add``, ``nl.exp``) is both a callable and the ``op=`` argument of
ISA instructions. Here each is an :class:`Op` carrying its NumPy semantics in fp32; calling it
runs the matching ``nki.language`` function.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import frontend, runtime
from .errors import rule, too_old

Array = np.ndarray
# What the engines' operator functions take: tiles' values, scalars, and [P, 1] columns (converted with np.asarray).
Binary = Callable[[ArrayLike, ArrayLike], Array]
Unary = Callable[[ArrayLike], Array]

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _erf32(x: Array) -> Array:
    return _erf(x.astype(np.float64)).astype(np.float32)


class Op:
    """An NKI operator. ``binary(a, b)`` for ALU use, ``unary(x)`` for activation/unary use.

    ``kind`` is "arith", "bitvec", "compare" or "logical" for ALU operators; ``identity`` is the
    start value when the operator reduces.
    """

    __slots__ = ("name", "binary", "unary", "kind", "identity")

    def __init__(
        self,
        name: str,
        *,
        binary: Binary | None = None,
        unary: Unary | None = None,
        kind: str = "arith",
        identity: float | None = None,
    ) -> None:
        self.name = name
        self.binary = binary
        self.unary = unary
        self.kind = kind
        self.identity = identity

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``nl.exp(x)``, ``nl.add(a, b)``: the element-wise ``nki.language`` function of the operator."""
        return frontend.language().apply_operator(self, *args, **kwargs)

    def __repr__(self) -> str:
        return f"nl.{self.name}"


def _ints(fn: Callable[[Array, Array], Array]) -> Binary:
    def run(a: ArrayLike, b: ArrayLike) -> Array:
        return fn(np.asarray(a).astype(np.int64), np.asarray(b).astype(np.int64))

    return run


def _logical_right_shift(a: Array, b: Array) -> Array:
    # The bitvec ALU shifts 32-bit words with zeros coming in (AWS's operator table lists
    # right_shift as a logical shift; an arithmetic one is "Not supported"): -8 >> 1 is 0x7FFFFFFC.
    return np.right_shift(a & 0xFFFFFFFF, b)


def _fp32(fn: Callable[..., Array]) -> Callable[..., Array]:
    def run(*xs: ArrayLike) -> Array:
        with np.errstate(all="ignore"):
            return np.asarray(fn(*[np.asarray(x, dtype=np.float32) for x in xs]), dtype=np.float32)

    return run


def _abs_pick(take_larger: bool) -> Callable[[Array, Array], Array]:
    def run(a: Array, b: Array) -> Array:
        pick_a = np.abs(a) > np.abs(b) if take_larger else np.abs(a) < np.abs(b)
        return np.where(pick_a, a, b)  # ties go to b, as documented

    return run


def _sigmoid(x: Array) -> Array:
    return 1.0 / (1.0 + np.exp(-x))


def _gelu_tanh(x: Array) -> Array:
    return 0.5 * x * (1.0 + np.tanh(np.float32(math.sqrt(2.0 / math.pi)) * (x + 0.044715 * x**3)))


def _gelu_dx(x: Array) -> Array:
    cdf = 0.5 * (1.0 + _erf32(x / np.float32(math.sqrt(2.0))))
    pdf = np.exp(-0.5 * x * x) / np.float32(math.sqrt(2.0 * math.pi))
    return cdf + x * pdf


def _silu_dx(x: Array) -> Array:
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _gelu_sig_dx(x: Array) -> Array:
    s = _sigmoid(1.702 * x)
    return s + 1.702 * x * s * (1.0 - s)


def _scalar_engine_sin(x: Array) -> Array:
    """ScalarE's sin: no range reduction; beyond [-pi, pi] the polynomial's cubic continues, i.e.
    sin's third-order expansion about the nearer of +-pi, so sin(9.0) is ~27.65 (nki.api.shared.rst,
    the note under the activation table; AWS's simulator reproduces it)."""
    edge = np.where(x > 0, np.float32(np.pi), np.float32(-np.pi)).astype(np.float32)
    d = x - edge
    return np.where(np.abs(x) <= np.float32(np.pi), np.sin(x), d * d * d / np.float32(6.0) - d)


def _softplus(x: Array) -> Array:
    return np.logaddexp(np.float32(0.0), x)


ARITH = {
    "add": Op("add", binary=_fp32(np.add), identity=0.0),
    "subtract": Op("subtract", binary=_fp32(np.subtract), identity=0.0),
    "multiply": Op("multiply", binary=_fp32(np.multiply), identity=1.0),
    "divide": Op("divide", binary=_fp32(np.divide)),
    "maximum": Op("maximum", binary=_fp32(np.maximum), identity=-np.inf),
    "minimum": Op("minimum", binary=_fp32(np.minimum), identity=np.inf),
    "power": Op("power", binary=_fp32(np.power)),
    "abs_max": Op("abs_max", binary=_fp32(_abs_pick(True)), identity=0.0),
    "abs_min": Op("abs_min", binary=_fp32(_abs_pick(False)), identity=np.inf),
    "fmod": Op("fmod", binary=_fp32(np.fmod)),
    "mod": Op("mod", binary=_fp32(np.mod)),
}
COMPARE = {
    name: Op(name, binary=_fp32(lambda a, b, f=f: f(a, b).astype(np.float32)), kind="compare")
    for name, f in {
        "equal": np.equal,
        "not_equal": np.not_equal,
        "greater": np.greater,
        "greater_equal": np.greater_equal,
        "less": np.less,
        "less_equal": np.less_equal,
    }.items()
}
LOGICAL = {
    name: Op(name, binary=_fp32(lambda a, b, f=f: f(a != 0, b != 0).astype(np.float32)), kind="logical")
    for name, f in {"logical_and": np.logical_and, "logical_or": np.logical_or, "logical_xor": np.logical_xor}.items()
}
LOGICAL["logical_not"] = Op("logical_not", unary=_fp32(lambda x: (x == 0).astype(np.float32)), kind="logical")
BITVEC = {
    "bitwise_and": Op("bitwise_and", binary=_ints(np.bitwise_and), kind="bitvec"),
    "bitwise_or": Op("bitwise_or", binary=_ints(np.bitwise_or), kind="bitvec"),
    "bitwise_xor": Op("bitwise_xor", binary=_ints(np.bitwise_xor), kind="bitvec"),
    "left_shift": Op("left_shift", binary=_ints(np.left_shift), kind="bitvec"),
    "right_shift": Op("right_shift", binary=_ints(_logical_right_shift), kind="bitvec"),
    "invert": Op("invert", unary=lambda x: np.invert(np.asarray(x).astype(np.int64)), kind="bitvec"),
}
_ACTIVATION_FNS: dict[str, Callable[[Array], Array]] = {
    "copy": lambda x: x,
    "identity": lambda x: x,
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "reciprocal": lambda x: 1.0 / x,
    "tanh": np.tanh,
    "sigmoid": _sigmoid,
    "relu": lambda x: np.maximum(x, 0.0),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf32(x / np.float32(math.sqrt(2.0)))),
    "gelu_apprx_tanh": _gelu_tanh,
    "gelu_apprx_sigmoid": lambda x: x * _sigmoid(1.702 * x),
    "gelu_dx": _gelu_dx,
    "gelu_apprx_sigmoid_dx": _gelu_sig_dx,
    "silu": lambda x: x * _sigmoid(x),
    "silu_dx": _silu_dx,
    "softplus": _softplus,
    "mish": lambda x: x * np.tanh(_softplus(x)),
    "erf": _erf32,
    "erf_dx": lambda x: np.float32(2.0 / math.sqrt(math.pi)) * np.exp(-x * x),
    "sin": _scalar_engine_sin,
    "cos": np.cos,
    "tan": np.tan,
    "arctan": np.arctan,
    "ceil": np.ceil,
    "floor": np.floor,
    "trunc": np.trunc,
    "negative": np.negative,
    "sign": np.sign,
    "square": np.square,
    "softsign": lambda x: x / (1.0 + np.abs(x)),
}
ACTIVATION = {name: Op(name, unary=_fp32(fn)) for name, fn in _ACTIVATION_FNS.items()}
# Operators that are both: usable as activation functions and as (unary) ALU operators.
ACTIVATION["abs"] = Op("abs", unary=_fp32(np.abs), binary=_fp32(lambda a, b: np.abs(a)))
ACTIVATION["rsqrt"].binary = _fp32(lambda a, b: 1.0 / np.sqrt(a))
ACTIVATION["reciprocal"].binary = _fp32(lambda a, b: 1.0 / a)
# AWS's ALU operator table lists square and relu as unary arithmetic operators too (operand ignored).
ACTIVATION["square"].binary = _fp32(lambda a, b: np.square(a))
ACTIVATION["relu"].binary = _fp32(lambda a, b: np.maximum(a, 0.0))
# ``bypass`` skips a stage of a two-operator instruction; as an activation it copies.
BYPASS = Op("bypass", unary=_fp32(lambda x: x), binary=_fp32(lambda a, b: a))
PRELU = Op("prelu", unary=_fp32(lambda x: x))  # slope comes from relu_param at the call site

# nki.language.abs_max / abs_min: "Available only on NeuronCore-v4 (trn3) and newer".
NEURONCORE_V4_OPS = frozenset({"abs_max", "abs_min"})

# ``nl.average``: a reduction operator (tensor_partition_reduce), the mean of what it reduces;
# as a binary it is the mean of its two operands.
AVERAGE = Op("average", binary=_fp32(lambda a, b: (a + b) * np.float32(0.5)))

ALL: dict[str, Op] = {
    **ARITH,
    **COMPARE,
    **LOGICAL,
    **BITVEC,
    **ACTIVATION,
    "bypass": BYPASS,
    "prelu": PRELU,
    "average": AVERAGE,
}


def as_alu(op: Any, instruction: str, role: str = "op") -> Op:
    """Resolve an ``op=`` argument to a binary ALU operator, or raise naming the instruction."""
    resolved = getattr(op, "alu_op", op)  # nl.max / nl.sum etc. stand for maximum / add
    if isinstance(resolved, Op) and resolved.binary is not None:
        run = runtime.active()
        if resolved.name in NEURONCORE_V4_OPS and run is not None and run.target.generation < 4:
            raise too_old(instruction, role, run.target.name, 4, f"nl.{resolved.name}")
        return resolved
    raise _bad_op(instruction, role, op, "an ALU operator (nl.add, nl.multiply, nl.maximum, ...)")


def as_activation(op: Any, instruction: str, role: str = "op") -> Op:
    if isinstance(op, Op) and op.unary is not None:
        return op
    raise _bad_op(instruction, role, op, "an activation function (nl.exp, nl.silu, nl.copy, ...)")


def _bad_op(instruction: str, role: str, op: Any, wanted: str) -> Exception:
    return rule(instruction, role, f"{op!r} is not {wanted}")
