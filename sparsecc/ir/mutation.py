"""Which graph nodes write in place, and where in a graph such writes fall.

A node that writes into a tensor changes what every later reader of that tensor sees: two sites
reading one node before and after such a write do not read the same values (sparsecc.ir.siblings),
and a graph with such writes cannot be run again just to time it (sparsecc.planner.check).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

#: the functions of Python's ``operator`` module that change their first argument
_OPERATOR_IN_PLACE = {"iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imatmul", "imod", "imul", "ior", "ipow",
                      "irshift", "isub", "itruediv", "ixor", "setitem", "delitem"}


def writes_in_place(node: fx.Node) -> bool:
    """Whether ``node`` may write into one of its arguments: a tensor method or torch function
    named with a trailing underscore (``add_``), one given ``out=``, an aten op whose schema
    mutates, or an in-place function of ``operator`` (``setitem``, ``iadd``; not ``and_``, which
    only avoids a keyword)."""
    if node.op not in ("call_method", "call_function"):
        return False
    if "out" in node.kwargs:
        return True
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    if node.op == "call_function" and getattr(operator, getattr(target, "__name__", ""), None) is target:
        return target.__name__ in _OPERATOR_IN_PLACE
    name = target if node.op == "call_method" else getattr(target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def writes_before(graph: fx.Graph) -> dict[fx.Node, int]:
    """For each node of ``graph``, how many nodes before it (in graph order) may write in place."""
    counts, seen = {}, 0
    for node in graph.nodes:
        counts[node] = seen
        seen += writes_in_place(node)
    return counts
