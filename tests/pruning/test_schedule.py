"""Gradual pruning (cubic schedule) and scope='erk' (per-layer densities)."""
import pytest
import torch
from torch import nn

from sparsecc.errors import InputError
from sparsecc.pruning import GradualPruning, attach_to_optimizer, prune, remove_masks
from sparsecc.pruning.allocation import erk_densities

from conftest import with_nonzero_weights
from models import mlp as build_mlp


def mlp(seed=0):
    torch.manual_seed(seed)
    return with_nonzero_weights(build_mlp((32, 64, 64, 8)))


def kept(model):
    return {i: m.weight != 0 for i, m in enumerate(model) if isinstance(m, nn.Linear)}


def test_erk_densities_follow_fan_in_plus_fan_out_and_keep_the_total():
    shapes = [(64, 32), (64, 64), (8, 64)]
    densities = erk_densities(shapes, 0.1)
    sizes = [r * c for r, c in shapes]
    assert sum(d * s for d, s in zip(densities, sizes)) == pytest.approx(0.1 * sum(sizes), rel=1e-12)
    ratios = [d / ((r + c) / (r * c)) for d, (r, c) in zip(densities, shapes)]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-12)


def test_erk_keeps_a_layer_dense_when_its_share_would_exceed_one():
    shapes = [(512, 512), (2, 4)]
    densities = erk_densities(shapes, 0.2)
    assert densities[1] == 1.0
    assert densities[0] * 512 * 512 + 8 == pytest.approx(0.2 * (512 * 512 + 8), rel=1e-12)


def test_prune_with_erk_scope_keeps_the_density_and_more_in_the_small_layer():
    model = mlp()
    report = prune(model, "unstructured@0.1", scope="erk")
    assert report.density == pytest.approx(0.1, abs=1e-3)
    expected = erk_densities([(64, 32), (64, 64), (8, 64)], 0.1)
    for layer, density in zip(report, expected):
        assert layer.density == pytest.approx(density, abs=1 / layer.numel), layer
    with pytest.raises(InputError, match="no density to spread"):
        prune(mlp(), "2:4", scope="erk")


def test_the_schedule_is_the_cubic_of_zhu_and_gupta():
    schedule = GradualPruning(mlp(), "unstructured@0.1", steps=5, initial_density=0.9)
    for t in range(7):
        assert schedule.density_at(t) == pytest.approx(0.1 + 0.8 * (1 - min(t, 5) / 5) ** 3, rel=1e-12)


@pytest.mark.parametrize("kwargs", [dict(scope="global"), dict(scope="erk"), dict(scope="layer")])
def test_steps_reach_the_final_density_and_masks_only_shrink(kwargs):
    model = mlp()
    schedule = GradualPruning(model, "unstructured@0.05", steps=4, **kwargs)
    before = kept(model)
    densities = []
    while not schedule.done:
        report = schedule.step()
        densities.append(report.density)
        now = kept(model)
        assert all((now[i] <= before[i]).all() for i in now)       # nothing pruned comes back
        before = now
    assert densities == sorted(densities, reverse=True)
    assert densities[-1] == pytest.approx(0.05, abs=2e-3)
    assert densities[0] == pytest.approx(schedule.density_at(1), abs=2e-3)
    assert schedule.step().density == pytest.approx(densities[-1])   # past the end: stays final


def test_training_between_steps_keeps_the_masks():
    model = mlp()
    x, y = torch.randn(64, 32), torch.randint(0, 8, (64,))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    handle = attach_to_optimizer(model, optimizer)
    schedule = GradualPruning(model, "unstructured@0.1", steps=3, criterion="wanda", calibration=[x])
    for _ in range(3):
        schedule.step()
        for _ in range(5):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        assert sum(int(m.sum()) for m in kept(model).values()) == pytest.approx(
            schedule.reports[-1].density * sum(m.numel() for m in kept(model).values()), abs=1)
    assert schedule.reports[-1].criterion == "wanda"
    remove_masks(model, handle)


@pytest.mark.parametrize("args, kwargs, says", [
    (("2:4",), dict(steps=3), "has none"), (("unstructured@0.1",), dict(steps=0), "steps"),
    (("unstructured@0.1",), dict(steps=3, initial_density=0.05), "initial_density"),
    (("unstructured@0.1",), dict(steps=3, keep_masks=False), "keep_masks"),
    (("unstructured@0.1",), dict(steps=3, criterion="wanda", calibration=iter([torch.randn(2, 32)])),
     "re-iterable")])
def test_bad_schedules_raise_input_error(args, kwargs, says):
    with pytest.raises(InputError, match=says):
        GradualPruning(mlp(), *args, **kwargs)
