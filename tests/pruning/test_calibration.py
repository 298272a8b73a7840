"""Input norms for Wanda: measured by hooks in one pass, equal to an fp64 reference computed
from the inputs directly, for Linear and Conv1D layers and every batch form."""
import pytest
import torch
from torch import nn

from sparsecc.errors import InputError
from sparsecc.pruning import prune
from sparsecc.pruning.calibration import input_norms

from pruning.test_prune import Conv1D


class TwoInputs(nn.Module):
    """A model called with two arguments (by position or by keyword)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(3, 5)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, y):
        return self.a(self.drop(x)).sum(1) + self.b(y)


def reference_norms(chunks):
    """||X_j||_2 over all rows of all chunks, in fp64."""
    x = torch.cat([c.reshape(-1, c.shape[-1]).double() for c in chunks])
    return x.pow(2).sum(0).sqrt()


@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_norms_match_an_fp64_reference_for_tuple_and_dict_batches(form):
    torch.manual_seed(0)
    model = TwoInputs().train()
    xs = [torch.randn(4, 7, 6) * torch.rand(6) * 5 for _ in range(3)]
    ys = [torch.randn(4, 3) for _ in range(3)]
    batches = ([(x, y) for x, y in zip(xs, ys)] if form == "tuple"
               else [{"x": x, "y": y} for x, y in zip(xs, ys)])
    norms = input_norms(model, [("a", model.a), ("b", model.b)], batches)
    # dropout would scale the inputs: calibration runs in eval mode, then restores train mode
    assert model.training and model.drop.training
    assert norms["a"].dtype == torch.float32
    torch.testing.assert_close(norms["a"].double(), reference_norms(xs), rtol=1e-6, atol=0)
    torch.testing.assert_close(norms["b"].double(), reference_norms(ys), rtol=1e-6, atol=0)


def test_conv1d_norms_run_over_its_input_features():
    torch.manual_seed(1)
    model = nn.Sequential(Conv1D(4, 12)).double()
    xs = [torch.randn(3, 12, dtype=torch.float64) for _ in range(2)]
    norms = input_norms(model, [("0", model[0])], xs)
    assert norms["0"].shape == (12,) and norms["0"].dtype == torch.float64
    torch.testing.assert_close(norms["0"], reference_norms(xs), rtol=1e-12, atol=0)


def test_hooks_are_removed_even_when_a_batch_fails():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(RuntimeError):
        input_norms(model, [("0", model[0])], [torch.randn(2, 4), torch.randn(2, 5)])
    assert not model[0]._forward_pre_hooks


@pytest.mark.parametrize("calibration, says", [
    (None, "needs calibration data"), ([], "empty"), (torch.randn(2, 8), "wrap a single batch"),
    (3, "iterable"), (["text"], "tensor, a tuple/list or a dict")])
def test_bad_calibration_raises_input_error(calibration, says):
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(InputError, match=says):
        prune(model, "unstructured@0.5", criterion="wanda", calibration=calibration)


def test_calibration_without_wanda_is_refused():
    with pytest.raises(InputError, match="only used by criterion='wanda'"):
        prune(nn.Sequential(nn.Linear(8, 8)), "2:4", calibration=[torch.randn(2, 8)])


def test_a_layer_the_batches_never_reach_is_named():
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.used(x)

    with pytest.raises(InputError, match="'unused' never ran"):
        prune(Skips(), "2:4", criterion="wanda", calibration=[torch.randn(2, 8)])
