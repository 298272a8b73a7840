"""share_globals: the graph modules' code reads one globals dict and computes as before."""
import torch
import torch.fx as fx
import torch.nn as nn

from sparsecc.frontend.shared_globals import share_globals
from sparsecc.ir.numerics import relative_error


class _Scaled(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.fc = nn.Linear(features, features)

    def forward(self, x):
        return torch.relu(self.fc(x)) * 0.5


def test_modules_share_one_dict_and_compute_as_before():
    torch.manual_seed(0)
    modules = [fx.symbolic_trace(_Scaled(16)) for _ in range(3)]
    x = torch.randn(4, 16)
    before = [m(x) for m in modules]
    share_globals(modules)
    scopes = {id(type(m).forward.__globals__) for m in modules}
    assert len(scopes) == 1
    for module, expected in zip(modules, before):
        assert relative_error(module(x), expected) == 0.0


def test_a_module_whose_names_clash_keeps_its_own_dict():
    a = fx.symbolic_trace(_Scaled(8))
    b = fx.symbolic_trace(_Scaled(8))
    # the same global name bound to another object in b's dict
    type(b).forward.__globals__["torch"] = object()
    globals_a, globals_b = type(a).forward.__globals__, type(b).forward.__globals__
    share_globals([a, b])
    assert type(a).forward.__globals__ is not globals_a           # a moved to the shared dict
    assert type(b).forward.__globals__ is globals_b               # b kept its own


def test_recompile_gives_a_module_its_own_dict_back():
    torch.manual_seed(1)
    a, b = fx.symbolic_trace(_Scaled(8)), fx.symbolic_trace(_Scaled(8))
    share_globals([a, b])
    a.recompile()
    assert type(a).forward.__globals__ is not type(b).forward.__globals__
    x = torch.randn(2, 8)
    assert relative_error(a(x), torch.relu(a.fc(x)) * 0.5) < 1e-6
