"""Split CSR weights on the GPU (skipped without a Hopper GPU and nvcc): the 2:4 part on the
2:4 kernels (small-batch layout and CUTLASS GEMMs) plus the residual pass in every mode,
against an fp64 reference on random unstructured weights with shapes that are not multiples
of any tile, empty rows, every activation, a weight that already fits 2:4 (no residual), a
fully empty and a fully dense one, NaN/Inf like dense, transposed operands, CUDA graphs and
a compiled model."""
import pytest
import torch
import torch.nn as nn

import sparsecc
from sparsecc.codegen.spec import Family, KernelSpec
from sparsecc.ir.epilogue import ACTIVATION_CODES
from sparsecc.ir.formats import CSR
from sparsecc.ir.workload import dtype_name
from sparsecc.kernels.csr_split import BY_ROWS, GATHER, STAGED, TRANSPOSED, CsrSplitWeight, residual_spec
from sparsecc.kernels.registry import CSR_SPLIT
from sparsecc.kernels.sparse24_small import GEMM, GEMV, MMA

from conftest import TOLERANCE, rel_error, replays_like_eager
from kernel_families.test_bsr_gpu import run
from kernel_families.test_csr_gpu import weight, with_nonfinite
from kernel_families.test_gemm_gpu import reference
from test_bad_input import assert_same_nonfinite, ieee_reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
SHAPES = [(200, 528), (256, 1024), (512, 1024), (1024, 512)]
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = list(dict.fromkeys(
    [residual_spec(dtype) for dtype in DTYPES]
    + [KernelSpec(Family.SM90_COMPRESS24, dtype_name(dtype)) for dtype in DTYPES]
    + [launch.spec for dtype in DTYPES for shape in SHAPES
       for family in (GEMM, MMA, GEMV)
       for _, launch in family.dispatch(dtype, shape)]))


def split(w, planned):
    """``w`` split for the 2:4 kernels packed for ``planned`` rows plus the residual pass, its
    kernels loaded (``registry.CSR_SPLIT``)."""
    packed = CSR_SPLIT.pack(w, CSR, planned)
    assert isinstance(packed, CsrSplitWeight)
    return packed


def with_mode(packed, mode):
    """The same split weight with its residual pass forced to ``mode``."""
    symbol = packed.residual.rsplit(":", 1)[0]
    return CsrSplitWeight(packed.main, packed.residual_values, packed.residual_index, f"{symbol}:{mode}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.05, 0.3])
def test_every_batch_size_and_mode_matches_fp64(density, dtype):
    """A 200 x 528 weight (N and K no multiple of any tile) with an empty row, packed for small
    and large batches, each residual mode (x copied transposed by the rule only for many entries
    at a large batch), M from 1 to 1000, with bias and ReLU."""
    w = weight(200, 528, density, dtype, seed=int(density * 100))
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    for planned in (16, 2048):
        packed = split(w, planned)
        assert packed.residual_entries > 0 and torch.equal(packed.to_dense(), w)
        assert packed.residual.endswith(f":{TRANSPOSED}") == (planned == 2048 and density == 0.3)
        for mode in (BY_ROWS, GATHER, STAGED, TRANSPOSED):
            forced = with_mode(packed, mode)
            for m in (1, 7, 16, 33, 64, 1000):
                x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
                error = rel_error(run(forced, x, bias, "relu"), reference(x, w, bias, "relu"))
                assert error <= TOLERANCE[dtype], (planned, mode, m, error)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(ACTIVATION_CODES))
def test_every_activation_with_and_without_bias(activation, dtype):
    """The activation runs once, after the residual: on y = x W24^T + b + x R^T."""
    w = weight(256, 1024, 0.2, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    for planned, m in ((16, 5), (2048, 257)):
        packed = split(w, planned)
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
        for b in (None, bias):
            error = rel_error(run(packed, x, b, activation), reference(x, w, b, activation))
            assert error <= TOLERANCE[dtype], (activation, m, b is not None, error)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_weight_that_fits_24_runs_without_a_residual(dtype):
    """Nothing beyond two per group of four: no residual pass, the 2:4 kernel's epilogue does it all."""
    w = weight(256, 1024, 0.5, dtype, seed=5)
    groups = w.reshape(256, -1, 4)
    groups[..., 2:] = 0
    packed = split(w, 16)
    assert packed.residual == "" and packed.residual_entries == 0
    x = torch.randn(9, 1024, generator=torch.Generator().manual_seed(6)).to(dtype).cuda()
    assert rel_error(run(packed, x, None, "gelu"), reference(x, w, None, "gelu")) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_empty_and_fully_dense_weights(dtype):
    """Nothing stored: y = act(bias); everything stored: half of it in the residual."""
    gen = torch.Generator().manual_seed(7)
    bias = torch.randn(256, generator=gen).to(dtype).cuda()
    for planned in (16, 2048):
        empty = split(torch.zeros(256, 512, dtype=dtype, device="cuda"), planned)
        assert empty.residual == ""
        full_w = weight(256, 512, 1.1, dtype, seed=8, empty_rows=())
        full = split(full_w, planned)
        assert full.residual_entries == full_w.numel() // 2 and full.residual.endswith(f":{BY_ROWS}")   # 256 entries an output
        for m in (3, 300):
            x = torch.randn(m, 512, generator=gen).to(dtype).cuda()
            expected = reference(x, torch.zeros(256, 512, dtype=dtype, device="cuda"), bias, "silu")
            assert torch.equal(run(empty, x, bias, "silu"), expected.to(dtype)), (planned, m)
            error = rel_error(run(full, x, bias, "silu"), reference(x, full_w, bias, "silu"))
            assert error <= TOLERANCE[dtype], (planned, m, error)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate_like_dense(dtype):
    """A NaN or an infinity of x reaches every output it meets, as in dense F.linear, whether
    its input is stored in W24, in R or in neither (the 2:4 kernels' guard, then the residual)."""
    w = weight(256, 512, 0.3, dtype, seed=9)
    w[:, 100] = 0                                    # an input no output stores
    gen = torch.Generator().manual_seed(10)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    for planned, m in ((16, 8), (2048, 200)):
        packed = split(w, planned)
        x = with_nonfinite(torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda())
        got = run(packed, x, bias, "relu")
        assert_same_nonfinite(got, ieee_reference(x, w, bias, "relu").to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_transposed_input_and_output(dtype):
    w = weight(512, 1024, 0.1, dtype, seed=11)
    gen = torch.Generator().manual_seed(12)
    for planned, m in ((16, 12), (2048, 300)):
        packed = split(w, planned)
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
        expected = reference(x, w, None, "relu")
        got = run(packed, x.t().contiguous(), None, "relu", x_transposed=True, transpose_out=True)
        assert got.shape == (512, m) and rel_error(got.t(), expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_replay_matches_eager(dtype):
    w = weight(1024, 512, 0.1, dtype, seed=13)
    for planned, m in ((16, 4), (2048, 512)):
        packed = split(w, planned)
        x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
        assert replays_like_eager(lambda x: run(packed, x, None, "gelu_tanh"), x), m


def test_compile_packs_unstructured_sites_for_the_fastest_kernel():
    """sparsecc.compile with formats=('csr',) times the CSR kernels on each weight of a 98%-sparse
    MLP at its batch (1024 rows) and packs the fastest: the plan names it with every time, the
    graph runs its op, and the output matches the eager model's."""
    torch.manual_seed(14)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024)).half().cuda().eval()
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.copy_(weight(layer.out_features, layer.in_features, 0.02, torch.float16,
                                      seed=layer.in_features))
    x = torch.randn(1024, 1024, dtype=torch.float16, device="cuda")
    compiled = sparsecc.compile(model, (x,), formats=("csr",))
    targets = {node.target for module in compiled.modules() if isinstance(module, torch.fx.GraphModule)
               for node in module.graph.nodes}
    for site in compiled.sparsecc_plan:
        assert site.choice == "csr" and "split onto the 2:4 kernels" in site.reason
        assert "the tiled CSR kernel" in site.reason, site.reason
        split = "packed for split onto the 2:4 kernels" in site.reason
        assert (torch.ops.sparsecc.linear_split.default in targets) or not split
    with torch.no_grad():
        assert rel_error(compiled(x), model(x)) <= TOLERANCE[torch.float16]
