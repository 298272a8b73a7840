"""Tensor-parallel linear layers, run on each rank's local shard.

``torch.distributed.tensor.parallel.parallelize_module`` turns an ``nn.Linear`` into one whose
weight is a DTensor sharded over a 1-D device mesh, and installs hooks on it that convert its input
to a DTensor and its output back (redistributing where the layout asks for it: the all-reduce after
a row-wise layer). sparsecc cannot pack a DTensor: what each rank computes with is its local shard.

:func:`find_shards` makes, for every such layer, a :class:`LocalShard` to take its place in
a copy of the model: a module with the same hooks (so the collectives run as installed) whose
forward unwraps the input DTensor, runs a plain ``nn.Linear`` holding the local shard (``local``,
sharing its storage; this is the site sparsecc plans, packs and rewrites) and wraps the result in
the DTensor the layer would have produced:

=====================================  ================  =====================  ===============
layout (``parallelize_module`` style)  weight            input the hooks give   output
=====================================  ================  =====================  ===============
ColwiseParallel                        ``Shard(0)``      ``Replicate()``        ``Shard(-1)``
RowwiseParallel                        ``Shard(1)``      ``Shard(-1)``          ``Partial()``
=====================================  ================  =====================  ===============

A column-wise bias is sharded with the rows and fused into the local product; a row-wise bias is
replicated and added to the partial output as a DTensor (DTensor adds it once, not once per rank).
Called with another input layout (custom hooks), a LocalShard computes what the original layer
computes, on the DTensors. Any other sharded linear (a 2-D mesh, a replicated weight) is left as
it was and listed in ``refused`` with the reason; sparsecc leaves its weight dense.
"""
from __future__ import annotations

import copy
import logging
import sys
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger("sparsecc")

#: the hook registries of an nn.Module that a LocalShard takes over from the layer it replaces
HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
         "_forward_hooks_always_called")


def _dtensor():
    """``torch.distributed.tensor`` if it is loaded, else None. A DTensor exists only once that
    module is loaded, so sparsecc never loads it itself (it adds seconds to ``import sparsecc``)."""
    return sys.modules.get("torch.distributed.tensor")


def is_distributed(tensor) -> bool:
    """Whether ``tensor`` is a DTensor (its values live on several ranks)."""
    dt = _dtensor()
    return dt is not None and isinstance(tensor, dt.DTensor)


@dataclass(frozen=True)
class ShardLayout:
    """Where a rank's shard sits in the full ``[N, K]`` weight: split along ``dim`` (0: output
    features, column-wise parallel; 1: input features, row-wise parallel) over ``ranks`` ranks, this
    one holding ``shape`` from ``offset`` (row, column)."""

    dim: int
    ranks: int
    rank: int
    full_shape: tuple[int, int]
    shape: tuple[int, int]
    offset: tuple[int, int]

    @property
    def style(self) -> str:
        return "column-wise (weight Shard(0))" if self.dim == 0 else "row-wise (weight Shard(1))"

    def describe(self) -> str:
        what = "rows" if self.dim == 0 else "columns"
        start = self.offset[self.dim]
        return (f"tensor parallel, {self.style} over {self.ranks} ranks: rank {self.rank} runs {what} "
                f"{start}:{start + self.shape[self.dim]} of the {list(self.full_shape)} weight")

    def cuts(self, group_along_k: int | None = None, block: tuple[int, int] | None = None) -> bool:
        """Whether this shard's boundaries fall inside a group of ``group_along_k`` along K or a
        ``block`` of the full weight, so its groups or blocks are not the full weight's."""
        start, size = self.offset[self.dim], self.shape[self.dim]
        edges = [start, start + size]
        if group_along_k is not None and self.dim == 1:
            return any(e % group_along_k for e in edges if e < self.full_shape[1])
        if block is not None:
            unit = block[self.dim]
            return any(e % unit for e in edges if e < self.full_shape[self.dim])
        return False


class LocalShard(nn.Module):
    """A tensor-parallel ``nn.Linear`` computed on this rank's shard (see the module docstring).
    ``weight`` and ``bias`` are the layer's own DTensor parameters; ``local`` is the ``nn.Linear``
    on the local shard that sparsecc compiles (and replaces with its graph)."""

    def __init__(self, linear: nn.Linear, layout: ShardLayout):
        super().__init__()
        self.layout = layout
        self.weight = linear.weight
        self.bias = linear.bias
        self.mesh = linear.weight.device_mesh
        self._original = weakref.ref(linear)
        with torch.no_grad():
            local_weight = linear.weight.to_local()
            local_bias = linear.bias.to_local() if linear.bias is not None and layout.dim == 0 else None
        self.local = nn.Linear(layout.shape[1], layout.shape[0], bias=local_bias is not None, device="meta",
                               dtype=local_weight.dtype)
        self.local.weight = nn.Parameter(local_weight, requires_grad=False)
        if local_bias is not None:
            self.local.bias = nn.Parameter(local_bias, requires_grad=False)
        self._warned = False
        for name in HOOKS:
            setattr(self, name, copy.copy(getattr(linear, name)))

    @property
    def original(self) -> nn.Module | None:
        """The layer this one stands in for (in the user's model), while it exists."""
        return self._original()

    def _runs_locally(self, x) -> bool:
        dt = _dtensor()
        if not isinstance(x, dt.DTensor) or x.device_mesh != self.mesh or len(x.placements) != 1:
            return False
        placement = x.placements[0]
        if self.layout.dim == 0:
            return isinstance(placement, dt.Replicate)
        return isinstance(placement, dt.Shard) and placement.dim in (-1, x.dim() - 1)

    def forward(self, x):
        if not self._runs_locally(x):
            if not self._warned:
                log.warning("a tensor-parallel linear got its input as %s, not the layout its style gives: it "
                            "runs as the original layer, on DTensors (dense)",
                            getattr(x, "placements", type(x).__name__))
                self._warned = True
            return F.linear(x, self.weight, self.bias)
        dt = _dtensor()
        y = self.local(x.to_local())
        shape = (*x.shape[:-1], self.layout.full_shape[0])
        placement = dt.Shard(y.dim() - 1) if self.layout.dim == 0 else dt.Partial()
        y = dt.DTensor.from_local(y, self.mesh, (placement,), run_check=False, shape=torch.Size(shape),
                               stride=_contiguous_strides(shape))
        if self.bias is not None and self.layout.dim == 1:
            y = y + self.bias
        return y


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= int(size)
    return tuple(reversed(strides))


def layout_of(linear: nn.Module) -> ShardLayout | str:
    """The :class:`ShardLayout` of a tensor-parallel ``nn.Linear``, or why it cannot run on its
    local shard."""
    dt = _dtensor()
    weight, bias = linear.weight, linear.bias
    mesh = weight.device_mesh
    if mesh.ndim != 1 or len(weight.placements) != 1:
        return f"its weight is sharded over a {mesh.ndim}-D mesh {weight.placements}; only 1-D meshes run locally"
    placement = weight.placements[0]
    if not isinstance(placement, dt.Shard) or placement.dim not in (0, 1):
        return f"its weight's placement {placement} is neither Shard(0) (column-wise) nor Shard(1) (row-wise)"
    dim = placement.dim
    wanted = dt.Shard(0) if dim == 0 else dt.Replicate()
    if bias is not None and (not is_distributed(bias) or tuple(bias.placements) != (wanted,)):
        return f"its bias is {getattr(bias, 'placements', 'not a DTensor')}, not {wanted} as its weight's layout needs"
    local = weight.to_local()
    sizes, offsets = _shard_extent(weight.shape[dim], mesh.size(), mesh.get_local_rank())
    if local.shape[dim] != sizes:
        return f"its local shard has {local.shape[dim]} along dim {dim}, not the {sizes} torch's chunking gives"
    offset = (offsets, 0) if dim == 0 else (0, offsets)
    return ShardLayout(dim=dim, ranks=mesh.size(), rank=mesh.get_local_rank(), full_shape=tuple(weight.shape),
                       shape=tuple(local.shape), offset=offset)


def _shard_extent(size: int, ranks: int, rank: int) -> tuple[int, int]:
    """(length, start) of ``rank``'s chunk of ``size`` split as torch.chunk splits (Shard's rule)."""
    chunk = -(-size // ranks)
    start = min(chunk * rank, size)
    return min(chunk, size - start), start


def find_shards(model: nn.Module) -> tuple[dict[str, LocalShard], dict[str, str]]:
    """A :class:`LocalShard` for every tensor-parallel linear of ``model`` that can run on its local
    shard (by path; :func:`sparsecc.frontend.tracing.assemble` puts them in a copy of the model), and
    the paths of those that cannot, with why (they stay dense). ``model`` is not changed."""
    shards, refused = {}, {}
    for path, module in model.named_modules():
        if type(module) is nn.Linear and is_distributed(module.weight):
            layout = layout_of(module)
            if isinstance(layout, str):
                refused[path] = f"tensor-parallel linear left dense: {layout}"
            else:
                shards[path] = LocalShard(module, layout)
    return shards, refused
