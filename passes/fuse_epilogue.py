"""Absorb elementwise consumers of each linear site into its epilogue.

Requires: find_linear has marked sites (``node.meta[SITE_KEY]``).
Ensures: each site is one ``sparsecc::linear_dense`` node (``sparsecc::linear_fp8`` for a
quantized site, which also takes the scales) computing the product and
everything it absorbed, carrying the site in its meta; the absorbed nodes are erased. The
graph computes what it computed before (the op runs torch's own dense kernels until
splice picks a format), so it can be run and compared after this pass.

Absorbed, in any order, while the current value has exactly one user:
- a bias: ``+ b`` with a constant ``b`` of shape ``[N]`` (``[N, 1]`` once the output is
  transposed) and the weight's dtype, if the site has no bias and no activation yet;
- one activation: relu, gelu (erf or tanh), silu (functions, methods, ATen ops, modules);
- a transpose of the last two dimensions (``.t()``, ``.transpose(-1, -2)``, ``.mT``,
  ``.permute(..., -1, -2)``), which toggles the transposed store.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from sparsecc.ir.epilogue import Activation
from sparsecc.ir.site import SITE_KEY, LinearSite

from . import PassResult
from .patterns import (ADD, ADD_METHODS, Constants, activation_of, arg, is_call, is_matrix_transpose,
                       rank, swaps_last_two_dims)

LINEAR_DENSE = torch.ops.sparsecc.linear_dense.default
LINEAR_FP8 = torch.ops.sparsecc.linear_fp8.default


def run(gm: fx.GraphModule, *, placeholders: dict[str, tuple[str, torch.Tensor]] | None = None) -> PassResult:
    constants = Constants(gm, placeholders)
    sites = [n.meta[SITE_KEY] for n in gm.graph.nodes if SITE_KEY in n.meta]
    replaced: dict[fx.Node, fx.Node] = {}       # erased output -> the fused node standing in
    for site in sites:
        site.x = replaced.get(site.x, site.x)
        absorbed = _absorb(site, gm, constants)
        output = absorbed[-1] if absorbed else site.anchor
        replaced[output] = _rewrite(gm, site, absorbed)
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, changed=bool(sites), sites=sites)


def _absorb(site: LinearSite, gm: fx.GraphModule, constants: Constants) -> list[fx.Node]:
    """Walk the single-user chain after the anchor, updating ``site``; return the nodes taken."""
    taken: list[fx.Node] = []
    current = site.anchor
    out_rank = rank(current)
    while len(current.users) == 1:
        user = next(iter(current.users))
        if user.args[:1] != (current,) and not (is_call(user, ADD, ADD_METHODS) and current in user.args[:2]):
            break
        if _is_bias_add(user, current, site, constants):
            other = user.args[1] if user.args[0] is current else user.args[0]
            site.bias_name, bias = constants.tensor(other)
            site.bias, site.bias_node = bias.reshape(-1), other
            site.fused.append("bias")
        elif site.activation is Activation.NONE and (act := activation_of(user, gm)) is not None:
            site.activation = act
            site.fused.append(act.value)
        elif swaps_last_two_dims(user, out_rank):
            site.transpose_out = not site.transpose_out
            site.fused.append("transpose")
        else:
            break
        taken.append(user)
        current = user
    return taken


def _is_bias_add(node: fx.Node, current: fx.Node, site: LinearSite, constants: Constants) -> bool:
    if not is_call(node, ADD, ADD_METHODS) or site.bias is not None or site.activation is not Activation.NONE:
        return False
    if arg(node, 2, "alpha", 1) != 1 or len(node.args) < 2:
        return False
    other = node.args[1] if node.args[0] is current else node.args[0]
    found = constants.tensor(other)
    if found is None:
        return False
    bias = found[1]
    expected = (site.out_features, 1) if site.transpose_out else (site.out_features,)
    return tuple(bias.shape) == expected and bias.dtype == site.weight.dtype


def _rewrite(gm: fx.GraphModule, site: LinearSite, absorbed: list[fx.Node]) -> fx.Node:
    """Replace the anchor and the absorbed nodes by one linear_dense node, and return it."""
    graph = gm.graph
    last = absorbed[-1] if absorbed else site.anchor
    with graph.inserting_before(last.next):
        weight = site.weight_node or graph.get_attr(site.weight_name)
        if site.weight_transposed:
            weight = graph.call_function(torch.t, (weight,))
        bias = site.bias_node
        if bias is None and site.bias_name is not None:
            bias = graph.get_attr(site.bias_name)
        if bias is not None and constants_shape(gm, site) != (site.out_features,):
            bias = graph.call_function(torch.flatten, (bias,))
        scales = (site.weight_scale_node, site.input_scale_node) if site.quantized else ()
        fused = graph.create_node("call_function", LINEAR_FP8 if site.quantized else LINEAR_DENSE,
                                  (site.x, weight, *scales, bias, site.activation.value, site.x_transposed,
                                   site.transpose_out), name="sparsecc_" + last.name)
    # "is_wrapped" (an fx.wrap'ed call such as fp8_linear) would make the code fx generates
    # register the new target as a wrapped global name, which breaks every later trace
    fused.meta = {k: v for k, v in last.meta.items() if k not in (SITE_KEY, "is_wrapped")}
    fused.meta[SITE_KEY] = site
    last.replace_all_uses_with(fused)
    erased = [site.anchor] + absorbed
    inputs = [a for node in erased for a in node.all_input_nodes]
    for node in reversed(erased):
        graph.erase_node(node)
    erase_dead_inputs(graph, inputs)
    site.anchor = fused
    return fused


def constants_shape(gm: fx.GraphModule, site: LinearSite) -> tuple[int, ...] | None:
    """Shape of the site's bias as stored (``[N]``, or ``[N, 1]`` for a transposed add)."""
    if site.bias_node is None:
        return tuple(site.bias.shape) if site.bias is not None else None
    stored = Constants(gm).tensor(site.bias_node)
    return tuple(stored[1].shape) if stored is not None else tuple(site.bias.shape)


def erase_dead_inputs(graph: fx.Graph, inputs: list[fx.Node]) -> None:
    """Erase constant reads (and their transposes) among ``inputs`` that lost their last user."""
    frontier = list(inputs)
    while frontier:
        node = frontier.pop()
        if getattr(node, "_erased", False) or node.users or node.op not in ("get_attr", "call_function", "call_method"):
            continue
        if node.op == "get_attr" or (is_matrix_transpose(node) and node.args[0].op == "get_attr"):
            frontier.extend(node.all_input_nodes)
            graph.erase_node(node)
