"""Measure a weight's sparsity: what exact formats can represent it, and at what density.

The cost model only considers formats that represent the weight exactly, so this module
answers, per weight: its density; for each group size m along K, the smallest n such that
the weight fits n:m, and how many non-zeros lie beyond two per group of four (the residual of
a split CSR weight, which the cost model prices); and for each block shape, the fraction of
blocks that hold a non-zero.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .formats import FormatSpec, group_along_k

#: group sizes m for which the smallest fitting n is measured
NM_GROUP_SIZES = (4, 8, 16, 32)
#: block shapes (rows x cols) whose block density is measured, when they divide the weight
BLOCK_SHAPES = ((16, 16), (32, 32), (64, 64), (128, 128), (16, 64), (64, 16), (32, 64), (64, 32))


@dataclass
class WeightStats:
    """Sparsity of one [N, K] weight. ``nm_min_n[m]`` is the smallest n it fits as n:m."""

    shape: tuple[int, int]
    dtype: str
    nnz: int
    nm_min_n: dict[int, int] = field(default_factory=dict)
    #: non-zeros beyond the first two of their group of four along K: what a split CSR weight
    #: (sparsecc.kernels.csr_split) leaves to its residual pass
    beyond_24: int = 0
    block_density: dict[tuple[int, int], float] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def density(self) -> float:
        return self.nnz / self.numel if self.numel else 0.0

    def fits(self, spec: FormatSpec) -> bool:
        """Whether ``spec`` represents this weight exactly."""
        if spec.kind in ("dense", "csr"):
            return True
        if spec.kind == "nm":
            return spec.m in self.nm_min_n and self.nm_min_n[spec.m] <= spec.n
        if spec.kind == "bsr":
            return spec.block in self.block_density
        return False

    def fitting_patterns(self) -> list[str]:
        """The tightest n:m for every measured m that is sparser than dense (e.g. ['2:4', '3:8'])."""
        return [f"{n}:{m}" for m, n in sorted(self.nm_min_n.items()) if n < m]


def analyze(weight: torch.Tensor, *, extra_group_sizes: tuple[int, ...] = (),
            extra_blocks: tuple[tuple[int, int], ...] = ()) -> WeightStats:
    """Measure ``weight`` ([N, K]). Extra group sizes and blocks come from user formats."""
    weight = weight.detach()
    dtype_name = str(weight.dtype).replace("torch.", "")
    if weight.is_floating_point() and weight.element_size() == 1:
        weight = weight.to(torch.float16)     # FP8 widens exactly; torch's CPU reductions take no float8
    nonzero = weight != 0
    rows, cols = weight.shape
    stats = WeightStats(shape=(rows, cols), dtype=dtype_name,
                        nnz=int(nonzero.sum()))
    for m in sorted(set(NM_GROUP_SIZES) | set(extra_group_sizes)):
        if m <= cols and m >= 2:
            counts = group_along_k(nonzero, m).sum(-1)
            stats.nm_min_n[m] = int(counts.max()) if nonzero.numel() else 0
            if m == 4:
                stats.beyond_24 = int((counts - 2).clamp(min=0).sum())
    for h, w in dict.fromkeys(BLOCK_SHAPES + tuple(extra_blocks)):
        if rows % h == 0 and cols % w == 0:
            present = nonzero.reshape(rows // h, h, cols // w, w).any(3).any(1)
            stats.block_density[(h, w)] = float(present.float().mean())
    return stats


def worst_of(stats: list[WeightStats]) -> WeightStats:
    """One weight's statistics that every one of ``stats`` (e.g. the shards of one layer on the
    ranks of a tensor-parallel model) satisfies: a format fits it only if it fits each of them, and
    its density and group counts are the largest, so a plan made from it suits every shard and
    prices the slowest. Its shape is the first's."""
    first = stats[0]
    return WeightStats(
        shape=first.shape, dtype=first.dtype, nnz=max(s.nnz for s in stats),
        nm_min_n={m: max(s.nm_min_n[m] for s in stats) for m in first.nm_min_n if all(m in s.nm_min_n for s in stats)},
        beyond_24=max(s.beyond_24 for s in stats),
        block_density={b: max(s.block_density[b] for s in stats) for b in first.block_density
                       if all(b in s.block_density for s in stats)})
