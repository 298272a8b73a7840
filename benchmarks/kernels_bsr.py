"""Block-sparse linear + bias + ReLU on the GPU, side by side in one process (run it as
``benchmarks/kernels_gemm.py --bsr``, or directly):

- ``cublas``: torch ``F.linear`` (cuBLAS) then ``relu`` on the dense weight (the baseline),
- ``torch-bsr-triton``: torch's Triton BSR kernel (``torch.sparse._triton_ops.bsr_dense_mm``,
  ``W @ x^T``) then the bias, ``relu`` and the transpose,
- ``sparsecc-bsr``: sparsecc's BSR kernel, epilogue and transpose fused (its M dispatch table),
- ``sparsecc-bsr-unchecked``: the same under SPARSECC_NONFINITE=unchecked (no NaN/Inf pass),
- ``sparsecc-bsr-nonfinite-pass``: the part of ``sparsecc-bsr`` that makes NaN and Inf of x
  propagate as in dense, timed alone;
- ``sparsecc-bsr-one-row``: where the dispatch runs the pairs kernel (two block rows per CTA),
  the one-row wgmma kernel with 128 rows of x per CTA that ran there before, for comparison;
- ``sparsecc-bsr-wgmma``: at 2 to 16 rows of x (where the dispatch runs the small-batch mma
  kernel), the wgmma kernel with 64 rows of x per CTA that ran there before, for comparison.

The BSR kernels' dispatch depends on the packed weight only (no tuning table); run as a
script this benchmark still sets ``SPARSECC_TUNE=off`` (common.fixed_dispatch), as every
benchmark that times sparsecc's dispatch against competitors does.

Weights have exactly ``density`` of their blocks stored (random positions, random values). At
M <= 64 every call reads its own copy of its weight (common.rotating; torch's Triton kernel
one copy), from memory as in a model's decode step, not from the L2 cache.
Rows carry ``us`` (CUDA-graph replay), ``us_eager``, ``rel_err`` (against fp32), ``block``,
``density`` and ``nbytes`` (the packed weight: values plus indices). Writes
benchmarks/results/kernels_bsr-<gpu>-<date>.json and a plot beside it.

    python benchmarks/kernels_bsr.py [--dtypes float16] [--ms 2048 8192] [--blocks 32 64]
    python benchmarks/kernels_bsr.py --ms 1 4 8 16 --densities 0.1 --blocks 64 --stem kernels_bsr_small
"""
from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import (environment, failed, fixed_dispatch, plot_per_dtype, relative_error, rotating,  # noqa: E402
                    time_eager_us, time_graph_us, write)

if __name__ == "__main__":
    fixed_dispatch()        # SPARSECC_TUNE=off (see the docstring)

from sparsecc.codegen.spec import Family, KernelSpec  # noqa: E402
from sparsecc.ir.epilogue import UNCHECKED_NONFINITE  # noqa: E402
from sparsecc.ir.formats import FormatSpec  # noqa: E402
from sparsecc.kernels.base import Launch, nonfinite_flags  # noqa: E402
from sparsecc.kernels.registry import BSR  # noqa: E402
from sparsecc.runtime.kernel_op import ensure, kernel_for, linear_kernel  # noqa: E402

SHAPES = [(11008, 4096), (4096, 11008), (4096, 4096), (3072, 768), (768, 3072), (1024, 4096)]
MS = [2048, 8192]
DENSITIES = [0.5, 0.25, 0.1, 0.05]
BLOCKS = [32, 64]


def block_weight(n: int, k: int, block: int, density: float, dtype, gen) -> torch.Tensor:
    """Exactly round(density x blocks) stored blocks at random positions, values ~ N(0, 1/K)."""
    rows, columns = n // block, k // block
    stored = torch.randperm(rows * columns, generator=gen)[: round(density * rows * columns)]
    present = torch.zeros(rows * columns, dtype=torch.bool)
    present[stored] = True
    mask = present.reshape(rows, columns).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return (torch.randn(n, k, generator=gen) / k ** 0.5 * mask).to(dtype).cuda()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="*", default=["float16", "bfloat16"])
    parser.add_argument("--ms", nargs="*", type=int, default=MS)
    parser.add_argument("--blocks", nargs="*", type=int, default=BLOCKS)
    parser.add_argument("--densities", nargs="*", type=float, default=DENSITIES)
    parser.add_argument("--shapes", nargs="*", default=None, help="NxK, e.g. 4096x4096 (default: the six LLM/BERT shapes of kernels_gemm.py)")
    parser.add_argument("--no-triton", action="store_true", help="leave torch's Triton kernel out")
    parser.add_argument("--stem", default=None, help="results file name stem (default kernels_bsr)")
    args = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    result = environment(args.stem or "kernels_bsr")
    gen = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for n, k in shapes:
            bias = torch.randn(n, generator=gen).to(dtype).cuda()
            for block in args.blocks:
                for density in args.densities:
                    w = block_weight(n, k, block, density, dtype, gen)
                    packed = BSR.pack(w, FormatSpec("bsr", block=(block, block)), None)
                    unchecked = packed.running(packed.launches(), UNCHECKED_NONFINITE).kernels
                    w_bsr = w.to_sparse_bsr((block, block))
                    for m in args.ms:
                        result["rows"] += measure_point(w, w_bsr, bias, packed, unchecked, m, block, density, name,
                                                        gen, not args.no_triton)
        path = write(result)                 # after every dtype: a time limit loses nothing done
    plot(result, path.with_suffix(".png"))
    print_summary(result)
    print("wrote", path)
    return result


def measure_point(w, w_bsr, bias, packed, unchecked, m, block, density, name, gen, triton) -> list[dict]:
    n, k = w.shape
    dtype = w.dtype
    x = torch.randn(m, k, generator=gen).to(dtype).cuda()
    ref = torch.relu(x.float() @ w.float().t() + bias.float())

    def on_kernels(table):
        return lambda values, metadata: linear_kernel(x, values, metadata, n, k, bias, "relu", False, False, table)
    impls = {
        "cublas": (lambda w: torch.relu(F.linear(x, w, bias)), (w,)),
        "sparsecc-bsr": (on_kernels(packed.kernels), (packed.values, packed.metadata)),
        "sparsecc-bsr-unchecked": (on_kernels(unchecked), (packed.values, packed.metadata)),
    }
    if kernel_for(packed.kernels, m)[0].spec.family is Family.BSR_SM90_PAIRS:
        one_row = Launch(KernelSpec(Family.BSR_SM90_WGMMA, name, tile=(block, block, 128)))
        ensure([one_row.spec], progress=False)
        impls["sparsecc-bsr-one-row"] = (on_kernels(packed.running([(0, one_row)], nonfinite_flags()).kernels),
                                         (packed.values, packed.metadata))
    if 1 < m <= 16:
        wgmma = Launch(KernelSpec(Family.BSR_SM90_WGMMA, name, tile=(block, block, 64)))
        ensure([wgmma.spec], progress=False)
        impls["sparsecc-bsr-wgmma"] = (on_kernels(packed.running([(0, wgmma)], nonfinite_flags()).kernels),
                                       (packed.values, packed.metadata))
    if triton:
        from torch.sparse._triton_ops import bsr_dense_mm
        impls["torch-bsr-triton"] = (lambda: torch.relu(bsr_dense_mm(w_bsr, x.t()).t() + bias), ())   # one copy
    base = {"M": m, "N": n, "K": k, "dtype": name, "epilogue": "bias+relu", "block": [block, block],
            "density": density}
    point = []
    for impl, (call, tensors) in impls.items():
        row = {"impl": impl, "format": "dense" if impl == "cublas" else f"bsr{block}x{block}", **base,
               "nbytes": w.numel() * w.element_size() if impl == "cublas" else packed.nbytes}
        try:
            fn = rotating(call, *tensors)[0] if m <= 64 else (lambda: call(*tensors))
            row["rel_err"] = relative_error(fn(), ref)
            row["us"] = time_graph_us(fn)
            row["us_eager"] = time_eager_us(fn)
        except Exception as error:  # noqa: BLE001 - recorded in the results
            failed(row, error)
        point.append(row)
    kernel = kernel_for(packed.kernels, m)[0]
    y = torch.empty(m, n, dtype=dtype, device="cuda")
    pass_alone = lambda: kernel.propagate_nonfinite(packed.metadata.data_ptr(), x.data_ptr(), y.data_ptr(),  # noqa: E731
                                                    n, m, k, torch.cuda.current_stream().cuda_stream)
    point.append({"impl": "sparsecc-bsr-nonfinite-pass", "format": f"bsr{block}x{block}", **base,
                  "us": time_graph_us(pass_alone), "us_eager": None, "rel_err": None})
    print(f"{name:8s} M={m:5d} N={n:5d} K={k:5d} b{block:<3d} d={density:<5g} " + " ".join(
        f"{r['impl']}={r['us']:8.1f}" if r["us"] else f"{r['impl']}=   -    " for r in point), flush=True)
    return point


def speedups(result: dict, impl: str, dtype: str, over: str = "cublas", key: str = "us") -> dict:
    """``over``'s time / ``impl``'s time per (M, N, K, block, density)."""
    def point(r):
        return (r["M"], r["N"], r["K"], r["block"][0], r["density"])
    rows = [r for r in result["rows"] if r["dtype"] == dtype and r.get(key)]
    base = {point(r): r[key] for r in rows if r["impl"] == over}
    return {point(r): base[point(r)] / r[key] for r in rows if r["impl"] == impl and point(r) in base}


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def print_summary(result: dict) -> None:
    """Per dtype, block and density: the speedup over cuBLAS at N, K >= 4096 against 0.6/d (what
    block sparsity could give), and how often sparsecc beats torch's Triton kernel."""
    for dtype in sorted({r["dtype"] for r in result["rows"]}):
        for impl in ("sparsecc-bsr", "sparsecc-bsr-unchecked"):
            data = speedups(result, impl, dtype)
            vs_triton = speedups(result, impl, dtype, over="torch-bsr-triton")
            for block, density in sorted({(p[3], p[4]) for p in data}):
                big = [s for p, s in data.items() if p[3:] == (block, density) and min(p[1], p[2]) >= 4096]
                triton = [s for p, s in vs_triton.items() if p[3:] == (block, density)]
                print(f"{dtype:8s} {impl:22s} b{block:<3d} d={density:<5g} over cuBLAS (N,K>=4096): geomean "
                      f"{geomean(big):.2f} min {min(big, default=math.nan):.2f} (0.6/d = {0.6 / density:.1f}); "
                      f"over Triton BSR: min {min(triton, default=math.nan):.2f} geomean {geomean(triton):.2f}")


def plot(result: dict, path) -> None:
    def draw(ax, dtype):
        for impl, style in (("sparsecc-bsr", "-o"), ("torch-bsr-triton", ":x")):
            data = speedups(result, impl, dtype)
            for m, block in sorted({(p[0], p[3]) for p in data}):
                densities = sorted({p[4] for p in data if (p[0], p[3]) == (m, block)})
                means = [geomean(s for p, s in data.items() if (p[0], p[3], p[4]) == (m, block, d)) for d in densities]
                ax.plot(densities, means, style, label=f"{impl} M={m} block {block}", alpha=0.8)
        densities = sorted({r["density"] for r in result["rows"]})
        ax.plot(densities, [0.6 / d for d in densities], "k--", lw=0.8, label="0.6/d")
    plot_per_dtype(result, path, draw, xlabel="block density",
                   title="speedup over cuBLAS (graph replay, geomean over shapes)")


if __name__ == "__main__":
    main()
