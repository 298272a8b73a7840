"""The kernel cache (DESIGN principle 7) with a stand-in compiler, so every fault is quick
to provoke; and, where nvcc and CUTLASS exist, every template compiled for real."""
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from sparsecc.codegen.spec import Family, KernelSpec, Scheduler
from sparsecc.errors import KernelBuildError
from sparsecc.runtime import build as build_module
from sparsecc.runtime.build import KernelCache, build, toolchain

from conftest import compiles, requires_nvcc

SPEC = KernelSpec(Family.SM90_DENSE, "float16")

def test_second_build_comes_from_the_cache(fake_nvcc, tmp_path):
    first = build([SPEC], progress=False)[SPEC]
    assert build_module.LAST_BUILD.built == 1 and compiles(fake_nvcc) == 1
    again = build([SPEC], progress=False)[SPEC]
    assert again == first and build_module.LAST_BUILD.cached == 1 and compiles(fake_nvcc) == 1
    manifest = json.loads((first.parent / "manifest.json").read_text())
    assert manifest["symbol"] == SPEC.symbol and manifest["nvcc"].endswith("V13.0.0-test")
    assert oct((tmp_path / "cache").stat().st_mode & 0o777) == "0o700"


def test_cutlass_gemms_start_compiling_first(fake_nvcc, monkeypatch):
    """One job: the order of compiles is the order of submission, and the GEMMs lead it."""
    started = []
    real = build_module._build_one
    monkeypatch.setattr(build_module, "_build_one", lambda symbol, *rest: started.append(symbol) or real(symbol, *rest))
    own = [KernelSpec(Family.BSR_SM90_WGMMA, "float16", tile=(64, 64, 128)),
           KernelSpec(Family.CSR_SM90, "float16", tile=(64, 16, 256))]
    gemms = [SPEC, KernelSpec(Family.SM90_SPARSE24, "float16")]
    paths = build([own[0], gemms[0], own[1], gemms[1]], jobs=1, progress=False)
    assert started == [s.symbol for s in gemms + own]
    assert list(paths) == [own[0], gemms[0], own[1], gemms[1]] and all(p.is_file() for p in paths.values())


def test_key_covers_source_compiler_and_flags(fake_nvcc, monkeypatch):
    tools = toolchain()
    key = build_module.cache_key(SPEC, "source", tools)
    assert key != build_module.cache_key(SPEC, "source ", tools)
    assert key != build_module.cache_key(SPEC, "source", tools.__class__(tools.nvcc, "other", tools.cutlass_include, tools.cutlass_version))
    assert key != build_module.cache_key(SPEC, "source", tools.__class__(tools.nvcc, tools.nvcc_version,
                                                                          tools.cutlass_include, "other"))
    monkeypatch.setitem(build_module._ARCH_FLAGS, SPEC.arch, "-gencode=arch=compute_90a,code=[sm_90a,compute_90a]")
    assert key != build_module.cache_key(SPEC, "source", tools)


def test_corrupt_or_truncated_entry_is_rebuilt(fake_nvcc):
    binary = build([SPEC], progress=False)[SPEC]
    binary.write_bytes(binary.read_bytes()[:10])
    assert build([SPEC], progress=False)[SPEC] == binary
    assert build_module.LAST_BUILD.built == 1 and compiles(fake_nvcc) == 2
    (binary.parent / "manifest.json").write_text("{not json")
    build([SPEC], progress=False)
    assert compiles(fake_nvcc) == 3


def test_cache_writable_by_others_is_not_trusted(fake_nvcc, tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    cache = KernelCache(shared)
    assert cache.root != shared and "writable by other users" in caplog.text
    path = build([SPEC], cache=cache, progress=False)[SPEC]
    assert shared not in path.parents


def test_read_only_cache_falls_back_to_a_private_one(fake_nvcc, tmp_path, monkeypatch, caplog):
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o700)
    read_only.chmod(0o500)
    if os.geteuid() == 0:        # root writes through file modes: make the check see what a user would
        real_access = os.access
        monkeypatch.setattr(build_module.os, "access",
                            lambda path, mode: False if str(path) == str(read_only) else real_access(path, mode))
    cache = KernelCache(read_only)
    assert cache.root != read_only and "using the private cache" in caplog.text
    assert build([SPEC], cache=cache, progress=False)[SPEC].is_file()
    assert list(read_only.iterdir()) == []


def test_disk_full_while_publishing_keeps_the_old_state(fake_nvcc, monkeypatch):
    other = KernelSpec(Family.SM90_DENSE, "bfloat16")
    kept = build([other], progress=False)[other]
    before = sorted(p.name for p in (KernelCache().root / "kernels").iterdir())

    def no_space(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(build_module.os, "rename", no_space)
    with pytest.raises(KernelBuildError, match="No space left on device"):
        build([SPEC], progress=False)
    root = KernelCache().root
    assert sorted(p.name for p in (root / "kernels").iterdir()) == before
    assert not list((root / "staging").iterdir())
    assert build([other], progress=False)[other] == kept and build_module.LAST_BUILD.cached == 1


def test_compile_failure_reports_command_stderr_and_source(fake_nvcc, monkeypatch):
    monkeypatch.setattr(build_module, "render", lambda spec: "#error broken template\n")
    with pytest.raises(KernelBuildError) as caught:
        build([SPEC], progress=False)
    error = caught.value
    assert error.command[0].endswith("nvcc") and "-o" in error.command
    assert "error: boom" in error.stderr and os.path.isfile(error.source_path)
    assert "#error broken template" in open(error.source_path).read()
    assert not list((KernelCache().root / "kernels").iterdir())       # nothing published


def test_missing_nvcc_or_cutlass_is_a_clear_error(fake_nvcc, monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSECC_NVCC", str(tmp_path / "no-such-nvcc"))
    build_module._toolchain.cache_clear()
    with pytest.raises(KernelBuildError, match="cannot run"):
        build([SPEC], progress=False)
    monkeypatch.delenv("SPARSECC_NVCC")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(KernelBuildError, match="nvcc was not found"):
        build([SPEC], progress=False)


def _build_in_child(queue):
    try:
        path = build([SPEC], progress=False)[SPEC]
        queue.put(str(path))
    except Exception as error:  # noqa: BLE001
        queue.put(f"error: {error}")


def test_concurrent_builders_share_one_compile(fake_nvcc, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "1.0")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_build_in_child, args=(queue,)) for _ in range(4)]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join()
    assert len(set(results)) == 1 and not results[0].startswith("error"), results
    assert compiles(fake_nvcc) == 1


def test_build_killed_midway_leaves_no_entry(fake_nvcc, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "30")
    code = "from sparsecc.runtime.build import build; from sparsecc.codegen.spec import *; build([KernelSpec(Family.SM90_DENSE, 'float16')], progress=False)"
    child = subprocess.Popen([sys.executable, "-c", code], env=os.environ.copy())
    deadline = time.time() + 30
    while compiles(fake_nvcc) == 0 and time.time() < deadline:
        time.sleep(0.1)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not list((tmp_path / "cache" / "kernels").iterdir())
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "0")
    assert build([SPEC], progress=False)[SPEC].is_file()


#: one kernel of every template (its default tile), the GEMMs' sliced scheduler, dense and 2:4
#: (a second kernel in the same source), and the 2:4 compressor for e4m3
COMPILED = [KernelSpec(family, "float16") for family in Family] + [
    KernelSpec(Family.SM90_DENSE, "float16", tile=(128, 64, 64), scheduler=Scheduler.SLICED),
    KernelSpec(Family.SM90_SPARSE24, "float16", tile=(128, 32, 128), scheduler=Scheduler.SLICED),
    KernelSpec(Family.SM90_COMPRESS24, "float8_e4m3fn")]


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.slow
def test_every_template_compiles_with_nvcc(tmp_path):
    """Compile-only check of each family (the GPU may be absent): a real shared object each,
    built in one parallel build as a session's kernels are."""
    build_module._toolchain.cache_clear()
    paths = build(COMPILED, cache=KernelCache(tmp_path), progress=False)
    for spec, path in paths.items():
        assert path.stat().st_size > 10_000, spec.symbol
        assert spec.symbol.encode() in path.read_bytes()
