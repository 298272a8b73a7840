"""The bitmap kernels on the GPU (skipped without a Hopper GPU and nvcc): bitmap_sm90 and
bitmap_wgmma_sm90, every tile of x's rows and every capacity against an fp64 reference, on random unstructured weights with odd K, empty
rows, a fully empty and a fully dense weight, every activation, batch sizes split over K and
not, poisoned outputs, NaN/Inf like dense, and CUDA graphs."""
import pytest
import torch

from sparsecc.codegen.spec import (BITMAP_TILE_M, CSR_CAPACITIES, CSR_SM90_CAPACITIES, CSR_WGMMA_TILE_M, Family,
                                   KernelSpec)
from sparsecc.ir.epilogue import ACTIVATION_CODES
from sparsecc.ir.formats import CSR
from sparsecc.ir.workload import dtype_name
from sparsecc.kernels.bitmap import BitmapKernelWeight, BitmapTiled, dispatch

from conftest import TOLERANCE, rel_error, replays_like_eager
from kernel_families.test_bsr_gpu import run
from kernel_families.test_csr_gpu import launch_poisoned, weight, with_nonfinite
from kernel_families.test_gemm_gpu import reference
from test_bad_input import assert_same_nonfinite, ieee_reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
BITMAP = BitmapTiled()
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = list(dict.fromkeys(
    [launch.spec for dtype in DTYPES for capacity in CSR_CAPACITIES for _, launch in dispatch(dtype, capacity)]
    + [KernelSpec(family, dtype_name(dtype), tile=(64, tile_m, capacity))
       for dtype in DTYPES
       for family, tiles_m, capacities in ((Family.BITMAP_SM90, BITMAP_TILE_M, CSR_SM90_CAPACITIES),
                                           (Family.BITMAP_WGMMA_SM90, CSR_WGMMA_TILE_M, CSR_CAPACITIES))
       for tile_m in tiles_m for capacity in capacities]))


def packed(w):
    """``w`` in the bitmap layout with its dispatch table loaded."""
    result = BITMAP.pack(w, CSR, None)
    assert isinstance(result, BitmapKernelWeight) and torch.equal(result.to_dense(), w)
    return result


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family, tile_m", [(Family.BITMAP_SM90, m) for m in BITMAP_TILE_M]
                         + [(Family.BITMAP_WGMMA_SM90, m) for m in CSR_WGMMA_TILE_M], ids=str)
def test_every_kernel_tile_and_batch_size_matches_fp64(family, tile_m, dtype):
    """Each kernel and tile of x's rows on a weight with K not a multiple of 64 (the last tile
    partial) and an empty row, M from 1 to past the tile, with bias and ReLU, into a poisoned y;
    small batches split over K (the workspace poisoned too)."""
    w = weight(192, 2000, 0.2, dtype, seed=tile_m)
    bitmap = packed(w)
    capacity = bitmap.capacity if family is Family.BITMAP_WGMMA_SM90 else {1536: 2048}.get(bitmap.capacity,
                                                                                          bitmap.capacity)
    spec = KernelSpec(family, dtype_name(dtype), tile=(64, tile_m, capacity))
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    split = False
    for m in (1, 2, 7, 16, 33, 64, 130, 1000):
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
        y, workspace = launch_poisoned(spec, bitmap, x, bias, "relu")
        split |= workspace > 0
        error = rel_error(y, reference(x, w, bias, "relu"))
        assert error <= TOLERANCE[dtype], (m, error)
    assert split, "no batch size was split over K"


@pytest.mark.parametrize("capacity", CSR_CAPACITIES)
def test_every_capacity(capacity):
    """Weights whose fullest tile needs each capacity, through the op's dispatch."""
    density = {256: 0.01, 512: 0.08, 1024: 0.2, 1536: 0.3, 2048: 0.45, 4096: 0.9}[capacity]
    w = weight(256, 1024, density, torch.float16, seed=capacity)
    bitmap = packed(w)
    assert bitmap.capacity == capacity
    gen = torch.Generator().manual_seed(2)
    for m in (4, 40, 300):
        x = torch.randn(m, w.shape[1], generator=gen).half().cuda()
        assert rel_error(run(bitmap, x), reference(x, w, None, "none")) <= TOLERANCE[torch.float16], m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.5, 0.3, 0.1])
def test_model_sized_weights(density, dtype):
    """A 4096 x 4096 weight at the densities pruned LLMs use, at decode batches."""
    w = weight(4096, 4096, density, dtype, seed=int(density * 10))
    bitmap = packed(w)
    gen = torch.Generator().manual_seed(3)
    for m in (1, 16, 64, 2048):
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda()
        assert rel_error(run(bitmap, x), reference(x, w, None, "none")) <= TOLERANCE[dtype], m


@pytest.mark.parametrize("activation", list(ACTIVATION_CODES))
def test_every_activation_with_and_without_bias(activation):
    w = weight(256, 512, 0.1, torch.bfloat16, seed=3)
    bitmap = packed(w)
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(w.shape[0], generator=gen).bfloat16().cuda()
    for m in (5, 257):
        x = torch.randn(m, w.shape[1], generator=gen).bfloat16().cuda()
        for b in (None, bias):
            error = rel_error(run(bitmap, x, b, activation), reference(x, w, b, activation))
            assert error <= TOLERANCE[torch.bfloat16], (activation, m, b is not None, error)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_empty_and_fully_dense_weights(dtype):
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(128, generator=gen).to(dtype).cuda()
    x = torch.randn(3, 256, generator=gen).to(dtype).cuda()
    empty = torch.zeros(128, 256, dtype=dtype, device="cuda")
    bitmap = packed(empty)
    assert bitmap.values.numel() == 0
    assert torch.equal(run(bitmap, x, bias, "gelu"), reference(x, empty, bias, "gelu").to(dtype).expand(3, 128))
    full = weight(128, 256, 1.1, dtype, seed=6, empty_rows=())
    bitmap = packed(full)
    assert bitmap.values.numel() == full.numel() and bitmap.capacity == CSR_CAPACITIES[-1]
    assert rel_error(run(bitmap, x, bias, "silu"), reference(x, full, bias, "silu")) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate_like_dense(dtype):
    """Every tile is multiplied densely, zeros included: NaN and Inf of x reach every output as in
    dense F.linear, checked output by output against IEEE products."""
    w = weight(192, 512, 0.05, dtype, seed=9)
    bitmap = packed(w)
    gen = torch.Generator().manual_seed(10)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).cuda()
    for m in (8, 200):
        x = with_nonfinite(torch.randn(m, w.shape[1], generator=gen).to(dtype).cuda())
        assert_same_nonfinite(run(bitmap, x, bias, "relu"), ieee_reference(x, w, bias, "relu").to(dtype), dtype)


def test_graph_replay_matches_eager():
    w = weight(512, 1024, 0.1, torch.float16, seed=11)
    bitmap = packed(w)
    for m in (4, 512):
        x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m)).half().cuda()
        assert replays_like_eager(lambda x: run(bitmap, x, None, "gelu_tanh"), x), m
