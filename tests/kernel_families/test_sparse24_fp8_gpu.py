"""The FP8 2:4 GEMM on the GPU (sparsecc.kernels.sparse24_fp8; skipped without a Hopper GPU and
nvcc): held to the reference op ``sparsecc::linear_fp8_nm`` on random data over several shapes and
batches, fp16 and bf16, per-token and static input scales, bias and activations; NaN and
infinities of x propagate as in the reference's dense IEEE arithmetic; a CUDA graph replays it;
a quantized 2:4 model compiled with ``formats=("2:4",)`` runs it and matches eager.

Tolerance: both round x to e4m3 to the same codes (the kernel's rounding pass is held to
sparsecc.ir.quant bit for bit on the host, test_sparse24_fp8.py) and sum exact e4m3 products in
fp32, so they differ in the order of the sums, in the kernel's fused multiply-add of
the weight's scale and the bias, and in where the activation rounds; the bounds are those of the
FP8 dense family (test_fp8_gpu.py): a wrong scale (one e4m3 step is 6-12%), a dropped bias or a
misread metadata fails by orders of magnitude."""
import logging

import pytest
import torch

import sparsecc
from sparsecc.codegen.spec import Family, KernelSpec
from sparsecc.ir.formats import NM_2_4
from sparsecc.ir.quant import quantize_weight
from sparsecc.kernels import tune
from sparsecc.kernels.base import Launch, launch_for
from sparsecc.kernels.sparse24_fp8 import DEFAULTS, SPARSE24_FP8
from sparsecc.runtime.kernel_op import linear_fp8_kernel
from sparsecc.runtime.torch_ops import linear_fp8

from conftest import n_m, rel_error, replays_like_eager
from models import mlp
from test_bad_input import assert_same_nonfinite

pytestmark = pytest.mark.gpu

BOUND = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float16, torch.bfloat16]
#: (N, K, M): decode and prefill batches, a tile-odd small weight and a long one
SHAPES = [(4096, 4096, 1), (4096, 4096, 16), (264, 1056, 33), (1024, 2048, 300), (512, 11008, 2048)]
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = [KernelSpec(Family.SM90_COMPRESS24, "float8_e4m3fn")] + [
    KernelSpec(Family.SM90_SPARSE24_FP8, name, tile=tile) for name in ("float16", "bfloat16")
    for tile in dict.fromkeys(DEFAULTS.values())]
KERNELS += [launch.spec for launch in SPARSE24_FP8.candidates(torch.float16, (1024, 2048), 16)]


def site(n, k, dtype, seed=0):
    """A 2:4 e4m3 weight with its scales and a bias, from a weight scaled like a trained layer's."""
    generator = torch.Generator().manual_seed(seed)
    weight, weight_scale = quantize_weight(n_m(n, k, 2, 4, generator) / k ** 0.5)
    bias = (torch.randn(n, generator=generator) * 0.1).to(dtype).cuda()
    return weight.cuda(), weight_scale.cuda(), bias


def run(packed, x, weight_scale, input_scale, bias, activation):
    return linear_fp8_kernel(x, packed.values, packed.metadata, weight_scale, input_scale, packed.out_features,
                             packed.in_features, bias, activation, False, False, packed.kernels)


@pytest.mark.parametrize("n, k", [(264, 1056), (1024, 4096)])
def test_compression_round_trips_exactly(n, k):
    weight, _, _ = site(n, k, torch.float16, seed=2)
    packed = SPARSE24_FP8.pack(weight, NM_2_4, 16, input_dtype=torch.float16)
    assert torch.equal(packed.to_dense().view(torch.uint8), weight.view(torch.uint8))


@pytest.mark.parametrize("n, k, m", SHAPES)
@pytest.mark.parametrize("static", [False, True])
def test_against_the_reference_op(n, k, m, static):
    for dtype in DTYPES:
        weight, weight_scale, bias = site(n, k, dtype)
        packed = SPARSE24_FP8.pack(weight, NM_2_4, m, input_dtype=dtype)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
        input_scale = (x.float().abs().amax() / 448.0 * 1.25) if static else None
        for activation in ("none", "relu", "gelu", "silu"):
            for b in (bias, None):
                got = run(packed, x, weight_scale, input_scale, b, activation)
                ref = linear_fp8(x, weight, weight_scale, input_scale, b, activation, False, False)
                assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
                error = rel_error(got, ref)
                assert error <= BOUND[dtype], (dtype, activation, b is not None, error)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate_like_the_reference(dtype):
    """A NaN in a column no row of W stores still makes its row of y NaN, as the reference's dense
    product does; an infinity's row has an infinite per-token scale; a finite call after them finds
    the guard lowered again."""
    n, k, m = 256, 2048, 24
    weight, weight_scale, bias = site(n, k, dtype, seed=4)
    weight.view(torch.uint8)[:, 7] = 0                       # +0 in e4m3: a column no row stores
    packed = SPARSE24_FP8.pack(weight, NM_2_4, m, input_dtype=dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5)).to(dtype).cuda()
    bad = x.clone()
    bad[2, 7], bad[5, 100], bad[9, 1500] = float("nan"), float("nan"), float("inf")
    got = run(packed, bad, weight_scale, None, bias, "none")
    assert_same_nonfinite(got, linear_fp8(bad, weight, weight_scale, None, bias, "none", False, False), dtype)
    again = run(packed, x, weight_scale, None, bias, "none")
    assert rel_error(again, linear_fp8(x, weight, weight_scale, None, bias, "none", False, False)) <= BOUND[dtype]


def test_tuning_times_every_candidate_against_the_fp8_reference(tmp_path, monkeypatch, caplog):
    """Every candidate launch computes the FP8 product (tuning holds each to sparsecc.ir.quant's,
    none is left out), the fastest is recorded and dispatched, and the packed site computes it."""
    monkeypatch.setenv("SPARSECC_TUNE", "new")
    table = tune.TuningTable([], tmp_path / "tuning.json", "test")
    tune.use(table)
    try:
        with caplog.at_level(logging.WARNING, logger="sparsecc"):
            found = tune.tune_bucket(SPARSE24_FP8, torch.float16, (1024, 2048), 16, progress=False)
        assert found is not None and "left out" not in caplog.text
        table_launch = launch_for(SPARSE24_FP8.dispatch(torch.float16, (1024, 2048)), 16)
        assert table_launch == Launch.from_description(found)
        weight, weight_scale, bias = site(1024, 2048, torch.float16, seed=6)
        packed = SPARSE24_FP8.pack(weight, NM_2_4, 16, input_dtype=torch.float16)
        x = torch.randn(16, 2048, dtype=torch.float16, device="cuda")
        assert rel_error(run(packed, x, weight_scale, None, bias, "relu"),
                         linear_fp8(x, weight, weight_scale, None, bias, "relu", False, False)) <= BOUND[torch.float16]
    finally:
        tune.use(None)


def test_replays_from_a_cuda_graph():
    weight, weight_scale, bias = site(1024, 2048, torch.float16)
    packed = SPARSE24_FP8.pack(weight, NM_2_4, 8, input_dtype=torch.float16)
    x = torch.randn(8, 2048, dtype=torch.float16, device="cuda")
    assert replays_like_eager(lambda inp: run(packed, inp, weight_scale, None, bias, "relu"), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compile_runs_a_quantized_24_model_on_it(dtype):
    """A 2:4-pruned MLP quantized to FP8 and compiled with formats=("2:4",): every site runs
    sparsecc::linear_fp8_kernel, the plan says so, and the output matches the quantized model's."""
    torch.manual_seed(0)
    model = mlp((512, 1024, 256)).eval().to(dtype).cuda()
    sparsecc.prune(model, "2:4")
    sparsecc.quantize(model, "fp8")
    x = torch.randn(64, 512, dtype=dtype, device="cuda")
    compiled = sparsecc.compile(model, x, formats=("2:4",))
    assert [n.target for n in compiled.graph.nodes].count(linear_fp8_kernel) == 2
    assert all("FP8 2:4 CUTLASS kernel" in site.reason for site in compiled.sparsecc_plan)
    with torch.no_grad():
        # two layers: the second rounds the first's output to e4m3 again (see test_fp8_gpu.py)
        assert rel_error(compiled(x), model(x)) <= 2 * BOUND[dtype]
