"""The BSR kernels' weight layout and dispatch (sparsecc.kernels.bsr), on the CPU: exact
round trips, the layout the template reads, the longest-first order, refusals, and the cost
model's view of a BSR site where the kernels run."""
import pytest
import torch

from sparsecc.codegen.spec import TILES, Family, KernelSpec
from sparsecc.errors import FormatError, InputError
from sparsecc.ir.analysis import analyze
from sparsecc.ir.formats import FormatSpec
from sparsecc.kernels import registry
from sparsecc.kernels.base import launch_for
from sparsecc.kernels.bsr import (BSR_BUCKETS, DEFAULT_KERNEL, PAIRS_MIN_BLOCK_ROWS, PAIRS_MIN_CHUNKS, PAIRS_TILE_M,
                                  SHORT_ROW_CHUNKS,
                                  BsrKernelWeight, block_supported, chunks_per_row_of, dispatch, kernel_for_rows,
                                  kernel_specs)
from sparsecc.kernels.csr import CSR_BUCKETS
from sparsecc.planner.cost import CostModel

from conftest import block_sparse


@pytest.mark.parametrize("block", [(16, 16), (32, 64), (64, 16), (128, 32)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pack_round_trips_and_stores_blocks_in_row_order(block, dtype, gen):
    h, w = block
    weight = block_sparse(6 * h, 9 * w, block, 0.35, gen, dtype)
    weight[2 * h:3 * h] = 0                                     # an empty block row
    packed = BsrKernelWeight.pack(weight, block, cover_columns=False)
    assert torch.equal(packed.to_dense(), weight)
    row_ptr, col = packed.row_ptr.long(), packed.col.long()
    assert row_ptr[3] == row_ptr[2]
    stacked = packed.values.reshape(-1, w)                      # the wgmma kernel's TMA view [blocks * h, w]
    for r in range(6):                                          # what the kernels read for block row r
        start, end = row_ptr[r].item(), row_ptr[r + 1].item()
        for j, c in zip(range(start, end), col[start:end].tolist()):
            assert torch.equal(stacked[j * h:(j + 1) * h], weight[r * h:(r + 1) * h, c * w:(c + 1) * w])
        assert col[start:end].diff().gt(0).all()
    assert packed.metadata.dtype == torch.int32
    assert packed.nbytes == packed.values.numel() * weight.element_size() + packed.metadata.numel() * 4
    assert packed.spec == FormatSpec("bsr", block=block)


def test_order_runs_the_longest_block_rows_first(gen):
    weight = block_sparse(8 * 16, 12 * 16, (16, 16), 0.3, gen)
    weight[5 * 16:6 * 16] = 1.0                                 # a full block row
    packed = BsrKernelWeight.pack(weight, (16, 16))
    lengths = (packed.row_ptr[1:] - packed.row_ptr[:-1])[packed.order.long()]
    assert packed.order[0] == 5 and lengths.diff().le(0).all()
    assert sorted(packed.order.tolist()) == list(range(8))


def test_empty_and_full_weights(gen):
    empty = BsrKernelWeight.pack(torch.zeros(64, 32), (32, 32), cover_columns=False)
    assert empty.values.numel() == 0 and torch.equal(empty.to_dense(), torch.zeros(64, 32))
    covered = BsrKernelWeight.pack(torch.zeros(64, 64), (32, 32))    # a block of zeros per block column
    assert covered.values.shape[0] == 2 and torch.equal(covered.to_dense(), torch.zeros(64, 64))
    full = torch.randn(64, 64, generator=gen)
    assert torch.equal(BsrKernelWeight.pack(full, (32, 16)).to_dense(), full)


def test_refusals():
    with pytest.raises(FormatError, match="does not divide"):
        BsrKernelWeight.pack(torch.ones(48, 64), (32, 32))
    with pytest.raises(InputError, match="GPU"):
        registry.BSR.pack(torch.ones(64, 64, dtype=torch.float16), FormatSpec("bsr", block=(32, 32)), None)
    assert "sides" in block_supported((8, 32), torch.float16)
    assert "float16/bfloat16" in block_supported((32, 32), torch.float32)
    assert block_supported((16, 128), torch.bfloat16) is None


def test_short_block_rows_get_two_tiles_of_x_per_cta(gen):
    """Where a weight's block rows average at most SHORT_ROW_CHUNKS pipeline chunks, its wgmma
    launches (not 256 rows) take two tiles of x per CTA (``splits``)."""
    for chunks, expected in ((None, 1), (SHORT_ROW_CHUNKS, 2), (SHORT_ROW_CHUNKS + 0.5, 1)):
        for _, launch in dispatch(torch.float16, (32, 64), chunks):
            wgmma = launch.spec.family is Family.BSR_SM90_WGMMA and launch.spec.tile[2] < 256
            assert launch.splits == (expected if wgmma else 1), (chunks, launch)
    sparse = BsrKernelWeight.pack(block_sparse(256, 1024, (64, 64), 0.1, gen, torch.float16), (64, 64))
    assert sparse.chunks_per_row == sparse.values.shape[0] / 4
    wide = BsrKernelWeight.pack(block_sparse(256, 1024, (128, 128), 0.5, gen, torch.float16), (128, 128))
    assert wide.chunks_per_row == wide.values.shape[0] * 2 / 2      # a 128-wide block is two chunks


def test_small_batch_launches_carry_the_longest_block_row(gen):
    """The mma kernel's launches carry the packed weight's longest block row in ``splits`` (the
    kernel picks its blocks per lane in flight from it), 1 where it is not known or empty."""
    w = block_sparse(512, 1024, (64, 64), 0.3, gen, torch.float16)
    packed = BsrKernelWeight.pack(w, (64, 64))
    lengths = (w.reshape(8, 64, 16, 64) != 0).any(dim=3).any(dim=1).sum(dim=1)
    assert packed.longest_row == int(lengths.max()) > 1
    for table, expected in ((packed.launches(), packed.longest_row), (dispatch(torch.float16, (64, 64)), 1)):
        for _, launch in table:
            if launch.spec.family is Family.BSR_MMA_SM90:
                assert launch.splits == expected, (launch, expected)
    empty = BsrKernelWeight.pack(torch.zeros(128, 256, dtype=torch.float16), (64, 64), cover_columns=False)
    assert empty.longest_row == 0
    assert all(launch.splits == 1 for _, launch in empty.launches() if launch.spec.family is Family.BSR_MMA_SM90)


def test_dispatch_has_a_kernel_per_bucket_for_every_block():
    for h in (16, 32, 64, 128):
        for w in (16, 32, 64, 128):
            table = dispatch(torch.float16, (h, w))
            assert [bound for bound, _ in table] == [bound for bound, _ in BSR_BUCKETS]
            assert all(launch.spec.family.bsr and launch.spec.tile in TILES[launch.spec.family]
                       and launch.spec.tile[:2] == (h, w) for _, launch in table)
    assert kernel_for_rows(1) == DEFAULT_KERNEL[1] and kernel_for_rows(100_000) == DEFAULT_KERNEL[0]
    with pytest.raises(InputError):
        KernelSpec(Family.BSR_MMA_SM90, "float16", tile=(64, 64, 16), transpose_out=True)
    assert (KernelSpec(Family.BSR_MMA_SM90, "bfloat16", tile=(16, 64, 16)).symbol
            == "sparsecc_bsr_mma_sm90_bf16_b16x64_m16")
    with pytest.raises(InputError, match="tile"):
        KernelSpec(Family.BSR_MMA_SM90, "float16", tile=(64, 64, 4))       # the mma kernel takes 16 rows
    with pytest.raises(InputError, match="tile"):
        KernelSpec(Family.BSR_SM90_WGMMA, "float16", tile=(64, 64, 32))    # a warpgroup takes 64 rows of x
    assert (KernelSpec(Family.BSR_SM90_WGMMA, "float16", tile=(128, 32, 256)).symbol
            == "sparsecc_bsr_sm90_wgmma_f16_b128x32_m256")


def test_cost_model_runs_block_sparse_on_the_kernel_where_it_can(gen):
    """With kernels available, BSR with a supported block runs on sparsecc's kernel and the
    plan says so; a float32 weight stays on torch's path and the reason says why."""
    weight = block_sparse(512, 512, (64, 64), 0.1, gen, torch.float16)
    model = CostModel("cuda", calibration=None, kernels_unavailable=None)
    spec = FormatSpec("bsr", block=(64, 64))
    stats = analyze(weight, extra_blocks=((64, 64),))
    assert model.workload(stats, spec, 2048).impl == "bsr-kernel"
    decision = model.decide(stats, 2048, [spec])
    assert decision.choice == spec and "sparsecc's BSR kernel" in decision.reason
    stats32 = analyze(weight.float(), extra_blocks=((64, 64),))
    assert model.workload(stats32, spec, 2048).impl != "bsr-kernel"
    assert "float16/bfloat16" in model.decide(stats32, 2048, [spec]).reason


def test_bsr_buckets_extend_the_shared_ones():
    """A BSR site's buckets are those of the other weight-dependent kernels (CSR) with 512 added
    (where the pairs kernel stops)."""
    shared = set(CSR_BUCKETS)
    assert shared < set(BSR_BUCKETS) and set(BSR_BUCKETS) - shared == {(512, 512)}
    assert [bound for bound, _ in BSR_BUCKETS] == sorted(b for b, _ in BSR_BUCKETS if b) + [0]


def unpair(packed):
    """The dense weight the pair section describes (each step's blocks at its rows and column)."""
    h, w = packed.block
    pairs = (packed.block_rows + 1) // 2
    section = packed.metadata[packed.pairs_at:].long()
    pair_ptr, order, steps = section[:pairs + 1], section[pairs + 1: 2 * pairs + 1], section[2 * pairs + 1:]
    steps = steps.reshape(-1, 3)
    assert steps.shape[0] == pair_ptr[-1] and sorted(order.tolist()) == list(range(pairs))
    lengths = pair_ptr[1:] - pair_ptr[:-1]
    assert lengths[order].diff().le(0).all()                                  # longest union first
    dense = torch.zeros(packed.out_features, packed.in_features, dtype=packed.values.dtype)
    blocks = packed.values.reshape(-1, h, w)
    for p in range(pairs):
        columns = steps[pair_ptr[p]: pair_ptr[p + 1], 0]
        assert columns.diff().gt(0).all()                                     # by increasing column
        for column, *row_blocks in steps[pair_ptr[p]: pair_ptr[p + 1]].tolist():
            assert any(b >= 0 for b in row_blocks)
            for r, b in enumerate(row_blocks):
                if b >= 0:
                    assert packed.col[b] == column and packed.row_ptr[2 * p + r] <= b < packed.row_ptr[2 * p + r + 1]
                    dense[(2 * p + r) * h:(2 * p + r + 1) * h, column * w:(column + 1) * w] = blocks[b]
    return dense


@pytest.mark.parametrize("block", [(64, 64), (64, 16), (64, 128)], ids=str)
def test_pair_section_lists_every_block_once_by_union_of_two_rows(block, gen):
    """Blocks of 64 rows carry the pairs kernel's section after the guard: every stored block
    once, at its pair's step for its column, an odd last block row alone; empty rows and an
    empty pair take no step; the guard ends where the section starts."""
    h, w = block
    weight = block_sparse(9 * h, 11 * w, block, 0.35, gen, torch.float16)
    weight[2 * h:5 * h] = 0                                 # pair 1 empty, an empty row in pair 2
    packed = BsrKernelWeight.pack(weight, block, cover_columns=False)
    assert torch.equal(unpair(packed), weight)
    section = packed.metadata[packed.pairs_at:]
    assert section[1] == section[2] < section[3]                              # pair 1: no step
    assert packed.guard.numel() == 3 + int(packed.guard[2])
    covered = BsrKernelWeight.pack(weight, block)                             # with the blocks of zeros
    assert torch.equal(unpair(covered), weight)
    narrow = BsrKernelWeight.pack(block_sparse(64, 128, (32, 32), 0.5, gen, torch.float16), (32, 32))
    assert narrow.pairs_at == 0 and narrow.metadata.numel() == 2 * 2 + 1 + narrow.values.shape[0] + narrow.guard.numel()


def test_long_rows_of_64_run_on_the_pairs_kernel_above_512_rows(gen):
    """The pairs kernel takes the buckets above 512 rows for blocks of 64 rows whose rows average
    at least PAIRS_MIN_CHUNKS chunks, on at least PAIRS_MIN_BLOCK_ROWS block rows; its launch
    carries where the pair section starts; short rows, fewer rows, other heights and unknown
    rows keep the one-row kernel; kernel_specs lists both."""
    long = BsrKernelWeight.pack(block_sparse(64 * PAIRS_MIN_BLOCK_ROWS, 512, (64, 64), 0.6, gen, torch.float16),
                                (64, 64))
    assert long.chunks_per_row >= PAIRS_MIN_CHUNKS
    for bound, launch in long.launches():
        pairs = bound in (2048, 0)
        assert (launch.spec.family is Family.BSR_SM90_PAIRS) == pairs, bound
        if pairs:
            assert launch.spec.tile == (64, 64, PAIRS_TILE_M) and launch.splits == long.pairs_at > 0
    assert launch_for(long.launches(), 513).spec.symbol == "sparsecc_bsr_sm90_pairs_f16_b64x64_m256"
    assert launch_for(long.launches(), 512).spec.family is Family.BSR_SM90_WGMMA
    short = BsrKernelWeight.pack(block_sparse(64 * PAIRS_MIN_BLOCK_ROWS, 512, (64, 64), 0.3, gen, torch.float16),
                                 (64, 64), cover_columns=False)
    few = BsrKernelWeight.pack(block_sparse(64 * PAIRS_MIN_BLOCK_ROWS - 64, 2048, (64, 64), 0.5, gen, torch.float16),
                               (64, 64))
    assert short.chunks_per_row < PAIRS_MIN_CHUNKS <= few.chunks_per_row
    for packed in (short, few):
        assert all(launch.spec.family is not Family.BSR_SM90_PAIRS for _, launch in packed.launches())
    for table in (dispatch(torch.float16, (64, 64)), dispatch(torch.float16, (32, 64), 8.0, block_rows=128)):
        assert all(launch.spec.family is not Family.BSR_SM90_PAIRS for _, launch in table)
    assert kernel_for_rows(8192, (64, 64), PAIRS_MIN_CHUNKS, PAIRS_MIN_BLOCK_ROWS) == (Family.BSR_SM90_PAIRS,
                                                                                      PAIRS_TILE_M)
    assert kernel_for_rows(8192, (64, 64), PAIRS_MIN_CHUNKS) == DEFAULT_KERNEL[0]      # rows not known
    assert kernel_for_rows(512, (64, 64), 16.0, 128) == DEFAULT_KERNEL[512]
    assert chunks_per_row_of((64, 32), 4096, 0.25) == 32 and chunks_per_row_of((64, 128), 4096, 0.25) == 16
    specs = kernel_specs(torch.bfloat16, (64, 32))
    assert KernelSpec(Family.BSR_SM90_PAIRS, "bfloat16", tile=(64, 32, PAIRS_TILE_M)) in specs
    assert {s.family for s in specs} == {Family.BSR_MMA_SM90, Family.BSR_SM90_WGMMA, Family.BSR_SM90_PAIRS}
    assert Family.BSR_SM90_PAIRS not in {s.family for s in kernel_specs(torch.float16, (32, 64))}
    with pytest.raises(InputError, match="tile"):
        KernelSpec(Family.BSR_SM90_PAIRS, "float16", tile=(32, 64, 256))       # a block row is 64 outputs
