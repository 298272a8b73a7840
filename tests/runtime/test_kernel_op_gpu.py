"""The C++ launch path of sparsecc::linear_kernel and what runs on it (skipped without a
Hopper GPU and nvcc): it is the implementation in use, it computes exactly what the Python
implementation computes, it works under torch.compile's CUDA graphs, and a generated kernel
directory runs a model with no compiler and zero compiles."""
import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import sparsecc
from sparsecc.backend import make_backend
from sparsecc.ir.formats import NM_2_4
from sparsecc.kernels.sparse24_small import GEMM
from sparsecc.runtime.kernel_op import _linear_kernel_python, cuda_implementation, linear_kernel

from conftest import kernels_of_24_sites, n_m, rel_error
from kernel_families.test_gemm_gpu import reference, sparse_weight

pytestmark = pytest.mark.gpu

#: tests/, where the subprocesses below import conftest from
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = kernels_of_24_sites([(1024, 512), (512, 1024), (256, 512), (1024, 4096)], [torch.float16, torch.bfloat16])


def _model(dtype=torch.float16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.SiLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 256))
    with torch.no_grad():
        for layer in model[::2]:
            shape = layer.weight.shape
            layer.weight.copy_(n_m(*shape, 2, 4, torch.Generator().manual_seed(shape[0])) / shape[1] ** 0.5)
    return model.to(dtype).cuda().eval()


#: :func:`_model` for a subprocess, without importing this module (whose KERNELS plans kernels)
MODEL_SOURCE = "import torch\nimport torch.nn as nn\nfrom conftest import n_m\n\n\n" + inspect.getsource(_model)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpp_launcher_is_used_and_matches_the_python_implementation(dtype):
    w = sparse_weight(1024, 4096, dtype)
    packed = GEMM.pack(w, NM_2_4, None)
    assert cuda_implementation() == "c++"
    bias = torch.randn(1024, dtype=dtype, device="cuda")
    for rows in (1, 7, 64, 1000):
        x = torch.randn(2, rows, 4096, dtype=dtype, device="cuda")
        args = (packed.values, packed.metadata, 1024, 4096, bias, "gelu", False, False, packed.kernels)
        got = linear_kernel(x, *args)
        assert torch.equal(got, _linear_kernel_python(x, *args))
        assert rel_error(got, reference(x, w, bias, "gelu")) < (3e-3 if dtype == torch.float16 else 1e-2)
    xt = torch.randn(4096, 33, dtype=dtype, device="cuda")
    got = linear_kernel(xt, packed.values, packed.metadata, 1024, 4096, None, "relu", True, True, packed.kernels)
    assert got.shape == (1024, 33)
    assert rel_error(got, reference(xt.t(), w, None, "relu").t()) < 1e-2


def test_cpp_launcher_rejects_bad_input_clearly():
    w = sparse_weight(256, 512, torch.float16)
    packed = GEMM.pack(w, NM_2_4, None)
    args = (packed.values, packed.metadata, 256, 512, None, "relu", False, False, packed.kernels)
    with pytest.raises(ValueError, match="does not match the weight"):
        linear_kernel(torch.randn(4, 512, device="cuda"), *args)
    with pytest.raises(ValueError, match="features along K"):
        linear_kernel(torch.randn(4, 256, dtype=torch.float16, device="cuda"), *args)
    with pytest.raises(ValueError, match="unknown activation"):
        linear_kernel(torch.randn(4, 512, dtype=torch.float16, device="cuda"), *args[:5], "swish", *args[6:])
    assert linear_kernel(torch.randn(0, 512, dtype=torch.float16, device="cuda"), *args).shape == (0, 256)


def test_compiled_module_under_reduce_overhead_and_the_cudagraph_backend():
    model = _model()
    x = torch.randn(8, 512, dtype=torch.float16, device="cuda")
    compiled = sparsecc.compile(model, x, formats=("2:4",))
    graphed = torch.compile(compiled, mode="reduce-overhead")
    backend = torch.compile(model, backend=make_backend(formats=("2:4",), mode="reduce-overhead"))
    with torch.no_grad():
        for step in range(4):
            fresh = torch.randn(8, 512, dtype=torch.float16, device="cuda")
            want = model(fresh)
            assert rel_error(graphed(fresh).clone(), want) < 1e-2, step
            assert rel_error(backend(fresh).clone(), want) < 1e-2, step


@pytest.mark.parametrize("tuning", [False, True])
def test_generated_directory_runs_with_no_compiler_and_zero_compiles(tmp_path, tuning):
    """Kernels generated ahead of time run where there is no compiler; with ``--tuning`` that
    machine also tunes the model's shapes on its GPU from them."""
    (tmp_path / "kernel_op_model.py").write_text(MODEL_SOURCE)
    script = tmp_path / "model.py"
    script.write_text(textwrap.dedent(f"""\
        import sys; sys.path[:0] = [{str(tmp_path)!r}, {TESTS!r}]
        import torch
        from kernel_op_model import _model
        def build():
            return _model().cpu().float(), torch.randn(8, 512)
        """))
    env = dict(os.environ, SPARSECC_CACHE_DIR=str(tmp_path / "cache-a"))
    subprocess.run([sys.executable, "-m", "sparsecc.cli", "generate", f"{script}:build", "--arch", "sm_90a",
                    "--out", str(tmp_path / "kernels")] + (["--tuning"] if tuning else []), check=True, env=env)
    check = textwrap.dedent(f"""\
        import shutil, sys, torch
        assert shutil.which("nvcc") is None
        sys.path[:0] = [{str(tmp_path)!r}, {TESTS!r}]
        import sparsecc
        from sparsecc.runtime import build
        from sparsecc.runtime.kernel_op import cuda_implementation
        from kernel_op_model import _model
        model = _model()
        x = torch.randn(8, 512, dtype=torch.float16, device="cuda")
        compiled = sparsecc.compile(model, x, formats=("2:4",), kernels={str(tmp_path / 'kernels')!r})
        assert [s.choice for s in compiled.sparsecc_plan] == ["2:4"] * 3
        assert "runs on sparsecc's sm90 2:4" in compiled.sparsecc_plan["0"].reason
        assert cuda_implementation() == "c++"
        print("compiles", build.TOTAL_BUILD.built, "tuned", len(compiled.sparsecc_plan.tuning))
        """)
    path_without_nvcc = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                        if not os.path.exists(os.path.join(p, "nvcc")))
    env = dict(os.environ, PATH=path_without_nvcc, SPARSECC_CACHE_DIR=str(tmp_path / "cache-b"))
    env.pop("SPARSECC_NVCC", None)
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiles 0 tuned" in done.stdout
    if tuning:
        assert "tuned 0" not in done.stdout and "did not build" not in done.stderr
    else:
        assert "tuned 0" in done.stdout
    assert not (tmp_path / "cache-b" / "kernels").exists() or not any((tmp_path / "cache-b" / "kernels").iterdir())
