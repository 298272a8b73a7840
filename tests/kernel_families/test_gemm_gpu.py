"""The generated CUTLASS kernels on the GPU (skipped without a Hopper GPU and nvcc):
exact 2:4 compression, every kernel against an fp64 reference, every activation, odd
shapes and batch sizes, poisoned outputs, other operand layouts, CUDA graphs, and compile."""
import pytest
import torch
import torch.nn as nn

import sparsecc
from sparsecc.codegen.spec import Family, KernelSpec, Scheduler
from sparsecc.ir.epilogue import ACTIVATION_CODES, apply_activation
from sparsecc.ir.formats import NM_2_4
from sparsecc.ir.workload import dtype_name
from sparsecc.kernels.base import Launch
from sparsecc.kernels.dense import DenseGemm
from sparsecc.kernels.sparse24 import CutlassSparse24Weight
from sparsecc.kernels.sparse24_small import GEMM
from sparsecc.runtime.kernel_op import ensure, linear_kernel

from conftest import TOLERANCE, kernels_of_24_sites, n_m, rel_error
from test_bad_input import assert_same_nonfinite, ieee_reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
SHAPES = [(264, 1040), (1024, 4096), (3072, 768)]     # N, K: not multiples of the tiles, and real ones
ROWS = [1, 7, 33, 1000]
#: the CUTLASS GEMM families: 2:4 (sparsecc.kernels.sparse24) and dense (sparsecc.kernels.dense)
DENSE = DenseGemm()
GEMMS = [GEMM, DENSE]


def family_id(family):
    return family.name


def sparse_weight(n, k, dtype, seed=0):
    """A 2:4 weight scaled like a trained layer's (1/sqrt(K)), so fp16 never overflows."""
    return (n_m(n, k, 2, 4, torch.Generator().manual_seed(seed)) / k ** 0.5).to(dtype).cuda()


def reference(x, w, bias, activation):
    y = x.double() @ w.double().t()
    if bias is not None:
        y = y + bias.double()
    return apply_activation(y, activation)


def run_poisoned(launch, a, e, x, bias, n, activation, transpose_out=False, x_transposed=False):
    """Run one launch directly on a NaN-filled output and return it."""
    kernel = ensure([launch.spec])[launch.spec]
    m = x.shape[1] if x_transposed else x.shape[0]
    k = x.shape[0] if x_transposed else x.shape[1]
    y = torch.full((n, m) if transpose_out else (m, n), float("nan"), dtype=x.dtype, device="cuda")
    size = kernel.workspace_size(n, m, k, launch.swizzle, launch.splits)
    workspace = torch.full((size,), 0xAB, dtype=torch.uint8, device="cuda") if size else None
    kernel.gemm(a.data_ptr(), e.data_ptr() if e is not None else 0, x.data_ptr(),
                bias.data_ptr() if bias is not None else 0, y.data_ptr(), n, m, k, ACTIVATION_CODES[activation],
                torch.cuda.current_stream().cuda_stream, swizzle=launch.swizzle, splits=launch.splits,
                workspace=workspace.data_ptr() if workspace is not None else 0)
    torch.cuda.synchronize()
    return y


def every_candidate(family, dtype, shapes):
    """Every launch tuning times for a tunable ``family`` at these shapes, over all its buckets."""
    return list(dict.fromkeys(launch for shape in shapes for _, m in family.buckets
                              for launch in family.candidates(dtype, shape, m)))


def launches_to_test(family, dtype):
    """Every candidate launch in fp16 (the tuning sweep's), the dispatched ones in bf16."""
    if dtype == torch.float16:
        return every_candidate(family, dtype, SHAPES)
    return list(dict.fromkeys(launch for shape in SHAPES for _, launch in family.dispatch(dtype, shape)))


LAYOUTS = [dict(x_transposed=True), dict(transpose_out=True)]
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = kernels_of_24_sites(SHAPES + [(4096, 1024)], DTYPES)
KERNELS += [launch.spec for family in GEMMS for dtype in DTYPES for launch in launches_to_test(family, dtype)]
KERNELS += [KernelSpec(family, "float16", **layout) for family in (Family.SM90_SPARSE24, Family.SM90_DENSE)
            for layout in LAYOUTS]
KERNELS += [KernelSpec(Family.SM90_DENSE, "float16", tile=(128, 64, 64), scheduler=Scheduler.SLICED, **layout)
            for layout in [{}] + LAYOUTS]
SLICED_24 = {"tile": (128, 32, 128), "scheduler": Scheduler.SLICED}
KERNELS += [KernelSpec(Family.SM90_SPARSE24, dtype, **SLICED_24, **layout)
            for dtype in ("float16", "bfloat16") for layout in [{}] + LAYOUTS]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_compression_round_trips_exactly(dtype, shape):
    w = sparse_weight(*shape, dtype)
    packed = GEMM.pack(w, NM_2_4, None)
    assert isinstance(packed, CutlassSparse24Weight)
    assert packed.values.numel() >= w.numel() // 2
    assert torch.equal(packed.to_dense(), w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", GEMMS, ids=family_id)
def test_every_kernel_matches_the_reference(dtype, family):
    launches = launches_to_test(family, dtype)
    ensure([launch.spec for launch in launches])
    gen = torch.Generator().manual_seed(7)
    for n, k in SHAPES:
        w = sparse_weight(n, k, dtype, seed=n + k)
        if family is GEMM:
            packed = CutlassSparse24Weight.compress(w)
            a, e = packed.values, packed.metadata
        else:
            a, e = w, None
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen).to(dtype).cuda()
            bias = torch.randn(n, generator=gen).to(dtype).cuda()
            for launch in launches:
                for activation in ACTIVATION_CODES:
                    for b in (bias, None):
                        y = run_poisoned(launch, a, e, x, b, n, activation)
                        assert not torch.isnan(y).any(), (launch.label, rows, n, k, "unwritten output")
                        error = rel_error(y, reference(x, w, b, activation))
                        assert error < TOLERANCE[dtype], (launch.label, rows, n, k, activation, error)


@pytest.mark.parametrize("family", [Family.SM90_SPARSE24, Family.SM90_DENSE])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_other_operand_layouts(family, layout):
    dtype = torch.float16
    launch = Launch(KernelSpec(family, "float16", **layout))
    n, k, rows = 264, 1040, 40                               # rows a multiple of 8: 16-byte aligned
    w = sparse_weight(n, k, dtype, seed=3)
    if family is Family.SM90_SPARSE24:
        packed = CutlassSparse24Weight.compress(w)
        a, e = packed.values, packed.metadata
    else:
        a, e = w, None
    x = torch.randn(rows, k, dtype=dtype, device="cuda")
    bias = torch.randn(n, dtype=dtype, device="cuda")
    operand = x.t().contiguous() if layout.get("x_transposed") else x
    y = run_poisoned(launch, a, e, operand, bias, n, "gelu", **layout)
    ref = reference(x, w, bias, "gelu")
    assert rel_error(y, ref.t() if layout.get("transpose_out") else ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("layout", [{}] + LAYOUTS)
@pytest.mark.parametrize("splits", [1, 4, 7, 16])
def test_sliced_dense_kernel_sums_its_slices(layout, splits):
    """K cut into slices (split-K as a batch), in every operand layout: 1 picks the count, 7 does
    not divide K = 1040 into multiples of 8 and falls back to 5, 16 leaves slices shorter than
    two k-tiles and falls back too; a workspace filled with garbage must not leak into y."""
    dtype = torch.float16
    launch = Launch(KernelSpec(Family.SM90_DENSE, "float16", tile=(128, 64, 64), scheduler=Scheduler.SLICED,
                               **layout), splits=splits)
    n, k, rows = 264, 1040, 40
    w = sparse_weight(n, k, dtype, seed=5)
    x = torch.randn(rows, k, dtype=dtype, device="cuda")
    bias = torch.randn(n, dtype=dtype, device="cuda")
    operand = x.t().contiguous() if layout.get("x_transposed") else x
    for activation in ("relu", "gelu"):
        y = run_poisoned(launch, w, None, operand, bias, n, activation, **layout)
        ref = reference(x, w, bias, activation)
        assert rel_error(y, ref.t() if layout.get("transpose_out") else ref) < TOLERANCE[dtype], (splits, activation)


@pytest.mark.parametrize("layout", [{}] + LAYOUTS)
@pytest.mark.parametrize("splits", [1, 2, 3, 16])
def test_sliced_24_kernel_sums_slices_of_the_one_compressed_weight(layout, splits):
    """The 2:4 GEMM with K in slices over one compressed weight, in every operand layout: 1 picks
    the count, 3 does not cut K = 2048 into whole 128-column atoms and falls back to 2, 16 leaves
    slices shorter than two k-tiles and falls back to 8; a workspace of garbage must not leak into y."""
    dtype = torch.float16
    launch = Launch(KernelSpec(Family.SM90_SPARSE24, "float16", **SLICED_24, **layout), splits=splits)
    n, k, rows = 264, 2048, 40
    w = sparse_weight(n, k, dtype, seed=6)
    packed = CutlassSparse24Weight.compress(w)
    x = torch.randn(rows, k, dtype=dtype, device="cuda")
    bias = torch.randn(n, dtype=dtype, device="cuda")
    operand = x.t().contiguous() if layout.get("x_transposed") else x
    for activation in ("relu", "gelu"):
        y = run_poisoned(launch, packed.values, packed.metadata, operand, bias, n, activation, **layout)
        ref = reference(x, w, bias, activation)
        assert rel_error(y, ref.t() if layout.get("transpose_out") else ref) < TOLERANCE[dtype], (splits, activation)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliced_24_kernel_propagates_nan_and_inf_from_any_slice(dtype):
    """NaN and infinities in x, in the first, a middle and the last K slice and in a column no row
    of W stores, reach y as in dense IEEE arithmetic: the slices' sum raises the site's guard as
    the unsliced epilogue's probe does, and the pass after it poisons what the sparse products
    skipped; a second, finite call finds the guard lowered again."""
    n, k, rows = 256, 4096, 24
    w = sparse_weight(n, k, dtype, seed=8)
    w[:, 5] = 0                                            # a column no row stores
    packed = GEMM.pack(w, NM_2_4, None)
    launch = Launch(KernelSpec(Family.SM90_SPARSE24, dtype_name(dtype), **SLICED_24), splits=4)
    ensure([launch.spec])
    kernels = packed.running([(0, launch)]).kernels
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(rows, k, generator=gen).to(dtype).cuda()
    bad = x.clone()
    bad[1, 5], bad[3, 40] = float("nan"), float("inf")     # first slice (one in the unstored column)
    bad[7, 2100], bad[11, 4095] = float("-inf"), float("nan")   # a middle and the last slice
    bias = torch.randn(n, generator=gen).to(dtype).cuda()
    got = linear_kernel(bad, packed.values, packed.metadata, n, k, bias, "none", False, False, kernels)
    assert_same_nonfinite(got, ieee_reference(bad, w, bias, "none").to(dtype), dtype)
    again = linear_kernel(x, packed.values, packed.metadata, n, k, bias, "none", False, False, kernels)
    assert rel_error(again, reference(x, w, bias, "none")) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_under_cuda_graph_capture(dtype):
    w = sparse_weight(1024, 4096, dtype)
    packed = GEMM.pack(w, NM_2_4, None)
    bias = torch.randn(1024, dtype=dtype, device="cuda")
    x = torch.randn(16, 4096, dtype=dtype, device="cuda")
    args = (packed.values, packed.metadata, 1024, 4096, bias, "silu", False, False, packed.kernels)
    eager = linear_kernel(x, *args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = linear_kernel(x, *args)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(captured, reference(x, w, bias, "silu")) < TOLERANCE[dtype]
    assert not torch.equal(captured, eager)


def test_compile_runs_24_sites_on_the_kernel():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024), nn.Linear(1024, 20)).half().cuda().eval()
    with torch.no_grad():
        for layer in (model[0], model[2], model[3]):
            shape = layer.weight.shape
            layer.weight.copy_((n_m(*shape, 2, 4, torch.Generator().manual_seed(1)) / shape[1] ** 0.5).half())
    x = torch.randn(2, 64, 1024, dtype=torch.float16, device="cuda")
    compiled = sparsecc.compile(model, x, formats=("2:4",))
    plan = compiled.sparsecc_plan
    assert [s.choice for s in plan] == ["2:4", "2:4", "2:4"]
    assert "not sparsecc's kernel" in plan["3"].reason            # N=20: not a multiple of 8
    ops_used = {str(n.target) for n in compiled.graph.nodes if n.op == "call_function"}
    assert "sparsecc.linear_kernel.default" in ops_used and "sparsecc.linear_nm.default" in ops_used
    with torch.no_grad():
        for rows in (1, 5, 64):
            fresh = torch.randn(3, rows, 1024, dtype=torch.float16, device="cuda")
            got, want = compiled(fresh), model(fresh)
            assert torch.isfinite(want).all() and rel_error(got, want) < 1e-2
