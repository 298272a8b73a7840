"""Sibling sites on sparsecc's 2:4 kernels (fp16, a Hopper GPU): q, k, v, gate and up, reading one
x, run as one call on their stacked weight, against an fp64 reference of the same fp16 weights, at a
decode step's rows, the tensor-core small-batch kernels' and the GEMMs', through sparsecc.compile
and through the torch.compile backend."""
import copy

import pytest
import torch
import torch.nn as nn

import sparsecc
from sparsecc.backend import COMPILED, make_backend

from conftest import TOLERANCE, kernels_of_24_sites, rel_error
from ir.test_siblings import Attention
from test_generate import SparseOps

pytestmark = pytest.mark.gpu

#: q, k and v; gate and up; out; and all five but out stacked
SHAPES = [(256, 256), (128, 256), (512, 256), (256, 512), (1536, 256)]
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = kernels_of_24_sites(SHAPES, (torch.float16,))
#: two layers in a row, each within fp16 tolerance
ERROR = 2 * TOLERANCE[torch.float16]


def block(gen) -> nn.Module:
    """test_siblings' model at widths the kernels take: q, k, v of 256 inputs, gate and up 512 wide."""
    return Attention(gen, width=256, hidden=512).half().cuda().eval()


def reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(model).double()(x.double())


@pytest.mark.parametrize("m", [1, 16, 200])
def test_compile_runs_the_group_in_one_call(gen, m):
    model = block(gen)
    x = torch.randn(m, 256, generator=gen).half().cuda()
    compiled = sparsecc.compile(model, x, formats=("2:4",))
    groups = {site.group for site in compiled.sparsecc_plan if site.group}
    assert groups == {"q.weight+k.weight+v.weight+gate.weight+up.weight"}
    for rows in (m, m + 3):                      # the planned batch and another
        x = torch.randn(rows, 256, generator=gen).half().cuda()
        with torch.no_grad(), SparseOps() as ops:
            y = compiled(x)
        assert sum(ops.rows.values()) == 2                          # the five, then out
        assert rel_error(y.double(), reference(model, x)) <= ERROR


def test_the_backend_runs_the_group_in_one_call(gen):
    model = block(gen)
    x = torch.randn(8, 256, generator=gen).half().cuda()
    torch._dynamo.reset()
    COMPILED.clear()
    try:
        compiled = torch.compile(model, backend=make_backend(formats=("2:4",), inductor=False))
        with torch.no_grad():
            y = compiled(x)
        [graph] = COMPILED
        assert sum(site.group is not None for site in graph.plan) == 5
        assert rel_error(y.double(), reference(model, x)) <= ERROR
    finally:
        torch._dynamo.reset()


def test_planning_prices_the_siblings_together(gen):
    """Unforced, at a decode step's rows: the cost model also times the five stacked (whatever
    it then chooses, each group runs as one call and the result holds)."""
    from test_generate import calls
    model = block(gen)
    x = torch.randn(1, 256, generator=gen).half().cuda()
    compiled = sparsecc.compile(model, x)
    with torch.no_grad(), SparseOps() as ops:
        y = compiled(x)
    sparse = [site for site in compiled.sparsecc_plan if site.choice != "dense"]
    assert sum(ops.rows.values()) == calls(sparse)
    assert rel_error(y.double(), reference(model, x)) <= ERROR


def test_a_group_planned_dense_above_the_small_batches_shares_their_call(gen):
    """Planned for 1 to 512 rows with the dense weights above the small-batch kernels (as a causal
    LM's prefill often is): the five share one small-batch call on their stacked weight, and past
    its rows each runs its own weight, the model's; both against fp64."""
    from sparsecc.kernels.by_rows import linear_split_by_rows
    model = block(gen)
    x = torch.randn(512, 256, generator=gen).half().cuda()
    plan = sparsecc.plan(model, x, formats=("2:4",), m_range=(1, 512))
    for site in plan:
        site.above = "dense" if site.choice == "2:4" else None
    compiled = sparsecc.compile(model, x, plan=plan)
    assert {site.group for site in compiled.sparsecc_plan if site.group} == {"q.weight+k.weight+v.weight+gate.weight+up.weight"}
    [call] = [n for gm in compiled.modules() if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes
              if n.target is linear_split_by_rows]
    held = {b.data_ptr() for b in compiled.buffers()}
    assert all(getattr(model, name).weight.data_ptr() in held for name in ("q", "k", "v", "gate", "up"))
    limit = call.args[6]                        # (x, values, metadata, dense, N, K, limit, ...)
    for rows in sorted({1, limit, limit + 1, 512}):
        x = torch.randn(rows, 256, generator=gen).half().cuda()
        with torch.no_grad(), SparseOps() as ops:
            y = compiled(x)
        assert rel_error(y.double(), reference(model, x)) <= ERROR, rows
        if rows in (1, 512):                    # the five in one call, then out; or all on torch
            assert sum(ops.rows.values()) == (2 if rows == 1 else 0), rows
