"""A 2:4 site planned over batch sizes that no one kernel serves well: the small-batch kernels up
to the rows they win at, and above them the 2:4 GEMMs or the model's dense weight.

A site planned over such a range (``m_range``, which compile sets for a model that generates)
keeps two packings (:class:`~sparsecc.kernels.by_rows.ByRowsWeight`): the small-batch layout
(reading 9/16 of the dense bytes), and either the GEMMs' layout (9/8 of the dense bytes in all)
or, where the planner timed 2:4 slower than dense at the top of the range, the dense weight itself.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..ir.formats import NM_2_4
from ..ir.plan import ABOVE_DENSE
from .base import KernelFamily, KernelWeight
from .by_rows import ByRowsWeight
from .sparse24_small import GEMM, choose, pack_24


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
