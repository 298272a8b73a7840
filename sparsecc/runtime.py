"""Load compiled kernels and call them: each shared object is opened once per process and
its entry points are wrapped with typed ctypes signatures.

A kernel is registered under its symbol, which is what the custom ops carry in the graph
(a string names the kernel; no pointer or handle is stored in a model).
"""
from __future__ import annotations

import ctypes
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import torch

from . import launcher
from .build import KernelCache, build, toolchain
from .codegen import CSR_LAYOUT, Family, KernelSpec
from .config import settings
from .errors import InputError, KernelBuildError, SparseccError
from .kernel_dir import KernelDirectory

_VOID = ctypes.c_void_p
#: the families that skip products dense would compute (0 * NaN) and so export a pass that
#: propagates NaN and Inf of x (run by their ``_run`` unless the flags say unchecked)
NONFINITE_PASS_FAMILIES = (Family.SM90_SPARSE24, Family.BSR_SM90, Family.BSR_SM90_WGMMA, Family.BSR_SM90_PAIRS,
                           Family.BSR_MMA_SM90)
_INT = ctypes.c_int


class KernelRunError(SparseccError):
    """A generated kernel refused its arguments or failed to launch."""


def finish_packing(device) -> None:
    """Wait until the kernels that packed a weight on ``device`` have finished. The small-batch
    2:4 kernels and the small-batch mma BSR kernel are programmatic dependent launches that read their weight before they
    wait for the kernel ahead of them (templates/common.j2, dependent_launch): a packed weight
    must be finished, not only ordered, before its first call. Packing while a CUDA graph is
    being captured is refused (the graph would pack on every replay)."""
    if torch.cuda.is_current_stream_capturing():
        raise InputError("a weight cannot be packed for sparsecc's kernels while a CUDA graph is being "
                         "captured: pack it (compile the model) before capturing")
    torch.cuda.current_stream(device).synchronize()


class Kernel:
    """One loaded kernel. ``gemm`` runs ``d = act(a @ b^T + bias)`` on device pointers."""

    def __init__(self, spec: KernelSpec, path: Path):
        self.spec = spec
        self.path = Path(path)
        self.library = ctypes.CDLL(str(self.path))
        symbol = spec.symbol
        self._error = getattr(self.library, f"{symbol}_error")
        self._error.restype = ctypes.c_char_p
        if spec.family is Family.SM90_COMPRESS24:
            self._sizes = getattr(self.library, f"{symbol}_sizes")
            self._sizes.argtypes = [_INT, _INT, ctypes.POINTER(ctypes.c_longlong), ctypes.POINTER(ctypes.c_longlong)]
            self._sizes.restype = _INT
            self._compress = getattr(self.library, f"{symbol}_compress")
            self._compress.argtypes = [_VOID, _VOID, _VOID, _INT, _INT, _VOID]
            self._compress.restype = _INT
        else:
            self._run = getattr(self.library, f"{symbol}_run")
            self._run.argtypes = [_VOID, _VOID, _VOID, _VOID, _VOID, _INT, _INT, _INT, _INT, _INT, _INT, _VOID, _VOID]
            self._run.restype = _INT
            self._workspace_size = getattr(self.library, f"{symbol}_workspace_size")
            self._workspace_size.argtypes = [_INT, _INT, _INT, _INT, _INT]
            self._workspace_size.restype = ctypes.c_longlong
            self._workspace_sizes: dict[tuple, int] = {}
        if spec.family in NONFINITE_PASS_FAMILIES:
            self._propagate = getattr(self.library, f"{symbol}_propagate_nonfinite")
            self._propagate.argtypes = [_VOID, _VOID, _VOID, _INT, _INT, _INT, _VOID]
            self._propagate.restype = _INT

    def _check(self, code: int) -> None:
        if code != 0:
            raise KernelRunError(self._error().decode(errors="replace") or f"{self.spec.symbol} returned {code}")

    def workspace_size(self, m: int, n: int, k: int, swizzle: int = 1, splits: int = 1) -> int:
        """Bytes of workspace a call needs (stream-K only; remembered per shape)."""
        key = (m, n, k, swizzle, splits)
        if key not in self._workspace_sizes:
            self._workspace_sizes[key] = int(self._workspace_size(m, n, k, swizzle, splits))
        return self._workspace_sizes[key]

    def gemm(self, a: int, e: int, b: int, bias: int, d: int, m: int, n: int, k: int,
             activation: int, stream: int, *, swizzle: int = 1, splits: int = 1, workspace: int = 0) -> None:
        """GEMM sizes: m = out features, n = rows of x, k = in features (pointers as ints)."""
        self._check(self._run(a, e, b, bias or None, d, m, n, k, activation, swizzle, splits,
                              workspace or None, stream))

    def propagate_nonfinite(self, e: int, b: int, d: int, m: int, n: int, k: int, stream: int) -> None:
        """The pass a 2:4 GEMM or BSR kernel runs after its product so that NaN and Inf of x reach y as in dense
        F.linear (``gemm`` already runs it; exposed so benchmarks can time it alone). It reads all of x only while
        the product has raised the site's guard (:mod:`sparsecc.nonfinite_guard`); the pingpong 2:4 GEMMs keep no
        guard, and their pass always reads all of x."""
        self._check(self._propagate(e, b, d, m, n, k, stream))

    def sizes(self, m: int, k: int) -> tuple[int, int]:
        """Compressed value elements and metadata bytes of an m x k 2:4 weight."""
        values, metadata = ctypes.c_longlong(), ctypes.c_longlong()
        self._check(self._sizes(m, k, ctypes.byref(values), ctypes.byref(metadata)))
        return values.value, metadata.value

    def compress(self, a: int, values: int, metadata: int, m: int, k: int, stream: int) -> None:
        self._check(self._compress(a, values, metadata, m, k, stream))


_REGISTRY: dict[str, Kernel] = {}
_DIRECTORIES: dict[Path, KernelDirectory] = {}


def use_kernels(path: Path | str) -> KernelDirectory:
    """Take kernels from a directory made by ``sparsecc generate`` before compiling any.
    The directory is checked (manifest hash, templates) now, each binary when first loaded."""
    path = Path(path).resolve()
    if path not in _DIRECTORIES:
        _DIRECTORIES[path] = KernelDirectory(path)
    return _DIRECTORIES[path]


def directories() -> list[KernelDirectory]:
    """The kernel directories in use: those passed to :func:`use_kernels` and SPARSECC_KERNELS."""
    for path in settings().kernel_dirs:
        use_kernels(path)
    return list(_DIRECTORIES.values())


def ensure(specs: Iterable[KernelSpec], *, cache: KernelCache | None = None,
           progress: bool = True) -> dict[KernelSpec, Kernel]:
    """Load ``specs``, each library once per process: from a kernel directory if one has it,
    else from the cache, compiling what is in neither."""
    specs = list(specs)
    missing = [s for s in specs if s.symbol not in _REGISTRY]
    to_build = []
    available = directories() if missing else []
    for spec in missing:
        directory = next((d for d in available if spec in d), None)
        if directory is not None:
            _REGISTRY[spec.symbol] = Kernel(spec, directory.binary(spec))
        else:
            to_build.append(spec)
    if to_build and _DIRECTORIES:
        try:
            toolchain()
        except KernelBuildError as error:
            names = ", ".join(s.symbol for s in to_build[:3]) + (" ..." if len(to_build) > 3 else "")
            raise KernelBuildError(f"{len(to_build)} kernels are not in the kernel directories "
                                   f"{[str(p) for p in _DIRECTORIES]} ({names}) and cannot be compiled "
                                   f"here: {error}") from None
    if to_build:
        with ThreadPoolExecutor(max_workers=1) as side:
            if torch.cuda.is_available():       # the C++ launcher (built once per torch) compiles alongside
                side.submit(_install_cuda_implementation)
            built = build(to_build, cache=cache, progress=progress)
        for spec, path in built.items():
            _REGISTRY[spec.symbol] = Kernel(spec, path)
    gemms = [_REGISTRY[s.symbol] for s in missing if s.family is not Family.SM90_COMPRESS24]
    if gemms and torch.cuda.is_available() and _install_cuda_implementation() == "c++":
        for kernel in gemms:
            launcher.add_kernel(kernel.spec.symbol, kernel.library)
    return {spec: _REGISTRY[spec.symbol] for spec in specs}


def _install_cuda_implementation() -> str:
    from .gpu import cuda_implementation
    return cuda_implementation()


def get(symbol: str) -> Kernel:
    try:
        return _REGISTRY[symbol]
    except KeyError:
        pass
    csr = re.fullmatch(r"sparsecc_csr_\w+_c\d+(?:_l(\d+))?", symbol)
    if csr and csr.group(1) != str(CSR_LAYOUT):
        raise SparseccError(f"kernel {symbol} reads weights packed in an earlier tiled CSR layout "
                            f"({csr.group(1) or 1}, this sparsecc packs layout {CSR_LAYOUT}): a module saved "
                            "with it must be compiled again")
    raise SparseccError(f"kernel {symbol} is not loaded in this process: compile the model with "
                        "sparsecc.compile (or call sparsecc.runtime.ensure) first")


def loaded() -> dict[str, Kernel]:
    return dict(_REGISTRY)
