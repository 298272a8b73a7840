"""Site timing: the runner computes the site's product in every format, and times it."""
import pytest
import torch

from sparsecc.ir.formats import FormatSpec
from sparsecc.ir.weights import random_weight
from sparsecc.planner.cost import site_runner
from sparsecc.runtime import timing
from sparsecc.runtime.timing import time_us

from conftest import rel_error


@pytest.mark.parametrize("pattern,density,fmt", [("dense", 1.0, "dense"), ("2:4", 0.5, "2:4"),
                                                 ("block16", 0.5, "bsr16"), ("block16x32", 0.5, "bsr16x32"),
                                                 ("unstructured", 0.1, "csr")])
def test_runner_computes_the_product(pattern, density, fmt):
    gen = torch.Generator().manual_seed(11)
    weight = random_weight(128, 192, pattern, density, torch.float32, "cpu", gen)
    run = site_runner(weight, FormatSpec.parse(fmt), 5)
    out = run()
    assert out.shape == (5, 128) and run.copies == 1 and weight.count_nonzero() > 0
    want = run.x.double() @ weight.double().t()
    assert rel_error(out, want) < 1e-5                                     # fp32 against fp64


@pytest.mark.parametrize("fmt", ["dense", "2:4", "csr"])
def test_runner_runs_the_sites_epilogue(fmt):
    """Timed as it runs: with the site's bias and activation (here GELU), y = gelu(x W^T + b)."""
    from sparsecc.ir.epilogue import Activation, Epilogue
    gen = torch.Generator().manual_seed(12)
    weight = random_weight(96, 128, "2:4", 0.5, torch.float32, "cpu", gen)
    run = site_runner(weight, FormatSpec.parse(fmt), 7, epilogue=Epilogue(bias=True, activation=Activation.GELU))
    want = torch.nn.functional.gelu(run.x.double() @ weight.double().t() + run.bias.double())
    assert run.bias.shape == (96,) and rel_error(run(), want) < 1e-5


def test_time_us_is_positive_and_grows_with_work():
    small = site_runner(torch.randn(64, 64), FormatSpec.parse("dense"), 1)
    big = site_runner(torch.randn(1024, 1024), FormatSpec.parse("dense"), 256)
    assert 0 < time_us(small, "cpu") < time_us(big, "cpu")


def test_reference_product_is_timed():
    assert 0 < timing.reference_us() < 1e6
