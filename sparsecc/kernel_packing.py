"""How compile packs a site that runs on sparsecc's own kernels: one place, so that timing
(calibration, the CPU's confirmation) measures exactly what a compiled model runs."""
from __future__ import annotations

import torch

from .bsr_kernel import BsrKernelWeight, kernel_for_rows
from .codegen import Family
from .csr_kernel import CsrKernelWeight
from .errors import InputError
from .formats import NM_2_4, FormatSpec, PackedWeight
from .gpu import pack_24_for


def pack_for_kernels(weight: torch.Tensor, spec: FormatSpec, m: int | None, *, progress: bool = False) -> PackedWeight:
    """``weight`` packed for the kernels that run ``spec`` at ``m`` rows (None: not known):
    2:4 for the small-batch kernels or the CUTLASS GEMMs, BSR for the BSR kernels, CSR for the
    unstructured kernel."""
    if spec == NM_2_4:
        return pack_24_for(weight, m, progress=progress)
    if spec.kind == "bsr" and spec.block is not None:
        # blocks of zeros cover the empty block columns where the wgmma kernel runs the site
        # (its NaN pass then reads no part of x); the streaming kernel (M = 1) reads only stored bytes
        wgmma = m is None or kernel_for_rows(m)[0] is Family.BSR_SM90_WGMMA
        return BsrKernelWeight.from_dense(weight, spec.block, cover_columns=wgmma, progress=progress)
    if spec.kind == "csr":
        return CsrKernelWeight.from_dense(weight, progress=progress)
    raise InputError(f"sparsecc has no kernel for {spec}")
