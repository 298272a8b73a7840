"""The kernels a GPU session needs: the fp16 candidates the tuning sweep measures, the
compressors, the other operand layouts the tests check, every launch the dispatch tables
name for the benchmark's shapes in both dtypes, and every small-batch tiling. Prebuilt into a cache (``python
benchmarks/kernel_set.py CACHE_DIR``), they cost the GPU machine no compile time.

The dispatch tables are the shipped tuning table's (sparsecc/kernels/tuning.json), the ones
the benchmarks measure (they run with SPARSECC_TUNE=off and without this machine's tuned
launches: common.fixed_dispatch)."""
from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

import torch

from sparsecc.codegen.spec import CSR_CAPACITIES, Family, KernelSpec, Scheduler
from sparsecc.kernels import csr, tune
from sparsecc.kernels.base import KernelFamily
from sparsecc.kernels.csr_split import residual_spec
from sparsecc.kernels.dense import SMALL as DENSE_SMALL
from sparsecc.kernels.dense import DenseGemm
from sparsecc.kernels.sparse24_small import GEMM, GEMV, MMA

SHAPES = [(11008, 4096), (4096, 11008), (4096, 4096), (3072, 768), (768, 3072), (1024, 4096),
          (264, 1040), (4096, 1024)]
DENSE_GEMM = DenseGemm()
TESTS = Path(__file__).resolve().parent.parent / "tests"


@contextlib.contextmanager
def shipped_table():
    """Dispatch tables from the shipped tuning table alone while in the block (what the
    benchmarks run), whatever this machine tuned."""
    previous = tune._override
    tune.use(tune.TuningTable(tune.shipped_entries()))
    try:
        yield
    finally:
        tune.use(previous)


def candidates(family: KernelFamily, dtype: torch.dtype, shapes=SHAPES) -> list[KernelSpec]:
    """The kernels of every launch tuning may time for ``family`` (any of these shapes, any bucket)."""
    return list(dict.fromkeys(launch.spec for shape in shapes for _, m in family.buckets
                              for launch in family.candidates(dtype, shape, m)))


def dispatch_specs(family: KernelFamily, dtype: torch.dtype, shapes) -> list[KernelSpec]:
    """The kernels ``family``'s dispatch tables name for these [N, K] shapes (the shipped table)."""
    with shipped_table():
        return list(dict.fromkeys(launch.spec for shape in shapes for _, launch in family.dispatch(dtype, shape)))


def small_batch_specs(dtype: torch.dtype) -> list[KernelSpec]:
    """Every tiling of the two small-batch 2:4 kernels (CUDA and tensor cores) that
    benchmarks/decode.py measures."""
    return candidates(GEMV, dtype) + candidates(MMA, dtype)


def session_specs(sweep=("float16", "bfloat16")) -> list[KernelSpec]:
    specs = []
    for name in sweep:
        dtype = getattr(torch, name)
        swept = [s for family in (GEMM, DENSE_GEMM, DENSE_SMALL) for s in candidates(family, dtype)]
        specs += sorted(dict.fromkeys(swept), key=lambda s: s.scheduler is not Scheduler.STREAMK)   # slowest first
    specs += dispatched_specs(SHAPES)
    for family in (Family.SM90_SPARSE24, Family.SM90_DENSE):
        specs += [KernelSpec(family, "float16", x_transposed=True), KernelSpec(family, "float16", transpose_out=True)]
    for name in ("float16", "bfloat16"):          # the small-batch kernels: every tiling decode.py measures
        specs += small_batch_specs(getattr(torch, name))
    return list(dict.fromkeys(specs))


def dispatched_specs(shapes) -> list[KernelSpec]:
    """What benchmarks/kernels_gemm.py runs without a sweep: the compressors and every launch the
    dispatch tables (2:4 and dense) name for these [N, K] shapes, in both dtypes."""
    specs = []
    for name in ("float16", "bfloat16"):
        dtype = getattr(torch, name)
        specs.append(KernelSpec(Family.SM90_COMPRESS24, name))
        for family in (GEMM, DENSE_GEMM):
            specs += dispatch_specs(family, dtype, shapes)
    return list(dict.fromkeys(specs))


def small_batch_session_specs() -> list[KernelSpec]:
    """What the small-batch tests and benchmarks/decode.py need: the compressors, every 2:4
    GEMM the shipped tuning table names, every small-batch tiling (CUDA and tensor cores)."""
    specs = [KernelSpec(Family.SM90_COMPRESS24, name) for name in ("float16", "bfloat16")]
    for entry in tune.shipped_entries():
        if entry["family"] == Family.SM90_SPARSE24.value:
            specs += [KernelSpec(**dict(entry["spec"], dtype=name)) for name in ("float16", "bfloat16")]
    for name in ("float16", "bfloat16"):
        dtype = getattr(torch, name)
        specs += small_batch_specs(dtype)
        specs += dispatch_specs(GEMM, dtype, SHAPES)
    return list(dict.fromkeys(specs))


def declared_test_kernels(module: str) -> list[KernelSpec]:
    """The ``KERNELS`` a test module under tests/ declares (e.g.
    ``"kernel_families.test_csr_split_gpu"``: tests/ is where its own imports resolve)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    return list(importlib.import_module(module).KERNELS)


def csr_split_session_specs(shapes=SHAPES[:3], dtypes=("float16", "bfloat16")) -> list[KernelSpec]:
    """What a session on split unstructured weights needs, for one parallel build: the kernels
    tests/kernel_families/test_csr_split_gpu.py declares, and for ``shapes`` (kernels_csr.py --no-tiled)
    the compressors, the residual pass and the 2:4 GEMMs of the dispatch."""
    specs = declared_test_kernels("kernel_families.test_csr_split_gpu")
    for name in dtypes:
        dtype = getattr(torch, name)
        specs += [KernelSpec(Family.SM90_COMPRESS24, name), residual_spec(dtype)]
        specs += dispatch_specs(GEMM, dtype, shapes)
    return list(dict.fromkeys(specs))


def dense_session_specs() -> list[KernelSpec]:
    """What ``kernels_gemm.py --dense-only`` sweeps and runs, in both dtypes: every candidate launch
    of the dense GEMM and the dense small-batch kernel, and the dense launches the dispatch
    tables name for the benchmark's shapes."""
    specs = []
    for name in ("float16", "bfloat16"):
        dtype = getattr(torch, name)
        specs += candidates(DENSE_GEMM, dtype) + candidates(DENSE_SMALL, dtype)
        specs += dispatch_specs(DENSE_GEMM, dtype, SHAPES)
    return list(dict.fromkeys(specs))


def sparse24_tuning_session_specs() -> list[KernelSpec]:
    """What tuning 2:4 weights of any shape at any batch times (unseen_shapes.py): the compressors
    and every candidate of the 2:4 GEMM and of both small-batch kernels, both dtypes."""
    specs = []
    for name in ("float16", "bfloat16"):
        dtype = getattr(torch, name)
        specs += ([KernelSpec(Family.SM90_COMPRESS24, name)] + candidates(GEMM, dtype) + candidates(MMA, dtype)
                  + candidates(GEMV, dtype))
    return list(dict.fromkeys(specs))


def fp8_24_session_specs() -> list[KernelSpec]:
    """What the FP8 2:4 GEMM's tests and kernels_fp8.py run: the e4m3 compressor and its launches."""
    return declared_test_kernels("kernel_families.test_sparse24_fp8_gpu")


def unstructured_session_specs() -> list[KernelSpec]:
    """What the bitmap kernel's tests and ``kernels_csr.py --tiled-only`` run: every bitmap kernel
    (both tiles of x's rows, every capacity, both dtypes) and the tiled CSR kernels' dispatch at
    every capacity."""
    specs = declared_test_kernels("kernel_families.test_bitmap_gpu")
    for dtype in (torch.float16, torch.bfloat16):
        specs += [launch.spec for capacity in CSR_CAPACITIES for _, launch in csr.dispatch(dtype, capacity)]
    return list(dict.fromkeys(specs))


def named_session_specs(name: str | None) -> list[KernelSpec]:
    """The kernels of a session by gpu_session.sh's KERNELS: "small-batch", "csr-split",
    "dense", "tune-24", "fp8-24", "unstructured", or anything else for :func:`session_specs`."""
    return {"small-batch": small_batch_session_specs, "csr-split": csr_split_session_specs,
            "dense": dense_session_specs, "tune-24": sparse24_tuning_session_specs,
            "fp8-24": fp8_24_session_specs, "unstructured": unstructured_session_specs}.get(name, session_specs)()


def main(argv=None) -> None:
    import argparse
    from sparsecc.runtime.build import KernelCache, build
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cache", nargs="?", help="the kernel cache to build into (default: sparsecc's)")
    parser.add_argument("name", nargs="?", help="the session's kernels: small-batch, csr-split, dense, tune-24, fp8-24, "
                                                "unstructured (default: session_specs)")
    args = parser.parse_args(argv)
    specs = named_session_specs(args.name)
    print(len(specs), "kernels", flush=True)
    build(specs, cache=KernelCache(args.cache) if args.cache else None)


if __name__ == "__main__":
    main()
