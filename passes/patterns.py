"""Which fx nodes mean what: the call targets the passes recognise, at the torch level
(fx symbolic tracing, Dynamo) and at the ATen level (torch.export), and helpers to read
constants (parameters and buffers) out of a graph module.
"""
from __future__ import annotations

import builtins
import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from sparsecc.ir.epilogue import Activation
from sparsecc.ir.quant import fp8_linear

aten = torch.ops.aten

LINEAR = {F.linear, torch._C._nn.linear, aten.linear.default}
FP8_LINEAR = {fp8_linear}
ADDMM = {torch.addmm, aten.addmm.default}
MATMUL = {operator.matmul, torch.matmul, torch.mm, aten.mm.default, aten.matmul.default}
MATMUL_METHODS = {"matmul", "mm", "__matmul__"}
ADD = {operator.add, torch.add, aten.add.Tensor}
ADD_METHODS = {"add", "__add__"}

RELU = {F.relu, torch.relu, aten.relu.default, aten.relu_.default, torch.relu_, F.relu_}
GELU = {F.gelu, torch._C._nn.gelu, aten.gelu.default}
SILU = {F.silu, torch._C._nn.silu, aten.silu.default, aten.silu_.default}
ACTIVATION_MODULES = {nn.ReLU: Activation.RELU, nn.SiLU: Activation.SILU}


def is_call(node: fx.Node, targets: set, methods: set = frozenset()) -> bool:
    if node.op == "call_function":
        return node.target in targets
    if node.op == "call_method":
        return node.target in methods
    return False


def arg(node: fx.Node, index: int, name: str, default=None):
    """Argument ``index``/``name`` of a call, whether passed by position or keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def fetch_attr(gm: nn.Module, qualname: str):
    obj = gm
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class Constants:
    """Resolves graph nodes that are constant tensors: ``get_attr`` nodes, placeholders that
    the caller knows to be parameters (Dynamo lifts parameters to inputs), and ``torch.flatten``
    of either (named as the tensor it views)."""

    def __init__(self, gm: fx.GraphModule, placeholders: dict[str, tuple[str, torch.Tensor]] | None = None):
        self.gm = gm
        self.placeholders = placeholders or {}

    def tensor(self, node) -> tuple[str, torch.Tensor] | None:
        """(qualified name, tensor) if ``node`` is a constant tensor."""
        if not isinstance(node, fx.Node):
            return None
        if node.op == "get_attr":
            value = fetch_attr(self.gm, node.target)
            return (node.target, value) if isinstance(value, torch.Tensor) else None
        if node.op == "placeholder" and node.target in self.placeholders:
            return self.placeholders[node.target]
        if node.op == "call_function" and node.target is torch.flatten and not node.kwargs:
            inner = self.tensor(node.args[0])          # a flattened constant (conv_as_linear's weight)
            if inner is not None:
                return inner[0], inner[1].flatten(*node.args[1:])
        return None

    def matrix(self, node) -> tuple[str, torch.Tensor, fx.Node, bool] | None:
        """(name, matrix as the graph uses it, storage node, whether the use is the storage
        transposed) if ``node`` is a 2-D constant or the transpose of one (``W.t()``, ``W.T``,
        ``W.transpose(0, 1)``, ``W.permute(1, 0)``)."""
        found = self.tensor(node)
        if found is not None:
            name, value = found
            return (name, value, node, False) if value.dim() == 2 else None
        if isinstance(node, fx.Node) and is_matrix_transpose(node):
            inner = self.tensor(node.args[0])
            if inner is not None and inner[1].dim() == 2:
                return inner[0], inner[1].t(), node.args[0], True
        return None


def is_matrix_transpose(node: fx.Node) -> bool:
    """A transpose of a 2-D tensor, in any spelling (rank is checked by the caller)."""
    if node.op == "call_function":
        if node.target in (torch.t, aten.t.default):
            return True
        if node.target in (torch.transpose, aten.transpose.int):
            return {node.args[1], node.args[2]} in ({0, 1}, {-1, -2}, {0, -1}, {-2, 1})
        if node.target in (torch.permute, aten.permute.default):
            return list(node.args[1]) == [1, 0]
        if node.target is builtins.getattr:
            return node.args[1] in ("T", "mT")
    if node.op == "call_method":
        if node.target == "t":
            return True
        if node.target == "transpose":
            return {node.args[1], node.args[2]} in ({0, 1}, {-1, -2}, {0, -1}, {-2, 1})
        if node.target == "permute":
            dims = node.args[1:] if not isinstance(node.args[1], (list, tuple)) else node.args[1]
            return list(dims) == [1, 0]
    return False


def rank(node: fx.Node) -> int | None:
    """The tensor rank recorded by shape propagation, if any."""
    meta = node.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "shape"):
        return len(meta.shape)
    val = node.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else None


def swaps_last_two_dims(node: fx.Node, input_rank: int | None) -> bool:
    """Whether ``node`` transposes the last two dimensions of its input."""
    def is_last_two(a, b):
        if input_rank is None:
            return {a, b} == {-1, -2}
        return {a % input_rank, b % input_rank} == {input_rank - 2, input_rank - 1} and input_rank >= 2

    if node.op == "call_function":
        if node.target in (torch.transpose, aten.transpose.int):
            return is_last_two(node.args[1], node.args[2])
        if node.target in (torch.t, aten.t.default):
            return input_rank == 2
        if node.target in (torch.permute, aten.permute.default):
            dims = list(node.args[1])
            return _is_last_two_permutation(dims)
        if node.target is builtins.getattr:
            return node.args[1] == "mT" or (node.args[1] == "T" and input_rank == 2)
    if node.op == "call_method":
        if node.target == "transpose":
            return is_last_two(node.args[1], node.args[2])
        if node.target == "t":
            return input_rank == 2
        if node.target == "permute":
            dims = list(node.args[1]) if isinstance(node.args[1], (list, tuple)) else list(node.args[1:])
            return _is_last_two_permutation(dims)
    return False


def _is_last_two_permutation(dims: list) -> bool:
    n = len(dims)
    dims = [d % n for d in dims]
    return n >= 2 and dims == list(range(n - 2)) + [n - 1, n - 2]


def activation_of(node: fx.Node, gm: nn.Module) -> Activation | None:
    """The activation ``node`` applies to its first argument, if it is one we fuse."""
    if node.op == "call_module":
        module = fetch_attr(gm, node.target)
        if type(module) in ACTIVATION_MODULES:
            return ACTIVATION_MODULES[type(module)]
        if type(module) is nn.GELU:
            return Activation.GELU_TANH if module.approximate == "tanh" else Activation.GELU
        return None
    if is_call(node, RELU, {"relu", "relu_"}):
        return Activation.RELU
    if is_call(node, SILU):
        return Activation.SILU
    if is_call(node, GELU, {"gelu"}):
        approximate = arg(node, 1, "approximate", "none")
        return {"none": Activation.GELU, "tanh": Activation.GELU_TANH}.get(approximate)
    return None
