"""Load compiled kernels and call them: each shared object is opened once per process and
its entry points are wrapped with typed ctypes signatures.

A kernel is registered under its symbol, which is what the custom ops carry in the graph
(a string names the kernel; no pointer or handle is stored in a model).
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Iterable

from .build import KernelCache, build
from .codegen import Family, KernelSpec
from .errors import SparseccError

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

    def sizes(self, m: int, k: int) -> tuple[int, int]:
        """Compressed value elements and metadata bytes of an m x k 2:4 weight."""
        values, metadata = ctypes.c_longlong(), ctypes.c_longlong()
        self._check(self._sizes(m, k, ctypes.byref(values), ctypes.byref(metadata)))
        return values.value, metadata.value

    def compress(self, a: int, values: int, metadata: int, m: int, k: int, stream: int) -> None:
        self._check(self._compress(a, values, metadata, m, k, stream))


_REGISTRY: dict[str, Kernel] = {}


def ensure(specs: Iterable[KernelSpec], *, cache: KernelCache | None = None,
           progress: bool = True) -> dict[KernelSpec, Kernel]:
    """Build (or find in the cache) and load ``specs``; each library is loaded once."""
    specs = list(specs)
    missing = [s for s in specs if s.symbol not in _REGISTRY]
    if missing:
        for spec, path in build(missing, cache=cache, progress=progress).items():
            _REGISTRY[spec.symbol] = Kernel(spec, path)
    return {spec: _REGISTRY[spec.symbol] for spec in specs}


def get(symbol: str) -> Kernel:
    try:
        return _REGISTRY[symbol]
    except KeyError:
        raise SparseccError(f"kernel {symbol} is not loaded in this process: compile the model with "
                            "sparsecc.compile (or call sparsecc.runtime.ensure) first") from None


def loaded() -> dict[str, Kernel]:
    return dict(_REGISTRY)
