"""The C++ launcher's source compiles against this torch's headers (compile only: linking
needs a CUDA build of torch, and running it a GPU; tests/runtime/test_kernel_op_gpu.py does both)."""
import subprocess
from pathlib import Path

import pytest

from sparsecc.config import settings
from sparsecc.runtime import launcher

from conftest import requires_nvcc


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.slow
def test_launcher_source_compiles(tmp_path):
    source = tmp_path / "launcher.cpp"
    source.write_text(launcher.source())
    command = launcher.compile_command(settings().nvcc, source, tmp_path / "launcher.o")
    command = command[:command.index("-L")]                      # compile, do not link
    command[command.index("-shared")] = "-c"
    # a CPU build of torch ships c10/cuda headers without the generated CUDA config header
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    done = subprocess.run(command + ["-I", str(tmp_path / "stub")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert Path(tmp_path / "launcher.o").stat().st_size > 10_000


def test_launcher_links_where_torch_tells_extensions_to(tmp_path):
    """Include and library directories come from torch.utils.cpp_extension, and the launcher
    finds torch's libraries at run time through an rpath to the same directories."""
    import torch.utils.cpp_extension as cpp_extension
    command = launcher.compile_command("nvcc", tmp_path / "launcher.cpp", tmp_path / "launcher.so")
    for path in cpp_extension.include_paths():
        assert path in command
    for path in cpp_extension.library_paths():
        assert command[command.index(path) - 1] == "-L"
        assert f"-Xlinker=-rpath={path}" in command
