"""The custom ops that replace linear sites: one per format family.

Every op computes ``y = act(x' @ W^T + bias)`` where ``x' = x`` (``[..., K]``) or, with
``x_transposed``, ``x' = x^T`` (``x`` is ``[..., K, M]``), and stores ``y`` (``[..., N]``) or,
with ``transpose_out``, ``y^T``. The ops differ only in how ``W`` arrives:

==================================  ==============================================================
``sparsecc::linear_dense``          ``weight [N, K]``
``sparsecc::linear_nm``             ``values, indices`` of an n:m weight (see sparsecc.ir.formats)
``sparsecc::linear_bsr``            ``crow, col, values [nnzb, h, w]``
``sparsecc::linear_csr``            ``crow, col, values``
``sparsecc::linear_fp8``            ``weight [N, K]`` in e4m3 and its scales (a quantized site)
``sparsecc::linear_fp8_nm``         ``values, indices`` of an e4m3 n:m weight and its scales
``sparsecc::linear_fp8_scaled_mm``  as ``linear_fp8``, on ``torch._scaled_mm`` where it runs
==================================  ==============================================================

The FP8 reference ops (``linear_fp8``, ``linear_fp8_nm``) compute
:func:`sparsecc.ir.quant.fp8_product` (the input rounded to e4m3 per token or with its static
scale, exact products summed in fp32, then both scales); they take an input of any floating dtype
and return that dtype. They are the reference the GPU's FP8 kernels are held to, not fast: they
widen e4m3 to fp32 and run a dense fp32 product. ``linear_fp8_scaled_mm`` rounds the input to
e4m3 the same way and runs the product and the bias on ``torch._scaled_mm`` (cuBLASLt on Hopper)
with the per-token and per-channel scales, its result in the input's dtype, where
:func:`scaled_mm_refusal` allows; elsewhere it is ``linear_fp8``.

The implementations here run on torch's own kernels on any device (dense GEMM, MKL/cuSPARSE
CSR and BSR, or block products where torch has no BSR kernel for the dtype or block);
fp16/bf16 sparse products accumulate in fp32 (sites on generated CUDA kernels run through
their own op, ``sparsecc::linear_kernel`` in sparsecc.runtime.kernel_op). Each op also has a fake
implementation (shapes only) for tracing and torch.compile. The ops are defined with
``torch.library.Library`` (one implementation for every device, CompositeExplicitAutograd)
rather than ``torch.library.custom_op``, whose Python layers cost about 10 us more per call.

What every op accepts (checked by :func:`_prepare`, the same for all four):

- ``x`` must have the weight's dtype and K features; anything else raises InputError
  naming both. Any strides and any alignment are fine, and ``M = 0`` gives an empty output.
- ``bias`` must have shape ``[N]``; another shape raises InputError (it is never
  broadcast). A bias of another dtype is cast to ``x``'s dtype first, as the CUDA kernels
  do, so a float32 bias on an fp16 site works and rounds like an fp16 bias.
- an unknown ``activation`` raises InputError.
- NaN and infinities in ``x`` propagate exactly as in dense ``F.linear`` with the same
  weight, zeros included (``0 * NaN = NaN``): see :func:`_has_nonfinite`. The CUDA 2:4
  and BSR kernels do the same on the GPU (:mod:`sparsecc.kernels.nonfinite_guard` says how).
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..codegen.spec import Family, KernelSpec
from ..errors import InputError
from ..ir.epilogue import Activation, apply_activation
from ..ir.quant import E4M3, fp8_product, quantize_input
from . import loader

_LIB = torch.library.Library("sparsecc", "FRAGMENT")
# the BSR and CSR tensors below are this module's own, short-lived: torch's beta notice about them
# would speak of something the user never made
warnings.filterwarnings("ignore", message="Sparse (CSR|BSR) tensor support is in beta", category=UserWarning)


def _define(schema: str, fake):
    """Define ``sparsecc::<schema>`` with the decorated function as its implementation on every
    device and ``fake`` as its shape function; returns the op (an OpOverload)."""
    name = schema.split("(", 1)[0]

    def register(implementation):
        _LIB.define(schema)
        _LIB.impl(name, implementation, "CompositeExplicitAutograd")
        torch.library.register_fake(f"sparsecc::{name}", fake, lib=_LIB)
        return getattr(torch.ops.sparsecc, name).default
    return register


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _rows(x: Tensor, x_transposed: bool, in_features: int) -> tuple[Tensor, tuple[int, ...]]:
    """``x`` as a [M, K] matrix and the leading shape of the output rows."""
    xt = x.transpose(-1, -2) if x_transposed and x.dim() > 1 else x
    if xt.shape[-1] != in_features:
        raise InputError(f"sparsecc linear: input has {xt.shape[-1]} features along K, the "
                         f"weight expects {in_features} (input shape {tuple(x.shape)}, "
                         f"x_transposed={x_transposed})")
    lead = tuple(xt.shape[:-1])
    return xt.reshape(-1, in_features), lead


def _check_dtype(x: Tensor, weight_dtype: torch.dtype) -> None:
    if x.dtype != weight_dtype:
        raise InputError(f"sparsecc linear: input dtype {x.dtype} does not match the weight's "
                         f"{weight_dtype}; cast the input (as F.linear would require)")


def _check_bias(bias: Optional[Tensor], out_features: int, dtype: torch.dtype) -> Optional[Tensor]:
    """``bias`` as an ``[N]`` tensor of ``dtype`` (the input's): another dtype is cast, as the
    CUDA kernels do; a wrong shape is refused, since broadcasting it would hide the mistake."""
    if bias is None:
        return None
    if tuple(bias.shape) != (out_features,):
        raise InputError(f"sparsecc linear: bias has shape {tuple(bias.shape)}, the weight has "
                         f"{out_features} output features (expected a bias of shape ({out_features},))")
    return bias.to(dtype)


def _prepare(x: Tensor, weight_dtype: torch.dtype, out_features: int, in_features: int,
             bias: Optional[Tensor], activation: str,
             x_transposed: bool) -> tuple[Tensor, tuple[int, ...], Optional[Tensor]]:
    """Check an op's arguments (see the module docstring) and return ``x`` as [M, K] rows,
    the leading shape of the output rows, and the bias in ``x``'s dtype."""
    Activation.parse(activation)
    _check_dtype(x, weight_dtype)
    x2d, lead = _rows(x, x_transposed, in_features)
    return x2d, lead, _check_bias(bias, out_features, x.dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a sparse product runs in: fp16/bf16 accumulate in fp32."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def _has_nonfinite(x2d: Tensor) -> bool:
    """Whether ``x2d`` holds a NaN or an infinity.

    A torch sparse product only multiplies the stored values, so a NaN or Inf of ``x`` that
    meets a zero of the weight is skipped, where dense ``F.linear`` gives ``0 * NaN = NaN``
    (and ``0 * Inf = NaN``). The CSR and BSR ops check with this and take a dense product
    when it returns True. One reduction is cheap next to the product: a sum over a NaN or
    an infinity is not finite; a sum of finite values that overflows is a false alarm that
    only costs the dense fallback. (On CUDA, reading the answer waits for the device.)
    """
    return not bool(torch.isfinite(x2d.sum()))


def _finish(y: Tensor, lead: tuple[int, ...], bias: Optional[Tensor], activation: str,
            transpose_out: bool, out_dtype: torch.dtype) -> Tensor:
    """Epilogue on a [M, N] product: bias, activation, cast, reshape, optional transpose."""
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = apply_activation(y, activation).to(out_dtype)
    y = y.reshape(*lead, y.shape[-1])
    if transpose_out and y.dim() > 1:
        y = y.transpose(-1, -2)
    return y.contiguous()


def output_shape(x: Tensor, x_transposed: bool, out_features: int, transpose_out: bool) -> list[int]:
    if x.dim() == 1:
        return [out_features]
    lead = list(x.shape[:-2]) + [x.shape[-1]] if x_transposed else list(x.shape[:-1])
    shape = lead + [out_features]
    if transpose_out:
        shape[-1], shape[-2] = shape[-2], shape[-1]
    return shape


def linear_torch(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str,
                 x_transposed: bool, transpose_out: bool) -> Tensor:
    """A site computed with plain torch ops (what a site that stays dense becomes): the same
    math as the custom ops, in a form Inductor can fuse and that costs no dispatch."""
    if x.dim() == 1:
        x_transposed = transpose_out = False
    y = F.linear(x.transpose(-1, -2) if x_transposed else x, weight, bias)
    y = apply_activation(y, activation)
    return y.transpose(-1, -2) if transpose_out else y


def _sparse_matmul(weight: Tensor, x2d: Tensor) -> Tensor:
    """``weight`` (a torch sparse [N, K] tensor) times ``x2d^T``, returned as [M, N]."""
    return (weight @ x2d.t()).t()


# ---------------------------------------------------------------------------- dense

@_define("linear_dense(Tensor x, Tensor weight, Tensor? bias, str activation, bool x_transposed, "
         "bool transpose_out) -> Tensor",
         lambda x, weight, bias, activation, x_transposed, transpose_out:
         x.new_empty(output_shape(x, x_transposed, weight.shape[0], transpose_out)))
def linear_dense(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str,
                 x_transposed: bool, transpose_out: bool) -> Tensor:
    """A dense site (``weight [N, K]``); arguments are checked as the module docstring says."""
    _, _, bias = _prepare(x, weight.dtype, weight.shape[0], weight.shape[1], bias, activation,
                          x_transposed)
    return linear_torch(x, weight, bias, activation, x_transposed, transpose_out).contiguous()


# ---------------------------------------------------------------------------- n:m

def nm_to_dense(values: Tensor, indices: Tensor, n: int, m: int, in_features: int) -> Tensor:
    """Unpack an n:m weight to dense [N, K] (the layout of sparsecc.formats.NMWeight)."""
    rows = values.shape[0]
    groups = values.shape[1] // n
    dense = values.new_zeros(rows, groups, m)
    dense.scatter_(-1, indices.reshape(rows, groups, n).long(), values.reshape(rows, groups, n))
    return dense.reshape(rows, groups * m)[:, :in_features]


@_define("linear_nm(Tensor x, Tensor values, Tensor indices, int n, int m, int in_features, Tensor? bias, "
         "str activation, bool x_transposed, bool transpose_out) -> Tensor",
         lambda x, values, indices, n, m, in_features, bias, activation, x_transposed, transpose_out:
         x.new_empty(output_shape(x, x_transposed, values.shape[0], transpose_out)))
def linear_nm(x: Tensor, values: Tensor, indices: Tensor, n: int, m: int, in_features: int,
              bias: Optional[Tensor], activation: str, x_transposed: bool,
              transpose_out: bool) -> Tensor:
    """An n:m site: the weight is unpacked to dense, so the product is a dense one (NaN and
    Inf propagate as in F.linear); arguments are checked as the module docstring says."""
    x2d, lead, bias = _prepare(x, values.dtype, values.shape[0], in_features, bias, activation,
                               x_transposed)
    weight = nm_to_dense(values, indices, n, m, in_features)
    y = F.linear(x2d, weight)
    return _finish(y, lead, bias, activation, transpose_out, x.dtype)


# ---------------------------------------------------------------------------- bsr

def _sparse_fake(x, crow, col, values, out_features, in_features, bias, activation, x_transposed, transpose_out):
    """The output's shape for the BSR and CSR ops (they take the same arguments)."""
    return x.new_empty(output_shape(x, x_transposed, out_features, transpose_out))


def torch_has_bsr_kernel(device: torch.device, dtype: torch.dtype, block: tuple[int, int]) -> bool:
    """Whether ``bsr @ dense`` has a native torch kernel here (MKL on CPU: fp32/fp64 and
    square blocks; cuSPARSE on CUDA: square blocks)."""
    if device.type in ("cpu", "cuda"):
        return block[0] == block[1] and (device.type == "cuda" or dtype in (torch.float32, torch.float64))
    return False


def _bsr_block_products(crow: Tensor, col: Tensor, values: Tensor, out_features: int,
                        x2d: Tensor) -> Tensor:
    """BSR times dense as one batched product over the stored blocks: [M, N]."""
    nnzb, h, w = values.shape
    rows = x2d.shape[0]
    block_row = torch.repeat_interleave(torch.arange(crow.numel() - 1, device=crow.device),
                                        (crow[1:] - crow[:-1]).long())
    x_blocks = x2d.reshape(rows, x2d.shape[1] // w, w)[:, col.long()].permute(1, 2, 0)  # [nnzb, w, M]
    products = torch.bmm(values, x_blocks)                                   # [nnzb, h, M]
    out = products.new_zeros(out_features // h, h, rows)
    out.index_add_(0, block_row, products)
    return out.reshape(out_features, rows).t()


@_define("linear_bsr(Tensor x, Tensor crow, Tensor col, Tensor values, int out_features, int in_features, "
         "Tensor? bias, str activation, bool x_transposed, bool transpose_out) -> Tensor",
         _sparse_fake)
def linear_bsr(x: Tensor, crow: Tensor, col: Tensor, values: Tensor, out_features: int,
               in_features: int, bias: Optional[Tensor], activation: str, x_transposed: bool,
               transpose_out: bool) -> Tensor:
    """A BSR site; arguments are checked as the module docstring says. Non-finite inputs
    take a dense product (see :func:`_has_nonfinite`)."""
    x2d, lead, bias = _prepare(x, values.dtype, out_features, in_features, bias, activation,
                               x_transposed)
    compute = _compute_dtype(values.dtype)
    vals, x2d = values.to(compute), x2d.to(compute)
    block = (values.shape[1], values.shape[2])
    weight = torch.sparse_bsr_tensor(crow, col, vals, (out_features, in_features),
                                     check_invariants=False)
    if _has_nonfinite(x2d):
        y = F.linear(x2d, weight.to_dense())
    elif torch_has_bsr_kernel(x.device, compute, block):
        y = _sparse_matmul(weight, x2d)
    else:
        y = _bsr_block_products(crow, col, vals, out_features, x2d)
    return _finish(y, lead, bias, activation, transpose_out, x.dtype)


# ---------------------------------------------------------------------------- csr

@_define("linear_csr(Tensor x, Tensor crow, Tensor col, Tensor values, int out_features, int in_features, "
         "Tensor? bias, str activation, bool x_transposed, bool transpose_out) -> Tensor",
         _sparse_fake)
def linear_csr(x: Tensor, crow: Tensor, col: Tensor, values: Tensor, out_features: int,
               in_features: int, bias: Optional[Tensor], activation: str, x_transposed: bool,
               transpose_out: bool) -> Tensor:
    """A CSR site; arguments are checked as the module docstring says. Non-finite inputs
    take a dense product (see :func:`_has_nonfinite`)."""
    x2d, lead, bias = _prepare(x, values.dtype, out_features, in_features, bias, activation,
                               x_transposed)
    compute = _compute_dtype(values.dtype)
    x2d = x2d.to(compute)
    weight = torch.sparse_csr_tensor(crow, col, values.to(compute), (out_features, in_features),
                                     check_invariants=False)
    y = F.linear(x2d, weight.to_dense()) if _has_nonfinite(x2d) else _sparse_matmul(weight, x2d)
    return _finish(y, lead, bias, activation, transpose_out, x.dtype)


# ---------------------------------------------------------------------------- fp8

def _fp8_rows(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Optional[Tensor], activation: str,
              x_transposed: bool) -> tuple[Tensor, tuple[int, ...], Optional[Tensor]]:
    """An FP8 site's arguments checked as the module docstring says (any floating input dtype):
    ``x`` as ``[M, K]`` rows, the leading shape of the output rows, the bias in ``x``'s dtype."""
    Activation.parse(activation)
    if not x.is_floating_point():
        raise InputError(f"sparsecc FP8 linear: the input must be floating point, got {x.dtype}")
    if tuple(weight_scale.shape) != (weight.shape[0],):
        raise InputError(f"sparsecc FP8 linear: weight_scale has shape {tuple(weight_scale.shape)}, "
                         f"expected ({weight.shape[0]},)")
    x2d, lead = _rows(x, x_transposed, weight.shape[1])
    return x2d, lead, _check_bias(bias, weight.shape[0], x.dtype)


def _fp8_site(x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Optional[Tensor],
              bias: Optional[Tensor], activation: str, x_transposed: bool, transpose_out: bool) -> Tensor:
    """An FP8 site on a dense e4m3 ``weight [N, K]``: its arguments checked, the product of
    :func:`~sparsecc.ir.quant.fp8_product`, the epilogue."""
    x2d, lead, bias = _fp8_rows(x, weight, weight_scale, bias, activation, x_transposed)
    y = fp8_product(x2d, weight, weight_scale, input_scale)
    return _finish(y, lead, bias, activation, transpose_out, x.dtype)


#: the arguments of the quantized sites with a dense e4m3 weight (linear_fp8, linear_fp8_scaled_mm)
_FP8_DENSE_ARGS = ("(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias, "
                   "str activation, bool x_transposed, bool transpose_out) -> Tensor")


def _fp8_dense_shape(x, weight, weight_scale, input_scale, bias, activation, x_transposed, transpose_out):
    return x.new_empty(output_shape(x, x_transposed, weight.shape[0], transpose_out))


@_define("linear_fp8" + _FP8_DENSE_ARGS, _fp8_dense_shape)
def linear_fp8(x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Optional[Tensor],
               bias: Optional[Tensor], activation: str, x_transposed: bool, transpose_out: bool) -> Tensor:
    """A quantized site with a dense e4m3 weight (see :func:`_fp8_site`)."""
    return _fp8_site(x, weight, weight_scale, input_scale, bias, activation, x_transposed, transpose_out)


@_define("linear_fp8_nm(Tensor x, Tensor values, Tensor indices, Tensor weight_scale, Tensor? input_scale, "
         "int n, int m, int in_features, Tensor? bias, str activation, bool x_transposed, "
         "bool transpose_out) -> Tensor",
         lambda x, values, indices, weight_scale, input_scale, n, m, in_features, bias, activation, x_transposed,
         transpose_out: x.new_empty(output_shape(x, x_transposed, values.shape[0], transpose_out)))
def linear_fp8_nm(x: Tensor, values: Tensor, indices: Tensor, weight_scale: Tensor, input_scale: Optional[Tensor],
                  n: int, m: int, in_features: int, bias: Optional[Tensor], activation: str,
                  x_transposed: bool, transpose_out: bool) -> Tensor:
    """A quantized site with an e4m3 n:m weight: unpacked (through fp32, exactly) to the dense
    weight, then :func:`_fp8_site`; the sums are those of the dense FP8 site."""
    weight = nm_to_dense(values.to(torch.float32), indices, n, m, in_features)
    return _fp8_site(x, weight, weight_scale, input_scale, bias, activation, x_transposed, transpose_out)


#: torch._scaled_mm's FP8 GEMM needs K and N (the weight's two sides) to be multiples of this
SCALED_MM_MULTIPLE = 16
#: the GPUs torch._scaled_mm takes per-row and per-column fp32 scales on (cuBLASLt on Hopper,
#: CUTLASS on Ada and Blackwell), and the output dtypes each gives: fp16 only through cuBLASLt
SCALED_MM_DTYPES = {(8, 9): (torch.bfloat16,), (9, 0): (torch.float16, torch.bfloat16),
                    (10, 0): (torch.bfloat16,)}


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of the CUDA GPU ``device`` (None: not a CUDA GPU torch can use)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def scaled_mm_refusal(device: torch.device | str, shape: tuple[int, int],
                      dtype: torch.dtype | None = None) -> str | None:
    """Why ``torch._scaled_mm`` cannot run the product of an FP8 site with an e4m3 weight of
    ``shape`` (``[N, K]``) on ``device`` for an input of ``dtype`` (None: any it may take), or
    None where it can."""
    capability = _capability(torch.device(device))
    if capability is None:
        return "torch._scaled_mm runs FP8 products on a CUDA GPU"
    dtypes = SCALED_MM_DTYPES.get(capability)
    if dtypes is None:
        supported = ", ".join(f"sm_{major}{minor}" for major, minor in SCALED_MM_DTYPES)
        return (f"torch._scaled_mm takes per-token input scales on {supported}; this GPU is "
                f"sm_{capability[0]}{capability[1]}")
    if dtype is not None and dtype not in dtypes:
        names = "/".join(str(d).replace("torch.", "") for d in dtypes)
        return (f"torch._scaled_mm returns {names} with per-token scales on this GPU, "
                f"not {str(dtype).replace('torch.', '')}")
    n, k = shape
    if not n or not k or n % SCALED_MM_MULTIPLE or k % SCALED_MM_MULTIPLE:
        return (f"torch._scaled_mm needs K and N to be multiples of {SCALED_MM_MULTIPLE} "
                f"(this weight is {n}x{k})")
    return None


@functools.lru_cache(maxsize=None)
def quantizer_spec(dtype: torch.dtype) -> KernelSpec:
    """The kernel that rounds inputs of ``dtype`` (float16 or bfloat16) to e4m3 in one pass (made
    once per dtype: a dense FP8 site asks for it on every call)."""
    return KernelSpec(Family.QUANTIZE_E4M3, str(dtype).replace("torch.", ""))


def quantize_rows(x2d: Tensor, input_scale: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`~sparsecc.ir.quant.quantize_input`'s ``(x_q, s_x)``, by sparsecc's rounding kernel in
    one pass over ``x2d`` where this process has loaded it for its dtype (the same codes and scales:
    templates/common.j2's e4m3 rounding), else by torch's ops."""
    kernel = None
    if x2d.is_cuda and x2d.dtype in _LOW_PRECISION and x2d.shape[1] % 8 == 0:
        kernel = loader.find(quantizer_spec(x2d.dtype).symbol)
    if kernel is None or not x2d.numel():
        return quantize_input(x2d, input_scale)
    rows = x2d.contiguous()
    if rows.data_ptr() % 16:                      # the kernel loads 16 bytes at a time
        rows = rows.clone()
    n, k = rows.shape
    x_q = torch.empty(n, k, dtype=torch.uint8, device=rows.device)
    scales = torch.empty(n, 1, dtype=torch.float32, device=rows.device)
    static = input_scale.to(torch.float32).reshape(()).contiguous() if input_scale is not None else None
    kernel.quantize(rows.data_ptr(), static.data_ptr() if static is not None else 0, x_q.data_ptr(),
                    scales.data_ptr(), n, k, torch.cuda.current_stream(rows.device).cuda_stream)
    return x_q.view(E4M3), scales


def scaled_mm_product(x2d: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Optional[Tensor],
                      bias: Optional[Tensor]) -> Tensor:
    """:func:`~sparsecc.ir.quant.fp8_product` plus ``bias`` (``[N]`` in ``x2d``'s dtype, or None)
    on ``torch._scaled_mm``, in ``x2d``'s dtype, where :func:`scaled_mm_refusal` allows. The input
    is rounded to e4m3 as :func:`~sparsecc.ir.quant.quantize_input` does (:func:`quantize_rows`); the exact e4m3
    products are summed in fp32 (``use_fast_accum=False``), scaled by ``s_x [M, 1]`` and
    ``s_w [1, N]``, the bias added and the sum rounded once to the output dtype, as the
    reference op rounds it: only the order of the sums differs."""
    x_q, x_scale = quantize_rows(x2d, input_scale)
    rows = x2d.shape[0]
    scale_a = x_scale.to(torch.float32).reshape(-1, 1).expand(rows, 1).contiguous()    # per token, or static
    scale_b = weight_scale.to(torch.float32).reshape(1, -1).contiguous()
    # row-major x_q [M, K] times a column-major [K, N] (the transpose of the row-major weight)
    return torch._scaled_mm(x_q.contiguous(), weight.contiguous().t(), scale_a=scale_a, scale_b=scale_b,
                            bias=bias, out_dtype=x2d.dtype, use_fast_accum=False)


@_define("linear_fp8_scaled_mm" + _FP8_DENSE_ARGS, _fp8_dense_shape)
def linear_fp8_scaled_mm(x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Optional[Tensor],
                         bias: Optional[Tensor], activation: str, x_transposed: bool, transpose_out: bool) -> Tensor:
    """A quantized site with a dense e4m3 weight, its product and bias on ``torch._scaled_mm``
    where that runs (:func:`scaled_mm_product`), the activation after it in the input's dtype;
    elsewhere (another device, GPU, input dtype or shape, or no rows) exactly ``linear_fp8``."""
    if scaled_mm_refusal(x.device, tuple(weight.shape), x.dtype) is not None or not x.numel():
        return _fp8_site(x, weight, weight_scale, input_scale, bias, activation, x_transposed, transpose_out)
    x2d, lead, bias = _fp8_rows(x, weight, weight_scale, bias, activation, x_transposed)
    y = scaled_mm_product(x2d, weight, weight_scale, input_scale, bias)
    return _finish(y, lead, None, activation, transpose_out, x.dtype)


def fp8_dense_op(device: torch.device | str, shape: tuple[int, int], dtype: torch.dtype | None = None):
    """The op a quantized site that stays dense runs: ``linear_fp8_scaled_mm`` where
    ``torch._scaled_mm`` takes its weight on ``device`` (and its input's ``dtype`` where known),
    else the reference ``linear_fp8``."""
    if scaled_mm_refusal(device, shape, dtype) is None:
        return linear_fp8_scaled_mm
    return linear_fp8


#: the op that runs each format family
OP_FOR_KIND = {
    "dense": torch.ops.sparsecc.linear_dense.default,
    "nm": torch.ops.sparsecc.linear_nm.default,
    "bsr": torch.ops.sparsecc.linear_bsr.default,
    "csr": torch.ops.sparsecc.linear_csr.default,
}
#: the op that runs each format family for a quantized (FP8) site
OP_FOR_FP8 = {
    "dense": torch.ops.sparsecc.linear_fp8.default,
    "nm": torch.ops.sparsecc.linear_fp8_nm.default,
}
