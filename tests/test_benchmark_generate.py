"""benchmarks/generate.py on the CPU: the cases its arguments select, the logits comparison, and
a smoke run on tiny models of both families with each pattern forced onto its format: a dense
and a sparsecc row per case and loop (``generate`` and ``greedy_loop``), sparsecc's on sparse formats and planned from one token to the
prompts, the same tokens and logits within fp32 tolerance, a results file and its plot."""
import copy
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
_spec = importlib.util.spec_from_file_location("benchmark_generate", BENCHMARKS / "generate.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
import common  # noqa: E402

#: relative error of the logits against the dense model's, fp32 (sparse products sum in another order)
TOLERANCE = 1e-5


def test_the_default_set_and_products_of_the_lists():
    none = SimpleNamespace(models=None, patterns=None, batches=None)
    assert bench.cases(none) == bench.DEFAULT_CASES
    assert ("llama-1b", "2:4", 32) in bench.DEFAULT_CASES and ("gpt2", "2:4", 1) in bench.DEFAULT_CASES
    some = SimpleNamespace(models=["gpt2"], patterns=None, batches=[8])
    assert bench.cases(some) == [("gpt2", "2:4", 8), ("gpt2", "block64x64@0.1", 8)]
    assert [bench.format_of(p) for p in ("2:4", "block64x64@0.1", "unstructured@0.5")] == ["2:4", "bsr64x64", "csr"]


def test_logits_are_compared_until_the_texts_part():
    prompt = torch.tensor([[5, 6], [7, 8]])
    dense_tokens, sparse_tokens = torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.tensor([[1, 2, 3], [1, 4, 3]])
    logits = [torch.ones(2, 10) for _ in range(3)]
    shifted = [logits[0], logits[1] * 1.5, logits[2] * 9]        # step 1 differs, step 2 follows other texts
    dense = SimpleNamespace(sequences=torch.cat([prompt, dense_tokens], 1), logits=logits)
    sparse = SimpleNamespace(sequences=torch.cat([prompt, sparse_tokens], 1), logits=shifted)
    assert bench.compare_logits(dense, sparse) == {"rel_err": 0.5, "steps_compared": 2, "same_tokens": False}
    same = bench.compare_logits(dense, SimpleNamespace(sequences=dense.sequences, logits=logits))
    assert same == {"rel_err": 0.0, "steps_compared": 3, "same_tokens": True}


def test_a_tiny_run_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    result = bench.main(["--device", "cpu", "--tiny", "--modes", "eager", "--force-formats", "--batches", "2",
                         "--patterns", "2:4", "block64x64@0.1", "unstructured@0.5", "--prompt", "12",
                         "--new-tokens", "5", "--repeats", "1"])
    rows = result["rows"]
    assert len(rows) == 2 * 2 * 3 * 2               # two models, three patterns, dense and sparsecc, two loops
    assert {row["attention"] for row in rows} == {"grouped"}      # the default, on both sides
    assert [row["loop"] for row in rows[:4]] == ["generate", "generate", "greedy_loop", "greedy_loop"]
    for dense, sparse in zip(rows[::2], rows[1::2]):
        assert (dense["impl"], sparse["impl"]) == ("dense", "sparsecc") and dense["loop"] == sparse["loop"]
        assert dense["pattern"] == sparse["pattern"] and dense["model"] == sparse["model"]
        assert bench.format_of(sparse["pattern"]) in sparse["choices"]
        assert sparse["m_range"] == [2, 2 * 12] and sparse["M"] == 24
        assert sparse["same_tokens"] is True and sparse["steps_compared"] == 5
        assert sparse["rel_err"] <= TOLERANCE
        assert all(row["ttft_ms"] > 0 and row["tokens_per_s"] > 0 for row in (dense, sparse))
        if sparse["pattern"] != "unstructured@0.5":         # CSR's indices outweigh half the values
            assert sparse["weight_bytes"] < dense["weight_bytes"]
    [written] = tmp_path.glob("generate-*.json")
    assert json.loads(written.read_text())["rows"] == json.loads(json.dumps(rows))
    assert written.with_suffix(".png").is_file()


def test_a_tiny_quantized_run_on_the_cpu(tmp_path, monkeypatch):
    """--quantize fp8: both sides the pruned model quantized, the dense one compiled dense (FP8 sites
    on their reference op on the CPU) and sparsecc's with the FP8 sites packed 2:4; the same tokens."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    result = bench.main(["--device", "cpu", "--tiny", "--modes", "eager", "--quantize", "fp8", "--models", "llama-1b",
                         "--batches", "2", "--patterns", "2:4", "--prompt", "12", "--new-tokens", "5", "--repeats", "1",
                         "--loops", "greedy_loop"])
    dense, sparse = result["rows"]
    assert (dense["format"], sparse["format"]) == ("fp8", "fp8-2:4") and dense["quantize"] == sparse["quantize"] == "fp8"
    assert sparse["choices"]["2:4"] > 0 and sparse["same_tokens"] is True and sparse["rel_err"] <= TOLERANCE


@pytest.mark.parametrize("attention", bench.ATTENTIONS)
def test_both_sides_get_the_attention_asked_for(attention):
    from sparsecc.grouped_attention import NAME
    for name in bench.MODELS:
        model = bench.build(name, tiny=True, device=torch.device("cpu"), dtype=torch.float32, attention=attention)
        assert model.config._attn_implementation == (NAME if attention == "grouped" else "sdpa")


def test_runs_of_either_attention_keep_each_others_rows(tmp_path, monkeypatch):
    """Two runs of one case on the same day, one per attention, leave both pairs of rows in the
    day's file (each run replaces only its own attention's rows)."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    args = ["--device", "cpu", "--tiny", "--modes", "eager", "--force-formats", "--batches", "1", "--models", "gpt2",
            "--patterns", "2:4", "--prompt", "6", "--new-tokens", "2", "--repeats", "1", "--loops", "generate"]
    bench.main(args + ["--attention", "sdpa"])
    bench.main(args + ["--attention", "grouped"])
    again = bench.main(args + ["--attention", "grouped"])
    assert sorted((row["attention"], row["impl"]) for row in again["rows"]) == [
        ("grouped", "dense"), ("grouped", "sparsecc"), ("sdpa", "dense"), ("sdpa", "sparsecc")]
    assert len(list(tmp_path.glob("generate-*.json"))) == 1 and list(tmp_path.glob("generate-*.png"))


def test_a_decode_steps_kernels_are_profiled():
    """``--profile``'s breakdown of one decode step: the prompt's forward left out (its rows differ),
    the longest first, and a compiled model's step running sparsecc's op once per site."""
    import sparsecc
    from sparsecc.generation import static_cache
    model = bench.build("llama-1b", tiny=True, device=torch.device("cpu"), dtype=torch.float32)
    sparsecc.prune(model, "2:4", exclude=bench.EXCLUDE)
    prompts = torch.randint(1, 500, (2, 6), generator=torch.Generator().manual_seed(0))
    compiled = sparsecc.compile(model, prompts, formats=("2:4",))
    step = bench.decode_kernels(compiled, prompts, static_cache(compiled, 6 + 1 + bench.PROFILED_STEPS))
    assert step["us_per_step"] > 0 and step["launches_per_step"] > 0
    times = [us for _, us, _ in step["top"]]
    assert times == sorted(times, reverse=True) and len(step["top"]) <= bench.PROFILED_TOP
    calls = {name: launches for name, _, launches in step["top"]}
    sites = len({site.group or site.name for site in compiled.sparsecc_plan if site.choice == "2:4"})
    assert calls.get("sparsecc::linear_nm") == sites          # per step, whatever the prompt's forward ran
    prompt_calls = {name: launches for name, _, launches in step["prompt_top"]}
    assert prompt_calls.get("sparsecc::linear_nm") == sites and step["prompt_us"] > 0   # one forward


@pytest.mark.slow
@pytest.mark.parametrize("flag, impls", [("--backend", {"dense", "sparsecc", "sparsecc-backend"}),
                                         ("--backend-only", {"dense", "sparsecc-backend"})])
def test_the_backend_impl_generates_what_dense_does(tmp_path, monkeypatch, flag, impls):
    """``--backend``: the pruned model through torch.compile(backend="sparsecc",
    mode="reduce-overhead"), its prefill and decode graphs planned apart; with the formats forced its
    decode graph runs 2:4, q, k and v in one call, gate and up in another. ``--backend-only``: the
    same without sparsecc.compile's impl."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    result = bench.main(["--device", "cpu", "--tiny", "--modes", "graphs", flag, "--force-formats",
                         "--batches", "2", "--patterns", "2:4", "--prompt", "12", "--new-tokens", "5",
                         "--repeats", "1", "--models", "llama-1b", "--loops", "greedy_loop"])
    rows = {row["impl"]: row for row in result["rows"]}
    assert set(rows) == impls
    backend = rows["sparsecc-backend"]
    assert backend["same_tokens"] is True and backend["rel_err"] <= TOLERANCE
    assert backend["choices"].get("2:4", 0) >= 2 * 7 and backend["shared_calls"] >= 2 * 2
    assert backend["tokens_per_s"] > 0 and backend["weight_bytes"] is None
    assert list(tmp_path.glob("generate-*.png"))


def test_wanda_prunes_on_calibration_prompts():
    """``--criterion wanda``: the masks come from Wanda's scores on random-token prompts, so they
    differ from magnitude's at the same density."""
    model = bench.build("llama-1b", tiny=True, device=torch.device("cpu"), dtype=torch.float32)
    by_magnitude, by_wanda = [copy.deepcopy(model) for _ in range(2)]
    magnitude = bench.prune(by_magnitude, "unstructured@0.5", SimpleNamespace(criterion="magnitude"))
    wanda = bench.prune(by_wanda, "unstructured@0.5", SimpleNamespace(criterion="wanda"))
    assert (magnitude.criterion, wanda.criterion) == ("magnitude", "wanda")
    assert abs(wanda.density - 0.5) < 0.01 and abs(magnitude.density - 0.5) < 0.01
    weight = "model.layers.0.mlp.down_proj.weight"
    masks = [dict(m.named_parameters())[weight] != 0 for m in (by_magnitude, by_wanda)]
    assert not torch.equal(*masks)
    assert torch.equal(dict(by_wanda.named_parameters())["lm_head.weight"], dict(model.named_parameters())["lm_head.weight"])
