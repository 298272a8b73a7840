"""The C++ launch path of ``sparsecc::linear_kernel`` (``csrc/launcher.cpp``).

Built once per torch version into the kernel cache and loaded with
``torch.ops.load_library``, it registers the op's CUDA implementation in C++, so a call
pays only the dispatcher: no Python below the op call. Kernels loaded by
:mod:`sparsecc.runtime` hand it their entry points by symbol.

If it cannot be built (no torch headers, an unusual toolchain) sparsecc says why once and
registers the Python implementation of :mod:`sparsecc.runtime.kernel_op` instead: slower to
call, same results.
"""
from __future__ import annotations

import ctypes
import importlib.resources
import logging
from pathlib import Path

import torch

from ..config import settings
from ..errors import KernelBuildError
from ..ir.epilogue import ACTIVATION_CODES
from .build import build_source, toolchain

log = logging.getLogger("sparsecc")


def source() -> str:
    return importlib.resources.files("sparsecc.runtime").joinpath("csrc", "launcher.cpp").read_text()


def compile_command(nvcc: str, source_path: Path, output: Path) -> list[str]:
    """Host C++ compiled by nvcc's driver (which knows the CUDA headers) against torch, with the
    include and library directories ``torch.utils.cpp_extension`` gives extensions. The build
    itself goes through sparsecc's kernel cache rather than ``cpp_extension.load``, so the
    launcher is keyed, locked, checked and published like every kernel."""
    import torch.utils.cpp_extension as cpp_extension   # imported when building only: it needs setuptools
    includes = [flag for path in cpp_extension.include_paths() for flag in ("-I", path)]
    libraries = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [nvcc, "-x", "c++", "-std=c++20", "-O2", "-DNDEBUG", "-shared", "-Xcompiler=-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(source_path), "-o", str(output),
            *(flag for path in libraries for flag in ("-L", path)), "-lc10", "-lc10_cuda", "-ltorch_cpu",
            "-ltorch_cuda", *(f"-Xlinker=-rpath={path}" for path in libraries)]


def torch_build() -> dict:
    """What the launcher binary depends on besides its source: it links against torch."""
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "abi": int(torch._C._GLIBCXX_USE_CXX11_ABI)}


def build() -> Path:
    """Compile the launcher for this torch (or find it in the kernel cache)."""
    tools = toolchain()
    return build_source("sparsecc_launcher", {"launcher": "linear_kernel"}, source(),
                        lambda src, out: compile_command(tools.nvcc, src, out), torch_build())


_UNSET = object()
_library = _UNSET          # the loaded launcher, None where it could not be loaded


def load(prebuilt: Path | None = None) -> ctypes.CDLL | None:
    """Load the launcher once per process: ``prebuilt`` (a kernel directory's, verified), else
    one built here; None, with one warning, if it cannot be, or if SPARSECC_LAUNCHER=python asks
    for the Python implementation."""
    global _library
    if _library is not _UNSET:
        return _library
    _library = None
    if settings().launcher == "python":
        return None
    try:
        path = prebuilt or build()
        torch.ops.load_library(str(path))
    except (KernelBuildError, OSError, RuntimeError) as error:
        log.warning("the C++ launcher of sparsecc::linear_kernel is not available (%s); using the Python "
                    "implementation, which costs more host time per call", str(error).splitlines()[0])
        return None
    library = ctypes.CDLL(str(path))
    library.sparsecc_launcher_add_kernel.argtypes = [ctypes.c_char_p] + [ctypes.c_void_p] * 3
    library.sparsecc_launcher_add_activation.argtypes = [ctypes.c_char_p, ctypes.c_int]
    for name, code in ACTIVATION_CODES.items():
        library.sparsecc_launcher_add_activation(name.encode(), code)
    _library = library
    return library


def add_kernel(symbol: str, kernel_library: ctypes.CDLL) -> None:
    """Hand a loaded kernel's entry points to the launcher (once :func:`load` has loaded it)."""
    if _library is _UNSET or _library is None:
        return
    address = lambda name: ctypes.cast(getattr(kernel_library, f"{symbol}_{name}"), ctypes.c_void_p).value  # noqa: E731
    _library.sparsecc_launcher_add_kernel(symbol.encode(), address("run"), address("workspace_size"), address("error"))
