"""The whole-graph check on a Hopper GPU: the backend's rewritten graph and the dense one Inductor
compiles, or ``sparsecc.compile``'s model and the model, are both run and timed on the example
inputs (op by op and under CUDA graphs); whichever is kept computes the model's output within fp16
tolerance, and the plan says which one ran."""
import pytest
import torch
import torch.nn as nn

import sparsecc
from sparsecc.backend import COMPILED, make_backend
from sparsecc.planner.check import HOST_BOUND_MARGIN, MARGIN

from conftest import kernels_of_24_sites, rel_error

pytestmark = pytest.mark.gpu

#: the MLP's weights [N, K]
SHAPES = [(2048, 1024), (1024, 2048)]
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = kernels_of_24_sites(SHAPES, (torch.float16,))


def _pruned_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024)).half().cuda().eval()
    sparsecc.prune(model, "2:4")
    return model


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("rows", [8, 1024])
def test_the_check_keeps_the_faster_graph_and_the_plan_says_which(mode, rows):
    torch._dynamo.reset()
    model = _pruned_mlp()
    compiled = torch.compile(model, backend=make_backend(formats=("2:4",), check_graph=True), mode=mode)
    with torch.no_grad():
        for step in range(4):     # CUDA graphs record on the first calls and replay after
            x = torch.randn(rows, 1024, dtype=torch.float16, device="cuda")
            assert rel_error(compiled(x).clone(), model(x)) < 1e-2, step
    graph = COMPILED[-1]
    assert graph.cuda_graphs == (mode == "reduce-overhead")
    sparse_us, dense_us, host_bound = graph.raced
    assert sparse_us > 0 and dense_us > 0
    choices = set(graph.plan.choices().values())
    if sparse_us <= (HOST_BOUND_MARGIN if host_bound else MARGIN) * dense_us:
        assert choices == {"2:4"} and graph._watched
    else:
        assert choices == {"dense"} and not graph._watched
        assert all(f"ran {sparse_us:.0f} us per call on the example inputs" in s.reason for s in graph.plan)


def test_the_check_is_on_by_default_on_the_gpu_unless_sparse_is_forced():
    torch._dynamo.reset()
    model = _pruned_mlp()
    x = torch.randn(64, 1024, dtype=torch.float16, device="cuda")
    with torch.no_grad():
        for backend, checked in ((make_backend(formats=("dense", "2:4")), True), (make_backend(formats=("2:4",)), False)):
            torch._dynamo.reset()
            assert rel_error(torch.compile(model, backend=backend)(x), model(x)) < 1e-2
            assert COMPILED[-1].check_graph is checked


@pytest.mark.parametrize("rows", [8, 1024])
def test_compile_checks_the_whole_model_the_same_way(monkeypatch, rows):
    """``sparsecc.compile`` on the GPU: the compiled model and the model, each captured in a CUDA
    graph, raced on the example inputs; whichever is returned computes the model's output, and
    its plan says which ran."""
    from sparsecc.planner import check
    found = []
    race = check.race
    monkeypatch.setattr(check, "race", lambda *a, **k: found.append(race(*a, **k)) or found[-1])
    model = _pruned_mlp()
    x = torch.randn(rows, 1024, dtype=torch.float16, device="cuda")
    compiled = sparsecc.compile(model, x, formats=("2:4",), check_graph=True)
    with torch.no_grad():
        assert rel_error(compiled(x), model(x)) < 1e-2
    (sparse_us, dense_us, host_bound), = found
    choices = set(compiled.sparsecc_plan.choices().values())
    if sparse_us <= (HOST_BOUND_MARGIN if host_bound else MARGIN) * dense_us:
        assert choices == {"2:4"}
    else:
        assert choices == {"dense"}
        assert all(f"ran {sparse_us:.0f} us per call on the example inputs" in s.reason for s in compiled.sparsecc_plan)
