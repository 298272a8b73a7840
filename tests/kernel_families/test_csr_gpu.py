"""The CSR tensor-core kernels on the GPU (skipped without a Hopper GPU and nvcc): csr_sm90 up
to 16 rows of x and csr_wgmma_sm90 beyond, every tile of x's rows and every tile capacity, against an fp64 reference, on random unstructured
weights with odd K, empty rows, a fully empty and a fully dense weight, every activation,
batch sizes 1..64 (split over K) and beyond (not split), poisoned outputs, NaN/Inf like
dense, CUDA graphs, and a compiled model."""
import pytest
import torch
import torch.nn as nn

import sparsecc
from sparsecc.codegen.spec import CSR_CAPACITIES, CSR_SM90_CAPACITIES, CSR_TILE_M, CSR_WGMMA_TILE_M, Family, KernelSpec
from sparsecc.ir.epilogue import ACTIVATION_CODES
from sparsecc.ir.formats import CSR
from sparsecc.ir.workload import dtype_name
from sparsecc.kernels.csr import CsrKernelWeight, dispatch
from sparsecc.kernels.registry import CSR_TILED
from sparsecc.runtime.kernel_op import ensure
from sparsecc.runtime.loader import loaded

from conftest import TOLERANCE, rel_error, replays_like_eager
from kernel_families.test_bsr_gpu import run
from kernel_families.test_gemm_gpu import reference
from test_bad_input import assert_same_nonfinite, ieee_reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = ([launch.spec for dtype in DTYPES for capacity in CSR_CAPACITIES for _, launch in dispatch(dtype, capacity)]
           + [KernelSpec(family, dtype_name(dtype), tile=(64, tile_m, capacity))
              for dtype in DTYPES
              for family, tiles_m, capacities in ((Family.CSR_SM90, CSR_TILE_M, CSR_SM90_CAPACITIES),
                                                  (Family.CSR_WGMMA_SM90, CSR_WGMMA_TILE_M, CSR_CAPACITIES))
              for capacity in capacities for tile_m in tiles_m])


def weight(n, k, density, dtype, seed=0, empty_rows=(3,)):
    """A random unstructured weight scaled like a trained layer's; the listed rows are empty."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, k, generator=gen) / k ** 0.5
    dense = dense * (torch.rand(n, k, generator=gen) < density)
    dense[list(empty_rows)] = 0
    return dense.to(dtype).cuda()


def with_nonfinite(x):
    """``x`` (at least 8 rows, 512 columns) with NaN at (3, 5) and (m - 1, 511), +Inf at (7, 100)
    and -Inf at (7, 200)."""
    x[3, 5] = float("nan")
    x[7, 100] = float("inf")
    x[7, 200] = float("-inf")
    x[x.shape[0] - 1, 511] = float("nan")
    return x


def tiled(w):
    """``w`` packed for the tiled CSR kernels with its dispatch table loaded (``registry.CSR_TILED``)."""
    packed = CSR_TILED.pack(w, CSR, None)
    assert isinstance(packed, CsrKernelWeight)
    return packed


def launch_poisoned(spec, packed, x, bias, activation):
    """``spec``'s kernel called directly (its own workspace) on a NaN-filled y."""
    kernel = ensure([spec], progress=False)[spec]
    n, m, k = packed.out_features, x.shape[0], packed.in_features
    y = torch.full((m, n), float("nan"), dtype=x.dtype, device="cuda")
    size = kernel.workspace_size(n, m, k, 1, 1)
    workspace = torch.full((max(size, 1),), 255, dtype=torch.uint8, device="cuda")
    kernel.gemm(packed.values.data_ptr(), packed.metadata.data_ptr(), x.data_ptr(),
                bias.data_ptr() if bias is not None else 0, y.data_ptr(), n, m, k, ACTIVATION_CODES[activation],
                torch.cuda.current_stream().cuda_stream, workspace=workspace.data_ptr() if size else 0)
    torch.cuda.synchronize()
    return y, size


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family, tile_m", [(Family.CSR_SM90, m) for m in CSR_TILE_M]
                         + [(Family.CSR_WGMMA_SM90, m) for m in CSR_WGMMA_TILE_M], ids=str)
def test_every_kernel_tile_and_batch_size_matches_fp64(family, tile_m, dtype):
    """Each kernel and tile of x's rows on a weight with K not a multiple of 64 (the last tile is
    partial) and an empty row, M from 1 to past the tile, with bias and ReLU, into a poisoned y;
    small batches split over K (the workspace is poisoned too)."""
    w = weight(192, 2000, 0.2, dtype, seed=tile_m)
    packed = tiled(w)
    assert torch.equal(packed.to_dense(), w)
    spec = KernelSpec(family, dtype_name(dtype), tile=(64, tile_m, packed.capacity))
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    split = False
    for m in (1, 2, 7, 16, 33, 64, 130, 1000):
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
        y, workspace = launch_poisoned(spec, packed, x, bias, "relu")
        split |= workspace > 0
        error = rel_error(y, reference(x, w, bias, "relu"))
        assert error <= TOLERANCE[dtype], (m, error)
    assert split, "no batch size was split over K"


@pytest.mark.parametrize("capacity", CSR_CAPACITIES)
def test_every_tile_capacity(capacity):
    """Weights whose fullest tile needs each capacity (a quarter, half and all of a tile stored),
    through the op's dispatch at small and large batches."""
    density = {256: 0.01, 512: 0.08, 1024: 0.2, 1536: 0.3, 2048: 0.45, 4096: 0.9}[capacity]
    w = weight(256, 1024, density, torch.float16, seed=capacity)
    packed = tiled(w)
    assert packed.capacity == capacity
    gen = torch.Generator().manual_seed(2)
    for m in (4, 300):
        x = torch.randn(m, w.shape[1], generator=gen).half().cuda()
        assert rel_error(run(packed, x), reference(x, w, None, "none")) <= TOLERANCE[torch.float16], m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(ACTIVATION_CODES))
def test_every_activation_with_and_without_bias(activation, dtype):
    w = weight(256, 512, 0.1, dtype, seed=3)
    packed = tiled(w)
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    for m in (5, 257):
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
        for b in (None, bias):
            error = rel_error(run(packed, x, b, activation), reference(x, w, b, activation))
            assert error <= TOLERANCE[dtype], (activation, m, b is not None, error)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_empty_and_fully_dense_weights(dtype):
    """Nothing stored: y = act(bias) everywhere; everything stored: the dense product."""
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(128, generator=gen).to(dtype).cuda()
    for m in (3, 300):
        x = torch.randn(m, 256, generator=gen).to(dtype).cuda()
        empty = torch.zeros(128, 256, dtype=dtype, device="cuda")
        packed = tiled(empty)
        assert packed.values.numel() == 0
        assert torch.equal(run(packed, x, bias, "gelu"), reference(x, empty, bias, "gelu").to(dtype).expand(m, 128))
        full = weight(128, 256, 1.1, dtype, seed=6, empty_rows=())
        packed = tiled(full)
        assert packed.values.numel() == full.numel() and packed.capacity == CSR_CAPACITIES[-1]
        assert rel_error(run(packed, x, bias, "silu"), reference(x, full, bias, "silu")) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_unbalanced_rows(dtype):
    """One full row among nearly empty ones, on a model-sized weight at decode and prefill batches."""
    w = weight(1024, 4096, 0.01, dtype, seed=7, empty_rows=(0, 500))
    w[77] = (torch.randn(4096) / 64).to(dtype).cuda()
    packed = tiled(w)
    gen = torch.Generator().manual_seed(8)
    for m in (1, 64, 2048):
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
        assert rel_error(run(packed, x), reference(x, w, None, "none")) <= TOLERANCE[dtype], m


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate_like_dense(dtype):
    """The kernel multiplies every tile densely, zeros included, so a NaN or an infinity of x
    reaches every output as in dense F.linear, without a separate pass: checked output by
    output against IEEE products, split over K and not."""
    w = weight(192, 512, 0.05, dtype, seed=9)
    packed = tiled(w)
    gen = torch.Generator().manual_seed(10)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    for m in (8, 200):
        x = with_nonfinite(torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda())
        got = run(packed, x, bias, "relu")
        assert_same_nonfinite(got, ieee_reference(x, w, bias, "relu").to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_replay_matches_eager(dtype):
    """Split-K (workspace from torch's allocator) and not, captured in a CUDA graph and replayed
    on new inputs."""
    w = weight(512, 1024, 0.1, dtype, seed=11)
    packed = tiled(w)
    for m in (4, 512):
        x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
        assert replays_like_eager(lambda x: run(packed, x, None, "gelu_tanh"), x), m


def test_compile_runs_unstructured_sites_on_the_kernel():
    """sparsecc.compile with formats=('csr',) packs a 90%-sparse MLP for the CSR kernels (the plan
    says so, with the packed size) and matches the eager model."""
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 256)).half().cuda().eval()
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.copy_(weight(layer.out_features, layer.in_features, 0.1, torch.float16,
                                      seed=layer.in_features))
    x = torch.randn(16, 512, dtype=torch.float16, device="cuda")
    compiled = sparsecc.compile(model, (x,), formats=("csr",))
    plan = compiled.sparsecc_plan
    assert all(site.choice == "csr" and "CSR kernel" in site.reason for site in plan), plan.table()
    # the tiled layout stores 4 bytes per entry, the CUDA-core one 6; a weight packed split stores its 2:4 part
    assert all(site.bytes_after < 0.35 * site.bytes_before or "packed for split" in site.reason
               for site in plan), plan.table()
    with torch.no_grad():
        assert rel_error(compiled(x), model(x)) <= TOLERANCE[torch.float16]
    assert any(name.startswith("sparsecc_csr_sm90") for name in loaded())
