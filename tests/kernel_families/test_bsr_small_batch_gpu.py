"""The small-batch BSR kernel on its own on the GPU (skipped without a Hopper GPU and nvcc):
the mma one (templates/bsr_mma_sm90.cu.j2, tensor cores, 16 rows of x per CTA). Every block
shape, batch sizes that leave partial tiles, an empty block row, poisoned outputs, every
activation, fully empty and fully dense weights, NaN/Inf like dense (and skipped when
unchecked), CUDA graphs. Apart from tests/kernel_families/test_bsr_gpu.py so that a GPU session can run
them without building the wgmma kernels (conftest builds the selected modules' KERNELS)."""
import pytest
import torch

from sparsecc.codegen.spec import Family, KernelSpec
from sparsecc.ir.epilogue import ACTIVATION_CODES, UNCHECKED_NONFINITE
from sparsecc.ir.workload import dtype_name
from sparsecc.kernels.base import Launch
from sparsecc.kernels.bsr import BsrKernelWeight
from sparsecc.runtime.kernel_op import dispatch_string, ensure

from conftest import TOLERANCE, rel_error, replays_like_eager
from kernel_families.test_bsr_gpu import BLOCKS, DTYPES, run, run_poisoned, weight
from kernel_families.test_gemm_gpu import reference
from test_bad_input import assert_same_nonfinite, ieee_reference

pytestmark = pytest.mark.gpu

#: the small-batch kernel's rows of x per CTA
TILE_M = 16
#: the kernel of every block and dtype the tests below run
SPECS = {(block, dtype): KernelSpec(Family.BSR_MMA_SM90, dtype_name(dtype), tile=(*block, TILE_M))
         for block in BLOCKS for dtype in DTYPES}
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = list(SPECS.values())


@pytest.fixture(scope="module")
def mma_kernels():
    """:data:`SPECS`, their kernels loaded."""
    ensure(KERNELS, progress=False)
    return SPECS


def on_mma_kernel(w, block, spec, flags=0, splits=1):
    packed = BsrKernelWeight.pack(w, block)
    packed.kernels = dispatch_string([(0, Launch(spec, splits=splits))], flags)
    return packed


#: the mma kernel's launch `splits` (its longest block row's stored blocks, a hint): 1 keeps
#: one block per lane in flight (2 KB a warp), a long row makes it take two (4 KB) where w < 128
MMA_ROW_HINTS = (1, 10_000)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_small_batch_kernel_matches_fp64(block, dtype, mma_kernels):
    """The small-batch kernel on its own, over batch sizes that leave partial tiles (partial
    tiles of 8 rows and a second CTA row), on a weight with an empty block row, into a poisoned
    y; the splitting of block rows across warps is exercised by a tall weight (few slices:
    split). It runs with one block per lane in flight and with two (its launch's hint of a long
    block row)."""
    gen = torch.Generator().manual_seed(20)
    for (n_blocks, k_blocks), hint in [(shape, hint) for shape in ((5, 7), (2, 40)) for hint in MMA_ROW_HINTS]:
        w = weight(block, n_blocks, k_blocks, 0.4, dtype, seed=21 + k_blocks)
        packed = on_mma_kernel(w, block, mma_kernels[(block, dtype)], splits=hint)
        bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
        for m in (1, 3, 4, 9, 16, 21):
            x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
            error = rel_error(run_poisoned(packed, x, bias, "relu", m), reference(x, w, bias, "relu"))
            assert error <= TOLERANCE[dtype], (n_blocks, k_blocks, hint, m, error)


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_batch_kernel_epilogues_edges_nan_and_graphs(dtype, mma_kernels):
    """Every activation with and without bias; a fully empty and a fully dense weight; NaN/Inf
    of x like dense (checked output by output against IEEE products, through the guard and the
    pass, with one and two blocks per lane in flight, and skipped when the site is unchecked);
    CUDA-graph replay."""
    block = (32, 32)
    spec = mma_kernels[(block, dtype)]
    gen = torch.Generator().manual_seed(30)
    w = weight(block, 6, 8, 0.4, dtype, seed=31)
    packed = on_mma_kernel(w, block, spec)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    x = torch.randn(3, w.shape[1], generator=gen).to(dtype).cuda()
    for activation in ACTIVATION_CODES:
        for b in (None, bias):
            error = rel_error(run(packed, x, b, activation), reference(x, w, b, activation))
            assert error <= TOLERANCE[dtype], (activation, b is not None, error)
    empty = torch.zeros_like(w)
    assert torch.equal(run(on_mma_kernel(empty, block, spec), x, bias, "gelu"),
                       reference(x, empty, bias, "gelu").to(dtype))
    full = weight(block, 6, 8, 1.0, dtype, seed=32, empty_rows=())
    assert rel_error(run(on_mma_kernel(full, block, spec), x, bias, "silu"),
                     reference(x, full, bias, "silu")) <= TOLERANCE[dtype]
    bad = torch.randn(4, w.shape[1], generator=gen).to(dtype).cuda()
    bad[0, 5] = float("nan")
    bad[2, 100] = float("inf")
    bad[2, 200] = float("-inf")
    for m in (1, 4):
        got = run(packed, bad[:m], bias, "relu")
        assert_same_nonfinite(got, ieee_reference(bad[:m], w, bias, "relu").to(dtype), dtype)
    long_rows = on_mma_kernel(w, block, spec, splits=MMA_ROW_HINTS[-1])     # the guard with two blocks per lane
    assert_same_nonfinite(run(long_rows, bad, bias, "relu"), ieee_reference(bad, w, bias, "relu").to(dtype), dtype)
    unchecked = on_mma_kernel(w, block, spec, UNCHECKED_NONFINITE)
    checked, skipped = run(packed, bad, bias, "relu"), run(unchecked, bad, bias, "relu")
    assert torch.equal(skipped[1], checked[1]) and skipped[0].isnan().sum() < checked[0].isnan().sum()
    assert replays_like_eager(lambda x: run(packed, x, None, "gelu_tanh"), x)
