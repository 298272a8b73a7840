"""Kernel directories (``sparsecc generate``): written once, loaded with no compiler, and
refused when their manifest or a binary does not match its hash."""
import json

import pytest
import torch
import torch.nn as nn

from sparsecc.cli import main
from sparsecc.codegen.spec import Family, KernelSpec
from sparsecc.ir.plan import Plan
from sparsecc.ir.formats import NM_2_4
from sparsecc.kernels.registry import plan_kernels, tuning_kernels
from sparsecc.kernels.sparse24_small import GEMM, GEMV, MMA
from sparsecc.pruning import prune
from sparsecc.runtime import build as build_module
from sparsecc.runtime import kernel_dir, loader
from sparsecc.runtime.kernel_dir import KernelDirectory, KernelDirectoryError, write
from sparsecc.runtime.kernel_op import ensure

from conftest import compiles

SPECS = [KernelSpec(Family.SM90_COMPRESS24, "float16"), KernelSpec(Family.SM90_SPARSE24, "float16")]


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """What a machine with no CUDA compiler looks like to sparsecc."""
    def off():
        monkeypatch.delenv("SPARSECC_NVCC", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))
        build_module._toolchain.cache_clear()
    return off


@pytest.fixture
def loads(monkeypatch):
    """Record which binaries the runtime opens instead of dlopen-ing the stand-in files."""
    opened = {}
    monkeypatch.setattr(loader, "Kernel", lambda spec, path: opened.setdefault(spec.symbol, path))
    monkeypatch.setattr(loader, "_REGISTRY", {})
    monkeypatch.setattr(kernel_dir, "_IN_USE", {})
    return opened


def test_generate_then_load_with_no_compiler_and_no_cache(fake_nvcc, tmp_path, no_compiler, loads):
    out = write(SPECS, tmp_path / "kernels", progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [k["symbol"] for k in manifest["kernels"]] == [s.symbol for s in SPECS]
    assert all((out / f"{s.symbol}.cu").is_file() and (out / f"{s.symbol}.so").is_file() for s in SPECS)
    ninja = (out / "build.ninja").read_text()
    assert all(f"build {s.symbol}.so: nvcc {s.symbol}.cu" in ninja for s in SPECS)
    built = compiles(fake_nvcc)
    assert built == len(SPECS)

    build_module.KernelCache().root.joinpath("kernels").rename(tmp_path / "deleted")   # no cache any more
    no_compiler()
    kernel_dir.use_kernels(out)
    before = build_module.TOTAL_BUILD.built
    ensure(SPECS, progress=False)
    assert loads == {s.symbol: out / f"{s.symbol}.so" for s in SPECS}
    assert compiles(fake_nvcc) == built and build_module.TOTAL_BUILD.built == before     # zero compiles


def test_a_kernel_missing_from_the_directory_says_so(fake_nvcc, tmp_path, no_compiler, loads):
    out = write(SPECS[:1], tmp_path / "kernels", progress=False)
    no_compiler()
    kernel_dir.use_kernels(out)
    with pytest.raises(build_module.KernelBuildError, match="not in the kernel directories.*nvcc was not found"):
        ensure(SPECS, progress=False)


def test_a_load_that_fails_hands_over_its_directory_kernels_later(fake_nvcc, tmp_path, no_compiler, loads):
    """Tuning asks for many kernels at once and falls back to the shipped table's when some are
    missing; the one it then asks for alone must still be handed to the op, not taken as loaded."""
    out = write(SPECS[:1], tmp_path / "kernels", progress=False)
    no_compiler()
    kernel_dir.use_kernels(out)
    with pytest.raises(build_module.KernelBuildError):
        loader.load(SPECS, progress=False)
    assert loader.find(SPECS[0].symbol) is None
    assert loader.load(SPECS[:1], progress=False) == [out / f"{SPECS[0].symbol}.so"]


def test_tampered_binary_is_refused(fake_nvcc, tmp_path, loads):
    out = write(SPECS, tmp_path / "kernels", progress=False)
    binary = out / f"{SPECS[1].symbol}.so"
    binary.write_bytes(binary.read_bytes() + b"\0")
    directory = kernel_dir.use_kernels(out)
    assert directory.binary(SPECS[0]).is_file()
    with pytest.raises(KernelDirectoryError, match="does not match the sha256"):
        ensure(SPECS, progress=False)


@pytest.mark.parametrize("damage", ["edit", "truncate", "delete", "templates"])
def test_damaged_manifest_is_refused(fake_nvcc, tmp_path, damage):
    out = write(SPECS, tmp_path / "kernels", progress=False)
    path = out / "manifest.json"
    manifest = json.loads(path.read_text())
    if damage == "edit":               # someone points an entry at another binary
        manifest["kernels"][0]["sha256"] = manifest["kernels"][1]["sha256"]
        path.write_text(json.dumps(manifest))
    elif damage == "truncate":
        path.write_text(path.read_text()[:40])
    elif damage == "delete":
        path.unlink()
    else:                              # consistent, but made by other templates
        manifest["templates"] = "0" * 64
        manifest.pop("manifest_sha256")
        from sparsecc.runtime.kernel_dir import _manifest_digest
        manifest["manifest_sha256"] = _manifest_digest(manifest)
        path.write_text(json.dumps(manifest))
    with pytest.raises(KernelDirectoryError):
        KernelDirectory(out)


def test_a_directory_serves_only_the_specs_it_was_built_for(fake_nvcc, tmp_path):
    directory = KernelDirectory(write(SPECS[:1], tmp_path / "kernels", progress=False))
    assert SPECS[0] in directory and SPECS[1] not in directory


def _pruned_model(dtype=torch.float16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 128), nn.Linear(128, 36))
    prune(model, "2:4", exclude=["3"])
    return model.to(dtype), torch.randn(4, 256, dtype=dtype)


@pytest.mark.parametrize("rows, expected", [
    (128, {Family.SM90_COMPRESS24, Family.SM90_SPARSE24}),        # past the small-batch kernels
    (1, {Family.GEMV_SM90_SPARSE24}),                             # decode: the gemv kernels
    (4, {Family.GEMV_MMA_SM90_SPARSE24}),                         # batched decode: the tensor-core ones
])
def test_plan_kernels_cover_every_2_4_site_the_kernels_take(rows, expected):
    """The kernels of a plan's 2:4 sites, all for sm_90a (the only architecture generated)."""
    from sparsecc import plan
    model, _ = _pruned_model()
    the_plan = plan(model, torch.randn(rows, 256, dtype=torch.float16), formats=("2:4",))
    specs = plan_kernels(the_plan)
    assert {s.family for s in specs} == expected
    assert all(s.dtype == "float16" and s.arch == "sm_90a" for s in specs)
    dense_only = Plan.from_json(the_plan.to_json())
    for site in dense_only:
        site.choice = "dense"
    assert plan_kernels(dense_only) == []


def test_tuning_kernels_hold_every_candidate_tuning_times_for_the_plans_sites():
    """What ``sparsecc generate --tuning`` adds: for each 2:4 site, the three 2:4 families'
    candidates at each bucket its rows meet (packing may race any of them), and the plan's own."""
    from sparsecc import plan
    model, _ = _pruned_model()
    the_plan = plan(model, torch.randn(4, 256, dtype=torch.float16), formats=("2:4",))
    specs = set(tuning_kernels(the_plan))
    for site in the_plan:
        shape = tuple(site.shape)
        for family in (GEMV, MMA, GEMM):
            if family.refuses(NM_2_4, shape, torch.float16) is None:
                for _, m in family.buckets.meeting(site.m, site.m):
                    assert {launch.spec for launch in family.candidates(torch.float16, shape, m)} <= specs
    assert KernelSpec(Family.SM90_COMPRESS24, "float16") in specs       # the GEMMs' packing runs it
    ranged = Plan.from_json(the_plan.to_json())
    for site in ranged:
        site.m_range = [1, 512]
    assert specs < set(tuning_kernels(ranged))                # more buckets
    for site in ranged:
        site.choice = "dense"
    assert tuning_kernels(ranged) == []


def test_generate_command_from_a_model_and_from_a_plan(fake_nvcc, tmp_path, capsys):
    script = tmp_path / "model.py"
    script.write_text("import sys; sys.path.insert(0, %r)\nfrom test_kernel_dir import _pruned_model\n"
                      "def build():\n    return _pruned_model(__import__('torch').float32)\n"
                      % str(__import__("pathlib").Path(__file__).parent))
    assert main(["generate", f"{script}:build", "--arch", "sm_90a", "--out", str(tmp_path / "a")]) == 0
    first = KernelDirectory(tmp_path / "a")
    symbols = {k["symbol"] for k in first.manifest["kernels"]}
    assert any(s.startswith("sparsecc_gemv_mma_sm90_sparse24_f16") for s in symbols)  # batch 4
    capsys.readouterr()
    assert main(["plan", f"{script}:build", "--dtype", "float16", "--device", "cpu", "--formats", "2:4", "--json"]) == 0
    (tmp_path / "plan.json").write_text(capsys.readouterr().out)
    assert main(["generate", str(tmp_path / "plan.json"), "--arch", "sm_90a", "--out", str(tmp_path / "b")]) == 0
    second = KernelDirectory(tmp_path / "b")
    assert {k["symbol"] for k in second.manifest["kernels"]} == symbols
    assert {k["arch"] for k in second.manifest["kernels"]} == {"sm_90a"}
    assert main(["generate", str(tmp_path / "plan.json"), "--arch", "sm_90a", "--out", str(tmp_path / "t"),
                 "--tuning"]) == 0
    tuning = {k["symbol"] for k in KernelDirectory(tmp_path / "t").manifest["kernels"]}
    assert symbols < tuning
    with pytest.raises(SystemExit):                    # sm_90a is the only architecture generated
        main(["generate", str(tmp_path / "plan.json"), "--arch", "sm_80", "--out", str(tmp_path / "c")])
    assert not (tmp_path / "c").exists()
