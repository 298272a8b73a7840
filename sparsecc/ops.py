"""The custom ops that replace linear sites: one per format family.

Every op computes ``y = act(x' @ W^T + bias)`` where ``x' = x`` (``[..., K]``) or, with
``x_transposed``, ``x' = x^T`` (``x`` is ``[..., K, M]``), and stores ``y`` (``[..., N]``) or,
with ``transpose_out``, ``y^T``. The ops differ only in how ``W`` arrives:

=========================  ===============================================================
``sparsecc::linear_dense``  ``weight [N, K]``
``sparsecc::linear_nm``     ``values, indices`` of an n:m weight (see sparsecc.formats)
``sparsecc::linear_bsr``    ``crow, col, values [nnzb, h, w]``
``sparsecc::linear_csr``    ``crow, col, values``
=========================  ===============================================================

The implementations here run on torch's own kernels on any device (dense GEMM, MKL/cuSPARSE
CSR and BSR, or block products where torch has no BSR kernel for the dtype or block);
fp16/bf16 sparse products accumulate in fp32. Generated CUDA kernels register themselves
for the CUDA device on top of these (``register_kernel("cuda")``). Each op also has a fake
implementation (shapes only) for tracing and torch.compile.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .epilogue import Activation, apply_activation
from .errors import InputError

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


def _output_shape(x: Tensor, x_transposed: bool, out_features: int, transpose_out: bool) -> list[int]:
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

@torch.library.custom_op("sparsecc::linear_dense", mutates_args=())
def linear_dense(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str,
                 x_transposed: bool, transpose_out: bool) -> Tensor:
    Activation.parse(activation)
    _check_dtype(x, weight.dtype)
    _rows(x, x_transposed, weight.shape[1])
    return linear_torch(x, weight, bias, activation, x_transposed, transpose_out).contiguous()


@linear_dense.register_fake
def _(x, weight, bias, activation, x_transposed, transpose_out):
    return x.new_empty(_output_shape(x, x_transposed, weight.shape[0], transpose_out))


# ---------------------------------------------------------------------------- n:m

def nm_to_dense(values: Tensor, indices: Tensor, n: int, m: int, in_features: int) -> Tensor:
    """Unpack an n:m weight to dense [N, K] (the layout of sparsecc.formats.NMWeight)."""
    rows = values.shape[0]
    groups = values.shape[1] // n
    dense = values.new_zeros(rows, groups, m)
    dense.scatter_(-1, indices.reshape(rows, groups, n).long(), values.reshape(rows, groups, n))
    return dense.reshape(rows, groups * m)[:, :in_features]


@torch.library.custom_op("sparsecc::linear_nm", mutates_args=())
def linear_nm(x: Tensor, values: Tensor, indices: Tensor, n: int, m: int, in_features: int,
              bias: Optional[Tensor], activation: str, x_transposed: bool,
              transpose_out: bool) -> Tensor:
    Activation.parse(activation)
    _check_dtype(x, values.dtype)
    weight = nm_to_dense(values, indices, n, m, in_features)
    x2d, lead = _rows(x, x_transposed, in_features)
    y = F.linear(x2d, weight)
    if bias is not None:
        y = y + bias
    return _finish(apply_activation(y, activation), lead, None, "none", transpose_out, x.dtype)


@linear_nm.register_fake
def _(x, values, indices, n, m, in_features, bias, activation, x_transposed, transpose_out):
    return x.new_empty(_output_shape(x, x_transposed, values.shape[0], transpose_out))


# ---------------------------------------------------------------------------- bsr

def _torch_has_bsr_kernel(device: torch.device, dtype: torch.dtype, block: tuple[int, int]) -> bool:
    """Whether ``bsr @ dense`` has a native torch kernel here (MKL on CPU: fp32/fp64 and
    square blocks; on CUDA torch has BSR kernels for floating types)."""
    if device.type == "cpu":
        return dtype in (torch.float32, torch.float64) and block[0] == block[1]
    return device.type == "cuda"


def _bsr_block_products(crow: Tensor, col: Tensor, values: Tensor, out_features: int,
                        x2d: Tensor) -> Tensor:
    """BSR times dense as one batched product over the stored blocks: [M, N]."""
    nnzb, h, w = values.shape
    rows = x2d.shape[0]
    block_row = torch.repeat_interleave(torch.arange(crow.numel() - 1, device=crow.device),
                                        (crow[1:] - crow[:-1]).long())
    x_blocks = x2d.reshape(rows, -1, w)[:, col.long()].permute(1, 2, 0)     # [nnzb, w, M]
    products = torch.bmm(values, x_blocks)                                   # [nnzb, h, M]
    out = products.new_zeros(out_features // h, h, rows)
    out.index_add_(0, block_row, products)
    return out.reshape(out_features, rows).t()


@torch.library.custom_op("sparsecc::linear_bsr", mutates_args=())
def linear_bsr(x: Tensor, crow: Tensor, col: Tensor, values: Tensor, out_features: int,
               in_features: int, bias: Optional[Tensor], activation: str, x_transposed: bool,
               transpose_out: bool) -> Tensor:
    Activation.parse(activation)
    _check_dtype(x, values.dtype)
    x2d, lead = _rows(x, x_transposed, in_features)
    compute = torch.float32 if values.dtype in _LOW_PRECISION else values.dtype
    vals, x2d = values.to(compute), x2d.to(compute)
    block = (values.shape[1], values.shape[2])
    if _torch_has_bsr_kernel(x.device, compute, block):
        weight = torch.sparse_bsr_tensor(crow, col, vals, (out_features, in_features),
                                         check_invariants=False)
        y = _sparse_matmul(weight, x2d)
    else:
        y = _bsr_block_products(crow, col, vals, out_features, x2d)
    return _finish(y, lead, bias, activation, transpose_out, x.dtype)


@linear_bsr.register_fake
def _(x, crow, col, values, out_features, in_features, bias, activation, x_transposed, transpose_out):
    return x.new_empty(_output_shape(x, x_transposed, out_features, transpose_out))


# ---------------------------------------------------------------------------- csr

@torch.library.custom_op("sparsecc::linear_csr", mutates_args=())
def linear_csr(x: Tensor, crow: Tensor, col: Tensor, values: Tensor, out_features: int,
               in_features: int, bias: Optional[Tensor], activation: str, x_transposed: bool,
               transpose_out: bool) -> Tensor:
    Activation.parse(activation)
    _check_dtype(x, values.dtype)
    x2d, lead = _rows(x, x_transposed, in_features)
    compute = torch.float32 if values.dtype in _LOW_PRECISION else values.dtype
    weight = torch.sparse_csr_tensor(crow, col, values.to(compute), (out_features, in_features),
                                     check_invariants=False)
    y = _sparse_matmul(weight, x2d.to(compute))
    return _finish(y, lead, bias, activation, transpose_out, x.dtype)


@linear_csr.register_fake
def _(x, crow, col, values, out_features, in_features, bias, activation, x_transposed, transpose_out):
    return x.new_empty(_output_shape(x, x_transposed, out_features, transpose_out))


#: the op that runs each format family
OP_FOR_KIND = {
    "dense": torch.ops.sparsecc.linear_dense.default,
    "nm": torch.ops.sparsecc.linear_nm.default,
    "bsr": torch.ops.sparsecc.linear_bsr.default,
    "csr": torch.ops.sparsecc.linear_csr.default,
}
