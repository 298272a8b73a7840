"""Small batches (decode), linear + bias + ReLU on the GPU, side by side in one process:

- ``cublas``: torch ``F.linear`` then ``relu`` (the baseline),
- ``sparsecc-gemm``: sparsecc's 2:4 CUTLASS GEMM with its M dispatch table (the shipped tuning
  table's launches: run as a script this benchmark sets ``SPARSECC_TUNE=off`` and leaves this
  machine's tuned launches out, common.fixed_dispatch, so every run measures the same ones),
- ``sparsecc-config`` rows: the small-batch 2:4 kernels in each of the launches tuning chooses
  among, on CUDA cores (templates/gemv_sm90_sparse24, ``Sparse24Gemv.candidates``: those of the
  batch's bucket) and on tensor cores (templates/gemv_mma_sm90_sparse24,
  ``Sparse24Mma.candidates``), in sparsecc.kernels.sparse24_small,
- ``sparsecc``: the small-batch kernel and tiling fastest in this run (of those whose result
  was right: sparsecc.kernels.tune.MAX_REL_ERR), through the op.

M in {1, 4, 8, 16, 32, 64}, fp16 and bf16, the shapes of benchmarks/kernels_gemm.py. Times as there: ``us``
under CUDA-graph replay, ``us_eager`` called eagerly; every call reads its own copy of the
weight (``copies`` of them, cycled, over 128 MiB together), so weights come from memory as in
a model, not from the 50 MB L2 cache. The device's copy bandwidth is measured
first (``copy_gbps``: a 1 GiB device-to-device copy, read + write bytes over time; ``read_gbps``:
a sum over 1 GiB, read bytes over time); rows of the small-batch kernel carry ``gbps`` (the
bytes they must read and write over ``us``), ``of_copy`` and ``of_read`` (that over the two).
The rows are results only: this benchmark writes no tuning table (tuning is the product's:
``sparsecc tune``, sparsecc/kernels/tune.py).

    python benchmarks/decode.py [--quick] [--ms 1 16]
    python benchmarks/decode.py --shapes 2048x2048 8192x2048 --ms 1 16   # a model's shapes (decode_shapes-*.json)
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import environment, fixed_dispatch, relative_error, time_eager_us, time_graph_us, write  # noqa: E402

if __name__ == "__main__":
    fixed_dispatch()        # SPARSECC_TUNE=off: the shipped table's launches (see the docstring)

from kernels_gemm import SHAPES, shape, two_four  # noqa: E402

from sparsecc.codegen.spec import Family  # noqa: E402
from sparsecc.ir.formats import NM_2_4  # noqa: E402
from sparsecc.kernels.base import finish_packing, launch_for  # noqa: E402
from sparsecc.kernels.sparse24_small import GEMM, GEMV, MMA, Sparse24GemvWeight, Sparse24MmaWeight  # noqa: E402
from sparsecc.kernels.tune import MAX_REL_ERR  # noqa: E402
from sparsecc.runtime.kernel_op import ensure, linear_kernel  # noqa: E402
from sparsecc.runtime.timing import copies_for  # noqa: E402

MS = [1, 4, 8, 16, 32, 64]


def small_batch_launches(dtype, shape) -> list:
    """Every launch of the two small-batch 2:4 families that some batch bucket times."""
    return list(dict.fromkeys(launch for family in (GEMV, MMA) for _, m in family.buckets
                              for launch in family.candidates(dtype, shape, m)))


def copy_bandwidth_gbps() -> float:
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    us = time_graph_us(lambda: dst.copy_(src), calls=2)
    return 2 * src.numel() * 2 / us / 1e3


def read_bandwidth_gbps() -> float:
    src = torch.randn(1 << 29, device="cuda").half()
    us = time_graph_us(lambda: src.sum(), calls=2)
    return src.numel() * 2 / us / 1e3


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two shapes")
    parser.add_argument("--dtypes", nargs="*", default=["float16", "bfloat16"])
    parser.add_argument("--ms", nargs="*", type=int, default=MS, help="batch sizes (default: %(default)s)")
    parser.add_argument("--shapes", nargs="*", type=shape, metavar="NxK",
                        help="weight shapes (out x in features) measured instead of the six, e.g. a model's own "
                             "(written as decode_shapes-*.json)")
    args = parser.parse_args(argv)
    shapes = SHAPES[:1] + SHAPES[3:4] if args.quick else (args.shapes or SHAPES)
    result = environment("decode_shapes" if args.shapes else "decode")   # a model's shapes: a file of their own
    result["copy_gbps"] = round(copy_bandwidth_gbps(), 1)
    result["read_gbps"] = round(read_bandwidth_gbps(), 1)
    print(f"copy bandwidth {result['copy_gbps']} GB/s, read {result['read_gbps']} GB/s", flush=True)
    ensure(dict.fromkeys(launch.spec for name in args.dtypes for n, k in shapes
                         for launch in small_batch_launches(getattr(torch, name), (n, k))))
    gen = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for n, k in shapes:
            w = two_four(n, k, dtype, gen)
            bias = torch.randn(n, dtype=dtype, device="cuda")
            gemm = GEMM.pack(w, NM_2_4, None)                        # the shipped table's dispatch
            gemm_table = GEMM.dispatch(dtype, (n, k))
            small = Sparse24GemvWeight.pack(w)                       # the layouts alone
            mma = Sparse24MmaWeight.pack(w)
            layouts = {Family.GEMV_SM90_SPARSE24: small, Family.GEMV_MMA_SM90_SPARSE24: mma}
            copies = copies_for(w.numel() * w.element_size())        # every call reads its own copy

            def copied(*tensors):
                return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(copies - 1)]
            dense_w, gemm_w = copied(w), copied(gemm.values, gemm.metadata)
            small_w = {Family.GEMV_SM90_SPARSE24: copied(small.values, small.metadata),
                       Family.GEMV_MMA_SM90_SPARSE24: copied(mma.values, mma.metadata)}
            moved_w = {Family.GEMV_SM90_SPARSE24: small.nbytes, Family.GEMV_MMA_SM90_SPARSE24: mma.nbytes}
            finish_packing(w.device)      # the small-batch kernels read their weight before they wait
            turn = itertools.count()
            for m in args.ms:
                x = torch.randn(m, k, dtype=dtype, device="cuda")
                ref = torch.relu(x.float() @ w.float().t() + bias.float())
                common = {"M": m, "N": n, "K": k, "dtype": name, "epilogue": "bias+relu", "density": 0.5, "block": None,
                          "copies": copies}

                def add(impl, fn, fmt="2:4", graph_only=False, **extra):
                    out = fn()
                    row = {"impl": impl, "format": fmt, **common, "us": time_graph_us(fn, calls=max(10, copies)),
                           "us_eager": None if graph_only else time_eager_us(fn), "rel_err": relative_error(out, ref),
                           **extra}
                    result["rows"].append(row)
                    return row

                def small_batch(launch):
                    table = layouts[launch.spec.family].running([(0, launch)]).kernels
                    weights = small_w[launch.spec.family]
                    return lambda: linear_kernel(x, *weights[next(turn) % copies], n, k, bias, "relu", False, False,
                                                 table)

                base = add("cublas", lambda: torch.relu(F.linear(x, *dense_w[next(turn) % copies], bias)), fmt="dense")
                gemm_launch = launch_for(gemm_table, m)
                add("sparsecc-gemm", lambda: linear_kernel(x, *gemm_w[next(turn) % copies], n, k, bias, "relu",
                                                           False, False, gemm.kernels),
                    launch=gemm_launch.describe())
                best = None
                # CUDA cores up to their last bounded bucket's rows of x (16), tensor cores at every M
                cuda_cores = GEMV.candidates(dtype, (n, k), m) if m <= GEMV.buckets.bounds[-1] else []
                candidates = cuda_cores + MMA.candidates(dtype, (n, k), m)
                for launch in candidates:
                    row = add("sparsecc-config", small_batch(launch), graph_only=True, config=launch.label,
                              launch=launch.describe())
                    right = row["rel_err"] <= MAX_REL_ERR[name]          # a wrong result (or NaN) never wins
                    if right and (best is None or row["us"] < best[1]["us"]):
                        best = (launch, row)
                if best is None:
                    raise RuntimeError(f"no small-batch launch computed {name} M={m} {n}x{k} right")
                gbps = (moved_w[best[0].spec.family] + x.numel() * 2 + m * n * 2) / best[1]["us"] / 1e3
                row = add("sparsecc", small_batch(best[0]),
                          config=best[1]["config"], gbps=round(gbps, 1), of_copy=round(gbps / result["copy_gbps"], 3),
                          of_read=round(gbps / result["read_gbps"], 3))
                print(f"{name} M={m:2d} {n:5d}x{k:5d}: cublas {base['us']:6.1f} us, gemm "
                      f"{result['rows'][-2 - len(candidates)]['us']:6.1f} us, small-batch "
                      f"{row['us']:6.1f} us ({best[1]['config']}, {gbps:.0f} GB/s = {row['of_copy']:.0%} of copy): "
                      f"{base['us'] / row['us']:.2f}x over cuBLAS (eager {base['us_eager'] / row['us_eager']:.2f}x)",
                      flush=True)
        path = write(result)
    plot(result, path.with_suffix(".png"))
    print("wrote", path)
    return result


def plot(result: dict, path) -> None:
    """Speedup over cuBLAS per shape and M, for the GEMM and the small-batch kernel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dtypes = list(dict.fromkeys(r["dtype"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.5), sharey=True, squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        rows = [r for r in result["rows"] if r["dtype"] == dtype]
        points = sorted({(r["N"], r["K"], r["M"]) for r in rows})
        labels = [f"{n}x{k}\nM={m}" for n, k, m in points]
        for offset, impl in ((-0.2, "sparsecc-gemm"), (0.2, "sparsecc")):
            speedups = []
            for n, k, m in points:
                times = {r["impl"]: r["us"] for r in rows if (r["N"], r["K"], r["M"]) == (n, k, m)}
                speedups.append(times["cublas"] / times[impl])
            ax.bar([i + offset for i in range(len(points))], speedups, 0.4,
                   label={"sparsecc": "sparsecc small-batch 2:4", "sparsecc-gemm": "sparsecc 2:4 GEMM"}[impl])
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(points)), labels, fontsize=7, rotation=90)
        ax.set_title(f"{dtype}: speedup over cuBLAS (graph replay)")
        ax.legend(fontsize=8)
    read = f", read {result['read_gbps']} GB/s" if "read_gbps" in result else ""
    fig.suptitle(f"{result['device']}, torch {result['torch']}, CUDA {result['cuda']}, copy {result['copy_gbps']} GB/s{read}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
