"""A 2:4 site planned over batch sizes that no one kernel serves well: the small-batch kernels up
to the rows they win at, and above them the 2:4 GEMMs or the model's dense weight.

A causal LM that generates meets both kinds of work at every layer: one row per sequence per new
token (decode, where the GPU waits on the weight's bytes and the small-batch kernels, reading 9/16
of them, win) and the whole prompt at once (prefill, where the GEMMs or cuBLAS win). One packing
serves one kernel family, so a site planned over such a range (``m_range``, which compile sets
for a model that generates) keeps two: the small-batch layout, and either the GEMMs' layout
(9/8 of the dense bytes in all) or, where the planner timed 2:4 slower than dense at the top of
the range, the dense weight itself. :func:`linear_by_rows` picks by the rows of x on each call;
under torch.compile those rows are known when a graph is traced, so each graph calls one kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..ir.formats import NM_2_4, PackedWeight
from ..ir.plan import ABOVE_DENSE
from ..runtime.kernel_op import linear_kernel
from ..runtime.torch_ops import linear_torch
from .base import KernelFamily, KernelWeight
from .sparse24_small import GEMM, choose, pack_24

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


@dataclass
class ByRowsWeight(PackedWeight):
    """A 2:4 weight packed twice (see the module docstring): ``small`` for up to ``limit`` rows,
    ``large`` above (None: ``dense``, the weight itself, runs there)."""

    small: KernelWeight
    limit: int
    large: KernelWeight | None
    dense: Tensor | None = None
    selection: str = ""

    spec = NM_2_4
    op = staticmethod(linear_by_rows)

    @property
    def shape(self):  # type: ignore[override]
        return self.small.shape

    @property
    def extra_args(self) -> tuple:
        return (self.small.kernels, self.large.kernels if self.large is not None else "")

    def tensors(self):
        large = self.large
        return {"values": self.small.values, "metadata": self.small.metadata,
                "large_values": large.values if large is not None else self.dense,
                "large_metadata": large.metadata if large is not None else None}

    def scalars(self):
        return {"out_features": self.small.out_features, "in_features": self.small.in_features,
                "limit": self.limit}

    def to_dense(self) -> Tensor:
        return self.small.to_dense()


def small_tier(dtype: torch.dtype | str, shape: tuple[int, int], lo: int, hi: int) -> tuple[KernelFamily, int] | None:
    """The small-batch family a 2:4 site planned over ``lo..hi`` rows keeps beside a large tier,
    and the most rows it runs: None where one family serves the whole range (the range stays
    within the small-batch kernels' rows, or the GEMMs win already at ``lo``)."""
    small = choose(dtype, shape, lo)
    if small is GEMM or choose(dtype, shape, hi) is not GEMM:
        return None
    rows = [b for b in (lo, *small.buckets.bounds) if lo <= b <= min(small.max_m, hi)]
    return small, max(b for b in rows if choose(dtype, shape, b) is small)


def pack(weight: Tensor, m: int | None, *, tune_range: tuple[int, int] | None = None, progress: bool = False,
         above: str | None = None) -> KernelWeight | ByRowsWeight:
    """A 2:4 [N, K] CUDA weight packed for the batches of ``tune_range`` (its launches tuned
    there where tuning may run): for one family where one serves them all (:func:`pack_24`, for
    ``m`` rows), else a :class:`ByRowsWeight` whose large tier is the GEMMs, or the dense weight
    where ``above`` is :data:`ABOVE_DENSE`."""
    tier = small_tier(weight.dtype, tuple(weight.shape), *tune_range) if tune_range is not None else None
    if tier is None:
        return pack_24(weight, m, tune_range=tune_range, progress=progress)
    family, limit = tier
    lo, hi = tune_range
    small = family.pack(weight, NM_2_4, lo, tune_range=(lo, limit), progress=progress)
    if above == ABOVE_DENSE:
        return ByRowsWeight(small, limit, None, weight.detach(),
                            selection=f"{family.unit} up to M={limit}, dense (torch) above")
    large = GEMM.pack(weight, NM_2_4, hi, tune_range=(limit + 1, hi), progress=progress)
    return ByRowsWeight(small, limit, large, selection=f"{family.unit} up to M={limit}, {GEMM.unit} above")
