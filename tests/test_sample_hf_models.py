"""samples/hf_models.py on the CPU: each Hugging Face architecture, pruned to 2:4 and to
blocks, compiled with sparsecc.compile and through the torch.compile backend, matches the
eager model with the sparse format chosen wherever the weight fits it."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "samples"))
import hf_models  # noqa: E402

#: relative error against eager, fp32 on the CPU (the sparse products sum in another order)
TOLERANCE = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "vit"])
@pytest.mark.parametrize("pattern", list(hf_models.PATTERNS))
def test_sample_model_matches_eager_with_sparse_formats(name, pattern):
    result = hf_models.run(name, pattern, batch=2, device="cpu", inductor=False,
                           formats=hf_models.PATTERNS[pattern], verbose=False)
    expected = "2:4" if pattern == "2:4" else "bsr32x32"
    assert expected in result["choices"]
    assert result["rel_err_compile"] < TOLERANCE and result["rel_err_backend"] < TOLERANCE
    assert result["bytes_after"] < result["bytes_before"]
