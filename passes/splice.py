"""Rewrite each planned site into its final form.

Requires: fuse_epilogue ran (each site is one ``sparsecc::linear_dense`` node carrying its
:class:`~sparsecc.site.LinearSite`), and a decision per site name: a packed weight
(:class:`~sparsecc.formats.PackedWeight`) or ``None`` for "stays dense".
Ensures: a packed site is one call of its format's custom op, its packed tensors
registered as buffers of the graph module named ``sparsecc_packed_<site>__<field>`` (not of a
submodule: each module level is a few more guards Dynamo checks on every call of a compiled
model) and read with ``get_attr``; a
dense site is plain torch ops (:func:`sparsecc.ops.linear_torch`), which Inductor fuses
and eager runs without dispatch overhead; a quantized site that stays dense calls
``sparsecc::linear_fp8_scaled_mm`` where ``torch._scaled_mm`` takes its weight on its device
(and its input's dtype; :func:`~sparsecc.runtime.torch_ops.fp8_dense_op`), else keeps the
``sparsecc::linear_fp8`` node fuse_epilogue made, and a packed one calls its format's FP8 op
with the same scales; the sites of a :class:`~sparsecc.ir.siblings.SiblingGroup` become one call
of their format's op on the stacked weight, placed where the first of them was, whose output
``torch.split`` shares out (each member's own activation after its split where the kernel applies
none), or, where the members sit in different graphs (the layers of a module that did not trace
whole), a call of one :class:`~sparsecc.runtime.shared_call.SharedCall` that all their graphs
hold, each for its own output; weights and modules nothing reads any more are dropped from the
graph module (modules it shares with the original model are never modified: see
:func:`_drop_unused`).
"""
from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx
import torch.nn as nn

from sparsecc.ir.epilogue import apply_activation
from sparsecc.ir.formats import PackedWeight
from sparsecc.ir.siblings import SiblingGroup
from sparsecc.runtime.shared_call import SharedCall
from sparsecc.runtime.torch_ops import OP_FOR_FP8, OP_FOR_KIND, fp8_dense_op, linear_torch
from sparsecc.ir.site import SITE_KEY

from . import PassResult
from .fuse_epilogue import erase_dead_inputs

#: the names of the packed tensors a graph module holds: sparsecc_packed_<site>__<field>
PACKED_PREFIX = "sparsecc_packed_"
#: a graph's submodules that compute groups whose members sit in different graphs: _0, _1, ...
SHARED_PREFIX = "sparsecc_shared_"


def run(gm: fx.GraphModule, decisions: dict[str, PackedWeight | SiblingGroup | None]) -> PassResult:
    """Apply ``decisions`` (site name -> packed weight, the site's sibling group, or None)."""
    sites = []
    nodes = {node.meta[SITE_KEY].name: node for node in gm.graph.nodes if SITE_KEY in node.meta}
    for node in list(gm.graph.nodes):
        site = node.meta.get(SITE_KEY)
        if site is None or site.name not in decisions:
            continue
        packed = decisions[site.name]
        if isinstance(packed, SiblingGroup):
            if not all(member.name in nodes for member in packed.members):
                _call_shared(gm, node, packed)
            elif site is packed.members[0]:
                _call_group_op(gm, [nodes[member.name] for member in packed.members], packed)
        elif packed is None:
            if site.quantized:
                node.target = fp8_dense_op(site.weight.device, tuple(site.weight.shape), site.input_dtype)
            else:
                node.target = linear_torch
        else:
            _call_packed_op(gm, node, site.name, packed, site.quantized)
        sites.append(site)
    _drop_unused(gm)
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, changed=bool(sites), sites=sites)


def _call_packed_op(gm: fx.GraphModule, node: fx.Node, name: str, packed: PackedWeight, quantized: bool) -> None:
    x, weight, *scales, bias, activation, x_transposed, transpose_out = node.args
    with gm.graph.inserting_before(node):
        tensors = _packed_inputs(gm, name, packed.tensors())
    node.target = getattr(packed, "op", None) or (OP_FOR_FP8 if quantized else OP_FOR_KIND)[packed.spec.kind]
    node.args = (x, *tensors, *scales, *packed.scalars().values(), bias, activation, x_transposed, transpose_out,
                 *getattr(packed, "extra_args", ()))
    erase_dead_inputs(gm.graph, [weight])


def _call_group_op(gm: fx.GraphModule, nodes: list[fx.Node], group: SiblingGroup) -> None:
    """One call of the group's op where its first member was, split into the members' outputs."""
    with gm.graph.inserting_before(nodes[0]):
        outputs = [_own_activation(gm, output, member, group)
                   for member, output in zip(group.members, _group_outputs(gm, nodes[0].args[0], group))]
    for node, output in zip(nodes, outputs):
        _replace(gm, node, output)


def _call_shared(gm: fx.GraphModule, node: fx.Node, group: SiblingGroup) -> None:
    """A member of a group whose members sit in different graphs: a call of the group's
    :class:`SharedCall` (one module, shared by the members' graphs) for its own output."""
    if group.shared is None:
        group.shared = SharedCall(_group_module(group), len(group.members))
    member = node.meta[SITE_KEY]
    index = [m.name for m in group.members].index(member.name)
    held = [name for name, _ in gm.named_children() if name.startswith(SHARED_PREFIX)]
    name = next((name for name in held if getattr(gm, name) is group.shared), f"{SHARED_PREFIX}{len(held)}")
    if name not in held:
        gm.add_module(name, group.shared)
    with gm.graph.inserting_before(node):
        output = _own_activation(gm, gm.graph.call_module(name, (node.args[0], index)), member, group)
    _replace(gm, node, output)


def _group_module(group: SiblingGroup) -> fx.GraphModule:
    """x -> the group's members' outputs (a tuple), from one call of its op."""
    gm = fx.GraphModule(nn.Module(), fx.Graph())
    x = gm.graph.placeholder("x")
    gm.graph.output(tuple(_group_outputs(gm, x, group)))
    gm.recompile()
    return gm


def _group_outputs(gm: fx.GraphModule, x: fx.Node, group: SiblingGroup) -> list[fx.Node]:
    """Nodes (added at the insertion point) computing the group's op on ``x`` and each member's
    part of its output, in the members' order."""
    packed = group.packed
    *tensors, bias = _packed_inputs(gm, group.name, {**packed.tensors(), "bias": group.bias()})
    op = getattr(packed, "op", None) or OP_FOR_KIND[packed.spec.kind]
    shared = gm.graph.call_function(op, (x, *tensors, *packed.scalars().values(), bias, group.activation.value,
                                         False, False, *getattr(packed, "extra_args", ())))
    # an op that gives the members' outputs itself (one call's split, or each member's own weight)
    parts = shared if getattr(packed, "returns_parts", False) else \
        gm.graph.call_function(torch.split, (shared, group.sizes, -1))
    return [gm.graph.call_function(operator.getitem, (parts, index)) for index in range(len(group.members))]


def _own_activation(gm: fx.GraphModule, output: fx.Node, member, group: SiblingGroup) -> fx.Node:
    """``output`` with the member's own activation where the group's call applies another."""
    if member.activation == group.activation:
        return output
    return gm.graph.call_function(apply_activation, (output, member.activation.value))


def _replace(gm: fx.GraphModule, node: fx.Node, output: fx.Node) -> None:
    """``output`` takes the site node's place; the node and what only it read go."""
    node.replace_all_uses_with(output)
    _reshape_not_view(output)
    inputs = node.all_input_nodes
    gm.graph.erase_node(node)
    erase_dead_inputs(gm.graph, inputs)


def _reshape_not_view(output: fx.Node) -> None:
    """A member's output is a view of the shared one, its rows ``sum of N`` apart: a ``.view`` that
    merges its last dimension with another (``y.view(-1)``) cannot take it, so each ``.view`` of it
    becomes ``.reshape`` (the same view where one exists, else a copy, where the site's own
    contiguous output would have been viewed)."""
    for user in list(output.users):
        if user.op == "call_method" and user.target == "view" and user.args[0] is output:
            user.target = "reshape"
        elif user.op == "call_function" and user.target is torch.Tensor.view and user.args[0] is output:
            user.target = torch.Tensor.reshape


def _packed_inputs(gm: fx.GraphModule, name: str, tensors: dict) -> list:
    """Register ``tensors`` (field -> tensor, list of tensors, or None) as buffers of ``gm``
    (see :data:`PACKED_PREFIX`), and read each with a ``get_attr`` node (a list of them for a list;
    None where the format leaves an optional array out: the op takes None)."""
    prefix = PACKED_PREFIX + re.sub(r"[^0-9A-Za-z_]", "_", name)

    def read(field: str, tensor: torch.Tensor) -> fx.Node:
        gm.register_buffer(f"{prefix}__{field}", tensor)
        return gm.graph.get_attr(f"{prefix}__{field}")

    nodes: list = []
    for field, tensor in tensors.items():
        if isinstance(tensor, (list, tuple)):
            nodes.append([read(f"{field}_{i}", t) for i, t in enumerate(tensor)])
        else:
            nodes.append(None if tensor is None else read(field, tensor))
    return nodes


def _drop_unused(gm: fx.GraphModule) -> None:
    """Let go of every weight and module the graph no longer reads.

    Modules reached from ``gm`` may belong to the original model, so none is ever modified:
    a module the graph only reads attributes from is replaced, in ``gm``, by a fresh
    container holding just those attributes; a module it calls is kept whole."""
    called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in list(gm._parameters) + list(gm._buffers):
        if name not in read:
            delattr(gm, name)
    for name, child in list(gm.named_children()):
        kept = _keep(child, name, called, read)
        delattr(gm, name)
        if kept is not None:
            gm.add_module(name, kept)


def _keep(module: nn.Module, path: str, called: set[str], read: set[str]) -> nn.Module | None:
    """``module`` itself if the graph calls it, None if it reads nothing inside it, else a
    fresh container with only what is read."""
    if path in called:
        return module
    inside = path + "."
    if not any(t.startswith(inside) for t in called | read):
        return None
    container = nn.Module()
    for target in sorted(t for t in read if t.startswith(inside) and "." not in t[len(inside):]):
        attr = target[len(inside):]
        value = getattr(module, attr)
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            container.register_buffer(attr, value)
        else:
            setattr(container, attr, value)
    for name, child in module.named_children():
        kept = _keep(child, inside + name, called, read)
        if kept is not None:
            container.add_module(name, kept)
    return container
