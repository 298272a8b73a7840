"""Dense weights at small batches on tensor cores (templates/gemv_mma_sm90_dense.cu.j2).

``mma.sync`` m16n8k16 through CUTLASS's ``arch::Mma`` with the same fused epilogue as the GEMMs:
W is read in place, row-major, with no packing, each lane loading 16 consecutive inputs of two
rows with 16-byte loads and feeding them to the instructions in the order x is loaded in too.
K is split over the block's warps and a cluster of 1-8 blocks (the launch's ``splits``; 0: the
kernel picks), and the blocks reading the same rows of W for different rows of x run side by
side, so W comes from memory once. Every product is computed, so NaN and Inf propagate with no
pass. A dense weight's dispatch (:mod:`sparsecc.kernels.dense`) takes it in the buckets up to
:data:`MAX_M` rows where it measured faster than the CUTLASS GEMM.
"""
from __future__ import annotations

import torch

from ..codegen.spec import TILES, Family, KernelSpec
from ..ir.formats import DENSE
from ..ir.weights import random_weight
from ..ir.workload import dtype_name, element_size
from .base import Buckets, KernelFamily, KernelWeight, Launch, shape_supported

#: the cluster sizes tuning times for the tensor-core small-batch kernels: clusters of 1 and 2
#: blocks splitting K, and 0 (the kernel picks, up to 8). Clusters of 4 and 8 won no point of the
#: H100 sweeps of the 2:4 and dense kernels and were up to 10x slower where they lost; the
#: kernel's own pick still reaches them.
CLUSTER_SPLITS = (0, 1, 2)
#: the largest batch bucket a dense weight may run on this kernel
MAX_M = 128


class DenseWeight(KernelWeight):
    """A dense weight for sparsecc's dense kernels: ``values`` is the [N, K] weight, no metadata."""

    spec = DENSE

    @classmethod
    def of(cls, weight: torch.Tensor) -> "DenseWeight":
        return cls(weight.detach().contiguous(), None, *weight.shape)

    def to_dense(self) -> torch.Tensor:
        return self.values


class DenseFamily(KernelFamily):
    """What the dense families share: the weight as it is, tuned on a random dense weight, every
    product computed (flops and bytes of a dense GEMM)."""

    kind = "dense"
    tunable = True

    def refuses(self, spec, shape, dtype):
        return f"it runs dense weights, not {spec}" if spec.kind != "dense" else shape_supported(*shape, dtype)

    def layout(self, weight):
        return DenseWeight.of(weight)

    def tuning_weight(self, n, k, dtype, device, generator):
        return random_weight(n, k, "dense", 1.0, dtype, device, generator)

    def work(self, w, sms):
        e = element_size(w.dtype)
        return 2.0 * w.m * w.n * w.k, w.n * w.k * e + (w.m * w.k + w.m * w.n) * e


class DenseSmall(DenseFamily):
    """Dense weights at up to :data:`MAX_M` rows on the small-batch tensor-core kernel."""

    name = "dense-small"
    templates = (Family.GEMV_MMA_SM90_DENSE,)
    unit = "sparsecc's dense small-batch kernel"
    max_m = MAX_M
    buckets = Buckets((1, 16, 128), 128)

    def candidates(self, dtype, shape, m):
        name = dtype_name(dtype)
        return [Launch(KernelSpec(Family.GEMV_MMA_SM90_DENSE, name, tile=tile), splits=splits)
                for tile in sorted(TILES[Family.GEMV_MMA_SM90_DENSE]) for splits in CLUSTER_SPLITS]

    def default_launch(self, dtype, bound):
        return Launch(KernelSpec(Family.GEMV_MMA_SM90_DENSE, dtype), splits=0)

