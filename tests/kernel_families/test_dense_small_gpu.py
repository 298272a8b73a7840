"""The dense small-batch kernel on the GPU (templates/gemv_mma_sm90_dense; skipped without a
Hopper GPU and nvcc): every tiling and cluster size against an fp64 reference at every M in
1..64 and past it on an odd shape, every activation, bias or none, poisoned outputs; NaN and
Inf of x propagating as in F.linear; the op with transposed layouts, 1-D input and a CUDA
graph. Which batch sizes it takes is tests/kernel_families/test_tune.py's subject."""
import pytest
import torch
import torch.nn.functional as F

from sparsecc.codegen.spec import Family, KernelSpec
from sparsecc.ir.epilogue import ACTIVATION_CODES
from sparsecc.ir.workload import dtype_name
from sparsecc.kernels.base import Launch
from sparsecc.kernels.dense import SMALL, DenseGemm
from sparsecc.runtime.kernel_op import dispatch_string, ensure, linear_kernel

from conftest import TOLERANCE, rel_error, replays_like_eager
from kernel_families.test_gemm_gpu import every_candidate, reference, run_poisoned

pytestmark = pytest.mark.gpu

ODD = (264, 1040)       # N, K: not multiples of the 16-feature units, K not of the 64-input units
DTYPES = [torch.float16, torch.bfloat16]
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = list(dict.fromkeys(launch.spec for dtype in DTYPES for launch in every_candidate(SMALL, dtype, [ODD])))


def dense_weight(n, k, dtype, seed=0):
    """A dense weight scaled like a trained layer's (1/sqrt(K))."""
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5).to(dtype).cuda()


def small_batch_table(n, k, dtype):
    """The dense dispatch table with the small-batch kernel in every bucket up to M=128 (its
    kernel loaded: the tests below run no more rows)."""
    launch = Launch(KernelSpec(Family.GEMV_MMA_SM90_DENSE, dtype_name(dtype)), splits=0)
    ensure([launch.spec], progress=False)
    return dispatch_string([(128, launch)] + [e for e in DenseGemm().dispatch(dtype, (n, k)) if e[0] == 0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_tiling_and_cluster_at_every_batch_size(dtype):
    w = dense_weight(*ODD, dtype)
    bias = torch.randn(ODD[0], dtype=dtype, device="cuda")
    x_all = torch.randn(130, ODD[1], dtype=dtype, device="cuda")
    for launch in every_candidate(SMALL, dtype, [ODD]):
        for m in list(range(1, 65)) + [97, 128, 130]:
            x = x_all[:m]
            y = run_poisoned(launch, w, None, x, bias, ODD[0], "relu")
            assert not torch.isnan(y).any(), (launch.label, m, "unwritten output")
            error = rel_error(y, reference(x, w, bias, "relu"))
            assert error < TOLERANCE[dtype], (launch.label, m, error)


@pytest.mark.parametrize("activation", list(ACTIVATION_CODES))
@pytest.mark.parametrize("with_bias", [True, False])
def test_activations_and_bias_on_a_real_shape(activation, with_bias):
    dtype = torch.bfloat16
    w = dense_weight(4096, 4096, dtype)
    bias = torch.randn(4096, dtype=dtype, device="cuda") if with_bias else None
    table = small_batch_table(4096, 4096, dtype)
    for m in (1, 3, 8, 16, 40, 128):
        x = torch.randn(m, 4096, dtype=dtype, device="cuda")
        got = linear_kernel(x, w, None, 4096, 4096, bias, activation, False, False, table)
        assert rel_error(got, reference(x, w, bias, activation)) < TOLERANCE[dtype], m


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_inputs_propagate_as_in_dense(dtype):
    w = dense_weight(1024, 4096, dtype)
    w[7] = 0                                  # 0 * Inf = NaN there too, as in F.linear
    x = torch.randn(5, 4096, dtype=dtype, device="cuda")
    x[1, 100], x[3, 4095] = float("nan"), float("inf")
    table = small_batch_table(1024, 4096, dtype)
    got = linear_kernel(x, w, None, 1024, 4096, None, "none", False, False, table).float()
    expected = F.linear(x.float(), w.float())
    assert torch.isnan(got[1]).all() and not torch.isfinite(got[3]).any() and torch.isnan(got[3, 7])
    assert torch.equal(torch.isnan(got), torch.isnan(expected)) and torch.equal(got.isinf(), expected.isinf())
    assert torch.equal(got[got.isinf()], expected[expected.isinf()])       # the infinities' signs
    finite = torch.isfinite(expected)
    assert rel_error(got[finite], expected[finite]) < TOLERANCE[dtype]


def test_layouts_one_dimensional_input_and_graph_capture():
    dtype = torch.float16
    w = dense_weight(1024, 4096, dtype)
    table = small_batch_table(1024, 4096, dtype)
    xt = torch.randn(4096, 5, dtype=dtype, device="cuda")
    got = linear_kernel(xt, w, None, 1024, 4096, None, "silu", True, True, table)
    assert got.shape == (1024, 5)
    assert rel_error(got, reference(xt.t(), w, None, "silu").t()) < TOLERANCE[dtype]
    v = torch.randn(4096, dtype=dtype, device="cuda")
    got = linear_kernel(v, w, None, 1024, 4096, None, "gelu", False, False, table)
    assert got.shape == (1024,) and rel_error(got, reference(v[None], w, None, "gelu")[0]) < TOLERANCE[dtype]
    x = torch.randn(4, 4096, dtype=dtype, device="cuda")
    assert replays_like_eager(lambda x: linear_kernel(x, w, None, 1024, 4096, None, "relu", False, False,
                                                      table), x)
