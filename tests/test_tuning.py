"""The tuning table (sparsecc/tuning.py) and the dispatch built from it (sparsecc.gpu.dispatch):
the winner at the nearest measured shape, and a dense weight's small batches on whichever of
the CUTLASS GEMM and the small-batch kernel measured faster."""
import json

import pytest
import torch

from sparsecc import gpu, tuning
from sparsecc.codegen import Family, KernelSpec


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
