"""``nki.typing``: annotations for kernel arguments and tiles.

AWS's examples annotate with ``from nki.typing import tensor`` (``x: tensor``,
``t: tensor[128, 512] = nl.load(...)``) and the nki-library with ``nt.mutable_tensor`` for outputs a
kernel writes in place. Annotations carry no behaviour: Python does not check them, and neither does
NKI when it runs a kernel.
"""

from __future__ import annotations

from typing import Any

from .tensor import Tensor


class _TensorAnnotationMeta(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, Tensor)

    def __getitem__(cls, params: Any) -> TensorAnnotation:
        return TensorAnnotation(cls, params if isinstance(params, tuple) else (params,))


class tensor(metaclass=_TensorAnnotationMeta):  # noqa: N801  (NKI's name)
    """An NKI tensor, optionally subscripted with its shape (and dtype): ``tensor[128, 512]``."""


class mutable_tensor(tensor):  # noqa: N801  (NKI's name)
    """A kernel argument the kernel writes into."""


class TensorAnnotation:
    """``tensor[...]``: the annotation and what it was subscripted with."""

    __slots__ = ("kind", "params")

    def __init__(self, kind: type, params: tuple[Any, ...]) -> None:
        self.kind = kind
        self.params = params

    def __repr__(self) -> str:
        return f"{self.kind.__name__}[{', '.join(map(repr, self.params))}]"


__all__ = ["tensor", "mutable_tensor"]
