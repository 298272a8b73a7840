"""The BSR tensor-core kernels on the GPU (skipped without a Hopper GPU and nvcc): every
block shape the benchmarks and the plans use, against an fp64 reference, with random block
patterns, empty block rows, a fully empty and a fully dense weight, every activation, odd
batch sizes, poisoned outputs, NaN/Inf like dense, CUDA graphs, and a compiled model. The
dispatch runs the mma kernel (bsr_mma_sm90) for M = 1..16 and the wgmma kernel
(bsr_sm90_wgmma) above, so the batch sizes below cover both; the pairs kernel
(bsr_sm90_pairs, long rows of 64-row blocks above 512 rows of x) has its own tests here; the
small-batch kernel's are in tests/kernel_families/test_bsr_small_batch_gpu.py."""
import pytest
import torch
import torch.nn as nn

import sparsecc
from sparsecc.codegen.spec import Family, KernelSpec
from sparsecc.ir.epilogue import ACTIVATION_CODES, UNCHECKED_NONFINITE
from sparsecc.ir.formats import FormatSpec
from sparsecc.ir.workload import dtype_name
from sparsecc.kernels.base import Launch, finish_packing, nonfinite_flags
from sparsecc.kernels.bsr import BsrKernelWeight, dispatch
from sparsecc.kernels.nonfinite_guard import groups_of
from sparsecc.kernels.registry import BSR
from sparsecc.planner.cost import site_runner
from sparsecc.runtime.kernel_op import dispatch_string, ensure, kernel_for
from sparsecc.runtime.loader import loaded
from sparsecc.runtime.timing import time_us

from conftest import TOLERANCE, block_sparse, rel_error, replays_like_eager
from kernel_families.test_gemm_gpu import reference
from test_bad_input import assert_same_nonfinite, ieee_reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
BLOCKS = [(16, 16), (32, 32), (64, 64), (128, 128), (16, 64), (64, 32)]
ROWS = [1, 7, 33, 1000]
#: the wgmma kernel's tilings the dispatch does not use
WGMMA_TILES = [((64, 64), 256, torch.float16), ((128, 128), 256, torch.bfloat16), ((16, 16), 64, torch.bfloat16),
               ((32, 128), 128, torch.float16), ((128, 16), 64, torch.float16)]

#: the pairs kernel's tilings: every block width, both rows-of-x tiles
PAIRS_TILES = [((64, 64), 256, torch.float16), ((64, 32), 256, torch.bfloat16), ((64, 16), 128, torch.float16),
               ((64, 128), 128, torch.bfloat16), ((64, 64), 128, torch.bfloat16)]


#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = [launch.spec for dtype in DTYPES for block in BLOCKS for _, launch in dispatch(dtype, block)]
KERNELS += [KernelSpec(Family.BSR_SM90_WGMMA, dtype_name(dtype), tile=(*block, tile_m)) for block, tile_m, dtype in WGMMA_TILES]
KERNELS += [KernelSpec(Family.BSR_SM90_PAIRS, dtype_name(dtype), tile=(*block, tile_m))
            for block, tile_m, dtype in PAIRS_TILES]


def weight(block, n_blocks, k_blocks, density, dtype, seed=0, empty_rows=(1,)):
    """A block-sparse weight scaled like a trained layer's; the listed block rows are empty."""
    h, w = block
    gen = torch.Generator().manual_seed(seed)
    dense = block_sparse(h * n_blocks, w * k_blocks, block, density, gen) / (w * k_blocks) ** 0.5
    for row in empty_rows:
        dense[row * h:(row + 1) * h] = 0
    return dense.to(dtype).cuda()


def kernel_weight(w, block, cover_columns=True):
    """``w`` packed for the BSR kernels with its dispatch table loaded, as compile packs it
    (``registry.BSR.pack``, which covers every empty block column with a block of zeros);
    ``cover_columns=False``: those columns listed in the guard instead."""
    if cover_columns:
        return BSR.pack(w, FormatSpec("bsr", block=block), None)
    packed = BsrKernelWeight.pack(w, block, cover_columns=False)
    finish_packing(w.device)                # the small-batch mma kernel reads it before it waits
    table = packed.launches()
    ensure([launch.spec for _, launch in table], progress=False)
    return packed.running(table, nonfinite_flags())


def run(packed, x, bias=None, activation="none", x_transposed=False, transpose_out=False):
    return packed.op(x, *packed.tensors().values(), *packed.scalars().values(), bias, activation,
                     x_transposed, transpose_out, *packed.extra_args)


def run_poisoned(packed, x, bias, activation, m_bound):
    """The launch the site dispatches for ``m_bound`` rows, called directly on a NaN-filled y."""
    kernel, swizzle, splits, _ = kernel_for(packed.kernels, m_bound)
    y = torch.full((x.shape[0], packed.out_features), float("nan"), dtype=x.dtype, device="cuda")
    kernel.gemm(packed.values.data_ptr(), packed.metadata.data_ptr(), x.data_ptr(),
                bias.data_ptr() if bias is not None else 0, y.data_ptr(), packed.out_features, x.shape[0],
                packed.in_features, ACTIVATION_CODES[activation], torch.cuda.current_stream().cuda_stream,
                swizzle=swizzle, splits=splits)
    torch.cuda.synchronize()
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_every_block_and_batch_size_matches_fp64(block, dtype):
    """Every M bucket's tiling (M = 1, 7, 33, 1000) on an odd-sized weight (5 x 7 blocks, one
    empty block row, about 40% of blocks stored) with bias and ReLU, into a poisoned y."""
    w = weight(block, 5, 7, 0.4, dtype)
    packed = kernel_weight(w, block)
    assert torch.equal(packed.to_dense(), w)
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    for m in ROWS:
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
        y = run_poisoned(packed, x, bias, "relu", m)
        error = rel_error(y, reference(x, w, bias, "relu"))
        assert error <= TOLERANCE[dtype], (m, error)
        assert torch.equal(run(packed, x, bias, "relu"), y)         # the op dispatches the same launch


@pytest.mark.parametrize("block,tile_m,dtype", WGMMA_TILES, ids=str)
def test_wgmma_tiles_the_dispatch_does_not_use(block, tile_m, dtype):
    """The wgmma kernel's other tilings (256 rows of x: two warpgroups of 128; 64 rows: one;
    blocks wider than a 64-column TMA box), each on its own over batch sizes that leave
    partial tiles."""
    w = weight(block, 5, 7, 0.4, dtype, seed=13)
    spec = KernelSpec(Family.BSR_SM90_WGMMA, dtype_name(dtype), tile=(*block, tile_m))
    ensure([spec], progress=False)
    packed = BsrKernelWeight.pack(w, block)
    packed.kernels = dispatch_string([(0, Launch(spec))])
    gen = torch.Generator().manual_seed(14)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    for m in (1, 100, 300, 1000):
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
        error = rel_error(run_poisoned(packed, x, bias, "gelu", m), reference(x, w, bias, "gelu"))
        assert error <= TOLERANCE[dtype], (m, error)


def pairs_weight(block, tile_m, dtype, density=0.4, seed=50):
    """An odd number of block rows (the last pair one row), pair 1 empty, pair 2 one row, packed
    for the pairs kernel alone."""
    w = weight(block, 9, 7, density, dtype, seed=seed, empty_rows=(2, 3, 4))
    spec = KernelSpec(Family.BSR_SM90_PAIRS, dtype_name(dtype), tile=(*block, tile_m))
    ensure([spec], progress=False)
    packed = BsrKernelWeight.pack(w, block)
    packed.kernels = dispatch_string([(0, Launch(spec, splits=packed.pairs_at))])
    return w, packed


@pytest.mark.parametrize("block,tile_m,dtype", PAIRS_TILES, ids=str)
def test_pairs_kernel_matches_fp64(block, tile_m, dtype):
    """The pairs kernel (two block rows per CTA over the union of their block columns) on
    pairs_weight, every activation, batch sizes that leave partial tiles, into a poisoned y;
    a dense weight (every step both rows') too."""
    w, packed = pairs_weight(block, tile_m, dtype)
    gen = torch.Generator().manual_seed(51)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    for m, activation in ((1, "relu"), (tile_m - 1, "gelu"), (tile_m + 1, "silu"), (1000, "gelu_tanh"),
                          (3 * tile_m, "none")):
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
        error = rel_error(run_poisoned(packed, x, bias, activation, m), reference(x, w, bias, activation))
        assert error <= TOLERANCE[dtype], (m, activation, error)
    full, packed = pairs_weight(block, tile_m, dtype, density=1.0, seed=52)
    x = torch.randn(300, w.shape[1], generator=gen).to(dtype).cuda()
    assert rel_error(run_poisoned(packed, x, None, "relu", 300), reference(x, full, None, "relu")) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_pairs_kernel_propagates_nan_and_inf_like_dense(dtype):
    """NaN and ±Inf of x through the pairs kernel as through dense (its epilogue raises the
    guard, the pass poisons the rows that skip a block column); then a clean call is clean."""
    dense, packed = pairs_weight((64, 32), 256, dtype, density=0.3, seed=53)
    gen = torch.Generator().manual_seed(54)
    x = torch.randn(300, dense.shape[1], generator=gen).to(dtype).cuda()
    bias = torch.randn(dense.shape[0], generator=gen).to(dtype).cuda()
    x[3, 5] = float("nan")
    x[7, 100] = float("inf")
    x[260, 200] = float("-inf")
    assert_same_nonfinite(run(packed, x, bias, "relu"), ieee_reference(x, dense, bias, "relu").to(dtype), dtype)
    clean = torch.randn(300, dense.shape[1], generator=gen).to(dtype).cuda()
    got = run(packed, clean, bias, "relu")
    assert got.isfinite().all() and rel_error(got, reference(clean, dense, bias, "relu")) <= TOLERANCE[dtype]


def test_long_rows_dispatch_the_pairs_kernel():
    """A site of 64x64 blocks with long rows (64 block rows) runs the pairs kernel above 512 rows
    of x, the one-row kernel at 512, both matching fp64 through the op."""
    dtype = torch.float16
    w = weight((64, 64), 64, 10, 0.6, dtype, seed=55)
    packed = kernel_weight(w, (64, 64))
    gen = torch.Generator().manual_seed(56)
    for m, family in ((513, Family.BSR_SM90_PAIRS), (512, Family.BSR_SM90_WGMMA)):
        assert kernel_for(packed.kernels, m)[0].spec.family is family
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
        assert rel_error(run(packed, x, None, "gelu"), reference(x, w, None, "gelu")) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block,tile_m", [((64, 64), 128), ((64, 64), 64), ((32, 32), 128), ((16, 64), 64)], ids=str)
def test_two_tiles_per_cta_compute_what_one_does(block, tile_m, dtype):
    """The wgmma kernel with two tiles of x per CTA (the launch's splits = 2, chosen for short
    block rows) gives the same bits as with one, over batch sizes with an odd number of tiles
    and a partial last tile, and matches fp64; the dispatch asks for it only for short rows."""
    spec = KernelSpec(Family.BSR_SM90_WGMMA, dtype_name(dtype), tile=(*block, tile_m))
    ensure([spec], progress=False)
    gen = torch.Generator().manual_seed(40)
    for density in (0.15, 0.9):
        w = weight(block, 6, 9, density, dtype, seed=41)
        one, two = BsrKernelWeight.pack(w, block), BsrKernelWeight.pack(w, block)
        one.kernels = dispatch_string([(0, Launch(spec, splits=1))])
        two.kernels = dispatch_string([(0, Launch(spec, splits=2))])
        bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
        for m in (1, tile_m, tile_m + 1, 3 * tile_m - 5, 1000):
            x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
            y = run_poisoned(two, x, bias, "gelu", m)
            assert torch.equal(y, run_poisoned(one, x, bias, "gelu", m)), (density, m)
            assert rel_error(y, reference(x, w, bias, "gelu")) <= TOLERANCE[dtype], (density, m)
    short, long = (kernel_weight(weight(block, 6, 9, d, dtype, seed=42), block) for d in (0.15, 0.9))
    assert short.chunks_per_row <= 3 < long.chunks_per_row
    assert kernel_for(short.kernels, 512)[2] == 2 and kernel_for(long.kernels, 512)[2] == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(ACTIVATION_CODES))
def test_every_activation_with_and_without_bias(activation, dtype):
    w = weight((32, 32), 8, 12, 0.3, dtype, seed=2)
    packed = kernel_weight(w, (32, 32))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(257, w.shape[1], generator=gen).to(dtype).cuda()
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    for b in (None, bias):
        error = rel_error(run(packed, x, b, activation), reference(x, w, b, activation))
        assert error <= TOLERANCE[dtype], (activation, b is not None, error)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_empty_and_fully_dense_weights(dtype):
    """No stored block at all (or only the blocks of zeros covering the block columns): y =
    act(bias) everywhere (the wgmma kernel's GELU is its own polynomial: within an ulp of
    torch's), and NaN in a row where x has one; every block stored: the dense product."""
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(128, generator=gen).to(dtype).cuda()
    x = torch.randn(300, 256, generator=gen).to(dtype).cuda()
    empty = torch.zeros(128, 256, dtype=dtype, device="cuda")
    for cover in (False, True):
        packed = kernel_weight(empty, (64, 64), cover_columns=cover)
        assert packed.values.shape[0] == (4 if cover else 0)
        got = run(packed, x, bias, "gelu")
        assert torch.equal(got, got[:1].expand(300, 128))          # act(bias) in every row, within an ulp
        torch.testing.assert_close(got[0], reference(x[:1], empty, bias, "gelu")[0].to(dtype),
                                   rtol=torch.finfo(dtype).eps, atol=1e-6)
        bad = x.clone()
        bad[5, 200] = float("nan")
        got = run(packed, bad, bias, "gelu")
        assert got[5].isnan().all() and torch.equal(got[6:], run(packed, x, bias, "gelu")[6:])
    full = weight((64, 64), 2, 4, 1.0, dtype, empty_rows=())
    packed = kernel_weight(full, (64, 64))
    assert packed.values.numel() == full.numel()
    assert rel_error(run(packed, x, bias, "silu"), reference(x, full, bias, "silu")) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_unbalanced_block_rows(dtype):
    """Block rows of very different lengths (one full, most nearly empty): the longest-first
    order covers every row exactly once."""
    h = w = 32
    dense = weight((h, w), 24, 32, 0.05, dtype, seed=6, empty_rows=(3, 9))
    dense[5 * h:6 * h] = (torch.randn(h, 32 * w) / (32 * w) ** 0.5).to(dtype).cuda()
    packed = kernel_weight(dense, (h, w))
    lengths = packed.row_ptr[1:] - packed.row_ptr[:-1]
    assert packed.order[0].item() == 5 and lengths[packed.order.long()].diff().le(0).all()
    x = torch.randn(2048, dense.shape[1], generator=torch.Generator().manual_seed(7)).to(dtype).cuda()
    assert rel_error(run(packed, x), reference(x, dense, None, "none")) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate_like_dense(dtype):
    """A NaN or an infinity of x meets the blocks that are not stored as dense meets zeros:
    NaN in every output of a block row that skips its block column; ±Inf against stored
    values. Checked output by output against IEEE products; unchecked sites skip the pass."""
    h, w = 32, 32
    dense = weight((h, w), 6, 8, 0.4, dtype, seed=8)
    packed = kernel_weight(dense, (h, w))
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(40, dense.shape[1], generator=gen).to(dtype).cuda()
    x[3, 5] = float("nan")
    x[7, 100] = float("inf")
    x[7, 200] = float("-inf")
    x[20, 255] = float("nan")
    bias = torch.randn(dense.shape[0], generator=gen).to(dtype).cuda()
    got = run(packed, x, bias, "relu")
    assert_same_nonfinite(got, ieee_reference(x, dense, bias, "relu").to(dtype), dtype)
    unchecked = BsrKernelWeight.pack(dense, (h, w))
    unchecked.kernels = dispatch_string(dispatch(dtype, (h, w)), UNCHECKED_NONFINITE)
    skipped = run(unchecked, x, bias, "relu")
    assert torch.equal(skipped[0], got[0]) and skipped[3].isnan().sum() < got[3].isnan().sum()


@pytest.mark.parametrize("rows", [5000, 12])
@pytest.mark.parametrize("cover", [True, False], ids=["covered", "listed"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_guard_reads_unmet_columns_and_is_lowered_after_every_call(dtype, cover, rows):
    """5000 rows of x (the wgmma kernel; more than the pass's warps: each takes several) or 12
    (the mma kernel) on a weight with a block column no block row stores, covered by a block of
    zeros or listed in the guard (the pass then reads it on every call): an infinity there and a
    NaN in a stored block column give NaN as dense, eagerly and on graph replays; the next call
    with finite x is clean; the guard is lowered after each."""
    h, w = 32, 32
    dense = weight((h, w), 6, 8, 0.5, dtype, seed=15)
    dense[:, 2 * w:3 * w] = 0
    packed = kernel_weight(dense, (h, w), cover_columns=cover)
    listed = set(groups_of(packed.guard).tolist())
    assert not listed if cover else set(range(2 * w // 8, 3 * w // 8)) <= listed
    gen = torch.Generator().manual_seed(16)
    x = torch.randn(rows, dense.shape[1], generator=gen).to(dtype).cuda()
    clean = run(packed, x, None, "none")
    assert rel_error(clean, reference(x, dense, None, "none")) <= TOLERANCE[dtype]
    suspect = [min(17, rows // 2), rows - 1]
    bad = x.clone()
    bad[suspect[0], 2 * w + 3] = float("inf")          # the unmet block column: NaN in every output
    bad[suspect[1], 5] = float("nan")                   # a stored column: the product raises the guard
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    with torch.cuda.graph(graph):
        captured = run(packed, static_x, None, "none")
    for given in (bad, x, bad, x):
        got = run(packed, given, None, "none")
        assert packed.guard[:2].tolist() == [0, 0]
        static_x.copy_(given)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured.isnan(), got.isnan()) and torch.equal(captured.nan_to_num(), got.nan_to_num())
        if given is bad:
            assert got[suspect[0]].isnan().all() and got[suspect[1]].isnan().any()
            assert_same_nonfinite(got[suspect], ieee_reference(bad[suspect], dense, None, "none").to(dtype), dtype)
            rest = torch.ones(rows, dtype=torch.bool)
            rest[suspect] = False
            assert torch.equal(got[rest], clean[rest])
        else:
            assert torch.equal(got, clean)


@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_replay_matches_eager(dtype):
    w = weight((64, 64), 4, 6, 0.5, dtype, seed=10)
    packed = kernel_weight(w, (64, 64))
    x = torch.randn(96, w.shape[1], generator=torch.Generator().manual_seed(11)).to(dtype).cuda()
    assert replays_like_eager(lambda x: run(packed, x, None, "gelu_tanh"), x)


def test_compile_runs_block_sparse_sites_on_the_kernel():
    """sparsecc.compile with formats=('bsr64',) packs a block-sparse MLP for the BSR kernels
    (the plan says so) and matches the eager model."""
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 256)).half().cuda().eval()
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.copy_(weight((64, 64), layer.out_features // 64, layer.in_features // 64, 0.25,
                                      torch.float16, seed=layer.in_features))
    x = torch.randn(64, 512, dtype=torch.float16, device="cuda")
    compiled = sparsecc.compile(model, (x,), formats=("bsr64",))
    plan = compiled.sparsecc_plan
    assert all(site.choice == "bsr64x64" and "BSR kernel" in site.reason for site in plan), plan.table()
    with torch.no_grad():
        assert rel_error(compiled(x), model(x)) <= TOLERANCE[torch.float16]
    assert any(name.startswith("sparsecc_bsr_sm90") for name in loaded())


def test_calibration_times_the_kernels_under_graph_replay():
    """sparsecc's BSR kernels never read a value back to the host, so the cost model's timing
    captures them in a CUDA graph like the 2:4 kernels (torch's BSR path is timed eagerly)."""
    w = weight((64, 64), 8, 8, 0.25, torch.float16, seed=15)
    spec = FormatSpec("bsr", block=(64, 64))
    on_kernel = site_runner(w, spec, 64, on_kernel=True)
    assert on_kernel.capturable and not site_runner(w, spec, 64).capturable
    assert rel_error(on_kernel(), reference(on_kernel.x, w, None, "none")) <= TOLERANCE[torch.float16]
    assert 0 < time_us(on_kernel, "cuda") < 1000


def test_a_range_packs_blocks_for_its_low_end_and_the_dense_weight_above():
    """A site planned over M = 1..512 that keeps its dense weight above its low end: the BSR kernels
    up to 16 rows (the small-batch kernel's), the model's own weight past them, each call against
    the fp64 reference."""
    from sparsecc.ir.plan import ABOVE_DENSE
    from sparsecc.kernels import registry
    from sparsecc.kernels.by_rows import ByRowsWeight
    w = weight((64, 64), 16, 32, 0.1, torch.float16)
    packed = registry.pack(w, FormatSpec.parse("bsr64x64"), 512, tune_range=(1, 512), above=ABOVE_DENSE)
    assert isinstance(packed, ByRowsWeight) and packed.limit == 16 and packed.dense.data_ptr() == w.data_ptr()
    assert isinstance(registry.pack(w, FormatSpec.parse("bsr64x64"), 512, tune_range=(1, 512)), BsrKernelWeight)
    bias = torch.randn(w.shape[0], dtype=torch.float16, device="cuda")
    for rows in (1, 16, 17, 512):
        x = torch.randn(rows, w.shape[1], dtype=torch.float16, device="cuda")
        got = packed.op(x, *packed.tensors().values(), *packed.scalars().values(), bias, "relu", False, False,
                        *packed.extra_args)
        assert rel_error(got, reference(x, w, bias, "relu")) < TOLERANCE[torch.float16], rows


def test_a_model_compiled_for_decode_and_prefill_computes_the_layer_at_every_batch():
    """Compiled over M = 1..512, a 10% block-sparse layer computes x W^T + b at one row, at the low
    tier's 16, past it and at 512 (whichever tiers timing gave it), and its reason says which ran."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU()).half().cuda().eval()
    with torch.no_grad():
        model[0].weight.copy_(weight((64, 64), 32, 32, 0.1, torch.float16))
    compiled = sparsecc.compile(model, torch.randn(512, 2048, dtype=torch.float16, device="cuda"), m_range=(1, 512))
    site = compiled.sparsecc_plan["0"]
    assert (site.above == "dense") == ("up to M=16, dense above" in site.reason)
    with torch.no_grad():
        for rows in (1, 16, 17, 512):
            x = torch.randn(rows, 2048, dtype=torch.float16, device="cuda")
            assert rel_error(compiled(x), reference(x, model[0].weight, model[0].bias, "relu")) < 1e-2, rows
