import pytest
import torch
import torch.nn.functional as F

from sparsecc.config import settings
from sparsecc.errors import InputError
from sparsecc.ir.epilogue import GELU_POLYNOMIAL, Activation, Epilogue, apply_activation


def test_activations_match_torch():
    x = torch.randn(100)
    assert torch.equal(apply_activation(x, "relu"), F.relu(x))
    assert torch.equal(apply_activation(x, "gelu"), F.gelu(x))
    assert torch.equal(apply_activation(x, "gelu_tanh"), F.gelu(x, approximate="tanh"))
    assert torch.equal(apply_activation(x, "silu"), F.silu(x))
    assert apply_activation(x, "none") is x
    with pytest.raises(InputError):
        apply_activation(x, "swish")


def test_gelu_keeps_plus_infinity_and_adds_its_workaround_on_the_cpu_only():
    """GELU(+inf) = +inf on the CPU (whose vectorised float32 GELU can give NaN there); on
    other devices the activation is torch's GELU alone, so compiled graphs fuse nothing extra."""
    y = torch.tensor([float("inf"), -float("inf"), float("nan"), 1.0, -1.0] * 8)
    out = apply_activation(y, "gelu")
    assert out[0] == float("inf") and out[2].isnan()
    assert torch.equal(out[1:].isnan(), F.gelu(y[1:].double()).isnan())   # GELU(-inf) is NaN in fp64 too
    assert torch.equal(out[3:5], F.gelu(y[3:5]))
    meta = torch.fx.experimental.proxy_tensor.make_fx(lambda t: apply_activation(t, "gelu"))(
        torch.empty(40, device="meta"))
    targets = {node.target for node in meta.graph.nodes if node.op == "call_function"}
    assert targets == {torch.ops.aten.gelu.default}, targets


def test_polynomial_gelu_is_as_exact_as_float32_erf_gelu():
    """GELU_POLYNOMIAL (the BSR kernel's exact GELU) evaluated in float32, against float64
    GELU: its error is about that of the usual float32 form 0.5 x (1 + erf(x / sqrt 2))."""
    x = torch.cat([torch.linspace(-20, 20, 2_000_001), torch.linspace(-1e-3, 1e-3, 20_001), torch.randn(100_000)])
    exact = F.gelu(x.double())
    ours = (GELU_POLYNOMIAL(x).double() - exact).abs()
    erf_form = ((0.5 * x * (1 + torch.erf(x * 0.70710678))).double() - exact).abs()
    scale = x.double().abs().clamp(min=1)
    assert (ours / scale).max() < 2e-7, (ours / scale).max()
    assert (ours / scale).max() < 1.5 * (erf_form / scale).max()
    central = x.abs() < 3                          # where 16-bit outputs see the difference
    for dtype in (torch.float16, torch.bfloat16):
        rounded = exact[central].to(dtype)
        ours_differ = (GELU_POLYNOMIAL(x[central]).to(dtype) != rounded).double().mean()
        erf_differ = ((0.5 * x * (1 + torch.erf(x * 0.70710678)))[central].to(dtype) != rounded).double().mean()
        assert ours_differ < 3e-3 and ours_differ < 3 * erf_differ + 1e-4, (dtype, ours_differ, erf_differ)


def test_polynomial_gelu_special_values_and_clamp():
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, -65504.0, 1e-30, -1e-30])
    got, want = GELU_POLYNOMIAL(special), F.gelu(special.double()).float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])
    assert torch.equal(got.signbit(), want.signbit())
    clamp = torch.tensor(GELU_POLYNOMIAL.clamp)
    p = sum(c * clamp ** i for i, c in enumerate(GELU_POLYNOMIAL.coefficients))
    assert p < -152                                # the GPU's flushing exp2 gives exactly 0 there


def test_epilogue_names():
    assert str(Epilogue()) == "none"
    assert str(Epilogue(True, Activation.GELU, True)) == "bias+gelu+T"


def test_settings_read_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSECC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPARSECC_BUILD_JOBS", "3")
    s = settings()
    assert s.cache_dir == tmp_path and s.build_jobs == 3 and s.on_build_error == "raise"
    monkeypatch.setenv("SPARSECC_BUILD_JOBS", "many")
    with pytest.raises(InputError, match="SPARSECC_BUILD_JOBS"):
        settings()
    monkeypatch.setenv("SPARSECC_BUILD_JOBS", "2")
    monkeypatch.setenv("SPARSECC_ON_BUILD_ERROR", "ignore")
    with pytest.raises(InputError, match="SPARSECC_ON_BUILD_ERROR"):
        settings()
    monkeypatch.setenv("SPARSECC_ON_BUILD_ERROR", "fallback")
    monkeypatch.setenv("SPARSECC_LOG", "LOUD")
    with pytest.raises(InputError, match="SPARSECC_LOG"):
        settings()


def test_nonfinite_setting_reaches_the_dispatch_table(monkeypatch):
    """SPARSECC_NONFINITE: 'propagate' by default; 'unchecked' makes a site's table add the
    flag that skips the 2:4 GEMMs' NaN/Inf pass; anything else is refused. Tables written
    before the flags field existed still parse (flags 0)."""
    from sparsecc.codegen.spec import Family, KernelSpec
    from sparsecc.ir.epilogue import ACTIVATION_CODES, UNCHECKED_NONFINITE
    from sparsecc.kernels.base import Launch, nonfinite_flags
    from sparsecc.runtime.kernel_op import dispatch_string, parse_dispatch
    assert settings().nonfinite == "propagate" and nonfinite_flags() == 0
    monkeypatch.setenv("SPARSECC_NONFINITE", "Unchecked")
    assert settings().nonfinite == "unchecked" and nonfinite_flags() == UNCHECKED_NONFINITE
    monkeypatch.setenv("SPARSECC_NONFINITE", "ignore")
    with pytest.raises(InputError, match="SPARSECC_NONFINITE"):
        settings()
    launch = Launch(KernelSpec(Family.SM90_SPARSE24, "float16"), swizzle=2, splits=3)
    table = dispatch_string([(16, launch), (0, launch)], UNCHECKED_NONFINITE)
    assert parse_dispatch(table) == ((16, launch.spec.symbol, 2, 3, UNCHECKED_NONFINITE),
                                     (0, launch.spec.symbol, 2, 3, UNCHECKED_NONFINITE))
    assert parse_dispatch(f"0={launch.spec.symbol}:2:3") == ((0, launch.spec.symbol, 2, 3, 0),)
    dense = Launch(KernelSpec(Family.SM90_DENSE, "float16"))
    with pytest.raises(InputError, match="sm90 2:4 GEMMs and the BSR kernels only"):
        dispatch_string([(0, dense)], UNCHECKED_NONFINITE)
    for family in (Family.BSR_SM90_WGMMA, Family.BSR_SM90_PAIRS, Family.BSR_MMA_SM90):
        bsr = Launch(KernelSpec(family, "float16"))
        assert dispatch_string([(0, bsr)], UNCHECKED_NONFINITE).endswith(f":{UNCHECKED_NONFINITE}")
    assert UNCHECKED_NONFINITE > max(ACTIVATION_CODES.values())
