"""Kernel directories: kernels generated ahead of time, loaded with no compiler.

``sparsecc generate`` writes a directory with, per kernel, its rendered source
(``<symbol>.cu``) and shared object (``<symbol>.so``), a ``build.ninja`` that rebuilds them by
hand, and ``manifest.json``::

    {"format": 1, "sparsecc": "0.1.0", "templates": <sha256 of the templates>,
     "nvcc": ..., "cutlass": ..., "kernels": [{"symbol", "arch", "spec", "source",
     "binary", "source_sha256", "sha256"}, ...], "launcher": {"binary", "sha256", "torch",
     "cuda", "abi"}, "manifest_sha256": <sha256 of the rest>}

(``launcher`` is the C++ launch path of :mod:`sparsecc.runtime.launcher`, present when the directory
was generated with a CUDA build of torch and used only under the same torch.)

``sparsecc.compile(..., kernels=DIR)`` (or ``SPARSECC_KERNELS=DIR``) makes the runtime take
kernels from there before it would compile anything (:func:`use_kernels`, :func:`directories`). A directory is trusted only as far as
its hashes: a manifest whose own hash does not match, one written by other templates, or a
binary whose sha256 differs from the manifest is refused with a :class:`KernelDirectoryError`.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from .._version import __version__
from ..codegen.render import render, templates_digest
from ..codegen.spec import KernelSpec
from ..config import settings
from ..errors import SparseccError
from . import launcher
from .build import build, nvcc_command, toolchain

MANIFEST = "manifest.json"
FORMAT = 1


class KernelDirectoryError(SparseccError):
    """A kernel directory is damaged, tampered with, or was made for other templates."""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest_digest(manifest: dict) -> str:
    body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    return _digest(json.dumps(body, sort_keys=True).encode())


def _ninja_file(entries: list[tuple[KernelSpec, list[str]]]) -> str:
    """A build.ninja that compiles every source with the command sparsecc used."""
    lines = ["# sparsecc kernels: `ninja` rebuilds every shared object from its source", "",
             "rule nvcc", "  command = $cmd", "  description = nvcc $out", ""]
    for spec, command in entries:
        flags = command[:command.index("-o")]
        cmd = " ".join(flags).replace("$", "$$") + " -o $out $in"
        lines += [f"build {spec.symbol}.so: nvcc {spec.symbol}.cu", f"  cmd = {cmd}", ""]
    return "\n".join(lines)


def write(specs, out: Path | str, *, progress: bool = True) -> Path:
    """Build ``specs`` (through the kernel cache) and write them as a kernel directory."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    specs = list(dict.fromkeys(specs))
    tools = toolchain()
    binaries = build(specs, progress=progress)
    kernels, ninja = [], []
    for spec in specs:
        source = render(spec).encode()
        (out / f"{spec.symbol}.cu").write_bytes(source)
        shutil.copyfile(binaries[spec], out / f"{spec.symbol}.so")
        kernels.append({"symbol": spec.symbol, "arch": spec.arch, "spec": json.loads(spec.describe()),
                        "source": f"{spec.symbol}.cu", "binary": f"{spec.symbol}.so",
                        "source_sha256": _digest(source), "sha256": _digest(binaries[spec].read_bytes())})
        ninja.append((spec, nvcc_command(spec, tools, Path(f"{spec.symbol}.cu"), Path(f"{spec.symbol}.so"))))
    (out / "build.ninja").write_text(_ninja_file(ninja))
    manifest = {"format": FORMAT, "sparsecc": __version__, "templates": templates_digest(),
                "nvcc": tools.nvcc_version, "cutlass": tools.cutlass_version, "kernels": kernels}
    if torch.version.cuda:            # the C++ launcher links against torch: only for a CUDA build of it
        built = launcher.build()
        shutil.copyfile(built, out / "sparsecc_launcher.so")
        manifest["launcher"] = {"binary": "sparsecc_launcher.so", "sha256": _digest(built.read_bytes()),
                                **launcher.torch_build()}
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out


class KernelDirectory:
    """A generated directory, opened for loading: checks its manifest once, and each binary
    the first time it is asked for."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise KernelDirectoryError(f"{self.path} is not a kernel directory: it has no {MANIFEST} "
                                       "(make one with `sparsecc generate`)") from None
        except (OSError, ValueError) as error:
            raise KernelDirectoryError(f"cannot read {manifest_path}: {error}") from None
        if not isinstance(manifest, dict) or manifest.get("manifest_sha256") != _manifest_digest(manifest):
            raise KernelDirectoryError(f"{manifest_path} does not match its recorded hash: it was edited or "
                                       "damaged; generate the directory again")
        if manifest.get("format") != FORMAT:
            raise KernelDirectoryError(f"{manifest_path} has format {manifest.get('format')}, this sparsecc "
                                       f"reads format {FORMAT}")
        if manifest.get("templates") != templates_digest():
            raise KernelDirectoryError(f"the kernels in {self.path} were generated by sparsecc "
                                       f"{manifest.get('sparsecc')} from other templates than this sparsecc's: "
                                       "generate them again with this version")
        self.manifest = manifest
        self._entries = {entry["symbol"]: entry for entry in manifest["kernels"]}
        self._verified: dict[str, Path] = {}

    def __contains__(self, spec: KernelSpec) -> bool:
        entry = self._entries.get(spec.symbol)
        return entry is not None and entry["spec"] == json.loads(spec.describe())

    def launcher(self) -> Path | None:
        """The verified C++ launcher, if the directory has one built for this torch."""
        entry = self.manifest.get("launcher")
        if not entry or {k: entry.get(k) for k in launcher.torch_build()} != launcher.torch_build():
            return None
        return self._verified_file("sparsecc_launcher", entry)

    def binary(self, spec: KernelSpec) -> Path:
        """The verified shared object of ``spec`` (which must be in the directory)."""
        return self._verified_file(spec.symbol, self._entries[spec.symbol])

    def _verified_file(self, name: str, entry: dict) -> Path:
        if name not in self._verified:
            binary = self.path / entry["binary"]
            try:
                actual = _digest(binary.read_bytes())
            except OSError as error:
                raise KernelDirectoryError(f"cannot read {binary}: {error}") from None
            if actual != entry["sha256"]:
                raise KernelDirectoryError(f"{binary} does not match the sha256 in {self.path / MANIFEST}: "
                                           "refusing to load it; generate the directory again")
            self._verified[name] = binary
        return self._verified[name]

    def __repr__(self) -> str:
        return f"KernelDirectory({str(self.path)!r}, {len(self._entries)} kernels)"


_IN_USE: dict[Path, KernelDirectory] = {}


def use_kernels(path: Path | str) -> KernelDirectory:
    """Take kernels from a directory made by ``sparsecc generate`` before compiling any.
    The directory is checked (manifest hash, templates) now, each binary when first loaded."""
    path = Path(path).resolve()
    if path not in _IN_USE:
        _IN_USE[path] = KernelDirectory(path)
    return _IN_USE[path]


def directories() -> list[KernelDirectory]:
    """The kernel directories in use: those passed to :func:`use_kernels` and SPARSECC_KERNELS."""
    for path in settings().kernel_dirs:
        use_kernels(path)
    return list(_IN_USE.values())


def prebuilt_launcher() -> Path | None:
    """The verified C++ launcher of the first directory in use that has one for this torch."""
    return next((p for p in (d.launcher() for d in directories()) if p is not None), None)
