"""find_linear: every spelling of a linear with a constant weight becomes a site whose
effective weight is [N, K]; nothing else does; the graph is unchanged."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from sparsecc.passes import find_linear
from sparsecc.ir.site import sites_of

from .graphs import ops, traced


class Forms(nn.Module):
    """One of each recognised form, each with its own weight."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.w_functional = nn.Parameter(torch.randn(5, 6))
        self.b_functional = nn.Parameter(torch.randn(5))
        self.w_t = nn.Parameter(torch.randn(4, 5))        # used as x @ W.t()
        self.p = nn.Parameter(torch.randn(4, 3))          # stored [K, N], used as x @ P
        self.conv1d_w = nn.Parameter(torch.randn(3, 7))   # addmm(b, x, P) like GPT-2's Conv1D
        self.conv1d_b = nn.Parameter(torch.randn(7))
        self.left = nn.Parameter(torch.randn(2, 7))       # W @ x
        self.register_buffer("buf", torch.randn(2, 2))    # a buffer weight, used as x.mm(B.T)

    def forward(self, x):
        h = self.lin(x)
        h = F.linear(h, self.w_functional, self.b_functional)
        h = h @ self.w_t.t()
        h = torch.matmul(h, self.p)
        h = torch.addmm(self.conv1d_b, h, self.conv1d_w)
        h = (self.left @ h.t()).t()
        return h.mm(self.buf.T)


def test_every_form_is_a_site_with_its_effective_weight():
    model = Forms()
    gm = traced(model, torch.randn(3, 8))
    before = ops(gm)
    result = find_linear.run(gm)
    assert not result.changed and ops(gm) == before
    # fx reads a buffer's transpose as a new constant (``_tensor_constant0`` = buf.T)
    sites = {("buf" if s.weight_name.startswith("_tensor_constant") else s.weight_name): s for s in result.sites}
    assert list(sites) == ["lin.weight", "w_functional", "w_t", "p", "conv1d_w", "left", "buf"]
    expected_weights = {"lin.weight": model.lin.weight, "w_functional": model.w_functional, "w_t": model.w_t,
                        "p": model.p.t(), "conv1d_w": model.conv1d_w.t(), "left": model.left, "buf": model.buf}
    for name, weight in expected_weights.items():
        assert torch.equal(sites[name].weight, weight), name
    assert sites["lin.weight"].bias is model.lin.bias
    assert sites["w_functional"].bias is model.b_functional and sites["conv1d_w"].bias is model.conv1d_b
    assert [sites[n].weight_transposed for n in sites] == [False, False, False, True, True, False, True]
    assert sites["left"].x_transposed and sites["left"].transpose_out
    assert not any(sites[n].x_transposed for n in sites if n != "left")
    assert sites["lin.weight"].input_shape == (3, 8) and sites["lin.weight"].m == 3
    assert sites["left"].m == 3            # input is [K, M] = [7, 3]
    assert sites_of(gm) == result.sites


def test_names_carry_the_prefix_and_repeat_counts():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return F.linear(F.linear(x, self.w), self.w)

    result = find_linear.run(traced(Tied(), torch.randn(2, 4)), prefix="block.0")
    assert [s.name for s in result.sites] == ["block.0.w", "block.0.w#2"]


class NotLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.w3 = nn.Parameter(torch.randn(2, 4, 4))
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x, y):
        a = torch.matmul(x, self.w3)          # a 3-D constant: a batched product, not a linear
        b = x @ y                              # no constant
        c = torch.addmm(self.w[0], x[0], self.w, beta=0.5)   # scaled bias: left alone
        return a.sum() + b.sum() + c.sum()


def test_products_that_are_not_linear_sites_are_ignored():
    gm = traced(NotLinear(), torch.randn(2, 4, 4), torch.randn(2, 4, 4))
    assert find_linear.run(gm).sites == []


def test_placeholders_declared_constant_are_weights():
    def f(x, w):
        return F.linear(x, w)

    gm = torch.fx.symbolic_trace(f)
    w = torch.randn(3, 5)
    result = find_linear.run(gm, placeholders={"w": ("layer.weight", w)})
    assert len(result.sites) == 1 and result.sites[0].weight is w
    assert result.sites[0].weight_node.op == "placeholder"
