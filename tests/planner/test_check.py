"""The whole-program check (sparsecc.planner.check): which graphs may be run again to time them,
the race itself, and the all-dense plan it leaves when the rewritten program loses."""
import gc

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from sparsecc.ir.plan import Plan, SitePlan
from sparsecc.planner.check import HOST_BOUND_MARGIN, MARGIN, ROUNDS, Raced, all_dense, can_run_again, faster, race


def test_racing_two_graphs_times_both():
    slow, fast = nn.Linear(1024, 1024), nn.Linear(8, 8)     # ~0.5 GFLOP a call against ~1 kFLOP
    x = torch.randn(64, 8)
    times = race(lambda: slow(x.repeat(8, 128)), lambda: fast(x), cuda=False)
    assert times.first_us > times.second_us > 0 and not times.second_host_bound


def test_the_two_take_the_lead_in_turn():
    from sparsecc.planner.check import CALLS, ROUNDS
    calls = []
    race(lambda: calls.append("a"), lambda: calls.append("b"), cuda=False)
    rounds = calls[6:]                                       # after three warm-up calls each
    leaders = [rounds[i * 2 * CALLS] for i in range(ROUNDS)]
    assert len(rounds) == 2 * CALLS * ROUNDS and leaders == ["a", "b"] * (ROUNDS // 2) + ["a"] * (ROUNDS % 2)


@pytest.mark.parametrize("collecting", [True, False])
def test_the_race_runs_with_the_collector_paused_and_leaves_it_as_it_was(collecting):
    seen = []
    (gc.enable if collecting else gc.disable)()
    try:
        race(lambda: seen.append(gc.isenabled()), lambda: seen.append(gc.isenabled()), cuda=False)
        assert seen and not any(seen)
        assert gc.isenabled() == collecting
    finally:
        gc.enable()


def test_graphs_run_again_only_on_real_inputs_and_without_in_place_writes():
    pure = fx.symbolic_trace(nn.Linear(4, 4))
    x = torch.randn(2, 4)
    assert can_run_again([pure], [x, 3])
    assert not can_run_again([pure], [x, object()])
    assert not can_run_again([pure], [torch.empty(2, 4, device="meta")])

    class Counting(nn.Module):
        def forward(self, x):
            return x.add_(1)

    assert not can_run_again([pure, fx.symbolic_trace(Counting())], [x])


def test_faster_means_ahead_by_the_margin_and_by_more_against_a_host_bound_program():
    assert faster(Raced(MARGIN * 100.0, 100.0)) and not faster(Raced(MARGIN * 100.0 + 0.1, 100.0))
    assert not faster(Raced(MARGIN * 100.0, 100.0, second_host_bound=True))
    assert faster(Raced(HOST_BOUND_MARGIN * 100.0, 100.0, True))
    assert not faster(Raced(HOST_BOUND_MARGIN * 100.0 + 0.1, 100.0, True))


def test_a_gain_under_the_margin_counts_where_every_round_shows_it_unless_the_host_sets_the_pace():
    gen = torch.Generator().manual_seed(0)
    dense = tuple(100.0 + 0.3 * torch.rand(ROUNDS, generator=gen).double().numpy())
    apart = tuple(99.0 + 0.3 * torch.rand(ROUNDS, generator=gen).double().numpy())
    overlapping = apart[:-1] + (max(dense) - 0.01,)
    median = lambda rounds: sorted(rounds)[ROUNDS // 2]  # noqa: E731
    assert median(apart) > MARGIN * median(dense)               # under the margin
    assert faster(Raced(median(apart), median(dense), False, apart, dense))
    assert not faster(Raced(median(overlapping), median(dense), False, overlapping, dense))
    assert not faster(Raced(median(apart), median(dense), True, apart, dense))
    assert not faster(Raced(median(apart), median(dense), False, apart[:2], dense[:2]))   # too few rounds


def test_race_returns_every_round():
    busy = lambda: sum(range(2000))  # noqa: E731
    raced = race(busy, busy, cuda=False)
    assert len(raced.first_rounds) == len(raced.second_rounds) == ROUNDS
    assert sorted(raced.first_rounds)[ROUNDS // 2] == raced.first_us


def test_on_the_cpu_no_program_is_called_bound_by_the_host():
    busy = lambda: sum(range(2000))  # noqa: E731
    assert race(busy, busy, cuda=False).second_host_bound is False


def test_a_lost_race_makes_every_site_dense_and_says_why():
    site = SitePlan(name="a", module_path="", shape=[8, 8], dtype="float16", m=4, epilogue="none", density=0.5,
                    fits=["2:4"], block_density={}, candidates=[], choice="2:4", reason="2:4 was timed fastest",
                    bytes_before=128, bytes_after=72, above="dense")
    dense = SitePlan(**{**site.__dict__, "name": "b", "choice": "dense", "reason": "dense was timed fastest",
                        "bytes_after": 128, "above": None})
    plan = all_dense(Plan([site, dense], device="cuda"), Raced(120.0, 100.0), what="model")
    assert [s.choice for s in plan.sites] == ["dense", "dense"] and plan.sites[0].bytes_after == 128
    assert plan.sites[0].above is None
    assert plan.sites[0].reason.startswith("dense: this model with its sparse layers ran 120 us per call on the "
                                           "example inputs, the dense one 100 us")
    assert plan.sites[0].reason.endswith("the layer alone: 2:4 was timed fastest")
    assert plan.sites[1].reason == "dense was timed fastest"
    host_bound = all_dense(Plan([site], device="cuda"), Raced(97.0, 100.0, True))
    assert "the dense one 100 us, bound by the host (a rewritten graph must be 5% faster)" in host_bound.sites[0].reason
    assert "(a rewritten model must be 2% faster, or in every round)" in plan.sites[0].reason
