"""Block-sparse (BSR) weights on sparsecc's tensor-core kernels (templates/bsr_sm90*.cu.j2).

The kernels loop over the stored blocks only: the wgmma kernel one block row of W against a
tile of x's rows per CTA, the pairs kernel two block rows of 64 (the union of their block
columns, each x chunk loaded once for both) against 256 rows of x, the small-batch mma kernel
16 weight rows per warp on tensor cores for up to 16 rows of x. The packed layout is the
portable BSR one with the block rows ordered for balance:

- ``values``: ``[blocks, h, w]``, each stored block row-major, block row after block row and
  by increasing block column within a row (the wgmma kernels load each block with one TMA
  box of a ``[blocks * h, w]`` view);
- ``metadata`` (int32): ``row_ptr [R + 1]`` (stored blocks before each block row),
  ``order [R]`` (block rows by decreasing length: the kernels start the longest first, a
  greedy balance across SMs), ``col [blocks]`` (the block column of each stored block),
  then the site's non-finite guard (:mod:`sparsecc.kernels.nonfinite_guard`), and for blocks of 64
  rows the pair section of :func:`pair_section` (the pairs kernel's launch carries where it
  starts, :attr:`BsrKernelWeight.pairs_at`).

A block column that no block row stores gets a block of zeros (``cover_columns``): the
product's sums then meet every input, so the NaN/Inf pass reads no part of x unless a sum was
not finite.

Packing is torch ops on any device and round-trips exactly; :meth:`Bsr.pack` also loads the
kernels of the site's dispatch table (one kernel per batch-size bucket).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..codegen.spec import BSR_BLOCK_SIDES, GUARD_HEADER_WORDS, Family, KernelSpec
from ..ir.analysis import WeightStats
from ..ir.formats import INDEX_DTYPE, BSRWeight, FormatSpec
from ..ir.workload import Workload, dtype_name, element_size
from ..runtime.kernel_op import ensure
from .base import (KERNEL_DTYPES, Buckets, KernelFamily, KernelWeight, Launch, check_cuda_weight,
                   finish_packing, nonfinite_flags)
from .nonfinite_guard import cover_block_columns, guard_words

#: a BSR site's M buckets, with a bound at 512 below which the pairs kernel does not pay
BSR_BUCKETS = Buckets((1, 16, 128, 512, 2048), 8192)

#: the kernel for each M bucket of :data:`BSR_BUCKETS` (bound -> family, rows of x
#: per CTA): the small-batch tensor-core kernel (mma.sync, memory-bound) up to 16 rows, one
#: row included, the wgmma kernel above, 64 rows per CTA up to 128 and 128 rows beyond
DEFAULT_KERNEL = {1: (Family.BSR_MMA_SM90, 16), 16: (Family.BSR_MMA_SM90, 16), 128: (Family.BSR_SM90_WGMMA, 64),
                  512: (Family.BSR_SM90_WGMMA, 128), 2048: (Family.BSR_SM90_WGMMA, 128),
                  0: (Family.BSR_SM90_WGMMA, 128)}

#: where the pairs kernel (templates/bsr_sm90_pairs.cu.j2, 256 rows of x per CTA) runs instead:
#: the buckets above 512 rows, for blocks of 64 rows whose block rows average at least
#: PAIRS_MIN_CHUNKS pipeline chunks, on weights of at least PAIRS_MIN_BLOCK_ROWS block rows.
#: Same process on an H100 (fp16, 64x64 blocks): on 4096x4096,
#: 11008x4096 and 4096x11008 at M = 1024-8192 and density 0.5 1.20-1.57x of cuBLAS + ReLU where
#: the one-row kernel took 0.68-1.09x, at 0.25 1.83-2.53x against 1.33-2.14x; at M = 256-512,
#: at about 3 chunks a row (density 0.05 at K = 4096) and on 768 or 1024 outputs (6 or 8 pairs:
#: too few CTAs) the one-row kernel was as fast or faster (4096x11008, M = 256, d = 0.05: 5.85x
#: against 3.83x; 1024x4096, M = 2048, d = 0.1: 14.2 against 16.4 us)
PAIRS_BUCKETS = (2048, 0)
PAIRS_MIN_CHUNKS = 4.0
PAIRS_MIN_BLOCK_ROWS = 64
PAIRS_TILE_M = 256


def block_supported(block: tuple[int, int], dtype: torch.dtype) -> str | None:
    """Why a BSR weight with this block and dtype cannot use the kernels, or None."""
    if dtype not in KERNEL_DTYPES:
        return f"the BSR kernels take float16/bfloat16, not {dtype_name(dtype)}"
    if block[0] not in BSR_BLOCK_SIDES or block[1] not in BSR_BLOCK_SIDES:
        return f"the BSR kernels take blocks with sides in {BSR_BLOCK_SIDES}, not {block[0]}x{block[1]}"
    return None


#: block rows of at most this many pipeline chunks (64 columns each) on average are short: the
#: wgmma kernel's CTAs take two tiles of x each there (the launch's ``splits``), the loads of
#: the second running while the first's output is stored. Same-process A/B on an H100 (fp16,
#: 64x64 blocks): 4-17% faster at 1-3 chunks per row (3072x768 and 768x768 at
#: density 0.1-0.25), 6-15% slower at 5-6 (768x3072 and 4096x4096 at 0.1, 3072x768 at 0.5),
#: where the stage it costs is missed
SHORT_ROW_CHUNKS = 3.0


def dispatch(dtype: torch.dtype, block: tuple[int, int], chunks_per_row: float | None = None,
             longest_row: int | None = None, block_rows: int = 0, pairs_at: int = 0) -> list[tuple[int, Launch]]:
    """The BSR launch per M bucket for a weight with this block; ``chunks_per_row``: the packed
    weight's pipeline chunks per block row on average (None: not known, one tile per CTA and
    no pairs kernel); ``longest_row``: the stored blocks of its longest block row (None: not
    known); ``block_rows``: its block rows (0: not known, no pairs kernel); ``pairs_at``: where
    its metadata's pair section starts (the pairs kernel's splits)."""
    name = dtype_name(dtype)
    table = []
    for bound, _ in BSR_BUCKETS:
        family, tile_m = kernel_for_bucket(bound, block, chunks_per_row, block_rows)
        spec = KernelSpec(family, name, tile=(*block, tile_m))
        splits = pairs_at if family is Family.BSR_SM90_PAIRS else launch_splits(spec, chunks_per_row, longest_row)
        table.append((bound, Launch(spec, splits=splits)))
    return table


def kernel_specs(dtype: torch.dtype, block: tuple[int, int]) -> list[KernelSpec]:
    """Every kernel :func:`dispatch` may pick for a weight with this block, whatever its rows."""
    tables = [dispatch(dtype, block, None), dispatch(dtype, block, PAIRS_MIN_CHUNKS, block_rows=PAIRS_MIN_BLOCK_ROWS)]
    return list(dict.fromkeys(launch.spec for table in tables for _, launch in table))


def launch_splits(spec: KernelSpec, chunks_per_row: float | None, longest_row: int | None = None) -> int:
    """The launch's ``splits`` for a weight with this many pipeline chunks per block row and this
    longest block row: for the wgmma kernel the tiles of x each CTA takes (two for short rows
    below 256 rows of x); for the small-batch mma kernel the longest row's stored blocks, from
    which it picks its blocks per lane in flight (templates/bsr_mma_sm90.cu.j2); else 1."""
    if spec.family is Family.BSR_MMA_SM90:
        return max(1, longest_row or 1)
    short = chunks_per_row is not None and chunks_per_row <= SHORT_ROW_CHUNKS
    return 2 if short and spec.family is Family.BSR_SM90_WGMMA and spec.tile[2] < 256 else 1


def kernel_for_bucket(bound: int, block: tuple[int, int], chunks_per_row: float | None,
                      block_rows: int = 0) -> tuple[Family, int]:
    """The family and rows of x per CTA of the M bucket ``bound`` for a weight with this block,
    pipeline chunks per block row (None: not known) and block rows (0: not known)."""
    pairs = (block[0] == 64 and bound in PAIRS_BUCKETS and chunks_per_row is not None
             and chunks_per_row >= PAIRS_MIN_CHUNKS and block_rows >= PAIRS_MIN_BLOCK_ROWS)
    return (Family.BSR_SM90_PAIRS, PAIRS_TILE_M) if pairs else DEFAULT_KERNEL[bound]


def kernel_for_rows(m: int, block: tuple[int, int] = (0, 0), chunks_per_row: float | None = None,
                    block_rows: int = 0) -> tuple[Family, int]:
    """The family and rows of x per CTA that :func:`dispatch` runs M rows with."""
    return kernel_for_bucket(BSR_BUCKETS.bound_for(m), block, chunks_per_row, block_rows)


def rows_below_dense(lo: int, hi: int) -> int | None:
    """The most rows a block-sparse site planned over ``lo..hi`` rows runs on the BSR kernels where
    it keeps the model's dense weight for larger batches (:mod:`sparsecc.kernels.by_rows`: BSR
    timed faster than dense at ``lo``, slower at ``hi``): the rows of the buckets that run ``lo``'s
    kernel (one row to 16 on the small-batch tensor-core kernel); None where they reach ``hi``."""
    bound = BSR_BUCKETS.bound_for(lo)
    if bound == 0:
        return None
    for later in BSR_BUCKETS.bounds[BSR_BUCKETS.bounds.index(bound) + 1:]:
        if DEFAULT_KERNEL[later] != DEFAULT_KERNEL[bound] or later in PAIRS_BUCKETS:
            break
        bound = later
    return bound if bound < hi else None


def chunks_per_block(block: tuple[int, int]) -> int:
    """The wgmma kernels' pipeline chunks (64 columns, or the block's width if narrower) per block."""
    return max(1, block[1] // 64)


def chunks_per_row_of(block: tuple[int, int], in_features: int, block_density: float) -> float:
    """The pipeline chunks per block row of a weight with this block, K and share of stored
    blocks, on average (the cost model's estimate of :attr:`BsrKernelWeight.chunks_per_row`)."""
    return block_density * (in_features // block[1]) * chunks_per_block(block)


def pair_section(row_ptr: torch.Tensor, col: torch.Tensor, block_columns: int) -> torch.Tensor:
    """The pairs kernel's metadata (int32, on ``col``'s device): pair p is block rows 2p and
    2p + 1 (the last alone for an odd count); ``pair_ptr [P + 1]`` (union steps before each
    pair), ``order [P]`` (pairs by decreasing steps), then per step of each pair, by increasing
    block column, ``(block column, block of row 2p or -1, block of row 2p + 1 or -1)`` (a block
    is its index in ``values``)."""
    block_rows = row_ptr.numel() - 1
    device = col.device
    lengths = (row_ptr[1:] - row_ptr[:-1]).long()
    rows = torch.repeat_interleave(torch.arange(block_rows, device=device), lengths)
    keys, step_of = torch.unique((rows // 2) * block_columns + col.long(), sorted=True, return_inverse=True)
    steps = torch.full((keys.numel(), 3), -1, dtype=torch.long, device=device)
    steps[:, 0] = keys % block_columns
    steps[step_of, 1 + rows % 2] = torch.arange(col.numel(), device=device)
    per_pair = torch.bincount(keys // block_columns, minlength=(block_rows + 1) // 2)
    pair_ptr = torch.cat([per_pair.new_zeros(1), per_pair.cumsum(0)])
    order = torch.sort(per_pair, descending=True, stable=True).indices
    return torch.cat([pair_ptr, order, steps.flatten()]).to(INDEX_DTYPE)


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
    def chunks_per_row(self) -> float:
        """The wgmma kernels' pipeline chunks (:func:`chunks_per_block`) per block row, on average
        over the block rows."""
        return self.values.shape[0] * chunks_per_block(tuple(self.block)) / max(1, self.block_rows)

    @property
    def longest_row(self) -> int:
        """The stored blocks of the longest block row (a host synchronisation)."""
        lengths = self.row_ptr[1:] - self.row_ptr[:-1]
        return int(lengths.max()) if lengths.numel() else 0

    def launches(self) -> list[tuple[int, Launch]]:
        """:func:`dispatch` for this weight (its dtype, block and row lengths)."""
        return dispatch(self.values.dtype, tuple(self.block), self.chunks_per_row, self.longest_row, self.block_rows,
                        self.pairs_at)

    @property
    def row_ptr(self) -> torch.Tensor:
        return self.metadata[: self.block_rows + 1]

    @property
    def order(self) -> torch.Tensor:
        return self.metadata[self.block_rows + 1: 2 * self.block_rows + 1]

    @property
    def col(self) -> torch.Tensor:
        start = 2 * self.block_rows + 1
        return self.metadata[start: start + self.values.shape[0]]

    @property
    def guard(self) -> torch.Tensor:
        return self.metadata[self._guard_start: self.pairs_at or None]

    @property
    def _guard_start(self) -> int:
        return 2 * self.block_rows + 1 + self.values.shape[0]

    @property
    def pairs_at(self) -> int:
        """Where the metadata's pair section starts (0: none, blocks not 64 rows high); a host
        synchronisation (the guard's length is on the device)."""
        if self.block[0] != 64:
            return 0
        start = self._guard_start + GUARD_HEADER_WORDS
        return start + int(self.metadata[start - 1])

    @classmethod
    def pack(cls, weight: torch.Tensor, block: tuple[int, int], *, cover_columns: bool = True) -> "BsrKernelWeight":
        """The layout alone (any device, any dtype): exact for every weight whose shape the
        block divides; a block is stored if any of its entries is non-zero, or (cover_columns)
        if it is the block of zeros that covers an empty block column."""
        portable = BSRWeight.from_dense(weight, block, stored=cover_block_columns if cover_columns else None)
        lengths = portable.crow[1:] - portable.crow[:-1]
        order = torch.sort(lengths, descending=True, stable=True).indices
        unmet = torch.ones(portable.in_features // block[1], dtype=torch.bool, device=portable.col.device)
        unmet[portable.col.long()] = False
        guard = guard_words(unmet.repeat_interleave(block[1]))
        pairs = [pair_section(portable.crow, portable.col, portable.in_features // block[1])] if block[0] == 64 else []
        metadata = torch.cat([portable.crow, order.to(INDEX_DTYPE), portable.col, guard, *pairs])
        n, k = portable.shape
        return cls(portable.values, metadata, n, k, block=tuple(block))

    def to_dense(self) -> torch.Tensor:
        """Unpack exactly (every value goes back to its position)."""
        return BSRWeight(self.row_ptr, self.col, self.values.reshape(-1, *self.block),
                         self.out_features, self.in_features).to_dense()


#: CTAs resident per SM of the wgmma BSR kernel, as built: about four (its kCtasPerSm: three or
#: two for the largest tiles)
WGMMA_RESIDENT_CTAS = 4
#: the small-batch mma kernel (templates/bsr_mma_sm90.cu.j2): its warps resident per SM with one
#: block per lane in flight (64 registers a thread: four CTAs of 8 warps) and with two (about
#: 120: two CTAs), and its kMaxSplit (warps sharing a long block row at most)
MMA_WARPS_PER_SM, MMA_WARPS_PER_SM_TWO_BLOCKS, MMA_MAX_SPLIT = 32, 16, 8


def _split(slices: float, max_split: int, slots: float) -> int:
    """The small-batch kernel's split of a block row: doubled while the warps fit one wave."""
    split = 1
    while split < max_split and slices * split * 2 <= slots:
        split *= 2
    return split


class Bsr(KernelFamily):
    """Block-sparse weights (see the module docstring): one packing, the kernel per M bucket."""

    name = "bsr"
    kind = "bsr"
    templates = (Family.BSR_SM90_WGMMA, Family.BSR_SM90_PAIRS, Family.BSR_MMA_SM90)
    unit = "sparsecc's BSR kernels (tensor cores)"
    impls = ("bsr-kernel", "bsr-kernel-mma")

    def refuses(self, spec, shape, dtype):
        if spec.kind != "bsr" or spec.block is None:
            return f"the BSR kernels run a block format with its block size, not {spec}"
        reason = block_supported(spec.block, dtype)
        if reason is None and (shape[0] % spec.block[0] or shape[1] % spec.block[1]):
            reason = f"a {shape[0]}x{shape[1]} weight does not divide into {spec.block[0]}x{spec.block[1]} blocks"
        return reason

    def pack(self, weight, spec, m, *, tune_range=None, progress=False):
        check_cuda_weight(weight, self.refuses(spec, tuple(weight.shape), weight.dtype))
        packed = BsrKernelWeight.pack(weight, tuple(spec.block))
        finish_packing(weight.device)   # the small-batch mma kernel reads it before it waits
        table = packed.launches()
        ensure([launch.spec for _, launch in table], progress=progress)
        return packed.running(table, nonfinite_flags())

    def kernel_specs(self, dtype, shape, spec, density, m):
        return kernel_specs(dtype, spec.block)

    def workloads(self, stats: WeightStats, spec: FormatSpec, m: int, planned_m: int | None) -> list[Workload]:
        """The kernel the dispatch runs M rows with, for a weight of this block density."""
        n, k = stats.shape
        density = stats.block_density[spec.block]
        chunks = chunks_per_row_of(spec.block, k, density)
        family, tile_m = kernel_for_rows(m, spec.block, chunks, n // spec.block[0])
        impl = "bsr-kernel-mma" if family is Family.BSR_MMA_SM90 else "bsr-kernel"
        return [Workload(impl, stats.dtype, m, n, k, round(stats.density, 6), block=spec.block,
                         block_density=round(density, 6), tile=(spec.block[0], tile_m))]

    def work(self, w, sms):
        e = element_size(w.dtype)
        h, bw = w.block or (32, 32)
        if w.impl == "bsr-kernel-mma":
            # the stored blocks and their block columns read once (x's matching inputs come from
            # L1/L2), y written once; fp32 sums on mma.sync
            stored = w.stored_density * w.n * w.k
            return 2.0 * w.m * stored, stored * e + stored / (h * bw) * 4 + w.m * w.k * e + w.m * w.n * e
        # stored blocks only, x's rows padded to the tile. Loads bound the kernel (TMA): every
        # block row gathers its columns of x again, and every tile of x's rows reads the stored
        # blocks again. A block column no block row stores (each with probability
        # (1 - density) ** block rows, blocks placed at random) gets a block of zeros
        tile_m = (w.tile or (h, 128))[1]
        density = w.stored_density
        stored = density * w.n * w.k + (1.0 - density) ** math.ceil(w.n / h) * w.k * h
        tiles = math.ceil(w.m / tile_m)
        gathered = w.m * stored / h * e + tiles * stored * e
        # an MMA narrower than 64 outputs (the block's rows) issues as slowly as a 64-wide one
        narrow = max(1.0, 64 / h)
        # one CTA per block row and tile of x: with fewer CTAs than SMs, the idle SMs' share of
        # the bandwidth is lost (counted as more bytes)
        idle = max(1.0, sms / (math.ceil(w.n / h) * tiles))
        return 2.0 * tiles * tile_m * stored * narrow, (gathered + w.m * w.n * e) * idle

    def steps(self, w, sms):
        """The wgmma kernel loads one block (or 64 columns) per step, one CTA per block row and
        tile of x; the mma kernel's rounds of loads one after another on the busiest warp slot:
        a warp's share of a block row's blocks over its loads in flight per round (64 / w, or
        128 / w where that saves two rounds or more), times the waves of warps, long block rows
        split across warps while they fit one wave."""
        h, bw = w.block or (32, 32)
        density = w.stored_density
        if w.impl == "bsr-kernel-mma":
            blocks = density * w.k / bw                               # stored blocks of a block row
            tile_m = (w.tile or (h, 1))[1]
            slices = w.n / 16
            options = [(MMA_WARPS_PER_SM, max(1.0, 64 / bw)), (MMA_WARPS_PER_SM_TWO_BLOCKS, max(1.0, 128 / bw))]
            (slots, loads, split), (slots_two, loads_two, split_two) = [
                (warps, loads, _split(slices, MMA_MAX_SPLIT, sms * warps)) for warps, loads in options]
            if math.ceil(blocks / (split_two * loads_two)) + 2 <= math.ceil(blocks / (split * loads)):
                slots, loads, split = slots_two, loads_two, split_two
            rounds = max(1.0, math.ceil(blocks / (split * loads)))
            warps = slices * split * math.ceil(w.m / tile_m)
            return rounds * max(1.0, warps / (sms * slots))
        tile_m = (w.tile or (h, 64))[1]
        per_cta = density * w.k / min(bw, 64)
        ctas = math.ceil(w.n / h) * math.ceil(w.m / tile_m)
        return per_cta * max(1.0, ctas / (sms * WGMMA_RESIDENT_CTAS))
