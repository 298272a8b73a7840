"""Compile generated kernels with nvcc into a content-addressed cache (DESIGN principle 7).

- The key is sha256 over the rendered source (which is all a template contributes: adding or
  changing one template leaves the others' kernels cached), the compiler's version, the full
  flags, the architecture, the CUTLASS version and this cache's layout version.
- An entry is built in a private staging directory and published with one atomic rename;
  a lock per key makes concurrent builders of the same kernel wait for one build.
- The cache directory is created 0700; one another user can write is not trusted: sparsecc
  warns and uses a private temporary cache instead. An entry whose binary does not match
  the hash its manifest recorded is removed and rebuilt, never loaded.
- A failing compile raises :class:`~sparsecc.errors.KernelBuildError` with the command,
  the compiler's stderr and the path of the source, kept for the user to read.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from filelock import FileLock
from tqdm.auto import tqdm

from ..codegen.render import render
from ..codegen.spec import KernelSpec
from ..config import settings
from ..errors import KernelBuildError

log = logging.getLogger("sparsecc")

CACHE_LAYOUT = 2
_ARCH_FLAGS = {"sm_90a": "-gencode=arch=compute_90a,code=sm_90a"}


@dataclass(frozen=True)
class Toolchain:
    nvcc: str
    nvcc_version: str
    cutlass_include: Path
    cutlass_version: str

    @property
    def util_include(self) -> Path:
        return self.cutlass_include.parent / "tools" / "util" / "include"


def toolchain() -> Toolchain:
    """nvcc and the CUTLASS headers, or a KernelBuildError saying which is missing."""
    config = settings()
    if config.nvcc is None:
        raise KernelBuildError("nvcc was not found: install the CUDA toolkit or set SPARSECC_NVCC")
    if config.cutlass_dir is None:
        raise KernelBuildError("the CUTLASS headers were not found: pip install nvidia-cutlass "
                               "(or set SPARSECC_CUTLASS_DIR to a CUTLASS include directory)")
    return _toolchain(config.nvcc, str(config.cutlass_dir))


@lru_cache(maxsize=None)
def _toolchain(nvcc: str, cutlass_dir: str) -> Toolchain:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise KernelBuildError(f"cannot run {nvcc}: {error}", command=[nvcc, "--version"]) from error
    if out.returncode != 0:
        raise KernelBuildError(f"{nvcc} --version failed", command=[nvcc, "--version"], stderr=out.stderr)
    version = out.stdout.strip().splitlines()[-1]
    header = Path(cutlass_dir) / "cutlass" / "version.h"
    numbers = dict(re.findall(r"#define CUTLASS_(MAJOR|MINOR|PATCH) (\d+)", header.read_text())) if header.is_file() else {}
    cutlass_version = ".".join(numbers.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH"))
    return Toolchain(nvcc, version, Path(cutlass_dir), cutlass_version)


def nvcc_command(spec: KernelSpec, tools: Toolchain, source: Path, output: Path) -> list[str]:
    return [tools.nvcc, "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-Xcompiler=-fPIC",
            "-shared", _ARCH_FLAGS[spec.arch], "-I", str(tools.cutlass_include), "-I", str(tools.util_include),
            "-o", str(output), str(source)]


def cache_key(spec: KernelSpec, source: str, tools: Toolchain) -> str:
    """The content address of a build. Where the compiler and the CUTLASS headers are
    installed does not enter it (their versions do), so a cache travels between machines."""
    flags = nvcc_command(spec, tools, Path("kernel.cu"), Path("kernel.so"))[1:]
    flags = [{str(tools.cutlass_include): "<cutlass>", str(tools.util_include): "<cutlass-util>"}.get(f, f) for f in flags]
    material = {"layout": CACHE_LAYOUT, "source": source, "flags": flags, "arch": spec.arch,
                "nvcc": tools.nvcc_version, "cutlass": tools.cutlass_version}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class KernelCache:
    """The on-disk cache: ``<root>/kernels/<key>/{kernel.so, kernel.cu, manifest.json}``."""

    def __init__(self, root: Path | str | None = None):
        self.root = self._trusted(Path(root) if root else settings().cache_dir)
        for sub in ("kernels", "staging", "locks", "failed"):
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)

    @staticmethod
    def _trusted(root: Path) -> Path:
        reason = "it is not writable"
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = root.stat()
            writable = os.access(root, os.W_OK)
        except OSError as error:
            info, writable = None, False
            reason = str(error)
        if info is not None and (info.st_uid != os.getuid() or info.st_mode & 0o022):
            reason = f"it is owned by uid {info.st_uid} or writable by other users (mode {oct(info.st_mode & 0o777)})"
            writable = False
        if writable:
            return root
        private = Path(tempfile.mkdtemp(prefix="sparsecc-cache-"))
        log.warning("not using the kernel cache %s: %s; using the private cache %s for this process",
                    root, reason, private)
        return private

    def path(self, key: str) -> Path:
        return self.root / "kernels" / key

    def lookup(self, key: str) -> Path | None:
        """The binary of ``key`` if present and intact; a damaged entry is removed."""
        entry = self.path(key)
        binary = entry / "kernel.so"
        if not entry.exists():
            return None
        try:
            manifest = json.loads((entry / "manifest.json").read_text())
            if manifest.get("key") == key and manifest.get("sha256") == file_sha256(binary):
                return binary
        except (OSError, ValueError):
            pass
        log.warning("kernel cache entry %s is damaged; rebuilding it", entry)
        shutil.rmtree(entry, ignore_errors=True)
        return None

    def lock(self, key: str):
        return FileLock(self.root / "locks" / f"{key}.lock")


@dataclass
class BuildStats:
    built: int = 0
    cached: int = 0
    seconds: float = 0.0
    symbols: list[str] = field(default_factory=list)     # the kernels compiled (not found in the cache)


LAST_BUILD = BuildStats()     # the latest call of build()
TOTAL_BUILD = BuildStats()    # every call of build() in this process


def build(specs, *, cache: KernelCache | None = None, jobs: int | None = None,
          progress: bool = True) -> dict[KernelSpec, Path]:
    """Compile every spec not already cached, in parallel, with a progress bar; return the
    path of each spec's shared object."""
    specs = list(dict.fromkeys(specs))
    tools = toolchain()
    cache = cache or KernelCache()
    sources = {spec: render(spec) for spec in specs}
    keys = {spec: cache_key(spec, sources[spec], tools) for spec in specs}
    found = {spec: cache.lookup(keys[spec]) for spec in specs}
    # CUTLASS's GEMMs take several times longer to compile than sparsecc's own kernels: start them
    # first, so that the slowest are not what the pool ends on
    todo = sorted((spec for spec in specs if found[spec] is None), key=lambda spec: spec.family.own_launch)
    stats = BuildStats(cached=len(specs) - len(todo))
    start = time.perf_counter()
    if todo:
        jobs = jobs or settings().build_jobs
        with ThreadPoolExecutor(max_workers=min(jobs, len(todo))) as pool, \
                tqdm(total=len(todo), desc="sparsecc: compiling kernels", unit="kernel", disable=not progress) as bar:
            futures = {pool.submit(_build_one, spec.symbol, json.loads(spec.describe()), sources[spec], keys[spec],
                                   lambda src, out, spec=spec: nvcc_command(spec, tools, src, out), tools, cache): spec
                       for spec in todo}
            for future in as_completed(futures):
                found[futures[future]] = future.result()
                bar.update()
        stats.built, stats.symbols = len(todo), [spec.symbol for spec in todo]
    stats.seconds = time.perf_counter() - start
    LAST_BUILD.__dict__.update(stats.__dict__)
    for name, value in stats.__dict__.items():
        setattr(TOTAL_BUILD, name, getattr(TOTAL_BUILD, name) + value)
    return found


def build_source(symbol: str, description: dict, source: str, command, material: dict,
                 cache: KernelCache | None = None) -> Path:
    """Compile one source that is not a kernel template (e.g. the C++ launcher) through the
    same cache: ``command(source_path, output_path)`` gives the compiler's argv, ``material``
    whatever else the binary depends on (compiler and library versions)."""
    tools = toolchain()
    cache = cache or KernelCache()
    key = hashlib.sha256(json.dumps({"layout": CACHE_LAYOUT, "source": source, "material": material,
                                     "nvcc": tools.nvcc_version}, sort_keys=True).encode()).hexdigest()
    return cache.lookup(key) or _build_one(symbol, description, source, key, command, tools, cache)


def _build_one(symbol: str, description: dict, source: str, key: str, command, tools: Toolchain,
               cache: KernelCache) -> Path:
    with cache.lock(key):
        published = cache.lookup(key)          # another process may have built it meanwhile
        if published is not None:
            return published
        staging = Path(tempfile.mkdtemp(prefix=key[:16] + "-", dir=cache.root / "staging"))
        try:
            _compile_into(staging, symbol, description, source, key, command, tools, cache)
            try:
                os.rename(staging, cache.path(key))
            except OSError:
                if cache.lookup(key) is None:
                    raise
            return cache.path(key) / "kernel.so"
        except OSError as error:      # disk full, quota, permissions: the cache keeps its old state
            raise KernelBuildError(f"could not write {symbol} into the kernel cache {cache.root}: {error}") from error
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _compile_into(staging: Path, symbol: str, description: dict, source: str, key: str, command,
                  tools: Toolchain, cache: KernelCache) -> None:
    """Compile ``source`` into ``staging`` with the manifest that makes it a cache entry."""
    source_path = staging / "kernel.cu"
    source_path.write_text(source)
    binary = staging / "kernel.so"
    argv = command(source_path, binary)
    start = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0 or not binary.is_file():
        kept = cache.root / "failed" / f"{symbol}{source_path.suffix}"
        shutil.copyfile(source_path, kept)
        raise KernelBuildError(f"nvcc failed to compile {symbol} (exit {result.returncode})",
                               command=argv, stderr=result.stderr + result.stdout, source_path=str(kept))
    manifest = {"key": key, "symbol": symbol, "spec": description, "sha256": file_sha256(binary), "command": argv,
                "nvcc": tools.nvcc_version, "cutlass": tools.cutlass_version, "compile_seconds": round(seconds, 2)}
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=1))
    log.info("compiled %s in %.1f s", symbol, seconds)
