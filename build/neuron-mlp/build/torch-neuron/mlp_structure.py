"""Which MLPs the fused kernels compute: read from a class's ``forward`` source.

A gated MLP is served only when its forward computes exactly ``down(act(gate(x)) * up(x))``: many
classes named ``*MLP`` hold gate/up/down projections but add clamps, multipliers, norms or dropout
(FalconH1, DeepseekV4, BitNet, ...), and would silently come out wrong. ``gated_mlp_form`` parses the
forward with ``ast`` and evaluates it symbolically; only the two forms transformers uses pass. A plain
MLP likewise only when it computes ``down(act(up(x)))`` (``plain_mlp_form``), optionally followed by
the dropout Starcoder2 and GPT-2 apply to the output, which the layer applies after the kernel. Shipped
in the neuron-mlp Hub repo beside the layers that ask it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any, NamedTuple

# Structure name -> the projections whose outputs feed the activation and the product.
STRUCTURES = {"gated_mlp": ("gate_proj", "up_proj"), "gated_mlp_fused": ("gate_up_proj",)}


def _symbolic(node: ast.AST, env: dict) -> Any:
    """A hashable description of what an expression of a forward computes, or None if not understood."""
    if isinstance(node, ast.Name):
        return env.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        left, right = _symbolic(node.left, env), _symbolic(node.right, env)
        return None if left is None or right is None else ("mul", frozenset((left, right)))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
        and len(node.args) == 1
        and not node.keywords
    ):
        arg = _symbolic(node.args[0], env)
        return None if arg is None else ("call", node.func.attr, arg)
    return _functional_dropout(node, env)


def _self_attribute(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _functional_dropout(node: ast.AST, env: dict) -> Any:
    """``nn.functional.dropout(e, p=self.<rate>, training=self.training)`` (or ``F.dropout``) as
    ("dropout", rate attribute, symbolic e), else None."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "dropout"
        and ast.unparse(node.func.value) in ("nn.functional", "F", "torch.nn.functional")
        and len(node.args) == 1
    ):
        return None
    keywords = {k.arg: _self_attribute(k.value) for k in node.keywords}
    if set(keywords) != {"p", "training"} or keywords["training"] != "training" or keywords["p"] is None:
        return None
    arg = _symbolic(node.args[0], env)
    return None if arg is None else ("dropout", keywords["p"], arg)


def _chunk_halves(node: ast.AST, env: dict) -> Any:
    """``e.chunk(2, dim=-1)`` or ``e.chunk(2, -1)``: the symbolic ``e``, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "chunk"):
        return None
    try:
        args = [ast.literal_eval(a) for a in node.args]
        dims = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except ValueError:
        return None
    if args[:1] != [2] or [*args[1:], *dims.values()] != [-1] or set(dims) - {"dim"}:
        return None
    return _symbolic(node.func.value, env)


def forward_definition(function: Any) -> ast.FunctionDef | None:
    """The ``def`` of ``function`` parsed from its source; None when the source is unavailable or is not
    a function definition."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    definition = tree.body[0] if tree.body else None
    return definition if isinstance(definition, ast.FunctionDef) else None


@functools.cache
def _returned(cls: type) -> Any:
    """What ``cls.forward(self, x)`` returns, symbolically (``_symbolic``), when its body is only
    assignments and one return; None otherwise."""
    forward = getattr(cls, "forward", None)
    function = None if forward is None else forward_definition(forward)
    if function is None:
        return None
    args = function.args
    if (
        [a.arg for a in args.args][:1] != ["self"]
        or len(args.args) != 2
        or args.vararg
        or args.kwarg
        or args.kwonlyargs
        or args.posonlyargs
        or args.defaults
    ):
        return None
    env: dict = {args.args[1].arg: ("x",)}
    result = None
    for statement in function.body:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # docstring
        if isinstance(statement, ast.Return) and statement.value is not None and result is None:
            result = _symbolic(statement.value, env)
            continue
        if not isinstance(statement, ast.Assign) or len(statement.targets) != 1 or result is not None:
            return None
        target = statement.targets[0]
        if isinstance(target, ast.Name):
            env[target.id] = _symbolic(statement.value, env)
        elif isinstance(target, ast.Tuple) and len(target.elts) == 2:  # gate, up = ...
            names = [e.id for e in target.elts if isinstance(e, ast.Name)]
            if len(names) != 2:
                return None
            whole = _chunk_halves(statement.value, env)
            for index, half in enumerate(names):
                env[half] = None if whole is None else ("half", index, whole)
        else:
            return None
    return result


@functools.cache
def gated_mlp_form(cls: type) -> tuple[str, str] | None:
    """(structure, activation attribute) when ``cls.forward(self, x)`` returns exactly
    ``down_proj(act(gate_proj(x)) * up_proj(x))`` ("gated_mlp") or Phi3's ``gate, up =
    gate_up_proj(x).chunk(2, dim=-1)`` then ``down_proj(up * act(gate))`` ("gated_mlp_fused"),
    with ``act`` the module's ``act_fn`` or ``activation_fn``; None otherwise."""
    result = _returned(cls)
    x = ("x",)
    for act in ("act_fn", "activation_fn"):
        separate = ("mul", frozenset((("call", act, ("call", "gate_proj", x)), ("call", "up_proj", x))))
        gate_up = ("call", "gate_up_proj", x)
        fused = ("mul", frozenset((("call", act, ("half", 0, gate_up)), ("half", 1, gate_up))))
        if result == ("call", "down_proj", separate):
            return "gated_mlp", act
        if result == ("call", "down_proj", fused):
            return "gated_mlp_fused", act
    return None


class PlainMLPForm(NamedTuple):
    """The attributes a plain MLP's forward uses: ``down(act(up(x)))``, then optionally dropout, either
    a dropout module (``dropout_module``) or ``nn.functional.dropout`` at the rate held in
    ``dropout_rate`` (attribute names, None when absent)."""

    up: str
    activation: str
    down: str
    dropout_module: str | None = None
    dropout_rate: str | None = None


PLAIN_ACTIVATION_ATTRIBUTES = ("act", "act_fn", "activation_fn")


@functools.cache
def plain_mlp_form(cls: type) -> PlainMLPForm | None:
    """The ``PlainMLPForm`` when ``cls.forward(self, x)`` returns exactly ``down(act(up(x)))`` with
    ``act`` one of ``PLAIN_ACTIVATION_ATTRIBUTES`` (Starcoder2, GPT-NeoX, Falcon, GPT-2, Phi), optionally followed
    by a dropout (a module attribute, or ``nn.functional.dropout(., p=self.<rate>,
    training=self.training)``); None otherwise."""
    result = _returned(cls)
    dropout_module = dropout_rate = None
    if isinstance(result, tuple) and result[0] == "dropout":
        dropout_rate, result = result[1], result[2]
    elif isinstance(result, tuple) and result[0] == "call" and "dropout" in result[1]:
        dropout_module, result = result[1], result[2]
    if not (isinstance(result, tuple) and result[0] == "call"):
        return None
    down, activated = result[1], result[2]
    if not (isinstance(activated, tuple) and activated[0] == "call" and activated[1] in PLAIN_ACTIVATION_ATTRIBUTES):
        return None
    projected = activated[2]
    if not (isinstance(projected, tuple) and projected[0] == "call" and projected[2] == ("x",)):
        return None
    return PlainMLPForm(projected[1], activated[1], down, dropout_module, dropout_rate)
