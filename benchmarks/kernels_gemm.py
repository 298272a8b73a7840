"""Linear + bias + ReLU on the GPU, side by side in one process, fp16 and bf16:

- ``cublas``: torch ``F.linear`` (cuBLAS) then ``relu`` (the baseline),
- ``torch-semi-structured``: ``to_sparse_semi_structured`` (cuSPARSELt) then ``relu``,
- ``sparsecc-dense``: sparsecc's dense kernels, epilogue fused (the dense family's M dispatch
  table: the small-batch tensor-core kernel where the table has it faster, the CUTLASS GEMM
  elsewhere),
- ``sparsecc``: sparsecc's 2:4 CUTLASS GEMM, epilogue fused (its M dispatch table),
- ``sparsecc-unchecked``: the same under SPARSECC_NONFINITE=unchecked (no NaN/Inf pass),
- ``sparsecc-nonfinite-pass``: the part of ``sparsecc`` that makes NaN and Inf of x propagate
  as in dense (one read of x after the product), timed alone,
- ``sparsecc-config`` rows (``--sweep``): every candidate launch (tiling and scheduler knobs)
  that tuning chooses among for these families, each timed alone. They are results only:
  tuning is the product's (``sparsecc tune``, sparsecc/kernels/tune.py), and this benchmark
  writes no tuning table.

The dispatch tables are the shipped tuning table's (sparsecc/kernels/tuning.json, the nearest
shape it holds): run as a script this benchmark sets ``SPARSECC_TUNE=off`` and leaves this
machine's tuned launches out (common.fixed_dispatch), so a run measures the same launches on
every machine and every run.

Each is timed as a CUDA-graph replay (``us``, kernel time: speedups are quoted on these) and
eagerly (``us_eager``, what a caller without graphs sees), and checked against an fp32
reference (``rel_err``). Extra keys: ``config`` (launch label) and ``launch`` (its spec and
knobs) on per-config rows, ``error`` when an implementation refused a shape. Writes benchmarks/results/kernels-<gpu>-<date>.json
and a plot beside it.

    python benchmarks/kernels_gemm.py [--quick] [--sweep float16] [--dense-only] [--ms 1 16]
    python benchmarks/kernels_gemm.py --shapes 1024x1024 4096x1024 --ms 4096 [--sparse-only]   # a model's shapes (kernels_shapes-*.json)
    python benchmarks/kernels_gemm.py --bsr [kernels_bsr.py options]    # the block-sparse kernels
    python benchmarks/kernels_gemm.py --csr [kernels_csr.py options]    # the unstructured kernel
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import (environment, failed, fixed_dispatch, relative_error, time_eager_us, time_graph_us,  # noqa: E402
                    write)

if __name__ == "__main__":
    fixed_dispatch()        # SPARSECC_TUNE=off: the shipped table's launches (see the docstring)

from sparsecc.ir.epilogue import UNCHECKED_NONFINITE  # noqa: E402
from sparsecc.kernels.dense import SMALL as DENSE_SMALL  # noqa: E402
from sparsecc.kernels.dense import DenseGemm  # noqa: E402
from sparsecc.kernels.dense_small import DenseWeight  # noqa: E402
from sparsecc.kernels.sparse24_small import GEMM  # noqa: E402
from sparsecc.runtime.kernel_op import ensure, kernel_for, linear_kernel  # noqa: E402

SHAPES = [(11008, 4096), (4096, 11008), (4096, 4096), (3072, 768), (768, 3072), (1024, 4096)]
MS = [1, 16, 128, 2048, 8192]
DENSE_GEMM = DenseGemm()


def shape(text: str) -> tuple[int, int]:
    """``"NxK"`` -> (N, K), for ``--shapes``."""
    try:
        n, k = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a weight shape is NxK (out x in features), not {text!r}") from None
    if n <= 0 or k <= 0 or k % 16:
        raise argparse.ArgumentTypeError(f"{text}: N and K must be positive and K a multiple of 16 (2:4 groups, 16-byte rows)")
    return n, k


def two_four(n: int, k: int, dtype, gen) -> torch.Tensor:
    w = torch.randn(n, k // 4, 4, generator=gen)
    keep = w.abs().topk(2, dim=-1).indices
    mask = torch.zeros_like(w, dtype=torch.bool).scatter_(-1, keep, True)
    return (w * mask).reshape(n, k).to(dtype).cuda()


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--bsr" in argv:
        import kernels_bsr
        return kernels_bsr.main([a for a in argv if a != "--bsr"])
    if "--csr" in argv:
        import kernels_csr
        return kernels_csr.main([a for a in argv if a != "--csr"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two shapes, three batch sizes")
    parser.add_argument("--sweep", nargs="*", default=["float16", "bfloat16"],
                        help="dtypes whose candidate launches are all measured (none: skip)")
    parser.add_argument("--dtypes", nargs="*", default=["float16", "bfloat16"])
    parser.add_argument("--sweep-ms", nargs="*", type=int, help="batch sizes the sweep measures (default: those measured)")
    parser.add_argument("--dense-only", action="store_true", help="the dense kernels and cuBLAS alone")
    parser.add_argument("--sparse-only", action="store_true", help="the 2:4 kernels and their competitors alone")
    parser.add_argument("--ms", nargs="*", type=int, help="batch sizes measured (default: %s)" % MS)
    parser.add_argument("--shapes", nargs="*", type=shape, metavar="NxK",
                        help="weight shapes (out x in features) measured instead of the six default ones, e.g. a "
                             "model's own (default: %s)" % " ".join(f"{n}x{k}" for n, k in SHAPES))
    args = parser.parse_args(argv)
    shapes, ms = (SHAPES[:1] + SHAPES[3:4], [1, 128, 2048]) if args.quick else (args.shapes or SHAPES, args.ms or MS)
    if args.dense_only and args.sparse_only:
        parser.error("--dense-only and --sparse-only exclude each other")
    # the families whose dispatch is measured, and those whose candidates the sweep times
    families = ([] if args.sparse_only else [DENSE_GEMM]) + ([] if args.dense_only else [GEMM])
    swept = ([] if args.sparse_only else [DENSE_GEMM, DENSE_SMALL]) + ([] if args.dense_only else [GEMM])
    result = environment("kernels_shapes" if args.shapes else "kernels")   # a model's shapes: a file of their own
    result["dispatch"] = "the shipped tuning table (sparsecc/kernels/tuning.json), SPARSECC_TUNE=off"
    gen = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        weights = {}
        for n, k in shapes:
            w = two_four(n, k, dtype, gen)
            bias = torch.randn(n, generator=gen).to(dtype).cuda()
            weights[(n, k)] = (w, bias, None if args.dense_only else GEMM.layout(w))   # compressed, no dispatch
        if name in args.sweep:              # 1: every candidate launch, each alone (results only)
            sweep_ms = [m for m in ms if args.sweep_ms is None or m in args.sweep_ms]
            candidates = {(n, k, m): [launch for family in swept if family.max_m is None or m <= family.max_m
                                      for launch in family.candidates(dtype, (n, k), m)]
                          for n, k in shapes for m in sweep_ms}
            ensure(dict.fromkeys(launch.spec for launches in candidates.values() for launch in launches))
            for (n, k), (w, bias, packed) in weights.items():
                for m in sweep_ms:
                    launches = candidates[(n, k, m)]
                    x = torch.randn(m, k, generator=gen).to(dtype).cuda()
                    ref = torch.relu(x.float() @ w.float().t() + bias.float())
                    base = {"M": m, "N": n, "K": k, "dtype": name, "epilogue": "bias+relu", "block": None}
                    for launch in launches:
                        result["rows"].append(measure_launch(launch, x, w, bias, packed, ref, base))
        tables = {(family.name, n, k): family.dispatch(dtype, (n, k)) for family in families for n, k in shapes}
        ensure([launch.spec for table in tables.values() for _, launch in table])
        for (n, k), (w, bias, packed) in weights.items():   # 2: the dispatch a user runs (the shipped table)
            dense = None if args.sparse_only else DenseWeight.of(w).running(tables[(DENSE_GEMM.name, n, k)])
            w_semi = None                   # the 2:4 competitors, unless --dense-only
            if not args.dense_only:
                sparse = packed.running(tables[(GEMM.name, n, k)])
                unchecked = packed.running(tables[(GEMM.name, n, k)], UNCHECKED_NONFINITE)
                try:
                    from torch.sparse import to_sparse_semi_structured
                    w_semi = to_sparse_semi_structured(w)
                except Exception as error:  # noqa: BLE001 - recorded in the results
                    w_semi = error
            for m in ms:
                x = torch.randn(m, k, generator=gen).to(dtype).cuda()
                ref = torch.relu(x.float() @ w.float().t() + bias.float())
                impls = {
                    "cublas": lambda: torch.relu(F.linear(x, w, bias)),
                    "sparsecc-dense": lambda: run_packed(dense, x, bias),
                    "sparsecc": lambda: run_packed(sparse, x, bias),
                    "sparsecc-unchecked": lambda: run_packed(unchecked, x, bias),
                }
                if args.dense_only:
                    impls = {impl: impls[impl] for impl in ("cublas", "sparsecc-dense")}
                if args.sparse_only:
                    del impls["sparsecc-dense"]
                if not args.dense_only and not isinstance(w_semi, Exception):
                    impls["torch-semi-structured"] = lambda: torch.relu(F.linear(x, w_semi, bias))
                base = {"M": m, "N": n, "K": k, "dtype": name, "epilogue": "bias+relu", "block": None}
                point = []
                for impl, fn in impls.items():
                    row = {"impl": impl, "format": "dense" if impl in ("cublas", "sparsecc-dense") else "2:4",
                           "density": 1.0 if impl in ("cublas", "sparsecc-dense") else 0.5, **base}
                    try:
                        row["rel_err"] = relative_error(fn(), ref)
                        row["us"] = time_graph_us(fn)
                        row["us_eager"] = time_eager_us(fn)
                    except Exception as error:  # noqa: BLE001
                        failed(row, error)
                    point.append(row)
                if not args.dense_only:
                    point.append(measure_nonfinite_pass(x, sparse, base))
                if isinstance(w_semi, Exception):
                    point.append({"impl": "torch-semi-structured", "format": "2:4", "density": 0.5, **base,
                                  "us": None, "us_eager": None, "rel_err": None, "error": str(w_semi)[:300]})
                result["rows"] += point
                print(f"{name:8s} M={m:5d} N={n:5d} K={k:5d} " + " ".join(
                    f"{r['impl']}={r['us']:8.1f}" if r["us"] else f"{r['impl']}=   -    " for r in point), flush=True)
    path = write(result)
    plot(result, path.with_suffix(".png"))
    print_summary(result)
    print("wrote", path)
    return result


def run_packed(packed, x, bias):
    """``relu(x W^T + bias)`` on sparsecc's op with ``packed``'s tensors and dispatch table."""
    n, k = packed.shape
    return linear_kernel(x, packed.values, packed.metadata, n, k, bias, "relu", False, False, packed.kernels)


def measure_nonfinite_pass(x, packed, base) -> dict:
    """The NaN/Inf pass of the 2:4 GEMM alone (it is part of the ``sparsecc`` time): graph replay."""
    kernel = kernel_for(packed.kernels, x.shape[0])[0]
    y = torch.empty(x.shape[0], base["N"], dtype=x.dtype, device=x.device)
    fn = lambda: kernel.propagate_nonfinite(packed.metadata.data_ptr(), x.data_ptr(), y.data_ptr(), base["N"],  # noqa: E731
                                            x.shape[0], base["K"], torch.cuda.current_stream().cuda_stream)
    return {"impl": "sparsecc-nonfinite-pass", "format": "2:4", "density": 0.5, **base,
            "us": time_graph_us(fn), "us_eager": None, "rel_err": None}


def measure_launch(launch, x, w, bias, packed, ref, base) -> dict:
    """One candidate launch at one point (graph replay time only): the 2:4 GEMM's on the
    compressed weight ``packed``, the dense kernels' on ``w``."""
    sparse = launch.spec.family.sparse
    one = (packed if sparse else DenseWeight.of(w)).running([(0, launch)])
    fn = lambda: run_packed(one, x, bias)  # noqa: E731
    row = {"impl": "sparsecc-config", "format": "2:4" if sparse else "dense", "density": 0.5 if sparse else 1.0,
           "config": launch.label, "launch": launch.describe(), **base}
    try:
        row["rel_err"] = relative_error(fn(), ref)
        row["us"] = time_graph_us(fn)
        row["us_eager"] = None
    except Exception as error:  # noqa: BLE001
        failed(row, error)
    return row


def speedups(result: dict, impl: str, dtype: str, min_m: int = 0, key: str = "us") -> dict:
    rows = [r for r in result["rows"] if r["dtype"] == dtype and r["M"] >= min_m]
    base = {(r["M"], r["N"], r["K"]): r[key] for r in rows if r["impl"] == "cublas" and r[key]}
    return {(r["M"], r["N"], r["K"]): base[(r["M"], r["N"], r["K"])] / r[key]
            for r in rows if r["impl"] == impl and r[key] and (r["M"], r["N"], r["K"]) in base}


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def print_summary(result: dict) -> None:
    for dtype in ("float16", "bfloat16"):
        for impl in ("sparsecc", "sparsecc-unchecked", "sparsecc-dense", "torch-semi-structured"):
            big = speedups(result, impl, dtype, 2048)
            allm = speedups(result, impl, dtype)
            eager = speedups(result, impl, dtype, key="us_eager")
            if allm:
                print(f"{dtype:8s} {impl:22s} speedup over cuBLAS (graph): geomean M>=2048 {geomean(big.values()):.2f} "
                      f"(min {min(big.values(), default=float('nan')):.2f}), all {geomean(allm.values()):.2f}; "
                      f"eager geomean {geomean(eager.values()):.2f}")
        shares = pass_shares(result, dtype)
        if shares:
            big = [share for (m, _, _), share in shares.items() if m >= 2048]
            print(f"{dtype:8s} the NaN/Inf pass: {100 * statistics.median(shares.values()):.1f}% of the 2:4 time "
                  f"(median; M>=2048 median {100 * statistics.median(big or [math.nan]):.1f}%, "
                  f"max {100 * max(shares.values()):.1f}%)")


def pass_shares(result: dict, dtype: str) -> dict:
    """The NaN/Inf pass's share of the 2:4 kernel's time, per (M, N, K)."""
    rows = [r for r in result["rows"] if r["dtype"] == dtype and r.get("us")]
    total = {(r["M"], r["N"], r["K"]): r["us"] for r in rows if r["impl"] == "sparsecc"}
    return {key: r["us"] / total[key] for r in rows if r["impl"] == "sparsecc-nonfinite-pass"
            for key in [(r["M"], r["N"], r["K"])] if key in total}


def plot(result: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, dtype in zip(axes, ("float16", "bfloat16")):
        for impl, style in (("sparsecc", "-o"), ("torch-semi-structured", ":x"), ("sparsecc-dense", "--.")):
            data = speedups(result, impl, dtype)
            for n, k in sorted({(key[1], key[2]) for key in data}):
                points = sorted((m, s) for (m, nn, kk), s in data.items() if (nn, kk) == (n, k))
                ax.plot([p[0] for p in points], [p[1] for p in points], style, label=f"{impl} {n}x{k}", alpha=0.8)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("M (rows of x)")
        ax.set_title(f"{dtype}: speedup over cuBLAS F.linear+bias+relu (CUDA graph)")
    axes[0].set_ylabel("speedup")
    axes[1].legend(fontsize=6, ncol=2)
    fig.suptitle(f"{result['device']}, torch {result['torch']}, CUDA {result['cuda']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
