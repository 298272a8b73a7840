"""The quantized linear layer that ``sparsecc.quantize`` puts in place of an ``nn.Linear``.

Its forward is :func:`sparsecc.ir.quant.fp8_linear` on an e4m3 weight, per-output-channel fp32
scales and, when calibrated, a static fp32 input scale. ``fp8_linear`` is an fx leaf
(``torch.fx.wrap``): a traced model shows one call with the layer's tensors as constants, which
``passes/find_linear`` recognises as a site, so ``sparsecc.compile`` plans and packs it like any
other linear.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ir.quant import E4M3, dequantize, fp8_linear

torch.fx.wrap("fp8_linear")


class FP8Linear(nn.Module):
    """``y = (e4m3(x / s_x) @ W_q^T) * s_x * s_w + bias`` (see :mod:`sparsecc.ir.quant`).

    ``weight``: ``[out, in]`` float8_e4m3fn (a parameter without gradient); ``weight_scale``:
    ``[out]`` fp32; ``input_scale``: a 0-d fp32 buffer (static) or None (per token, dynamic);
    ``bias``: ``[out]`` in the original layer's dtype, or None.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dtype != E4M3 or weight.dim() != 2:
            raise ValueError(f"FP8Linear takes a 2-D {E4M3} weight, got {weight.dtype}{tuple(weight.shape)}")
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale", weight_scale.to(torch.float32))
        self.register_buffer("input_scale", None if input_scale is None else input_scale.to(torch.float32).reshape(()))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """``W_q * s_w`` in fp32: the weight this layer multiplies by, up to the input's rounding."""
        return dequantize(self.weight, self.weight_scale)

    def extra_repr(self) -> str:
        inputs = "dynamic per-token" if self.input_scale is None else f"static {float(self.input_scale):.4g}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight=e4m3 per-channel, input={inputs}")
