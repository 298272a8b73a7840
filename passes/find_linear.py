"""Mark every linear-like node whose weight is a constant.

Requires: a graph module; optionally shape metadata (``tensor_meta`` from ShapeProp or
``val`` from export), used to record each site's input shape and dtype.
Ensures: every recognised product carries a :class:`~sparsecc.site.LinearSite` in
``node.meta[SITE_KEY]``; the graph itself is unchanged.

Recognised forms, ``W`` being a 2-D parameter or buffer (or a placeholder the caller
declares constant) and ``P`` a stored ``[K, N]`` matrix:

- ``nn.Linear`` modules, ``F.linear(x, W, b)`` (torch and ATen);
- ``addmm(b, x, W.t())`` and ``addmm(b, x, P)`` (e.g. GPT-2's Conv1D);
- ``x @ W.t()``, ``x @ P``, ``matmul``/``mm`` (function or method), any transpose spelling;
- ``W @ x``: the weight on the left; its input is ``[..., K, M]``, its output ``[..., N, M]``;
- ``fp8_linear(x, W, weight_scale, input_scale, b)`` (sparsecc.quantize's layers): a quantized
  site, its scales constants too (``input_scale`` may be None: per token).
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from sparsecc.ir.site import SITE_KEY, LinearSite

from . import PassResult
from .patterns import ADDMM, FP8_LINEAR, LINEAR, MATMUL, MATMUL_METHODS, Constants, arg, fetch_attr, is_call


def run(gm: fx.GraphModule, *, prefix: str = "",
        placeholders: dict[str, tuple[str, torch.Tensor]] | None = None) -> PassResult:
    """Mark the linear sites of ``gm``. ``prefix`` is the graph module's path in the model
    (it prefixes site names); ``placeholders`` maps input names to constant tensors."""
    constants = Constants(gm, placeholders)
    sites: list[LinearSite] = []
    seen: dict[str, int] = {}
    for node in gm.graph.nodes:
        site = _match(node, gm, constants)
        if site is None:
            continue
        base = f"{prefix}.{site.weight_name}" if prefix else site.weight_name
        seen[base] = seen.get(base, 0) + 1
        site.name = base if seen[base] == 1 else f"{base}#{seen[base]}"
        site.module_path = prefix
        _record_input(site)
        node.meta[SITE_KEY] = site
        sites.append(site)
    return PassResult(gm, changed=False, sites=sites)


def _match(node: fx.Node, gm: fx.GraphModule, constants: Constants) -> LinearSite | None:
    if node.op == "call_module":
        module = fetch_attr(gm, node.target)
        if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward and len(node.args) == 1:
            bias_name = f"{node.target}.bias" if module.bias is not None else None
            if not isinstance(node.args[0], fx.Node):
                return None
            return LinearSite(name="", weight_name=f"{node.target}.weight", weight=module.weight,
                              x=node.args[0], anchor=node, bias_name=bias_name, bias=module.bias)
        return None
    if is_call(node, LINEAR):
        x, weight = arg(node, 0, "input"), constants.tensor(arg(node, 1, "weight"))
        bias = constants.tensor(arg(node, 2, "bias"))
        if weight is None or weight[1].dim() != 2 or not isinstance(x, fx.Node):
            return None
        if arg(node, 2, "bias") is not None and bias is None:
            return None                       # a computed bias: leave the node alone
        return _site(node, x, weight[0], weight[1], arg(node, 1, "weight"), False,
                     bias, arg(node, 2, "bias"))
    if is_call(node, FP8_LINEAR):
        return _fp8_site(node, constants)
    if is_call(node, ADDMM):
        if arg(node, 3, "beta", 1) != 1 or arg(node, 4, "alpha", 1) != 1:
            return None
        bias, x, right = constants.tensor(node.args[0]), node.args[1], constants.matrix(node.args[2])
        if bias is None or right is None or not isinstance(x, fx.Node) or constants.tensor(x):
            return None
        name, used, storage, transposed = right
        return _site(node, x, name, used.t(), storage, not transposed, bias, node.args[0])
    if is_call(node, MATMUL, MATMUL_METHODS):
        left, right = node.args[0], node.args[1]
        if constants.tensor(left) is None and (found := constants.matrix(right)) is not None:
            name, used, storage, transposed = found                         # x @ W^T
            return _site(node, left, name, used.t(), storage, not transposed, None, None)
        if constants.tensor(right) is None and (found := constants.matrix(left)) is not None:
            name, used, storage, transposed = found                         # W @ x
            site = _site(node, right, name, used, storage, transposed, None, None)
            if site is not None:
                site.x_transposed = site.transpose_out = True
            return site
    return None


def _fp8_site(node: fx.Node, constants: Constants) -> LinearSite | None:
    """A call of fp8_linear whose weight, scales and bias are constants."""
    x, weight_node = arg(node, 0, "x"), arg(node, 1, "weight")
    scale_node, input_scale_node, bias_node = arg(node, 2, "weight_scale"), arg(node, 3, "input_scale"), arg(node, 4, "bias")
    weight, bias = constants.tensor(weight_node), constants.tensor(bias_node)
    if weight is None or constants.tensor(scale_node) is None or not isinstance(x, fx.Node):
        return None
    if (input_scale_node is not None and constants.tensor(input_scale_node) is None) or \
            (bias_node is not None and bias is None):
        return None                           # computed scales or bias: leave the node alone
    site = _site(node, x, weight[0], weight[1], weight_node, False, bias, bias_node)
    if site is not None:
        site.quantized, site.weight_scale_node, site.input_scale_node = True, scale_node, input_scale_node
    return site


def _site(node, x, weight_name, weight, weight_node, weight_transposed, bias, bias_node) -> LinearSite | None:
    if not isinstance(x, fx.Node) or weight.dim() != 2:
        return None
    bias_name, bias_tensor = (bias if bias is not None else (None, None))
    if bias_tensor is not None and tuple(bias_tensor.shape) != (weight.shape[0],):
        return None
    return LinearSite(name="", weight_name=weight_name, weight=weight, x=x, anchor=node,
                      weight_node=weight_node, weight_transposed=weight_transposed,
                      bias_name=bias_name, bias=bias_tensor, bias_node=bias_node)


def _record_input(site: LinearSite) -> None:
    meta = site.x.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "shape"):
        site.input_shape, site.input_dtype = tuple(meta.shape), meta.dtype
        return
    val = site.x.meta.get("val")
    if isinstance(val, torch.Tensor):
        site.input_shape, site.input_dtype = tuple(val.shape), val.dtype
