"""A 2:4 site planned over a batch range that spans the small-batch kernels and the GEMMs
(sparsecc.kernels.sparse24_by_rows), on any device: which small-batch family and row limit a
range gets, that each call reaches the tier its rows belong to with the packed arrays in the
op's order, that the dense tier computes x W^T (fp64 reference), and what the planner makes of
timings at both ends of the range (sparsecc.planner.cost)."""
import pytest
import torch

import sparsecc.kernels.sparse24_by_rows as by_rows
from sparsecc.ir.formats import DENSE, NM_2_4
from sparsecc.ir.plan import ABOVE_DENSE, Plan, SitePlan
from sparsecc.kernels.sparse24_small import GEMM, GEMV, MMA, Sparse24GemvWeight
from sparsecc.planner.cost import CostModel, Decision

from conftest import n_m


def _choose_like_a_gpu(dtype, shape, m):
    """One row on the CUDA-core kernel, up to 32 on the tensor-core one, the GEMMs above."""
    return GEMV if m <= 1 else MMA if m <= 32 else GEMM


@pytest.mark.parametrize("lo, hi, expected", [
    (1, 512, (GEMV, 1)), (4, 512, (MMA, 32)), (32, 4096, (MMA, 32)), (8, 16, None), (64, 512, None),
    (1, 1, None)])
def test_the_small_tier_of_a_range(monkeypatch, lo, hi, expected):
    monkeypatch.setattr(by_rows, "choose", _choose_like_a_gpu)
    assert by_rows.small_tier(torch.float16, (256, 512), lo, hi) == expected


def _packed(gen, dense_above: bool):
    weight = n_m(48, 64, 2, 4, gen)
    small = Sparse24GemvWeight.pack(weight).running([])
    large = None if dense_above else Sparse24GemvWeight(weight[:, ::2].clone(), None, 48, 64, kernels="large table")
    return weight, by_rows.ByRowsWeight(small, 4, large, weight if dense_above else None)


@pytest.mark.parametrize("dense_above", [False, True])
def test_each_call_runs_the_tier_of_its_rows(monkeypatch, gen, dense_above):
    weight, packed = _packed(gen, dense_above)
    calls = []

    def kernel(x, values, metadata, n, k, bias, activation, x_transposed, transpose_out, kernels):
        calls.append((x.numel() // k, values, metadata, kernels))
        return x.new_zeros(*x.shape[:-1], n)

    monkeypatch.setattr(by_rows, "linear_kernel", kernel)
    bias = torch.randn(48, generator=gen)
    for rows in (1, 4, 5, 300):
        x = torch.randn(rows, 64, generator=gen)
        got = packed.op(x, *packed.tensors().values(), *packed.scalars().values(), bias, "relu", False, False,
                        *packed.extra_args)
        assert got.shape == (rows, 48)
        if rows <= 4:
            assert calls[-1][0] == rows and calls[-1][1] is packed.small.values and calls[-1][3] == packed.small.kernels
        elif dense_above:
            want = torch.relu(x.double() @ weight.double().t() + bias.double())
            assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5) and calls[-1][0] <= 4
        else:
            assert calls[-1][0] == rows and calls[-1][1] is packed.large.values and calls[-1][3] == "large table"
    assert packed.shape == (48, 64) and torch.equal(packed.to_dense(), weight)
    extra = weight.numel() * 4 if dense_above else packed.large.values.numel() * 4
    assert packed.nbytes == packed.small.nbytes + extra


def _decide_after_top(monkeypatch, top: Decision, low_us: dict) -> Decision:
    """``top`` after timings ``low_us`` at M = 1, where the small-batch kernel runs up to one row."""
    return CostModel("cpu", measure=False)._with_small_batches(top, ("the small-batch kernel", 1), 1, low_us)


def test_dense_at_the_top_but_2_4_at_the_low_end_runs_both(monkeypatch):
    decided = _decide_after_top(monkeypatch, Decision(DENSE, "dense stays at M=512", []), {NM_2_4: 40.0, DENSE: 60.0})
    assert decided.choice == NM_2_4 and decided.above == ABOVE_DENSE
    assert "2:4 up to M=1, dense above" in decided.reason and "dense stays at M=512" in decided.reason


def test_2_4_at_both_ends_keeps_the_gemms_above(monkeypatch):
    decided = _decide_after_top(monkeypatch, Decision(NM_2_4, "2:4 was timed fastest", []), {NM_2_4: 40.0, DENSE: 60.0})
    assert decided.choice == NM_2_4 and decided.above is None and "above on the GEMMs" in decided.reason


def test_2_4_not_ahead_at_the_low_end_leaves_the_choice(monkeypatch):
    for top in (Decision(DENSE, "dense stays", []), Decision(NM_2_4, "2:4 was timed fastest", [])):
        decided = _decide_after_top(monkeypatch, top, {NM_2_4: 59.0, DENSE: 60.0})
        assert decided.choice == top.choice and decided.above is None
        assert "2:4 on the small-batch kernel timed 59.0 us, dense 60.0 us" in decided.reason


def test_a_plan_keeps_above_through_json():
    site = SitePlan("w", "", [256, 512], "float16", 512, "none", 0.5, ["2:4"], {}, [], "2:4", "why", 1, 1,
                    m_range=[1, 512], above=ABOVE_DENSE)
    assert Plan.from_json(Plan([site], device="cuda").to_json()).sites[0].above == ABOVE_DENSE


def _group(gen, sizes=(48, 16, 16)):
    """Three members' weights and their group's packing: the stacked weight's small tier up to 4
    rows, the members' own weights above."""
    weights = [n_m(n, 64, 2, 4, gen) for n in sizes]
    stacked = by_rows.ByRowsWeight(Sparse24GemvWeight.pack(torch.cat(weights)).running([]), 4, None, torch.cat(weights))
    return weights, stacked.for_members(weights)


def test_a_group_shares_the_small_call_and_runs_each_members_weight_above(monkeypatch, gen):
    weights, packed = _group(gen)
    calls = []

    def kernel(x, values, metadata, n, k, bias, activation, x_transposed, transpose_out, kernels):
        calls.append((x.numel() // k, values, n))
        return torch.relu(x.double() @ packed.small.to_dense().double().t() + bias.double()).to(x.dtype)

    monkeypatch.setattr(by_rows, "linear_kernel", kernel)
    bias = torch.randn(80, generator=gen)
    for rows in (1, 4, 5, 300):
        x = torch.randn(rows, 64, generator=gen)
        got = packed.op(x, *packed.tensors().values(), *packed.scalars().values(), bias, "relu", False, False,
                        *packed.extra_args)
        assert [tuple(y.shape) for y in got] == [(rows, 48), (rows, 16), (rows, 16)]
        for y, w, b in zip(got, weights, bias.split([48, 16, 16])):
            want = torch.relu(x.double() @ w.double().t() + b.double())
            assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5), rows
        if rows <= 4:
            assert calls[-1] == (rows, packed.small.values, 80) and len(calls) == [1, 4].index(rows) + 1
        else:
            assert len(calls) == 2                        # the members' own weights: no kernel call
    assert all(mine is theirs for mine, theirs in zip(packed.tensors()["dense"], weights))     # no stacked copy
    assert packed.shape == (80, 64) and torch.equal(packed.to_dense(), torch.cat(weights))
    assert packed.nbytes == packed.small.nbytes + sum(w.numel() * 4 for w in weights)


def test_only_a_packing_whose_top_runs_dense_takes_the_members_weights(gen):
    weights, packed = _group(gen)
    with pytest.raises(ValueError, match="48 rows, the stacked one 80"):
        by_rows.ByRowsWeight(packed.small, 4, None, torch.cat(weights)).for_members(weights[:1])
    with pytest.raises(ValueError, match="top runs dense"):
        by_rows.ByRowsWeight(packed.small, 4, packed.small, None).for_members(weights)
