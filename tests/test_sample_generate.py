"""samples/generate.py on the CPU: pruned to a pattern and forced onto its sparse format, the
compiled model generates the pruned model's tokens, planned from one token to the prompts, with
less weight memory, and both are timed; the script prints it for each pattern."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "samples"))
import generate  # noqa: E402


def test_sample_generates_the_pruned_models_tokens_on_csr():
    result = generate.run("unstructured@0.1", batch=2, prompt=8, new_tokens=3, device="cpu", repeats=1,
                          formats=generate.PATTERNS["unstructured@0.1"], verbose=False)
    assert result["same_tokens"] is True
    assert result["m_range"] == [2, 2 * 8]
    assert "csr" in result["choices"]
    assert result["bytes_after"] < result["bytes_before"]
    assert all(result[key] > 0 for key in ("eager_ttft_ms", "compiled_ttft_ms", "eager_tokens_per_s",
                                           "compiled_tokens_per_s"))


def test_sample_prints_each_pattern(capsys):
    [result] = generate.main(["--patterns", "2:4", "--batch", "1", "--prompt", "8", "--new-tokens", "2",
                              "--device", "cpu", "--force-formats"])
    out = capsys.readouterr().out
    assert "2:4: formats" in out and "first token" in out and "same tokens: yes" in out
    assert "2:4" in result["choices"] and result["m_range"] == [1, 8]


def test_sample_gives_both_models_the_attention_asked_for():
    for attention in ("grouped", "sdpa"):
        result = generate.run("2:4", batch=2, prompt=8, new_tokens=3, device="cpu", repeats=1, attention=attention,
                              formats=generate.PATTERNS["2:4"], verbose=False)
        assert result["same_tokens"] is True and result["attention"] == attention
