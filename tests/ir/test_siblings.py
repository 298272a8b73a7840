"""siblings: which sites share one kernel (same input, same format and batch range, same dtype and
K, untransposed, distinct weights), and their stacked weight, bias and shared activation."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from sparsecc.ir import siblings
from sparsecc.ir.analysis import analyze
from sparsecc.ir.epilogue import Activation
from sparsecc.ir.formats import FormatSpec
from sparsecc.passes import find_linear, fuse_epilogue

from conftest import n_m

from passes.graphs import traced

TWO_FOUR, CSR, DENSE = FormatSpec.parse("2:4"), FormatSpec.parse("csr"), FormatSpec.parse("dense")


class Attention(nn.Module):
    """q, k, v (``width`` wide, k and v half as wide) and an MLP's gate and up (``hidden`` wide) read
    x; out reads what they make. 2:4 weights, random biases."""

    def __init__(self, gen, width: int = 32, hidden: int = 24):
        super().__init__()
        self.half_width = width // 2
        self.q, self.k = nn.Linear(width, width), nn.Linear(width, self.half_width, bias=False)
        self.v = nn.Linear(width, self.half_width)
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.out = nn.Linear(hidden, width)
        with torch.no_grad():
            for layer in (self.q, self.k, self.v, self.gate, self.up, self.out):
                layer.weight.copy_(n_m(*layer.weight.shape, 2, 4, gen))
                if layer.bias is not None:
                    layer.bias.normal_(generator=gen)

    def forward(self, x):
        attention = torch.relu(self.q(x))[..., :self.half_width] * self.k(x) + self.v(x)
        return self.out(F.silu(self.gate(x)) * self.up(x)) + attention.sum(-1, keepdim=True)


def sites_of(model, x):
    gm = traced(model, x)
    sites = find_linear.run(gm).sites
    fuse_epilogue.run(gm)
    return sites


def find(sites, choices):
    return siblings.find(sites, choices, {s.name: analyze(s.weight) for s in sites})


def choose(sites, **formats):
    """site name -> (format, batch range, above): 2:4 unless ``formats`` names the layer."""
    return {s.name: (formats.get(s.name.split(".")[0], TWO_FOUR), (1, 8), None) for s in sites}


def test_sites_reading_one_input_in_one_format_form_a_group(gen):
    model = Attention(gen)
    sites = sites_of(model, torch.randn(4, 32, generator=gen))
    [group] = find(sites, choose(sites))
    assert [m.name for m in group.members] == ["q.weight", "k.weight", "v.weight", "gate.weight", "up.weight"]
    assert group.sizes == [32, 16, 16, 24, 24] and group.choice == TWO_FOUR
    assert torch.equal(group.weight(), torch.cat([model.q.weight, model.k.weight, model.v.weight, model.gate.weight,
                                                model.up.weight]))
    # the members without a bias get zeros; the activations differ (relu, none, silu): none is shared
    assert torch.equal(group.bias(), torch.cat([model.q.bias, torch.zeros(16), model.v.bias, torch.zeros(48)]))
    assert group.activation is Activation.NONE
    stacked = analyze(group.weight())
    assert (group.stats.shape, group.stats.nnz, group.stats.nm_min_n) == ((112, 32), stacked.nnz, stacked.nm_min_n)
    assert group.stats.fits(TWO_FOUR)
    # 16x16 blocks tile the stack (112 rows) but not each member (24 rows): not a format for it
    assert (16, 16) in stacked.block_density and (16, 16) not in group.stats.block_density
    site = group.site()
    assert site.name == group.name == "+".join(m.name for m in group.members)
    assert site.x is sites[0].x and torch.equal(site.weight, group.weight()) and site.m == 4
    assert torch.equal(site.bias, group.bias()) and site.activation is Activation.NONE


def test_a_shared_activation_stays_in_the_kernel(gen):
    model = Attention(gen)
    sites = sites_of(model, torch.randn(4, 32, generator=gen))
    [group] = find(sites, choose(sites, q=CSR, v=CSR, gate=CSR, up=DENSE, k=DENSE))
    assert [m.name for m in group.members] == ["q.weight", "v.weight", "gate.weight"]
    assert {m.activation for m in group.members} == {Activation.RELU, Activation.NONE, Activation.SILU}
    relu_only = [s for s in sites if s.name in ("q.weight",)]
    twin = sites_of(model, torch.randn(4, 32, generator=gen))
    relu_only.append(next(s for s in twin if s.name == "q.weight"))
    assert find(relu_only, {"q.weight": (CSR, (1, 8), None)}) == []   # other inputs: no group


def test_what_keeps_sites_apart(gen):
    model = Attention(gen)
    sites = sites_of(model, torch.randn(4, 32, generator=gen))
    # other formats, another batch range, or what runs above the small-batch kernels
    assert find(sites, choose(sites, q=CSR, k=DENSE, v=FormatSpec.parse("bsr8"), gate=DENSE)) == []
    ranges = {s.name: (TWO_FOUR, (1, 8 + i), None) for i, s in enumerate(sites)}
    assert find(sites, ranges) == []
    above = {s.name: (TWO_FOUR, (1, 8), "dense" if i % 2 else None) for i, s in enumerate(sites)}
    assert [[m.name for m in g.members] for g in find(sites, above)] == [
        ["q.weight", "v.weight", "up.weight"], ["k.weight", "gate.weight"]]
    # a transposed store, a quantized site: each alone
    for flag in ("transpose_out", "quantized", "x_transposed"):
        for site in sites:
            setattr(site, flag, site.name != "q.weight")
        assert find(sites, choose(sites)) == []
        for site in sites:
            setattr(site, flag, False)


def test_a_weight_read_twice_is_stacked_once(gen):
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 8), nn.Linear(16, 8)
            with torch.no_grad():
                self.a.weight.copy_(n_m(8, 16, 2, 4, gen))
                self.b.weight.copy_(n_m(8, 16, 2, 4, gen))

        def forward(self, x):
            return self.a(x) + self.a(x) * self.b(x)

    sites = sites_of(Twice(), torch.randn(3, 16, generator=gen))
    assert [s.name for s in sites] == ["a.weight", "a.weight#2", "b.weight"]
    [group] = find(sites, choose(sites))
    assert [m.name for m in group.members] == ["a.weight", "b.weight"]


def test_a_stacked_weight_that_does_not_fit_is_no_group(gen):
    """The stacked weight is measured again: a member that does not fit the format keeps the group
    from forming, whatever the choices say."""
    model = Attention(gen)
    with torch.no_grad():
        model.k.weight.copy_(n_m(16, 32, 3, 4, gen))     # 3:4, not 2:4
    sites = sites_of(model, torch.randn(4, 32, generator=gen))
    assert find(sites, choose(sites)) == []
    [group] = find(sites, choose(sites, k=DENSE))
    assert "k.weight" not in [m.name for m in group.members]


def test_stacked_statistics_are_the_stacked_weights(gen):
    """Counts, n:m groups and block densities of weights stacked along N, from each weight's own,
    equal what measuring the stacked weight gives; a block that tiles only some of them is left out."""
    from conftest import block_sparse, unstructured
    weights = [block_sparse(64, 128, (16, 16), 0.3, gen), unstructured(32, 128, 0.4, gen), n_m(48, 128, 2, 4, gen)]
    stats = [analyze(w, extra_blocks=((16, 16), (32, 32))) for w in weights]
    combined = siblings.stacked(stats)
    assert combined.shape == (144, 128) and (32, 32) not in combined.block_density     # 48 rows: no 32x32 tiling
    measured = analyze(torch.cat(weights), extra_blocks=((16, 16),))
    assert combined.nnz == measured.nnz and combined.nm_min_n == measured.nm_min_n
    assert combined.beyond_24 == measured.beyond_24
    assert combined.block_density.keys() == measured.block_density.keys()
    for block, density in measured.block_density.items():
        assert abs(combined.block_density[block] - density) < 1e-6       # analyze averages in float32


def test_one_activation_for_all_runs_in_the_shared_call(gen):
    class TwoRelu(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 8), nn.Linear(16, 24)
            with torch.no_grad():
                self.a.weight.copy_(n_m(8, 16, 2, 4, gen))
                self.b.weight.copy_(n_m(24, 16, 2, 4, gen))

        def forward(self, x):
            return torch.relu(self.a(x)).sum(-1) + F.relu(self.b(x)).sum(-1)

    sites = sites_of(TwoRelu(), torch.randn(3, 16, generator=gen))
    [group] = find(sites, choose(sites))
    assert group.activation is Activation.RELU and group.site().activation is Activation.RELU
