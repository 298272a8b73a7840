"""tracing: whole-model fx first, then part by part; guarded parts; clear input errors;
the original model is never changed."""
import functools

import pytest
import torch
import torch.nn as nn

import sparsecc
from sparsecc.frontend import tracing
from sparsecc.errors import InputError

from models import bert


class Untraceable(nn.Module):
    """Data-dependent control flow at the top, traceable children below."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.own = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        if x.sum() > 0:                      # fx cannot trace this
            x = x @ self.own
        return self.b(self.a(x))


def test_parts_are_traced_when_the_whole_is_not():
    model = Untraceable()
    result = tracing.trace(model, (torch.randn(2, 4),), {})
    assert [p.path for p in result.parts] == ["a", "b"]
    assert "<model>" in result.untraced and "own" in result.untraced["<model>"]
    # shape propagation annotated the parts
    node = next(n for n in result.parts[0].gm.graph.nodes if n.op == "call_function")
    assert tuple(node.meta["tensor_meta"].shape) == (2, 4)


def test_bad_example_inputs_raise_input_error():
    with pytest.raises(InputError, match="do not fit the model"):
        tracing.trace(nn.Linear(4, 3), (torch.randn(2, 5),), {})
    with pytest.raises(InputError, match="example_inputs must be"):
        tracing.normalize_inputs(3.0)


class WithOptional(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask=None, scale=1.0):
        y = self.lin(x)
        if mask is not None:
            y = y * mask
        return y * scale


def test_constant_arguments_are_guarded():
    model = WithOptional()
    x = torch.randn(3, 4)
    result = tracing.trace(model, (x,), {})
    part = result.parts[0]
    assert part.constants == {"mask": None, "scale": 1.0}
    guarded = part.module()
    assert isinstance(guarded, tracing.GuardedModule)
    torch.testing.assert_close(guarded(x), model(x))
    mask = torch.rand(3, 4)
    torch.testing.assert_close(guarded(x, mask, scale=2.0), model(x, mask, scale=2.0))   # falls back, correct


def test_assemble_shares_untouched_parts_and_leaves_the_original_alone():
    model = bert()
    ids = torch.randint(0, 100, (2, 6))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    replacement = nn.Linear(64, 64)
    assembled = tracing.assemble(model, {"encoder.layer.0.intermediate.dense": nn.Linear(64, 128),
                                         "pooler.dense": replacement})
    assert assembled.pooler.dense is replacement and model.pooler.dense is not replacement
    assert assembled.embeddings is model.embeddings                      # shared, not copied
    assert assembled.encoder.layer[1] is model.encoder.layer[1]
    assert assembled.encoder.layer[0] is not model.encoder.layer[0]      # on the replaced path
    assert {k: v for k, v in model.state_dict().items()}.keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    model(ids)   # the original still runs


def test_a_module_called_whole_with_weights_is_reported():
    """fx keeps torch.nn's modules as single calls: a MultiheadAttention called whole would hide
    its weights; the plan's untraced list names it and its weights instead."""
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention, self.fc = nn.MultiheadAttention(64, 4, batch_first=True), nn.Linear(64, 64)

        def forward(self, x):
            return self.fc(self.attention(x, x, x)[0])

    plan = sparsecc.plan(Attention().eval(), torch.randn(2, 10, 64))
    assert [site.label for site in plan.sites] == ["fc"]
    assert set(plan.untraced) == {"attention"}
    assert "in_proj_weight" in plan.untraced["attention"] and "out_proj.weight" in plan.untraced["attention"]


def test_assemble_leaves_out_calls_into_the_original():
    """A method of the original stored on it (``model.forward = wrapper(model.forward)``, a
    compiled ``__call__`` cached by ``generate``) would run the original from the copy: the copy
    leaves it out and runs its own forward; other attributes are kept."""
    model = Untraceable()
    calls = []
    original_forward = model.forward

    @functools.wraps(original_forward)          # as torch.compile does: __wrapped__ is the bound method
    def counting(*args, **kwargs):
        calls.append(1)
        return original_forward(*args, **kwargs)

    model.forward = counting
    model.cached_call = functools.partial(model.__call__)      # no __self__, no __wrapped__: kept
    model.note = "kept"
    replacement = nn.Linear(4, 4)
    assembled = tracing.assemble(model, {"b": replacement})
    assert "forward" not in assembled.__dict__ and "forward" in model.__dict__
    assert assembled.note == "kept" and "cached_call" in assembled.__dict__
    x = -torch.ones(2, 4)                                   # x.sum() < 0: no branch
    torch.testing.assert_close(assembled(x), replacement(model.a(x)))
    assert not calls
    model(x)
    assert calls == [1]
