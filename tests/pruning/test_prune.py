import json
import math
import warnings

import pytest
import torch
from torch import nn

from sparsecc.ir.analysis import analyze
from sparsecc.errors import InputError, PatternError
from sparsecc.ir.formats import FormatSpec, group_along_k
from sparsecc.pruning import (NMPattern, UnstructuredPattern, parse_pattern, pattern_mask, prune)
from sparsecc.pruning import apply as prune_apply
from sparsecc.pruning.masks import kept_count

from conftest import nonzero_randn


class Conv1D(nn.Module):
    """Hugging Face GPT-2's Conv1D, as transformers defines it: y = x @ W + b, W is [in, out]."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf).normal_(std=0.02))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def mlp(seed=0, width=32):
    torch.manual_seed(seed)
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(16, width))
    model.add_module("blocks", nn.Sequential(Block(width), Block(width)))
    model.add_module("head", nn.Linear(width, 8))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):    # never zeros, so every kept weight is non-zero
                module.weight.copy_(nonzero_randn(*module.weight.shape) / module.weight.shape[1] ** 0.5)
    return model


def linear_names(model):
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def weights(model):
    return {name: module.weight.detach().clone() for name, module in model.named_modules()
            if hasattr(module, "weight")}


@pytest.mark.parametrize("pattern", ["2:4", "1:4", "4:8", "3:32", "3:8", "2:4/vw4", "1:2/vw3",
                                     "2:4/bw8", "block8x8@0.25", "block4x8@0.5",
                                     "unstructured@0.1", "unstructured@0.37"])
def test_prune_applies_the_pattern_in_place(pattern):
    model = mlp()
    before = weights(model)
    report = prune(model, pattern)
    parsed = parse_pattern(pattern)
    modules = dict(model.named_modules())
    assert [layer.name for layer in report] == linear_names(model)
    for layer in report:
        w = modules[layer.name].weight
        original = before[layer.name]
        assert torch.equal(w, original * pattern_mask(parsed, original))    # same mask, in place
        stats = analyze(w, extra_group_sizes=tuple(f.m for f in parsed.formats() if f.m),
                        extra_blocks=tuple(f.block for f in parsed.formats() if f.block))
        for spec in parsed.formats():
            if spec.kind == "nm" and spec.m > w.shape[1]:    # analyze measures m <= K only
                assert group_along_k(w != 0, spec.m).sum(-1).max() <= spec.n
            else:
                assert stats.fits(spec), spec
        assert layer.density == pytest.approx(stats.density)
        assert layer.density_before == 1.0
        assert layer.shape == tuple(w.shape) and layer.pattern == str(parsed)
        assert layer.magnitude_kept == pytest.approx(float(w.detach().abs().sum() / original.abs().sum()),
                                                     rel=1e-5)
        assert w.requires_grad and w.grad_fn is None


def test_nm_layers_end_exactly_at_the_pattern_density():
    report = prune(mlp(), "3:8")
    assert all(layer.density == 3 / 8 for layer in report)          # every width divides by 8
    assert report.density == 3 / 8


def test_block_pruned_weight_has_the_asked_block_density():
    model = mlp()
    prune(model, "block8x8@0.25")
    for name in linear_names(model):
        w = dict(model.named_modules())[name].weight
        stats = analyze(w, extra_blocks=((8, 8),))
        blocks = w.shape[0] * w.shape[1] // 64
        assert stats.block_density[(8, 8)] == pytest.approx(kept_count(0.25, blocks) / blocks)
        assert stats.block_density[(8, 8)] <= 0.25 + 0.5 / blocks


def test_pattern_objects_and_strings_prune_the_same():
    a, b = mlp(), mlp()
    prune(a, "2:4")
    prune(b, NMPattern(2, 4))
    assert all(torch.equal(x, y) for x, y in zip(weights(a).values(), weights(b).values()))


def test_global_unstructured_uses_one_threshold_over_the_selected_layers():
    model = mlp()
    before = weights(model)
    report = prune(model, "unstructured@0.2", scope="global", exclude="head")
    selected = [layer.name for layer in report]
    assert "head" not in selected and len(selected) == 5
    assert torch.equal(model.head.weight, before["head"])
    after = weights(model)
    kept = torch.cat([after[name][after[name] != 0].abs() for name in selected])
    dropped = torch.cat([before[name][after[name] == 0].abs() for name in selected])
    total = sum(before[name].numel() for name in selected)
    assert kept.numel() == kept_count(0.2, total)
    assert kept.min() >= dropped.max()
    assert report.density == pytest.approx(kept.numel() / total)
    # layers differ in scale, so global densities differ from layer to layer
    assert len({round(layer.density, 3) for layer in report}) > 1


def test_per_layer_unstructured_gives_each_layer_its_density():
    report = prune(mlp(), "unstructured@0.2")
    for layer in report:
        assert layer.density == kept_count(0.2, layer.numel) / layer.numel


def test_include_exclude_globs_and_keep_first_last():
    model = mlp()
    assert [l.name for l in prune(mlp(), "2:4", include="blocks.*")] == \
        ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]
    assert [l.name for l in prune(mlp(), "2:4", include=["embed", "head"])] == ["embed", "head"]
    assert [l.name for l in prune(mlp(), "2:4", exclude="*fc2")] == \
        ["embed", "blocks.0.fc1", "blocks.1.fc1", "head"]
    assert [l.name for l in prune(mlp(), "2:4", include="blocks.*", exclude="blocks.1.*")] == \
        ["blocks.0.fc1", "blocks.0.fc2"]
    before = weights(model)
    report = prune(model, "2:4", keep_first=1, keep_last=2)
    assert [l.name for l in report] == ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1"]
    for name in ("embed", "blocks.1.fc2", "head"):
        assert torch.equal(dict(model.named_modules())[name].weight, before[name])


def test_types_selects_module_classes():
    class Other(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(8, 8), Other(8, 8))
    assert [l.name for l in prune(model, "2:4", types=(Other,))] == ["1"]


@pytest.mark.parametrize("kwargs, says", [
    (dict(include="decoder.*"), "decoder"), (dict(include=["x", "y"], exclude="z"), "'x', 'y'"),
    (dict(exclude="*"), "exclude"), (dict(keep_first=4, keep_last=2), "keep_first=4"),
    (dict(types=(nn.Conv2d,)), "Conv2d"), (dict(keep_first=-1), "keep_first"),
    (dict(include=3), "globs"), (dict(scope="global"), "scope='layer'"),
    (dict(scope="everything"), "'layer', 'global' or 'erk'"), (dict(criterion="taylor"), "criterion"),
])
def test_bad_selection_and_options_raise_input_error(kwargs, says):
    with pytest.raises(InputError, match=says):
        prune(mlp(), "2:4", **kwargs)


def test_not_a_module_is_refused():
    with pytest.raises(InputError, match="nn.Module"):
        prune(torch.ones(4, 4), "2:4")


def test_bad_pattern_raises_pattern_error():
    with pytest.raises(PatternError, match="n < m"):
        prune(mlp(), "4:4")


def test_a_selected_layer_without_a_2d_weight_raises():
    model = nn.Sequential(nn.Conv2d(4, 4, 3), nn.Linear(4, 4))
    with pytest.raises(InputError, match="'0'.*2-D"):
        prune(model, "2:4", types=(nn.Conv2d, nn.Linear))


def test_layers_the_pattern_cannot_take_are_skipped_and_reported():
    model = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 10))     # 10 rows: no 32x32 blocks
    before = model[1].weight.detach().clone()
    with pytest.warns(UserWarning, match="left 1 layer.*: 1"):
        report = prune(model, "2:4/bw32")
    assert [l.name for l in report.pruned] == ["0"]
    assert [l.name for l in report.skipped] == ["1"]
    assert "multiple of 32" in report["1"].skipped and "skipped" in report.table()
    assert torch.equal(model[1].weight, before)
    assert report["1"].density == 1.0
    assert report.density == report["0"].density == 0.5


def test_a_pattern_no_selected_layer_can_take_raises():
    with pytest.raises(PatternError, match="fits none"):
        prune(nn.Sequential(nn.Linear(20, 10)), "block8x8@0.5")


def test_custom_criterion_decides_what_is_kept():
    model = mlp()
    before = weights(model)
    seen = []

    def smallest_first(name, weight):
        seen.append(name)
        return -weight.abs()

    prune(model, "2:4", criterion=smallest_first)
    assert seen == linear_names(model)
    for name in seen:
        w, original = dict(model.named_modules())[name].weight, before[name]
        assert torch.equal(w, original * pattern_mask("2:4", -original.abs(), magnitude=False))
        groups = original.reshape(original.shape[0], -1, 4).abs()
        kept = (w != 0).reshape(groups.shape)
        assert (groups[kept].reshape(*groups.shape[:2], 2).max(-1).values
                <= groups[~kept].reshape(*groups.shape[:2], 2).min(-1).values).all()


def test_criterion_must_return_the_weights_shape():
    with pytest.raises(InputError, match="criterion returned.*'embed'"):
        prune(mlp(), "2:4", criterion=lambda name, w: w.t())


def test_conv1d_groups_run_along_its_input_dim_zero():
    torch.manual_seed(0)
    conv = Conv1D(nf=12, nx=32)                       # weight [in=32, out=12]
    linear = nn.Linear(32, 12)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    original = conv.weight.detach().clone()
    report = prune(nn.Sequential(conv), "2:4", keep_masks=True)
    prune(nn.Sequential(linear), "2:4")
    assert report["0"].shape == (12, 32)                             # reported as [out, in]
    assert torch.equal(conv.weight, linear.weight.t())               # same choice as nn.Linear
    assert analyze(conv.weight.t()).fits(FormatSpec.parse("2:4"))    # groups along dim 0
    assert not analyze(conv.weight).fits(FormatSpec.parse("2:4"))   # not along the stored rows
    assert conv.weight_mask.shape == conv.weight.shape               # stored orientation
    assert torch.equal(conv.weight, original * conv.weight_mask)
    x = torch.randn(5, 32)
    torch.testing.assert_close(conv(x), linear(x))


def test_conv1d_criterion_sees_and_returns_the_stored_layout():
    conv = Conv1D(nf=8, nx=16)
    shapes = []

    def criterion(name, weight):
        shapes.append(tuple(weight.shape))
        return weight.abs()

    prune(nn.Sequential(conv), "2:4", criterion=criterion)
    assert shapes == [(16, 8)]
    assert analyze(conv.weight.t()).fits(FormatSpec.parse("2:4"))


def test_conv1d_is_found_by_class_name_with_default_types():
    model = nn.Sequential(Conv1D(8, 16), nn.Linear(8, 8))
    assert [l.name for l in prune(model, "unstructured@0.5")] == ["0", "1"]


def test_report_table_and_dict():
    model = mlp()
    report = prune(model, UnstructuredPattern(0.25), exclude="embed")
    table = report.table()
    for layer in report:
        assert layer.name in table
    assert "unstructured@0.25" in table and "total (5 pruned)" in table
    data = json.loads(json.dumps(report.to_dict()))
    assert data["pattern"] == "unstructured@0.25" and data["scope"] == "layer"
    assert [l["name"] for l in data["layers"]] == [l.name for l in report]
    assert data["layers"][0]["shape"] == list(report.layers[0].shape)
    nnz = sum(int(torch.count_nonzero(dict(model.named_modules())[l.name].weight)) for l in report)
    assert report.density == pytest.approx(nnz / sum(l.numel for l in report))
    assert data["density"] == pytest.approx(report.density)
    with pytest.raises(KeyError):
        report["embed"]


def bits(tensor):
    """A tensor's bit patterns, so that +0.0 and -0.0 (and NaNs) compare as what they are."""
    return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def awkward_weight(rows, cols, dtype, seed):
    """Normal samples with exact zeros, -0.0 and a wide range of magnitudes in them."""
    generator = torch.Generator().manual_seed(seed)
    w = nonzero_randn(rows, cols, generator=generator) * torch.rand(rows, cols, generator=generator) ** 4
    w[torch.rand(rows, cols, generator=generator) < 0.1] = 0.0
    w[torch.rand(rows, cols, generator=generator) < 0.1] = -0.0
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pattern", ["2:4", "3:32", "2:4/vw4", "1:2/bw8", "block8x8@0.5",
                                     "unstructured@0.3"])
def test_report_equals_an_fp64_recount_and_pruning_equals_masked_fill(pattern, dtype, monkeypatch):
    """prune zeroes and measures each weight in one pass of its own (chunks of rows, integer
    products of the weight's bits, sums in float32 within a chunk); what it reports must be
    what a plain fp64 recount of the weights before and after says (counts exactly, |w| kept
    to float32 rounding, or float64's for a float64 weight), and what it writes what
    masked_fill_ writes, bit for bit (+0.0 where a weight is dropped). Small chunks make a
    layer span many, the last one partial; a Conv1D weight is walked in its stored
    orientation; a skipped layer is measured as it is."""
    monkeypatch.setattr(prune_apply, "APPLY_CHUNK_ELEMENTS", 200)
    model = nn.Sequential(nn.Linear(64, 40), Conv1D(nf=48, nx=64), nn.Linear(48, 36)).to(dtype)
    with torch.no_grad():
        for index, module in enumerate(model):
            module.weight.copy_(awkward_weight(*module.weight.shape, dtype, seed=index))
    before = weights(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # 36 rows are no multiple of 8: layer 2 skips 8x8
        report = prune(model, pattern)
    for index, module in enumerate(model):
        w, original, layer = module.weight.detach(), before[str(index)], report[str(index)]
        if layer.skipped:
            assert torch.equal(bits(w), bits(original))
        else:
            matrix = original.t() if index == 1 else original          # Conv1D: stored [in, out]
            pruned = matrix.masked_fill(~pattern_mask(pattern, matrix), 0)
            assert torch.equal(bits(w), bits(pruned.t() if index == 1 else pruned))
        numel = original.numel()
        assert layer.density_before == int(torch.count_nonzero(original)) / numel
        assert layer.density == int(torch.count_nonzero(w)) / numel
        l1_before = float(original.double().abs().sum())
        rel = 1e-12 if dtype == torch.float64 else 1e-6
        assert layer.magnitude_kept == pytest.approx(float(w.double().abs().sum()) / l1_before,
                                                     rel=rel, abs=0)


def test_a_dropped_nan_becomes_zero_and_a_kept_one_is_reported():
    """As masked_fill_ does: a NaN weight the criterion drops is zeroed, one it keeps stays and
    makes the layer's |w| kept NaN (there is no L1 norm to compare); both count as non-zeros."""
    layer = nn.Linear(8, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(1.0, 17.0).view(2, 8))
        layer.weight[0, 0] = float("nan")       # dropped: scored lowest
        layer.weight[1, 4] = float("nan")       # kept: scored highest
    scores = torch.arange(16.0).view(2, 8)
    scores[1, 4] = 100.0
    report = prune(nn.Sequential(layer), "2:4", criterion=lambda name, w: scores)
    assert bits(layer.weight.detach())[0, 0] == 0
    assert torch.isnan(layer.weight[1, 4])
    assert report["0"].density_before == 1.0 and report["0"].density == 0.5
    assert math.isnan(report["0"].magnitude_kept)


def test_a_weight_that_is_not_floating_point_is_refused_before_anything_changes():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight = nn.Parameter(torch.randint(-4, 4, (8, 8)), requires_grad=False)
    before = weights(model)
    with pytest.raises(InputError, match="'1' has a torch.int64 weight"):
        prune(model, "2:4")
    assert all(torch.equal(w, before[name]) for name, w in weights(model).items())


def test_pruning_twice_reports_the_density_before():
    model = mlp()
    prune(model, "2:4")
    report = prune(model, "1:4")
    assert all(layer.density_before == 0.5 and layer.density == 0.25 for layer in report)


def test_no_warning_when_nothing_is_skipped():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prune(mlp(), "2:4")


def test_prune_says_what_it_left_dense_and_what_it_pruned_through_a_tie():
    """Weights of modules prune does not take (MultiheadAttention's in_proj_weight) are listed
    with the reason; a weight tied to a pruned layer (an embedding shared with the output layer)
    is named in the report and in a warning, not left to be discovered."""
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    report = prune(layer, "2:4")
    assert set(report.not_pruned) == {"self_attn.in_proj_weight"}
    assert "MultiheadAttention.in_proj_weight" in report.not_pruned["self_attn.in_proj_weight"]
    assert "not pruned: self_attn.in_proj_weight" in report.table()
    assert prune(nn.TransformerEncoderLayer(64, 4, 128), "2:4", exclude="self_attn*").not_pruned == {}

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(100, 64), nn.Linear(64, 100, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    model = Tied()
    with pytest.warns(UserWarning, match="head -> emb.weight"):
        report = prune(model, "2:4")
    assert report.tied == {"head": ["emb.weight"]} and "emb.weight" not in report.not_pruned
    assert float((model.emb.weight == 0).float().mean()) == 0.5
