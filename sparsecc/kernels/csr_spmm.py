"""Unstructured sparse weights on CUDA cores (templates/spmm_sm90.cu.j2): work per stored entry.

The tensor-core CSR kernels multiply tiles of W whole (the tiled kernel) or half of them (the
2:4 split), so their time barely falls below a density of a few percent. This kernel reads
each stored entry once per 8 rows of x (4 bytes: value and input column) and does 8 fp32
multiply-adds with it, so at 1% density it reads 1/50 of the dense weight's bytes and does
1/100 of its work on CUDA cores: the path for extreme sparsity at small batches.

The layout is plain CSR: ``values`` [nnz] and ``metadata`` int32, ``crow`` [N + 1] followed by
``col`` [nnz]. It runs through ``sparsecc::linear_kernel`` (the C++ launcher), like the
tensor-core kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codegen.spec import CSR_TILE_N, TILES, Family, KernelSpec
from ..ir.formats import CSR, CSRWeight
from ..ir.workload import Workload, dtype_name
from ..runtime.kernel_op import ensure
from .base import KERNEL_DTYPES, KernelFamily, KernelWeight, Launch, check_cuda_weight

#: the largest K the kernel stages (8 rows of x in shared memory)
MAX_K = next(iter(TILES[Family.SPMM_SM90]))[2]


#: the CUDA-core kernel is timed for weights at most this dense (its time grows with the entries)
MAX_DENSITY = 0.1


def spmm_spec(dtype: torch.dtype) -> KernelSpec:
    return KernelSpec(Family.SPMM_SM90, dtype_name(dtype))


def shape_supported(out_features: int, in_features: int, dtype: torch.dtype) -> str | None:
    """Why a weight of this shape and dtype cannot run on the CUDA-core CSR kernel, or None."""
    if dtype not in KERNEL_DTYPES:
        return f"the CUDA-core CSR kernel takes float16/bfloat16, not {dtype_name(dtype)}"
    if in_features % 8 or in_features > MAX_K:
        return (f"the CUDA-core CSR kernel needs K % 8 == 0 and K <= {MAX_K} "
                f"(this weight is {out_features}x{in_features})")
    return None


@dataclass
class CsrSpmmWeight(KernelWeight):
    """A weight in CSR for the CUDA-core kernel: ``values`` [nnz], ``metadata`` int32 (crow, then col)."""

    selection: str = ""       # why compile packed the weight for this kernel (registry.pack_unstructured)

    spec = CSR

    @property
    def entries(self) -> int:
        return self.values.numel()

    @classmethod
    def pack(cls, weight: torch.Tensor) -> "CsrSpmmWeight":
        """The layout alone (any device, any dtype): sparsecc.ir.formats' CSR, crow and col in one array."""
        csr = CSRWeight.from_dense(weight)
        return cls(csr.values, torch.cat([csr.crow, csr.col]).contiguous(), *csr.shape)

    def to_dense(self) -> torch.Tensor:
        """Unpack exactly."""
        n, k = self.shape
        return CSRWeight(self.metadata[: n + 1], self.metadata[n + 1:], self.values, n, k).to_dense()


class CsrSpmm(KernelFamily):
    """Unstructured weights at most :data:`MAX_DENSITY` dense, per entry on CUDA cores."""

    name = "csr-spmm"
    kind = "csr"
    templates = (Family.SPMM_SM90,)
    unit = "sparsecc's CUDA-core CSR kernel"

    def refuses(self, spec, shape, dtype):
        return f"it runs CSR, not {spec}" if spec.kind != "csr" else shape_supported(*shape, dtype)

    def pack(self, weight, spec, m, *, tune_range=None, progress=False):
        check_cuda_weight(weight, self.refuses(spec, tuple(weight.shape), weight.dtype))
        packed = CsrSpmmWeight.pack(weight)
        launch = Launch(spmm_spec(weight.dtype))
        ensure([launch.spec], progress=progress)
        return packed.running([(0, launch)])

    def kernel_specs(self, dtype, shape, spec, density, m):
        return [spmm_spec(dtype)] if density <= MAX_DENSITY else []

    def workloads(self, stats, spec, m, planned_m):
        """Priced as the tiled kernels' work (it has no calibration of its own); compile times it
        against them on the weight, which decides."""
        n, k = stats.shape
        return [Workload("csr-kernel", stats.dtype, m, n, k, round(stats.density, 6), tile=(CSR_TILE_N, 16))]
