"""Wanda: which weights it keeps (against fp64 references built from the inputs directly),
and that it keeps a layer's output closer than magnitude does on a small language model."""
import copy
import warnings

import pytest
import torch
from torch import nn

from sparsecc.pruning import prune
from sparsecc.pruning.masks import kept_count
from sparsecc.pruning.wanda import row_masks

from conftest import nonzero_randn, with_nonzero_weights
from models import mlp
from pruning.test_prune import Conv1D


def model_and_batches(seed=0):
    """A 3-layer MLP whose input features differ in scale by ~100x, and calibration batches."""
    torch.manual_seed(seed)
    model = with_nonzero_weights(mlp((32, 48, 32, 16)))
    scale = torch.logspace(-1, 1, 32)[torch.randperm(32)]
    batches = [torch.randn(8, 32) * scale for _ in range(4)]
    return model, batches


def reference_scores(model, batches):
    """|W_ij| * ||X_j||_2 per Linear, in fp64, from inputs recorded by running the model."""
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda m, a: inputs.setdefault(m, []).append(a[0].double()))
             for m in model if isinstance(m, nn.Linear)]
    with torch.no_grad():
        for batch in batches:
            model(batch)
    for hook in hooks:
        hook.remove()
    return {str(i): m.weight.detach().double().abs() * torch.cat(inputs[m]).pow(2).sum(0).sqrt()
            for i, m in enumerate(model) if isinstance(m, nn.Linear)}


def masks_of(model):
    return {str(i): m.weight != 0 for i, m in enumerate(model) if isinstance(m, nn.Linear)}


def test_unstructured_wanda_keeps_the_top_scores_of_every_row():
    model, batches = model_and_batches()
    scores = reference_scores(model, batches)
    report = prune(model, "unstructured@0.3", criterion="wanda", calibration=batches)
    for name, mask in masks_of(model).items():
        kept = kept_count(0.3, mask.shape[1])
        assert (mask.sum(1) == kept).all(), name                  # the same count in every row
        top = scores[name].argsort(dim=1, descending=True)[:, :kept]
        expected = torch.zeros_like(mask).scatter_(1, top, True)
        assert torch.equal(mask, expected), name
    assert report.criterion == "wanda" and "wanda" in report.table()
    assert report.to_dict()["criterion"] == "wanda"


def test_wanda_and_magnitude_choose_differently_when_inputs_differ_in_scale():
    model, batches = model_and_batches()
    magnitude = copy.deepcopy(model)
    prune(model, "unstructured@0.3", criterion="wanda", calibration=batches)
    report = prune(magnitude, "unstructured@0.3")
    assert report.criterion == "magnitude"
    assert not torch.equal(masks_of(model)["0"], masks_of(magnitude)["0"])


def test_nm_wanda_keeps_the_top_scores_of_every_group():
    model, batches = model_and_batches(1)
    scores = reference_scores(model, batches)
    prune(model, "2:4", criterion="wanda", calibration=iter(batches))   # one pass: an iterator will do
    for name, mask in masks_of(model).items():
        groups = scores[name].reshape(mask.shape[0], -1, 4)
        expected = torch.zeros(groups.shape, dtype=torch.bool).scatter_(
            2, groups.argsort(dim=2, descending=True)[..., :2], True)
        assert torch.equal(mask, expected.reshape(mask.shape)), name


def test_global_wanda_uses_one_threshold_over_all_contributions():
    model, batches = model_and_batches(2)
    scores = reference_scores(model, batches)
    report = prune(model, "unstructured@0.2", criterion="wanda", calibration=batches, scope="global")
    masks = masks_of(model)
    kept = torch.cat([scores[n][masks[n]] for n in masks])
    dropped = torch.cat([scores[n][~masks[n]] for n in masks])
    assert kept.min() > dropped.max()
    assert report.density == pytest.approx(0.2, abs=1e-3)


def test_erk_wanda_keeps_each_layers_density_row_by_row():
    model, batches = model_and_batches(3)
    report = prune(model, "unstructured@0.2", criterion="wanda", calibration=batches, scope="erk")
    assert report.density == pytest.approx(0.2, abs=0.01)
    for name, mask in masks_of(model).items():
        assert len(set(mask.sum(1).tolist())) == 1, name            # every row alike
    densities = [layer.density for layer in report]
    assert densities[2] > max(densities[:2])                        # the small output layer keeps most


def test_conv1d_wanda_scores_its_stored_layout_transposed():
    """A Hugging Face Conv1D stores W as [in, out]: rows of the canonical [out, in] view are the
    stored columns, and the norms are over its input features (stored dim 0)."""
    torch.manual_seed(4)
    conv = Conv1D(6, 16)
    with torch.no_grad():
        conv.weight.copy_(nonzero_randn(16, 6))
    batches = [torch.randn(5, 16) * torch.logspace(-1, 1, 16) for _ in range(2)]
    norms = torch.cat(batches).double().pow(2).sum(0).sqrt()
    scores = conv.weight.detach().double().t().abs() * norms            # [out, in]
    prune(nn.Sequential(conv), "unstructured@0.25", criterion="wanda", calibration=batches)
    top = scores.argsort(dim=1, descending=True)[:, :kept_count(0.25, 16)]
    assert torch.equal(conv.weight.t() != 0, torch.zeros(6, 16, dtype=torch.bool).scatter_(1, top, True))


def test_row_masks_break_ties_by_the_lower_column():
    scores = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    assert row_masks(scores, 0.5).tolist() == [[True, True, False, False], [False, True, True, False],
                                               [True, True, False, False]]


# ---- quality: the layer-output error on a small Llama with outlier input features ----

def tiny_llama(outlier_scale):
    """A 2-layer Llama from a config (random weights). Its RMSNorm gains are raised on 4 of 64
    features, so every attention and MLP input has a few large (outlier) features, as the
    activations of trained LLMs do."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    outliers = torch.randperm(64)[:4]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[outliers] = outlier_scale
            layer.post_attention_layernorm.weight[outliers] = outlier_scale
    return model


def token_batches(count, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (4, 32), generator=generator) for _ in range(count)]


def layer_inputs(model, names, batches):
    """Each layer's inputs on ``batches``, fp64 [tokens, in]."""
    modules = dict(model.named_modules())
    seen = {name: [] for name in names}
    hooks = [modules[name].register_forward_pre_hook(
        lambda m, a, name=name: seen[name].append(a[0].detach().reshape(-1, a[0].shape[-1]).double()))
        for name in names]
    with torch.no_grad():
        for batch in batches:
            model(batch)
    for hook in hooks:
        hook.remove()
    return {name: torch.cat(chunks) for name, chunks in seen.items()}


def output_errors(dense, pruned, inputs):
    """||X W^T - X W_p^T|| / ||X W^T|| per layer, in fp64."""
    dense_modules, pruned_modules = dict(dense.named_modules()), dict(pruned.named_modules())
    errors = {}
    for name, x in inputs.items():
        weight = dense_modules[name].weight.detach().double()
        delta = weight - pruned_modules[name].weight.detach().double()
        errors[name] = float((x @ delta.T).norm() / (x @ weight.T).norm())
    return errors


@pytest.mark.parametrize("pattern", ["unstructured@0.5", "2:4"])
def test_wanda_keeps_layer_outputs_closer_than_magnitude_on_a_small_llama(pattern):
    """Pruned on 4 calibration batches, measured on 4 other (held-out) batches: Wanda's output
    error is below magnitude's in every layer whose input has the outlier features (q/k/v,
    gate/up), no more than 5% above it where the inputs are near-uniform in scale (o_proj,
    down_proj: there both choose by |w|, Wanda row by row), and below 75% of it on average."""
    dense = tiny_llama(outlier_scale=8.0)
    names = [name for name, module in dense.named_modules()
             if isinstance(module, nn.Linear) and name != "lm_head"]
    held_out = layer_inputs(dense, names, token_batches(4, seed=2))
    errors = {}
    for criterion in ("magnitude", "wanda"):
        model = copy.deepcopy(dense)
        extra = {"calibration": token_batches(4, seed=1)} if criterion == "wanda" else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")      # lm_head is tied to the embedding: left out
            prune(model, pattern, exclude="lm_head", criterion=criterion, **extra)
        errors[criterion] = output_errors(dense, model, held_out)
    for name in names:
        bound = 1.0 if name.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")) else 1.05
        assert errors["wanda"][name] < bound * errors["magnitude"][name], (name, errors)
    mean = {c: sum(e.values()) / len(e) for c, e in errors.items()}
    assert mean["wanda"] < 0.75 * mean["magnitude"], mean
    assert mean["magnitude"] > 0.1                  # pruning half the weights does cost something


def test_the_output_error_measurement_tells_a_bad_criterion_apart():
    """The measurement can fail a criterion: scores that favour SMALL inputs (|w| / ||x_j||)
    keep outputs worse than magnitude in every layer with outlier features."""
    dense = tiny_llama(outlier_scale=8.0)
    names = [name for name, module in dense.named_modules()
             if isinstance(module, nn.Linear) and name.endswith(("q_proj", "up_proj"))]
    held_out = layer_inputs(dense, names, token_batches(4, seed=2))
    norms = {name: x.norm(dim=0).float() for name, x in
             layer_inputs(dense, names, token_batches(4, seed=1)).items()}
    anti, magnitude = copy.deepcopy(dense), copy.deepcopy(dense)
    prune(anti, "unstructured@0.5", include=names,
          criterion=lambda name, weight: weight.abs() / norms[name])
    prune(magnitude, "unstructured@0.5", include=names)
    bad, base = output_errors(dense, anti, held_out), output_errors(dense, magnitude, held_out)
    assert all(bad[name] > base[name] for name in names), (bad, base)
