"""Both an editable install and a wheel built from the repository contain and find the
passes (sparsecc.passes, from passes/), the templates (sparsecc.templates, from
templates/), every subpackage of sparsecc and the package data (the shipped tuning table,
the C++ launcher's source, the shipped calibrations, py.typed)."""
import importlib
import importlib.metadata
import importlib.resources
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: the subpackages of sparsecc (from sparsecc/), each with modules of its own
SUBPACKAGES = ("ir", "frontend", "codegen", "runtime", "kernels", "planner", "pruning")
#: package data, as installed (paths inside the wheel)
PACKAGE_DATA = ["sparsecc/kernels/tuning.json", "sparsecc/runtime/csrc/launcher.cpp", "sparsecc/py.typed",
                *(f"sparsecc/planner/calibrations/{p.name}"
                  for p in sorted((ROOT / "sparsecc" / "planner" / "calibrations").glob("*.json")))]


def test_installed_package_finds_passes_templates_and_data():
    for name in ("find_linear", "fuse_epilogue", "splice", "conv_as_linear", "patterns"):
        importlib.import_module(f"sparsecc.passes.{name}")
    templates = importlib.resources.files("sparsecc.templates")
    names = {p.name for p in templates.iterdir()}
    expected = {p.name for p in (ROOT / "templates").glob("*.j2")}
    assert expected <= names
    from sparsecc.runtime import launcher
    assert "TORCH_LIBRARY_IMPL" in launcher.source()
    for sub in SUBPACKAGES:
        importlib.import_module(f"sparsecc.{sub}")
    assert (importlib.resources.files("sparsecc.kernels") / "tuning.json").is_file()
    assert {"cpu.json", "cuda.json"} <= {p.name for p in (importlib.resources.files("sparsecc.planner")
                                                          / "calibrations").iterdir()}
    assert (importlib.resources.files("sparsecc") / "py.typed").is_file()


@pytest.mark.slow
def test_wheel_contains_subpackages_passes_templates_and_data(tmp_path):
    source = tmp_path / "src"            # build from a copy: setuptools writes build files in place
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".kcache", ".whl", ".ci-venv", "venv",
                                                                 "build", "*.egg-info", "__pycache__", "results"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(source)], check=True, cwd=tmp_path)
    wheel = next(tmp_path.glob("sparsecc-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (ROOT / "passes").glob("*.py"):
        assert f"sparsecc/passes/{path.name}" in names
    for path in (ROOT / "templates").glob("*.j2"):
        assert f"sparsecc/templates/{path.name}" in names
    assert "sparsecc/templates/__init__.py" in names and "sparsecc/compiler.py" in names
    # every subpackage of the source tree, with all of its modules (none left out of pyproject's list)
    found = {p.parent.name for p in (ROOT / "sparsecc").glob("*/__init__.py")}
    assert set(SUBPACKAGES) <= found
    for sub in sorted(found):
        modules = sorted((ROOT / "sparsecc" / sub).glob("*.py"))
        assert modules and all(f"sparsecc/{sub}/{p.name}" in names for p in modules), sub
    assert len(PACKAGE_DATA) >= 5
    for data in PACKAGE_DATA:
        assert data in names, data
    # nothing left at the places the data moved from, nothing outside the package
    assert not {"sparsecc/tuning.json", "sparsecc/csrc/launcher.cpp"} & names
    assert not any(n.startswith("sparsecc/calibrations/") for n in names)
    assert not any(n.startswith(("passes/", "templates/", "tests/")) for n in names)


@pytest.mark.parametrize("folder", ["tests", "benchmarks", "samples"])
def test_no_script_folder_shadows_an_installed_package(folder):
    """tests/, benchmarks/ and samples/ go first on sys.path when their scripts run, so a module or
    package of theirs named like an installed distribution's would be imported in its place (by
    transformers probing for the ``kernels`` package, say, which then failed to import)."""
    installed = importlib.metadata.packages_distributions()
    names = {p.stem for p in (ROOT / folder).glob("*.py")} | {p.name for p in (ROOT / folder).iterdir() if p.is_dir()}
    shadowing = {name: installed[name] for name in names if name in installed}
    assert not shadowing, f"{folder}/ would shadow installed packages: {shadowing}"
