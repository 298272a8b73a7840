"""Launch tuning on the GPU: every candidate of a family timed on a weight of the user's shape,
the fastest right one recorded and dispatched, and compile reporting what it tuned."""
import pytest
import torch
import torch.nn as nn

import sparsecc
from conftest import TOLERANCE, n_m, rel_error
from sparsecc.codegen.spec import Family, KernelSpec
from sparsecc.ir.formats import NM_2_4
from sparsecc.kernels import tune
from sparsecc.kernels.base import Launch, launch_for
from sparsecc.kernels.sparse24_small import GEMM, MMA

pytestmark = pytest.mark.gpu

SHAPE = (1536, 2560)          # in no table: the shipped one borrows a launch from the nearest shape
KERNELS = list(dict.fromkeys([KernelSpec(Family.SM90_COMPRESS24, "float16")]
                             + [launch.spec for family in (MMA, GEMM) for m in (16, 64)
                                for launch in family.candidates(torch.float16, SHAPE, m)]))


@pytest.fixture
def fresh_table(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSECC_TUNE", "new")
    monkeypatch.setattr(tune, "_TUNED_THIS_PROCESS", set())
    table = tune.TuningTable(tune.shipped_entries(), tmp_path / "tuning.json", tune.machine_key(torch.device("cuda")))
    tune.use(table)
    yield table
    tune.use(None)


@pytest.mark.parametrize("family, m", [(MMA, 16), (GEMM, 64)])
def test_a_tuned_launch_is_dispatched_and_computes_right(fresh_table, family, m, gen):
    found = tune.tune_bucket(family, torch.float16, SHAPE, m, progress=False)
    assert found is not None and (found["N"], found["K"], found["M"]) == (*SHAPE, m) and found["us"] > 0
    assert fresh_table.best(family.templates[0], "float16", m, *SHAPE)[2] == "tuned here"
    weight = n_m(*SHAPE, 2, 4, gen, torch.float16).cuda()
    packed = family.pack(weight, NM_2_4, m)
    assert launch_for(family.dispatch(torch.float16, SHAPE), m).label == Launch.from_description(found).label
    x = torch.randn(m, SHAPE[1], generator=gen).to(torch.float16).cuda()
    y = packed.op(x, *packed.tensors().values(), *packed.scalars().values(), None, "none", False, False,
                  *packed.extra_args)
    assert rel_error(y, x.float() @ weight.float().t()) <= TOLERANCE[torch.float16]


def test_compile_tunes_what_it_needs_once_and_reports_it(fresh_table, gen):
    """A 2:4 layer of an unseen shape at 16 rows: the plan lists what it tuned; compiling it
    again tunes nothing (measured here), and the output matches eager."""
    layer = nn.Linear(SHAPE[1], SHAPE[0]).half().cuda()
    with torch.no_grad():
        layer.weight.copy_(n_m(*SHAPE, 2, 4, gen, torch.float16))
    x = torch.randn(16, SHAPE[1], generator=gen).half().cuda()
    first = sparsecc.compile(layer, x, formats=("2:4",))
    assert first.sparsecc_plan.tuning, "nothing was tuned"
    assert all((t["n"], t["k"]) == SHAPE for t in first.sparsecc_plan.tuning)
    assert "tuned on this GPU" in first.sparsecc_plan.table()
    again = sparsecc.compile(layer, x, formats=("2:4",))
    assert again.sparsecc_plan.tuning == []
    with torch.no_grad():
        assert rel_error(again(x), layer(x)) <= TOLERANCE[torch.float16]
