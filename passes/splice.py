"""Rewrite each planned site into its final form.

Requires: fuse_epilogue ran (each site is one ``sparsecc::linear_dense`` node carrying its
:class:`~sparsecc.site.LinearSite`), and a decision per site name: a packed weight
(:class:`~sparsecc.formats.PackedWeight`) or ``None`` for "stays dense".
Ensures: a packed site is one call of its format's custom op, its packed tensors
registered as buffers of the submodule ``sparsecc_packed`` and read with ``get_attr``; a
dense site is plain torch ops (:func:`sparsecc.ops.linear_torch`), which Inductor fuses
and eager runs without dispatch overhead; weights and modules nothing reads any more are
dropped from the graph module (never from modules it shares with the original model).
"""
from __future__ import annotations

import re

import torch
import torch.fx as fx
import torch.nn as nn

from sparsecc.formats import PackedWeight
from sparsecc.ops import OP_FOR_KIND, linear_torch
from sparsecc.site import SITE_KEY

from . import PassResult
from .fuse_epilogue import erase_dead_inputs

PACKED_MODULE = "sparsecc_packed"


def run(gm: fx.GraphModule, decisions: dict[str, PackedWeight | None], *,
        shared: set[int] = frozenset()) -> PassResult:
    """Apply ``decisions`` (site name -> packed weight or None). ``shared`` holds the ids of
    modules owned by the original model, which are never modified."""
    sites = []
    for node in list(gm.graph.nodes):
        site = node.meta.get(SITE_KEY)
        if site is None or site.name not in decisions:
            continue
        packed = decisions[site.name]
        if packed is None:
            node.target = linear_torch
        else:
            _call_packed_op(gm, node, site.name, packed)
        sites.append(site)
    _drop_unused(gm, shared)
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, changed=bool(sites), sites=sites)


def _call_packed_op(gm: fx.GraphModule, node: fx.Node, name: str, packed: PackedWeight) -> None:
    if not hasattr(gm, PACKED_MODULE):
        gm.add_module(PACKED_MODULE, nn.Module())
    holder = getattr(gm, PACKED_MODULE)
    prefix = re.sub(r"[^0-9A-Za-z_]", "_", name)
    x, weight, bias, activation, x_transposed, transpose_out = node.args
    with gm.graph.inserting_before(node):
        tensors = []
        for field, tensor in packed.tensors().items():
            holder.register_buffer(f"{prefix}__{field}", tensor)
            tensors.append(gm.graph.get_attr(f"{PACKED_MODULE}.{prefix}__{field}"))
    node.target = OP_FOR_KIND[packed.spec.kind]
    node.args = (x, *tensors, *packed.scalars().values(), bias, activation, x_transposed, transpose_out)
    erase_dead_inputs(gm.graph, [weight])


def _drop_unused(gm: fx.GraphModule, shared: set[int]) -> None:
    """Drop attributes and submodules the graph no longer reads, except inside modules the
    original model owns (deleting there would change the user's model)."""
    used = {n.target for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}

    def is_used(path: str) -> bool:
        return any(t == path or t.startswith(path + ".") or path.startswith(t + ".") for t in used)

    for name, module in list(gm.named_modules()):
        if id(module) in shared or module is getattr(gm, PACKED_MODULE, None):
            continue
        for attr, value in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            path = f"{name}.{attr}" if name else attr
            if not is_used(path) and value is not None:
                delattr(module, attr)
    gm.delete_all_unused_submodules()
