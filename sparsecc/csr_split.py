"""Unstructured sparse weights on the 2:4 kernels plus a residual pass: a split CSR weight.

A weight of density d keeps at most two non-zeros in almost every group of four along K:
with its non-zeros spread at random, a group holds three or four with probability about
4 d^3, which at d = 0.05 is one group in 2000. Such a weight is therefore split exactly as

    W = W24 + R,

``W24`` keeping the first two non-zeros (by position) of every group of four, ``R`` the
rest (at d = 0.05 about 0.01% of W's elements, at d = 0.1 0.1%, at d = 0.3 2.3%). ``W24``
runs on sparsecc's 2:4 kernels (sparse tensor cores: the CUTLASS GEMMs, or the small-batch
kernels, as a 2:4 site planned for the same batch), and a second kernel
(templates/residual_sm90.cu.j2) adds ``x R^T``, in one of two orders:

- on the CUTLASS GEMMs (large batches), first: the residual kernel writes ``y = x R^T``
  (:data:`WRITE`), and the GEMM, built to read y as its source, stores
  ``act(x W24^T + bias + y)``: y is written once and read once, inside the GEMM's epilogue;
- on the small-batch kernels, after: they store ``x W24^T + bias``, and the residual kernel
  adds ``x R^T`` in place and applies the activation (:data:`GATHER` or :data:`BY_ROWS`).

Either way a residual with many entries reads x from a transposed copy that the pass makes
first (:data:`WRITE_TRANSPOSED`, :data:`TRANSPOSED`): an entry then reads its inputs for
eight rows of x in one 32-byte sector instead of eight.

Where R is empty the 2:4 kernel alone runs the site, epilogue included.

Both parts are exact, so the split is lossless: y differs from the unsplit product by the
rounding of y to the weight's dtype between the two kernels (fp32 sums in both).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import runtime
from .codegen import Family, KernelSpec
from .epilogue import ACTIVATION_CODES, Activation
from .errors import InputError
from .formats import CSR, CSRWeight, PackedWeight, group_along_k
from .gpu import KERNEL_DTYPES, KernelWeight, linear_add, linear_kernel, pack_24_for, shape_supported as kernels_take
from .ops import _output_shape

#: the residual pass's modes (its launch ``splits``): after the 2:4 kernel, the kernel picks by the
#: rows of x (gather below 256, staged from 256 where K fits), or gathers x from global memory per
#: entry, or stages the CTA's rows of x in shared memory first, or gathers from a copy of x^T it
#: makes first; before a GEMM with a source, it writes y = x R^T (gathering from x or from x^T),
#: which the GEMM adds (templates/residual_sm90.cu.j2)
BY_ROWS, GATHER, STAGED, WRITE, TRANSPOSED, WRITE_TRANSPOSED = 0, 1, 2, 3, 4, 5
#: the modes that make a transposed copy of x (in a workspace of the kernel's ``workspace_size``)
FROM_TRANSPOSED = (TRANSPOSED, WRITE_TRANSPOSED)
#: a residual with at least this many entries per input feature gathers from x^T: per eight
#: rows of x an entry then reads one 32-byte sector instead of eight (224 bytes saved), and the
#: copy costs 32 bytes per input feature (8 rows x 2 bytes, read and written), so it pays from
#: about 1/7 entry per input feature
TRANSPOSED_MIN_ENTRIES = 1 / 7
#: a weight whose residual has fewer entries per output feature than this always gathers: measured
#: on an H100 at M = 2048 (benchmarks/lab/csr_split_modes-*, 2026-11-25), on 11008x4096 staging x
#: cost more than it saved at density 0.01 (0.003 entries per output: 288.5 against 268.7 us) and
#: paid at 0.05 (0.5 per output: 304.7 against 332.5 us); at M = 16 and 64 gathering won everywhere
STAGED_MIN_ENTRIES = 0.25


def residual_mode(entries: int, out_features: int, in_features: int, main: KernelWeight) -> int:
    """The residual pass's mode for R's ``entries`` beside the 2:4 part ``main``: where main's
    GEMMs add y (a source), :data:`WRITE`, or :data:`WRITE_TRANSPOSED` from
    :data:`TRANSPOSED_MIN_ENTRIES` per input feature (K % 8 == 0); else :data:`BY_ROWS` from
    :data:`STAGED_MIN_ENTRIES` per output feature, else :data:`GATHER`."""
    many = entries >= TRANSPOSED_MIN_ENTRIES * in_features and in_features % 8 == 0
    if getattr(main, "source", False):
        return WRITE_TRANSPOSED if many else WRITE
    return BY_ROWS if entries >= STAGED_MIN_ENTRIES * out_features else GATHER


def split_24(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(W24, R)`` with ``W24 + R == weight`` exactly: ``W24`` keeps the first two non-zeros of
    every group of four along K (it fits 2:4), ``R`` the others."""
    n, k = weight.shape
    groups = group_along_k(weight.detach(), 4)
    nonzero = groups != 0
    keep = nonzero & (nonzero.cumsum(-1) <= 2)
    main = torch.where(keep, groups, torch.zeros((), dtype=weight.dtype, device=weight.device))
    rest = torch.where(keep, torch.zeros((), dtype=weight.dtype, device=weight.device), groups)
    return main.reshape(n, -1)[:, :k], rest.reshape(n, -1)[:, :k]


def residual_spec(dtype: torch.dtype) -> KernelSpec:
    """The residual pass's kernel for a dtype."""
    return KernelSpec(Family.RESIDUAL_SM90, str(dtype).replace("torch.", ""))


def shape_supported(out_features: int, in_features: int, dtype: torch.dtype) -> str | None:
    """Why a weight of this shape and dtype cannot be split onto the 2:4 kernels, or None."""
    if dtype not in KERNEL_DTYPES:
        return f"the split CSR kernels take float16/bfloat16, not {str(dtype).replace('torch.', '')}"
    return kernels_take(out_features, in_features, dtype)


@dataclass
class CsrSplitWeight(PackedWeight):
    """An unstructured weight split for the 2:4 kernels (see the module docstring): ``main``,
    the W24 part in a 2:4 kernel layout, and R in CSR: ``residual_values`` [nnz] and
    ``residual_index`` int32 (crow [N + 1], then col [nnz]). ``residual`` names the pass's
    kernel and mode (``symbol:mode``, :func:`residual_mode`), empty where R is."""

    main: KernelWeight
    residual_values: Tensor
    residual_index: Tensor
    residual: str = ""
    selection: str = ""       # why compile packed the weight split (kernel_packing.pack_unstructured)

    spec = CSR
    op = None   # sparsecc::linear_split, set once the op exists (below)

    @property
    def out_features(self) -> int:
        return self.main.out_features

    @property
    def in_features(self) -> int:
        return self.main.in_features

    @property
    def shape(self):  # type: ignore[override]
        return (self.out_features, self.in_features)

    @property
    def residual_entries(self) -> int:
        return self.residual_values.numel()

    @property
    def extra_args(self) -> tuple:
        return (self.main.kernels, self.residual)

    def tensors(self):
        return {"values": self.main.values, "metadata": self.main.metadata,
                "residual_values": self.residual_values, "residual_index": self.residual_index}

    def scalars(self):
        return {"out_features": self.out_features, "in_features": self.in_features}

    @classmethod
    def pack(cls, weight: Tensor, pack_main) -> "CsrSplitWeight":
        """The layout alone (any device): W24 packed by ``pack_main(W24, R is not empty)`` (a 2:4
        layout's packing), R in CSR (entries by output, inputs ascending); no residual kernel
        named yet."""
        main, rest = split_24(weight)
        residual = CSRWeight.from_dense(rest)                        # by row, columns ascending
        return cls(pack_main(main, residual.values.numel() > 0), residual.values,
                   torch.cat([residual.crow, residual.col]).contiguous())

    @classmethod
    def from_dense(cls, weight: Tensor, m: int | None, *, progress: bool = False) -> "CsrSplitWeight":
        """Split a [N, K] CUDA weight, pack W24 for the 2:4 kernels that take ``m`` rows
        (:func:`sparsecc.gpu.pack_24_for`) and R for the residual pass, and load the kernels."""
        if weight.device.type != "cuda":
            raise InputError("sparsecc's kernels run on the GPU: move the weight to CUDA first")
        reason = shape_supported(*weight.shape, weight.dtype)
        if reason:
            raise InputError(reason)
        packed = cls.pack(weight, lambda main, residual: pack_24_for(main, m, source=residual, progress=progress))
        if packed.residual_entries:
            spec = residual_spec(weight.dtype)
            runtime.ensure([spec], progress=progress)
            mode = residual_mode(packed.residual_entries, *weight.shape, packed.main)
            packed.residual = f"{spec.symbol}:{mode}"
        return packed

    def to_dense(self) -> Tensor:
        """Unpack exactly: W24 from its layout plus R (the two never share an element)."""
        n, k = self.shape
        rest = CSRWeight(self.residual_index[: n + 1], self.residual_index[n + 1:], self.residual_values, n, k)
        return self.main.to_dense() + rest.to_dense()


_LIB = torch.library.Library("sparsecc", "FRAGMENT")
_LIB.define("linear_split(Tensor x, Tensor values, Tensor metadata, Tensor residual_values, Tensor residual_index, "
            "int out_features, int in_features, Tensor? bias, str activation, bool x_transposed, "
            "bool transpose_out, str kernels, str residual) -> Tensor")

#: ``sparsecc::linear_split``: a split CSR site (:class:`CsrSplitWeight`'s tensors, scalars and extra_args)
linear_split = torch.ops.sparsecc.linear_split.default


def _linear_split_cuda(x: Tensor, values: Tensor, metadata: Tensor, residual_values: Tensor,
                       residual_index: Tensor, out_features: int, in_features: int, bias: Optional[Tensor],
                       activation: str, x_transposed: bool, transpose_out: bool, kernels: str,
                       residual: str) -> Tensor:
    """The 2:4 kernel (bias, and the activation where R is empty) and the residual pass: before
    a GEMM that adds y (modes :data:`WRITE`, :data:`WRITE_TRANSPOSED`), else after, on y in place."""
    if not residual:
        return linear_kernel(x, values, metadata, out_features, in_features, bias, activation, x_transposed,
                             transpose_out, kernels)
    code = ACTIVATION_CODES.get(activation)
    if code is None:
        Activation.parse(activation)            # raises the clear error
    symbol, mode = residual.rsplit(":", 1)
    one_dim = x.dim() == 1
    rows = (x.transpose(-1, -2) if x_transposed and not one_dim else x).reshape(-1, in_features)
    if not rows.is_contiguous() or rows.data_ptr() % 16:
        rows = rows.contiguous() if not rows.is_contiguous() else rows.clone()
    m, stream = rows.shape[0], torch.cuda.current_stream().cuda_stream

    def residual_pass(y: Tensor, pass_mode: int, pass_code: int) -> None:
        kernel = runtime.get(symbol)
        size = kernel.workspace_size(out_features, m, in_features, 1, pass_mode)
        workspace = torch.empty(size, dtype=torch.uint8, device=y.device) if size else None   # x^T
        kernel.gemm(residual_values.data_ptr(), residual_index.data_ptr(), rows.data_ptr(), 0, y.data_ptr(),
                    out_features, m, in_features, pass_code, stream, splits=pass_mode,
                    workspace=workspace.data_ptr() if workspace is not None else 0)

    if int(mode) in (WRITE, WRITE_TRANSPOSED):
        if rows.dtype != values.dtype or rows.device != values.device:
            raise InputError(f"sparsecc linear: input of {rows.dtype} on {rows.device}, the weight of {values.dtype} "
                             f"on {values.device}")
        y = torch.empty(m, out_features, dtype=rows.dtype, device=rows.device)
        if m:
            residual_pass(y, int(mode), ACTIVATION_CODES["none"])         # y = x R^T
        linear_add(rows, values, metadata, bias, activation, kernels, y)  # y = act(x W24^T + bias + y)
        y = y.view(*_output_shape(x, x_transposed, out_features, False))
    else:
        y = linear_kernel(x, values, metadata, out_features, in_features, bias, "none", x_transposed, False, kernels)
        if m:
            residual_pass(y, int(mode), code)
    if transpose_out and not one_dim:
        y = y.transpose(-1, -2).contiguous()
    return y


def _linear_split_elsewhere(x, *args):
    raise InputError("sparsecc::linear_split runs generated CUDA kernels: this module was compiled for a CUDA GPU "
                     f"and cannot run on {x.device.type}; compile it again for this device")


_LIB.impl("linear_split", _linear_split_cuda, "CUDA")
_LIB.impl("linear_split", _linear_split_elsewhere, "CPU")


@torch.library.register_fake("sparsecc::linear_split")
def _(x, values, metadata, residual_values, residual_index, out_features, in_features, bias, activation,
      x_transposed, transpose_out, kernels, residual):
    return x.new_empty(_output_shape(x, x_transposed, out_features, transpose_out))


CsrSplitWeight.op = linear_split
