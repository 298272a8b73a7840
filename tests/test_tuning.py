"""The tuning table (sparsecc/tuning.py) and the dispatch built from it (sparsecc.gpu.dispatch):
the winner at the nearest measured shape, and a dense weight's small batches on whichever of
the CUTLASS GEMM and the small-batch kernel measured faster."""
import json

import pytest
import torch

from sparsecc import gpu, tuning
from sparsecc.codegen import Family, KernelSpec, Scheduler


def entry(launch: gpu.Launch, m: int, n: int, k: int, us: float) -> dict:
    return {"family": launch.spec.family.value, "dtype": launch.spec.dtype, "M": m, "N": n, "K": k, "us": us,
            "spec": json.loads(launch.spec.describe()), "swizzle": launch.swizzle, "splits": launch.splits}


GEMM = gpu.Launch(KernelSpec(Family.SM90_DENSE, "float16", tile=(128, 64, 64)))
WIDE = gpu.Launch(KernelSpec(Family.SM90_DENSE, "float16", tile=(128, 256, 64)), swizzle=8)
SMALL = gpu.Launch(KernelSpec(Family.GEMV_MMA_SM90_DENSE, "float16", tile=(4, 2, 1)), splits=4)


@pytest.fixture
def measured():
    """A table as a sweep writes it: at M=1 the small-batch kernel won, at M=128 the GEMM did."""
    rng = torch.Generator().manual_seed(0)
    fast, slow = sorted(float(v) for v in torch.rand(2, generator=rng) * 50 + 10)
    entries = [entry(GEMM, 1, 4096, 4096, slow), entry(SMALL, 1, 4096, 4096, fast),
               entry(GEMM, 128, 4096, 4096, fast), entry(SMALL, 128, 4096, 4096, slow),
               entry(WIDE, 8192, 4096, 4096, 100 * slow), entry(GEMM, 8192, 768, 3072, 10 * slow)]
    tuning.use({"entries": entries})
    yield
    tuning.use(None)


def test_the_nearest_measured_shape_wins(measured):
    launch, _ = tuning.best_entry(Family.SM90_DENSE, "float16", 8192, 4000, 4200)
    assert launch == WIDE
    launch, _ = tuning.best_entry(Family.SM90_DENSE, "float16", 8192, 800, 3000)
    assert launch == GEMM
    borrowed, _ = tuning.best_entry(Family.SM90_DENSE, "bfloat16", 8192, 4096, 4096)   # the other dtype's
    assert borrowed.spec == WIDE.spec.with_(dtype="bfloat16")
    assert tuning.best_entry(Family.SM90_DENSE, "float16", 2048, 4096, 4096) is None


def test_the_nearest_shape_wins_over_the_dtype_and_the_dtype_breaks_ties(measured):
    """A bf16 site of a shape measured only in fp16 takes that shape's tiling, not the tiling of
    a farther shape measured in bf16; where both dtypes measured a shape, its own entry wins."""
    own = gpu.Launch(KernelSpec(Family.SM90_DENSE, "bfloat16", tile=(128, 128, 64)))
    tuning.use({"entries": tuning.table()["entries"] + [entry(own, 8192, 768, 3072, 1.0),
                                                        entry(own, 8192, 11008, 4096, 1.0)]})
    nearest, _ = tuning.best_entry(Family.SM90_DENSE, "bfloat16", 8192, 4096, 4096)
    assert nearest.spec == WIDE.spec.with_(dtype="bfloat16")             # fp16's, at the same shape
    tied, _ = tuning.best_entry(Family.SM90_DENSE, "bfloat16", 8192, 768, 3072)
    assert tied == own                                                  # both measured it: bf16's own
    assert tuning.best_entry(Family.SM90_DENSE, "float16", 8192, 768, 3072)[0] == GEMM


def test_small_dense_batches_take_the_faster_family(measured):
    table = dict(gpu.dispatch(Family.SM90_DENSE, torch.float16, 4096, 4096))
    assert table[1] == SMALL and table[128] == GEMM and table[0] == WIDE
    assert table[16].spec.family is Family.GEMV_MMA_SM90_DENSE   # unmeasured small bucket: the default
    assert table[2048].spec.family is Family.SM90_DENSE


def test_without_measurements_small_dense_batches_use_the_small_batch_kernel():
    tuning.use({"entries": []})
    try:
        table = gpu.dispatch(Family.SM90_DENSE, torch.bfloat16, 1024, 4096)
    finally:
        tuning.use(None)
    families = {bound: launch.spec.family for bound, launch in table}
    assert families[1] is families[16] is Family.GEMV_MMA_SM90_DENSE
    assert families[128] is families[2048] is families[0] is Family.SM90_DENSE
    assert all(launch.spec.dtype == "bfloat16" for _, launch in table)


def test_tensor_core_small_batch_launches_fill_their_tiles_of_x():
    """The 2:4 tensor-core kernel's candidates for a batch take no 16-row tile of x it would leave
    half empty; without measurements, its buckets above 8 rows use the 16-row tile."""
    for m, tiles_of_x in ((1, {1}), (8, {1}), (9, {1, 2}), (64, {1, 2}), (None, {1, 2})):
        launches = gpu.mma_candidates(torch.float16, m)
        assert {launch.spec.tile[2] for launch in launches} == tiles_of_x, m
        assert {launch.splits for launch in launches} == set(gpu.CLUSTER_SPLITS) == {0, 1, 2}
    tuning.use({"entries": []})
    try:
        table = gpu.dispatch(Family.GEMV_MMA_SM90_SPARSE24, torch.float16, 4096, 4096)
    finally:
        tuning.use(None)
    assert {bound: launch.spec.tile[2] for bound, launch in table} == {1: 1, 8: 1, 16: 2, 32: 2, 64: 2, 0: 2}


def picked_families(entries, points):
    """gpu.small_batch_family (fp16) at each (m, shape) of ``points``, with ``entries`` as the tuning table."""
    tuning.use({"entries": entries})
    try:
        return {(m, shape): gpu.small_batch_family(m, torch.float16, *shape) for m, shape in points}
    finally:
        tuning.use(None)


def test_24_small_batches_take_the_tensor_core_kernel_where_it_measured_faster():
    """Above one row, a 2:4 site runs on the tensor-core small-batch kernel where the table has
    it faster than the 2:4 GEMM at the batch's bucket and the nearest shape, else on the GEMM;
    unmeasured, up to MMA_DEFAULT_MAX_M rows. One row with nothing measured at M = 1 is the
    CUDA-core kernel's, past MMA_MAX_M the GEMM's."""
    mma = gpu.Launch(KernelSpec(Family.GEMV_MMA_SM90_SPARSE24, "float16", tile=(8, 1, 2)), splits=0)
    gemm = gpu.Launch(KernelSpec(Family.SM90_SPARSE24, "float16", tile=(128, 64, 128)))
    rng = torch.Generator().manual_seed(1)
    fast, slow = sorted(float(v) for v in torch.rand(2, generator=rng) * 30 + 5)
    small, large = (768, 3072), (11008, 4096)
    family = picked_families([entry(mma, 16, *small, fast), entry(gemm, 16, *small, slow),
                              entry(mma, 16, *large, slow), entry(gemm, 16, *large, fast)],
                             [(m, shape) for m in (1, 4, 9, 16, 17, 65) for shape in (small, large, (800, 3000))])
    assert {family[1, s] for s in (small, large)} == {Family.GEMV_SM90_SPARSE24}
    assert family[9, small] is family[16, small] is family[16, (800, 3000)] is Family.GEMV_MMA_SM90_SPARSE24
    assert family[9, large] is family[16, large] is None                 # the GEMM measured faster
    assert family[4, large] is Family.GEMV_MMA_SM90_SPARSE24              # M = 8 unmeasured: the default
    assert family[17, small] is None and family[65, small] is None        # M = 32 unmeasured; past the kernel's range


def test_one_row_takes_the_tensor_core_kernel_only_where_it_measured_faster():
    """At M = 1 a 2:4 site runs on the CUDA-core small-batch kernel, unless the table has the
    tensor-core one faster at M = 1 and the nearest shape; a site of a shape nearer the other
    measurement, or with nothing measured, keeps the CUDA-core kernel."""
    mma = gpu.Launch(KernelSpec(Family.GEMV_MMA_SM90_SPARSE24, "float16", tile=(16, 1, 1)), splits=0)
    cuda_cores = gpu.Launch(KernelSpec(Family.GEMV_SM90_SPARSE24, "float16", tile=(8, 1, 1)))
    rng = torch.Generator().manual_seed(3)
    fast, slow = sorted(float(v) for v in torch.rand(2, generator=rng) * 30 + 5)
    large, small = (4096, 11008), (768, 3072)
    picked = picked_families([entry(mma, 1, *large, fast), entry(cuda_cores, 1, *large, slow),
                              entry(mma, 1, *small, slow), entry(cuda_cores, 1, *small, fast)],
                             [(1, shape) for shape in (large, small, (4096, 8192), (1024, 4096))])
    assert picked[1, large] is picked[1, (4096, 8192)] is Family.GEMV_MMA_SM90_SPARSE24
    assert picked[1, small] is picked[1, (1024, 4096)] is Family.GEMV_SM90_SPARSE24
    assert gpu.small_batch_family(1, torch.float16, *large) is not None    # the packaged table answers too


def test_a_launch_with_a_wrong_result_never_wins():
    """The fastest row per point becomes the entry, unless its result was wrong (relative error
    over the dtype's tolerance, or not measured): then the fastest right one does."""
    rng = torch.Generator().manual_seed(2)
    fastest, fast, slow = sorted(float(v) for v in torch.rand(3, generator=rng) * 40 + 5)

    def row(launch, us, rel_err, dtype="float16", impl="sparsecc-config"):
        return {"impl": impl, "M": 16, "N": 4096, "K": 4096, "dtype": dtype, "us": us, "rel_err": rel_err,
                "launch": {"spec": json.loads(launch.spec.describe()), "swizzle": launch.swizzle,
                           "splits": launch.splits}}
    rows = [row(SMALL, fastest, 0.5), row(GEMM, fast, 1e-4), row(WIDE, slow, 2e-4),
            row(SMALL, fastest, 5e-3, "bfloat16"), row(GEMM, slow, None, "bfloat16"),
            row(WIDE, fastest, 1e-4, impl="cublas")]
    found = {e["dtype"]: (e["spec"]["tile"], e["us"]) for e in tuning.winners(rows)}
    assert found == {"float16": ([128, 64, 64], fast), "bfloat16": ([4, 2, 1], fastest)}


def test_a_borrowed_small_batch_launch_leaves_the_cluster_size_to_the_kernel():
    """A tensor-core small-batch launch keeps its measured blocks per cluster at the shape it was
    measured at; at another shape it keeps the tiling and the kernel picks the cluster size
    (splits 0). A GEMM's splits (stream-K) are kept wherever they are borrowed."""
    mma = gpu.Launch(KernelSpec(Family.GEMV_MMA_SM90_SPARSE24, "float16", tile=(4, 2, 1)), splits=2)
    dense = gpu.Launch(KernelSpec(Family.GEMV_MMA_SM90_DENSE, "float16", tile=(8, 1, 2)), splits=4)
    streamk = gpu.Launch(KernelSpec(Family.SM90_SPARSE24, "float16", tile=(128, 64, 128),
                                    scheduler=Scheduler.STREAMK), splits=4)
    tuning.use({"entries": [entry(launch, 16, 11008, 4096, 20.0) for launch in (mma, dense, streamk)]})
    try:
        at = {(launch.spec.family, shape): tuning.best_entry(launch.spec.family, "float16", 16, *shape)[0]
              for launch in (mma, dense, streamk) for shape in ((11008, 4096), (8192, 2048))}
    finally:
        tuning.use(None)
    for launch in (mma, dense, streamk):
        assert at[launch.spec.family, (11008, 4096)] == launch
        borrowed = at[launch.spec.family, (8192, 2048)]
        assert borrowed.spec == launch.spec
        assert borrowed.splits == (0 if launch.spec.family.clustered else launch.splits)
