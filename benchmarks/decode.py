"""Small batches (decode), linear + bias + ReLU on the GPU, side by side in one process:

- ``cublas``: torch ``F.linear`` then ``relu`` (the baseline),
- ``sparsecc-gemm``: sparsecc's 2:4 CUTLASS GEMM with its M dispatch table,
- ``sparsecc-config`` rows: the small-batch 2:4 kernels in each of their tilings, on CUDA cores
  (templates/gemv_sm90_sparse24, sparsecc.gpu.gemv_candidates: those of the batch's bucket) and
  on tensor cores (templates/gemv_mma_sm90_sparse24, sparsecc.gpu.mma_candidates),
- ``sparsecc``: the small-batch kernel and tiling fastest in this run, through the op.

M in {1, 4, 8, 16, 32, 64}, fp16 and bf16, the shapes of benchmarks/kernels.py. Times as there: ``us``
under CUDA-graph replay, ``us_eager`` called eagerly; every call reads its own copy of the
weight (``copies`` of them, cycled, over 128 MiB together), so weights come from memory as in
a model, not from the 50 MB L2 cache. The device's copy bandwidth is measured
first (``copy_gbps``: a 1 GiB device-to-device copy, read + write bytes over time; ``read_gbps``:
a sum over 1 GiB, read bytes over time); rows of the small-batch kernel carry ``gbps`` (the
bytes they must read and write over ``us``), ``of_copy`` and ``of_read`` (that over the two).
``--tuning-out`` writes the packaged tuning table with this run's small-batch winners added, and
the 2:4 GEMM's time at each M (what sparsecc.gpu.small_batch_family weighs them against).

    python benchmarks/decode.py [--quick] [--ms 1 16] [--tuning-out sparsecc/tuning.json]
    python benchmarks/decode.py --shapes 2048x2048 8192x2048 --ms 1 16   # a model's shapes (decode_shapes-*.json)
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import environment, rel_err, time_eager_us, time_graph_us, write  # noqa: E402
from kernels import SHAPES, shape, two_four  # noqa: E402

from sparsecc import gpu, runtime, tuning  # noqa: E402
from sparsecc.codegen import Family  # noqa: E402
from sparsecc.timing import copies_for  # noqa: E402

MS = [1, 4, 8, 16, 32, 64]


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
    parser.add_argument("--tuning-out", help="write the tuning table with the small-batch winners here")
    parser.add_argument("--shapes", nargs="*", type=shape, metavar="NxK",
                        help="weight shapes (out x in features) measured instead of the six, e.g. a model's own "
                             "(written as decode_shapes-*.json)")
    args = parser.parse_args(argv)
    shapes = SHAPES[:1] + SHAPES[3:4] if args.quick else (args.shapes or SHAPES)
    result = environment("decode_shapes" if args.shapes else "decode")   # a model's shapes: a file of their own
    result["copy_gbps"] = round(copy_bandwidth_gbps(), 1)
    result["read_gbps"] = round(read_bandwidth_gbps(), 1)
    print(f"copy bandwidth {result['copy_gbps']} GB/s, read {result['read_gbps']} GB/s", flush=True)
    runtime.ensure([launch.spec for name in args.dtypes
                    for launch in gpu.gemv_candidates(getattr(torch, name)) + gpu.mma_candidates(getattr(torch, name))])
    gen = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for n, k in shapes:
            w = two_four(n, k, dtype, gen)
            bias = torch.randn(n, dtype=dtype, device="cuda")
            gemm = gpu.CutlassSparse24Weight.from_dense(w, progress=False)
            gemm_table = gpu.dispatch(Family.SM90_SPARSE24, dtype, n, k)
            small = gpu.Sparse24GemvWeight.pack(w)
            mma = gpu.Sparse24MmaWeight.pack(w)
            copies = copies_for(w.numel() * w.element_size())        # every call reads its own copy

            def copied(*tensors):
                return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(copies - 1)]
            dense_w, gemm_w = copied(w), copied(gemm.values, gemm.metadata)
            small_w = {Family.GEMV_SM90_SPARSE24: copied(small.values, small.metadata),
                       Family.GEMV_MMA_SM90_SPARSE24: copied(mma.values, mma.metadata)}
            moved_w = {Family.GEMV_SM90_SPARSE24: small.nbytes, Family.GEMV_MMA_SM90_SPARSE24: mma.nbytes}
            turn = itertools.count()
            for m in args.ms:
                x = torch.randn(m, k, dtype=dtype, device="cuda")
                ref = torch.relu(x.float() @ w.float().t() + bias.float())
                common = {"M": m, "N": n, "K": k, "dtype": name, "epilogue": "bias+relu", "density": 0.5, "block": None,
                          "copies": copies}

                def add(impl, fn, fmt="2:4", graph_only=False, **extra):
                    out = fn()
                    row = {"impl": impl, "format": fmt, **common, "us": time_graph_us(fn, calls=max(10, copies)),
                           "us_eager": None if graph_only else time_eager_us(fn), "rel_err": rel_err(out, ref), **extra}
                    result["rows"].append(row)
                    return row

                def small_batch(launch):
                    table, weights = gpu.dispatch_string([(0, launch)]), small_w[launch.spec.family]
                    return lambda: gpu.linear_kernel(x, *weights[next(turn) % copies], n, k, bias, "relu", False, False,
                                                     table)

                base = add("cublas", lambda: torch.relu(F.linear(x, *dense_w[next(turn) % copies], bias)), fmt="dense")
                gemm_launch = gpu.launch_for(gemm_table, m)
                add("sparsecc-gemm", lambda: gpu.linear_kernel(x, *gemm_w[next(turn) % copies], n, k, bias, "relu",
                                                               False, False, gemm.kernels),
                    launch={"spec": json.loads(gemm_launch.spec.describe()), "swizzle": gemm_launch.swizzle,
                            "splits": gemm_launch.splits})
                best = None
                # CUDA cores up to their last bucket's rows of x (16), tensor cores at every M
                cuda_cores = gpu.gemv_candidates(dtype, m) if m <= gpu.GEMV_BUCKETS[-2][0] else []
                candidates = cuda_cores + gpu.mma_candidates(dtype, m)
                for launch in candidates:
                    row = add("sparsecc-config", small_batch(launch), graph_only=True, config=launch.label,
                              launch={"spec": json.loads(launch.spec.describe()), "swizzle": launch.swizzle,
                                      "splits": launch.splits})
                    if tuning.computed_right(row) and (best is None or row["us"] < best[1]["us"]):   # a wrong result never wins
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
    if args.tuning_out:        # this run's winners replace the entries of what it measured
        winners = tuning.winners(result["rows"], impls=("sparsecc-config", "sparsecc-gemm"))
        measured = {(e["family"], e["dtype"], e["M"], e["N"], e["K"]) for e in winners}
        kept = [e for e in tuning.table()["entries"]
                if (e["family"], e["dtype"], e["M"], e["N"], e["K"]) not in measured]
        with open(args.tuning_out, "w") as handle:
            json.dump({**tuning.table(), "entries": kept + winners}, handle, indent=1)
        print(f"wrote {len(winners)} small-batch and GEMM entries to {args.tuning_out}")
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
