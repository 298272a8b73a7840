"""Pruning a model that lives on the GPU: the weights stay there in their dtype, kept weights are
untouched, n:m patterns fit exactly, and the report matches an fp64 recount, as on the CPU."""
import pytest
import torch
import torch.nn as nn

import sparsecc
from sparsecc.ir.analysis import analyze

pytestmark = pytest.mark.gpu


def check_prune_on(device: str, pattern: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 256)).half().to(device)
    before = [layer.weight.detach().double().cpu() for layer in (model[0], model[2])]
    report = sparsecc.prune(model, pattern)
    for layer, original, entry in zip((model[0], model[2]), before, report.layers):
        weight = layer.weight.detach()
        assert weight.device.type == device and weight.dtype == torch.float16
        kept = weight.double().cpu()
        assert torch.equal(kept[kept != 0], original[kept != 0])
        assert entry.density == pytest.approx(kept.count_nonzero().item() / kept.numel(), abs=1e-12)
        assert entry.magnitude_kept == pytest.approx((kept.abs().sum() / original.abs().sum()).item(), rel=1e-6)
        if ":" in pattern:
            assert analyze(weight.float().cpu()).fits(sparsecc.FormatSpec.parse(pattern))


@pytest.mark.parametrize("pattern", ["2:4", "3:32", "block32x32@0.25", "unstructured@0.1"])
def test_prune_on_the_gpu_keeps_the_model_there(pattern):
    check_prune_on("cuda", pattern)
