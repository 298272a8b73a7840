"""Unstructured sparse weights on the 2:4 kernels plus a residual pass: a split CSR weight.

A weight of density d keeps at most two non-zeros in almost every group of four along K:
with its non-zeros spread at random, a group holds three or four with probability about
4 d^3, which at d = 0.05 is one group in 2000. Such a weight is therefore split exactly as

    W = W24 + R,

``W24`` keeping the first two non-zeros (by position) of every group of four, ``R`` the
rest (at d = 0.05 about 0.01% of W's elements, at d = 0.1 0.1%, at d = 0.3 2.3%). ``W24``
runs on sparsecc's 2:4 kernels (sparse tensor cores: the CUTLASS GEMMs, or the small-batch
kernels, as a 2:4 site planned for the same batch), which add the bias; a second kernel
(templates/residual_sm90.cu.j2) adds ``x R^T`` to y in place and applies the activation.
Where R is empty the 2:4 kernel alone runs the site, epilogue included. At large batches a
residual with many entries reads x from a transposed copy that the pass makes first
(:data:`TRANSPOSED`): an entry then reads its inputs for eight rows of x in one 32-byte
sector instead of eight.

Both parts are exact, so the split is lossless: y differs from the unsplit product by the
rounding of y to the weight's dtype between the two kernels (fp32 sums in both).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..codegen.spec import RESIDUAL_STAGED_MIN_ROWS, Family, KernelSpec
from ..errors import InputError
from ..ir.analysis import WeightStats
from ..ir.epilogue import ACTIVATION_CODES, Activation
from ..ir.formats import CSR, NM_2_4, CSRWeight, FormatSpec, PackedWeight, group_along_k
from ..ir.workload import Workload, dtype_name, element_size
from ..runtime import loader
from ..runtime.kernel_op import ensure, linear_kernel
from ..runtime.torch_ops import output_shape
from .base import KERNEL_DTYPES, KernelFamily, KernelWeight, check_cuda_weight
from .base import shape_supported as kernels_take
from .sparse24_small import choose, pack_24

#: the residual pass's modes (its launch ``splits``): the kernel picks by the rows of x (gather
#: below 256, staged from 256 where K fits), or gather x from global memory per entry, or stage
#: the CTA's rows of x in shared memory first, or gather from a transposed copy of x it makes
#: first in its workspace (templates/residual_sm90.cu.j2)
BY_ROWS, GATHER, STAGED, TRANSPOSED = 0, 1, 2, 3
#: a weight whose residual has fewer entries per output feature than this always gathers: measured
#: on an H100 at M = 2048, on 11008x4096 staging x
#: cost more than it saved at density 0.01 (0.003 entries per output: 288.5 against 268.7 us) and
#: paid at 0.05 (0.5 per output: 304.7 against 332.5 us); at M = 16 and 64 gathering won everywhere
STAGED_MIN_ENTRIES = 0.25
#: mode BY_ROWS stages x from this many rows of x (the kernel's own rule), else gathers
STAGED_MIN_ROWS = RESIDUAL_STAGED_MIN_ROWS
#: at batches of at least TRANSPOSED_MIN_ROWS rows, a residual with at least
#: TRANSPOSED_MIN_ENTRIES entries per input feature and fewer than TRANSPOSED_MAX_ENTRIES per
#: output feature gathers from x^T. Measured on an H200 at M = 2048 (every mode forced): from 0.5
#: to 10 entries per input the copy
#: of x paid for itself (d = 0.05: 238.6 against 245.0 us staged on 4096x11008, 287.4 against 296.1
#: on 11008x4096; d = 0.1: 3-7% ahead of staging), at 0.003-0.011 per input (d = 0.01) it cost 8 to
#: 30 us more than gathering (the copy of x: about 8 us at K = 4096, 30 at K = 11008, against
#: about 7 ns saved per entry), which puts the crossover near 0.3; at 94-250 per output (d = 0.3)
#: its one thread per output feature ran 2x slower than staging. At M = 64 it lost to gathering
#: at every density up to 0.1 (the copy's launch outweighs the sectors saved).
TRANSPOSED_MIN_ENTRIES = 0.35
TRANSPOSED_MAX_ENTRIES = 16
TRANSPOSED_MIN_ROWS = 256
#: what the cost model charges per entry of R and row of x, by mode, in bytes at the dense
#: bandwidth: gathering reads a 32-byte sector of x per entry and row, the copy of x^T one per
#: eight rows; staging walks each output's entries one after another from shared memory, which
#: took the time of about 1.5 bytes per entry and row on an H100 at M = 2048, d = 0.3
#: (benchmarks/results/kernels_csr-*-2026-11-25: 11008x4096 1498 us, 4096x4096 558 us)
ENTRY_BYTES = {GATHER: 32.0, STAGED: 1.5, TRANSPOSED: 4.0}


def residual_mode(entries: int, out_features: int, in_features: int, m: int | None) -> int:
    """The residual pass's mode for R's ``entries`` at a batch of ``m`` rows (None: unknown,
    taken as large): :data:`TRANSPOSED` at :data:`TRANSPOSED_MIN_ROWS` rows and more, from
    :data:`TRANSPOSED_MIN_ENTRIES` per input feature below :data:`TRANSPOSED_MAX_ENTRIES` per
    output feature (K % 8 == 0), else :data:`BY_ROWS` from :data:`STAGED_MIN_ENTRIES` per output
    feature, else :data:`GATHER`."""
    if ((m is None or m >= TRANSPOSED_MIN_ROWS) and in_features % 8 == 0
            and TRANSPOSED_MIN_ENTRIES * in_features <= entries < TRANSPOSED_MAX_ENTRIES * out_features):
        return TRANSPOSED
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
    return KernelSpec(Family.RESIDUAL_SM90, dtype_name(dtype))


def shape_supported(out_features: int, in_features: int, dtype: torch.dtype) -> str | None:
    """Why a weight of this shape and dtype cannot be split onto the 2:4 kernels, or None."""
    if dtype not in KERNEL_DTYPES:
        return f"the split CSR kernels take float16/bfloat16, not {dtype_name(dtype)}"
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
    selection: str = ""       # why compile packed the weight split (registry.pack_unstructured)

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
        """The layout alone (any device): W24 packed by ``pack_main`` (a 2:4 layout's packing),
        R in CSR (entries by output, inputs ascending); no residual kernel named yet."""
        main, rest = split_24(weight)
        residual = CSRWeight.from_dense(rest)                        # by row, columns ascending
        return cls(pack_main(main), residual.values, torch.cat([residual.crow, residual.col]).contiguous())

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
    """The 2:4 kernel (bias, and the activation where R is empty), then the residual pass on y."""
    if not residual:
        return linear_kernel(x, values, metadata, out_features, in_features, bias, activation, x_transposed,
                             transpose_out, kernels)
    code = ACTIVATION_CODES.get(activation)
    if code is None:
        Activation.parse(activation)            # raises the clear error
    y = linear_kernel(x, values, metadata, out_features, in_features, bias, "none", x_transposed, False, kernels)
    one_dim = x.dim() == 1
    rows = (x.transpose(-1, -2) if x_transposed and not one_dim else x).reshape(-1, in_features)
    if not rows.is_contiguous() or rows.data_ptr() % 16:
        rows = rows.contiguous() if not rows.is_contiguous() else rows.clone()
    flat = y.view(-1, out_features)
    if flat.shape[0]:
        symbol, mode = residual.rsplit(":", 1)
        kernel, m = loader.get(symbol), flat.shape[0]
        size = kernel.workspace_size(out_features, m, in_features, 1, int(mode))
        workspace = torch.empty(size, dtype=torch.uint8, device=y.device) if size else None   # x^T (TRANSPOSED)
        kernel.gemm(residual_values.data_ptr(), residual_index.data_ptr(), rows.data_ptr(), 0, flat.data_ptr(),
                    out_features, m, in_features, code, torch.cuda.current_stream().cuda_stream, splits=int(mode),
                    workspace=workspace.data_ptr() if workspace is not None else 0)
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
    return x.new_empty(output_shape(x, x_transposed, out_features, transpose_out))


CsrSplitWeight.op = linear_split


class CsrSplit(KernelFamily):
    """Unstructured weights split onto the 2:4 kernels plus the residual pass (see the module
    docstring). Priced as the 2:4 site packed for the same batch plus the residual pass's bytes
    at the dense bandwidth (impl ``csr-residual``, priced like ``dense``)."""

    name = "csr-split"
    kind = "csr"
    templates = (Family.RESIDUAL_SM90,)
    unit = "sparsecc's 2:4 kernels plus a residual pass"
    impls = ("csr-residual",)

    def refuses(self, spec, shape, dtype):
        return f"it runs CSR, not {spec}" if spec.kind != "csr" else shape_supported(*shape, dtype)

    def pack(self, weight, spec, m, *, tune_range=None, progress=False):
        """Split a [N, K] CUDA weight, pack W24 for the 2:4 family that takes ``m`` rows
        (:func:`sparsecc.kernels.sparse24_small.pack_24`) and R for the residual pass."""
        check_cuda_weight(weight, self.refuses(spec, tuple(weight.shape), weight.dtype))
        packed = CsrSplitWeight.pack(weight, lambda main: pack_24(main, m, tune_range=tune_range,
                                                                  progress=progress))
        if packed.residual_entries:
            residual = residual_spec(weight.dtype)
            ensure([residual], progress=progress)
            packed.residual = f"{residual.symbol}:{residual_mode(packed.residual_entries, *weight.shape, m)}"
        return packed

    def kernel_specs(self, dtype, shape, spec, density, m):
        family = choose(dtype, shape, m)
        return [residual_spec(dtype)] + family.kernel_specs(dtype, shape, NM_2_4, 0.5, m)

    def workloads(self, stats: WeightStats, spec: FormatSpec, m: int, planned_m: int | None) -> list[Workload]:
        main = choose(stats.dtype, stats.shape, planned_m).workloads(stats, NM_2_4, m, planned_m)
        if not stats.beyond_24:
            return main
        n, k = stats.shape
        return main + [Workload("csr-residual", stats.dtype, m, n, k, stats.beyond_24 / stats.numel,
                                mode=residual_mode(stats.beyond_24, n, k, planned_m))]

    def work(self, w, sms):
        """The residual pass's bytes: y read and written, and per entry of R and row of x its
        mode's :data:`ENTRY_BYTES` (plus x read and written once more where it copies or stages x)."""
        e = element_size(w.dtype)
        entries = w.density * w.n * w.k
        mode = GATHER if w.mode is None else w.mode
        if mode == BY_ROWS:
            mode = STAGED if w.m >= STAGED_MIN_ROWS else GATHER
        nbytes = 2.0 * w.m * w.n * e + ENTRY_BYTES[mode] * entries * w.m + (2.0 * w.m * w.k * e if mode != GATHER else 0.0)
        return 0.0, nbytes

    def priced_like(self, impl):
        return "dense"
