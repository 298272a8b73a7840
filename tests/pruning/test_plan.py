"""Weights pruned with each pattern are planned with the matching exact sparse format among
the candidates, and the cost model picks it where it predicts it fastest."""
import pytest
import torch
import torch.nn as nn

import sparsecc
from sparsecc import CostModel

PATTERN_FORMAT = [
    ("2:4", "2:4"), ("1:4", "1:4"), ("3:32", "3:32"), ("2:4/vw4", "2:4"),
    ("2:4/bw32", "bsr32x32"), ("block32x32@0.25", "bsr32x32"), ("block16x64@0.2", "bsr16x64"),
    ("unstructured@0.1", "csr"),
]


@pytest.mark.parametrize("pattern,fmt", PATTERN_FORMAT)
def test_pruned_weight_has_its_format_as_exact_candidate(pattern, fmt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64)).eval()
    sparsecc.prune(model, pattern)
    formats = None if fmt in ("2:4", "csr", "bsr32x32") else (fmt,)
    plan = sparsecc.plan(model, torch.randn(32, 256), formats=formats, cost_model=CostModel("cpu", measure=False))
    for site in plan:
        assert fmt in [c.format for c in site.candidates], (site.label, [c.format for c in site.candidates])


def test_the_cheapest_predicted_exact_format_is_chosen():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024)).eval()
    sparsecc.prune(model, "unstructured@0.01")
    plan = sparsecc.plan(model, torch.randn(256, 1024), cost_model=CostModel("cpu", measure=False))
    site = plan["0"]
    best = min(site.candidates, key=lambda c: c.predicted_us)
    assert site.choice == best.format == "csr"
