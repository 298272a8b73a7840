"""sparsecc.quantize (FP8) and compiling a quantized model: the report against fp64 recomputations,
zeros kept, the compiled model against the quantized model's eager output, and bad input."""
import copy

import pytest
import torch
import torch.nn as nn

import sparsecc
from sparsecc.ir.quant import E4M3
from sparsecc.quantization import FP8Linear
from sparsecc.runtime.torch_ops import OP_FOR_FP8

from conftest import rel_error
from models import llama, mlp

#: compiled against eager, both FP8 on the CPU: the same exact products, fp32 sums in another order
#: (the 2:4 op unpacks to the dense weight): relative error (norm of difference over norm)
COMPILED_TOLERANCE = 1e-6


def pruned_mlp(seed=0, sizes=(64, 96, 32)):
    torch.manual_seed(seed)
    model = mlp(sizes).eval()
    sparsecc.prune(model, "2:4")
    return model


def e4m3_spacing(q: torch.Tensor) -> torch.Tensor:
    """The gap between e4m3 values around |q| (fp64): 2^(e - 3), subnormals spaced 2^-9."""
    exponent = torch.floor(torch.log2(q.abs().clamp(min=2.0 ** -6)))
    return 2.0 ** (exponent - 3)


def test_weights_round_to_nearest_e4m3_and_the_report_equals_fp64():
    model = pruned_mlp()
    original = {name: m.weight.detach().double().clone() for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    report = sparsecc.quantize(model, "fp8")
    assert [layer.name for layer in report] == list(original)
    for name, weight in original.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, FP8Linear) and layer.weight.dtype == E4M3
        scale = weight.abs().amax(dim=1) / 448.0                                   # fp64 recomputation
        torch.testing.assert_close(layer.weight_scale.double(), scale, rtol=1e-7, atol=0)
        q, scaled = layer.weight.double(), weight / layer.weight_scale.double()[:, None]
        assert bool(((scaled - q).abs() <= e4m3_spacing(q) / 2 * (1 + 1e-9)).all()), "not the nearest e4m3"
        assert float(q.abs().max()) == 448.0
        error = float((weight - q * layer.weight_scale.double()[:, None]).norm() / weight.norm())
        assert report[name].weight_error == pytest.approx(error, rel=1e-12)
        assert 0 < report[name].weight_error < 0.05          # e4m3 keeps about 3 bits of mantissa
        assert report[name].output_error is None and report[name].input_scale is None
    assert "per token" in report.table() and "0 " in report.table()


def test_zeros_stay_zero_and_pruned_layers_still_fit_2_4():
    model = pruned_mlp(seed=1)
    zeros = {name: m.weight == 0 for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    with torch.no_grad():                       # one weight that underflows e4m3: it must become +0
        model[0].weight[0, model[0].weight[0].nonzero()[0]] = -1e-12
    report = sparsecc.quantize(model, "fp8")
    for name, was_zero in zeros.items():
        weight = model.get_submodule(name).weight
        bits = weight.view(torch.uint8)
        assert bool((bits[was_zero] == 0).all()), "a pruned weight is not +0 after quantization"
        assert not bool((bits == 0x80).any()), "a negative zero is stored"
        assert sparsecc.ir.analysis.analyze(weight).fits(sparsecc.FormatSpec.parse("2:4"))
        assert report[name].density <= 0.5
    assert model[0].weight.view(torch.uint8)[0].eq(0).sum() > zeros["0"][0].sum()    # the underflow


def test_per_token_scales_make_each_row_scale_free():
    """Dynamic scales: doubling one token doubles its output exactly and leaves the others."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(48, 40, bias=False)).eval()
    sparsecc.quantize(model, "fp8")
    x = torch.randn(6, 48)
    scaled = x.clone()
    scaled[3] *= 8.0
    y, y_scaled = model(x), model(scaled)
    assert torch.equal(y_scaled[3], 8.0 * y[3])
    assert torch.equal(torch.cat([y_scaled[:3], y_scaled[4:]]), torch.cat([y[:3], y[4:]]))


def test_calibration_gives_static_scales_and_output_errors_equal_fp64():
    model = pruned_mlp(seed=3)
    reference = copy.deepcopy(model)
    batches = [torch.randn(5, 64) * (i + 1) for i in range(3)]
    inputs = {name: [] for name, m in reference.named_modules() if isinstance(m, nn.Linear)}
    hooks = [reference.get_submodule(name).register_forward_pre_hook(lambda m, a, name=name: inputs[name].append(a[0]))
             for name in inputs]
    with torch.no_grad():
        for batch in batches:
            reference(batch)
    for hook in hooks:
        hook.remove()
    report = sparsecc.quantize(model, "fp8", calibration=batches)
    assert report.activations == "static" and report.calibration_batches == 3
    for name, xs in inputs.items():
        layer, original = model.get_submodule(name), reference.get_submodule(name)
        amax = max(float(x.abs().max()) for x in xs)
        assert report[name].input_scale == pytest.approx(amax / 448.0, rel=1e-7)
        s_x = layer.input_scale.double()
        diff = ref = 0.0
        for x in xs:
            exact = x.double() @ original.weight.detach().double().t() + original.bias.detach().double()
            x_q = (x.double() / s_x).clamp(-448, 448).float().to(E4M3).double()
            approx = (x_q @ layer.weight.double().t()) * s_x * layer.weight_scale.double() + original.bias.detach().double()
            diff += float((approx - exact).norm()) ** 2
            ref += float(exact.norm()) ** 2
        assert report[name].output_error == pytest.approx((diff / ref) ** 0.5, rel=1e-9)
        assert 0 < report[name].output_error < 0.1
    assert set(report.to_dict()["layers"][0]) >= {"name", "shape", "weight_error", "output_error", "input_scale"}


@pytest.mark.parametrize("calibrated", [False, True])
@pytest.mark.parametrize("formats", [None, ("2:4",)])
def test_compiled_quantized_mlp_equals_its_eager_output(calibrated, formats):
    model = pruned_mlp(seed=4)
    calibration = [torch.randn(8, 64) for _ in range(2)] if calibrated else None
    sparsecc.quantize(model, "fp8", calibration=calibration)
    x = torch.randn(8, 64)
    compiled = sparsecc.compile(model, x, formats=formats)
    plan = compiled.sparsecc_plan
    assert [s.dtype for s in plan] == ["float8_e4m3fn"] * 2
    assert plan.choices() == dict.fromkeys(["0.weight", "2.weight"], "2:4" if formats else "dense")
    op = OP_FOR_FP8["nm" if formats else "dense"]
    assert sum(n.target is op for n in compiled.graph.nodes) == 2
    with torch.no_grad():
        for batch in (x, torch.randn(3, 64), torch.randn(2, 5, 64)):
            assert rel_error(compiled(batch), model(batch)) <= COMPILED_TOLERANCE


def test_quantized_llama_compiles_to_2_4_and_matches_eager():
    pytest.importorskip("transformers")
    torch.manual_seed(5)
    model = llama()
    sparsecc.prune(model, "2:4")
    ids = [torch.randint(0, 100, (2, 12)) for _ in range(2)]
    report = sparsecc.quantize(model, "fp8", calibration=ids)
    assert len(report) == 14 and all(layer.output_error is not None for layer in report)
    tokens = torch.randint(0, 100, (2, 9))
    compiled = sparsecc.compile(model, tokens, formats=("2:4",))
    assert len(compiled.sparsecc_plan) == 14
    assert set(compiled.sparsecc_plan.choices().values()) == {"2:4"}
    with torch.no_grad():
        for batch in (tokens, torch.randint(0, 100, (1, 17))):
            assert rel_error(compiled(batch).last_hidden_state, model(batch).last_hidden_state) <= COMPILED_TOLERANCE


def test_a_model_that_was_not_quantized_never_runs_fp8():
    model = pruned_mlp(seed=6)
    x = torch.randn(8, 64)
    for formats in (None, ("2:4",)):
        compiled = sparsecc.compile(model, x, formats=formats)
        graphs = [m for m in compiled.modules() if isinstance(m, torch.fx.GraphModule)]   # none if all dense
        assert not any(n.target in OP_FOR_FP8.values() for gm in graphs for n in gm.graph.nodes)
        assert not any(t.dtype == E4M3 for t in [*compiled.parameters(), *compiled.buffers()])
        assert all(s.dtype == "float32" for s in compiled.sparsecc_plan)
        with torch.no_grad():
            assert rel_error(compiled(x), model(x)) <= 1e-5


def test_bad_input_is_refused_with_a_clear_error():
    with pytest.raises(sparsecc.InputError, match="unknown quantization scheme 'int4'"):
        sparsecc.quantize(mlp((8, 8)), "int4")
    integer = nn.Sequential(nn.Linear(8, 8))
    integer[0].weight = nn.Parameter(torch.ones(8, 8, dtype=torch.int32), requires_grad=False)
    with pytest.raises(sparsecc.InputError, match="torch.int32 weight"):
        sparsecc.quantize(integer, "fp8")
    with pytest.raises(sparsecc.InputError, match="meta device"):
        sparsecc.quantize(nn.Sequential(nn.Linear(8, 8, device="meta")), "fp8")
    with pytest.raises(sparsecc.InputError, match="static input scales need calibration"):
        sparsecc.quantize(mlp((8, 8)), "fp8", activations="static")
    with pytest.raises(sparsecc.InputError, match="holds no batch"):
        sparsecc.quantize(mlp((8, 8)), "fp8", calibration=[])
    with pytest.raises(sparsecc.InputError, match="never call"):
        model = nn.ModuleDict({"used": nn.Linear(8, 8), "unused": nn.Linear(8, 8)})
        model.forward = lambda x: model["used"](x)
        sparsecc.quantize(model, "fp8", calibration=[torch.randn(2, 8)])
    nan = mlp((8, 8))
    with torch.no_grad():
        nan[0].weight[0, 0] = float("nan")
    with pytest.raises(sparsecc.InputError, match="NaN or Inf"):
        sparsecc.quantize(nan, "fp8")
    quantized = mlp((8, 8))
    sparsecc.quantize(quantized, "fp8")
    with pytest.raises(sparsecc.InputError, match="no layer"):      # quantized layers are not nn.Linear
        sparsecc.quantize(quantized, "fp8")
    with pytest.raises(sparsecc.InputError, match="model itself is a linear layer"):
        sparsecc.quantize(nn.Linear(8, 8), "fp8")


def test_a_plan_cannot_run_an_fp8_site_in_a_format_without_an_fp8_op():
    model = pruned_mlp(seed=7)
    sparsecc.quantize(model, "fp8")
    x = torch.randn(4, 64)
    plan = sparsecc.plan(model, x)
    plan["0.weight"].choice = "csr"
    with pytest.raises(sparsecc.PlanError, match="FP8 site 0.weight as csr"):
        sparsecc.compile(model, x, plan=plan)
