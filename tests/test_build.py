"""The kernel cache (DESIGN principle 7) with a stand-in compiler, so every fault is quick
to provoke; and, where nvcc and CUTLASS exist, every template compiled for real."""
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sparsecc import build as build_module
from sparsecc.build import KernelCache, build, toolchain
from sparsecc.codegen import Family, KernelSpec
from sparsecc.errors import KernelBuildError

from conftest import requires_nvcc

SPEC = KernelSpec(Family.SM90_DENSE, "float16")

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


def test_second_build_comes_from_the_cache(fake_nvcc, tmp_path):
    first = build([SPEC], progress=False)[SPEC]
    assert build_module.LAST_BUILD.built == 1 and compiles(fake_nvcc) == 1
    again = build([SPEC], progress=False)[SPEC]
    assert again == first and build_module.LAST_BUILD.cached == 1 and compiles(fake_nvcc) == 1
    manifest = json.loads((first.parent / "manifest.json").read_text())
    assert manifest["symbol"] == SPEC.symbol and manifest["nvcc"].endswith("V13.0.0-test")
    assert oct((tmp_path / "cache").stat().st_mode & 0o777) == "0o700"


def test_key_covers_source_compiler_and_flags(fake_nvcc):
    tools = toolchain()
    key = build_module.cache_key(SPEC, "source", tools)
    assert key != build_module.cache_key(SPEC, "source ", tools)
    assert key != build_module.cache_key(SPEC, "source", tools.__class__(tools.nvcc, "other", tools.cutlass_include, tools.cutlass_version))
    assert key != build_module.cache_key(KernelSpec(Family.SM80_DENSE, "float16"), "source", tools)


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
    code = "from sparsecc.build import build; from sparsecc.codegen import *; build([KernelSpec(Family.SM90_DENSE, 'float16')], progress=False)"
    child = subprocess.Popen([sys.executable, "-c", code], env=os.environ.copy())
    deadline = time.time() + 30
    while compiles(fake_nvcc) == 0 and time.time() < deadline:
        time.sleep(0.1)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not list((tmp_path / "cache" / "kernels").iterdir())
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "0")
    assert build([SPEC], progress=False)[SPEC].is_file()


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.slow
def test_every_template_compiles_with_nvcc(tmp_path):
    """Compile-only check of each family (the GPU may be absent): a real shared object."""
    build_module._toolchain.cache_clear()
    specs = [KernelSpec.default(family, "float16") for family in Family]
    paths = build(specs, cache=KernelCache(tmp_path), progress=False)
    for spec, path in paths.items():
        assert path.stat().st_size > 10_000, spec.symbol
        assert spec.symbol.encode() in path.read_bytes()
