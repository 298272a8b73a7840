"""The FP8 dense family (sparsecc.kernels.fp8, ``sparsecc::linear_fp8_scaled_mm``) without a GPU:
which devices, GPUs, input dtypes and shapes torch._scaled_mm is given, what the registry, the
cost model and splice make of that, and the op's arithmetic run through torch's CPU
``_scaled_mm`` (the GPU pretended) against an fp64 recomputation, every call checked for the
layouts the CUDA kernel requires. tests/kernel_families/test_fp8_gpu.py holds it to the reference op on
the GPU."""
import pytest
import torch

import sparsecc
from sparsecc.codegen.spec import Family
from sparsecc.ir.analysis import analyze
from sparsecc.ir.epilogue import apply_activation
from sparsecc.ir.formats import DENSE, NM_2_4
from sparsecc.ir.quant import E4M3, quantize_input, quantize_weight
from sparsecc.kernels import fp8, registry
from sparsecc.planner.cost import CostModel
from sparsecc.runtime import torch_ops
from sparsecc.runtime.torch_ops import linear_fp8, linear_fp8_scaled_mm, scaled_mm_refusal

from conftest import TOLERANCE, n_m, rel_error
from models import mlp

HOPPER = (9, 0)


@pytest.fixture
def gpu(monkeypatch):
    """Pretend every device is a GPU of the capability the test sets (``gpu(capability)``)."""
    def pretend(capability):
        monkeypatch.setattr(torch_ops, "_capability", lambda device: capability)
    return pretend


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """torch._scaled_mm checked for what the CUDA kernel requires before it runs (on the CPU):
    returns the list of ``(M, K, N, out_dtype)`` it was called with."""
    calls = []
    real = torch._scaled_mm

    def checked(a, b, *, scale_a, scale_b, bias=None, out_dtype, use_fast_accum):
        m, k = a.shape
        n = b.shape[1]
        assert a.dtype == b.dtype == E4M3 and b.shape[0] == k
        assert a.stride() == (k, 1), f"x_q must be row-major, has strides {a.stride()}"
        assert b.stride() == (1, k), f"the weight must be column-major, has strides {b.stride()}"
        assert k % 16 == 0 and n % 16 == 0
        assert scale_a.dtype == scale_b.dtype == torch.float32
        assert tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n)
        assert scale_a.is_contiguous() and scale_b.is_contiguous()
        assert out_dtype in (torch.float16, torch.bfloat16) and use_fast_accum is False
        assert bias is None or (bias.dtype == out_dtype and tuple(bias.shape) == (n,))
        calls.append((m, k, n, out_dtype))
        return real(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                    use_fast_accum=use_fast_accum)
    monkeypatch.setattr(torch, "_scaled_mm", checked)
    return calls


@pytest.mark.parametrize("device, capability, shape, dtype, runs", [
    ("cpu", None, (4096, 4096), torch.float16, False),          # not a GPU
    ("cuda", (8, 0), (4096, 4096), torch.bfloat16, False),      # Ampere: no FP8 tensor cores
    ("cuda", (12, 0), (4096, 4096), torch.bfloat16, False),     # not one of the GPUs it is known on
    ("cuda", HOPPER, (4096, 4096), torch.float16, True),
    ("cuda", HOPPER, (4096, 4096), torch.bfloat16, True),
    ("cuda", HOPPER, (4096, 4096), None, True),                 # the input's dtype not known yet
    ("cuda", HOPPER, (4096, 4096), torch.float32, False),       # its output dtypes are fp16/bf16
    ("cuda", HOPPER, (4096, 4104), torch.float16, False),       # K % 16
    ("cuda", HOPPER, (4104, 4096), torch.float16, False),       # N % 16
    ("cuda", HOPPER, (16, 16), torch.float16, True),
    ("cuda", (8, 9), (4096, 4096), torch.bfloat16, True),       # Ada: CUTLASS, bf16 out
    ("cuda", (8, 9), (4096, 4096), torch.float16, False),
])
def test_scaled_mm_refusal_by_device_gpu_dtype_and_shape(monkeypatch, device, capability, shape, dtype, runs):
    if device == "cuda":
        monkeypatch.setattr(torch_ops, "_capability", lambda d: capability)
    reason = scaled_mm_refusal(device, shape, dtype)
    assert (reason is None) == runs, reason
    family = fp8.SCALED_MM.refuses(DENSE, shape, E4M3, device, dtype)
    assert family == reason
    op = torch_ops.fp8_dense_op(device, shape, dtype)
    assert op is (linear_fp8_scaled_mm if runs else linear_fp8)


def test_without_a_gpu_the_registry_and_the_plan_keep_fp8_on_the_reference_op():
    shape = (64, 64)
    assert registry.refusal(DENSE, shape, E4M3) is not None                # no device: nothing to run it on
    assert "CUDA GPU" in registry.refusal(DENSE, shape, E4M3, "cpu")
    assert registry.quantized_dense(shape, "cpu")[0] is None
    assert registry.refusal(NM_2_4, shape, E4M3, "cpu") is None            # the FP8 2:4 GEMM takes the shape
    assert "K % 32 == 0" in registry.refusal(NM_2_4, (64, 48), E4M3)
    assert "float16/bfloat16 inputs" in registry.refusal(NM_2_4, shape, E4M3, input_dtype=torch.float32)
    assert registry.kernel_specs(DENSE, E4M3, shape, 1.0, 16) == []
    weight, _ = quantize_weight(torch.randn(*shape))
    model = CostModel("cpu", measure=False, calibration=None)
    decision = model._decide_quantized(analyze(weight), None)
    assert decision.choice == DENSE and "runs on its reference op (torch._scaled_mm runs FP8 products on a CUDA" \
        in decision.reason
    pruned, _ = quantize_weight(n_m(*shape, 2, 4))
    decision = model._decide_quantized(analyze(pruned), [NM_2_4])
    assert decision.choice == NM_2_4 and "runs on its reference op (sparsecc's kernels run on CUDA GPUs)" \
        in decision.reason


def test_on_a_gpu_that_takes_it_the_registry_and_the_plan_name_scaled_mm(gpu):
    gpu(HOPPER)
    assert registry.quantized_dense((64, 64), "cuda") == (fp8.SCALED_MM, None)
    assert registry.refusal(DENSE, (64, 64), E4M3, "cuda") is None
    family, why = registry.quantized_dense((64, 72), "cuda")
    assert family is None and "multiples of 16" in why
    weight, _ = quantize_weight(n_m(64, 64, 2, 4))
    model = CostModel("cuda", measure=False, calibration=None, kernels_unavailable=None)
    decision = model._decide_quantized(analyze(weight), None)
    assert decision.choice == DENSE and "runs on torch._scaled_mm" in decision.reason
    decision = model._decide_quantized(analyze(weight), [NM_2_4])                   # 2:4 where asked for
    assert decision.choice == NM_2_4 and "runs on sparsecc's sm90 FP8 2:4 CUTLASS kernel" in decision.reason
    specs = registry.kernel_specs(NM_2_4, E4M3, (64, 64), 0.5, 16)
    assert {s.family for s in specs} == {Family.SM90_COMPRESS24, Family.SM90_SPARSE24_FP8}
    assert {s.dtype for s in specs if s.family is Family.SM90_SPARSE24_FP8} == {"float16", "bfloat16"}


def test_a_quantized_model_compiled_on_the_cpu_runs_the_reference_op():
    torch.manual_seed(0)
    model = mlp((64, 96, 32)).eval().to(torch.bfloat16)
    sparsecc.quantize(model, "fp8")
    compiled = sparsecc.compile(model, torch.randn(8, 64, dtype=torch.bfloat16))
    targets = [n.target for n in compiled.graph.nodes]
    assert targets.count(linear_fp8) == 2 and linear_fp8_scaled_mm not in targets


def reference64(x2d, weight, weight_scale, input_scale, bias, activation):
    """The quantized site in fp64 from the same e4m3 input and weight: exact up to fp64 sums."""
    x_q, x_scale = quantize_input(x2d, input_scale)
    y = (x_q.double() @ weight.double().t()) * x_scale.double() * weight_scale.double()
    if bias is not None:
        y = y + bias.double()
    return apply_activation(y, activation)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("activation, with_bias", [("none", False), ("relu", True), ("gelu", True), ("silu", False)])
def test_the_scaled_mm_path_equals_fp64(gpu, scaled_mm_calls, dtype, static, activation, with_bias):
    """torch's CPU _scaled_mm in place of cuBLASLt: the op's arguments are what the CUDA kernel
    takes (checked by the fixture) and its result is the fp64 product of the same e4m3 input
    and weight within the fp16/bf16 families' bounds (product and bias are rounded once to the
    input's dtype, an activation other than ReLU rounds once more)."""
    gpu(HOPPER)
    generator = torch.Generator().manual_seed(1)
    n, k, m = 48, 80, 7
    weight, weight_scale = quantize_weight(torch.randn(n, k, generator=generator))
    bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(m, k, generator=generator).to(dtype)
    input_scale = x.float().abs().amax() / 448.0 * 1.5 if static else None
    y = linear_fp8_scaled_mm(x, weight, weight_scale, input_scale, bias, activation, False, False)
    assert scaled_mm_calls == [(m, k, n, dtype)] and y.dtype == dtype
    expected = reference64(x, weight, weight_scale, input_scale, bias, activation)
    assert rel_error(y, expected) <= TOLERANCE[dtype]
    reference = linear_fp8(x, weight, weight_scale, input_scale, bias, activation, False, False)
    assert rel_error(y, reference.double()) <= TOLERANCE[dtype]


def test_the_scaled_mm_path_takes_transposes_and_any_leading_shape(gpu, scaled_mm_calls):
    gpu(HOPPER)
    generator = torch.Generator().manual_seed(2)
    weight, weight_scale = quantize_weight(torch.randn(32, 64, generator=generator))
    bias = torch.randn(32, generator=generator).half()
    for shape, x_transposed, transpose_out in [((2, 5, 64), False, False), ((2, 64, 5), True, False),
                                               ((5, 64), False, True), ((5, 64), False, False), ((64,), False, False),
                                               ((0, 64), False, False)]:
        x = torch.randn(*shape, generator=generator).half()
        if len(shape) == 2 and not transpose_out and shape[0]:
            x = x.t().contiguous().t()                  # a column-major input: x_q must be made row-major
        got = linear_fp8_scaled_mm(x, weight, weight_scale, None, bias, "relu", x_transposed, transpose_out)
        ref = linear_fp8(x, weight, weight_scale, None, bias, "relu", x_transposed, transpose_out)
        assert got.shape == ref.shape and got.dtype == ref.dtype and got.is_contiguous()
        if ref.numel():
            assert rel_error(got, ref) <= TOLERANCE[torch.float16], shape
    assert len(scaled_mm_calls) == 5                   # no rows: nothing to multiply


@pytest.mark.parametrize("shape, dtype", [((24, 64), torch.float16),    # N % 16
                                          ((32, 40), torch.bfloat16),   # K % 16
                                          ((32, 64), torch.float32)])   # an output dtype it has not
def test_what_scaled_mm_cannot_take_is_the_reference_op_exactly(gpu, scaled_mm_calls, shape, dtype):
    gpu(HOPPER)
    generator = torch.Generator().manual_seed(3)
    weight, weight_scale = quantize_weight(torch.randn(*shape, generator=generator))
    x = torch.randn(6, shape[1], generator=generator).to(dtype)
    bias = torch.randn(shape[0], generator=generator)
    got = linear_fp8_scaled_mm(x, weight, weight_scale, None, bias, "gelu", False, False)
    assert torch.equal(got, linear_fp8(x, weight, weight_scale, None, bias, "gelu", False, False))
    assert scaled_mm_calls == []


def test_splice_routes_a_dense_fp8_site_to_scaled_mm_where_it_runs(gpu, scaled_mm_calls):
    """Compile on a pretended Hopper GPU: both sites of a bf16 model call the scaled_mm op, the
    plan says so, and the model computes what the quantized model computes."""
    gpu(HOPPER)
    torch.manual_seed(4)
    model = mlp((64, 96, 32)).eval().to(torch.bfloat16)
    sparsecc.quantize(model, "fp8")
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    compiled = sparsecc.compile(model, x)
    targets = [n.target for n in compiled.graph.nodes]
    assert targets.count(linear_fp8_scaled_mm) == 2 and linear_fp8 not in targets
    assert all("torch._scaled_mm" in site.reason for site in compiled.sparsecc_plan)
    scaled_mm_calls.clear()                             # compile ran the model to check it
    with torch.no_grad():
        assert rel_error(compiled(x), model(x)) <= TOLERANCE[torch.bfloat16]
    assert [call[:3] for call in scaled_mm_calls] == [(8, 64, 96), (8, 96, 32)]
    float32 = mlp((64, 96, 32)).eval()                  # fp32 inputs: no output dtype of _scaled_mm
    sparsecc.quantize(float32, "fp8")
    compiled = sparsecc.compile(float32, torch.randn(8, 64))
    assert [n.target for n in compiled.graph.nodes].count(linear_fp8) == 2


def test_the_rounding_kernel_is_loaded_only_where_sparsecc_kernels_run():
    """A dense FP8 site's input is rounded by torch's ops wherever the rounding kernel is not
    loaded: on the CPU, preparing the site says why and loads nothing, and quantize_rows is
    quantize_input exactly."""
    why = registry.prepare_quantized_dense((64, 64), "cpu", torch.float16)
    assert why is not None and "CUDA GPU" in why
    x = torch.randn(5, 64, dtype=torch.float16)
    x[2, 3] = float("nan")
    got, want = torch_ops.quantize_rows(x, None), quantize_input(x, None)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
