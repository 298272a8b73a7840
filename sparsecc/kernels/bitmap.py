"""Unstructured sparse weights as bits and values, on the CSR kernels' pipelines
(templates/bitmap_sm90.cu.j2 and bitmap_wgmma_sm90.cu.j2: csr_sm90 and csr_wgmma_sm90 reading
this packing).

The tiled CSR packing (:mod:`sparsecc.kernels.csr`) stores a 16-bit value and a 16-bit slot per
non-zero: 4d bytes an element at density d, as many as dense at d = 0.5. The bitmap packing
stores a bit per element and the non-zeros' values only: 2d + 1/8 bytes an element (1.125 at
d = 0.5, 0.725 at 0.3, 0.325 at 0.1), and the kernels' helper warps rebuild each dense tile in
shared memory from the bits, where the CSR kernels' scatter each entry to its slot. Everything
else (tiles of 64 x 64, the multiplying warps, the K slices, the epilogue, the M dispatch) is the
CSR kernels'.

The layout, per tile of :data:`~sparsecc.codegen.spec.CSR_TILE_N` rows x :data:`TILE_K` columns
(tiles by row of tiles, then by column):

- bits: :data:`WORDS` 32-bit words; bit ``b`` of word ``w`` stands for the element the kernel
  keeps at slot ``b * WORDS + w`` of its swizzled shared-memory tile (:func:`~sparsecc.kernels.csr.slot`):
  the lanes of a warp, one word each, then write neighbouring slots;
- values: the tile's non-zeros in the order of its bits (word by word, bit by bit), the count
  padded to a multiple of 8 with zeros (16-byte copies);
- ``group_ptr``: the values before each of the tile's :data:`GROUPS` groups of 32 words (the
  words one helper warp scatters; a lane finds its first value from its group's offset and a
  warp scan of the popcounts), and the total last.

``values`` holds the values; ``metadata`` (int32) ``group_ptr`` padded to a multiple of 4 words,
then every tile's bits. Packing is torch ops on any device and round-trips exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from ..codegen.spec import CSR_TILE_N, Family
from ..errors import InputError
from ..ir.analysis import WeightStats
from ..ir.formats import INDEX_DTYPE
from ..ir.workload import Workload, element_size
from . import csr
from .base import Launch
from .csr import TILE_K, CsrTiled, TiledKernelWeight, capacity_for, metadata_header, slot

#: 32-bit words of bits per tile
WORDS = CSR_TILE_N * TILE_K // 32
#: value groups per tile: the words of one helper warp (32) each
GROUPS = WORDS // 32


@lru_cache(maxsize=1)
def bit_positions() -> torch.Tensor:
    """For each bit of a tile in the packing's order (word ``w``, bit ``b`` at index ``w * 32 + b``),
    the element it stands for, as ``row * TILE_K + column``: the one kept at slot ``b * WORDS + w``
    (on the CPU; made once)."""
    rows, columns = torch.meshgrid(torch.arange(CSR_TILE_N), torch.arange(TILE_K), indexing="ij")
    slot_of_element = slot(rows.reshape(-1), columns.reshape(-1))
    element_of_slot = torch.empty_like(slot_of_element)
    element_of_slot[slot_of_element] = torch.arange(slot_of_element.numel())
    words, bits = torch.meshgrid(torch.arange(WORDS), torch.arange(32), indexing="ij")
    return element_of_slot[(bits * WORDS + words).reshape(-1)]


def dispatch(dtype: torch.dtype, capacity: int) -> list[tuple[int, Launch]]:
    """The bitmap launch per M bucket for a weight whose fullest tile needs ``capacity`` values: the
    tiled CSR kernels' buckets and tiles of x's rows, bitmap_sm90 up to 16 rows, bitmap_wgmma_sm90
    beyond."""
    return csr.dispatch(dtype, capacity, bitmap=True)


@dataclass
class BitmapKernelWeight(TiledKernelWeight):
    """An unstructured sparse weight in the bitmap layout (see the module docstring)."""

    @property
    def group_ptr(self) -> torch.Tensor:
        return self.metadata[: self.tile_count * GROUPS + 1]

    @property
    def bits(self) -> torch.Tensor:
        """Every tile's words of bits, ``[tiles, WORDS]`` int32."""
        start = -(-(self.tile_count * GROUPS + 1) // 4) * 4
        return self.metadata[start:].view(self.tile_count, WORDS)

    @classmethod
    def pack(cls, weight: torch.Tensor) -> "BitmapKernelWeight":
        """The layout alone (any device, any dtype): exact for every weight whose out features are
        a multiple of the tile's rows."""
        n, k = weight.shape
        if n % CSR_TILE_N:
            raise InputError(f"the bitmap kernel layout needs N % {CSR_TILE_N} == 0 (this weight is {n}x{k})")
        k_tiles = -(-k // TILE_K)
        tiles = F.pad(weight.detach(), (0, k_tiles * TILE_K - k)).reshape(n // CSR_TILE_N, CSR_TILE_N, k_tiles, TILE_K)
        ordered = tiles.permute(0, 2, 1, 3).reshape(-1, CSR_TILE_N * TILE_K)[:, bit_positions().to(weight.device)]
        stored = ordered != 0
        weights = torch.ones(32, dtype=torch.int64, device=weight.device) << torch.arange(32, device=weight.device)
        words = (stored.view(-1, WORDS, 32).long() * weights).sum(-1)
        words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(INDEX_DTYPE)
        group_counts = stored.view(-1, GROUPS, WORDS // GROUPS * 32).sum(-1)          # [tiles, GROUPS]
        counts = group_counts.sum(1)
        padded = (counts + 7) // 8 * 8
        tile_ptr = padded.cumsum(0) - padded
        group_ptr = (tile_ptr[:, None] + group_counts.cumsum(1) - group_counts).reshape(-1)
        total = int(padded.sum())
        group_ptr = torch.cat([group_ptr, group_ptr.new_full((1,), total)])
        tile, position = stored.nonzero(as_tuple=True)                              # by tile, then by bit
        rank = torch.arange(tile.numel(), device=weight.device) - (counts.cumsum(0) - counts)[tile]
        values = ordered.new_zeros(total)
        values[tile_ptr[tile] + rank] = ordered[tile, position]
        fullest = int(padded.max()) if padded.numel() else 0
        return cls(values, torch.cat([metadata_header(group_ptr), words.reshape(-1)]), n, k,
                   capacity=capacity_for(fullest))

    def to_dense(self) -> torch.Tensor:
        """Unpack exactly (every value goes back to its element)."""
        n, k = self.out_features, self.in_features
        k_tiles = -(-k // TILE_K)
        words = self.bits.long() & 0xFFFFFFFF
        stored = ((words[:, :, None] >> torch.arange(32, device=words.device)) & 1).bool().view(self.tile_count, -1)
        tile, position = stored.nonzero(as_tuple=True)
        counts = stored.sum(1)
        tile_ptr = self.group_ptr[:-1].view(-1, GROUPS)[:, 0].long()
        rank = torch.arange(tile.numel(), device=words.device) - (counts.cumsum(0) - counts)[tile]
        ordered = self.values.new_zeros(self.tile_count, CSR_TILE_N * TILE_K)
        ordered[tile, position] = self.values[tile_ptr[tile] + rank]
        tiles = torch.empty_like(ordered)
        tiles[:, bit_positions().to(words.device)] = ordered
        dense = tiles.reshape(n // CSR_TILE_N, k_tiles, CSR_TILE_N, TILE_K).permute(0, 2, 1, 3)
        return dense.reshape(n, k_tiles * TILE_K)[:, :k].contiguous()

    @property
    def fullest_tile(self) -> int:
        """The most values (padded) any tile stores."""
        tile_ptr = self.group_ptr[::GROUPS].long()
        return int((tile_ptr[1:] - tile_ptr[:-1]).max()) if self.tile_count else 0


class BitmapTiled(CsrTiled):
    """Unstructured weights on the bitmap kernels: the tiled CSR family on the bitmap packing (see
    the module docstring)."""

    name = "bitmap"
    templates = (Family.BITMAP_SM90, Family.BITMAP_WGMMA_SM90)
    unit = "sparsecc's bitmap kernels (tensor cores)"
    impls = ("bitmap-kernel",)
    opt_in = True            # SPARSECC_OPT_IN=bitmap: priced like the tiled CSR kernel, not calibrated yet
    packing = BitmapKernelWeight
    bitmap = True
    kernel = "the bitmap kernel"

    def nbytes(self, stats: WeightStats, element: int) -> int:
        """The packing's bytes: the values (counts padded to 8), a bit per element, the group offsets."""
        n, k = stats.shape
        tiles = n // CSR_TILE_N * math.ceil(k / TILE_K)
        return round((stats.nnz + 3.5 * tiles) * element) + tiles * (WORDS + GROUPS) * 4 + 16

    def weight_bytes(self, w: Workload) -> float:
        """A value per stored element and a bit per element."""
        return w.density * w.n * w.k * element_size(w.dtype) + w.n * w.k / 8

    def priced_like(self, impl: str) -> str | None:
        """Until it has a calibration of its own, the tiled CSR kernel's prices it (same pipeline)."""
        return "csr-kernel" if impl == "bitmap-kernel" else None
