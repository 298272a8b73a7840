"""FP8 numerics: how a weight and an activation become e4m3, and the product an FP8 linear computes.

One definition, used by every implementation (the quantized model's eager forward, the CPU ops a
compiled FP8 site runs, the quantization report), so that ``sparsecc.compile`` of a quantized
model computes what the quantized model computes, up to the order of fp32 sums:

- weight ``W [N, K]``: one fp32 scale per output channel, ``s_w = amax(|W[n, :]|) / 448``,
  ``W_q = e4m3(W / s_w)`` (448 is e4m3's largest finite value; a row of zeros gets ``s_w = 1``);
- input ``x [M, K]``: per token (``s_x = amax(|x[m, :]|) / 448``, computed on each call, the
  default) or one static fp32 scale from calibration (``x / s_x`` saturates at +-448);
- ``y = (x_q @ W_q^T) * s_x * s_w + bias``: the products of two e4m3 values are exact in fp32 and
  are summed in fp32, as FP8 tensor cores do.

Zero stays zero: ``0 / s = 0``, and every e4m3 zero (negative zeros and values that underflow
included) is stored as ``+0``, so a pruned weight's n:m pattern survives quantization.
"""
from __future__ import annotations

import torch
from torch import Tensor

#: the element type of a quantized weight and of a quantized input
E4M3 = torch.float8_e4m3fn
#: e4m3's largest finite value: an amax maps to it
E4M3_MAX = 448.0
#: the weight dtypes that mark a site as quantized
FP8_DTYPES = (torch.float8_e4m3fn,)
#: the schemes sparsecc.quantize takes
SCHEMES = ("fp8",)


def amax_scale(amax: Tensor) -> Tensor:
    """The fp32 scale that maps ``amax`` to :data:`E4M3_MAX` (1 where ``amax`` is 0), the
    correctly rounded quotient on every device: on a GPU, torch divides by a Python number as a
    multiplication by its rounded reciprocal, one unit in the last place off for about half of
    all values, which then rounds some inputs to the other e4m3 code than sparsecc's kernels."""
    amax = amax.to(torch.float32)
    return torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))


def to_e4m3(values: Tensor, scale: Tensor) -> Tensor:
    """``values / scale`` rounded to the nearest e4m3 (ties to even), saturated at +-448, computed
    in fp32; every zero is stored as +0. NaN stays NaN.

    In as few passes over the values as torch's ops allow (this runs on every call of an FP8 site
    with per-token scales): the division writes fp32 directly (a 16-bit tensor over an fp32 one of
    one or more dimensions promotes to fp32, and converting 16-bit floats to fp32 is exact), the
    saturation is done in place, and the signs of zeros are cleared on the one-byte codes."""
    scale = scale.to(torch.float32)
    scaled = torch.div(values, scale.reshape(1) if scale.dim() == 0 else scale)
    if scaled.dtype != torch.float32:           # a float64 input
        scaled = scaled.to(torch.float32)
    bits = scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3).view(torch.uint8)
    return bits.masked_fill_((bits & 0x7F) == 0, 0).view(E4M3)


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(W_q, s_w)``: an ``[N, K]`` weight in e4m3 with its per-output-channel fp32 scales ``[N]``."""
    scale = amax_scale(weight.detach().abs().amax(dim=1))
    return to_e4m3(weight.detach(), scale[:, None]), scale


def dequantize(weight: Tensor, scale: Tensor) -> Tensor:
    """``W_q * s_w`` in fp32 (exact: an e4m3 value times an fp32 scale rounds once)."""
    return weight.to(torch.float32) * scale[:, None]


def quantize_input(x2d: Tensor, input_scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(x_q, s_x)`` for ``[M, K]`` rows: per token (``s_x [M, 1]``) when ``input_scale`` is None,
    else the static scale (a 0-d fp32 tensor)."""
    if input_scale is None and x2d.shape[1]:   # max |x| per row from one pass (aminmax and maximum keep NaN)
        low, high = torch.aminmax(x2d.detach(), dim=1, keepdim=True)
        scale = amax_scale(torch.maximum(high, -low))
    elif input_scale is None:
        scale = torch.ones(x2d.shape[0], 1, device=x2d.device)
    else:
        scale = input_scale.to(torch.float32)
    return to_e4m3(x2d, scale), scale


def fp8_product(x2d: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Tensor | None) -> Tensor:
    """``(x_q @ W_q^T) * s_x * s_w`` in fp32 for ``[M, K]`` rows and an e4m3 ``[N, K]`` weight."""
    x_q, x_scale = quantize_input(x2d, input_scale)
    product = x_q.to(torch.float32) @ weight.to(torch.float32).t()
    return product * x_scale * weight_scale.to(torch.float32)


def fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Tensor | None,
               bias: Tensor | None) -> Tensor:
    """What a quantized linear computes for ``x [..., K]``: :func:`fp8_product` plus the bias
    (cast to ``x``'s dtype, added in fp32), returned in ``x``'s dtype."""
    lead = x.shape[:-1]
    y = fp8_product(x.reshape(-1, x.shape[-1]), weight, weight_scale, input_scale)
    if bias is not None:
        y = y + bias.to(x.dtype).to(torch.float32)
    return y.to(x.dtype).reshape(*lead, weight.shape[0])
