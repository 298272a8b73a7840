"""Bad and unusual inputs at the CUDA kernel op, sparsecc::linear_kernel with a CUTLASS 2:4
weight: the CPU ops' cases of tests/test_bad_input.py (skipped without a Hopper GPU and nvcc).

Its errors are checked as ValueError: the Python implementation raises InputError (a
ValueError), the C++ launcher a ValueError from TORCH_CHECK_VALUE.
"""
import pytest
import torch

from sparsecc.codegen.spec import Family, KernelSpec, Schedule
from sparsecc.ir.epilogue import ACTIVATION_CODES, UNCHECKED_NONFINITE
from sparsecc.ir.formats import NM_2_4
from sparsecc.ir.workload import dtype_name
from sparsecc.kernels import nonfinite_guard
from sparsecc.kernels.dense import DenseGemm
from sparsecc.kernels.sparse24_small import GEMM, GEMV, MMA
from sparsecc.runtime.kernel_op import dispatch_string, ensure, kernel_for, linear_kernel

from conftest import assert_rel_close, kernels_of_24_sites, n_m
from runtime.test_torch_ops import reference
from test_bad_input import assert_same_nonfinite, ieee_reference, scattered_nonfinite
from test_fuzz import make_input

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
N, K = 64, 128
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = kernels_of_24_sites([(N, K), (136, 544)], DTYPES)
KERNELS += [launch.spec for dtype in DTYPES for _, launch in DenseGemm().dispatch(dtype, (N, K))]
#: GEMMs other than the dispatched ones: the two other operand layouts and a pingpong kernel
OTHER_KERNELS = [dict(x_transposed=True), dict(transpose_out=True),
                 dict(tile=(128, 128, 128), schedule=Schedule.PINGPONG)]
KERNELS += [KernelSpec(Family.SM90_SPARSE24, "float16", **layout) for layout in OTHER_KERNELS]


@pytest.fixture(scope="module", params=DTYPES, ids=["float16", "bfloat16"])
def site(request):
    """A 2:4 weight [N, K] (scaled like a trained layer's) and its CUTLASS packing."""
    dtype = request.param
    w = (n_m(N, K, 2, 4, torch.Generator().manual_seed(5)) / K ** 0.5).to(dtype).cuda()
    return w, GEMM.pack(w, NM_2_4, None)


def run(packed, x, bias=None, activation="none", x_transposed=False, transpose_out=False):
    return packed.op(x, *packed.tensors().values(), *packed.scalars().values(), bias, activation,
                     x_transposed, transpose_out, *packed.extra_args)


def test_wrong_input_dtype_raises(site):
    w, packed = site
    other = torch.bfloat16 if w.dtype == torch.float16 else torch.float16
    for dtype in (torch.float32, other):
        with pytest.raises(ValueError, match="input dtype"):
            run(packed, torch.randn(3, K, device="cuda").to(dtype))


@pytest.mark.parametrize("shape, x_transposed", [((3, K + 16), False), ((3, K - 1), False),
                                                 ((2, 3, K + 8), False), ((K + 16, 3), True), ((K // 2,), False)])
def test_feature_mismatch_names_both_sizes(site, shape, x_transposed):
    w, packed = site
    given = shape[-2] if x_transposed else shape[-1]
    with pytest.raises(ValueError, match=rf"input has {given} features along K, the weight expects {K}\b"):
        run(packed, torch.randn(*shape, device="cuda").to(w.dtype), x_transposed=x_transposed)


def test_unknown_activation_raises(site):
    w, packed = site
    for activation in ("tanh", "", "RELU"):
        with pytest.raises(ValueError, match=rf"unknown activation {activation!r}"):
            run(packed, torch.randn(3, K, device="cuda").to(w.dtype), activation=activation)


def test_bias_of_the_wrong_length_raises(site):
    w, packed = site
    for shape in ((N - 1,), (N + 8,), (1,), (1, N)):
        bias = torch.randn(shape, device="cuda").to(w.dtype)
        for rows in (3, 0):
            with pytest.raises(ValueError, match=rf"bias of shape .* for a weight with {N} outputs"):
                run(packed, torch.randn(rows, K, device="cuda").to(w.dtype), bias)


def test_bias_of_another_dtype_is_cast(site):
    w, packed = site
    x = torch.randn(5, K, device="cuda").to(w.dtype)
    bias = torch.randn(N, device="cuda", dtype=torch.float32)
    got = run(packed, x, bias, "gelu")
    assert got.dtype == w.dtype
    assert torch.equal(got, run(packed, x, bias.to(w.dtype), "gelu"))
    assert_rel_close(got, reference(x, w, bias.to(w.dtype), "gelu", False, False), w.dtype)


@pytest.mark.parametrize("layout", ["transposed", "strided", "offset"])
@pytest.mark.parametrize("x_transposed", [False, True])
@pytest.mark.parametrize("transpose_out", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_noncontiguous_and_misaligned_inputs(site, layout, x_transposed, transpose_out, rows):
    """A transposed view, a step slice (NaN in its gaps) and a view one element past an
    aligned start (NaN before it; TMA needs 16-byte alignment) give the fp64 reference."""
    w, packed = site
    shape = (2, K, rows) if x_transposed else (2, rows, K)
    x = make_input(shape, w.dtype, layout, torch.Generator().manual_seed(rows), "cuda")
    if layout == "offset":
        assert x.data_ptr() % 16
    elif rows > 1:                         # a transposed view of one row is contiguous
        assert not x.is_contiguous()
    bias = torch.randn(N, device="cuda").to(w.dtype)
    got = run(packed, x, bias, "silu", x_transposed, transpose_out)
    torch.cuda.synchronize()
    assert got.is_contiguous()
    assert_rel_close(got, reference(x, w, bias, "silu", x_transposed, transpose_out), w.dtype)


@pytest.mark.parametrize("shape, x_transposed, transpose_out, expected", [
    ((0, K), False, False, (0, N)), ((2, 0, K), False, False, (2, 0, N)),
    ((0, K), False, True, (N, 0)), ((2, 0, K), False, True, (2, N, 0)),
    ((K, 0), True, False, (0, N)), ((0, K, 3), True, True, (0, N, 3))])
def test_empty_batch(site, shape, x_transposed, transpose_out, expected):
    w, packed = site
    x = torch.randn(*shape, device="cuda").to(w.dtype)
    bias = torch.randn(N, device="cuda").to(w.dtype)
    got = run(packed, x, bias, "relu", x_transposed, transpose_out)
    assert tuple(got.shape) == expected and got.dtype == w.dtype and got.is_cuda


#: the 2:4 layouts: CUTLASS's (the GEMMs, fixed up after the product) and the small-batch
#: kernels' (checked inside the kernel), by family and the batch a site is packed for it at
PACKINGS = {"gemm": (GEMM, None), "gemv": (GEMV, 1), "gemv-mma": (MMA, 4)}


def pack_24(packing, w):
    """``w`` packed for the family of ``packing``, its dispatch table's kernels loaded."""
    family, m = PACKINGS[packing]
    return family.pack(w, NM_2_4, m)


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
def test_nan_and_inf_propagate_like_dense(site, packing, activation):
    """As on the CPU: NaN and infinities of x meet the weight's zeros as in dense F.linear,
    including a group of four all-zero columns and the zeros of every 2:4 group."""
    w, _ = site
    w = w.clone()
    w[:, :4] = 0                                  # a group with nothing kept
    packed = pack_24(packing, w)
    x = torch.randn(6, K, device="cuda").to(w.dtype)
    x[0, 3] = float("nan")                        # meets only zeros
    x[1, 2] = float("inf")                        # meets only zeros
    x[2, 9] = float("nan")                        # meets values and zeros
    x[3, 10] = float("inf")
    x[4, 17] = -float("inf")
    bias = torch.randn(N, device="cuda").to(w.dtype)
    got = run(packed, x, bias, activation)
    ref = ieee_reference(x, w, bias, activation)
    assert ref[[0, 1, 2]].isnan().all() and ref[5].isfinite().all()
    assert_same_nonfinite(got, ref, w.dtype)


@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "silu"])
def test_dense_kernel_propagates_nan_and_inf(site, activation):
    """sparsecc's dense CUTLASS kernel multiplies every entry, so it needs no pass: its
    epilogue keeps NaN (ReLU of NaN is NaN, as in torch)."""
    w, _ = site
    table = DenseGemm().dispatch(w.dtype, (N, K))
    ensure([launch.spec for _, launch in table])
    x = torch.randn(4, K, device="cuda").to(w.dtype)
    x[0, 3], x[1, 2], x[2, 9] = float("nan"), float("inf"), -float("inf")
    bias = torch.randn(N, device="cuda").to(w.dtype)
    got = linear_kernel(x, w, None, N, K, bias, activation, False, False, dispatch_string(table))
    assert_same_nonfinite(got, ieee_reference(x, w, bias, activation), w.dtype)


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("rows", [1, 7, 130])
@pytest.mark.parametrize("transpose_out", [False, True])
def test_scattered_nonfinite_inputs_meet_the_right_zeros(packing, rows, transpose_out):
    """One NaN, +Inf or -Inf in each row of x at a random place (two infinities of opposite
    signs in one row), on a weight whose shape is no multiple of the tiles: each output is NaN,
    +Inf, -Inf or finite exactly as in dense. An infinity gives NaN against a zero and an
    infinity against a value, so each such row checks that the kernel read the right row and
    group of the metadata."""
    n, k = 136, 544
    gen = torch.Generator().manual_seed(rows + 1000 * transpose_out)
    for dtype in DTYPES:
        w = (n_m(n, k, 2, 4, gen) / k ** 0.5).to(dtype).cuda()
        packed = pack_24(packing, w)
        x = scattered_nonfinite(rows, k, gen).to(dtype).cuda()
        bias = torch.randn(n, generator=gen).to(dtype).cuda()
        got = run(packed, x, bias, "relu", transpose_out=transpose_out)
        ref = ieee_reference(x, w, bias, "relu")
        ref = ref.transpose(-1, -2) if transpose_out else ref
        assert ref.isnan().any() and ref.isfinite().any()
        assert_same_nonfinite(got, ref, dtype)


def test_input_or_bias_on_another_device_raises(site):
    w, packed = site
    with pytest.raises(ValueError, match="input on cpu"):
        run(packed, torch.randn(3, K).to(w.dtype))
    with pytest.raises(ValueError, match="bias on cpu"):
        run(packed, torch.randn(3, K, device="cuda").to(w.dtype), torch.randn(N).to(w.dtype))


def guard_of(packed, n=N, k=K):
    """The guard words after a CUTLASS 2:4 weight's metadata (int32 view, shares its memory)."""
    compressor = ensure([KernelSpec(Family.SM90_COMPRESS24, dtype_name(packed.values.dtype))])
    return nonfinite_guard.guard_after(packed.metadata, next(iter(compressor.values())).sizes(n, k)[1])


def test_nonfinite_pass_alone_writes_only_where_dense_has_nan(site):
    """The GEMMs' pass on its own (as benchmarks/kernels_gemm.py times it): with the guard lowered
    it reads only the listed inputs (none here) and leaves y untouched, even with a NaN in x;
    raised, it writes NaN exactly where the weight skips that column, and nowhere else, and
    lowers the guard."""
    w, packed = site
    guard = guard_of(packed)
    assert guard.tolist() == [0, 0, 0]              # every column of this weight holds a non-zero
    kernel = kernel_for(packed.kernels, 5)[0]
    x = torch.randn(5, K, device="cuda").to(w.dtype)
    y = torch.randn(5, N, device="cuda").to(w.dtype)
    before = y.clone()
    stream = torch.cuda.current_stream().cuda_stream
    x[3, 21] = float("nan")
    kernel.propagate_nonfinite(packed.metadata.data_ptr(), x.data_ptr(), y.data_ptr(), N, 5, K, stream)
    assert torch.equal(y, before)
    guard[0] = 1                                     # what the GEMM's epilogue does on a NaN sum
    kernel.propagate_nonfinite(packed.metadata.data_ptr(), x.data_ptr(), y.data_ptr(), N, 5, K, stream)
    skipped = w[:, 21] == 0                  # a 2:4 weight stores exactly its non-zeros here
    assert torch.equal(y[3].isnan(), skipped) and skipped.any() and not skipped.all()
    assert torch.equal(y[[0, 1, 2, 4]], before[[0, 1, 2, 4]])
    assert guard.tolist() == [0, 0, 0]


@pytest.mark.parametrize("activation", ["none", "relu"])
def test_guard_is_lowered_after_each_call_and_left_alone_unchecked(site, activation):
    """An infinity of x that meets stored weights reaches y as in dense (the GEMM's epilogue
    raised the guard: the pass alone would not look, see above); the pass lowers the guard, so
    the next call, on finite x, is exact. Unchecked, the epilogue has no flag to raise."""
    w, packed = site
    guard = guard_of(packed)
    unchecked = dispatch_string(GEMM.dispatch(w.dtype, (N, K)), UNCHECKED_NONFINITE)
    x = torch.randn(9, K, device="cuda").to(w.dtype)
    bias = torch.randn(N, device="cuda").to(w.dtype)
    args = (packed.values, packed.metadata, N, K, bias, activation, False, False)
    x[4, 30] = float("inf")
    assert_same_nonfinite(linear_kernel(x, *args, packed.kernels), ieee_reference(x, w, bias, activation),
                          w.dtype)
    assert guard.tolist() == [0, 0, 0]
    linear_kernel(x, *args, unchecked)
    assert guard.tolist() == [0, 0, 0]
    x[4, 30] = 1.0
    assert_rel_close(linear_kernel(x, *args, packed.kernels), reference(x, w, bias, activation, False, False),
                     w.dtype)


@pytest.mark.parametrize("layout", OTHER_KERNELS, ids=["x_transposed", "transpose_out", "pingpong"])
def test_listed_and_met_nonfinite_inputs_in_the_other_layouts(layout):
    """The GEMMs with x given as [K, rows] or y stored as [N, rows], and a pingpong GEMM (no
    guard: its pass reads all of x): an all-zero group of columns (listed by the guard: the
    pass reads it on every call) and columns the weight stores (found after the epilogue raised
    the guard) both give dense's NaN and Inf."""
    dtype = torch.float16
    w = (n_m(N, K, 2, 4, torch.Generator().manual_seed(11)) / K ** 0.5).to(dtype).cuda()
    w[:, 8:16] = 0                                    # one listed group of eight inputs
    packed = GEMM.pack(w, NM_2_4, None)
    assert nonfinite_guard.groups_of(guard_of(packed)).tolist() == [1]
    kernel = ensure([KernelSpec(Family.SM90_SPARSE24, "float16", **layout)])
    kernel = next(iter(kernel.values()))
    rows = 24
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(rows, K, generator=gen).to(dtype).cuda()
    x[2, 11], x[5, 15], x[7, 40], x[7, 13] = float("nan"), float("inf"), -float("inf"), float("inf")
    bias = torch.randn(N, generator=gen).to(dtype).cuda()
    operand = x.t().contiguous() if layout.get("x_transposed") else x
    y = torch.empty((N, rows) if layout.get("transpose_out") else (rows, N), dtype=dtype, device="cuda")
    for _ in range(2):                                # the guard is lowered again after each call
        kernel.gemm(packed.values.data_ptr(), packed.metadata.data_ptr(), operand.data_ptr(), bias.data_ptr(),
                    y.data_ptr(), N, rows, K, ACTIVATION_CODES["relu"], torch.cuda.current_stream().cuda_stream)
        ref = ieee_reference(x, w, bias, "relu")
        assert_same_nonfinite(y.t() if layout.get("transpose_out") else y, ref, dtype)
        assert guard_of(packed)[:2].tolist() == [0, 0]


def test_unchecked_sites_skip_the_pass(site, monkeypatch):
    """SPARSECC_NONFINITE=unchecked: sites packed then compute the same finite results, and a
    NaN of x reaches only the outputs whose weight stores its column (the pass is skipped)."""
    w, _ = site
    monkeypatch.setenv("SPARSECC_NONFINITE", "unchecked")
    packed = GEMM.pack(w, NM_2_4, None)
    assert packed.kernels.endswith(f":{UNCHECKED_NONFINITE}")
    x = torch.randn(3, K, device="cuda").to(w.dtype)
    bias = torch.randn(N, device="cuda").to(w.dtype)
    assert_rel_close(run(packed, x, bias, "relu"), reference(x, w, bias, "relu", False, False), w.dtype)
    x[1, 21] = float("nan")
    got = run(packed, x, bias, "relu")
    stored = w[:, 21] != 0
    assert got[1][stored].isnan().all() and got[1][~stored].isfinite().all() and (~stored).any()
