"""Unstructured sparse weights on sparsecc's tensor-core kernels (templates/csr_sm90.cu.j2 for
up to 16 rows of x, templates/csr_wgmma_sm90.cu.j2 beyond).

The kernels load only the stored entries of W and multiply dense tiles rebuilt from them
in shared memory ("load as sparse, compute as dense"): at small batch, where time is the
weight's bytes, they read 4 bytes per non-zero instead of 2 per element. The packed layout
("tiled CSR") cuts W into tiles of :data:`~sparsecc.codegen.CSR_TILE_N` rows by
:data:`TILE_K` columns and stores each tile's non-zeros in row-major order:

- ``values``: the entries, tile after tile (by row of tiles, then by column), each tile's
  count padded to a multiple of 8 (16-byte loads) with copies of its last entry (writing an
  entry twice leaves the tile as it was, so the kernel needs no test for padding);
- ``metadata`` (int32): ``tile_ptr [R * T + 1]`` (entries before each tile, R = N / 64 rows
  of tiles, T = ceil(K / 64)), zero-padded to a multiple of 4 words, then each entry's slot
  as uint16, two per word: where the kernel's shared-memory copy of the dense tile keeps
  it (:func:`slot`, the kernel's swizzle, computed here once instead of per entry per call).

Packing is torch ops on any device and round-trips exactly; both kernels read the same
packing. A kernel is compiled for a tile capacity (stored entries per tile, padded): the smallest of
:data:`~sparsecc.codegen.CSR_CAPACITIES` that holds the weight's fullest tile, so sparse
weights get the deepest pipelines.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import math

from ..codegen.spec import CSR_CAPACITIES, CSR_SM90_CAPACITIES, CSR_TILE_N, CSR_WGMMA_TILE_M, Family, KernelSpec
from ..errors import InputError
from ..ir.analysis import WeightStats
from ..ir.formats import CSR, INDEX_DTYPE, FormatSpec
from ..ir.workload import Workload, dtype_name, element_size
from ..runtime.kernel_op import ensure
from .base import KERNEL_DTYPES, Buckets, KernelFamily, KernelWeight, Launch, check_cuda_weight

TILE_K = 64
#: the CSR kernels' M buckets
CSR_BUCKETS = Buckets((1, 16, 128, 2048), 8192)
#: rows of x per CTA for each M bucket of :data:`CSR_BUCKETS`: a 16-row tile of csr_sm90
#: (mma.sync) up to 16 rows (the memory-bound range, split over K), then csr_wgmma_sm90 with
#: one warpgroup of 64 rows, and two (128 rows) past 128 rows of x
DEFAULT_TILE_M = {1: 16, 16: 16, 128: 64, 2048: 128, 0: 128}
#: the kernel's kMaxSplits (K slices at most) and kMaxSliceTiles (tiles along K per slice at most)
MAX_SPLITS, MAX_SLICE_TILES = 16, 252


def slot(row: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """Where the kernels keep element (row, column) of a 64x64 tile in shared memory: rows of 64
    columns (128 bytes), each row's 16-byte chunks of 8 columns in the order chunk XOR (row mod
    8), the 128-byte swizzle that wgmma reads and ldmatrix reads without bank conflicts. A
    bijection on 0..4095."""
    chunk = column >> 3
    return row * 64 + ((chunk ^ (row & 7)) << 3) + (column & 7)


def coordinates(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each slot: the inverse of :func:`slot`."""
    row = slots >> 6
    return row, ((((slots >> 3) & 7) ^ (row & 7)) << 3) + (slots & 7)


def shape_supported(out_features: int, in_features: int, dtype: torch.dtype,
                    kernel: str = "the CSR kernel") -> str | None:
    """Why a weight of this shape and dtype cannot use the tiled kernels (named ``kernel`` in the
    reason), or None."""
    if dtype not in KERNEL_DTYPES:
        return f"{kernel} takes float16/bfloat16, not {dtype_name(dtype)}"
    if out_features % CSR_TILE_N or in_features % 16:
        return (f"{kernel} needs N % {CSR_TILE_N} == 0 and K % 16 == 0 "
                f"(this weight is {out_features}x{in_features})")
    return None


def expected_capacity(density: float) -> int:
    """The tile capacity a random weight of this density most likely needs: its fullest tile
    expected at the mean plus five standard deviations of a tile's non-zeros (and padding)."""
    entries = CSR_CAPACITIES[-1]
    fullest = density * entries + 5 * (entries * density * (1 - density)) ** 0.5 + 8
    return capacity_for(min(entries, int(fullest)))


def capacity_for(fullest_tile: int, capacities: tuple[int, ...] = CSR_CAPACITIES) -> int:
    """The smallest of ``capacities`` (the packing's, by default) that holds a tile of
    ``fullest_tile`` padded entries."""
    return next(c for c in capacities if c >= fullest_tile)


def kernel_spec(dtype: str, tile_m: int, capacity: int, bitmap: bool = False) -> KernelSpec:
    """The CSR kernel that runs ``tile_m`` rows of x per CTA on a packing of ``capacity``:
    csr_sm90 for 16 and 32 rows (built for the smallest of its capacities that holds it),
    csr_wgmma_sm90 for 64 and 128 (a consumer warpgroup per 64 rows); with ``bitmap`` their
    versions reading the bitmap packing (sparsecc.kernels.bitmap)."""
    if tile_m in CSR_WGMMA_TILE_M:
        family = Family.BITMAP_WGMMA_SM90 if bitmap else Family.CSR_WGMMA_SM90
        return KernelSpec(family, dtype, tile=(CSR_TILE_N, tile_m, capacity))
    family = Family.BITMAP_SM90 if bitmap else Family.CSR_SM90
    return KernelSpec(family, dtype, tile=(CSR_TILE_N, tile_m, capacity_for(capacity, CSR_SM90_CAPACITIES)))


def resident_ctas(spec: KernelSpec) -> int:
    """CTAs of ``spec`` an SM runs at once (the kernels' kCtasPerSm): two, one for the wgmma
    kernel's two warpgroups of 128 rows."""
    return 1 if spec.family.csr_wgmma and spec.tile[1] >= 128 else 2


def k_slices(out_features: int, m: int, in_features: int, spec: KernelSpec, sms: int) -> int:
    """The K slices the kernel splits ``m`` rows into (its ``splits_for``): none while its CTAs
    fill the SMs' resident slots; else, for x tiles of up to 64 rows, the count whose waves
    carry the least work per slice, and for 128-row tiles as many as fit one wave."""
    ctas = out_features // CSR_TILE_N * -(-m // spec.tile[1])
    k_tiles = -(-in_features // TILE_K)
    most = max(1, min(MAX_SPLITS, k_tiles // (2 * spec.csr_step_tiles)))
    fewest = -(-k_tiles // MAX_SLICE_TILES)
    chosen, best, resident = 1, 1.0, resident_ctas(spec) * sms   # CTAs the GPU runs at once
    if spec.tile[1] >= 128:
        chosen = max(1, min(most, resident // ctas))
    elif ctas < resident:
        for s in range(2, most + 1):
            waves_per_slice = -(-ctas * s // resident) / s
            if waves_per_slice < 0.99 * best:
                best, chosen = waves_per_slice, s
    return max(fewest, chosen)


def dispatch(dtype: torch.dtype, capacity: int, bitmap: bool = False) -> list[tuple[int, Launch]]:
    """The CSR launch per M bucket for a weight whose fullest tile needs ``capacity`` (``bitmap``:
    the kernels reading the bitmap packing)."""
    name = dtype_name(dtype)
    return [(bound, Launch(kernel_spec(name, DEFAULT_TILE_M[bound], capacity, bitmap))) for bound, _ in CSR_BUCKETS]


def tile_m_for(m: int) -> int:
    """Rows of x per CTA that :func:`dispatch` runs M rows with."""
    return DEFAULT_TILE_M[CSR_BUCKETS.bound_for(m)]


def metadata_header(tile_ptr: torch.Tensor) -> torch.Tensor:
    """The metadata's first part: ``tile_ptr`` as int32, zero-padded to a multiple of 4 words
    (what follows starts 16-byte aligned, at the kernels' slots_offset)."""
    header = torch.zeros(-(-tile_ptr.numel() // 4) * 4, dtype=INDEX_DTYPE, device=tile_ptr.device)
    header[: tile_ptr.numel()] = tile_ptr.to(INDEX_DTYPE)
    return header


@dataclass
class TiledKernelWeight(KernelWeight):
    """An unstructured sparse weight cut into tiles of :data:`~sparsecc.codegen.CSR_TILE_N` rows x
    :data:`TILE_K` columns that store only their non-zeros, for kernels built per tile capacity:
    the tiled CSR layout here, the bitmap layout (:mod:`sparsecc.kernels.bitmap`)."""

    capacity: int = CSR_CAPACITIES[-1]
    selection: str = ""       # why compile packed the weight for this kernel (registry.pack_unstructured)

    spec = CSR

    @property
    def tile_count(self) -> int:
        return self.out_features // CSR_TILE_N * -(-self.in_features // TILE_K)


@dataclass
class CsrKernelWeight(TiledKernelWeight):
    """An unstructured sparse weight in the tiled layout of the CSR kernel (see the module docstring)."""

    @property
    def tile_ptr(self) -> torch.Tensor:
        return self.metadata[: self.tile_count + 1]

    @property
    def slots(self) -> torch.Tensor:
        """The entries' slots in their tile (:func:`slot`), as int64 in 0..4095."""
        start = -(-(self.tile_count + 1) // 4) * 4
        return self.metadata[start:].view(torch.int16).long() & 0xFFFF

    @classmethod
    def pack(cls, weight: torch.Tensor) -> "CsrKernelWeight":
        """The layout alone (any device, any dtype): exact for every weight whose out features
        are a multiple of the tile's rows."""
        n, k = weight.shape
        if n % CSR_TILE_N:
            raise InputError(f"the CSR kernel layout needs N % {CSR_TILE_N} == 0 (this weight is {n}x{k})")
        k_tiles = -(-k // TILE_K)
        tiles = F.pad(weight.detach(), (0, k_tiles * TILE_K - k)).reshape(n // CSR_TILE_N, CSR_TILE_N, k_tiles, TILE_K)
        tiles = tiles.permute(0, 2, 1, 3).reshape(-1, CSR_TILE_N * TILE_K)
        nonzero = tiles != 0
        counts = nonzero.sum(1)
        padded = (counts + 7) // 8 * 8
        tile_ptr = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
        tile, position = nonzero.nonzero(as_tuple=True)            # by tile, then by position
        total = int(tile_ptr[-1])
        # every stored entry, padding included: the tile's (rank)th entry, or its last one
        owner = torch.repeat_interleave(torch.arange(counts.numel(), device=weight.device), padded, output_size=total)
        rank = torch.arange(total, device=weight.device) - tile_ptr[owner]
        source = (counts.cumsum(0) - counts)[owner] + torch.minimum(rank, counts[owner] - 1)
        values = tiles[tile[source], position[source]]
        slots = slot(position[source] // TILE_K, position[source] % TILE_K).to(torch.int32)
        pairs = torch.where(slots >= 1 << 15, slots - (1 << 16), slots).to(torch.int16).view(INDEX_DTYPE)
        header = metadata_header(tile_ptr)
        fullest = int(padded.max()) if padded.numel() else 0
        return cls(values, torch.cat([header, pairs]), n, k, capacity=capacity_for(fullest))

    def to_dense(self) -> torch.Tensor:
        """Unpack exactly (every value goes back to its position)."""
        n, k = self.out_features, self.in_features
        k_tiles = -(-k // TILE_K)
        ptr = self.tile_ptr.long()
        tile = torch.repeat_interleave(torch.arange(self.tile_count, device=ptr.device), ptr[1:] - ptr[:-1])
        row, column = coordinates(self.slots)
        tiles = self.values.new_zeros(self.tile_count, CSR_TILE_N * TILE_K)
        tiles[tile, row * TILE_K + column] = self.values               # padding repeats an entry: same value
        dense = tiles.reshape(n // CSR_TILE_N, k_tiles, CSR_TILE_N, TILE_K).permute(0, 2, 1, 3)
        return dense.reshape(n, k_tiles * TILE_K)[:, :k].contiguous()

    @property
    def fullest_tile(self) -> int:
        """The most entries (padded) any tile stores."""
        ptr = self.tile_ptr.long()
        return int((ptr[1:] - ptr[:-1]).max()) if self.tile_count else 0


class CsrTiled(KernelFamily):
    """Unstructured weights on the tiled CSR kernels (see the module docstring). The bitmap family
    (:mod:`sparsecc.kernels.bitmap`) is this one on another packing: ``packing`` (the weight class),
    ``bitmap`` (the kernels that read it), ``kernel`` (how a refusal names them) and the bytes
    a non-zero costs (:meth:`weight_bytes`, :meth:`nbytes`)."""

    name = "csr-tiled"
    kind = "csr"
    templates = (Family.CSR_SM90, Family.CSR_WGMMA_SM90)
    unit = "sparsecc's tiled CSR kernels (tensor cores)"
    impls = ("csr-kernel",)
    packing: type[TiledKernelWeight] = CsrKernelWeight
    bitmap = False
    kernel = "the CSR kernel"

    def refuses(self, spec, shape, dtype):
        return f"it runs CSR, not {spec}" if spec.kind != "csr" else shape_supported(*shape, dtype, self.kernel)

    def pack(self, weight, spec, m, *, tune_range=None, progress=False):
        check_cuda_weight(weight, self.refuses(spec, tuple(weight.shape), weight.dtype))
        packed = self.packing.pack(weight)
        table = dispatch(weight.dtype, packed.capacity, self.bitmap)
        ensure([launch.spec for _, launch in table], progress=progress)
        return packed.running(table)

    def kernel_specs(self, dtype, shape, spec, density, m):
        """The kernels of every tile capacity a weight of this density may need: the fullest
        tile is not known until the weight is packed (the expected one and above)."""
        expected = expected_capacity(density)
        return list(dict.fromkeys(launch.spec for capacity in CSR_CAPACITIES if capacity >= expected
                                  for _, launch in dispatch(dtype, capacity, self.bitmap)))

    def nbytes(self, stats: WeightStats, element: int) -> int:
        """The packing's bytes: 16-bit slots, counts padded to 8, the tile offsets."""
        n, k = stats.shape
        tiles = n // CSR_TILE_N * math.ceil(k / TILE_K)
        return round((stats.nnz + 3.5 * tiles) * (element + 2)) + (tiles + 4) * 4

    def workloads(self, stats: WeightStats, spec: FormatSpec, m: int, planned_m: int | None) -> list[Workload]:
        n, k = stats.shape
        return [Workload(self.impls[0], stats.dtype, m, n, k, round(stats.density, 6), tile=(CSR_TILE_N, tile_m_for(m)))]

    def weight_bytes(self, w: Workload) -> float:
        """The weight's bytes a call reads: a value and a 16-bit slot per stored entry."""
        return w.density * w.n * w.k * (element_size(w.dtype) + 2)

    def work(self, w, sms):
        """Every tile multiplied densely (x's rows padded to the tile, K to 64), the weight's bytes
        (:meth:`weight_bytes`), x and y once."""
        e = element_size(w.dtype)
        tile_m = (w.tile or (CSR_TILE_N, 16))[1]
        rows = math.ceil(w.m / tile_m) * tile_m
        act = (w.m * w.k + w.m * w.n) * e
        return 2.0 * rows * w.n * math.ceil(w.k / TILE_K) * TILE_K, self.weight_bytes(w) + act

    def steps(self, w, sms):
        """The K steps of one CTA (its slice of K over the tiles a stage holds) times the CTAs
        each resident slot runs."""
        tile_m = (w.tile or (CSR_TILE_N, 16))[1]
        spec = kernel_spec("float16", tile_m, expected_capacity(w.density), self.bitmap)
        ctas = math.ceil(w.n / CSR_TILE_N) * math.ceil(w.m / tile_m)
        k_tiles = math.ceil(w.k / TILE_K)
        splits = k_slices(math.ceil(w.n / CSR_TILE_N) * CSR_TILE_N, w.m, w.k, spec, sms)
        per_cta = math.ceil(k_tiles / splits / spec.csr_step_tiles)
        return per_cta * max(1.0, ctas * splits / (sms * resident_ctas(spec)))
