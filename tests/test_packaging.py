"""Both an editable install and a wheel built from the repository contain and find the
passes (sparsecc.passes, from passes/) and the templates (sparsecc.templates, from
templates/)."""
import importlib.resources
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_installed_package_finds_passes_and_templates():
    import sparsecc.passes.find_linear
    import sparsecc.passes.fuse_epilogue
    import sparsecc.passes.splice  # noqa: F401
    templates = importlib.resources.files("sparsecc.templates")
    names = {p.name for p in templates.iterdir()}
    expected = {p.name for p in (ROOT / "templates").glob("*.j2")}
    assert expected <= names
    from sparsecc import launcher
    assert "TORCH_LIBRARY_IMPL" in launcher.source()


@pytest.mark.slow
def test_wheel_contains_passes_and_templates(tmp_path):
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
    assert "sparsecc/csrc/launcher.cpp" in names and "sparsecc/tuning.json" in names
    assert not any(n.startswith(("passes/", "templates/", "tests/")) for n in names)
