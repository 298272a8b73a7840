"""A site packed twice by the rows of x: a sparse format's kernels up to a limit, and above it
another packing (2:4's GEMMs) or the model's dense weight.

A causal LM that generates meets two kinds of work at every layer: one row per sequence per new
token (decode, where the GPU waits on the weight's bytes and a sparse format's small-batch kernels,
reading fewer of them, win) and the whole prompt at once (prefill, where the GEMMs or cuBLAS win).
One packing serves one kernel family, so a site planned over such a range keeps two
(:class:`ByRowsWeight`), and :func:`linear_by_rows` picks by the rows of x on each call; under
torch.compile those rows are known when a graph is traced, so each graph calls one kernel.
:mod:`sparsecc.kernels.sparse24_by_rows` packs 2:4 sites so, the registry block-sparse ones.

Sibling sites (sparsecc.ir.siblings: q, k and v; gate and up) planned so share the small tier, one
call on their stacked weight (:class:`GroupByRowsWeight`); above it, where the top runs dense, each
member runs its own dense weight, the model's: stacked, the dense weights would be a copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..ir.formats import FormatSpec, PackedWeight
from ..runtime.kernel_op import linear_kernel
from ..runtime.torch_ops import linear_torch
from .base import KernelWeight


def linear_by_rows(x: Tensor, values: Tensor, metadata: Optional[Tensor], large_values: Tensor,
                   large_metadata: Optional[Tensor], out_features: int, in_features: int, limit: int,
                   bias: Optional[Tensor], activation: str, x_transposed: bool, transpose_out: bool,
                   kernels: str, large_kernels: str) -> Tensor:
    """A site of :class:`ByRowsWeight`: x with at most ``limit`` rows on the small-batch kernels
    (``values``, ``metadata``, ``kernels``), more on the large tier: the GEMMs (``large_*``), or the
    dense weight ``large_values`` where ``large_kernels`` is empty."""
    rows = x.numel() // in_features if in_features else 0
    if rows <= limit:
        return linear_kernel(x, values, metadata, out_features, in_features, bias, activation, x_transposed,
                             transpose_out, kernels)
    if not large_kernels:
        return linear_torch(x, large_values, bias, activation, x_transposed, transpose_out)
    return linear_kernel(x, large_values, large_metadata, out_features, in_features, bias, activation,
                         x_transposed, transpose_out, large_kernels)


class _SmallTier(PackedWeight):
    """What both packings share: ``small``, the low end's packing (its format is theirs), serves
    up to ``limit`` rows."""

    small: KernelWeight
    limit: int

    @property
    def spec(self) -> FormatSpec:  # type: ignore[override]
        return self.small.spec

    @property
    def shape(self):  # type: ignore[override]
        return self.small.shape

    def scalars(self):
        return {"out_features": self.small.out_features, "in_features": self.small.in_features,
                "limit": self.limit}


@dataclass
class ByRowsWeight(_SmallTier):
    """A sparse weight packed twice (see the module docstring): ``small`` for up to ``limit`` rows,
    ``large`` above (None: ``dense``, the weight itself, runs there)."""

    small: KernelWeight
    limit: int
    large: KernelWeight | None
    dense: Tensor | None = None
    selection: str = ""

    op = staticmethod(linear_by_rows)

    @property
    def extra_args(self) -> tuple:
        return (self.small.kernels, self.large.kernels if self.large is not None else "")

    def tensors(self):
        large = self.large
        return {"values": self.small.values, "metadata": self.small.metadata,
                "large_values": large.values if large is not None else self.dense,
                "large_metadata": large.metadata if large is not None else None}

    def to_dense(self) -> Tensor:
        return self.small.to_dense()

    def for_members(self, weights: list[Tensor]) -> "GroupByRowsWeight":
        """This packing of a sibling group's stacked weight, its dense tier replaced by the members'
        own ``weights`` (each ``[N_i, K]``, in the group's order; their rows add up to this one's)."""
        if self.large is not None:
            raise ValueError("only a packing whose top runs dense has the members' own weights there")
        if sum(w.shape[0] for w in weights) != self.shape[0]:
            raise ValueError(f"the members' weights have {sum(w.shape[0] for w in weights)} rows, "
                             f"the stacked one {self.shape[0]}")
        return GroupByRowsWeight(self.small, self.limit, list(weights), self.selection)


def linear_split_by_rows(x: Tensor, values: Tensor, metadata: Optional[Tensor], dense: list[Tensor],
                         out_features: int, in_features: int, limit: int, bias: Optional[Tensor], activation: str,
                         x_transposed: bool, transpose_out: bool, kernels: str) -> tuple[Tensor, ...]:
    """A sibling group of :class:`GroupByRowsWeight`, each member's output: up to ``limit`` rows of x
    one small-batch call on the stacked weight (``values``, ``metadata``, ``kernels``), split (views);
    more, each member's own weight in ``dense`` with its part of the stacked ``bias``."""
    sizes = [w.shape[0] for w in dense]
    rows = x.numel() // in_features if in_features else 0
    if rows <= limit:
        shared = linear_kernel(x, values, metadata, out_features, in_features, bias, activation, x_transposed,
                               transpose_out, kernels)
        return torch.split(shared, sizes, -1)
    biases = bias.split(sizes) if bias is not None else [None] * len(dense)
    return tuple(linear_torch(x, weight, part, activation, x_transposed, transpose_out)
                 for weight, part in zip(dense, biases))


@dataclass
class GroupByRowsWeight(_SmallTier):
    """A sibling group's sparse weights (see the module docstring): ``small``, the stacked weight's
    small-batch packing, for up to ``limit`` rows; above, ``dense``, the members' own weights. Its
    op returns the members' outputs, not the stacked one."""

    small: KernelWeight
    limit: int
    dense: list[Tensor]
    selection: str = ""

    op = staticmethod(linear_split_by_rows)
    #: the op gives each member's output itself (a split where it ran one call)
    returns_parts = True

    @property
    def extra_args(self) -> tuple:
        return (self.small.kernels,)

    def tensors(self):
        return {"values": self.small.values, "metadata": self.small.metadata, "dense": self.dense}

    @property
    def nbytes(self) -> int:
        return self.small.nbytes + sum(w.numel() * w.element_size() for w in self.dense)

    def to_dense(self) -> Tensor:
        return torch.cat(self.dense)
