"""The command line: plan (table and JSON), compile (saved, loadable, same outputs), cache,
clear errors."""
import json
import subprocess
import sys

import torch

from sparsecc import Plan, cli


def run(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparsecc.cli", *argv], capture_output=True, text=True, timeout=300)


def test_plan_prints_a_table_and_json():
    result = run("plan", "mlp", "--prune", "2:4", "--formats", "2:4", "--device", "cpu", "--batch", "4")
    assert result.returncode == 0, result.stderr
    assert "choice" in result.stdout and "2:4" in result.stdout
    result = run("plan", "mlp", "--prune", "2:4", "--formats", "2:4", "--device", "cpu", "--json")
    plan = Plan.from_json(result.stdout)
    assert [s.choice for s in plan] == ["2:4", "2:4", "2:4"]


def test_compile_saves_a_module_that_matches(tmp_path):
    out = tmp_path / "mlp.pt"
    assert cli.main(["compile", "mlp", "--prune", "unstructured@0.1", "--formats", "csr", "--device", "cpu",
                     "--out", str(out)]) == 0
    compiled = torch.load(out, weights_only=False)
    assert [s.choice for s in compiled.sparsecc_plan] == ["csr", "csr", "csr"]
    x = torch.randn(5, 784)
    assert compiled(x).shape == (5, 10)


def test_cache_listing_and_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPARSECC_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.main(["cache", "ls", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kernels"] == []
    assert cli.main(["cache", "verify"]) == 0
    result = run("plan", "no-such-model")
    assert result.returncode == 2 and "use one of" in result.stderr


def test_plan_over_a_batch_range_for_memory():
    result = run("plan", "mlp", "--prune", "unstructured@0.05", "--device", "cpu", "--m-range", "1", "64",
                 "--objective", "memory", "--json")
    assert result.returncode == 0, result.stderr
    plan = Plan.from_json(result.stdout)
    assert all(s.m_range == [1, 64] and "M in 1..64" in s.reason for s in plan)
    result = run("plan", "mlp", "--device", "cpu", "--m-range", "8", "2")
    assert result.returncode == 2 and "m_range" in result.stderr


def test_calibrate_prints_and_caches(tmp_path, monkeypatch):
    from sparsecc import calibration as calib
    monkeypatch.setenv("SPARSECC_CACHE_DIR", str(tmp_path))
    probes = [calib.Probe(256, 256, "dense", 1.0, "dense", m, "float32") for m in (1, 16, 128)]
    monkeypatch.setattr(calib, "calibration_workloads", lambda device: probes)
    assert cli.main(["calibrate", "--device", "cpu", "--json"]) == 0
    assert calib.cache_path(torch.device("cpu")).is_file() and not calib.for_device("cpu").borrowed
