"""Rewrite each patch-embedding convolution into a linear over patches.

A convolution whose kernel tiles its input (stride equal to the kernel, no padding, no
dilation, one group, a kernel larger than 1x1) multiplies every non-overlapping patch by the
same ``[out_channels, in_channels * kernel]`` matrix: it is ``F.linear`` on the patches. ViT's
patch embedding is one. Written as a linear it becomes a site like any other (sparse kernels
for a pruned weight), and a dense one runs on the GEMM: on an H100, ViT-B/16's patch embedding
at batch 256 takes cuDNN 2.1 ms (its input converted to NHWC and back around an implicit-GEMM
convolution) and 0.16 ms as a patch copy plus a GEMM under Inductor.

Requires: a graph module; the convolution's weight shape, from a module, a ``get_attr``, a
placeholder the caller declares constant, or shape metadata.
Ensures: each such convolution is ``grid_of(F.linear(patches(x, k), flatten(W, 1), b), x, k)``
(functions of this module: the patches copied out row by row, and the output as a view in
the convolution's shape). The products and their sums are the same, so is the result, up to
the order of the sums. The output's strides are channels-last; where a user of the
convolution is not one of :data:`LAYOUT_FREE` a ``.contiguous()`` restores the dense layout.

1x1 convolutions (stride 1) are left alone: they are linears too, but the rewrite would
change the layout their output is stored in, which the convolutions around them pay for.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from . import PassResult
from .patterns import Constants, arg, fetch_attr

aten = torch.ops.aten

CONV = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3,
        aten.conv1d.default: 1, aten.conv2d.default: 2, aten.conv3d.default: 3}
CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: users that take the convolution's output in any layout (its view semantics are kept)
LAYOUT_FREE = {"flatten", "reshape", "permute", "transpose", "contiguous",
               torch.flatten, torch.reshape, torch.permute, torch.transpose}


def patches(x: torch.Tensor, kernel: tuple[int, ...]) -> torch.Tensor:
    """``x`` ``[B, C, *sizes]`` (or unbatched ``[C, *sizes]``) as its patches, one per row:
    ``[B * prod(sizes // kernel), C * prod(kernel)]``, each row ordered (channel, *kernel
    position) as a convolution weight flattens. Trailing inputs that fill no patch are dropped,
    as the convolution drops them."""
    if x.dim() == len(kernel) + 1:
        x = x.unsqueeze(0)
    batch, channels, *sizes = x.shape
    grid = [size // k for size, k in zip(sizes, kernel)]
    x = x[(slice(None), slice(None), *(slice(0, g * k) for g, k in zip(grid, kernel)))]
    split = x.reshape(batch, channels, *(v for g, k in zip(grid, kernel) for v in (g, k)))
    d = len(kernel)
    order = [0, *(2 + 2 * i for i in range(d)), 1, *(3 + 2 * i for i in range(d))]
    return split.permute(order).reshape(-1, channels * math.prod(kernel))


def grid_of(y: torch.Tensor, x: torch.Tensor, kernel: tuple[int, ...]) -> torch.Tensor:
    """The linear's output ``[B * prod(grid), N]`` as the convolution's ``[B, N, *grid]`` (a
    view: channels-last strides), for the input ``x`` :func:`patches` took."""
    d = len(kernel)
    grid = [size // k for size, k in zip(x.shape[-d:], kernel)]
    batched = x.dim() == d + 2
    out = y.reshape(x.shape[0] if batched else 1, *grid, y.shape[-1]).permute(0, d + 1, *range(1, d + 1))
    return out if batched else out.squeeze(0)


def is_patch_conv(module: nn.Module) -> bool:
    """Whether ``module`` is a convolution module this pass rewrites."""
    return (type(module) in CONV_MODULES and module.padding_mode == "zeros"
            and _tiles(module.weight.shape, module.stride, module.padding, module.dilation, module.groups))


def run(gm: fx.GraphModule, *, placeholders: dict[str, tuple[str, torch.Tensor]] | None = None) -> PassResult:
    """Rewrite every patch-embedding convolution of ``gm`` (``placeholders``: input name ->
    (name, constant tensor), for weights that arrive as graph inputs)."""
    constants = Constants(gm, placeholders)
    changed = False
    for node in list(gm.graph.nodes):
        found = _patch_conv(node, gm, constants)
        if found is not None:
            _rewrite(gm, node, *found)
            changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changed=changed)


def _patch_conv(node: fx.Node, gm: fx.GraphModule, constants: Constants):
    """``(x, weight node or name, bias node or name, kernel)`` if ``node`` is a patch
    convolution, else None."""
    if node.op == "call_module":
        module = fetch_attr(gm, node.target)
        if not is_patch_conv(module) or len(node.args) != 1 or node.kwargs:
            return None
        bias = f"{node.target}.bias" if module.bias is not None else None
        return node.args[0], f"{node.target}.weight", bias, tuple(module.kernel_size)
    if node.op != "call_function" or node.target not in CONV:
        return None
    d = CONV[node.target]
    weight = arg(node, 1, "weight")
    shape = _shape(weight, constants)
    if shape is None or len(shape) != d + 2:
        return None
    stride, padding = arg(node, 3, "stride", 1), arg(node, 4, "padding", 0)
    dilation, groups = arg(node, 5, "dilation", 1), arg(node, 6, "groups", 1)
    if not _tiles(shape, stride, padding, dilation, groups):
        return None
    return arg(node, 0, "input"), weight, arg(node, 2, "bias"), tuple(shape[2:])


def _shape(weight, constants: Constants) -> tuple[int, ...] | None:
    found = constants.tensor(weight)
    if found is not None:
        return tuple(found[1].shape)
    value = weight.meta.get("val", weight.meta.get("tensor_meta")) if isinstance(weight, fx.Node) else None
    shape = getattr(value, "shape", None)
    return tuple(int(s) for s in shape) if shape is not None and all(isinstance(s, int) for s in shape) else None


def _tiles(shape, stride, padding, dilation, groups) -> bool:
    """Whether a convolution with a weight of ``shape`` takes non-overlapping patches that
    cover its input without padding, with one group and a kernel larger than one input."""
    kernel = tuple(shape[2:])
    d = len(kernel)

    def per_dim(value):
        values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        return values * d if len(values) == 1 else values

    if isinstance(padding, str):
        padding = 0 if padding == "valid" else None
    return (padding is not None and groups == 1 and math.prod(kernel) > 1 and per_dim(stride) == kernel
            and all(p == 0 for p in per_dim(padding)) and all(v == 1 for v in per_dim(dilation)))


def _rewrite(gm: fx.GraphModule, node: fx.Node, x, weight, bias, kernel) -> None:
    graph = gm.graph
    with graph.inserting_before(node):
        weight = graph.get_attr(weight) if isinstance(weight, str) else weight
        bias = graph.get_attr(bias) if isinstance(bias, str) else bias
        matrix = graph.call_function(torch.flatten, (weight, 1))
        rows = graph.call_function(patches, (x, kernel))
        product = graph.call_function(F.linear, (rows, matrix, bias))
        out = graph.call_function(grid_of, (product, x, kernel))
    if not all(_layout_free(user) for user in node.users):
        with graph.inserting_after(out):
            out = graph.call_method("contiguous", (out,))
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _layout_free(user: fx.Node) -> bool:
    return user.op in ("call_method", "call_function") and user.target in LAYOUT_FREE
