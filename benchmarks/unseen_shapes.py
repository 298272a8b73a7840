"""2:4 linear + bias + ReLU on weight shapes given on the command line, after sparsecc tunes
them on this GPU, against cuBLAS; in one process, on one GPU.

For each dtype and shape (``--shapes NxK ...``, by default the MLP weights of public LLMs that
sparsecc's shipped tuning table does not hold) the script first tunes, in a tuning table of its
own (so that earlier tuning on this machine hides nothing), every bucket the batch sizes
``--ms`` fall in, timing that (``tuning``: seconds per shape and per bucket, with the kernels
already built), then times at each M:

- ``cublas``: ``F.linear`` with the bias, then ``relu`` (the baseline);
- ``sparsecc``: a random 2:4 weight packed as ``sparsecc.compile`` packs a site planned for M
  rows (the family and launches tuning chose), through its op with the epilogue fused;
- ``sparsecc-plan``: what ``sparsecc.compile`` chooses for a Linear + ReLU of that weight with an
  example of M rows (``choice``: 2:4, or dense when timing did not find 2:4 5% ahead); its
  ``us`` is that choice's time in this run (packed as compile packs it).

Every call reads its own copy of the weight (copies cycled, 128 MiB together): weights come
from memory as in a model, not from the L2. ``us`` is the median under CUDA-graph replay,
``us_eager`` called eagerly; ``rel_err`` against an fp32 product. Rows add ``family`` (the
kernel family), ``launch`` and ``in_shipped_table`` (whether the shape was in the shipped table).

    python benchmarks/unseen_shapes.py [--shapes 14336x4096 ...] [--ms 1 8 32 64 128] [--dtypes float16]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, plot_per_dtype, private_tuning, rotating, time_eager_us, time_graph_us, write  # noqa: E402

import sparsecc  # noqa: E402
from sparsecc.codegen.spec import Family, KernelSpec  # noqa: E402
from sparsecc.ir.formats import NM_2_4, FormatSpec  # noqa: E402
from sparsecc.ir.numerics import relative_error  # noqa: E402
from sparsecc.ir.weights import random_weight  # noqa: E402
from sparsecc.ir.workload import dtype_name  # noqa: E402
from sparsecc.kernels import registry, tune  # noqa: E402
from sparsecc.kernels.sparse24_small import GEMM, GEMV, MMA, choose  # noqa: E402
from sparsecc.runtime.kernel_op import ensure, parse_dispatch  # noqa: E402

#: MLP weights (out x in features) of Llama-3-8B / Mistral-7B, Llama-2-13B and Qwen2-7B
SHAPES = ["14336x4096", "4096x14336", "13824x5120", "5120x13824", "18944x3584", "3584x18944"]
MS = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128]
FAMILIES = (GEMV, MMA, GEMM)


def shape(text: str) -> tuple[int, int]:
    n, k = text.lower().split("x")
    return int(n), int(k)


def buckets_for(ms: list[int]) -> dict:
    """Per family, the bucket Ms the batch sizes ``ms`` fall in."""
    return {family: sorted({family.buckets.measured_for(m) for m in ms if family.max_m is None or m <= family.max_m})
            for family in FAMILIES}


def prebuild(dtypes, shapes, ms) -> float:
    """Build (or load) every candidate kernel tuning will time, and the compressor that packs the
    GEMMs' weights (on a cold cache it took ~20 s inside the first GEMM bucket's tuning): tuning
    time is measured without builds."""
    start = time.perf_counter()
    specs = [launch.spec for dtype in dtypes for n_k in shapes for family, bucket_ms in buckets_for(ms).items()
             for m in bucket_ms for launch in family.candidates(dtype, n_k, m)]
    specs += [KernelSpec(Family.SM90_COMPRESS24, dtype_name(dtype)) for dtype in dtypes]
    ensure(list(dict.fromkeys(specs)))
    return time.perf_counter() - start


def tune_shape(dtype, n_k, ms) -> dict:
    """Tune every bucket the batches ``ms`` need for a 2:4 weight of this shape as packing does:
    at each M the two families that may serve it (sparse24_small.choose), then the chosen
    family's bucket; seconds in all and per bucket."""
    before, start = len(tune.LOG), time.perf_counter()
    for m in ms:
        family = choose(dtype, n_k, m, tune_first=True, progress=False)
        family.dispatch(dtype, n_k, (m, m))
    tuned = tune.log_since(before)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 3), "buckets": len(tuned),
            "per_bucket_s": round(seconds / max(1, len(tuned)), 3),
            "tuned": [{k: t[k] for k in ("family", "m", "launch", "us", "candidates", "seconds")} for t in tuned]}


def cublas_runner(x, weight, bias):
    return rotating(lambda w, b: F.relu(F.linear(x, w, b)), weight, bias)


def sparse_runner(x, packed, bias):
    scalars, extra = tuple(packed.scalars().values()), tuple(packed.extra_args)
    tensors = tuple(packed.tensors().values())
    return rotating(lambda *ts: packed.op(x, *ts, *scalars, bias, "relu", False, False, *extra), *tensors)


#: calls captured per CUDA graph: the timer clears the L2 before each replay by writing it full,
#: and the first calls of a replay then share the memory with those writes; with 8-20 calls a
#: replay, that added about 1 us per call to a 7-12 us 2:4 kernel (0.3 us to cuBLAS's 17 us) on an H100
GRAPH_CALLS = 64


def timed(run, copies) -> tuple[float, float]:
    return (time_graph_us(run, calls=copies * max(1, GRAPH_CALLS // copies)), time_eager_us(run))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="weight shapes NxK (out x in features)")
    parser.add_argument("--ms", nargs="+", type=int, default=MS, help="batch sizes")
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    parser.add_argument("--stem", default="unseen_shapes", help="the results file's name")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("unseen_shapes.py times sparsecc's kernels: it needs a Hopper GPU")
    private_tuning("unseen_shapes")
    shipped = {(e["N"], e["K"]) for e in tune.shipped_entries()}
    shapes = [shape(s) for s in args.shapes]
    dtypes = [getattr(torch, d) for d in args.dtypes]
    result = environment(args.stem)
    result["build_s"] = round(prebuild(dtypes, shapes, args.ms), 1)
    result["tuning"] = []
    generator = torch.Generator("cuda").manual_seed(0)
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        for n, k in shapes:
            tuning = tune_shape(dtype, (n, k), args.ms)
            result["tuning"].append({"dtype": name, "N": n, "K": k, **tuning})
            print(f"{name} {n}x{k}: tuned {tuning['buckets']} buckets in {tuning['seconds']:.1f} s", flush=True)
            weight = random_weight(n, k, "2:4", 0.5, dtype, "cuda", generator)
            bias = torch.randn(n, device="cuda", generator=generator).to(dtype)
            common = {"N": n, "K": k, "dtype": name, "epilogue": "bias+relu", "density": 0.5, "block": None,
                      "in_shipped_table": (n, k) in shipped}
            for m in args.ms:
                x = torch.randn(m, k, device="cuda", generator=generator).to(dtype)
                want = F.relu(F.linear(x.float(), weight.float(), bias.float()))
                run, copies = cublas_runner(x, weight, bias)
                us, eager = timed(run, copies)
                rows = {"cublas": dict(impl="cublas", format="dense", us=us, us_eager=eager,
                                       rel_err=relative_error(run().float(), want))}
                family = choose(dtype, (n, k), m)
                packed = registry.pack(weight, NM_2_4, m, tune_range=(m, m))
                run, copies = sparse_runner(x, packed, bias)
                us, eager = timed(run, copies)
                _, symbol, swizzle, splits, _ = next(e for e in parse_dispatch(packed.kernels) if e[0] == 0 or m <= e[0])
                rows["sparsecc"] = dict(impl="sparsecc", format="2:4", us=us, us_eager=eager,
                                        rel_err=relative_error(run().float(), want), family=family.name,
                                        launch=f"{symbol}:{swizzle}:{splits}")
                model = nn.Sequential(nn.Linear(k, n), nn.ReLU()).to("cuda", dtype)
                with torch.no_grad():
                    model[0].weight.copy_(weight)
                    model[0].bias.copy_(bias)
                compiled = sparsecc.compile(model, x)
                choice = compiled.sparsecc_plan.sites[0].choice
                with torch.no_grad():
                    plan_error = relative_error(compiled(x).float(), want)
                if choice == "dense":
                    us, eager = rows["cublas"]["us"], rows["cublas"]["us_eager"]
                elif choice == "2:4":
                    us, eager = rows["sparsecc"]["us"], rows["sparsecc"]["us_eager"]
                else:                     # packed as compile packs it, timed on weight copies
                    run, copies = sparse_runner(x, registry.pack(weight, FormatSpec.parse(choice), m,
                                                                 tune_range=(m, m)), bias)
                    us, eager = timed(run, copies)
                rows["sparsecc-plan"] = dict(impl="sparsecc-plan", format=choice, us=us, us_eager=eager,
                                             rel_err=plan_error, choice=choice)
                for row in rows.values():
                    result["rows"].append({**common, "M": m, **row})
                speedup = rows["cublas"]["us"] / rows["sparsecc"]["us"]
                print(f"  M={m:4d}: cublas {rows['cublas']['us']:8.2f} us, 2:4 {rows['sparsecc']['us']:8.2f} us "
                      f"({speedup:.2f}x, {family.name}), plan: {choice}", flush=True)
                del packed, compiled, model
                torch.cuda.empty_cache()
            result["summary"] = summary(result)
            write(result, stem=args.stem)       # what a run cut short keeps, summed up so far
    result["summary"] = summary(result)
    path = write(result, stem=args.stem)
    plot(result, path.with_suffix(".png"))
    print(path)
    for line in result["summary"]["lines"]:
        print(line)
    return result


def summary(result: dict) -> dict:
    """Per dtype and batch range, the lowest 2:4 speedup over cuBLAS where N, K >= 4096, and the
    plan's choice against dense everywhere."""
    times = {(r["dtype"], r["N"], r["K"], r["M"], r["impl"]): r["us"] for r in result["rows"]}
    lines, ranges = [], {"1..32": (1, 32), "33..128": (33, 128)}
    out = {}
    for dtype in sorted({r["dtype"] for r in result["rows"]}):
        for label, (lo, hi) in ranges.items():
            speedups = [times[d, n, k, m, "cublas"] / times[d, n, k, m, "sparsecc"]
                        for (d, n, k, m, impl) in times if impl == "sparsecc" and d == dtype and lo <= m <= hi
                        and n >= 4096 and k >= 4096]
            if speedups:
                out[f"{dtype} M {label}"] = {"min": round(min(speedups), 3), "points": len(speedups)}
                lines.append(f"{dtype} M {label}, N, K >= 4096: 2:4 at least {min(speedups):.2f}x of cuBLAS "
                             f"({len(speedups)} points)")
        ratios = [times[d, n, k, m, "sparsecc-plan"] / times[d, n, k, m, "cublas"]
                  for (d, n, k, m, impl) in times if impl == "sparsecc-plan" and d == dtype]
        out[f"{dtype} plan / dense, worst"] = round(max(ratios), 3)
        lines.append(f"{dtype}: the plan's choice at worst {max(ratios):.3f}x dense's time")
    per_bucket = [t["per_bucket_s"] for t in result["tuning"]]
    out["tuning_s_per_bucket_max"] = max(per_bucket)
    lines.append(f"tuning: at most {max(per_bucket):.2f} s per bucket (kernels built), "
                 f"{max(t['seconds'] for t in result['tuning']):.1f} s per shape")
    out["lines"] = lines
    return out


def plot(result: dict, path) -> None:
    def draw(ax, dtype):
        for n, k in sorted({(r["N"], r["K"]) for r in result["rows"] if r["dtype"] == dtype}):
            rows = {(r["M"], r["impl"]): r["us"] for r in result["rows"]
                    if r["dtype"] == dtype and (r["N"], r["K"]) == (n, k)}
            ms = sorted({m for m, _ in rows})
            ax.plot(ms, [rows[m, "cublas"] / rows[m, "sparsecc"] for m in ms], marker="o", label=f"{n}x{k}")
    plot_per_dtype(result, path, draw, xlabel="M (rows of x)", title="2:4 + bias + ReLU over cuBLAS, tuned here")


if __name__ == "__main__":
    main()
