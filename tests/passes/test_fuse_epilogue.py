"""fuse_epilogue: Before/Expected graphs for each absorbable consumer, and numerics."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from sparsecc.ir.epilogue import Activation
from sparsecc.passes import find_linear, fuse_epilogue

from .graphs import ops, traced

DENSE_OP = "linear_dense"


def run_passes(module, *example):
    gm = traced(module, *example)
    find_linear.run(gm)
    return gm, fuse_epilogue.run(gm)


class LinearBiasGeluT(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8, bias=False)
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return F.gelu(self.lin(x) + self.bias, approximate="tanh").transpose(-1, -2)


def test_bias_activation_and_transpose_are_absorbed():
    model, x = LinearBiasGeluT(), torch.randn(2, 5, 16)
    gm, result = run_passes(model, x)
    expected = [("get_attr", "bias"), ("get_attr", "lin.weight"), ("call_function", DENSE_OP)]
    assert [(o, t.replace(".default", "")) for o, t in ops(gm)] == expected
    site = result.sites[0]
    assert site.fused == ["bias", "gelu_tanh", "transpose"]
    assert site.activation is Activation.GELU_TANH and site.transpose_out
    assert site.bias_name == "bias" and torch.equal(site.bias, model.bias)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-6)


class Chain(nn.Module):
    """relu as a module, silu in place, a second use that blocks fusion, a non-constant add."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.act = nn.ReLU()

    def forward(self, x):
        h = self.act(self.a(x))
        g = F.silu(self.b(h), inplace=True)
        k = self.c(g)
        return torch.relu(k) + k + x          # k has two users: nothing after c is absorbed


def test_single_user_chains_only():
    model, x = Chain(), torch.randn(4, 6)
    gm, result = run_passes(model, x)
    assert [s.fused for s in result.sites] == [["relu"], ["silu"], []]
    assert [o for o, _ in ops(gm)].count("call_function") == 3 + 3   # 3 sites + relu + 2 adds
    torch.testing.assert_close(gm(x), model(x))


class LeftForm(nn.Module):
    """W @ x with a column bias, then transposed back: y = (W x + b[:, None])^T."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 7))
        self.b = nn.Parameter(torch.randn(5, 1))

    def forward(self, x):
        return torch.relu((self.w @ x.transpose(-1, -2)) + self.b).transpose(-1, -2)


def test_left_form_bias_and_transpose():
    model, x = LeftForm(), torch.randn(3, 4, 7)
    gm, result = run_passes(model, x)
    site = result.sites[0]
    assert site.fused == ["bias", "relu", "transpose"] and site.x_transposed and not site.transpose_out
    torch.testing.assert_close(gm(x), model(x))


def test_a_bias_of_another_dtype_or_shape_is_not_absorbed():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3, bias=False)
            self.b64 = nn.Parameter(torch.randn(3, dtype=torch.float64))
            self.b2 = nn.Parameter(torch.randn(2, 3))

        def forward(self, x):
            return self.lin(x) + self.b64, self.lin(x) + self.b2

    model, x = M(), torch.randn(2, 4)
    gm, result = run_passes(model, x)
    assert [s.fused for s in result.sites] == [[], []]
    for got, want in zip(gm(x), model(x)):
        torch.testing.assert_close(got, want)


def test_transpose_of_higher_rank_output_needs_last_two_dims():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x).transpose(0, 1), self.lin(x).permute(0, 2, 1)

    model, x = M(), torch.randn(2, 5, 4)
    gm, result = run_passes(model, x)
    assert [s.fused for s in result.sites] == [[], ["transpose"]]
    for got, want in zip(gm(x), model(x)):
        torch.testing.assert_close(got, want)
