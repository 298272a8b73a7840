"""FP8 kernel families: what runs a quantized site's product.

A quantized site (``sparsecc.quantize``: an e4m3 weight with per-channel scales) runs on the
reference ops of :mod:`sparsecc.runtime.torch_ops` (``linear_fp8``, ``linear_fp8_nm``) wherever
nothing faster takes it: exact, not fast.

- FP8 dense (:class:`Fp8ScaledMm`): ``torch._scaled_mm`` (cuBLASLt on Hopper) with a per-token
  input scale and a per-channel weight scale, the bias and activation in a following op. It
  needs a GPU of sm_89 or later, K and N multiples of 16 and an fp16 or bf16 input
  (:func:`~sparsecc.runtime.torch_ops.scaled_mm_refusal`); its op,
  ``sparsecc::linear_fp8_scaled_mm``, is the reference op wherever that is not so. Nothing is
  packed or tuned: the weight stays the layer's e4m3 tensor. Its one template rounds the input to
  e4m3 in one pass (templates/quantize_e4m3.cu.j2, loaded by
  :func:`~sparsecc.kernels.registry.prepare_quantized_dense` where sparsecc's kernels run), the
  same codes as torch's ops, which round it elsewhere.
- FP8 2:4 (:mod:`sparsecc.kernels.sparse24_fp8`): the CUTLASS sm_90a sparse GEMM on e4m3, both
  scales applied in its epilogue's visitor tree before the bias, where a plan asks for 2:4
  (``formats=("2:4",)``) on a Hopper GPU; the kernel rounds the input to e4m3 itself, first.

docs/kernels.md ("FP8") says what runs where and how each is held to the reference ops.
"""
from __future__ import annotations

import torch

from ..ir.formats import FormatSpec
from ..ir.quant import FP8_DTYPES
from ..codegen.spec import Family
from ..runtime.torch_ops import linear_fp8_scaled_mm, quantizer_spec, scaled_mm_refusal
from .base import KERNEL_DTYPES, KernelFamily
from .sparse24_fp8 import SPARSE24_FP8


class Fp8ScaledMm(KernelFamily):
    """A dense e4m3 weight's product on ``torch._scaled_mm``: no packing (the weight is read as the
    layer stores it), no tuning (cuBLASLt chooses its own kernel); the input's rounding to e4m3 on
    sparsecc's kernel where it is loaded."""

    name = "fp8-scaled-mm"
    kind = "dense"
    templates = (Family.QUANTIZE_E4M3,)
    unit = "torch._scaled_mm (cuBLASLt, per-token and per-channel scales)"
    op = linear_fp8_scaled_mm

    def refuses(self, spec: FormatSpec, shape: tuple[int, int], dtype: torch.dtype,
                device: torch.device | str | None = None, input_dtype: torch.dtype | None = None) -> str | None:
        """Why this family cannot run ``spec`` for a weight of this shape and dtype on ``device``
        (None: not known, so refused) for inputs of ``input_dtype`` (None: not known), or None."""
        if spec.kind != "dense" or dtype not in FP8_DTYPES:
            return f"{self.unit} runs dense e4m3 weights, not {spec} of {dtype}"
        if device is None:
            return f"{self.unit} runs on a GPU of sm_89 or later; the device is not known"
        return scaled_mm_refusal(device, shape, input_dtype)

    def kernel_specs(self, dtype, shape, spec, density, m) -> list:
        return [quantizer_spec(input_dtype) for input_dtype in KERNEL_DTYPES]     # the input's rounding


SCALED_MM = Fp8ScaledMm()


def refusal(spec: FormatSpec, dtype: torch.dtype, shape: tuple[int, int] | None = None,
            device: torch.device | str | None = None, input_dtype: torch.dtype | None = None) -> str | None:
    """Why no kernel runs ``spec`` for a weight of ``dtype`` (and ``shape``, on ``device``, for
    inputs of ``input_dtype`` where known) when it is an FP8 dtype (None for other dtypes: the
    other families answer for them)."""
    if dtype not in FP8_DTYPES:
        return None
    if shape is None:
        return "sparsecc's FP8 kernels need the weight's shape"
    if spec.kind == "dense":
        return SCALED_MM.refuses(spec, shape, dtype, device)
    if spec.kind == "nm":
        return SPARSE24_FP8.refuses(spec, shape, dtype, input_dtype)
    return f"no FP8 kernel runs {spec}: a quantized site runs as dense or n:m"
