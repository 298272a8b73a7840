import pytest
import torch
from torch import nn

from sparsecc.ir.analysis import analyze
from sparsecc.errors import InputError
from sparsecc.ir.formats import FormatSpec
from sparsecc.pruning import attach_to_optimizer, parse_pattern, prune, remove_masks
from sparsecc.pruning.finetune import MASK_BUFFER, apply_masks, register_mask

from conftest import nonzero_randn


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Training steps this small run faster on one thread (and do not stall on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    with torch.no_grad():                 # one scale for all layers, never zeros
        for module in linears(model):
            module.weight.copy_(nonzero_randn(*module.weight.shape) * 0.2)
    x = torch.randn(128, 32)
    y = torch.randint(0, 8, (128,))
    return model, x, y


def train_steps(model, optimizer, x, y, steps, check=None):
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if check:
            check()


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)


def linears(model):
    return [m for m in model if isinstance(m, nn.Linear)]


def assert_fits(pattern, w):
    parsed = parse_pattern(pattern)
    stats = analyze(w, extra_group_sizes=tuple(f.m for f in parsed.formats() if f.m),
                    extra_blocks=tuple(f.block for f in parsed.formats() if f.block))
    assert all(stats.fits(spec) for spec in parsed.formats())


@pytest.mark.parametrize("pattern, scope", [("2:4", "layer"), ("1:8", "layer"), ("2:4/vw4", "layer"),
                                            ("2:4/bw8", "layer"), ("block8x8@0.3", "global"),
                                            ("unstructured@0.2", "global")])
def test_pattern_holds_exactly_after_every_step_of_fine_tuning(pattern, scope):
    model, x, y = model_and_data()
    report = prune(model, pattern, scope=scope, keep_masks=True)
    masks = [m.weight_mask.clone() for m in linears(model)]
    pruned = [m.weight.detach().clone() for m in linears(model)]
    optimizer = sgd(model)
    attach_to_optimizer(model, optimizer)

    def check():
        for module, mask in zip(linears(model), masks):
            assert (module.weight[~mask] == 0).all()

    train_steps(model, optimizer, x, y, 12, check)
    for module, mask, before in zip(linears(model), masks, pruned):
        w = module.weight.detach()
        assert torch.equal(w != 0, mask)                  # kept weights trained, none regrew
        assert not torch.equal(w, before)                 # and they did train
        assert_fits(pattern, w)
    assert [layer.density for layer in report] == \
        [float((m.weight != 0).float().mean()) for m in linears(model)]


def test_without_the_hook_pruned_weights_regrow():
    """The control for the test above: momentum and weight decay do move pruned weights."""
    model, x, y = model_and_data()
    prune(model, "2:4", keep_masks=True)
    train_steps(model, sgd(model), x, y, 3)
    assert not analyze(linears(model)[0].weight).fits(FormatSpec.parse("2:4"))


def test_masks_are_bool_buffers_of_the_stored_shape_in_the_state_dict():
    model, _, _ = model_and_data()
    prune(model, "2:4", keep_masks=True)
    for index, module in enumerate(model):
        if isinstance(module, nn.Linear):
            assert module.weight_mask.dtype == torch.bool
            assert module.weight_mask.shape == module.weight.shape
            assert torch.equal(module.weight_mask, module.weight != 0)
            assert f"{index}.{MASK_BUFFER}" in model.state_dict()


def test_no_masks_without_keep_masks():
    model, _, _ = model_and_data()
    prune(model, "2:4")
    assert not any(hasattr(m, MASK_BUFFER) for m in model.modules())


def test_remove_masks_leaves_exactly_sparse_weights_and_removes_the_hook():
    model, x, y = model_and_data()
    prune(model, "2:4", keep_masks=True)
    optimizer = sgd(model)
    handle = attach_to_optimizer(model, optimizer)
    train_steps(model, optimizer, x, y, 3)
    # a change made outside the optimizer is undone by remove_masks' last application
    with torch.no_grad():
        linears(model)[0].weight.add_(1.0)
    assert remove_masks(model, handle) == 3
    for module in linears(model):
        assert not hasattr(module, MASK_BUFFER)
        assert analyze(module.weight).fits(FormatSpec.parse("2:4"))
    assert not any(MASK_BUFFER in key for key in model.state_dict())
    assert remove_masks(model) == 0
    train_steps(model, optimizer, x, y, 3)                # the hook is gone: weights regrow
    assert not analyze(linears(model)[0].weight).fits(FormatSpec.parse("2:4"))


def test_hook_works_with_adam_and_one_setup_call():
    model, x, y = model_and_data()
    prune(model, "unstructured@0.1", keep_masks=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    attach_to_optimizer(model, optimizer)
    masks = [m.weight_mask.clone() for m in linears(model)]
    train_steps(model, optimizer, x, y, 10)
    for module, mask in zip(linears(model), masks):
        assert torch.equal(module.weight != 0, mask)


def test_repruning_replaces_the_mask():
    model, x, y = model_and_data()
    prune(model, "2:4", keep_masks=True)
    prune(model, "1:4", keep_masks=True)
    optimizer = sgd(model)
    attach_to_optimizer(model, optimizer)
    train_steps(model, optimizer, x, y, 3)
    for module in linears(model):
        assert int(module.weight_mask.sum()) == module.weight.numel() // 4
        assert analyze(module.weight).fits(FormatSpec.parse("1:4"))


def test_apply_masks_and_register_mask():
    layer = nn.Linear(8, 4)
    with torch.no_grad():
        layer.weight.copy_(nonzero_randn(4, 8, generator=torch.Generator().manual_seed(0)))
    mask = torch.rand(4, 8, generator=torch.Generator().manual_seed(1)) < 0.5
    register_mask(layer, mask.to(torch.uint8))
    assert layer.weight_mask.dtype == torch.bool
    assert apply_masks(nn.Sequential(layer)) == 1
    assert torch.equal(layer.weight != 0, mask)
    with pytest.raises(InputError, match="does not fit"):
        register_mask(layer, mask.t())
