"""2:4 weights on the Hopper CUTLASS GEMMs (templates/gemm_sm90_sparse24.cu.j2).

The weight is the sparse left operand of ``wgmma.sp``: the kernel computes ``y^T = W x^T`` and
its epilogue adds the bias per output feature, applies the activation in registers and stores
``y`` row-major, so neither the transpose nor the epilogue costs a pass. The layout is the one
CUTLASS's compressor writes (templates/compress_sm90_sparse24.cu.j2: the kept values and their
metadata), followed by the site's NaN/Inf guard (:mod:`sparsecc.kernels.nonfinite_guard`).
The launch per batch bucket is tuned (:mod:`sparsecc.kernels.tune`) among :data:`CANDIDATES`, and
up to a few dozen rows :data:`FEW_ROWS` too (K in slices among them: templates/gemm_sm90_sparse24).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..codegen.spec import Family, KernelSpec, Schedule, Scheduler
from ..ir.analysis import WeightStats
from ..ir.formats import NM_2_4, FormatSpec
from ..ir.weights import random_weight
from ..ir.workload import Workload, dtype_name, element_size
from ..runtime.kernel_op import ensure, linear_kernel
from . import nonfinite_guard, tune
from .base import (Buckets, KernelFamily, KernelWeight, Launch, check_cuda_weight, launch_for, nonfinite_flags,
                   shape_supported)


def _launches(dtype: str, entries) -> list[Launch]:
    return [Launch(KernelSpec(Family.SM90_SPARSE24, dtype, **config), **knobs) for config, knobs in entries]


#: every way of running the GEMM that tuning times
CANDIDATES = [
    (dict(tile=(128, 64, 128)), {}), (dict(tile=(128, 128, 128)), {}),
    (dict(tile=(128, 128, 128), cluster=(2, 1)), {}), (dict(tile=(256, 128, 128)), {}),
    (dict(tile=(256, 128, 128)), dict(swizzle=8)), (dict(tile=(256, 128, 128), cluster=(2, 1)), {}),
    (dict(tile=(256, 128, 128), cluster=(2, 1)), dict(swizzle=4)),
    (dict(tile=(256, 128, 128), cluster=(2, 1)), dict(swizzle=8)),
    (dict(tile=(256, 128, 128), cluster=(1, 2)), {}), (dict(tile=(256, 128, 128), cluster=(1, 2)), dict(swizzle=4)),
    (dict(tile=(256, 128, 128), cluster=(1, 2)), dict(swizzle=8)), (dict(tile=(128, 256, 128)), {}),
    (dict(tile=(64, 128, 128), schedule=Schedule.PINGPONG), {}),
    (dict(tile=(128, 128, 128), schedule=Schedule.PINGPONG), {}),
    (dict(tile=(128, 64, 128), scheduler=Scheduler.STREAMK), {}),
    (dict(tile=(128, 64, 128), scheduler=Scheduler.STREAMK), dict(splits=4)),
    (dict(tile=(128, 128, 128), scheduler=Scheduler.STREAMK), {}),
]

#: launches for a few dozen rows of x (tuned only for buckets up to :data:`FEW_ROWS_MAX_M`): tiles of
#: 32 rows of x (half the shared memory of a stage of 64, so more of W in flight per SM), and K in
#: slices (split-K as a batch) so that a long weight with few output tiles fills the SMs; tiles of
#: 256 rows of W read x half as often as 128
FEW_ROWS = [
    (dict(tile=(128, 32, 128)), {}),
    (dict(tile=(128, 32, 128), scheduler=Scheduler.SLICED), {}),
    (dict(tile=(128, 32, 128), scheduler=Scheduler.SLICED), dict(splits=4)),
    (dict(tile=(128, 64, 128), scheduler=Scheduler.SLICED), {}),
    (dict(tile=(256, 32, 128), scheduler=Scheduler.SLICED), {}),
    (dict(tile=(256, 64, 128), scheduler=Scheduler.SLICED), {}),
    (dict(tile=(128, 32, 128), scheduler=Scheduler.STREAMK), {}),
    (dict(tile=(64, 32, 128), schedule=Schedule.PINGPONG), {}),
    (dict(tile=(64, 32, 128), schedule=Schedule.PINGPONG, scheduler=Scheduler.SLICED), {}),
    (dict(tile=(64, 64, 128), schedule=Schedule.PINGPONG, scheduler=Scheduler.SLICED), {}),
]
FEW_ROWS_MAX_M = 128

#: used where neither this GPU nor the shipped table measured a bucket: narrow tiles for small
#: batches, wide for large ones
DEFAULTS = {1: (128, 64, 128), 16: (128, 64, 128), 32: (128, 64, 128), 64: (128, 64, 128), 96: (128, 64, 128),
            128: (128, 64, 128), 2048: (256, 128, 128), 0: (256, 128, 128)}


@dataclass
class CutlassSparse24Weight(KernelWeight):
    """A 2:4 weight in the layout the sm90 GEMMs read: compressed values and metadata, as
    CUTLASS's compressor writes them, the metadata followed by the site's NaN/Inf guard."""

    spec = NM_2_4

    @classmethod
    def compress(cls, weight: torch.Tensor) -> "CutlassSparse24Weight":
        """Compress ``weight`` (a 2:4 [N, K] CUDA tensor) with CUTLASS's compressor kernel."""
        kernel = next(iter(ensure([KernelSpec(Family.SM90_COMPRESS24, dtype_name(weight.dtype))],
                                  progress=False).values()))
        n, k = weight.shape
        value_count, metadata_bytes = kernel.sizes(n, k)
        dense = weight.detach().contiguous()
        values = torch.zeros(value_count, dtype=weight.dtype, device=weight.device)
        metadata = torch.zeros(metadata_bytes, dtype=torch.uint8, device=weight.device)
        with torch.cuda.device(weight.device):
            kernel.compress(dense.data_ptr(), values.data_ptr(), metadata.data_ptr(), n, k,
                            torch.cuda.current_stream().cuda_stream)
        # An all-zero column may be stored by no row (the compressor picks which zeros it keeps),
        # so its inputs are listed for the NaN/Inf pass; columns with a non-zero are always met.
        metadata = nonfinite_guard.append_guard(metadata, ~(dense != 0).any(dim=0))
        return cls(values, metadata, n, k)

    def to_dense(self) -> torch.Tensor:
        """Unpack exactly by running the kernel on an identity: I @ W^T = W^T (fp32 accumulation
        of one product per output; every value is representable, so nothing rounds)."""
        eye = torch.eye(self.in_features, dtype=self.values.dtype, device=self.values.device)
        return linear_kernel(eye, self.values, self.metadata, self.out_features, self.in_features, None,
                             "none", False, False, self.kernels).t().contiguous()


class Sparse24Gemm(KernelFamily):
    """2:4 weights on the CUTLASS GEMMs: every batch size, fastest from a few dozen rows up."""

    name = "sparse24-gemm"
    kind = "nm"
    templates = (Family.SM90_SPARSE24, Family.SM90_COMPRESS24)
    unit = "sparsecc's sm90 2:4 CUTLASS kernel"
    impls = ("sparse24-gemm",)
    tunable = True
    #: 32, 64 and 96 apart from 128: at a few dozen rows the best tile differs from 128 rows' (too
    #: few output tiles to fill the SMs), and batched decode lives there
    buckets = Buckets((1, 16, 32, 64, 96, 128, 2048), 8192)

    def refuses(self, spec, shape, dtype):
        if spec != NM_2_4:
            return f"the sparse tensor cores run 2:4, not {spec}"
        return shape_supported(*shape, dtype)

    def candidates(self, dtype, shape, m):
        return _launches(dtype_name(dtype), CANDIDATES + (FEW_ROWS if m <= FEW_ROWS_MAX_M else []))

    def default_launch(self, dtype: str, bound: int) -> Launch:
        return Launch(KernelSpec(Family.SM90_SPARSE24, dtype, tile=DEFAULTS[bound]))

    def dispatch(self, dtype, shape, tune_range=None, *, progress=False) -> list[tuple[int, Launch]]:
        """The launch per bucket (see :func:`sparsecc.kernels.tune.dispatch`)."""
        return tune.dispatch(self, dtype, shape, tune_range, progress=progress)

    def layout(self, weight):
        return CutlassSparse24Weight.compress(weight)

    def tuning_weight(self, n, k, dtype, device, generator):
        return random_weight(n, k, "2:4", 0.5, dtype, device, generator)

    def pack(self, weight, spec, m, *, tune_range=None, progress=False):
        check_cuda_weight(weight, self.refuses(spec, tuple(weight.shape), weight.dtype))
        table = self.dispatch(weight.dtype, tuple(weight.shape), tune_range, progress=progress)
        ensure([launch.spec for _, launch in table], progress=progress)
        return self.layout(weight).running(table, nonfinite_flags())

    def kernel_specs(self, dtype, shape, spec, density, m):
        return [KernelSpec(Family.SM90_COMPRESS24, dtype_name(dtype))] + [
            launch.spec for _, launch in self.dispatch(dtype, shape)]

    def workloads(self, stats: WeightStats, spec: FormatSpec, m: int, planned_m: int | None) -> list[Workload]:
        """The launch that runs M rows: its ``(rows of W, rows of x)`` per CTA as the workload's tile
        (what the cost model pads the work to and counts waves of CTAs over the SMs with), and its K
        slices requested as its mode (0: as many as fill the SMs; None: K is not sliced)."""
        n, k = stats.shape
        launch = launch_for(self.dispatch(getattr(torch, stats.dtype), stats.shape), m)
        sliced = launch.spec.scheduler is Scheduler.SLICED
        return [Workload(self.name, stats.dtype, m, n, k, round(stats.density, 6), tile=launch.spec.tile[:2],
                         mode=(launch.splits if launch.splits > 1 else 0) if sliced else None)]

    def work(self, w, sms):
        """Half the math of dense (the tiles padded, counted in waves of CTAs over the SMs, a CTA
        per tile and K slice), the weight in 9/16 of the dense bytes, x and y once, and with K in
        slices their fp32 sums written and read back."""
        e = element_size(w.dtype)
        tile_n, tile_m = w.tile or (128, 64)
        tiles = math.ceil(w.n / tile_n) * math.ceil(w.m / tile_m)
        slices = 1 if w.mode is None else k_slices(tiles, w.k, w.mode, sms)
        waves = math.ceil(tiles * slices / sms) * sms / (tiles * slices)
        act = (w.m * w.k + w.m * w.n) * e + (2 * slices * w.m * w.n * 4 if w.mode is not None else 0)
        return tiles * tile_n * tile_m * w.k * waves, w.n * w.k * e * 9 / 16 + act


def k_slices(tiles: int, k: int, requested: int, sms: int) -> int:
    """The K slices the sliced 2:4 GEMM runs (its ``slices_for``): ``requested`` (> 1) if K cuts into
    that many, else as many as fill one wave of the SMs with ``tiles`` output tiles; whole
    128-column metadata atoms, at least two k-tiles a slice, at most 16."""
    slices = min(max(requested if requested > 1 else sms // tiles, 1), 16)
    while slices > 1 and (k % (128 * slices) or k // slices < 256):
        slices -= 1
    return slices
