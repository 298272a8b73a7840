"""The CUDA-core CSR kernel on the GPU (skipped without a Hopper GPU and nvcc): every batch size
around its 8-row tiles, against an fp64 reference, on random unstructured weights with odd
shapes and empty rows, every activation, a fully empty and a fully dense weight, the largest K
it stages, poisoned outputs, NaN/Inf like dense, CUDA graphs, and compile's choice among the
CSR kernels."""
import pytest
import torch
import torch.nn as nn

import sparsecc
from sparsecc.ir.epilogue import ACTIVATION_CODES
from sparsecc.ir.formats import CSR
from sparsecc.kernels.csr_spmm import MAX_K, CsrSpmmWeight, spmm_spec
from sparsecc.kernels.registry import CSR_SPMM
from sparsecc.runtime.kernel_op import ensure

from conftest import TOLERANCE, rel_error, replays_like_eager
from kernel_families.test_bsr_gpu import run
from kernel_families.test_csr_gpu import weight
from kernel_families.test_gemm_gpu import reference
from test_bad_input import assert_same_nonfinite, ieee_reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = [spmm_spec(dtype) for dtype in DTYPES]


def on_spmm(w):
    """``w`` packed for the CUDA-core CSR kernel with its kernel loaded (``registry.CSR_SPMM``)."""
    packed = CSR_SPMM.pack(w, CSR, None)
    assert isinstance(packed, CsrSpmmWeight)
    return packed


def poisoned(packed, x, bias, activation):
    """The kernel called directly on a NaN-filled y: every output must be written."""
    kernel = ensure([spmm_spec(x.dtype)], progress=False)[spmm_spec(x.dtype)]
    y = torch.full((x.shape[0], packed.out_features), float("nan"), dtype=x.dtype, device="cuda")
    kernel.gemm(packed.values.data_ptr(), packed.metadata.data_ptr(), x.data_ptr(),
                bias.data_ptr() if bias is not None else 0, y.data_ptr(), packed.out_features, x.shape[0],
                packed.in_features, ACTIVATION_CODES[activation], torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.01, 0.1])
def test_every_batch_size_matches_fp64(density, dtype):
    """A 200 x 536 weight (N and K no multiple of 64) with an empty row, M around the 8-row
    tiles and beyond, bias and ReLU, into a poisoned y; through the op too."""
    w = weight(200, 536, density, dtype, seed=int(density * 100))
    packed = on_spmm(w)
    assert torch.equal(packed.to_dense(), w)
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    for m in (1, 2, 7, 8, 9, 16, 33, 64, 130, 1000):
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
        expected = reference(x, w, bias, "relu")
        assert rel_error(poisoned(packed, x, bias, "relu"), expected) <= TOLERANCE[dtype], m
        assert rel_error(run(packed, x, bias, "relu"), expected) <= TOLERANCE[dtype], m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(ACTIVATION_CODES))
def test_every_activation_with_and_without_bias(activation, dtype):
    w = weight(256, 1024, 0.05, dtype, seed=3)
    packed = on_spmm(w)
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    for m in (5, 64):
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
        for b in (None, bias):
            error = rel_error(run(packed, x, b, activation), reference(x, w, b, activation))
            assert error <= TOLERANCE[dtype], (activation, m, b is not None, error)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_dense_and_widest_weights(dtype):
    """Nothing stored: y = act(bias); everything stored: the dense product; K at the staging limit."""
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(128, generator=gen).to(dtype).cuda()
    x = torch.randn(11, 256, generator=gen).to(dtype).cuda()
    empty = on_spmm(torch.zeros(128, 256, dtype=dtype, device="cuda"))
    expected = reference(x, torch.zeros(128, 256, dtype=dtype, device="cuda"), bias, "gelu")
    assert torch.equal(poisoned(empty, x, bias, "gelu"), expected.to(dtype))
    full = weight(128, 256, 1.1, dtype, seed=6, empty_rows=())
    assert rel_error(run(on_spmm(full), x, bias, "silu"), reference(x, full, bias, "silu")) <= TOLERANCE[dtype]
    wide = weight(64, MAX_K, 0.01, dtype, seed=7)
    xw = torch.randn(9, MAX_K, generator=gen).to(dtype).cuda()
    assert rel_error(run(on_spmm(wide), xw), reference(xw, wide, None, "none")) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate_like_dense(dtype):
    """An output is NaN where a non-finite input meets a zero of W (0 * NaN in dense), and takes
    the stored products (Inf * w) where every non-finite input of its row is stored."""
    w = weight(192, 512, 0.05, dtype, seed=9)
    w[:10, 100] = 1.0                                 # input 100 stored by outputs 0..9 only
    w[10:, 100] = 0
    gen = torch.Generator().manual_seed(10)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    packed = on_spmm(w)
    for m in (9, 20):
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
        x[3, 5] = float("nan")
        x[7, 100] = float("inf")                      # Inf for outputs 0..9 (stored), NaN for the others
        x[m - 1, 200] = float("-inf")
        got = run(packed, x, bias, "none")
        assert_same_nonfinite(got, ieee_reference(x, w, bias, "none").to(dtype), dtype)
        assert torch.isinf(got[7, :10]).all() and torch.isnan(got[7, 10:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_replay_matches_eager(dtype):
    w = weight(512, 1024, 0.02, dtype, seed=11)
    packed = on_spmm(w)
    for m in (4, 100):
        x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
        assert replays_like_eager(lambda x: run(packed, x, None, "gelu_tanh"), x), m


def test_compile_times_every_csr_kernel_on_a_very_sparse_model():
    """At 1% density and batch 16, compile times the three CSR kernels on each weight and says
    so in the plan; the compiled model matches the eager one."""
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048)).half().cuda().eval()
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.copy_(weight(layer.out_features, layer.in_features, 0.01, torch.float16,
                                      seed=layer.in_features))
    x = torch.randn(16, 2048, dtype=torch.float16, device="cuda")
    compiled = sparsecc.compile(model, (x,), formats=("csr",))
    for site in compiled.sparsecc_plan:
        assert all(name in site.reason for name in ("the tiled CSR kernel", "split onto the 2:4 kernels",
                                                    "the CUDA-core CSR kernel")), site.reason
    with torch.no_grad():
        assert rel_error(compiled(x), model(x)) <= TOLERANCE[torch.float16]
