"""conv_as_linear: a convolution whose kernel tiles its input becomes a linear over patches
(then a site of find_linear), computing what the convolution computed; every other
convolution is left alone."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import sparsecc
from sparsecc.pruning.masks import nm_mask
from sparsecc.passes import conv_as_linear, find_linear

from conftest import assert_rel_close

from .graphs import ops, traced

CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def conv_ops(gm):
    return [t for op, t in ops(gm) if "conv" in t]


@pytest.mark.parametrize("d, kernel, sizes", [
    (2, (4, 4), (16, 12)),
    (2, (2, 3), (9, 14)),          # trailing inputs that fill no patch are dropped, as conv drops them
    (1, (5,), (23,)),
    (3, (2, 2, 2), (4, 6, 5)),
])
@pytest.mark.parametrize("bias", [True, False])
def test_patch_convolution_becomes_a_linear_with_the_same_result(d, kernel, sizes, bias):
    torch.manual_seed(0)
    conv = CONVS[d](3, 8, kernel, stride=kernel, bias=bias)
    x = torch.randn(2, 3, *sizes)
    reference = conv(x.double().float())
    gm = traced(conv, x)
    assert conv_as_linear.run(gm).changed
    assert conv_ops(gm) == [] and ("call_function", "linear") in ops(gm)
    out = gm(x)
    assert out.shape == reference.shape and out.is_contiguous()    # the graph's output: dense layout
    assert_rel_close(out, reference, torch.float32)
    exact = F.conv2d if d == 2 else F.conv1d if d == 1 else F.conv3d
    expected = exact(x.double(), conv.weight.double(), None if conv.bias is None else conv.bias.double(), kernel)
    assert (out.double() - expected).abs().max() < 1e-5


def test_unbatched_input_and_other_batch_sizes_after_the_rewrite():
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 2, stride=2)
    gm = traced(conv, torch.randn(1, 4, 8, 8))
    conv_as_linear.run(gm)
    for x in (torch.randn(4, 8, 6), torch.randn(5, 4, 10, 4)):
        assert_rel_close(gm(x), conv(x), torch.float32)


@pytest.mark.parametrize("kwargs", [
    dict(kernel_size=4, stride=2),                   # overlapping patches
    dict(kernel_size=4, stride=4, padding=1),
    dict(kernel_size=2, stride=2, dilation=2),
    dict(kernel_size=4, stride=4, groups=2),
    dict(kernel_size=1, stride=1),                   # 1x1: its output layout would change
])
def test_other_convolutions_are_left_alone(kwargs):
    conv = nn.Conv2d(4, 8, **kwargs)
    gm = traced(conv, torch.randn(1, 4, 16, 16))
    before = ops(gm)
    assert not conv_as_linear.run(gm).changed and ops(gm) == before


class PatchEmbedding(nn.Module):
    """ViT's patch embedding: a patch convolution, flattened to a sequence of tokens."""

    def __init__(self):
        super().__init__()
        self.projection = nn.Conv2d(3, 16, 4, stride=4)

    def forward(self, x):
        return self.projection(x).flatten(2).transpose(1, 2)


def test_layout_free_users_take_the_view_and_find_linear_sees_a_site():
    torch.manual_seed(0)
    model = PatchEmbedding()
    x = torch.randn(2, 3, 16, 16)
    gm = fx.symbolic_trace(model)              # the module is a leaf: a call_module node
    assert ("call_module", "projection") in ops(gm)
    conv_as_linear.run(gm)
    assert ("call_method", "contiguous") not in ops(gm)       # flatten takes any layout
    assert_rel_close(gm(x), model(x), torch.float32)
    sites = find_linear.run(gm).sites
    assert [s.weight_name for s in sites] == ["projection.weight"]
    assert torch.equal(sites[0].weight, model.projection.weight.flatten(1))
    assert sites[0].bias is not None and sites[0].bias_name == "projection.bias"


def test_weights_given_as_graph_inputs_are_recognised():
    """Dynamo's form: torch.conv2d on placeholders the caller declares constant."""
    weight, bias = nn.Parameter(torch.randn(8, 3, 2, 2)), nn.Parameter(torch.randn(8))

    def f(x, w, b):
        return torch.conv2d(x, w, b, (2, 2), (0, 0), (1, 1), 1).flatten(2)

    gm = fx.symbolic_trace(f)
    x = torch.randn(2, 3, 6, 6)
    expected = f(x, weight, bias)
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    assert not conv_as_linear.run(gm).changed                 # weight shape unknown: left alone
    placeholders = {names[1]: ("w", weight), names[2]: ("b", bias)}
    assert conv_as_linear.run(gm, placeholders=placeholders).changed
    assert_rel_close(gm(x, weight, bias), expected, torch.float32)
    assert [s.weight_name for s in find_linear.run(gm, placeholders=placeholders).sites] == ["w"]


def test_a_pruned_patch_embedding_runs_sparse_through_compile_and_the_backend():
    """sparsecc.compile traces the convolution (a module with no 2-D weight) and plans it as a
    site; so does the backend; both match eager."""
    torch.manual_seed(0)
    model = nn.Sequential(PatchEmbedding(), nn.LayerNorm(16), nn.Linear(16, 8)).eval()
    sparsecc.prune(model, "2:4")                 # the linear; the convolution's weight is 4-D
    with torch.no_grad():
        w = model[0].projection.weight
        w.mul_(nm_mask(w.flatten(1), 2, 4).reshape(w.shape))
    x = torch.randn(3, 3, 16, 16)
    compiled = sparsecc.compile(model, x, formats=("2:4",))
    plan = compiled.sparsecc_plan
    assert plan.choices() == {"0.projection.weight": "2:4", "2.weight": "2:4"}
    assert plan["0.projection.weight"].m == 3 * 16                # the patches, seen by shape propagation
    with torch.no_grad():
        assert_rel_close(compiled(x), model(x), torch.float32)
        torch._dynamo.reset()
        from sparsecc.backend import COMPILED, make_backend
        through_backend = torch.compile(model, backend=make_backend(formats=("2:4",), inductor=False))
        assert_rel_close(through_backend(x), model(x), torch.float32)
    assert "2:4" in COMPILED[-1].plan.choices().values() and len(COMPILED[-1].plan.choices()) == 2
    torch._dynamo.reset()
