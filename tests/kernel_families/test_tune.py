"""Launch tuning (sparsecc.kernels.tune) and the dispatch tables built from it: what is measured
here wins, else the shipped table's nearest shape, else the family's default; tuning keeps the
fastest launch whose result is right, saves it atomically per machine, and SPARSECC_TUNE says
what is tuned. The timing itself is the GPU's (tests/kernel_families/test_tune_gpu.py); here a fake
family on the CPU and injected times stand in for it."""
import json
import logging
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from sparsecc.codegen.spec import Family, KernelSpec, Scheduler
from sparsecc.ir.formats import NM_2_4
from sparsecc.ir.plan import Plan
from sparsecc.kernels import base, tune
from sparsecc.kernels.base import Buckets, KernelFamily, KernelWeight, Launch
from sparsecc.kernels.dense import SMALL as DENSE_SMALL
from sparsecc.kernels.dense import DenseGemm
from sparsecc.kernels.sparse24_small import BULK_LAUNCHES, GEMM, GEMV, MMA, choose
from sparsecc.errors import KernelBuildError
from sparsecc.runtime.loader import KernelRunError

DENSE = DenseGemm()
GEMM_LAUNCH = Launch(KernelSpec(Family.SM90_DENSE, "float16", tile=(128, 64, 64)))
WIDE = Launch(KernelSpec(Family.SM90_DENSE, "float16", tile=(128, 256, 64)), swizzle=8)
SMALL = Launch(KernelSpec(Family.GEMV_MMA_SM90_DENSE, "float16", tile=(4, 2, 1)), splits=4)


def entry(launch: Launch, m: int, n: int, k: int, us: float) -> dict:
    return tune.entry(launch.spec.family, launch.spec.dtype, m, n, k, launch, us)


@pytest.fixture
def shipped():
    """A shipped table: at M=1 the small-batch kernel won, at M=128 the GEMM did."""
    def use(entries, path=None, key="test"):
        table = tune.TuningTable(entries, path, key)
        tune.use(table)
        return table
    yield use
    tune.use(None)


@pytest.fixture
def measured(shipped):
    rng = torch.Generator().manual_seed(0)
    fast, slow = sorted(float(v) for v in torch.rand(2, generator=rng) * 50 + 10)
    return shipped([entry(GEMM_LAUNCH, 1, 4096, 4096, slow), entry(SMALL, 1, 4096, 4096, fast),
                    entry(GEMM_LAUNCH, 128, 4096, 4096, fast), entry(SMALL, 128, 4096, 4096, slow),
                    entry(WIDE, 8192, 4096, 4096, 100 * slow), entry(GEMM_LAUNCH, 8192, 768, 3072, 10 * slow)])


def test_the_nearest_shipped_shape_wins(measured):
    launch, _, where = measured.best(Family.SM90_DENSE, "float16", 8192, 4000, 4200)
    assert launch == WIDE and where == "shipped table, nearest shape 4096x4096"
    assert measured.best(Family.SM90_DENSE, "float16", 8192, 800, 3000)[0] == GEMM_LAUNCH
    borrowed = measured.best(Family.SM90_DENSE, "bfloat16", 8192, 4096, 4096)    # the other dtype's
    assert borrowed[0].spec == WIDE.spec.with_(dtype="bfloat16") and borrowed[2] == "shipped table"
    assert measured.best(Family.SM90_DENSE, "float16", 2048, 4096, 4096) is None


def test_the_nearest_shape_wins_over_the_dtype_and_the_dtype_breaks_ties(measured, shipped):
    own = Launch(KernelSpec(Family.SM90_DENSE, "bfloat16", tile=(128, 128, 64)))
    table = shipped(measured.shipped + [entry(own, 8192, 768, 3072, 1.0), entry(own, 8192, 11008, 4096, 1.0)])
    assert table.best(Family.SM90_DENSE, "bfloat16", 8192, 4096, 4096)[0].spec == WIDE.spec.with_(dtype="bfloat16")
    assert table.best(Family.SM90_DENSE, "bfloat16", 8192, 768, 3072)[0] == own
    assert table.best(Family.SM90_DENSE, "float16", 8192, 768, 3072)[0] == GEMM_LAUNCH


def test_a_borrowed_small_batch_launch_leaves_the_cluster_size_to_the_kernel(shipped):
    """A tensor-core small-batch launch keeps its blocks per cluster at the shape it was measured
    at; at another shape the kernel picks them (splits 0). A GEMM's splits (stream-K) are kept."""
    mma = Launch(KernelSpec(Family.GEMV_MMA_SM90_SPARSE24, "float16", tile=(4, 2, 1)), splits=2)
    dense = Launch(KernelSpec(Family.GEMV_MMA_SM90_DENSE, "float16", tile=(8, 1, 2)), splits=4)
    streamk = Launch(KernelSpec(Family.SM90_SPARSE24, "float16", tile=(128, 64, 128), scheduler=Scheduler.STREAMK),
                     splits=4)
    table = shipped([entry(launch, 16, 11008, 4096, 20.0) for launch in (mma, dense, streamk)])
    for launch in (mma, dense, streamk):
        assert table.best(launch.spec.family, "float16", 16, 11008, 4096)[0] == launch
        borrowed = table.best(launch.spec.family, "float16", 16, 8192, 2048)[0]
        assert borrowed.spec == launch.spec
        assert borrowed.splits == (0 if launch.spec.family.clustered else launch.splits)


def test_small_dense_batches_take_the_faster_family(measured):
    table = dict(DENSE.dispatch(torch.float16, (4096, 4096)))
    assert table[1] == SMALL and table[128] == GEMM_LAUNCH and table[0] == WIDE
    assert table[16].spec.family is Family.GEMV_MMA_SM90_DENSE   # unmeasured small bucket: the default
    assert table[2048].spec.family is Family.SM90_DENSE


def test_without_measurements_small_dense_batches_use_the_small_batch_kernel(shipped):
    shipped([])
    families = {bound: launch.spec.family for bound, launch in DENSE.dispatch(torch.bfloat16, (1024, 4096))}
    assert families[1] is families[16] is Family.GEMV_MMA_SM90_DENSE
    assert families[128] is families[2048] is families[0] is Family.SM90_DENSE


def test_tensor_core_small_batch_launches_fill_their_tiles_of_x(shipped):
    """The 2:4 tensor-core kernel's candidates for a batch take no 16-row tile of x it would leave
    half empty; without measurements, its buckets above 8 rows use the 16-row tile."""
    for m, tiles_of_x in ((1, {1}), (8, {1}), (9, {1, 2}), (64, {1, 2})):
        launches = [launch for launch in MMA.candidates(torch.float16, (4096, 4096), m)
                    if launch.spec.family is Family.GEMV_MMA_SM90_SPARSE24]
        assert {launch.spec.tile[2] for launch in launches} == tiles_of_x, m
        assert {launch.splits for launch in launches} == {0, 1, 2}
    shipped([])
    table = MMA.dispatch(torch.float16, (4096, 4096))
    assert {bound: launch.spec.tile[2] for bound, launch in table} == {1: 1, 8: 1, 16: 2, 32: 2, 64: 2, 0: 2}


def test_the_bulk_copy_kernel_is_a_candidate_past_8_rows_where_k_is_whole_units():
    """Its tiles of x are the fewest 8-row tiles that hold the bucket's rows (one block reads each
    unit of W for all of them); a K that is no multiple of its 64-input units leaves it out."""
    bulk = Family.GEMV_MMA_BULK_SM90_SPARSE24
    for m, tiles_of_x in ((9, 2), (16, 2), (17, 4), (32, 4), (33, 8), (64, 8)):
        launches = [launch for launch in MMA.candidates(torch.bfloat16, (4096, 4096), m) if launch.spec.family is bulk]
        assert len(launches) == len(BULK_LAUNCHES), m
        assert {launch.spec.tile[1] for launch in launches} == {tiles_of_x} and 8 * tiles_of_x >= m
        assert all(launch.spec.dtype == "bfloat16" for launch in launches)
    for m, shape in ((8, (4096, 4096)), (32, (4096, 4112))):
        assert not any(launch.spec.family is bulk for launch in MMA.candidates(torch.float16, shape, m))
    assert bulk in MMA.templates


def test_a_borrowed_bulk_copy_launch_stays_off_a_k_it_cannot_run(shipped):
    """The nearest measured shape's bulk-copy launch serves an unseen shape whose K is whole units,
    and the default serves one whose K is not."""
    launch = Launch(KernelSpec(Family.GEMV_MMA_BULK_SM90_SPARSE24, "float16", tile=(4, 4, 4)), splits=2)
    shipped([tune.entry(MMA.templates[0], "float16", 32, 4096, 4096, launch, 9.0)])   # as tuning records it
    whole = dict(MMA.dispatch(torch.float16, (4096, 4608)))[32]
    assert whole.spec == launch.spec and whole.splits == 0         # a cluster size is the shape's own
    assert dict(MMA.dispatch(torch.float16, (4096, 4112)))[32] == MMA.default_launch("float16", 32)


def test_24_small_batches_take_the_tensor_core_kernel_where_it_measured_faster(shipped):
    """Above one row, a 2:4 site is packed for the tensor-core small-batch kernel where the table
    has it faster than the 2:4 GEMM at the batch's bucket and the nearest shape, else for the GEMM;
    unmeasured, up to MMA_DEFAULT_MAX_M rows. One row with nothing measured at M = 1 is the
    CUDA-core kernel's, past MMA_MAX_M the GEMM's."""
    mma = Launch(KernelSpec(Family.GEMV_MMA_SM90_SPARSE24, "float16", tile=(8, 1, 2)), splits=0)
    gemm = Launch(KernelSpec(Family.SM90_SPARSE24, "float16", tile=(128, 64, 128)))
    rng = torch.Generator().manual_seed(1)
    fast, slow = sorted(float(v) for v in torch.rand(2, generator=rng) * 30 + 5)
    small, large = (768, 3072), (11008, 4096)
    shipped([entry(mma, 16, *small, fast), entry(gemm, 16, *small, slow),
             entry(mma, 16, *large, slow), entry(gemm, 16, *large, fast)])
    family = {(m, s): choose(torch.float16, s, m) for m in (1, 4, 9, 16, 17, 65) for s in (small, large, (800, 3000))}
    assert {family[1, s] for s in (small, large)} == {GEMV}
    assert family[9, small] is family[16, small] is family[16, (800, 3000)] is MMA
    assert family[9, large] is family[16, large] is GEMM                # the GEMM measured faster
    assert family[4, large] is MMA                                      # M = 8 unmeasured: the default
    assert family[17, small] is GEMM and family[65, small] is GEMM     # M = 32 unmeasured; past the kernel's range
    assert choose(torch.float16, small, None) is GEMM


def test_one_row_takes_the_tensor_core_kernel_only_where_it_measured_faster(shipped):
    mma = Launch(KernelSpec(Family.GEMV_MMA_SM90_SPARSE24, "float16", tile=(16, 1, 1)), splits=0)
    cuda_cores = Launch(KernelSpec(Family.GEMV_SM90_SPARSE24, "float16", tile=(8, 1, 1)))
    rng = torch.Generator().manual_seed(3)
    fast, slow = sorted(float(v) for v in torch.rand(2, generator=rng) * 30 + 5)
    large, small = (4096, 11008), (768, 3072)
    shipped([entry(mma, 1, *large, fast), entry(cuda_cores, 1, *large, slow),
             entry(mma, 1, *small, slow), entry(cuda_cores, 1, *small, fast)])
    assert choose(torch.float16, large, 1) is choose(torch.float16, (4096, 8192), 1) is MMA
    assert choose(torch.float16, small, 1) is choose(torch.float16, (1024, 4096), 1) is GEMV


def test_the_shipped_table_answers_for_the_six_benchmark_shapes():
    """The packaged table holds launches for every small-batch bucket of the benchmark shapes but
    the 2:4 GEMM's 96-row one, which it predates: that bucket runs the 128-row bucket's launch."""
    table = tune.TuningTable(tune.shipped_entries())
    for family in (GEMM, MMA):
        for _, m in family.buckets:
            found = table.best(family.templates[0], "float16", m, 11008, 4096)
            if (family, m) == (GEMM, 96):
                assert found is None
                continue
            assert found is not None and found[0].spec.family is family.templates[0], (family, m)
    tune.use(table)
    try:
        dispatch = dict(GEMM.dispatch(torch.float16, (11008, 4096)))
    finally:
        tune.use(None)
    assert dispatch[96] == dispatch[128] == table.best(Family.SM90_SPARSE24, "float16", 128, 11008, 4096)[0]


def test_buckets_cover_every_batch_once():
    buckets = Buckets((1, 8, 16, 64), 64)
    assert list(buckets) == [(1, 1), (8, 8), (16, 16), (64, 64), (0, 64)]
    assert [buckets.bound_for(m) for m in (1, 2, 8, 9, 64, 65, 10_000)] == [1, 8, 8, 16, 64, 0, 0]
    assert buckets.meeting(1, 1) == [(1, 1)]
    assert buckets.meeting(9, 9) == [(16, 16)]
    assert buckets.meeting(2, 20) == [(8, 8), (16, 16), (64, 64)]
    assert buckets.meeting(100, 200) == [(0, 64)]
    with pytest.raises(ValueError):
        Buckets((3, 1), 8)


# ---------------------------------------------------------------- tuning itself, with a fake family

@dataclass
class FakeWeight(KernelWeight):
    """A weight whose op computes with the launch its dispatch names: its 128x256 tile adds one
    to the last output feature (a wrong result), the others are right."""

    @staticmethod
    def op(x, values, metadata, out_features, in_features, bias, activation, x_transposed, transpose_out, kernels):
        y = F.linear(x, values)
        if "_t128x256x64" in kernels:
            y = y.clone()
            y[:, -1] += 1.0
        return y


def computing(product):
    """A FakeWeight whose op returns ``product(x, values, kernels)`` (the launch's symbols)."""

    class Weight(FakeWeight):
        @staticmethod
        def op(x, values, metadata, out_features, in_features, bias, activation, x_transposed, transpose_out,
               kernels):
            return product(x, values, kernels)

    return Weight


class FakeFamily(KernelFamily):
    name = "fake"
    kind = "dense"
    templates = (Family.SM90_DENSE,)
    unit = "a fake kernel"
    tunable = True
    buckets = Buckets((1, 16), 16)
    launches = [Launch(KernelSpec(Family.SM90_DENSE, "float16", tile=tile))
                for tile in ((128, 64, 64), (128, 128, 64), (128, 256, 64))]

    def candidates(self, dtype, shape, m):
        return self.launches

    def default_launch(self, dtype, bound):
        return self.launches[0]

    def layout(self, weight):
        return FakeWeight(weight, None, *weight.shape)

    def tuning_weight(self, n, k, dtype, device, generator):
        return torch.randn(n, k, generator=generator, dtype=torch.float32).to(dtype)


@pytest.fixture
def tunable(monkeypatch, tmp_path):
    """Tuning on the CPU: kernels 'available', nothing built, a fresh table in a temporary cache."""
    monkeypatch.setattr(tune, "kernels_unavailable", lambda device: None)
    monkeypatch.setattr(tune, "ensure", lambda specs, progress=True: {})
    monkeypatch.setattr(tune, "_TUNED_THIS_PROCESS", set())
    table = tune.TuningTable([], tmp_path / "tuning" / "here.json", "test-machine")
    tune.use(table)
    yield table
    tune.use(None)


def test_tuning_keeps_the_fastest_launch_whose_result_is_right(tunable, monkeypatch):
    """The fastest launch computed a wrong result: it is left out with a warning, and the fastest
    right one is recorded, logged and saved."""
    family = FakeFamily()
    wrong, slow, fast = family.launches[2], family.launches[0], family.launches[1]
    times = {wrong: 1.0, slow: 9.0, fast: 4.0}
    before = len(tune.LOG)
    found = tune.tune_bucket(family, torch.float16, (64, 128), 16, device="cpu", progress=False,
                             measure=lambda launch, run: times[launch])
    assert Launch.from_description(found) == fast and found["us"] == 4.0 and found["M"] == 16
    assert tunable.measured_here(Family.SM90_DENSE, "float16", 16, 64, 128) == found
    logged = tune.log_since(before)
    assert [(t["family"], t["m"], t["us"], t["candidates"]) for t in logged] == [("fake", 16, 4.0, 3)]
    saved = json.loads(tunable.path.read_text())
    assert saved["key"] == "test-machine" and saved["entries"] == [found]
    assert not list(tunable.path.parent.glob("*.tmp*"))       # published by a rename, nothing left over


def test_a_buckets_fewest_rows_are_one_past_the_bucket_below():
    from sparsecc.kernels.sparse24 import Sparse24Gemm
    gemm = Sparse24Gemm()                                     # buckets 1, 16, 32, 64, ..., 2048, open at 8192
    assert [tune.fewest_rows(gemm, m) for m in (1, 16, 32, 64, 2048, 8192)] == [None, 2, 17, 33, 129, 2049]
    assert tune.fewest_rows(FakeFamily(), 16) == 2 and tune.fewest_rows(FakeFamily(), 1) is None


def test_a_launch_slow_at_its_buckets_fewest_rows_loses_to_one_fast_at_both_ends(tunable):
    """At 16 rows (the bucket's most) one launch is 4% faster than the runner-up, at 2 (its fewest)
    44% slower than the fastest there: the runner-up (4% and 11% behind) wins, recorded with its
    time at 16 rows. The fastest at 2 rows, 25% behind at 16, stays out; 9% behind, it wins."""
    family = FakeFamily()
    edgy, steady, slow = family.launches[0], family.launches[1], family.launches[2]
    right = computing(lambda x, values, kernels: F.linear(x, values))
    family.layout = lambda weight: right(weight, None, *weight.shape)
    times = {16: {edgy: 9.6, steady: 10.0, slow: 12.0}, 2: {edgy: 13.0, steady: 10.0, slow: 9.0}}
    seen = []

    def measure(launch, run):
        seen.append((launch, run.x.shape[0]))
        return times[run.x.shape[0]][launch]

    found = tune.tune_bucket(family, torch.float16, (64, 128), 16, device="cpu", progress=False, measure=measure)
    assert Launch.from_description(found) == steady and found["us"] == 10.0
    assert sorted(rows for _, rows in seen) == [2] * 3 + [16] * 3      # FINALISTS = 3: all three again at 2
    times[16][slow] = 10.5
    tunable.here.clear()
    found = tune.tune_bucket(family, torch.float16, (64, 128), 16, device="cpu", progress=False, measure=measure)
    assert Launch.from_description(found) == slow


def test_a_launch_wrong_at_its_buckets_fewest_rows_is_left_out(tunable, caplog):
    family = FakeFamily()
    fast, other = family.launches[0], family.launches[1]
    family.launches = [fast, other]
    wrong_with_few_rows = computing(lambda x, values, kernels:
                                    F.linear(x, values) + (1.0 if x.shape[0] < 16 and "_t128x64x64" in kernels else 0.0))
    family.layout = lambda weight: wrong_with_few_rows(weight, None, *weight.shape)
    times = {fast: 1.0, other: 5.0}
    with caplog.at_level(logging.WARNING, logger="sparsecc"):
        found = tune.tune_bucket(family, torch.float16, (64, 128), 16, device="cpu", progress=False,
                                 measure=lambda launch, run: times[launch])
    assert Launch.from_description(found) == other and found["us"] == 5.0
    assert "wrong result at M=2" in caplog.text


def test_no_right_launch_records_nothing(tunable):
    family = FakeFamily()
    family.launches = [family.launches[2]]                   # only the wrong one
    assert tune.tune_bucket(family, torch.float16, (64, 128), 1, device="cpu", progress=False,
                            measure=lambda launch, run: 1.0) is None
    assert tunable.here == {}


def test_tune_modes(tunable, monkeypatch):
    """new: tune the buckets without a measurement here; all: tune again, once per process;
    off: never."""
    calls = []
    monkeypatch.setattr(tune, "tune_bucket", lambda family, dtype, shape, m, **kw: calls.append(m))
    tunable.record([entry(GEMM_LAUNCH, 1, 64, 128, 3.0)])
    family = FakeFamily()
    monkeypatch.setenv("SPARSECC_TUNE", "off")
    tune.ensure_tuned(family, torch.float16, (64, 128), [1, 16], device="cpu")
    assert calls == []
    monkeypatch.setenv("SPARSECC_TUNE", "new")
    tune.ensure_tuned(family, torch.float16, (64, 128), [1, 16], device="cpu")
    assert calls == [16]                                       # M = 1 was measured here
    monkeypatch.setenv("SPARSECC_TUNE", "all")
    tune.ensure_tuned(family, torch.float16, (64, 128), [1, 16], device="cpu")
    tune.ensure_tuned(family, torch.float16, (64, 128), [1, 16], device="cpu")
    assert calls == [16, 1]                                    # 16 was tuned in this process already
    monkeypatch.setenv("SPARSECC_TUNE", "sometimes")
    with pytest.raises(Exception, match="SPARSECC_TUNE"):
        tune.ensure_tuned(family, torch.float16, (64, 128), [4], device="cpu")


def test_nothing_is_tuned_where_the_kernels_cannot_run(monkeypatch):
    calls = []
    monkeypatch.setattr(tune, "tune_bucket", lambda *a, **kw: calls.append(a))
    tune.ensure_tuned(FakeFamily(), torch.float16, (64, 128), [1], device="cpu")
    assert calls == []


def test_kernels_that_cannot_be_built_are_warned_of_once_per_family(tunable, monkeypatch, caplog):
    """A machine without a CUDA compiler fails to build every bucket's candidates: one warning,
    the rest at INFO, and each bucket falls back to the shipped table."""
    def unbuildable(family, dtype, shape, m, **kw):
        raise KernelBuildError(f"3 kernels are not in the kernel directories (M={m}): nvcc was not found")
    monkeypatch.setattr(tune, "tune_bucket", unbuildable)
    monkeypatch.setattr(tune, "_UNBUILT_WARNED", set())
    with caplog.at_level(logging.INFO, logger="sparsecc"):
        tune.ensure_tuned(FakeFamily(), torch.float16, (64, 128), [1, 16], device="cpu")
        tune.ensure_tuned(FakeFamily(), torch.float16, (256, 128), [1], device="cpu")
    unbuilt = [r for r in caplog.records if "did not build" in r.getMessage()]
    assert [r.levelno for r in unbuilt] == [logging.WARNING, logging.INFO, logging.INFO]
    assert "nvcc was not found" in unbuilt[0].getMessage() and "logged at INFO" in unbuilt[0].getMessage()
    assert tunable.here == {}


def test_dispatch_takes_what_was_tuned_here(tunable, monkeypatch):
    """A tuned bucket's launch replaces the shipped one; the others keep theirs."""
    family = FakeFamily()
    times = {launch: float(i + 1) for i, launch in enumerate(family.launches)}
    monkeypatch.setenv("SPARSECC_TUNE", "new")
    monkeypatch.setattr(tune, "tune_bucket", lambda fam, dtype, shape, m, **kw: tune.TuningTable.record(
        tunable, [entry(family.launches[1], m, *shape, times[family.launches[1]])]))
    table = tune.dispatch(family, torch.float16, (64, 128), tune_range=(2, 8))
    assert dict(table) == {1: family.launches[0], 16: family.launches[1], 0: family.launches[1]}   # open: at M = 16


def test_two_processes_saving_keep_both_tables_entries(tmp_path):
    path = tmp_path / "t.json"
    first, second = tune.TuningTable([], path, "k"), tune.TuningTable([], path, "k")
    first.record([entry(GEMM_LAUNCH, 1, 64, 128, 3.0)])
    second.record([entry(WIDE, 16, 64, 128, 5.0)])
    again = tune.TuningTable([], path, "k")
    assert set(again.here) == {("gemm_sm90_dense", "float16", 1, 64, 128), ("gemm_sm90_dense", "float16", 16, 64, 128)}
    assert tune.TuningTable([], path, "another machine").here == {}      # another key: not ours


def test_an_unreadable_table_is_ignored_with_a_warning(tmp_path, caplog):
    path = tmp_path / "t.json"
    path.write_text("{ not json")
    with caplog.at_level("WARNING", logger="sparsecc"):
        assert tune.TuningTable([], path, "k").here == {}
    assert "unreadable tuning table" in caplog.text


def test_the_plan_reports_what_was_tuned():
    plan = Plan([], device="cuda", tuning=[{"family": "sparse24-mma", "dtype": "float16", "n": 4096, "k": 11008,
                                             "m": 16, "launch": "sparsecc_x:1:0", "us": 12.5, "candidates": 45,
                                             "seconds": 1.25}])
    assert "tuned on this GPU: 1 launch choice(s) in 1.2 s" in plan.table()
    assert "sparse24-mma 4096x11008 float16 M=16: sparsecc_x:1:0 12.5 us (45 candidates, 1.2 s)" in plan.table()
    assert Plan.from_json(plan.to_json()).tuning == plan.tuning


def test_families_describe_themselves_consistently():
    """Every tunable family lists candidates of its own template and a default per bucket."""
    for family in (GEMM, GEMV, MMA, DENSE, DENSE_SMALL):
        for bound, m in family.buckets:
            default = family.default_launch("float16", bound)
            assert default.spec.family is family.templates[0]
            launches = family.candidates(torch.float16, (4096, 4096), m)
            assert launches and all(launch.spec.family in family.templates for launch in launches)
    assert base.launch_for(GEMM.dispatch(torch.float16, (4096, 4096)), 3000).spec.family is Family.SM90_SPARSE24
    assert GEMM.refuses(NM_2_4, (4096, 4100), torch.float16) is not None


def test_a_launch_that_declines_the_shape_is_left_out(tunable, caplog):
    """A kernel that refuses its arguments (CUTLASS's can_implement, say) costs its candidacy, not
    the whole tuning: the others are timed and the fastest right one recorded."""
    family = FakeFamily()
    declining, slow, fast = family.launches[2], family.launches[0], family.launches[1]

    def product(x, values, kernels):
        if "_t128x256x64" in kernels:
            raise KernelRunError("can_implement failed: Error Misaligned Operand")
        return F.linear(x, values)

    declining_weight = computing(product)
    family.layout = lambda weight: declining_weight(weight, None, *weight.shape)
    times = {declining: 1.0, slow: 9.0, fast: 4.0}
    with caplog.at_level(logging.WARNING, logger="sparsecc"):
        found = tune.tune_bucket(family, torch.float16, (64, 128), 16, device="cpu", progress=False,
                                 measure=lambda launch, run: times[launch])
    assert Launch.from_description(found) == fast
    assert "does not run" in caplog.text and declining.label in caplog.text


def test_a_launch_is_held_to_its_familys_reference_with_its_runner_arguments(tunable):
    """A family whose product is not the weight's plain one (a quantized weight's) gives tuning its
    reference, the arguments its op takes where a site passes its own, and the inputs' dtype
    through its launches: the launch right by that reference wins, the plain product is wrong."""
    family = FakeFamily()
    plain, halved = family.launches[0], family.launches[1]
    calls = []

    class Scaled(FakeWeight):
        def runner_args(self):
            return (torch.full((self.out_features,), 0.5),)

        @staticmethod
        def op(x, values, metadata, scale, out_features, in_features, bias, activation, x_transposed, transpose_out,
               kernels):
            calls.append(x.dtype)
            y = F.linear(x.float(), values.float())
            return y * scale if "_t128x128x64" in kernels else y

    family.layout = lambda weight: Scaled(weight, None, *weight.shape)
    family.tuning_weight = lambda n, k, dtype, device, generator: torch.randn(n, k, generator=generator)   # fp32
    family.reference = lambda x, weight: F.linear(x.float(), weight.float()) * 0.5
    family.launches = [plain, halved]
    found = tune.tune_bucket(family, torch.float16, (64, 128), 16, device="cpu", progress=False,
                             measure=lambda launch, run: 1.0)
    assert Launch.from_description(found) == halved
    assert set(calls) == {torch.float16}                 # the launches' dtype, not the packed weight's
