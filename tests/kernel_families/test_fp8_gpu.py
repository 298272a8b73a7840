"""The FP8 dense family on the GPU (``sparsecc::linear_fp8_scaled_mm`` on torch._scaled_mm; skipped
without a GPU that takes per-token scales): held to the reference op ``sparsecc::linear_fp8`` on
random data over several shapes, fp16 and bf16, per-token and static input scales, bias and
activations, transposed layouts; shapes torch._scaled_mm cannot take run the reference op
exactly; NaN rows stay NaN rows; a CUDA graph replays it; a quantized model compiled on the GPU
runs it. tests/kernel_families/test_fp8.py covers the routing and the arithmetic without a GPU.

Tolerance: both ops round the input to e4m3 with the same code and multiply exact e4m3 products,
so they differ only in the order of the fp32 sums (and in torch._scaled_mm's accumulation,
promoted to fp32 with ``use_fast_accum=False``) and in the rounding to the output dtype: the
reference rounds ``product + bias`` once, torch._scaled_mm rounds it once too (bias fused) and a
GELU or SiLU applied after it rounds once more. Two roundings bound the relative error (norm of
the difference over the norm) by 2u (u = 2^-11 for fp16, 2^-8 for bf16); the bounds below are
about twice that, so a wrong scale (one e4m3 step is 6-12%) or a dropped bias fails by orders of
magnitude."""
import pytest
import torch

import sparsecc
from sparsecc.ir.quant import quantize_input, quantize_weight
from sparsecc.kernels import registry
from sparsecc.kernels.base import kernels_unavailable
from sparsecc.runtime.torch_ops import linear_fp8, linear_fp8_scaled_mm, quantize_rows, scaled_mm_refusal

from conftest import rel_error, replays_like_eager
from models import mlp

WHY_NOT = scaled_mm_refusal("cuda", (64, 64), torch.bfloat16) if torch.cuda.is_available() else "no CUDA GPU"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY_NOT is not None, reason=f"{WHY_NOT}")]

#: relative error against the reference op (see the module docstring)
BOUND = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
#: (N, K, M): decode and prefill batches, a tall and a wide weight
SHAPES = [(4096, 4096, 1), (4096, 4096, 16), (1024, 2048, 300), (11008, 4096, 17), (512, 11008, 2048)]
#: (N, K): shapes torch._scaled_mm refuses (N, then K, not a multiple of 16)
ODD = [(264, 1024), (256, 1000)]


def dtypes():
    return [d for d in (torch.float16, torch.bfloat16) if scaled_mm_refusal("cuda", (64, 64), d) is None]


def site(n, k, dtype, seed=0, bias=True):
    """An e4m3 weight with its scales and a bias, from a weight scaled like a trained layer's."""
    generator = torch.Generator().manual_seed(seed)
    weight, weight_scale = quantize_weight(torch.randn(n, k, generator=generator) / k ** 0.5)
    b = (torch.randn(n, generator=generator) * 0.1).to(dtype).cuda() if bias else None
    return weight.cuda(), weight_scale.cuda(), b


def inputs(m, k, dtype, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype).cuda()


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """The calls torch._scaled_mm gets (it still runs)."""
    calls = []
    real = torch._scaled_mm

    def counted(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", counted)
    return calls


@pytest.mark.parametrize("n, k, m", SHAPES)
@pytest.mark.parametrize("static", [False, True])
def test_against_the_reference_op(scaled_mm_calls, n, k, m, static):
    for dtype in dtypes():
        weight, weight_scale, bias = site(n, k, dtype)
        x = inputs(m, k, dtype)
        input_scale = (x.float().abs().amax() / 448.0 * 1.25) if static else None
        for activation in ("none", "relu", "gelu", "silu"):
            for b in (bias, None):
                args = (x, weight, weight_scale, input_scale, b, activation, False, False)
                got, ref = linear_fp8_scaled_mm(*args), linear_fp8(*args)
                assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
                error = rel_error(got, ref)
                assert error <= BOUND[dtype], (dtype, activation, b is not None, error)
    assert len(scaled_mm_calls) == 8 * len(dtypes())


def test_transposed_layouts_and_leading_shapes(scaled_mm_calls):
    dtype = dtypes()[0]
    weight, weight_scale, bias = site(256, 512, dtype)
    cases = [(inputs(3 * 40, 512, dtype).reshape(3, 40, 512), False, False),
             (inputs(3 * 40, 512, dtype).reshape(3, 512, 40), True, False),
             (inputs(40, 512, dtype), False, True),
             (inputs(512, 40, dtype).t(), False, False),              # a column-major input
             (inputs(1, 512, dtype).reshape(512), False, False),
             (inputs(0, 512, dtype), False, False)]
    for x, x_transposed, transpose_out in cases:
        args = (x, weight, weight_scale, None, bias, "relu", x_transposed, transpose_out)
        got, ref = linear_fp8_scaled_mm(*args), linear_fp8(*args)
        assert got.shape == ref.shape and got.is_contiguous()
        if ref.numel():
            assert rel_error(got, ref) <= BOUND[dtype], tuple(x.shape)
    assert len(scaled_mm_calls) == len(cases) - 1     # no rows: nothing to multiply


@pytest.mark.parametrize("n, k", ODD)
def test_shapes_it_cannot_take_run_the_reference_op_exactly(scaled_mm_calls, n, k):
    for dtype in (*dtypes(), torch.float32):
        weight, weight_scale, bias = site(n, k, dtype)
        x = inputs(33, k, dtype)
        args = (x, weight, weight_scale, None, bias, "gelu", False, False)
        assert torch.equal(linear_fp8_scaled_mm(*args), linear_fp8(*args))
    weight, weight_scale, bias = site(256, 256, torch.float32)
    args = (inputs(8, 256, torch.float32), weight, weight_scale, None, bias, "none", False, False)
    assert torch.equal(linear_fp8_scaled_mm(*args), linear_fp8(*args))        # an fp32 input
    assert scaled_mm_calls == []


def test_a_nan_row_stays_a_nan_row():
    dtype = dtypes()[0]
    weight, weight_scale, bias = site(256, 512, dtype)
    x = inputs(8, 512, dtype)
    x[3, 7] = float("nan")
    got = linear_fp8_scaled_mm(x, weight, weight_scale, None, bias, "none", False, False)
    ref = linear_fp8(x, weight, weight_scale, None, bias, "none", False, False)
    assert torch.equal(torch.isnan(got), torch.isnan(ref)) and bool(torch.isnan(got[3]).all())
    rows = [0, 1, 2, 4, 5, 6, 7]
    assert rel_error(got[rows], ref[rows]) <= BOUND[dtype]


def test_a_cuda_graph_replays_it():
    dtype = dtypes()[0]
    weight, weight_scale, bias = site(1024, 1024, dtype)
    x = inputs(16, 1024, dtype)
    assert replays_like_eager(lambda x: linear_fp8_scaled_mm(x, weight, weight_scale, None, bias, "silu", False, False),
                              x)


def test_a_quantized_model_compiled_on_the_gpu_runs_it():
    dtype = dtypes()[0]
    torch.manual_seed(0)
    model = mlp((512, 1024, 256)).eval().to(dtype).cuda()
    sparsecc.quantize(model, "fp8")
    x = torch.randn(64, 512, dtype=dtype, device="cuda")
    compiled = sparsecc.compile(model, x)
    assert [n.target for n in compiled.graph.nodes].count(linear_fp8_scaled_mm) == 2
    assert all("torch._scaled_mm" in site.reason for site in compiled.sparsecc_plan)
    with torch.no_grad():
        # two layers: the second rounds the first's output to e4m3 again, where one rounding
        # of fp16/bf16 may move a value across an e4m3 tie; the bound allows for a few such
        assert rel_error(compiled(x), model(x)) <= 2 * BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_the_rounding_kernel_gives_torchs_codes_and_scales(dtype, static):
    """sparsecc's one-pass rounding of x to e4m3 (templates/quantize_e4m3.cu.j2), loaded for a dense
    FP8 site, gives sparsecc.ir.quant.quantize_input's codes and scales bit for bit: random rows over
    many magnitudes, a row of zeros, a row with a NaN and one with an infinity."""
    if kernels_unavailable("cuda"):
        pytest.skip(kernels_unavailable("cuda"))
    assert registry.prepare_quantized_dense((4096, 4096), "cuda", dtype) is None
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(37, 4096, generator=generator) * 10.0 ** torch.randint(-4, 3, (37, 1), generator=generator)
    x = x.to(dtype).cuda()
    x[3] = 0
    x[5, 17], x[8, 4000] = float("nan"), float("inf")
    input_scale = torch.tensor(0.01, device="cuda") if static else None
    got, want = quantize_rows(x, input_scale), quantize_input(x, input_scale)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1].reshape(-1).expand(37) if static else got[1],
                       want[1].reshape(-1).expand(37) if static else want[1])
