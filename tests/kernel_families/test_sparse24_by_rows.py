"""A 2:4 site planned over a batch range that spans the small-batch kernels and the GEMMs
(sparsecc.kernels.sparse24_by_rows), on any device: which small-batch family and row limit a
range gets, and what the planner makes of timings at both ends of the range
(sparsecc.planner.cost), also where a block-sparse format has a low-end tier too."""
import pytest
import torch

import sparsecc.kernels.sparse24_by_rows as by_rows
from sparsecc.ir.formats import DENSE, NM_2_4, FormatSpec
from sparsecc.ir.plan import ABOVE_DENSE, Plan, SitePlan
from sparsecc.kernels.sparse24_small import GEMM, GEMV, MMA
from sparsecc.planner.cost import CostModel, Decision


def _choose_like_a_gpu(dtype, shape, m):
    """One row on the CUDA-core kernel, up to 32 on the tensor-core one, the GEMMs above."""
    return GEMV if m <= 1 else MMA if m <= 32 else GEMM


@pytest.mark.parametrize("lo, hi, expected", [
    (1, 512, (GEMV, 1)), (4, 512, (MMA, 32)), (32, 4096, (MMA, 32)), (8, 16, None), (64, 512, None),
    (1, 1, None)])
def test_the_small_tier_of_a_range(monkeypatch, lo, hi, expected):
    monkeypatch.setattr(by_rows, "choose", _choose_like_a_gpu)
    assert by_rows.small_tier(torch.float16, (256, 512), lo, hi) == expected


def _decide_after_top(monkeypatch, top: Decision, low_us: dict, tiers=None) -> Decision:
    """``top`` after timings ``low_us`` at M = 1, where the small-batch kernel runs up to one row
    (or the low-end ``tiers`` given)."""
    tiers = tiers or {NM_2_4: ("the small-batch kernel", 1)}
    return CostModel("cpu", measure=False)._with_small_batches(top, tiers, 1, low_us)


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


BSR64 = FormatSpec.parse("bsr64x64")


def test_dense_at_the_top_but_blocks_at_the_low_end_run_both(monkeypatch):
    tiers = {BSR64: ("the BSR kernels", 16)}
    decided = _decide_after_top(monkeypatch, Decision(DENSE, "dense stays at M=512", []), {BSR64: 4.0, DENSE: 9.0},
                                tiers)
    assert decided.choice == BSR64 and decided.above == ABOVE_DENSE
    assert "bsr64x64 up to M=16, dense above" in decided.reason and "dense stays at M=512" in decided.reason
    decided = _decide_after_top(monkeypatch, Decision(BSR64, "bsr64x64 was timed fastest", []),
                                {BSR64: 4.0, DENSE: 9.0}, tiers)
    assert decided.choice == BSR64 and decided.above is None and "GEMMs" not in decided.reason
    decided = _decide_after_top(monkeypatch, Decision(DENSE, "dense stays", []), {BSR64: 8.9, DENSE: 9.0}, tiers)
    assert decided.choice == DENSE and "bsr64x64 on the BSR kernels timed 8.9 us, dense 9.0 us" in decided.reason


def test_the_fastest_format_at_the_low_end_takes_it(monkeypatch):
    tiers = {NM_2_4: ("the small-batch kernel", 1), BSR64: ("the BSR kernels", 16)}
    decided = _decide_after_top(monkeypatch, Decision(DENSE, "dense stays", []), {NM_2_4: 6.0, BSR64: 4.0, DENSE: 9.0},
                                tiers)
    assert decided.choice == BSR64 and decided.above == ABOVE_DENSE
    decided = _decide_after_top(monkeypatch, Decision(DENSE, "dense stays", []), {NM_2_4: 3.0, BSR64: 4.0, DENSE: 9.0},
                                tiers)
    assert decided.choice == NM_2_4 and "2:4 up to M=1, dense above" in decided.reason
