"""groups: sibling sites planned once more as one stacked site, taking its sparse format where one
call of it was timed faster than the members as planned alone, by the timing margin. The timings
are a table (a GPU's, replayed on the CPU); the compiled model is checked against fp64."""
import copy

import pytest
import torch

import sparsecc
from sparsecc.planner.cost import CostModel, Decision, Prediction
from sparsecc.ir.formats import FormatSpec

from conftest import TOLERANCE, rel_error
from ir.test_siblings import Attention
from test_generate import SparseOps

TWO_FOUR, DENSE = FormatSpec.parse("2:4"), FormatSpec.parse("dense")
#: Attention's q, k, v, gate and up read x: stacked, 32 + 16 + 16 + 24 + 24 rows
STACKED_ROWS = 112


class TimedTable(CostModel):
    """Timings from a table, by the weight's rows: dense 10 us a site alone and 2:4 ``alone``
    (11: each stays dense), and for the stacked weight dense 50 us and 2:4 ``together``."""

    def __init__(self, together: float, alone=lambda rows: 11.0, dense_call_us: float | None = None):
        super().__init__("cpu")
        self.together, self.alone, self.decided = together, alone, []
        self.dense_call_us = dense_call_us       # op by op: a dense call's host time, else None

    def prices_groups(self) -> bool:
        return True

    def charges_host(self) -> bool:
        return self.dense_call_us is not None

    def dense_host_us(self, weight, m) -> float:
        assert weight.shape == (STACKED_ROWS, 32) and m == 4
        return self.dense_call_us

    def decide(self, stats, m, allowed, measure_sites=None, m_range=None) -> Decision:
        rows = stats.shape[0]
        self.decided.append(rows)
        dense, two_four = (50.0, self.together) if rows == STACKED_ROWS else (10.0, self.alone(rows))
        choice = TWO_FOUR if two_four < 0.95 * dense else DENSE
        return Decision(choice, "from the table", [Prediction("dense", dense, 0, dense),
                                                   Prediction("2:4", two_four, 0, two_four)])


def compiled_with(cost_model, gen):
    model = Attention(gen).eval()
    x = torch.randn(4, 32, generator=gen)
    return model, sparsecc.compile(model, x, cost_model=cost_model), x


def test_siblings_take_the_stacked_weights_format_where_one_call_is_faster(gen):
    model, compiled, x = compiled_with(TimedTable(together=40.0), gen)
    readers = [site for site in compiled.sparsecc_plan if site.name.split(".")[0] != "out"]
    assert {site.choice for site in readers} == {"2:4"}
    assert {site.group for site in readers} == {"q.weight+k.weight+v.weight+gate.weight+up.weight"}
    assert "timed 40.0 us as 2:4, the 5 as planned alone 50.0 us" in readers[0].reason
    assert compiled.sparsecc_plan["out.weight"].choice == "dense"
    with torch.no_grad(), SparseOps() as ops:
        y = compiled(x)
    assert sum(ops.rows.values()) == 1
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(x.double())
    assert rel_error(y.double(), reference) <= 10 * TOLERANCE[torch.float32]


def test_siblings_stay_as_planned_unless_one_call_beats_them_by_the_margin(gen):
    _, compiled, _ = compiled_with(TimedTable(together=48.0), gen)       # 0.95 x 50 = 47.5
    assert {site.choice for site in compiled.sparsecc_plan} == {"dense"}
    assert all(site.group is None for site in compiled.sparsecc_plan)


def test_op_by_op_one_call_is_credited_the_dense_host_calls_it_saves(gen):
    """Op by op the five dense layers are five host calls, the stacked one call: 4 x 2 us."""
    _, compiled, _ = compiled_with(TimedTable(together=55.0, dense_call_us=2.0), gen)     # 55 - 8 <= 47.5
    readers = [site for site in compiled.sparsecc_plan if site.name.split(".")[0] != "out"]
    assert {site.choice for site in readers} == {"2:4"} and len({site.group for site in readers}) == 1
    assert "one host call where dense makes 5: 8.0 us less" in readers[0].reason
    _, compiled, _ = compiled_with(TimedTable(together=56.0, dense_call_us=2.0), gen)
    assert {site.choice for site in compiled.sparsecc_plan} == {"dense"}


def test_siblings_already_sharing_a_call_are_left_as_planned(gen):
    cost_model = TimedTable(together=20.0, alone=lambda rows: 5.0 if rows == 24 else 11.0)   # gate, up: 2:4
    _, compiled, _ = compiled_with(cost_model, gen)
    choices = {site.name.split(".")[0]: site.choice for site in compiled.sparsecc_plan}
    assert choices == {"q": "dense", "k": "dense", "v": "dense", "gate": "2:4", "up": "2:4", "out": "dense"}
    assert STACKED_ROWS not in cost_model.decided


def test_siblings_planned_over_a_batch_range_keep_their_own_choices(gen):
    """Over a range each bucket may choose differently: such sites are not priced as one."""
    cost_model = TimedTable(together=20.0)
    model = Attention(gen).eval()
    compiled = sparsecc.compile(model, torch.randn(4, 32, generator=gen), cost_model=cost_model, m_range=(1, 8))
    assert {site.choice for site in compiled.sparsecc_plan} == {"dense"}
    assert STACKED_ROWS not in cost_model.decided


@pytest.mark.parametrize("measure", [False, True])
def test_only_a_gpus_timings_price_groups(measure):
    assert not CostModel("cpu", measure=measure).prices_groups()
    assert CostModel("cuda", measure=True, kernels_unavailable="no GPU here").prices_groups()
    assert not CostModel("cuda", measure=False, kernels_unavailable="no GPU here").prices_groups()
