"""How compile packs a site that runs on sparsecc's own kernels: one place, so that timing
(calibration, the CPU's confirmation) measures exactly what a compiled model runs."""
from __future__ import annotations

import torch

from . import csr_kernel, csr_split, csr_spmm
from .bsr_kernel import BsrKernelWeight, kernel_for_rows
from .codegen import Family
from .csr_kernel import CsrKernelWeight
from .errors import InputError
from .formats import NM_2_4, FormatSpec, PackedWeight
from .gpu import pack_24_for


def pack_for_kernels(weight: torch.Tensor, spec: FormatSpec, m: int | None, *, progress: bool = False) -> PackedWeight:
    """``weight`` packed for the kernels that run ``spec`` at ``m`` rows (None: not known):
    2:4 for the small-batch kernels or the CUTLASS GEMMs, BSR for the BSR kernels, CSR for
    whichever of its kernels :func:`pack_unstructured` times fastest."""
    if spec == NM_2_4:
        return pack_24_for(weight, m, progress=progress)
    if spec.kind == "bsr" and spec.block is not None:
        # blocks of zeros cover the empty block columns where a kernel with the NaN pass runs the
        # site (the pass then reads no part of x); the streaming kernel, which tests x itself,
        # would read only stored bytes (no M runs it now: sparsecc.bsr_kernel.DEFAULT_KERNEL)
        covered = m is None or kernel_for_rows(m)[0] is not Family.BSR_SM90
        return BsrKernelWeight.from_dense(weight, spec.block, cover_columns=covered, progress=progress)
    if spec.kind == "csr":
        return pack_unstructured(weight, m, progress=progress)
    raise InputError(f"sparsecc has no kernel for {spec}")


#: the batch an unstructured weight's kernels are timed at when the site's batch is not known
UNKNOWN_M = 128
#: the CUDA-core CSR kernel is timed for weights at most this dense (its time grows with the entries)
SPMM_MAX_DENSITY = 0.1


def unstructured_refused(out_features: int, in_features: int, dtype: torch.dtype) -> str | None:
    """Why none of sparsecc's CSR kernels takes a weight of this shape and dtype, or None."""
    reasons = [module.shape_supported(out_features, in_features, dtype) for module in (csr_kernel, csr_split, csr_spmm)]
    return None if None in reasons else reasons[0]


def pack_unstructured(weight: torch.Tensor, m: int | None, *, progress: bool = False) -> PackedWeight:
    """An unstructured weight packed for the fastest of sparsecc's CSR kernels at ``m`` rows,
    timed on the weight itself (CUDA-graph replay, a few milliseconds each):

    - the tiled CSR kernel (tensor cores; its time follows the 64x64 tiles, whatever their entries),
    - the split onto the 2:4 kernels plus a residual pass (:mod:`sparsecc.csr_split`: sparse tensor
      cores; its time follows the entries beyond two per group of four),
    - the CUDA-core kernel (:mod:`sparsecc.csr_spmm`: its time follows the entries; timed up to
      :data:`SPMM_MAX_DENSITY`).

    Measured on an H100 (benchmarks/results/kernels_csr-*, 2026-11-25), each wins somewhere:
    the split at M = 2048 up to density 0.1 (3-8x faster than the tiled kernel) and at M = 64
    on the large shapes, the tiled kernel at M = 16 from density 0.05 up and everywhere at 0.3,
    the CUDA-core kernel at density 0.01 up to M = 64; in between it depends on the shape,
    hence the timing. The returned weight's ``selection`` says what was timed."""
    from .timing import packed_runner, time_all_us
    shape, dtype = tuple(weight.shape), weight.dtype
    density = int(torch.count_nonzero(weight)) / max(weight.numel(), 1)
    candidates = {}
    if csr_kernel.shape_supported(*shape, dtype) is None:
        candidates["the tiled CSR kernel"] = lambda: CsrKernelWeight.from_dense(weight, progress=progress)
    if csr_split.shape_supported(*shape, dtype) is None:
        candidates["split"] = lambda: csr_split.CsrSplitWeight.from_dense(weight, m, progress=progress)
    if csr_spmm.shape_supported(*shape, dtype) is None and density <= SPMM_MAX_DENSITY:
        candidates["the CUDA-core CSR kernel"] = lambda: csr_spmm.CsrSpmmWeight.from_dense(weight, progress=progress)
    if not candidates:
        raise InputError(unstructured_refused(*shape, dtype) or "no CSR kernel takes this weight")
    packed = {name: pack() for name, pack in candidates.items()}
    if "split" in packed:
        split = packed.pop("split")
        packed[f"split onto the 2:4 kernels plus a residual pass of {split.residual_entries} entries"] = split
    if len(packed) == 1:
        return next(iter(packed.values()))
    rows = m or UNKNOWN_M
    times = time_all_us({name: packed_runner(p, rows, weight.device) for name, p in packed.items()}, weight.device)
    fastest = min(times, key=times.get)
    others = ", ".join(f"{name} {times[name]:.1f} us" for name in sorted(times, key=times.get) if name != fastest)
    packed[fastest].selection = f"{fastest}: {times[fastest]:.1f} us at M={rows}; {others}"
    return packed[fastest]
