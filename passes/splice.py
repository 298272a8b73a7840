"""Rewrite each planned site into its final form.

Requires: fuse_epilogue ran (each site is one ``sparsecc::linear_dense`` node carrying its
:class:`~sparsecc.site.LinearSite`), and a decision per site name: a packed weight
(:class:`~sparsecc.formats.PackedWeight`) or ``None`` for "stays dense".
Ensures: a packed site is one call of its format's custom op, its packed tensors
registered as buffers of the submodule ``sparsecc_packed`` and read with ``get_attr``; a
dense site is plain torch ops (:func:`sparsecc.ops.linear_torch`), which Inductor fuses
and eager runs without dispatch overhead; a quantized site that stays dense calls
``sparsecc::linear_fp8_scaled_mm`` where ``torch._scaled_mm`` takes its weight on its device
(and its input's dtype; :func:`~sparsecc.runtime.torch_ops.fp8_dense_op`), else keeps the
``sparsecc::linear_fp8`` node fuse_epilogue made, and a packed one calls its format's FP8 op
with the same scales; weights and modules nothing reads any more are dropped from the graph
module (modules it shares with the original model are never modified: see :func:`_drop_unused`).
"""
from __future__ import annotations

import re

import torch
import torch.fx as fx
import torch.nn as nn

from sparsecc.ir.formats import PackedWeight
from sparsecc.runtime.torch_ops import OP_FOR_FP8, OP_FOR_KIND, fp8_dense_op, linear_torch
from sparsecc.ir.site import SITE_KEY

from . import PassResult
from .fuse_epilogue import erase_dead_inputs

PACKED_MODULE = "sparsecc_packed"


def run(gm: fx.GraphModule, decisions: dict[str, PackedWeight | None]) -> PassResult:
    """Apply ``decisions`` (site name -> packed weight or None)."""
    sites = []
    for node in list(gm.graph.nodes):
        site = node.meta.get(SITE_KEY)
        if site is None or site.name not in decisions:
            continue
        packed = decisions[site.name]
        if packed is None:
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
    if not hasattr(gm, PACKED_MODULE):
        gm.add_module(PACKED_MODULE, nn.Module())
    holder = getattr(gm, PACKED_MODULE)
    prefix = re.sub(r"[^0-9A-Za-z_]", "_", name)
    x, weight, *scales, bias, activation, x_transposed, transpose_out = node.args
    with gm.graph.inserting_before(node):
        tensors = []
        for field, tensor in packed.tensors().items():
            if tensor is None:          # an optional array the format leaves out: the op takes None
                tensors.append(None)
                continue
            holder.register_buffer(f"{prefix}__{field}", tensor)
            tensors.append(gm.graph.get_attr(f"{PACKED_MODULE}.{prefix}__{field}"))
    node.target = getattr(packed, "op", None) or (OP_FOR_FP8 if quantized else OP_FOR_KIND)[packed.spec.kind]
    node.args = (x, *tensors, *scales, *packed.scalars().values(), bias, activation, x_transposed, transpose_out,
                 *getattr(packed, "extra_args", ()))
    erase_dead_inputs(gm.graph, [weight])


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
