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

from . import runtime
from .codegen import TILES, Family, KernelSpec
from .errors import InputError
from .formats import CSR, CSRWeight
from .gpu import KERNEL_DTYPES, KernelWeight, Launch, dispatch_string

#: the largest K the kernel stages (8 rows of x in shared memory)
MAX_K = next(iter(TILES[Family.SPMM_SM90]))[2]


def spmm_spec(dtype: torch.dtype) -> KernelSpec:
    return KernelSpec(Family.SPMM_SM90, str(dtype).replace("torch.", ""))


def shape_supported(out_features: int, in_features: int, dtype: torch.dtype) -> str | None:
    """Why a weight of this shape and dtype cannot run on the CUDA-core CSR kernel, or None."""
    if dtype not in KERNEL_DTYPES:
        return f"the CUDA-core CSR kernel takes float16/bfloat16, not {str(dtype).replace('torch.', '')}"
    if in_features % 8 or in_features > MAX_K:
        return (f"the CUDA-core CSR kernel needs K % 8 == 0 and K <= {MAX_K} "
                f"(this weight is {out_features}x{in_features})")
    return None


@dataclass
class CsrSpmmWeight(KernelWeight):
    """A weight in CSR for the CUDA-core kernel: ``values`` [nnz], ``metadata`` int32 (crow, then col)."""

    selection: str = ""       # why compile packed the weight for this kernel (kernel_packing.pack_unstructured)

    spec = CSR

    @property
    def entries(self) -> int:
        return self.values.numel()

    @classmethod
    def pack(cls, weight: torch.Tensor) -> "CsrSpmmWeight":
        """The layout alone (any device, any dtype): sparsecc.formats' CSR, crow and col in one array."""
        csr = CSRWeight.from_dense(weight)
        return cls(csr.values, torch.cat([csr.crow, csr.col]).contiguous(), *csr.shape)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, *, progress: bool = False) -> "CsrSpmmWeight":
        """Pack a [N, K] CUDA weight and load its kernel."""
        if weight.device.type != "cuda":
            raise InputError("sparsecc's kernels run on the GPU: move the weight to CUDA first")
        reason = shape_supported(*weight.shape, weight.dtype)
        if reason:
            raise InputError(reason)
        packed = cls.pack(weight)
        spec = spmm_spec(weight.dtype)
        runtime.ensure([spec], progress=progress)
        packed.kernels = dispatch_string([(0, Launch(spec))])
        return packed

    def to_dense(self) -> torch.Tensor:
        """Unpack exactly."""
        n, k = self.shape
        return CSRWeight(self.metadata[: n + 1], self.metadata[n + 1:], self.values, n, k).to_dense()
