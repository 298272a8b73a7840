"""The kernels a GPU session needs: the fp16 candidates the tuning sweep measures, the
compressors, the other operand layouts the tests check, every launch the dispatch tables
name for the benchmark's shapes in both dtypes, and every small-batch tiling. Prebuilt into a cache (``python
benchmarks/kernel_set.py CACHE_DIR``), they cost the GPU machine no compile time."""
from __future__ import annotations

import sys

import torch

from sparsecc import gpu
from sparsecc.codegen import Family, KernelSpec, Scheduler

SHAPES = [(11008, 4096), (4096, 11008), (4096, 4096), (3072, 768), (768, 3072), (1024, 4096),
          (264, 1040), (4096, 1024)]


def session_specs(sweep=("float16", "bfloat16")) -> list[KernelSpec]:
    specs = []
    for name in sweep:
        candidates = gpu.candidate_specs(getattr(torch, name))
        specs += sorted(candidates, key=lambda s: s.scheduler is not Scheduler.STREAMK)   # slowest first
    specs += dispatched_specs(SHAPES)
    for family in (Family.SM90_SPARSE24, Family.SM90_DENSE):
        specs += [KernelSpec(family, "float16", x_transposed=True), KernelSpec(family, "float16", transpose_out=True)]
    for name in ("float16", "bfloat16"):          # the small-batch kernels: every tiling decode.py measures
        specs += [launch.spec for launch in gpu.gemv_candidates(getattr(torch, name)) + gpu.mma_candidates(getattr(torch, name))]
    return list(dict.fromkeys(specs))


def dispatched_specs(shapes) -> list[KernelSpec]:
    """What benchmarks/kernels.py runs without a sweep: the compressors and every launch the
    dispatch tables (2:4 and dense) name for these [N, K] shapes, in both dtypes."""
    specs = []
    for name in ("float16", "bfloat16"):
        dtype = getattr(torch, name)
        specs.append(KernelSpec(Family.SM90_COMPRESS24, name))
        for family in (Family.SM90_SPARSE24, Family.SM90_DENSE):
            for n, k in shapes:
                specs += [launch.spec for _, launch in gpu.dispatch(family, dtype, n, k)]
    return list(dict.fromkeys(specs))


def small_batch_session_specs() -> list[KernelSpec]:
    """What the small-batch tests and benchmarks/decode.py need: the compressors, every 2:4
    GEMM the tuning table names, every small-batch tiling (CUDA and tensor cores)."""
    from sparsecc import tuning
    specs = [KernelSpec(Family.SM90_COMPRESS24, name) for name in ("float16", "bfloat16")]
    for entry in tuning.table()["entries"]:
        if entry["family"] == Family.SM90_SPARSE24.value:
            specs += [KernelSpec(**dict(entry["spec"], dtype=name)) for name in ("float16", "bfloat16")]
    for name in ("float16", "bfloat16"):
        specs += [launch.spec for launch in gpu.gemv_candidates(getattr(torch, name)) + gpu.mma_candidates(getattr(torch, name))]
        for n, k in SHAPES:
            specs += [launch.spec for _, launch in gpu.dispatch(Family.SM90_SPARSE24, getattr(torch, name), n, k)]
    return list(dict.fromkeys(specs))


def csr_split_session_specs(shapes=SHAPES[:3], dtypes=("float16", "bfloat16")) -> list[KernelSpec]:
    """What a session on split unstructured weights needs, for one parallel build: the kernels
    tests/test_gpu_csr_split.py declares, and for ``shapes`` (kernels_csr.py --no-tiled) the
    compressors, the residual pass and the 2:4 GEMMs of the dispatch."""
    import importlib
    import os
    from sparsecc.csr_split import residual_spec
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    specs = list(importlib.import_module("test_gpu_csr_split").KERNELS)
    for name in dtypes:
        dtype = getattr(torch, name)
        specs += [KernelSpec(Family.SM90_COMPRESS24, name), residual_spec(dtype)]
        for n, k in shapes:
            specs += [launch.spec for _, launch in gpu.dispatch(Family.SM90_SPARSE24, dtype, n, k)]
    return list(dict.fromkeys(specs))


def dense_session_specs() -> list[KernelSpec]:
    """What ``kernels.py --dense-only`` sweeps and runs, in both dtypes: every candidate launch
    of the dense GEMM and the dense small-batch kernel, and the dense launches the dispatch
    tables name for the benchmark's shapes."""
    specs = []
    for name in ("float16", "bfloat16"):
        dtype = getattr(torch, name)
        specs += [launch.spec for family in (Family.SM90_DENSE, Family.GEMV_MMA_SM90_DENSE)
                  for launch in gpu.candidates(family, dtype)]
        specs += [launch.spec for n, k in SHAPES for _, launch in gpu.dispatch(Family.SM90_DENSE, dtype, n, k)]
    return list(dict.fromkeys(specs))


def named_session_specs(name: str | None) -> list[KernelSpec]:
    """The kernels of a session by gpu_session.sh's KERNELS: "small-batch", "csr-split",
    "dense", or anything else for :func:`session_specs`."""
    return {"small-batch": small_batch_session_specs, "csr-split": csr_split_session_specs,
            "dense": dense_session_specs}.get(name, session_specs)()


if __name__ == "__main__":
    from sparsecc.build import KernelCache, build
    specs = named_session_specs(sys.argv[2] if len(sys.argv) > 2 else None)
    print(len(specs), "kernels", flush=True)
    build(specs, cache=KernelCache(sys.argv[1]) if len(sys.argv) > 1 else None)
