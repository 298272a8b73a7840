"""2:4 weights at small batches (decode): memory-bound kernels that read the weight's 9/16 of
the dense bytes.

- :class:`Sparse24Gemv` (templates/gemv_sm90_sparse24.cu.j2), on CUDA cores: warps read the
  kept values with 16-byte loads along K, pick each group's two inputs with one byte permute
  and sum in fp32; fastest at one row of x on weights of a few MB.
- :class:`Sparse24Mma` (templates/gemv_mma_sm90_sparse24.cu.j2), on the sparse tensor cores
  (``mma.sp`` m16n8k32): the weight packed in units of 16 output features x 64 inputs in the
  order the instruction takes them, x staged in shared memory, K split over the block's warps
  and a cluster of blocks (the launch's ``splits``; 0: the kernel picks); from 2 to 64 rows.
  Past 8 rows its tuning also times templates/gemv_mma_bulk_sm90_sparse24.cu.j2, which reads the
  same units through shared memory (bulk copies into a pipeline of stages) so that one block
  multiplies each unit of W by all of a bucket's rows.

Both are programmatic dependent launches that read their weight before they wait for the
kernel ahead, so packing ends with a host synchronisation. :func:`choose` picks, for a 2:4
site planned at M rows, the family whose tuned launch runs that batch fastest (these two or
the CUTLASS GEMMs of :mod:`sparsecc.kernels.sparse24`); every layout serves every batch size,
each is fastest in its own range.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codegen.spec import TILES, Family, KernelSpec
from ..errors import InputError
from ..ir.formats import NM_2_4
from ..ir.weights import random_weight
from ..ir.workload import Workload, dtype_name, element_size
from ..runtime.kernel_op import ensure
from . import tune
from .base import (K_MULTIPLE, Buckets, KernelFamily, KernelWeight, Launch, check_cuda_weight, finish_packing,
                   shape_supported)
from .dense_small import CLUSTER_SPLITS
from .sparse24 import Sparse24Gemm

#: the batches a 2:4 site is packed for the small-batch kernels at: the CUDA-core kernel up to
#: GEMV_MAX_M rows (unless the tensor-core one measured faster there), the tensor-core one up to
#: MMA_MAX_M where it measured faster than the GEMM, and without measurements up to
#: MMA_DEFAULT_MAX_M; the GEMMs elsewhere. On an H100 (six LLM/BERT shapes, fp16 and bf16) at
#: M = 1 the CUDA-core kernel was fastest on the 1-16 MB weights and the tensor-core one on the
#: 90 MB ones; at M = 4..32 the tensor-core kernel ran 1.39-2.62x faster than cuBLAS and ahead of
#: the GEMMs; at M = 64 the GEMMs won on the 32-90 MB weights.
GEMV_MAX_M = 1
MMA_MAX_M = 64
MMA_DEFAULT_MAX_M = 8
#: the bulk-copy kernel's launches tuning times past 8 rows, as (16-feature unit rows per block,
#: units of 64 inputs per stage, blocks per cluster; 0: the kernel picks), its tiles of x covering
#: the bucket's rows; it takes weights whose K is a multiple of 64
BULK_LAUNCHES = ((4, 4, 0), (4, 4, 2), (4, 4, 8), (4, 2, 0), (8, 4, 0), (8, 2, 0))
BULK_MIN_M = 9

def _kept_pairs(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What the small-batch layouts store of a 2:4 [N, K] weight: the two kept entries of each
    group of four along K ([N, K/2], in order; a group with fewer non-zeros keeps zeros at its
    lowest free positions) and their positions as 16 bits per 16 inputs ([N, K/16] int64, group
    g's two positions in bits 4g..4g+1 and 4g+2..4g+3). InputError if it is not 2:4."""
    n, k = weight.shape
    if k % K_MULTIPLE:
        raise InputError(f"the {layout} layout needs K % {K_MULTIPLE} == 0 (this weight is {n}x{k})")
    groups = weight.detach().reshape(n, k // 4, 4)
    nonzero = groups != 0
    if (nonzero.sum(-1) > 2).any():
        raise InputError("the weight is not 2:4: some group of four along K has more than two non-zeros")
    preference = nonzero.to(torch.int8) * 4 + torch.arange(3, -1, -1, dtype=torch.int8, device=weight.device)
    positions = preference.topk(2, dim=-1).indices.sort(dim=-1).values
    codes = (positions[..., 0] | (positions[..., 1] << 2)).reshape(n, k // 16, 4).to(torch.int64)
    return groups.gather(-1, positions).reshape(n, k // 2), sum(codes[..., g] << (4 * g) for g in range(4))


def _dense_from_pairs(values: torch.Tensor, bits: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [N, K] weight back from :func:`_kept_pairs`' two arrays: every value to its position."""
    codes = torch.stack([(bits >> (4 * g)) & 0xF for g in range(4)], dim=-1).reshape(n, k // 4)
    positions = torch.stack([codes & 3, codes >> 2], dim=-1).long()
    dense = values.new_zeros(n, k // 4, 4)
    dense.scatter_(-1, positions, values.reshape(n, k // 4, 2))
    return dense.reshape(n, k)


@dataclass
class Sparse24GemvWeight(KernelWeight):
    """A 2:4 weight in the layout of the small-batch kernels (templates/gemv_sm90_sparse24):
    ``values`` [N, K/2] (the two kept entries of each group of four, in order) and
    ``metadata`` [N, K/16] int16 holding 16 bits per four groups (each group's two positions,
    2 bits each)."""

    spec = NM_2_4

    @classmethod
    def pack(cls, weight: torch.Tensor) -> "Sparse24GemvWeight":
        """The layout alone (any device): exact for a weight with at most two non-zeros per
        group of four along K."""
        values, bits = _kept_pairs(weight, "gemv")
        indices = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).contiguous()
        return cls(values.contiguous(), indices, *weight.shape)

    def to_dense(self) -> torch.Tensor:
        """Unpack exactly (torch ops: every value goes back to its position)."""
        return _dense_from_pairs(self.values, self.metadata.to(torch.int64) & 0xFFFF, self.out_features,
                                 self.in_features)


#: the tensor-core small-batch layout's unit: 16 output features x 64 inputs (512 kept values, 32 words)
MMA_UNIT_ROWS, MMA_UNIT_COLUMNS = 16, 64
#: metadata of four groups of four that keep positions 0 and 1: what padding stores
_PADDING_CODES = 0x4444


@dataclass
class Sparse24MmaWeight(KernelWeight):
    """A 2:4 weight in the layout of the tensor-core small-batch kernels
    (templates/gemv_mma_sm90_sparse24, which describes it): units of 16 output features x 64
    inputs, zero-padded to whole units.
    ``values`` [ceil(N/16), ceil(K/64), 512] holds each unit's kept values in the order of the
    sparse tensor cores' A fragments (8 per lane and 32-input half); ``metadata``
    [ceil(N/16), ceil(K/64), 32] int32 a word per lane, two rows' 16-bit metadata (each group
    of four's two positions, 2 bits each) for one 16-input piece."""

    spec = NM_2_4

    @classmethod
    def pack(cls, weight: torch.Tensor) -> "Sparse24MmaWeight":
        """The layout alone (any device): exact for a weight with at most two non-zeros per
        group of four along K."""
        n, k = weight.shape
        kept, codes = _kept_pairs(weight, "small-batch")
        tiles, units = -(-n // MMA_UNIT_ROWS), -(-k // MMA_UNIT_COLUMNS)
        values = weight.new_zeros(tiles * 16, units * 32)
        values[:n, :k // 2] = kept
        bits = torch.full((tiles * 16, units * 4), _PADDING_CODES, dtype=torch.int64, device=weight.device)
        bits[:n, :k // 16] = codes
        # (unit row, row // 8, g, unit, half, column // 8, t, column % 2) -> lane 4g + t's 8 values
        values = values.reshape(tiles, 2, 8, units, 2, 2, 4, 2).permute(0, 3, 4, 2, 6, 5, 1, 7)
        bits = bits.reshape(tiles, 2, 8, units, 2, 2)        # (unit row, row // 8, q, unit, half, piece)
        words = (bits[:, 0] | (bits[:, 1] << 16)).permute(0, 2, 1, 3, 4).reshape(tiles, units, 32)
        words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        return cls(values.reshape(tiles, units, 512).contiguous(), words.contiguous(), n, k)

    def to_dense(self) -> torch.Tensor:
        """Unpack exactly (torch ops: every value goes back to its position)."""
        n, k = self.out_features, self.in_features
        tiles, units = self.values.shape[:2]
        values = self.values.reshape(tiles, units, 2, 8, 4, 2, 2, 2).permute(0, 6, 3, 1, 2, 5, 4, 7)
        values = values.reshape(tiles * 16, units * 32)[:n, :k // 2]
        words = self.metadata.to(torch.int64).reshape(tiles, units, 8, 2, 2).permute(0, 2, 1, 3, 4)
        bits = torch.stack([words & 0xFFFF, (words >> 16) & 0xFFFF], dim=1).reshape(tiles * 16, units * 4)
        return _dense_from_pairs(values, bits[:n, :k // 16], n, k)


class _SmallBatch24(KernelFamily):
    """What the two small-batch 2:4 families share: 2:4 weights, packing and loading."""

    kind = "nm"
    tunable = True
    weight_class: type[KernelWeight]

    def refuses(self, spec, shape, dtype):
        if spec != NM_2_4:
            return f"the sparse tensor cores run 2:4, not {spec}"
        return shape_supported(*shape, dtype)

    def layout(self, weight):
        return self.weight_class.pack(weight)

    def tuning_weight(self, n, k, dtype, device, generator):
        return random_weight(n, k, "2:4", 0.5, dtype, device, generator)

    def dispatch(self, dtype, shape, tune_range=None, *, progress=False) -> list[tuple[int, Launch]]:
        return tune.dispatch(self, dtype, shape, tune_range, progress=progress)

    def pack(self, weight, spec, m, *, tune_range=None, progress=False):
        check_cuda_weight(weight, self.refuses(spec, tuple(weight.shape), weight.dtype))
        table = self.dispatch(weight.dtype, tuple(weight.shape), tune_range, progress=progress)
        packed = self.layout(weight)
        finish_packing(weight.device)           # the kernels read it before they wait
        ensure([launch.spec for _, launch in table], progress=progress)
        return packed.running(table)

    def kernel_specs(self, dtype, shape, spec, density, m):
        return [launch.spec for _, launch in self.dispatch(dtype, shape)]

    def workloads(self, stats, spec, m, planned_m):
        n, k = stats.shape
        return [Workload(self.name, stats.dtype, m, n, k, round(stats.density, 6))]

    def work(self, w, sms):
        """Every product computed (fp32 sums), the weight's 9/16 of the dense bytes read once."""
        e = element_size(w.dtype)
        return 1.0 * w.m * w.n * w.k, w.n * w.k * e * 9 / 16 + (w.m * w.k + w.m * w.n) * e


#: the tile of x (rows per block) of the CUDA-core kernel's buckets
GEMV_ROWS_OF_X = {1: 1, 4: 4, 16: 16, 0: 16}


class Sparse24Gemv(_SmallBatch24):
    """2:4 at one row on CUDA cores (tile: warps, output features per warp, rows of x per block)."""

    name = "sparse24-gemv"
    templates = (Family.GEMV_SM90_SPARSE24,)
    unit = "sparsecc's sm90 2:4 small-batch kernel on CUDA cores"
    impls = ("sparse24-gemv",)
    max_m = GEMV_MAX_M
    buckets = Buckets((1, 4, 16), 16)
    weight_class = Sparse24GemvWeight

    def candidates(self, dtype, shape, m):
        rows_of_x = GEMV_ROWS_OF_X[self.buckets.bound_for(m)]
        return [Launch(KernelSpec(Family.GEMV_SM90_SPARSE24, dtype_name(dtype), tile=(w, r, rows_of_x)))
                for w, r in ((4, 1), (4, 2), (8, 1), (8, 2), (4, 4))]

    def default_launch(self, dtype, bound):
        return Launch(KernelSpec(Family.GEMV_SM90_SPARSE24, dtype, tile=(4, 2, GEMV_ROWS_OF_X[bound])))


class Sparse24Mma(_SmallBatch24):
    """2:4 at 2-64 rows on the sparse tensor cores (tile: warps, 16-feature units of W, 8-row
    tiles of x per block; for the bulk-copy kernel unit rows of W, 8-row tiles of x per block and
    units of K per stage; the launch's splits are the blocks of a cluster, 0: the kernel picks)."""

    name = "sparse24-mma"
    templates = (Family.GEMV_MMA_SM90_SPARSE24, Family.GEMV_MMA_BULK_SM90_SPARSE24)
    unit = "sparsecc's sm90 2:4 small-batch kernel on tensor cores"
    impls = ("sparse24-mma",)
    max_m = MMA_MAX_M
    buckets = Buckets((1, 8, 16, 32, 64), 64)
    weight_class = Sparse24MmaWeight

    def candidates(self, dtype, shape, m):
        """Every tiling whose tiles of x ``m`` rows fill (a second 8-row tile only past 8 rows),
        with clusters of 1 and 2 blocks and the kernel's own pick; past 8 rows also the bulk-copy
        kernel's :data:`BULK_LAUNCHES` (K a multiple of 64), with the fewest tiles of x that
        hold ``m`` rows."""
        name = dtype_name(dtype)
        tiles = sorted(t for t in TILES[Family.GEMV_MMA_SM90_SPARSE24] if 8 * (t[2] - 1) < m)
        launches = [Launch(KernelSpec(Family.GEMV_MMA_SM90_SPARSE24, name, tile=tile), splits=splits)
                    for tile in tiles for splits in CLUSTER_SPLITS]
        if m >= BULK_MIN_M and shape[1] % MMA_UNIT_COLUMNS == 0:
            tiles_of_x = min(t for t in (2, 4, 8) if 8 * t >= min(m, MMA_MAX_M))
            launches += [Launch(KernelSpec(Family.GEMV_MMA_BULK_SM90_SPARSE24, name, tile=(units, tiles_of_x, stage)),
                                splits=splits) for units, stage, splits in BULK_LAUNCHES]
        return launches

    def default_launch(self, dtype, bound):
        return Launch(KernelSpec(Family.GEMV_MMA_SM90_SPARSE24, dtype, tile=(8, 1, 1 if 0 < bound <= 8 else 2)))

    def dispatch(self, dtype, shape, tune_range=None, *, progress=False) -> list[tuple[int, Launch]]:
        """As tuned, but a bulk-copy launch borrowed from another shape's measurements stays off a
        weight whose K is no multiple of its 64-input units: that bucket runs the default."""
        table = super().dispatch(dtype, shape, tune_range, progress=progress)
        if shape[1] % MMA_UNIT_COLUMNS == 0:
            return table
        return [(bound, self.default_launch(dtype_name(dtype), bound)
                 if launch.spec.family is Family.GEMV_MMA_BULK_SM90_SPARSE24 else launch) for bound, launch in table]


GEMV, MMA, GEMM = Sparse24Gemv(), Sparse24Mma(), Sparse24Gemm()


def choose(dtype: torch.dtype | str, shape: tuple[int, int], m: int | None, *, tune_first: bool = False,
           progress: bool = False) -> KernelFamily:
    """The 2:4 family a site planned for ``m`` rows is packed for (None: not known, the GEMMs):
    at one row the CUDA-core kernel unless the tensor-core one runs it faster; up to
    :data:`MMA_MAX_M` rows the tensor-core kernel where it runs the batch's bucket at least as
    fast as the GEMMs (without any measurement, up to :data:`MMA_DEFAULT_MAX_M` rows); the GEMMs
    elsewhere. ``tune_first``: tune both at this shape first, where ``SPARSECC_TUNE`` allows (what
    packing does; a plan's predictions and ``sparsecc generate`` only read the tables)."""
    if m is None or m > MMA_MAX_M:
        return GEMM
    name = dtype_name(dtype)
    if name not in ("float16", "bfloat16"):
        return GEMM if m > MMA_DEFAULT_MAX_M else (GEMV if m <= GEMV_MAX_M else MMA)
    measured_at = MMA.buckets.measured_for(m)
    rival = GEMV if m <= GEMV_MAX_M else GEMM
    times = {}
    for family in (MMA, rival):
        if tune_first:
            tune.ensure_tuned(family, getattr(torch, name), shape, [measured_at], progress=progress)
        found = tune.table().best(family.templates[0], name, measured_at, *shape)
        if found is not None:
            times[family] = found[1]
    if m <= GEMV_MAX_M:
        return MMA if len(times) == 2 and times[MMA] < times[GEMV] else GEMV
    if len(times) == 2:
        return MMA if times[MMA] <= times[GEMM] else GEMM
    return MMA if m <= MMA_DEFAULT_MAX_M else GEMM


def pack_24(weight: torch.Tensor, m: int | None, *, tune_range: tuple[int, int] | None = None,
            progress: bool = False) -> KernelWeight:
    """A 2:4 [N, K] CUDA weight packed for the family :func:`choose` picks for ``m`` rows (tuned
    first where ``tune_range`` is given)."""
    family = choose(weight.dtype, tuple(weight.shape), m, tune_first=tune_range is not None, progress=progress)
    return family.pack(weight, NM_2_4, m, tune_range=tune_range, progress=progress)
