"""Block-sparse (BSR) weights on sparsecc's tensor-core kernels (templates/bsr_sm90.cu.j2).

The kernel computes one block row of W against a tile of x's rows per CTA, looping over the
stored blocks only, so the packed layout keeps each block row's stored columns together:

- ``values``: block row after block row, each ``[h, blocks_in_row * w]`` row-major (the
  row's stored blocks side by side, in increasing block column);
- ``metadata`` (int32): ``row_ptr [R + 1]`` (stored blocks before each block row),
  ``order [R]`` (block rows by decreasing length: the kernel starts the longest first, a
  greedy balance across SMs), ``col [blocks]`` (the block column of each stored block).

Packing is torch ops on any device and round-trips exactly; :meth:`BsrKernelWeight.from_dense`
also loads the kernels of the site's dispatch table (one tiling per batch-size bucket).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import runtime
from .codegen import BSR_BLOCK_SIDES, Family, KernelSpec
from .errors import InputError
from .formats import INDEX_DTYPE, BSRWeight, FormatSpec
from .gpu import KERNEL_DTYPES, M_BUCKETS, KernelWeight, Launch, dispatch_string, nonfinite_flags

#: rows of x per CTA for each M bucket of :data:`sparsecc.gpu.M_BUCKETS` (bound -> tile M):
#: a 16-row tile for decode-sized batches, 128 rows once there are enough rows to share a
#: block's loads (tuned by benchmarks/kernels.py --bsr)
DEFAULT_TILE_M = {1: 16, 16: 16, 128: 64, 2048: 128, 0: 128}


def block_supported(block: tuple[int, int], dtype: torch.dtype) -> str | None:
    """Why a BSR weight with this block and dtype cannot use the kernels, or None."""
    if dtype not in KERNEL_DTYPES:
        return f"the BSR kernels take float16/bfloat16, not {str(dtype).replace('torch.', '')}"
    if block[0] not in BSR_BLOCK_SIDES or block[1] not in BSR_BLOCK_SIDES:
        return f"the BSR kernels take blocks with sides in {BSR_BLOCK_SIDES}, not {block[0]}x{block[1]}"
    return None


def dispatch(dtype: torch.dtype, block: tuple[int, int]) -> list[tuple[int, Launch]]:
    """The BSR launch per M bucket for a weight with this block."""
    name = str(dtype).replace("torch.", "")
    return [(bound, Launch(KernelSpec(Family.BSR_SM90, name, tile=(*block, DEFAULT_TILE_M[bound]))))
            for bound, _ in M_BUCKETS]


def tile_m_for(m: int) -> int:
    """Rows of x per CTA that :func:`dispatch` runs M rows with."""
    return next(DEFAULT_TILE_M[bound] for bound, _ in M_BUCKETS if bound == 0 or m <= bound)


@dataclass
class BsrKernelWeight(KernelWeight):
    """A block-sparse weight in the layout of the BSR kernels (see the module docstring)."""

    block: tuple[int, int] = (0, 0)

    @property
    def spec(self) -> FormatSpec:  # type: ignore[override]
        return FormatSpec("bsr", block=tuple(self.block))

    @property
    def block_rows(self) -> int:
        return self.out_features // self.block[0]

    @property
    def row_ptr(self) -> torch.Tensor:
        return self.metadata[: self.block_rows + 1]

    @property
    def order(self) -> torch.Tensor:
        return self.metadata[self.block_rows + 1: 2 * self.block_rows + 1]

    @property
    def col(self) -> torch.Tensor:
        return self.metadata[2 * self.block_rows + 1:]

    @classmethod
    def pack(cls, weight: torch.Tensor, block: tuple[int, int]) -> "BsrKernelWeight":
        """The layout alone (any device, any dtype): exact for every weight whose shape the
        block divides; a block is stored if any of its entries is non-zero."""
        h, w = block
        portable = BSRWeight.from_dense(weight, block)       # crow, col, values [blocks, h, w] in row order
        row_ptr = portable.crow.long()
        lengths = row_ptr[1:] - row_ptr[:-1]
        block_row = torch.repeat_interleave(torch.arange(lengths.numel(), device=row_ptr.device), lengths)
        destination = _value_positions(row_ptr, lengths, block_row, h, w)
        values = portable.values.new_empty(portable.values.numel())
        values[destination.reshape(-1)] = portable.values.reshape(-1)
        order = torch.sort(lengths, descending=True, stable=True).indices
        metadata = torch.cat([row_ptr, order, portable.col.long()]).to(INDEX_DTYPE).contiguous()
        n, k = portable.shape
        return cls(values, metadata, n, k, block=(h, w))

    @classmethod
    def from_dense(cls, weight: torch.Tensor, block: tuple[int, int], *, progress: bool = False) -> "BsrKernelWeight":
        """Pack a [N, K] CUDA weight and load the kernels of its dispatch table."""
        cls._check(weight)
        reason = block_supported(tuple(block), weight.dtype)
        if reason:
            raise InputError(reason)
        packed = cls.pack(weight, tuple(block))
        table = dispatch(weight.dtype, tuple(block))
        runtime.ensure([launch.spec for _, launch in table], progress=progress)
        packed.kernels = dispatch_string(table, nonfinite_flags())
        return packed

    def to_dense(self) -> torch.Tensor:
        """Unpack exactly (every value goes back to its position)."""
        h, w = self.block
        row_ptr = self.row_ptr.long()
        lengths = row_ptr[1:] - row_ptr[:-1]
        block_row = torch.repeat_interleave(torch.arange(self.block_rows, device=row_ptr.device), lengths)
        source = _value_positions(row_ptr, lengths, block_row, h, w)
        dense = self.values.new_zeros(self.block_rows, self.in_features // w, h, w)
        dense[block_row, self.col.long()] = self.values[source.reshape(-1)].reshape(-1, h, w)
        return dense.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)


def _value_positions(row_ptr: torch.Tensor, lengths: torch.Tensor, block_row: torch.Tensor, h: int, w: int):
    """[blocks, h, w]: where each element of each stored block (in row-major block order)
    sits in ``values``: block j of row r, element (i, l) at
    ``row_ptr[r] * h * w + i * lengths[r] * w + j * w + l``."""
    first = row_ptr[:-1][block_row]
    within = torch.arange(block_row.numel(), device=row_ptr.device) - first
    base = first * h * w + within * w
    pitch = lengths[block_row] * w
    i = torch.arange(h, device=row_ptr.device)
    lane = torch.arange(w, device=row_ptr.device)
    return base[:, None, None] + i[None, :, None] * pitch[:, None, None] + lane[None, None, :]
