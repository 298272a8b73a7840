"""Block-sparse (BSR) weights on sparsecc's tensor-core kernels (templates/bsr_sm90*.cu.j2).

The kernels loop over the stored blocks only: the wgmma kernel one block row of W against a
tile of x's rows per CTA, the pairs kernel two block rows of 64 (the union of their block
columns, each x chunk loaded once for both) against 256 rows of x, the small-batch mma kernel
16 weight rows per warp on tensor cores for up to 16 rows of x (the streaming kernel, on CUDA
cores, once took one row). The packed layout is the portable BSR one with the block rows
ordered for balance:

- ``values``: ``[blocks, h, w]``, each stored block row-major, block row after block row and
  by increasing block column within a row (the wgmma kernels load each block with one TMA
  box of a ``[blocks * h, w]`` view);
- ``metadata`` (int32): ``row_ptr [R + 1]`` (stored blocks before each block row),
  ``order [R]`` (block rows by decreasing length: the kernels start the longest first, a
  greedy balance across SMs), ``col [blocks]`` (the block column of each stored block),
  then the site's non-finite guard (:mod:`sparsecc.nonfinite_guard`), and for blocks of 64
  rows the pair section of :func:`pair_section` (the pairs kernel's launch carries where it
  starts, :attr:`BsrKernelWeight.pairs_at`).

Where the wgmma or the mma kernel runs a site, a block column that no block row stores gets a block of
zeros (``cover_columns``): the product's sums then meet every input, so the NaN/Inf pass reads
no part of x unless a sum was not finite.

Packing is torch ops on any device and round-trips exactly; :meth:`BsrKernelWeight.from_dense`
also loads the kernels of the site's dispatch table (one kernel per batch-size bucket).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import runtime
from .codegen import BSR_BLOCK_SIDES, Family, KernelSpec
from .errors import InputError
from .formats import INDEX_DTYPE, BSRWeight, FormatSpec
from .gpu import KERNEL_DTYPES, KernelWeight, Launch, dispatch_string, nonfinite_flags
from .nonfinite_guard import HEADER_WORDS, cover_block_columns, guard_words

#: a BSR site's M buckets (upper bound, 0 = none; the M measured): sparsecc.gpu.M_BUCKETS with
#: a bound at 512 as well, below which the pairs kernel does not pay (see PAIRS_BUCKETS)
BSR_BUCKETS = ((1, 1), (16, 16), (128, 128), (512, 512), (2048, 2048), (0, 8192))

#: the kernel for each M bucket of :data:`BSR_BUCKETS` (bound -> family, rows of x
#: per CTA): the small-batch tensor-core kernel (mma.sync, memory-bound) up to 16 rows, one
#: row included, the wgmma kernel above, 64 rows per CTA up to 128 and 128 rows beyond. At 90%
#: block sparsity (64x64 blocks, fp16, H100, benchmarks/results/kernels_bsr_small-*-2026-11-26)
#: the mma kernel at M = 1 is faster than the streaming CUDA-core kernel (templates/bsr_sm90.cu.j2)
#: that ran one row before on all six shapes of the 2:4 issue (11008x4096 6.8 against 9.3 us,
#: 4096x11008 7.1 against 7.6, 768x3072 4.0 against 4.6)
DEFAULT_KERNEL = {1: (Family.BSR_MMA_SM90, 16), 16: (Family.BSR_MMA_SM90, 16), 128: (Family.BSR_SM90_WGMMA, 64),
                  512: (Family.BSR_SM90_WGMMA, 128), 2048: (Family.BSR_SM90_WGMMA, 128),
                  0: (Family.BSR_SM90_WGMMA, 128)}

#: where the pairs kernel (templates/bsr_sm90_pairs.cu.j2, 256 rows of x per CTA) runs instead:
#: the buckets above 512 rows, for blocks of 64 rows whose block rows average at least
#: PAIRS_MIN_CHUNKS pipeline chunks, on weights of at least PAIRS_MIN_BLOCK_ROWS block rows.
#: Same process on an H100 (fp16, 64x64 blocks, benchmarks/lab/README.md): on 4096x4096,
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
        return f"the BSR kernels take float16/bfloat16, not {str(dtype).replace('torch.', '')}"
    if block[0] not in BSR_BLOCK_SIDES or block[1] not in BSR_BLOCK_SIDES:
        return f"the BSR kernels take blocks with sides in {BSR_BLOCK_SIDES}, not {block[0]}x{block[1]}"
    return None


#: block rows of at most this many pipeline chunks (64 columns each) on average are short: the
#: wgmma kernel's CTAs take two tiles of x each there (the launch's ``splits``), the loads of
#: the second running while the first's output is stored. Same-process A/B on an H100 (fp16,
#: 64x64 blocks, lab/README.md): 4-17% faster at 1-3 chunks per row (3072x768 and 768x768 at
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
    name = str(dtype).replace("torch.", "")
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
    bound = next(bound for bound, _ in BSR_BUCKETS if bound == 0 or m <= bound)
    return kernel_for_bucket(bound, block, chunks_per_row, block_rows)


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
        return self._guard_start + HEADER_WORDS + int(self.metadata[self._guard_start + HEADER_WORDS - 1])

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

    @classmethod
    def from_dense(cls, weight: torch.Tensor, block: tuple[int, int], *, cover_columns: bool = True,
                   progress: bool = False) -> "BsrKernelWeight":
        """Pack a [N, K] CUDA weight (see :meth:`pack`) and load the kernels of its dispatch table."""
        cls._check(weight)
        reason = block_supported(tuple(block), weight.dtype)
        if reason:
            raise InputError(reason)
        packed = cls.pack(weight, tuple(block), cover_columns=cover_columns)
        runtime.finish_packing(weight.device)   # the small-batch mma kernel reads it before it waits
        table = packed.launches()
        runtime.ensure([launch.spec for _, launch in table], progress=progress)
        packed.kernels = dispatch_string(table, nonfinite_flags())
        return packed

    def to_dense(self) -> torch.Tensor:
        """Unpack exactly (every value goes back to its position)."""
        return BSRWeight(self.row_ptr, self.col, self.values.reshape(-1, *self.block),
                         self.out_features, self.in_features).to_dense()
