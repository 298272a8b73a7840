"""The command line: plan (table and JSON), compile (saved, loadable, same outputs), cache,
clear errors (tune without a GPU, arguments argparse refuses)."""
import json
import subprocess
import sys

import pytest
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
    from sparsecc.planner import calibrate as calibration
    from sparsecc.planner.fit import cache_path, for_device
    monkeypatch.setenv("SPARSECC_CACHE_DIR", str(tmp_path))
    probes = [calibration.Probe(256, 256, "dense", 1.0, "dense", m, "float32") for m in (1, 16, 128)]
    monkeypatch.setattr(calibration, "calibration_workloads", lambda device: probes)
    assert cli.main(["calibrate", "--device", "cpu", "--json"]) == 0
    assert cache_path(torch.device("cpu")).is_file() and not for_device("cpu").borrowed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
@pytest.mark.parametrize("argv", [["tune", "mlp"], ["tune", "--shapes", "4096x4096", "--ms", "1"], ["tune"]],
                         ids=["model", "shapes", "neither"])
def test_tune_without_a_gpu_is_a_one_line_error(argv, monkeypatch, capsys):
    """Without a GPU, ``sparsecc tune`` exits with code 2 and one line saying why, before it loads
    a model; with neither a model nor --shapes the GPU check comes first too."""
    monkeypatch.setenv("SPARSECC_TUNE", "new")         # tune sets it for the process
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and captured.out == ""
    assert lines[0].startswith("sparsecc: error: tuning times sparsecc's kernels on a Hopper GPU: ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
def test_tune_without_a_gpu_from_the_shell():
    """The ``sparsecc`` process itself: exit code 2, one line on stderr."""
    result = run("tune", "--shapes", "4096x4096")
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sparsecc: error: tuning times sparsecc's kernels on a Hopper GPU: ")


def test_tune_needs_a_model_or_shapes_where_kernels_could_run(monkeypatch, capsys):
    """Where the kernels could run, tune with neither a model nor --shapes (or with both) is an
    error, raised before anything is tuned."""
    monkeypatch.setenv("SPARSECC_TUNE", "new")
    monkeypatch.setattr(cli, "kernels_unavailable", lambda device: None)
    assert cli.main(["tune"]) == 2
    assert capsys.readouterr().err.strip() == (
        "sparsecc: error: tune needs a MODEL or --shapes NxK ... (with --ms)")
    assert cli.main(["tune", "mlp", "--shapes", "64x64"]) == 2
    assert capsys.readouterr().err.strip() == "sparsecc: error: tune takes a MODEL or --shapes, not both"


@pytest.mark.parametrize("argv,says", [
    (["tune", "--shapes", "4096xabc"], "is not a weight shape NxK"),
    (["generate", "mlp", "--arch", "sm_80", "--out", "kernels"], "invalid choice"),
], ids=["tune-bad-shape", "generate-sm80"])
def test_arguments_argparse_refuses(argv, says, capsys):
    """A shape that is not NxK, and an architecture other than sm_90a (the kernels are Hopper's)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and argv[-3 if argv[0] == "generate" else -1] in err


def test_a_log_level_that_is_none_is_refused_in_one_line():
    result = run("--log", "verbose", "plan", "mlp")
    assert result.returncode == 2 and "argument --log: invalid choice: 'VERBOSE'" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_function_in_a_model_file_is_named(tmp_path, capsys):
    script = tmp_path / "model.py"
    script.write_text("def build():\n    pass\n")
    assert cli.main(["plan", f"{script}:missing", "--device", "cpu"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("sparsecc: error: ") and "defines no function 'missing'" in error
    assert len(error.splitlines()) == 1


def test_a_builtin_model_without_transformers_names_the_extra(monkeypatch, capsys):
    """Hide transformers: the Hugging Face models then ask for `pip install sparsecc[models]`."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert cli.main(["plan", "gpt2", "--device", "cpu"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("sparsecc: error: ") and "pip install 'sparsecc[models]'" in error


def test_calibrate_shows_an_unconstrained_fit_as_not_applicable(monkeypatch, capsys):
    """A fit the probes did not constrain (a rate or bandwidth no machine has) prints n/a, not 1e48."""
    from sparsecc.planner import fit as fitting

    found = fitting.Calibration(key="k", device="cpu-test", fits={
        "dense/float32": fitting.Fit(10.0, 5e10, 2e10, 2.0, points=8),
        "csr/float32": fitting.Fit(20.0, 3e10, 1.7e57, 1.5, points=8)})
    monkeypatch.setattr(cli.calibration, "calibrate", lambda device, progress=True: found)
    assert cli.main(["calibrate", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "n/a GB/s" in out and "e+48" not in out and "20.0 GB/s" in out


TINY_CAUSAL_LM = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def lm():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval(), torch.randint(3, 256, (2, 8))
'''


def test_bench_generate_times_a_causal_lm(tmp_path, capsys):
    """``bench --generate``: eager and compiled generate the same tokens; each has a time to the
    first token and a decode rate; the plan covers M from 1 to batch x prompt."""
    script = tmp_path / "lm.py"
    script.write_text(TINY_CAUSAL_LM)
    assert cli.main(["bench", f"{script}:lm", "--generate", "--prune", "2:4", "--exclude", "*lm_head*", "*embed*",
                     "--formats", "2:4", "--device", "cpu", "--new-tokens", "4", "--repeats", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["same_tokens"] is True and summary["m_range"] == [2, 16]
    assert (summary["batch"], summary["prompt"], summary["new_tokens"]) == (2, 8, 4)
    assert [row["impl"] for row in summary["rows"]] == ["eager", "sparsecc"]
    assert all(row["ttft_ms"] > 0 and row["tokens_per_s"] > 0 for row in summary["rows"])
    assert summary["weight_bytes_after"] < summary["weight_bytes_before"]
    assert cli.main(["bench", f"{script}:lm", "--generate", "--device", "cpu", "--new-tokens", "2", "--repeats", "1",
                     "--cache", "static"]) == 0
    out = capsys.readouterr().out
    assert "first token" in out and "tokens/s" in out and "same tokens: yes" in out
    assert cli.main(["bench", f"{script}:lm", "--generate", "--device", "cpu", "--new-tokens", "3", "--repeats", "1",
                     "--cache", "static", "--loop", "greedy_loop", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["loop"] == "greedy_loop" and summary["same_tokens"] is True
    assert all(row["ttft_ms"] > 0 and row["tokens_per_s"] > 0 for row in summary["rows"])
    assert summary["attention"] == "sdpa"
    assert cli.main(["bench", f"{script}:lm", "--generate", "--device", "cpu", "--new-tokens", "3", "--repeats", "1",
                     "--cache", "static", "--grouped-attention", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["attention"] == "sparsecc_grouped_sdpa" and summary["same_tokens"] is True
    assert cli.main(["bench", f"{script}:lm", "--generate", "--device", "cpu", "--loop", "greedy_loop"]) == 2
    assert "--loop greedy_loop fills a static cache: add --cache static" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["mlp", "llama-1b"])
def test_bench_generate_refuses_a_model_that_cannot_generate_in_one_line(model, capsys):
    assert cli.main(["bench", model, "--generate", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and captured.out == ""
    assert lines[0].startswith(f"sparsecc: error: {model} has no language-model head and cannot generate")
    assert "llama-1b-causal" in lines[0]
