"""Dense weights on Hopper CUTLASS GEMMs (templates/gemm_sm90_dense.cu.j2), with the epilogue of
the 2:4 kernels fused: bias, activation and the transposed store in registers.

What the 2:4 kernels are measured against (the same main loop and epilogue, dense), and what
a dense weight's sparsecc dispatch runs: per batch bucket the faster of this GEMM and, up to
128 rows, the dense small-batch kernel (:mod:`sparsecc.kernels.dense_small`), as tuned. The
sliced scheduler cuts K into slices run as one batched GEMM whose fp32 sums a second kernel
adds, for a few hundred rows of x times a short weight (too few output tiles to fill the GPU).
"""
from __future__ import annotations

from ..codegen.spec import Family, KernelSpec, Schedule, Scheduler
from ..ir.workload import dtype_name
from ..runtime.kernel_op import ensure
from . import tune
from .base import Buckets, Launch, check_cuda_weight
from .dense_small import DenseFamily, DenseSmall

#: every way of running the GEMM that tuning times
CANDIDATES = [
    (dict(tile=(128, 64, 64)), {}), (dict(tile=(128, 128, 64)), {}), (dict(tile=(128, 256, 64)), {}),
    (dict(tile=(128, 256, 64)), dict(swizzle=8)), (dict(tile=(256, 128, 64), cluster=(2, 1)), {}),
    # clusters of two CTAs loading their common tile once through TMA multicast: of x (2, 1:
    # neighbours along W's rows) or of W (1, 2: neighbours along x's rows)
    (dict(tile=(128, 256, 64), cluster=(2, 1)), {}), (dict(tile=(128, 256, 64), cluster=(1, 2)), {}),
    (dict(tile=(256, 128, 64), cluster=(1, 2)), {}),
    # one warpgroup per 64 rows of W, two tiles in flight per CTA: 64 x 64 tiles give a
    # 4096-row weight at 128 rows of x 128 CTAs where 128 x 64 tiles give 64
    (dict(tile=(64, 256, 64), schedule=Schedule.PINGPONG), {}),
    (dict(tile=(64, 128, 64), schedule=Schedule.PINGPONG), {}),
    (dict(tile=(64, 64, 64), schedule=Schedule.PINGPONG), {}),
    (dict(tile=(64, 64, 64), schedule=Schedule.PINGPONG, cluster=(1, 2)), {}),
    (dict(tile=(128, 128, 64), schedule=Schedule.PINGPONG), {}),
    (dict(tile=(128, 128, 64), schedule=Schedule.PINGPONG), dict(swizzle=4)),
    (dict(tile=(128, 64, 64), scheduler=Scheduler.STREAMK), {}),
    (dict(tile=(128, 64, 64), scheduler=Scheduler.STREAMK), dict(splits=4)),
    (dict(tile=(128, 128, 64), scheduler=Scheduler.STREAMK), {}),
    (dict(tile=(128, 256, 64), scheduler=Scheduler.STREAMK), {}),   # a last partial wave of wide tiles
    # K in slices (split-K as a batch): one wave of output tiles x slices, or 4 / 8 slices
    (dict(tile=(128, 64, 64), scheduler=Scheduler.SLICED), {}),
    (dict(tile=(128, 64, 64), scheduler=Scheduler.SLICED), dict(splits=4)),
    (dict(tile=(128, 64, 64), scheduler=Scheduler.SLICED), dict(splits=8)),
    (dict(tile=(128, 128, 64), scheduler=Scheduler.SLICED), {}),
]

#: used where nothing was measured: narrow tiles for small batches, wide for large ones
DEFAULTS = {1: (128, 64, 64), 16: (128, 64, 64), 128: (128, 64, 64), 2048: (128, 256, 64), 0: (128, 256, 64)}
#: without measurements, buckets up to this bound run on the dense small-batch kernel
SMALL_DEFAULT_MAX_M = 16

SMALL = DenseSmall()


class DenseGemm(DenseFamily):
    """Dense weights on the CUTLASS GEMM, small buckets on the small-batch kernel where faster."""

    name = "dense-gemm"
    templates = (Family.SM90_DENSE,)
    unit = "sparsecc's dense CUTLASS kernel"
    buckets = Buckets((1, 16, 128, 2048), 8192)

    def candidates(self, dtype, shape, m):
        name = dtype_name(dtype)
        return [Launch(KernelSpec(Family.SM90_DENSE, name, **config), **knobs) for config, knobs in CANDIDATES]

    def default_launch(self, dtype, bound):
        return Launch(KernelSpec(Family.SM90_DENSE, dtype, tile=DEFAULTS[bound]))

    def dispatch(self, dtype, shape, tune_range=None, *, progress=False) -> list[tuple[int, Launch]]:
        """Per bucket the faster of the GEMM and, up to :data:`~sparsecc.kernels.dense_small.MAX_M`
        rows, the small-batch kernel, as measured; without measurements the small-batch kernel up
        to :data:`SMALL_DEFAULT_MAX_M` rows."""
        name = dtype_name(dtype)
        if tune_range is not None:
            lo, hi = tune_range
            tune.ensure_tuned(self, dtype, shape, [m for _, m in self.buckets.meeting(lo, hi)], progress=progress)
            if lo <= SMALL.max_m:
                tune.ensure_tuned(SMALL, dtype, shape, [m for b, m in self.buckets.meeting(lo, min(hi, SMALL.max_m))
                                                        if 0 < b <= SMALL.max_m], progress=progress)
        table = []
        for bound, m in self.buckets:
            small = 0 < bound <= SMALL.max_m
            measured = [found for family in ((self, SMALL) if small else (self,))
                        for found in [tune.table().best(family.templates[0], name, m, *shape)] if found]
            if measured:
                launch = min(measured, key=lambda found: found[1])[0]
            elif small and bound <= SMALL_DEFAULT_MAX_M:
                launch = SMALL.default_launch(name, bound)
            else:
                launch = self.default_launch(name, bound)
            table.append((bound, launch))
        return table

    def pack(self, weight, spec, m, *, tune_range=None, progress=False):
        check_cuda_weight(weight, self.refuses(spec, tuple(weight.shape), weight.dtype))
        table = self.dispatch(weight.dtype, tuple(weight.shape), tune_range, progress=progress)
        ensure([launch.spec for _, launch in table], progress=progress)
        return self.layout(weight).running(table)

    def kernel_specs(self, dtype, shape, spec, density, m):
        return [launch.spec for _, launch in self.dispatch(dtype, shape)]
