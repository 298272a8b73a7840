"""Cost model v0: exact candidates only, honest CPU choices, forced formats, buckets."""
import torch

from sparsecc.analysis import analyze
from sparsecc.cost import BUCKETS, CostModel, exact_candidates, format_nbytes
from sparsecc.formats import FormatSpec, pack

from conftest import block_sparse, n_m, unstructured


def specs(stats, allowed=None):
    return [str(s) for s in exact_candidates(stats, allowed)]


def test_candidates_are_exactly_the_fitting_formats(gen):
    stats = analyze(n_m(64, 128, 2, 4, gen))
    found = specs(stats)
    assert found[0] == "dense" and "2:4" in found and "csr" in found
    stats = analyze(unstructured(64, 128, 0.9, gen))
    assert specs(stats) == ["dense"]                       # too dense for any sparse format
    assert specs(stats, [FormatSpec.parse("2:4")]) == ["dense"]
    stats = analyze(block_sparse(64, 128, (32, 32), 0.25, gen))
    assert "bsr32x32" in specs(stats) and "bsr16x16" in specs(stats)
    assert specs(stats, [FormatSpec.parse("bsr")]) == ["dense"] + [f"bsr{h}x{w}" for h, w in stats.block_density]


def test_nbytes_prediction_matches_packing(gen):
    for weight, spec in [(n_m(32, 64, 2, 4, gen), "2:4"), (unstructured(32, 64, 0.2, gen), "csr"),
                         (block_sparse(64, 64, (16, 16), 0.3, gen), "bsr16")]:
        stats = analyze(weight)
        assert format_nbytes(stats, FormatSpec.parse(spec), 4) == pack(weight, spec).nbytes


def test_forced_format_wins_whatever_the_prediction(gen):
    stats = analyze(n_m(8, 8, 2, 4, gen))
    decision = CostModel("cpu", measure=False).decide(stats, 1, [FormatSpec.parse("2:4")])
    assert str(decision.choice) == "2:4" and "restricts" in decision.reason


def test_dense_stays_when_sparse_cannot_win(gen):
    stats = analyze(n_m(64, 64, 2, 4, gen))           # 50% dense: CPU n:m runs as unpack + dense
    decision = CostModel("cpu", measure=False).decide(stats, 64, None)
    assert str(decision.choice) == "dense" and "dense is fastest" in decision.reason
    assert {p.format for p in decision.candidates} >= {"dense", "2:4", "csr"}


def test_cpu_sparse_choice_is_confirmed_by_measurement(gen):
    weight = unstructured(2048, 2048, 0.01, gen)
    stats = analyze(weight)
    model = CostModel("cpu")
    timings = []

    def fake_measure(spec, m):
        timings.append(str(spec))
        return 1.0 if spec.kind == "dense" else 5.0      # pretend sparse lost on this machine

    decision = model.decide(stats, 256, None, measure_site=fake_measure)
    assert timings and str(decision.choice) == "dense" and "measured slower" in decision.reason
    decision = model.decide(stats, 256, None, measure_site=lambda spec, m: 5.0 if spec.kind == "dense" else 1.0)
    assert decision.choice.kind != "dense" and "measured faster" in decision.reason


def test_unsupported_dtype_and_buckets(gen):
    stats = analyze(n_m(16, 16, 2, 4, gen).double())
    decision = CostModel("cpu").decide(stats, 8, None)
    assert str(decision.choice) == "dense" and "float64 is not supported" in decision.reason
    decision = CostModel("cpu", measure=False).decide(analyze(unstructured(64, 64, 0.05, gen)), None, None)
    assert "M not observed" in decision.reason
    assert [(b["m_lo"], b["m_hi"]) for b in decision.buckets] == list(BUCKETS)
    assert all(b["best"] in b["predicted_us"] for b in decision.buckets)


def test_cuda_profile_keeps_torch_fallbacks_dense(gen):
    """Until sparsecc's own kernels are there, CUDA sparse paths are torch's and lose."""
    stats = analyze(n_m(4096, 4096, 2, 4, gen))
    decision = CostModel("cuda", measure=False).decide(stats, 2048, None)
    assert str(decision.choice) == "dense"
