"""FP8 kernel families: declared, not built yet.

A quantized site (``sparsecc.quantize``: an e4m3 weight with per-channel scales) runs today on the
reference ops of :mod:`sparsecc.runtime.torch_ops` (``linear_fp8``, ``linear_fp8_nm``) on every
device: exact, not fast. Two GPU families are planned and answer only "not yet" here, so no plan
can choose them and nothing pretends to run them:

- FP8 dense: ``torch._scaled_mm`` (cuBLASLt) with a per-row input scale and a per-column weight
  scale, the bias and activation in a following op or a fused CUTLASS epilogue;
- FP8 2:4: a CUTLASS sm_90a sparse GEMM on e4m3 (``wgmma.sp`` with K = 64 per instruction, the
  compressed 2:4 layout of e4m3, with 8-bit elements the metadata of a 4-byte chunk), the
  input quantization as a prologue kernel (per-token amax, round to e4m3) and both scales
  applied in the epilogue's visitor tree before the bias.

docs/kernels.md ("FP8") says what each will need and how it will be held to the reference ops.
"""
from __future__ import annotations

import torch

from ..ir.formats import FormatSpec
from ..ir.quant import FP8_DTYPES

#: why no generated kernel runs a quantized site yet
NOT_BUILT = {
    "dense": "FP8 dense runs on the reference op: the torch._scaled_mm family is not built yet",
    "nm": "FP8 2:4 runs on the reference op: the sparse FP8 CUTLASS GEMM (sm_90a) is not built yet",
}


def refusal(spec: FormatSpec, dtype: torch.dtype) -> str | None:
    """Why no kernel runs ``spec`` for a weight of ``dtype`` when it is an FP8 dtype (None for
    other dtypes: the other families answer for them)."""
    if dtype not in FP8_DTYPES:
        return None
    return NOT_BUILT.get(spec.kind, f"no FP8 kernel runs {spec}: a quantized site runs as dense or n:m")
