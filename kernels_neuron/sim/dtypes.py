"""NKI data types, their NumPy storage, and rounding on write.

Every NKI dtype is stored in the NumPy dtype with the same bits (bf16 and fp8 through
``ml_dtypes``). ``tfloat32`` has no NumPy type: it is stored as float32 whose mantissa is
rounded to 10 bits on every write, which is what the hardware keeps of it.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike


class SpecialDType:
    """A dtype NumPy lacks: stored in ``storage`` with its own rounding and name."""

    __slots__ = ("name", "storage", "itemsize")

    def __init__(self, name: str, storage: DTypeLike, itemsize: int) -> None:
        self.name = name
        self.storage = np.dtype(storage)
        self.itemsize = itemsize

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SpecialDType):
            return other.name == self.name
        return isinstance(other, str) and other == self.name

    def __hash__(self) -> int:
        return hash(self.name)


DType = np.dtype | SpecialDType

bool_ = np.dtype(np.bool_)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
# NKI's float8_e4m3 is the IEEE-style e4m3 (max 240, has inf); float8_e4m3fn is OCP's (max 448).
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
# An exponent-only byte (2**(e - 127), 0xFF is NaN): the power-of-two scale of MX formats.
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)
tfloat32 = SpecialDType("tfloat32", np.float32, 4)
# Four values packed along the contraction dim for Trn3's MX instructions: four 8-bit values in 32
# bits, or four 4-bit values in 16 bits (AWS's MXFP matmul guide: "The float4_*_x4 type is 16-bits wide").
float8_e5m2_x4 = SpecialDType("float8_e5m2_x4", np.uint32, 4)
float8_e4m3fn_x4 = SpecialDType("float8_e4m3fn_x4", np.uint32, 4)
float4_e2m1fn_x4 = SpecialDType("float4_e2m1fn_x4", np.uint16, 2)

_BY_NAME: dict[str, DType] = {
    "bool": bool_,
    "bool_": bool_,
    "int8": int8,
    "int16": int16,
    "int32": int32,
    "uint8": uint8,
    "uint16": uint16,
    "uint32": uint32,
    "float16": float16,
    "float32": float32,
    "bfloat16": bfloat16,
    "float8_e4m3": float8_e4m3,
    "float8_e4m3fn": float8_e4m3fn,
    "float8_e5m2": float8_e5m2,
    "float8_e8m0fnu": float8_e8m0fnu,
    "tfloat32": tfloat32,
    "float8_e5m2_x4": float8_e5m2_x4,
    "float8_e4m3fn_x4": float8_e4m3fn_x4,
    "float4_e2m1fn_x4": float4_e2m1fn_x4,
}
_SUPPORTED_NUMPY = {d for d in _BY_NAME.values() if isinstance(d, np.dtype)}
PACKED_X4 = (float8_e5m2_x4, float8_e4m3fn_x4, float4_e2m1fn_x4)
FP8 = (float8_e4m3, float8_e4m3fn, float8_e5m2)


def canonical(dtype: Any) -> DType:
    """Map any spelling of a dtype (NKI constant, NumPy dtype or type, torch dtype, name) to NKI's."""
    if isinstance(dtype, SpecialDType):
        return dtype
    if isinstance(dtype, str):
        found = _BY_NAME.get(dtype)
        if found is None:
            raise TypeError(f"unknown NKI dtype {dtype!r}; known: {sorted(_BY_NAME)}")
        return found
    if dtype is bool:
        return bool_
    torch_name = _torch_dtype_name(dtype)
    if torch_name is not None:
        return canonical(torch_name)
    try:
        np_dtype = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{dtype!r} is not a dtype NKI knows") from exc
    if np_dtype not in _SUPPORTED_NUMPY:
        raise TypeError(f"dtype {np_dtype} is not an NKI dtype (float64/int64 have no engine support)")
    return np_dtype


def _torch_dtype_name(dtype: Any) -> str | None:
    module = type(dtype).__module__
    if module != "torch":
        return None
    return str(dtype).removeprefix("torch.")


def storage(dtype: DType) -> np.dtype:
    """The NumPy dtype that holds a tensor of ``dtype``."""
    return dtype.storage if isinstance(dtype, SpecialDType) else dtype


def itemsize(dtype: DType) -> int:
    return dtype.itemsize


_NAMES: dict[DType, str] = {}


def name(dtype: DType) -> str:
    """NKI's name for a dtype ("bfloat16", "float32", ...); cached, as it sits on the hot path."""
    found = _NAMES.get(dtype)
    if found is None:
        found = dtype.name if isinstance(dtype, SpecialDType) else ("bfloat16" if dtype == bfloat16 else str(dtype))
        _NAMES[dtype] = found
    return found


def is_float(dtype: DType) -> bool:
    if dtype == tfloat32:
        return True
    if isinstance(dtype, SpecialDType):
        return False
    return dtype.kind == "f" or dtype in FP8 or dtype == bfloat16 or dtype == float8_e8m0fnu


def is_int(dtype: DType) -> bool:
    return isinstance(dtype, np.dtype) and dtype.kind in "iu"


def _round_to_tf32(values: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    finite = np.isfinite(values)
    # Round to nearest even on the 13 dropped mantissa bits.
    lsb = (bits >> 13) & 1
    rounded = ((bits + 0x0FFF + lsb) & 0xFFFFE000).astype(np.uint32)
    return np.where(finite, rounded.view(np.float32), values).astype(np.float32)


def cast(values: np.ndarray, dtype: DType) -> np.ndarray:
    """Round fp32 engine results to ``dtype`` as a write does: nearest-even, saturating ints."""
    target = storage(dtype)
    if dtype == tfloat32:
        return _round_to_tf32(np.asarray(values, dtype=np.float32))
    values = np.asarray(values)
    if values.dtype == target:
        return values
    if is_int(dtype) and values.dtype.kind == "f":
        info = np.iinfo(target)
        # Clip in float64, which holds every int32/uint32 bound exactly (in fp32, 2**31 - 1 rounds
        # up to 2**31 and the cast would wrap to the other end of the range).
        with np.errstate(invalid="ignore"):
            clipped = np.clip(np.rint(values.astype(np.float64)), info.min, info.max)
        return np.nan_to_num(clipped, nan=0).astype(target)
    if dtype == bool_:
        return values != 0
    return values.astype(target)


def to_engine(values: np.ndarray) -> np.ndarray:
    """Widen stored values to the engines' fp32 arithmetic (ints stay exact in int64)."""
    if values.dtype.kind in "iu":
        return values.astype(np.int64)
    if values.dtype == np.bool_:
        return values.astype(np.float32)
    return values.astype(np.float32, copy=False)


def uninitialized_fill(dtype: DType) -> Any:
    """What never-written memory reads as: NaN for floats, a fixed sentinel for ints."""
    if is_float(dtype):
        return np.nan
    if dtype == bool_:
        return True
    return 4  # the official simulator's integer sentinel


def torch_to_numpy(t: Any) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory. Through DLPack, not ``Tensor.numpy()``: that marks the
    tensor's storage as not resizable for good, and FSDP frees unsharded parameters with
    ``storage.resize_(0)`` after each forward."""
    import torch

    if t.device.type != "cpu":
        raise TypeError(f"the NKI simulator runs on CPU tensors; got a tensor on {t.device}")
    t = t.detach()
    bits = {
        torch.bfloat16: (torch.int16, bfloat16),
        torch.float8_e4m3fn: (torch.uint8, float8_e4m3fn),
        torch.float8_e5m2: (torch.uint8, float8_e5m2),
    }.get(t.dtype)
    if bits is not None:
        return np.from_dlpack(t.view(bits[0])).view(bits[1])
    return np.from_dlpack(t)


def numpy_to_torch(a: np.ndarray) -> Any:
    """A CPU tensor sharing ``a``'s memory (bf16 and fp8 through their bits; IEEE-style e4m3, which
    torch lacks, as a float32 copy)."""
    import torch

    bits = {
        bfloat16: (np.int16, torch.bfloat16),
        float8_e4m3fn: (np.uint8, torch.float8_e4m3fn),
        float8_e5m2: (np.uint8, torch.float8_e5m2),
    }.get(a.dtype)
    if bits is not None:
        return torch.from_numpy(a.view(bits[0])).view(bits[1])
    if a.dtype == float8_e4m3:  # IEEE-style e4m3 has no torch dtype
        return torch.from_numpy(a.astype(np.float32))
    return torch.from_numpy(a)
