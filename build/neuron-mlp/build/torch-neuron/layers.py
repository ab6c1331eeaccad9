"""Hub layers that replace transformers' MLP forwards: gated (SwiGLU / GeGLU) and plain
(``down(act(up(x)))``). Stateless: they borrow the replaced module's projections and activation,
and keep the signature of the forward they replace. The activation is read from the module itself
(``act_fn``, else ``activation_fn``), so one layer serves SiLU models (Llama, Qwen, Mistral ...) and
tanh-GELU ones (Gemma); the plain layer reads the attributes its class's forward uses
(``mlp_structure.plain_mlp_form``): Starcoder2, GPT-NeoX, Falcon, GPT-2 and Phi MLPs.

The fused kernel reads the projections' weights instead of calling them, so every call first
checks that each projection still is something whose weight says what it computes
(``unsupported_reasons``, which kernelize asks too):

- a plain ``nn.Linear`` without bias, hooks or a replaced forward;
- a PEFT LoRA layer over such a linear: its active adapters become low-rank updates of the weight
  (merged inside the op, gradients to ``lora_A``/``lora_B``), unless an adapter has dropout in
  training, a bias, a variant such as DoRA, or the layout is transposed;
- tensor-parallel shards: gate/up split by rows (``Shard(0)``) and down by columns (``Shard(1)``)
  on one mesh, from transformers' TP plans or torch's ``parallelize_module``: each rank runs the
  fused kernel on its shards and the partial outputs are summed across ranks, as the row-parallel
  down projection would.

Anything else (a quantized linear, another PEFT tuner, a forward hook, a dtype or size past the
kernel's limits, ``model.float()`` pushing the hidden size past the fp32 limit) makes the module
run its own forward for that call, with the reason kept on the module and warned about once.

The plain layer takes projections that are ``nn.Linear``, Falcon's ``FalconLinear`` (the same math)
or transformers' ``Conv1D`` (GPT-2: the weight stored [in, out], copied transposed on each call), with
both biases or neither; PEFT adapters and tensor-parallel shards fall back to the module's forward.
The dropout Starcoder2 and GPT-2 apply to the MLP's output runs after the kernel, as theirs does.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, NamedTuple

import torch
from torch import nn

from ._backend import SUPPORTED_FLOAT_DTYPES, autocast_dtype, dtype_name, is_dtensor, own_forward
from .mlp import MAX_INTERMEDIATE, LowRankUpdate, activation_kind, describe_activation, gated_mlp, max_hidden
from .mlp_structure import STRUCTURES, PlainMLPForm, gated_mlp_form, plain_mlp_form
from .plain_mlp import PLAIN_ACTIVATIONS, plain_mlp

# Each layer: the structure its module's forward must have (mlp_structure), and its projections in the
# order of gated_mlp's weights (None: the fused gate_up has no up).
_STRUCTURE = {"GatedMLP": "gated_mlp", "GatedMLPFusedGateUp": "gated_mlp_fused"}
_PROJECTIONS: dict[str, tuple[str, str | None, str]] = {
    "GatedMLP": ("gate_proj", "up_proj", "down_proj"),
    "GatedMLPFusedGateUp": ("gate_up_proj", None, "down_proj"),
}
_ACTIVATIONS = ("act_fn", "activation_fn")
_SIZES = (
    f"hidden size up to {max_hidden('bfloat16')} (bf16/fp16) or {max_hidden('float32')} (fp32) in the compute "
    f"dtype; intermediate size up to {MAX_INTERMEDIATE}"
)
_GATED_LIMITS = (
    f"a forward computing down(act(gate(x)) * up(x)) (read from its source); projections without bias: "
    f"plain nn.Linear, PEFT LoRA over one, or tensor-parallel shards; {_SIZES}; SiLU or tanh-GELU activation"
)
LIMITS = {
    "GatedMLP": _GATED_LIMITS,
    "GatedMLPFusedGateUp": _GATED_LIMITS,
    "PlainMLP": (
        "a forward computing down(act(up(x))), optionally followed by dropout (read from its source); "
        "projections nn.Linear, FalconLinear or Conv1D (GPT-2), both with a bias or neither, no PEFT adapters "
        f"or tensor-parallel shards; {_SIZES}; exact GELU, tanh-GELU, ReLU or SiLU activation"
    ),
}


def computes(layer: str, cls: type) -> bool:
    """Whether ``cls.forward`` computes what ``layer`` computes (kernelize takes any ``*MLP`` class that
    does, beside the classes the registry names)."""
    if layer == "PlainMLP":
        return plain_mlp_form(cls) is not None
    form = gated_mlp_form(cls)
    return form is not None and form[0] == _STRUCTURE[layer]


def _structure_reasons(layer: str, module: nn.Module) -> list[str]:
    name = type(module).__name__
    cls: type = type(module)  # as a plain type: mypy checks Module.__hash__ for type[Module] and finds no Hashable
    form = gated_mlp_form(cls)
    if form is None or form[0] != _STRUCTURE[layer]:
        projections = " * ".join(f"{p}(x)" for p in STRUCTURES[_STRUCTURE[layer]])
        return [f"{name}.forward is not the gated MLP the kernel computes (down_proj(act({projections})))"]
    present = [a for a in _ACTIVATIONS if hasattr(module, a)]
    if present and present[0] != form[1]:
        return [f"{name}.forward uses {form[1]} but the layer would read {present[0]}"]
    return []


class Projection(NamedTuple):
    """What a projection computes, as the kernel takes it: its weight (this rank's shard under tensor
    parallelism) and any low-rank updates; for a tensor-parallel shard, how the weight is split
    ("rows": column-parallel, "columns": row-parallel) and on which mesh."""

    weight: torch.Tensor
    updates: tuple[LowRankUpdate, ...] = ()
    split: str | None = None
    mesh: object = None


def _hooks(module: nn.Module) -> list[str]:
    """Why calling ``module`` would do more than its class's forward."""
    found = []
    if module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks or module._backward_hooks:
        found.append("hooks")
    if "forward" in vars(module):
        found.append("a replaced forward")
    return found


def _activation_hooks(name: str, attribute: str, act: object) -> list[str]:
    """Hooks on an activation module (interpretability tools read ``mlp.act``), which the fused kernel would
    skip. A replaced forward is no reason: transformers tags its activation classes for Hub kernels, so
    kernelize may give them one computing the same function."""
    hooks = isinstance(act, nn.Module) and any(
        (act._forward_pre_hooks, act._forward_hooks, act._backward_pre_hooks, act._backward_hooks)
    )
    return [f"{name}.{attribute} has hooks, which the fused kernel would bypass"] if hooks else []


def _plain_linear(linear: nn.Module, what: str) -> Projection | str:
    if type(linear) is not nn.Linear:
        return f"{what} is {type(linear).__name__}, not a plain nn.Linear"
    if linear.bias is not None:
        return f"{what} has a bias (the kernel adds none)"
    hooks = _hooks(linear)
    if hooks:
        return f"{what} has {' and '.join(hooks)}, which the fused kernel would bypass"
    return Projection(linear.weight)


def _peft_lora_linear(linear: Any, what: str) -> Projection | str:
    """A PEFT LoRA layer (a ``peft.tuners.lora.Linear``, read by its attributes: PEFT is optional) as
    its base weight plus one update per active adapter (what its forward computes when no adapter has
    dropout in training, a bias or a variant)."""
    hooks = _hooks(linear)
    if hooks:  # PEFT's own pre-hooks pass per-sample adapter names
        return f"{what} (PEFT LoRA) has {' and '.join(hooks)}, which the fused kernel would bypass"
    base = _plain_linear(linear.base_layer, f"{what}.base_layer")
    if isinstance(base, str) or linear.fan_in_fan_out:
        return base if isinstance(base, str) else f"{what} (PEFT LoRA) stores its weights transposed (fan_in_fan_out)"
    if linear.merged or linear.disable_adapters:
        if linear.merged and linear.disable_adapters:
            return f"{what} (PEFT LoRA) is merged but its adapters are disabled (PEFT would unmerge it in place)"
        return base  # merged: the update is in the base weight; disabled: only the base runs
    updates = []
    for adapter in linear.active_adapters:
        if adapter not in linear.lora_A:
            continue
        if adapter in getattr(linear, "lora_variant", {}):
            variant = type(linear.lora_variant[adapter]).__name__
            return f"{what}: LoRA adapter {adapter!r} uses a variant ({variant}) the kernel does not merge"
        if linear.lora_bias.get(adapter, False):
            return f"{what}: LoRA adapter {adapter!r} has a bias (the kernel adds none)"
        dropout = linear.lora_dropout[adapter]
        if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0:
            return (
                f"{what}: LoRA adapter {adapter!r} has dropout {dropout.p} in training, which applies to the "
                "adapter's input alone and cannot be merged into the weight (lora_dropout=0 keeps the kernel)"
            )
        updates.append(
            LowRankUpdate(linear.lora_A[adapter].weight, linear.lora_B[adapter].weight, float(linear.scaling[adapter]))
        )
    return Projection(base.weight, tuple(updates))


def _is_peft_lora_linear(module: nn.Module) -> bool:
    lora = sys.modules.get("peft.tuners.lora.layer")  # never imports peft: no module is PEFT's without it
    return lora is not None and type(module) is lora.Linear


def _projection(module: nn.Module, attribute: str) -> Projection | str:
    what = f"{type(module).__name__}.{attribute}"
    linear = getattr(module, attribute, None)
    if linear is None:
        return f"{type(module).__name__} has no {attribute}"
    if _is_peft_lora_linear(linear):
        return _peft_lora_linear(linear, what)
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is not None and isinstance(linear, tuners.BaseTunerLayer):
        return f"{what} is a PEFT {type(linear).__module__.split('.')[-2]} layer ({type(linear).__name__}), not LoRA"
    shard = _tensor_parallel_shard(linear)
    if shard is not None:  # the TP plan's own hooks/forward, which the layer reproduces
        return shard if linear.bias is None else f"{what} has a bias (the kernel adds none)"
    return _plain_linear(linear, what)


# The two tensor-parallel styles the fused layer reproduces, by how they split the weight: column-parallel
# (rows split; replicated input, output split by features, local output) and row-parallel (columns split;
# input split by features, replicated output, local output). Sequence parallelism and other layouts are not.
_STANDARD_STYLES = {
    "rows": ("ColwiseParallel", "Replicate()", "Shard(dim=-1)"),
    "columns": ("RowwiseParallel", "Shard(dim=-1)", "Replicate()"),
}


def _tensor_parallel_shard(linear: nn.Module) -> Projection | None:
    """``linear`` as a tensor-parallel shard: its weight a DTensor on a 1-D mesh split by rows or columns,
    and every hook (torch's ``parallelize_module``) or replaced forward (transformers' plans) on it the
    matching standard style (``_STANDARD_STYLES``); else None."""
    weight = getattr(linear, "weight", None)
    if type(linear) is not nn.Linear or not is_dtensor(weight) or weight.device_mesh.ndim != 1:
        return None
    from torch.distributed.tensor import Shard

    (placement,) = weight.placements
    if not isinstance(placement, Shard) or placement.dim not in (0, 1):
        return None
    split = "rows" if placement.dim == 0 else "columns"
    style, inputs, outputs = _STANDARD_STYLES[split]
    hooks = [*linear._forward_pre_hooks.values(), *linear._forward_hooks.values()]
    forward = vars(linear).get("forward")
    if hooks and forward is None:  # torch: one input and one output hook, each a partial of the style's function
        layouts = {}
        for hook in hooks:
            for value in _closure(hook):
                if isinstance(value, functools.partial) and value.func.__qualname__.startswith(f"{style}._prepare_"):
                    layouts[value.func.__qualname__.rpartition(".")[2]] = value.args
        standard = (
            len(hooks) == 2
            and _placements(layouts.get("_prepare_input_fn", ((),))[0]) == inputs
            and layouts.get("_prepare_output_fn", ((), False))[1] is True
            and _placements(layouts["_prepare_output_fn"][0]) == outputs
        )
    elif forward is not None and not hooks:  # transformers: the style object in the replaced forward's closure
        styles = [
            v for v in _closure(forward) if type(v).__name__ == style and type(v).__module__.startswith("transformers.")
        ]
        standard = (
            len(styles) == 1
            and _placements(styles[0].input_layouts) == inputs
            and _placements(styles[0].output_layouts) == outputs
            and styles[0].use_local_output is True
        )
    else:
        standard = False
    return Projection(weight.to_local(), (), split, weight.device_mesh) if standard else None


def _closure(function: object) -> list:
    return [cell.cell_contents for cell in getattr(function, "__closure__", None) or ()]


def _placements(layouts: object) -> str:
    """A placement, or a 1-tuple of one, as text ("Replicate()", "Shard(dim=-1)")."""
    if isinstance(layouts, tuple):
        layouts = layouts[0] if len(layouts) == 1 else layouts
    return repr(layouts)


class _Plan(NamedTuple):
    gate: Projection  # or the fused gate_up
    up: Projection | None  # None with a fused gate_up
    down: Projection
    activation: str
    mesh: object = None  # the tensor-parallel mesh, when the weights are TP shards


def _resolve(layer: str, module: nn.Module, x: torch.Tensor | None, structure: bool) -> _Plan | list[str]:
    """How the kernel computes ``module`` (on ``x``), or why it cannot. ``structure``: also check what the
    class's forward computes (its source: once, at kernelize time; a class does not change between calls)."""
    name = type(module).__name__
    reasons = _structure_reasons(layer, module) if structure else []
    if reasons:
        return reasons
    found: dict[str, Projection] = {}
    for attribute in filter(None, _PROJECTIONS[layer]):
        projection = _projection(module, attribute)
        if isinstance(projection, str):
            reasons.append(projection)
        else:
            found[attribute] = projection
    present = [a for a in _ACTIVATIONS if getattr(module, a, None) is not None]
    kind = activation_kind(getattr(module, present[0])) if present else None
    if not present:
        reasons.append(f"{name} has no activation ({' or '.join(_ACTIVATIONS)})")
    elif kind is None:
        reasons.append(f"{name}.{present[0]}: {describe_activation(getattr(module, present[0]))}")
    else:
        reasons += _activation_hooks(name, present[0], getattr(module, present[0]))
    if reasons or kind is None:
        return reasons
    gate, up, down = _PROJECTIONS[layer]
    projections = (found[gate], None if up is None else found[up], found[down])
    mesh, reasons = _tensor_parallel_mesh(name, layer, projections)
    if reasons:
        return reasons
    reasons += _limits(name, {attribute: p.weight for attribute, p in found.items()}, x)
    return reasons or _Plan(*projections, kind, mesh)


def _tensor_parallel_mesh(
    name: str, layer: str, projections: tuple[Projection | None, ...]
) -> tuple[object, list[str]]:
    """The mesh when the projections are a complete tensor-parallel MLP (gate/up split by rows, down by
    columns, one mesh), None when none is sharded, else why not."""
    present = [p for p in projections if p is not None]
    if all(p.split is None and not is_dtensor(p.weight) for p in present):
        return None, []
    expected = [None if a is None else ("columns" if a == "down_proj" else "rows") for a in _PROJECTIONS[layer]]
    splits = [None if p is None else p.split for p in projections]
    meshes = {p.mesh for p in present}
    if splits != expected or len(meshes) != 1:
        return None, [
            f"{name}'s weights are DTensors sharded in a way other than tensor parallelism's "
            "column-parallel gate/up and row-parallel down on one mesh"
        ]
    if layer == "GatedMLPFusedGateUp":
        return None, [f"{name}: a row-split fused gate_up weight would mix gate and up rows across ranks"]
    return meshes.pop(), []


def _limits(
    name: str, named_weights: dict[str, torch.Tensor], x: torch.Tensor | None, copied: frozenset[str] = frozenset()
) -> list[str]:
    """The kernel's dtype and size limits, in the dtype it would compute in for ``x``. ``named_weights``
    in the kernel's layout, the down projection's last; ``copied``: the ones the layer copies (no
    contiguity needed)."""
    weights = list(named_weights.values())
    dtypes = {w.dtype for w in weights}
    if x is not None and (is_dtensor(x) or x.dtype not in SUPPORTED_FLOAT_DTYPES or x.numel() == 0):
        detail = "is a DTensor" if is_dtensor(x) else f"has dtype {x.dtype}" if x.numel() else "is empty"
        return [f"the input of shape {tuple(x.shape)} {detail}"]
    compute = (autocast_dtype(x) or x.dtype) if x is not None else next(iter(dtypes))
    if len(dtypes) > 1:
        return [f"{name}'s projections have mixed dtypes {sorted(map(dtype_name, dtypes))}"]
    if x is not None and autocast_dtype(x) is None and x.dtype not in dtypes:  # the module itself would raise
        return [f"the input's dtype {x.dtype} differs from the weights' {weights[0].dtype}"]
    reasons = [
        f"{name}'s weights have dtype {w.dtype} (the kernel takes float32, bfloat16, float16)"
        for w in weights[:1]
        if w.dtype not in SUPPORTED_FLOAT_DTYPES
    ]
    if reasons or compute not in SUPPORTED_FLOAT_DTYPES:
        return reasons or [f"compute dtype {compute} (the kernel takes float32, bfloat16, float16)"]
    hidden, intermediate = weights[-1].shape
    if hidden > max_hidden(dtype_name(compute)):
        reasons.append(
            f"hidden size {hidden} is above the kernel's {max_hidden(dtype_name(compute))} for {dtype_name(compute)}"
        )
    if intermediate > MAX_INTERMEDIATE:
        reasons.append(f"intermediate size {intermediate} is above the kernel's {MAX_INTERMEDIATE}")
    reasons += [
        f"{name}.{attribute}.weight is not contiguous"
        for attribute, w in named_weights.items()
        if not w.is_contiguous() and attribute not in copied
    ]
    return reasons


def unsupported_reasons(layer: str, module: nn.Module, x: torch.Tensor | None = None) -> list[str]:
    """Why ``module`` cannot run ``layer`` (empty when it can); with ``x``, also for that input."""
    resolved = _resolve_plain(module, x) if layer == "PlainMLP" else _resolve(layer, module, x, structure=True)
    return resolved if isinstance(resolved, list) else []


def _tensor_parallel(x: torch.Tensor, mesh, run) -> torch.Tensor:
    """``run`` on this rank's shards: x is replicated, so its gradient is summed across ranks; the
    output is this rank's partial sum, summed across ranks (what the row-parallel down would do)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    x = DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
    partial = DTensor.from_local(run(x), mesh, [Partial()], run_check=False)
    return partial.redistribute(mesh, [Replicate()]).to_local()


def _forward(layer: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    plan = _resolve(layer, module, x, structure=False)
    if isinstance(plan, list):
        return own_forward(module, "; ".join(plan), x)
    up = None if plan.up is None else plan.up.weight
    updates = [plan.gate.updates, () if plan.up is None else plan.up.updates, plan.down.updates]

    def run(inputs: torch.Tensor) -> torch.Tensor:
        return gated_mlp(inputs, plan.gate.weight, up, plan.down.weight, plan.activation, updates=updates)

    return run(x) if plan.mesh is None else _tensor_parallel(x, plan.mesh, run)


class _PlainProjection(NamedTuple):
    """A plain MLP's projection as the kernel takes it: the weight [out, in] (a Conv1D's stored [in, out],
    ``transposed``) and the bias or None; ``uncast_bias``: the module adds its bias without autocast's
    cast (FalconLinear's ``x @ W.T + bias``)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    transposed: bool = False
    uncast_bias: bool = False

    def kernel_weight(self) -> torch.Tensor:
        return self.weight.t().contiguous() if self.transposed else self.weight


def _is_class(module: nn.Module, module_name: str, class_name: str) -> bool:
    cls = type(module)
    return cls.__module__ == module_name and cls.__name__ == class_name


def _plain_projection(module: nn.Module, attribute: str) -> _PlainProjection | str:
    what = f"{type(module).__name__}.{attribute}"
    linear = getattr(module, attribute, None)
    if linear is None:
        return f"{type(module).__name__} has no {attribute}"
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is not None and isinstance(linear, tuners.BaseTunerLayer):
        return f"{what} is a PEFT layer ({type(linear).__name__}): the plain MLP kernel merges no adapters"
    weight = getattr(linear, "weight", None)
    if is_dtensor(weight):
        return f"{what}'s weight is a DTensor: the plain MLP kernel takes no sharded weights"
    hooks = _hooks(linear)
    if hooks:
        return f"{what} has {' and '.join(hooks)}, which the fused kernel would bypass"
    if type(linear) is nn.Linear:
        return _PlainProjection(linear.weight, linear.bias)
    if _is_class(linear, "transformers.models.falcon.modeling_falcon", "FalconLinear"):
        return _PlainProjection(linear.weight, linear.bias, uncast_bias=True)
    if _is_class(linear, "transformers.pytorch_utils", "Conv1D"):
        return _PlainProjection(linear.weight, linear.bias, transposed=True)
    return f"{what} is {type(linear).__name__}, not nn.Linear, FalconLinear or Conv1D"


class _PlainPlan(NamedTuple):
    form: PlainMLPForm
    up: _PlainProjection
    down: _PlainProjection
    activation: str


@torch.compiler.assume_constant_result
def _plain_form_fields(cls: type) -> tuple[str | None, ...]:
    """``plain_mlp_form(cls)`` as a tuple of its fields (empty when none): a class's source does not
    change, so torch.compile takes the result as a constant instead of tracing ``inspect.getsource``."""
    form = plain_mlp_form(cls)
    return () if form is None else tuple(form)


def _plain_form(cls: type) -> PlainMLPForm | None:
    fields = _plain_form_fields(cls)
    return PlainMLPForm(*fields) if fields else None


def _resolve_plain(module: nn.Module, x: torch.Tensor | None) -> _PlainPlan | list[str]:
    name = type(module).__name__
    cls: type = type(module)
    form = _plain_form(cls)
    if form is None:
        return [f"{name}.forward is not the plain MLP the kernel computes (down(act(up(x))), then optionally dropout)"]
    reasons = []
    found = []
    for attribute in (form.up, form.down):
        projection = _plain_projection(module, attribute)
        if isinstance(projection, str):
            reasons.append(projection)
        else:
            found.append(projection)
    act = getattr(module, form.activation, None)
    kind = activation_kind(act, PLAIN_ACTIVATIONS)
    if kind is None:
        reasons.append(f"{name}.{form.activation}: {describe_activation(act, PLAIN_ACTIVATIONS)}")
    else:
        reasons += _activation_hooks(name, form.activation, act)
    if reasons or kind is None:
        return reasons
    up, down = found
    if (up.bias is None) != (down.bias is None):
        return [f"{name}: one projection has a bias and the other not (the kernel takes both or neither)"]
    weights = {f"{form.up}.weight": up.weight, f"{form.down}.weight": down.weight}
    kernel_layout = {a: (w.t() if p.transposed else w) for (a, w), p in zip(weights.items(), found)}
    copied = frozenset(a for a, p in zip(weights, found) if p.transposed)
    reasons = _limits(name, kernel_layout, x, copied)
    for attribute, projection in ((form.up, up), (form.down, down)):
        bias = projection.bias
        if bias is not None and bias.dtype != projection.weight.dtype:
            reasons.append(f"{name}.{attribute}.bias has dtype {bias.dtype}, its weight {projection.weight.dtype}")
        if bias is not None and not bias.is_contiguous():
            reasons.append(f"{name}.{attribute}.bias is not contiguous")
        if bias is not None and x is not None and autocast_dtype(x) is not None and projection.uncast_bias:
            reasons.append(
                f"{name}.{attribute} is a FalconLinear, which adds its bias uncast under autocast (its output "
                "takes the bias's dtype); the kernel computes in the autocast dtype"
            )
    return reasons or _PlainPlan(form, up, down, kind)


def _plain_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    plan = _resolve_plain(module, x)
    if isinstance(plan, list):
        return own_forward(module, "; ".join(plan), x)
    up, down = plan.up, plan.down
    y = plain_mlp(x, up.kernel_weight(), down.kernel_weight(), up.bias, down.bias, plan.activation)
    if plan.form.dropout_module is not None:
        return getattr(module, plan.form.dropout_module)(y)
    if plan.form.dropout_rate is not None:
        return nn.functional.dropout(y, p=getattr(module, plan.form.dropout_rate), training=module.training)
    return y


class GatedMLP(nn.Module):
    """``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: LlamaMLP, Qwen2/3MLP, MistralMLP, Olmo2MLP,
    GraniteMLP, GemmaMLP, Gemma2/3MLP and any MLP whose forward is this."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _forward("GatedMLP", self, x)


class GatedMLPFusedGateUp(nn.Module):
    """Phi3MLP: ``gate, up = gate_up_proj(x).chunk(2)``, then ``down_proj(up * activation_fn(gate))``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _forward("GatedMLPFusedGateUp", self, hidden_states)


class PlainMLP(nn.Module):
    """``down(act(up(x)))`` with biases, then the module's dropout if it has one: Starcoder2MLP,
    GPTNeoXMLP, FalconMLP, GPT2MLP, PhiMLP and any MLP whose forward is this."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _plain_forward(self, hidden_states)


__all__ = ["GatedMLP", "GatedMLPFusedGateUp", "PlainMLP"]
