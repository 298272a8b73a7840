"""Load compiled kernels: each shared object is opened once per process and its entry points
are wrapped with typed ctypes signatures.

A kernel is registered under its symbol, which is what the custom ops carry in the graph
(a string names the kernel; no pointer or handle is stored in a model). Kernels come from a
generated kernel directory when one in use has them (:mod:`sparsecc.runtime.kernel_dir`),
else from the kernel cache, compiling what is in neither (:mod:`sparsecc.runtime.build`).
"""
from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Iterable

from ..codegen.spec import BITMAP_LAYOUT, CSR_LAYOUT, KernelSpec
from ..errors import KernelBuildError, SparseccError
from .build import KernelCache, build, toolchain
from .kernel_dir import directories

_VOID = ctypes.c_void_p
_INT = ctypes.c_int


class KernelRunError(SparseccError):
    """A generated kernel refused its arguments or failed to launch."""


class Kernel:
    """One loaded kernel. ``gemm`` runs ``d = act(a @ b^T + bias)`` on device pointers."""

    def __init__(self, spec: KernelSpec, path: Path):
        self.spec = spec
        self.path = Path(path)
        self.library = ctypes.CDLL(str(self.path))
        symbol = spec.symbol
        self._error = getattr(self.library, f"{symbol}_error")
        self._error.restype = ctypes.c_char_p
        if spec.family.compressor:
            self._sizes = getattr(self.library, f"{symbol}_sizes")
            self._sizes.argtypes = [_INT, _INT, ctypes.POINTER(ctypes.c_longlong), ctypes.POINTER(ctypes.c_longlong)]
            self._sizes.restype = _INT
            self._compress = getattr(self.library, f"{symbol}_compress")
            self._compress.argtypes = [_VOID, _VOID, _VOID, _INT, _INT, _VOID]
            self._compress.restype = _INT
        elif spec.family.quantizer:
            self._quantize = getattr(self.library, f"{symbol}_quantize")
            self._quantize.argtypes = [_VOID, _VOID, _VOID, _VOID, _INT, _INT, _VOID]
            self._quantize.restype = _INT
        else:
            self._run = getattr(self.library, f"{symbol}_run")
            self._run.argtypes = [_VOID, _VOID, _VOID, _VOID, _VOID, _INT, _INT, _INT, _INT, _INT, _INT, _VOID, _VOID]
            if spec.family.fp8:                  # the weight's and x's fp32 scales
                self._run.argtypes += [_VOID, _VOID]
            self._run.restype = _INT
            self._workspace_size = getattr(self.library, f"{symbol}_workspace_size")
            self._workspace_size.argtypes = [_INT, _INT, _INT, _INT, _INT]
            self._workspace_size.restype = ctypes.c_longlong
            self._workspace_sizes: dict[tuple, int] = {}
        if spec.family.nonfinite_pass:
            self._propagate = getattr(self.library, f"{symbol}_propagate_nonfinite")
            self._propagate.argtypes = [_VOID, _VOID, _VOID, _INT, _INT, _INT, _VOID]
            self._propagate.restype = _INT

    def _check(self, code: int) -> None:
        if code != 0:
            raise KernelRunError(self._error().decode(errors="replace") or f"{self.spec.symbol} returned {code}")

    def workspace_size(self, m: int, n: int, k: int, swizzle: int = 1, splits: int = 1) -> int:
        """Bytes of workspace a call needs (remembered per shape)."""
        key = (m, n, k, swizzle, splits)
        if key not in self._workspace_sizes:
            self._workspace_sizes[key] = int(self._workspace_size(m, n, k, swizzle, splits))
        return self._workspace_sizes[key]

    def gemm(self, a: int, e: int, b: int, bias: int, d: int, m: int, n: int, k: int,
             activation: int, stream: int, *, swizzle: int = 1, splits: int = 1, workspace: int = 0,
             scales: tuple[int, int] | None = None) -> None:
        """GEMM sizes: m = out features, n = rows of x, k = in features (pointers as ints); an FP8
        kernel's ``scales`` point to the weight's fp32 scales [m] and to x's static fp32 scale (0:
        per token), and its ``b`` is x in the site's dtype (the kernel rounds it to e4m3)."""
        if self.spec.family.fp8 != (scales is not None):
            raise KernelRunError(f"{self.spec.symbol} takes scales if and only if it is an FP8 kernel")
        self._check(self._run(a, e, b, bias or None, d, m, n, k, activation, swizzle, splits,
                              workspace or None, stream, *(scales or ())))

    def propagate_nonfinite(self, e: int, b: int, d: int, m: int, n: int, k: int, stream: int) -> None:
        """The pass a 2:4 GEMM or BSR kernel runs after its product so that NaN and Inf of x reach y
        as in dense F.linear (``gemm`` already runs it; exposed so benchmarks can time it alone). It
        reads all of x only while the product has raised the site's guard
        (:mod:`sparsecc.kernels.nonfinite_guard`); the pingpong 2:4 GEMMs keep no guard, and their
        pass always reads all of x."""
        self._check(self._propagate(e, b, d, m, n, k, stream))

    def quantize(self, x: int, static_scale: int, x_q: int, scales: int, n: int, k: int, stream: int) -> None:
        """x's ``n`` rows of ``k`` rounded to e4m3 into ``x_q``, their fp32 scales into ``scales``
        (``static_scale``: a pointer to one scale for every row, 0: per token)."""
        self._check(self._quantize(x, static_scale or None, x_q, scales, n, k, stream))

    def sizes(self, m: int, k: int) -> tuple[int, int]:
        """Compressed value elements and metadata bytes of an m x k 2:4 weight."""
        values, metadata = ctypes.c_longlong(), ctypes.c_longlong()
        self._check(self._sizes(m, k, ctypes.byref(values), ctypes.byref(metadata)))
        return values.value, metadata.value

    def compress(self, a: int, values: int, metadata: int, m: int, k: int, stream: int) -> None:
        self._check(self._compress(a, values, metadata, m, k, stream))


_REGISTRY: dict[str, Kernel] = {}


def load(specs: Iterable[KernelSpec], *, cache: KernelCache | None = None,
         progress: bool = True) -> list[Kernel]:
    """Load ``specs``, each library once per process: from a kernel directory in use if one has
    it, else from the cache, compiling what is in neither. Returns the kernels loaded by this
    call (those loaded before are skipped). All or nothing: where one cannot be had, none is
    recorded as loaded, so a later call for those that can be hands them over."""
    missing = list(dict.fromkeys(s for s in specs if s.symbol not in _REGISTRY))
    if not missing:
        return []
    available = directories()
    found, to_build = {}, []
    for spec in missing:
        directory = next((d for d in available if spec in d), None)
        if directory is not None:
            found[spec.symbol] = Kernel(spec, directory.binary(spec))
        else:
            to_build.append(spec)
    if to_build and available:
        try:
            toolchain()
        except KernelBuildError as error:
            names = ", ".join(s.symbol for s in to_build[:3]) + (" ..." if len(to_build) > 3 else "")
            raise KernelBuildError(f"{len(to_build)} kernels are not in the kernel directories "
                                   f"{[str(d.path) for d in available]} ({names}) and cannot be compiled "
                                   f"here: {error}") from None
    for spec, path in (build(to_build, cache=cache, progress=progress) if to_build else {}).items():
        found[spec.symbol] = Kernel(spec, path)
    _REGISTRY.update(found)
    return [_REGISTRY[s.symbol] for s in missing]


def find(symbol: str) -> Kernel | None:
    """The loaded kernel named ``symbol``, or None if this process has not loaded it."""
    return _REGISTRY.get(symbol)


def get(symbol: str) -> Kernel:
    """The loaded kernel named ``symbol``; a clear error if it is not loaded."""
    try:
        return _REGISTRY[symbol]
    except KeyError:
        pass
    versioned = re.fullmatch(r"sparsecc_(csr|bitmap)_\w+_c\d+(?:_l(\d+))?", symbol)
    if versioned:
        name, layout = {"csr": ("tiled CSR", CSR_LAYOUT), "bitmap": ("bitmap", BITMAP_LAYOUT)}[versioned.group(1)]
        if versioned.group(2) != str(layout):
            raise SparseccError(f"kernel {symbol} reads weights packed in another {name} layout "
                                f"({versioned.group(2) or 1}, this sparsecc packs layout {layout}): a module "
                                "saved with it must be compiled again")
    raise SparseccError(f"kernel {symbol} is not loaded in this process: compile the model with "
                        "sparsecc.compile (or call sparsecc.runtime.kernel_op.ensure) first")


def loaded() -> dict[str, Kernel]:
    return dict(_REGISTRY)
