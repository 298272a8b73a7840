"""Kernel specifications: ``KernelSpec``, frozen and validated, names one generated kernel.

A spec names everything that distinguishes one generated kernel from another: its template
(:class:`Family`), dtype and tiling. Templates render only from it (:mod:`sparsecc.codegen.render`),
and only enumerated values reach the C++. The symbol spells the configuration out, so a binary
says what it is. The layouts the templates share with the packing code (the non-finite guard's
words) are defined here too, so that both sides read one definition.
"""
from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass

from ..errors import InputError

#: the non-finite guard kept after a weight's metadata (sparsecc.kernels.nonfinite_guard):
#: inputs per listed group (one 16-byte load of 16-bit x), the words before the groups (flag,
#: finished CTAs, group count), and where a 2:4 weight's guard starts after CUTLASS's metadata
#: (the next multiple of this many bytes)
GUARD_GROUP = 8
GUARD_HEADER_WORDS = 3
GUARD_ALIGNMENT = 16


class Family(str, enum.Enum):
    """A template, i.e. a kernel family. The value is the template's file stem."""

    SM90_SPARSE24 = "gemm_sm90_sparse24"
    SM90_SPARSE24_FP8 = "gemm_sm90_sparse24_fp8"
    SM90_DENSE = "gemm_sm90_dense"
    SM90_COMPRESS24 = "compress_sm90_sparse24"
    GEMV_SM90_SPARSE24 = "gemv_sm90_sparse24"
    GEMV_MMA_SM90_SPARSE24 = "gemv_mma_sm90_sparse24"
    GEMV_MMA_BULK_SM90_SPARSE24 = "gemv_mma_bulk_sm90_sparse24"
    GEMV_MMA_SM90_DENSE = "gemv_mma_sm90_dense"
    BSR_SM90_WGMMA = "bsr_sm90_wgmma"
    BSR_SM90_PAIRS = "bsr_sm90_pairs"
    BSR_MMA_SM90 = "bsr_mma_sm90"
    CSR_SM90 = "csr_sm90"
    CSR_WGMMA_SM90 = "csr_wgmma_sm90"
    BITMAP_SM90 = "bitmap_sm90"
    BITMAP_WGMMA_SM90 = "bitmap_wgmma_sm90"
    RESIDUAL_SM90 = "residual_sm90"
    SPMM_SM90 = "spmm_sm90"
    QUANTIZE_E4M3 = "quantize_e4m3"

    @property
    def arch(self) -> str:
        """Every template targets Hopper's sm_90a (wgmma, TMA, clusters)."""
        return "sm_90a"

    @property
    def sparse(self) -> bool:
        return "sparse24" in self.value

    @property
    def fp8(self) -> bool:
        """A product of e4m3 operands (a quantized site), dequantized by per-token and per-channel
        scales in its epilogue; its dtype is the output's (the site's input dtype)."""
        return self.value.endswith("_fp8")

    @property
    def gemv(self) -> bool:
        """A memory-bound small-batch kernel (tile: warps, rows per warp, rows of x; for the
        tensor-core ones warps, units of 16 output features, tiles of 8 rows of x; for the
        bulk-copy one units, tiles of x, units of K per stage)."""
        return self.value.startswith("gemv")

    @property
    def clustered(self) -> bool:
        """A tensor-core small-batch kernel: its launch's ``splits`` are the blocks of a
        cluster that split K (0: the kernel picks them for the shape it runs)."""
        return self.value.startswith("gemv_mma")

    @property
    def bsr(self) -> bool:
        """A block-sparse kernel (tile = block rows, block columns, rows of x)."""
        return self.value.startswith("bsr")

    @property
    def csr(self) -> bool:
        """An unstructured sparse kernel (tile = rows of a weight tile, rows of x, entries per tile):
        the tiled CSR kernels and the bitmap kernel, which shares their pipeline."""
        return self.value.startswith(("csr", "bitmap"))

    @property
    def bitmap(self) -> bool:
        """An unstructured kernel whose tiles store a bit per element and their non-zeros' values
        (sparsecc.kernels.bitmap) instead of a value and a slot per non-zero."""
        return self.value.startswith("bitmap")

    @property
    def csr_wgmma(self) -> bool:
        """An unstructured kernel on wgmma (csr_wgmma_sm90's pipeline: one tile a step, 64 or 128 rows of x)."""
        return self in (Family.CSR_WGMMA_SM90, Family.BITMAP_WGMMA_SM90)

    @property
    def per_entry(self) -> bool:
        """A CUDA-core kernel whose work follows a CSR weight's stored entries, with 8 rows of x
        staged in shared memory (templates/staged_x.j2): the residual pass of a split weight and
        the sparse product (tile = rows of x per CTA, threads per CTA, the largest K staged)."""
        return self in (Family.RESIDUAL_SM90, Family.SPMM_SM90)

    @property
    def own_launch(self) -> bool:
        """A kernel written with its own launch (gemv, BSR, CSR, per entry): no CUTLASS
        schedule, scheduler, cluster or operand-layout options (the op transposes x and y where
        a site needs it)."""
        return self.gemv or self.bsr or self.csr or self.per_entry or self.quantizer

    @property
    def compressor(self) -> bool:
        """A kernel that packs weights (``_sizes``/``_compress`` entry points) rather than a
        product (``_run``/``_workspace_size``)."""
        return self is Family.SM90_COMPRESS24

    @property
    def quantizer(self) -> bool:
        """A kernel that rounds inputs to e4m3 (a ``_quantize`` entry point) for an FP8 product that
        is not sparsecc's own (torch._scaled_mm's)."""
        return self is Family.QUANTIZE_E4M3

    @property
    def product(self) -> bool:
        """A kernel that computes a site's product (``_run``/``_workspace_size``)."""
        return not (self.compressor or self.quantizer)

    @property
    def nonfinite_pass(self) -> bool:
        """A product that skips what dense would compute (``0 * NaN``), so it exports a pass
        (``_propagate_nonfinite``) that makes NaN and Inf of x reach y as in dense F.linear,
        run unless the call's flags say unchecked (sparsecc.kernels.nonfinite_guard)."""
        return self in (Family.SM90_SPARSE24, Family.SM90_SPARSE24_FP8, Family.BSR_SM90_WGMMA, Family.BSR_SM90_PAIRS,
                        Family.BSR_MMA_SM90)


class Schedule(str, enum.Enum):
    COOPERATIVE = "cooperative"
    PINGPONG = "pingpong"


class Scheduler(str, enum.Enum):
    """How output tiles are spread over the SMs: one persistent wave, stream-K (which splits K
    across CTAs when there are too few tiles, e.g. small batch), or K cut into slices run as a
    batch whose fp32 sums a second kernel adds (the CUTLASS GEMMs, dense and 2:4)."""

    PERSISTENT = "persistent"
    STREAMK = "streamk"
    SLICED = "sliced"


DTYPES = ("float16", "bfloat16")
#: the element type of quantized weights: what the 2:4 compressor also packs
E4M3 = "float8_e4m3fn"
_SHORT_DTYPE = {"float16": "f16", "bfloat16": "bf16", E4M3: "e4m3"}

#: tile shapes (M, N, K of the GEMM: out features x rows x in features) each family accepts.
#: Every sm90 2:4 tile has K = 128, so one compressed layout serves all of them.
TILES = {
    Family.SM90_SPARSE24: {(64, 128, 128), (64, 256, 128), (128, 64, 128), (128, 128, 128),
                           (128, 256, 128), (256, 128, 128), (256, 64, 128), (64, 64, 128),
                           (128, 32, 128), (256, 32, 128), (64, 32, 128)},
    # e4m3 operands: the same 128-column K tiles (two sparse wgmma k-steps of 64)
    Family.SM90_SPARSE24_FP8: {(128, 64, 128), (128, 128, 128), (128, 256, 128), (256, 128, 128)},
    Family.SM90_DENSE: {(64, 64, 64), (64, 128, 64), (64, 256, 64), (128, 64, 64), (128, 128, 64), (128, 256, 64),
                        (256, 128, 64), (128, 128, 128), (128, 256, 128)},
    Family.SM90_COMPRESS24: {(128, 128, 128)},
    # (warps per block, output features per warp, rows of x per block)
    Family.GEMV_SM90_SPARSE24: {(w, r, m) for w in (2, 4, 8) for r in (1, 2, 4) for m in (1, 2, 4, 8, 16)},
    # the tensor-core small-batch kernels: (warps per block, 16-feature units of W per block,
    # 8-row tiles of x per block); the launch's splits are the blocks per cluster. Sixteen warps
    # split K within a block (partial sums meet in shared memory, not across a cluster) where a
    # short weight leaves few blocks; one tile of x only (two would stage 64 KB of x)
    Family.GEMV_MMA_SM90_SPARSE24: {(w, u, x) for w in (4, 8) for u in (1, 2, 4) for x in (1, 2)}
                                   | {(16, u, 1) for u in (1, 2, 4)},
    Family.GEMV_MMA_SM90_DENSE: {(w, u, x) for w in (4, 8) for u in (1, 2) for x in (1, 2)},
    # the same 2:4 units fed through shared memory by bulk copies: (16-feature unit rows of W per
    # block, 8-row tiles of x per block, units of 64 inputs per pipeline stage)
    Family.GEMV_MMA_BULK_SM90_SPARSE24: {(u, x, s) for u in (2, 4, 8) for x in (2, 4, 8) for s in (2, 4)},
}
#: BSR block sizes (rows, columns) the kernels take, square or not
BSR_BLOCK_SIDES = (16, 32, 64, 128)
#: rows of x per CTA of the wgmma BSR kernel: one consumer warpgroup of 64 rows, or two
BSR_WGMMA_TILE_M = (64, 128, 256)
#: rows of x per CTA of the wgmma BSR kernel on pairs of 64-row block rows (wgmma's N: one CTA
#: an SM at 256, two at 128)
BSR_PAIRS_TILE_M = (128, 256)
#: rows of x per CTA of the small-batch tensor-core BSR kernel (two mma n-tiles of 8)
BSR_MMA_TILE_M = (16,)

# (block rows, block columns, rows of x per CTA)
TILES[Family.BSR_SM90_WGMMA] = {(h, w, m) for h in BSR_BLOCK_SIDES for w in BSR_BLOCK_SIDES for m in BSR_WGMMA_TILE_M}
TILES[Family.BSR_SM90_PAIRS] = {(64, w, m) for w in BSR_BLOCK_SIDES for m in BSR_PAIRS_TILE_M}
TILES[Family.BSR_MMA_SM90] = {(h, w, m) for h in BSR_BLOCK_SIDES for w in BSR_BLOCK_SIDES for m in BSR_MMA_TILE_M}
#: the unstructured kernel: rows of a weight tile (its columns are 64), rows of x per CTA, and the
#: stored entries a tile may have (the packing picks the smallest that holds its fullest tile)
CSR_TILE_N = 64
CSR_TILE_M = (16, 32, 64, 128)
CSR_CAPACITIES = (256, 512, 1024, 1536, 2048, 4096)
#: the capacities csr_sm90 (the mma.sync kernel, up to 16 rows of x) is built for: a weight packed
#: for 1536 runs on its 2048 build, which held 11008x4096 at 16 rows and d = 0.3 in 42.8 us where
#: the 1536 build took 45.5 (five stages of two tiles against four); the wgmma kernel gains from
#: 1536 (47.1 against 48.8 us at 64 rows: five stages against four)
CSR_SM90_CAPACITIES = tuple(c for c in CSR_CAPACITIES if c != 1536)
#: the version of the tiled CSR packing (sparsecc.kernels.csr) the CSR kernels read, part of their
#: symbols: raised whenever that layout changes, so that a module saved with weights packed the
#: old way names kernels no process loads any more (sparsecc.runtime.loader.get says why) instead of having its
#: weights misread. 2: slots in the 128-byte K-major swizzle.
CSR_LAYOUT = 2
TILES[Family.CSR_SM90] = {(CSR_TILE_N, m, c) for m in CSR_TILE_M for c in CSR_SM90_CAPACITIES}
#: rows of x per CTA of the wgmma CSR kernel: one consumer warpgroup of 64 rows, or two
CSR_WGMMA_TILE_M = (64, 128)
TILES[Family.CSR_WGMMA_SM90] = {(CSR_TILE_N, m, c) for m in CSR_WGMMA_TILE_M for c in CSR_CAPACITIES}
#: the bitmap kernels (the CSR kernels' pipelines on the bitmap packing): tiles of 64 rows, rows of x
#: per CTA (16 or 32 on mma.sync, 64 or 128 on wgmma), the stored values a tile may have (padded to 8)
BITMAP_TILE_M = (16, 32)
TILES[Family.BITMAP_SM90] = {(CSR_TILE_N, m, c) for m in BITMAP_TILE_M for c in CSR_SM90_CAPACITIES}
TILES[Family.BITMAP_WGMMA_SM90] = {(CSR_TILE_N, m, c) for m in CSR_WGMMA_TILE_M for c in CSR_CAPACITIES}
#: the version of the bitmap packing (sparsecc.kernels.bitmap), part of the bitmap kernels' symbols
#: as CSR_LAYOUT is of the CSR kernels'
BITMAP_LAYOUT = 1
#: bytes of a bitmap tile's bits (64 x 64 elements) and of its group offsets in shared memory
BITMAP_TILE_BYTES = CSR_TILE_N * 64 // 8
#: the per-entry kernels: 8 rows of x per CTA (a staged column of x is one 16-byte vector), 256
#: threads, K up to 12288 staged (192 KB of shared memory)
TILES[Family.RESIDUAL_SM90] = TILES[Family.SPMM_SM90] = {(8, 256, 12288)}
#: the e4m3 rounding of x: a CTA of 256 threads a row, eight inputs a load
TILES[Family.QUANTIZE_E4M3] = {(256, 8, 1)}
#: the residual pass's mode 0 (sparsecc.csr_split.BY_ROWS) stages x from this many rows of x,
#: below it gathers (templates/residual_sm90.cu.j2; the cost model prices the mode it picks)
RESIDUAL_STAGED_MIN_ROWS = 256
DEFAULT_TILE = {Family.SM90_SPARSE24: (128, 128, 128), Family.SM90_SPARSE24_FP8: (128, 128, 128),
                Family.SM90_DENSE: (128, 128, 64),
                Family.SM90_COMPRESS24: (128, 128, 128), Family.GEMV_SM90_SPARSE24: (4, 2, 1),
                Family.GEMV_MMA_SM90_SPARSE24: (8, 1, 1), Family.GEMV_MMA_SM90_DENSE: (8, 1, 1),
                Family.GEMV_MMA_BULK_SM90_SPARSE24: (4, 4, 4),
                Family.BSR_SM90_WGMMA: (64, 64, 128),
                Family.BSR_SM90_PAIRS: (64, 64, 256),
                Family.BSR_MMA_SM90: (64, 64, 16),
                Family.CSR_SM90: (CSR_TILE_N, 64, 1024), Family.CSR_WGMMA_SM90: (CSR_TILE_N, 64, 1024),
                Family.BITMAP_SM90: (CSR_TILE_N, 16, 1024), Family.BITMAP_WGMMA_SM90: (CSR_TILE_N, 64, 1024),
                Family.RESIDUAL_SM90: (8, 256, 12288),
                Family.SPMM_SM90: (8, 256, 12288), Family.QUANTIZE_E4M3: (256, 8, 1)}
CLUSTERS = {(1, 1), (1, 2), (2, 1), (2, 2)}


def _csr_stages_fitting(tile_m: int, capacity: int, step_tiles: int, bitmap: bool = False) -> int:
    """Pipeline stages of the CSR kernel that fit 113 KB of shared memory (two CTAs per SM) beside
    its double-buffered dense tile and the K slice's tile offsets (1 KB; 4 KB of group offsets for
    the bitmap kernel): a stage holds x's columns and the entries (2-byte value, 2-byte slot) of
    ``step_tiles`` tiles, or for the bitmap kernel their values and bits."""
    step_k = 64 * step_tiles
    entry_bytes = capacity * step_tiles * 2 + step_tiles * BITMAP_TILE_BYTES if bitmap else capacity * step_tiles * 4
    offsets = 4096 if bitmap else 1024
    stage_bytes = tile_m * step_k * 2 + entry_bytes
    return (113 * 1024 - offsets - 2 * CSR_TILE_N * step_k * 2) // stage_bytes


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: family, dtype, operand layouts and tiling. Validated on creation.

    The epilogue (bias or not, which activation) is a run-time argument of every generated
    kernel, so one kernel serves every site with the same shape class."""

    family: Family
    dtype: str
    x_transposed: bool = False      # x arrives as [K, M] (CUTLASS B row-major)
    transpose_out: bool = False     # store y^T (CUTLASS D row-major)
    tile: tuple[int, int, int] = ()
    cluster: tuple[int, int] = (1, 1)
    schedule: Schedule = Schedule.COOPERATIVE
    scheduler: Scheduler = Scheduler.PERSISTENT

    def __post_init__(self):
        object.__setattr__(self, "family", Family(self.family))
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        object.__setattr__(self, "scheduler", Scheduler(self.scheduler))
        object.__setattr__(self, "tile", tuple(self.tile) or DEFAULT_TILE[self.family])
        object.__setattr__(self, "cluster", tuple(self.cluster))
        if self.dtype not in DTYPES and not (self.family is Family.SM90_COMPRESS24 and self.dtype == E4M3):
            raise InputError(f"kernels are generated for {DTYPES} (the 2:4 compressor also for {E4M3}), "
                             f"not {self.dtype!r}")
        if self.tile not in TILES[self.family]:
            raise InputError(f"tile {self.tile} is not one of {sorted(TILES[self.family])} for {self.family.value}")
        if self.cluster not in CLUSTERS:
            raise InputError(f"cluster {self.cluster} is not supported by {self.family.value}")
        if self.scheduler is Scheduler.STREAMK and self.schedule is not Schedule.COOPERATIVE:
            raise InputError("the stream-K scheduler needs the cooperative schedule")
        if self.scheduler is Scheduler.SLICED and self.family not in (Family.SM90_DENSE, Family.SM90_SPARSE24):
            raise InputError("the sliced scheduler (split-K as a batch) is written for the CUTLASS GEMMs "
                             f"({Family.SM90_DENSE.value}, {Family.SM90_SPARSE24.value}) only")
        if self.family.own_launch and (self.cluster != (1, 1) or self.scheduler is not Scheduler.PERSISTENT
                                       or self.schedule is not Schedule.COOPERATIVE
                                       or self.x_transposed or self.transpose_out):
            raise InputError(f"{self.family.value} kernels take no cluster, schedule, scheduler or operand-layout options")
        if self.family.fp8 and (self.schedule is not Schedule.COOPERATIVE or self.scheduler is Scheduler.SLICED):
            raise InputError(f"{self.family.value} runs the cooperative schedule, unsliced")
        if self.schedule is Schedule.COOPERATIVE and self.tile[0] < 128 and not self.family.own_launch:
            raise InputError("the cooperative schedule splits the tile's M over two warpgroups: M >= 128")
        if not isinstance(self.x_transposed, bool) or not isinstance(self.transpose_out, bool):
            raise InputError("x_transposed and transpose_out are booleans")

    @property
    def arch(self) -> str:
        return self.family.arch

    @property
    def template(self) -> str:
        return f"{self.family.value}.cu.j2"

    @property
    def mainloop_schedule(self) -> str:
        return {Schedule.COOPERATIVE: "KernelTmaWarpSpecializedCooperative",
                Schedule.PINGPONG: "KernelTmaWarpSpecializedPingpong"}[self.schedule]

    @property
    def epilogue_schedule(self) -> str:
        return {Schedule.COOPERATIVE: "TmaWarpSpecializedCooperative",
                Schedule.PINGPONG: "TmaWarpSpecialized"}[self.schedule]

    @property
    def csr_warps(self) -> tuple[int, int]:
        """(warps along x's rows, warps along the tile's rows) of the CSR kernel: four warps."""
        return (1, 4) if self.tile[1] == 16 else (2, 2)

    @property
    def csr_step_tiles(self) -> int:
        """Weight tiles (along K) per pipeline stage of the CSR kernels: for csr_sm90 four for x
        tiles of up to 32 rows, two for 64, one for 128, halved while three stages do not fit
        (large tile capacities); one for csr_wgmma_sm90."""
        _, tile_m, capacity = self.tile
        if self.family.csr_wgmma:
            return 1
        tiles = {16: 4, 32: 4, 64: 2, 128: 1}[tile_m]
        while tiles > 1 and _csr_stages_fitting(tile_m, capacity, tiles, self.family.bitmap) < 3:
            tiles //= 2
        return tiles

    @property
    def csr_stages(self) -> int:
        """Pipeline stages of the CSR kernel: as many as fit the shared memory of two CTAs per SM,
        between 3 (the helper warps refill a stage two steps after the one they scatter) and 8:
        a sparse weight's small tile capacity buys a deep pipeline, which hides memory latency
        at small batch."""
        _, tile_m, capacity = self.tile
        return max(3, min(8, _csr_stages_fitting(tile_m, capacity, self.csr_step_tiles, self.family.bitmap)))

    @property
    def symbol(self) -> str:
        """A C identifier that spells the whole configuration out."""
        if self.family in (Family.SM90_COMPRESS24, Family.QUANTIZE_E4M3):
            return f"sparsecc_{self.family.value}_{_SHORT_DTYPE[self.dtype]}"
        if self.family.bsr:
            h, w, m = self.tile
            return f"sparsecc_{self.family.value}_{_SHORT_DTYPE[self.dtype]}_b{h}x{w}_m{m}"
        if self.family.per_entry:
            return f"sparsecc_{self.family.value}_{_SHORT_DTYPE[self.dtype]}_r{self.tile[0]}"
        if self.family.csr:
            n, m, capacity = self.tile
            layout = BITMAP_LAYOUT if self.family.bitmap else CSR_LAYOUT
            return f"sparsecc_{self.family.value}_{_SHORT_DTYPE[self.dtype]}_n{n}_m{m}_c{capacity}_l{layout}"
        if self.family is Family.GEMV_MMA_BULK_SM90_SPARSE24:
            u, x, s = self.tile
            return f"sparsecc_{self.family.value}_{_SHORT_DTYPE[self.dtype]}_u{u}_x{x}_s{s}"
        if self.family in (Family.GEMV_MMA_SM90_SPARSE24, Family.GEMV_MMA_SM90_DENSE):
            w, u, x = self.tile
            return f"sparsecc_{self.family.value}_{_SHORT_DTYPE[self.dtype]}_w{w}_u{u}_x{x}"
        if self.family.gemv:
            w, r, m = self.tile
            return f"sparsecc_{self.family.value}_{_SHORT_DTYPE[self.dtype]}_w{w}_r{r}_m{m}"
        layouts = f"b{'row' if self.x_transposed else 'col'}_d{'row' if self.transpose_out else 'col'}"
        tile = "x".join(map(str, self.tile))
        cluster = "x".join(map(str, self.cluster))
        schedule = "coop" if self.schedule is Schedule.COOPERATIVE else "pp"
        scheduler = {Scheduler.STREAMK: "_sk", Scheduler.SLICED: "_ks"}.get(self.scheduler, "")
        return (f"sparsecc_{self.family.value}_{_SHORT_DTYPE[self.dtype]}_{layouts}"
                f"_t{tile}_c{cluster}_{schedule}{scheduler}")

    def describe(self) -> str:
        data = asdict(self)
        data.update(family=self.family.value, schedule=self.schedule.value, scheduler=self.scheduler.value)
        return json.dumps(data, sort_keys=True)

    def with_(self, **changes) -> "KernelSpec":
        return KernelSpec(**{**asdict(self), **changes})
