"""Shared test helpers: random sparse weights (never zeros where a value is kept), the
relative-error check every numeric test uses (sparsecc's own relative_error), and the skips:
a test marked ``gpu`` runs only where sparsecc's kernels can (a Hopper GPU and nvcc or a kernel
directory); ``pytest -m gpu`` selects those."""
from __future__ import annotations

import math
import shutil
import subprocess
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sparsecc.config import settings
from sparsecc.errors import KernelBuildError
from sparsecc.ir.numerics import relative_error
from sparsecc.kernels.base import kernels_unavailable
from sparsecc.kernels.registry import plan_kernels
from sparsecc.runtime import build as build_module
from sparsecc.runtime.kernel_op import ensure

#: relative-error bounds (||got - ref|| / ||ref|| against an fp64 reference), by dtype
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
requires_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None or settings().cutlass_dir is None,
                                   reason="needs nvcc and the CUTLASS headers (pip install nvidia-cutlass)")


def host_program(source: str, directory: Path) -> Path:
    """``source`` (a rendered kernel with a ``main()`` appended) compiled by nvcc into a program
    that runs on the host: the host half of a kernel (its layouts, its arguments, CUTLASS's
    ``can_implement``, functions marked ``__host__ __device__``) checked without a GPU."""
    tools = build_module.toolchain()
    (directory / "check.cu").write_text(source)
    subprocess.run([str(tools.nvcc), "-std=c++17", "-O1", "--expt-relaxed-constexpr",
                    "-gencode=arch=compute_90a,code=sm_90a", "-I", str(tools.cutlass_include),
                    "-I", str(tools.util_include), "-o", str(directory / "check"), str(directory / "check.cu")],
                   check=True, capture_output=True)
    return directory / "check"


#: ||got - ref|| / ||ref|| (NaN where the NaNs differ): the one relative error of sparsecc
rel_error = relative_error


def assert_rel_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, *, factor: float = 1.0):
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert not torch.isnan(got).any(), "NaN in output"
    error = rel_error(got, ref)
    assert error <= TOLERANCE[dtype] * factor, f"relative error {error:.3g} > {TOLERANCE[dtype] * factor:.3g}"


def replays_like_eager(call, x: torch.Tensor) -> bool:
    """``call(x)`` captured in a CUDA graph, x given new values in place, the graph replayed:
    whether the captured output equals ``call(x)`` run eagerly on the new values and differs
    from the output on the old ones (the graph read x, not a copy)."""
    before = call(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    return torch.equal(captured, call(x)) and not torch.equal(captured, before)


def nonzero_randn(*shape, generator=None, dtype=torch.float32) -> torch.Tensor:
    """Normal samples pushed away from zero, so a kept value is never accidentally 0."""
    x = torch.randn(*shape, generator=generator)
    return (x + x.sign() * 0.1).to(dtype)


def with_nonzero_weights(model):
    """``model`` with every linear weight drawn by :func:`nonzero_randn` (the global generator)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(nonzero_randn(*module.weight.shape))
    return model


def unstructured(rows, cols, density, generator=None, dtype=torch.float32) -> torch.Tensor:
    w = nonzero_randn(rows, cols, generator=generator)
    return (w * (torch.rand(rows, cols, generator=generator) < density)).to(dtype)


def n_m(rows, cols, n, m, generator=None, dtype=torch.float32) -> torch.Tensor:
    """Exactly n non-zeros in every group of m along K (the last short group keeps <= n)."""
    groups = math.ceil(cols / m)
    w = nonzero_randn(rows, groups, m, generator=generator)
    keep = torch.rand(rows, groups, m, generator=generator).argsort(-1)[..., :n]
    mask = torch.zeros(rows, groups, m, dtype=torch.bool).scatter_(-1, keep, True)
    return (w * mask).reshape(rows, groups * m)[:, :cols].contiguous().to(dtype)


def block_sparse(rows, cols, block, density, generator=None, dtype=torch.float32) -> torch.Tensor:
    h, w = block
    present = torch.rand(rows // h, cols // w, generator=generator) < density
    mask = present.repeat_interleave(h, 0).repeat_interleave(w, 1)
    return (nonzero_randn(rows, cols, generator=generator) * mask).to(dtype)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


FAKE_NVCC = textwrap.dedent("""\
    #!/usr/bin/env python3
    # stands in for nvcc: copies the source to the output, fails on '#error', logs each compile
    import os, sys, time
    args = sys.argv[1:]
    if args == ["--version"]:
        print("Cuda compilation tools, release 13.0, V13.0.0-test"); sys.exit(0)
    out, src = args[args.index("-o") + 1], args[-1]
    text = open(src).read()
    with open(os.environ["FAKE_NVCC_LOG"], "a") as log: log.write(src + "\\n")
    time.sleep(float(os.environ.get("FAKE_NVCC_SLEEP", "0")))
    if "#error" in text:
        sys.stderr.write(src + ":1: error: boom\\n"); sys.exit(2)
    open(out, "w").write(text)
    """)


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    script = tmp_path / "nvcc"
    script.write_text(FAKE_NVCC)
    script.chmod(0o755)
    log = tmp_path / "compiles.log"
    log.write_text("")
    include = tmp_path / "cutlass" / "include"
    (include / "cutlass").mkdir(parents=True)
    (include / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 0\n")
    monkeypatch.setenv("SPARSECC_NVCC", str(script))
    monkeypatch.setenv("SPARSECC_CUTLASS_DIR", str(include))
    monkeypatch.setenv("SPARSECC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_NVCC_LOG", str(log))
    build_module._toolchain.cache_clear()
    yield log
    build_module._toolchain.cache_clear()


def compiles(log) -> int:
    return len(log.read_text().splitlines())


def kernels_of_24_sites(shapes, dtypes) -> list:
    """The kernels 2:4 sites of these [N, K] shapes run, as ``sparsecc generate`` lists them:
    the small-batch kernels (sites planned at M=1 and at M=4), the compressor and the GEMMs of
    each M bucket (any other site), for the GPU test modules' ``KERNELS``."""
    return plan_kernels([SimpleNamespace(choice="2:4", dtype=str(dtype).replace("torch.", ""), shape=shape,
                                         density=0.5, m=m)
                         for dtype in dtypes for shape in shapes for m in (1, 4, None)])


def pytest_collection_modifyitems(config, items):
    """Skip the tests marked ``gpu`` where sparsecc's kernels cannot run, saying why."""
    why_not = kernels_unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"
    if why_not is None:
        return
    skip = pytest.mark.skip(reason=f"needs a Hopper GPU and nvcc: {why_not}")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Compile the kernels every selected GPU test module declares (its ``KERNELS``) in one
    parallel build before the first test runs: built test by test, a few at a time, they
    take a fresh GPU machine many minutes. A kernel a module does not declare is still built
    by the test that needs it; a failed build is reported by the tests that need the kernel."""
    modules = {item.module for item in session.items
               if item.get_closest_marker("gpu") is not None and getattr(item, "module", None) is not None}
    specs = list(dict.fromkeys(spec for module in sorted(modules, key=lambda m: m.__name__)
                               for spec in getattr(module, "KERNELS", ())))
    if not specs or not torch.cuda.is_available() or kernels_unavailable(torch.device("cuda")) is not None:
        return
    try:
        ensure(specs)
    except KernelBuildError as error:
        print(f"building the GPU tests' kernels failed: {str(error).splitlines()[0]}")


def pytest_terminal_summary(terminalreporter):
    """The kernels this test session compiled, not found in their kernel cache: on a GPU machine,
    what a cache carried there lacked (tests/runtime/test_build.py compiles its own on purpose)."""
    built = build_module.TOTAL_BUILD
    if built.built:
        shown = ", ".join(built.symbols[:SHOWN_SYMBOLS]) + (", ..." if built.built > SHOWN_SYMBOLS else "")
        terminalreporter.write_line(f"sparsecc: the tests compiled {built.built} kernels not in their cache "
                                    f"({built.seconds:.0f} s): {shown}")


#: the compiled kernels the summary names
SHOWN_SYMBOLS = 30
