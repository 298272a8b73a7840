import pytest
import torch
import torch.nn.functional as F

from sparsecc.config import settings
from sparsecc.epilogue import Activation, Epilogue, apply_activation
from sparsecc.errors import InputError


def test_activations_match_torch():
    x = torch.randn(100)
    assert torch.equal(apply_activation(x, "relu"), F.relu(x))
    assert torch.equal(apply_activation(x, "gelu"), F.gelu(x))
    assert torch.equal(apply_activation(x, "gelu_tanh"), F.gelu(x, approximate="tanh"))
    assert torch.equal(apply_activation(x, "silu"), F.silu(x))
    assert apply_activation(x, "none") is x
    with pytest.raises(InputError):
        apply_activation(x, "swish")


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
    from sparsecc import gpu
    from sparsecc.codegen import Family, KernelSpec
    from sparsecc.epilogue import ACTIVATION_CODES, UNCHECKED_NONFINITE
    assert settings().nonfinite == "propagate" and gpu.nonfinite_flags() == 0
    monkeypatch.setenv("SPARSECC_NONFINITE", "Unchecked")
    assert settings().nonfinite == "unchecked" and gpu.nonfinite_flags() == UNCHECKED_NONFINITE
    monkeypatch.setenv("SPARSECC_NONFINITE", "ignore")
    with pytest.raises(InputError, match="SPARSECC_NONFINITE"):
        settings()
    launch = gpu.Launch(KernelSpec(Family.SM90_SPARSE24, "float16"), swizzle=2, splits=3)
    table = gpu.dispatch_string([(16, launch), (0, launch)], UNCHECKED_NONFINITE)
    assert gpu._parse_dispatch(table) == ((16, launch.spec.symbol, 2, 3, UNCHECKED_NONFINITE),
                                          (0, launch.spec.symbol, 2, 3, UNCHECKED_NONFINITE))
    assert gpu._parse_dispatch(f"0={launch.spec.symbol}:2:3") == ((0, launch.spec.symbol, 2, 3, 0),)
    dense = gpu.Launch(KernelSpec(Family.SM90_DENSE, "float16"))
    with pytest.raises(InputError, match="sm90 2:4 GEMMs and the BSR kernels only"):
        gpu.dispatch_string([(0, dense)], UNCHECKED_NONFINITE)
    bsr = gpu.Launch(KernelSpec(Family.BSR_SM90, "float16"))
    assert gpu.dispatch_string([(0, bsr)], UNCHECKED_NONFINITE).endswith(f":{UNCHECKED_NONFINITE}")
    assert UNCHECKED_NONFINITE > max(ACTIVATION_CODES.values())
