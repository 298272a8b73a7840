"""Unstructured sparse linear + bias + ReLU on the GPU, side by side in one process (run it as
``benchmarks/kernels_gemm.py --csr``, or directly):

- ``cublas``: torch ``F.linear`` (cuBLAS) then ``relu`` on the dense weight (the baseline),
- ``torch-csr-cusparse``: ``torch.sparse.mm`` on the CSR weight (cuSPARSE SpMM, ``W @ x^T``)
  then the bias, ``relu`` and the transpose,
- ``sparsecc-csr``: sparsecc's tiled CSR kernels, epilogue and transpose fused (its M dispatch table:
  csr_sm90 up to 16 rows of x, csr_wgmma_sm90 beyond),
- ``sparsecc-csr-split``: the weight split into a 2:4 part on sparsecc's 2:4 kernels and a
  residual pass (sparsecc.kernels.csr_split), packed for each M as compile packs a site planned
  for it (the 2:4 part's family and launches from the shipped tuning table, see below);
  with ``--residual-modes`` also each mode of the residual pass forced
  (``sparsecc-csr-split-gather``, ``-staged``, ``-transposed``),
- ``sparsecc-csr-spmm``: sparsecc's CUDA-core CSR kernel (sparsecc.kernels.csr_spmm), up to density 0.1,
- ``sparsecc-bitmap``: sparsecc's bitmap kernel (sparsecc.kernels.bitmap: a bit per element and the
  non-zeros' values, on the tiled CSR kernel's pipeline), its M dispatch table.

Run as a script this benchmark sets ``SPARSECC_TUNE=off`` and leaves this machine's tuned
launches out (common.fixed_dispatch): the split weight's 2:4 part runs the shipped tuning
table's launches (sparsecc/kernels/tuning.json), the same on every run and machine, and
packing tunes nothing.

Weights keep each element with probability ``density`` (random values). Every call of an
implementation reads its own copy of the weight, cycling through enough copies (128 MB in
all) that each is read from memory, not from the 50 MB L2 cache: a model's layers each read
their own weight once. Rows carry ``us`` (CUDA-graph replay; for cuSPARSE, which reads a
value back to the host and cannot be captured, the eager time: ``graph`` says which),
``us_eager``, ``rel_err`` (against fp32), ``density`` and ``nbytes`` (the packed weight:
values plus indices). Writes
benchmarks/results/kernels_csr-<gpu>-<date>.json and a plot beside it.

    python benchmarks/kernels_csr.py [--dtypes float16] [--ms 16 64 2048] [--densities 0.1]
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
    fixed_dispatch()        # SPARSECC_TUNE=off: the shipped table's launches (see the docstring)

from kernels_bsr import geomean  # noqa: E402

from sparsecc.ir.formats import FormatSpec  # noqa: E402
from sparsecc.kernels.csr_split import GATHER, STAGED, TRANSPOSED, linear_split  # noqa: E402
from sparsecc.kernels.csr_spmm import MAX_DENSITY as SPMM_MAX_DENSITY  # noqa: E402
from sparsecc.kernels.bitmap import BitmapTiled  # noqa: E402
from sparsecc.kernels.registry import CSR_SPLIT, CSR_SPMM, CSR_TILED  # noqa: E402
from sparsecc.runtime.kernel_op import linear_kernel  # noqa: E402

CSR = FormatSpec("csr")
BITMAP = BitmapTiled()

SHAPES = [(11008, 4096), (4096, 11008), (4096, 4096), (3072, 768), (768, 3072), (1024, 4096)]
MS = [16, 64, 2048, 8192]
DENSITIES = [0.3, 0.1, 0.05, 0.01]
MAX_COPIES = 16          # weight copies per call cycle (sparsecc.runtime.timing.ROTATE_BYTES together)


def unstructured_weight(n: int, k: int, density: float, dtype, gen) -> torch.Tensor:
    """Each element kept with probability ``density``, values ~ N(0, 1/(density K))."""
    mask = torch.rand(n, k, generator=gen) < density
    return (torch.randn(n, k, generator=gen) / (density * k) ** 0.5 * mask).to(dtype).cuda()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="*", default=["float16", "bfloat16"])
    parser.add_argument("--ms", nargs="*", type=int, default=MS)
    parser.add_argument("--densities", nargs="*", type=float, default=DENSITIES)
    parser.add_argument("--shapes", nargs="*", default=None, help="NxK, e.g. 4096x4096 (default: the six LLM/BERT shapes of kernels_gemm.py)")
    parser.add_argument("--no-cusparse", action="store_true", help="leave torch's cuSPARSE path out")
    parser.add_argument("--stem", default=None, help="results file name stem (default kernels_csr)")
    parser.add_argument("--no-tiled", action="store_true", help="leave sparsecc's tiled CSR kernels out")
    parser.add_argument("--tiled-only", action="store_true",
                        help="of sparsecc's kernels time only the tiled ones (no split, no CUDA-core kernel)")
    parser.add_argument("--residual-modes", action="store_true",
                        help="also time the split weight with each residual-pass mode forced")
    args = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    result = environment("kernels_csr")
    gen = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for n, k in shapes:
            bias = torch.randn(n, generator=gen).to(dtype).cuda()
            for density in args.densities:
                w = unstructured_weight(n, k, density, dtype, gen)
                packed = None if args.no_tiled else CSR_TILED.pack(w, CSR, None, progress=True)
                bitmap = None if args.no_tiled else BITMAP.pack(w, CSR, None, progress=True)
                spmm = (CSR_SPMM.pack(w, CSR, None, progress=True)
                        if density <= SPMM_MAX_DENSITY and not args.tiled_only else None)
                w_csr = None if args.no_cusparse else w.to_sparse_csr()
                for m in args.ms:
                    split = None if args.tiled_only else CSR_SPLIT.pack(w, CSR, m, progress=True)
                    result["rows"] += measure_point(w, w_csr, bias, packed, split, spmm, m, density, name, gen,
                                                    args.residual_modes, bitmap)
                del w_csr, packed, spmm, bitmap
            write(result, stem=args.stem)       # what a run cut short keeps
    path = write(result, stem=args.stem)
    plot(result, path.with_suffix(".png"))
    print_summary(result)
    print("wrote", path)
    return result


def measure_point(w, w_csr, bias, packed, split, spmm, m, density, name, gen, residual_modes,
                  bitmap=None) -> list[dict]:
    n, k = w.shape
    x = torch.randn(m, k, generator=gen).to(w.dtype).cuda()
    ref = torch.relu(x.float() @ w.float().t() + bias.float())
    impls = {"cublas": (lambda w: torch.relu(F.linear(x, w, bias)), (w,))}
    if packed is not None:
        impls["sparsecc-csr"] = (lambda v, e: linear_kernel(x, v, e, n, k, bias, "relu", False, False,
                                                            packed.kernels), (packed.values, packed.metadata))
    if bitmap is not None:
        impls["sparsecc-bitmap"] = (lambda v, e: linear_kernel(x, v, e, n, k, bias, "relu", False, False,
                                                               bitmap.kernels), (bitmap.values, bitmap.metadata))
    if spmm is not None:
        impls["sparsecc-csr-spmm"] = (lambda v, e: linear_kernel(x, v, e, n, k, bias, "relu", False, False,
                                                                 spmm.kernels), (spmm.values, spmm.metadata))
    residuals = {"sparsecc-csr-split": split.residual} if split is not None else {}
    if residual_modes and split is not None and split.residual:
        symbol = split.residual.rsplit(":", 1)[0]
        residuals.update({f"sparsecc-csr-split-{name}": f"{symbol}:{mode}"
                          for name, mode in (("gather", GATHER), ("staged", STAGED), ("transposed", TRANSPOSED))})
    for impl, residual in residuals.items():
        impls[impl] = ((lambda v, e, rv, ri, residual=residual:
                        linear_split(x, v, e, rv, ri, n, k, bias, "relu", False, False, split.main.kernels, residual)),
                       tuple(split.tensors().values()))
    if w_csr is not None:
        impls["torch-csr-cusparse"] = (lambda s: torch.relu(torch.sparse.mm(s, x.t()).t() + bias), (w_csr,))
    base = {"M": m, "N": n, "K": k, "dtype": name, "epilogue": "bias+relu", "density": density}
    point = []
    for impl, (call, tensors) in impls.items():
        row = {"impl": impl, "format": "dense" if impl == "cublas" else "csr", **base,
               "nbytes": (w.numel() * w.element_size() if impl == "cublas" else
                          packed.nbytes if impl == "sparsecc-csr" else
                          bitmap.nbytes if impl == "sparsecc-bitmap" else
                          spmm.nbytes if impl == "sparsecc-csr-spmm" else
                          split.nbytes if impl.startswith("sparsecc-csr-split") else
                          sum(t.numel() * t.element_size() for t in (w_csr.crow_indices(), w_csr.col_indices(),
                                                                     w_csr.values())))}
        if impl.startswith("sparsecc-csr-split"):
            row.update(residual_entries=split.residual_entries, residual=residuals[impl].rsplit(":", 1)[-1] or None,
                       main_kernels=type(split.main).__name__)
        try:
            fn, copies = (rotating(call, *tensors, max_copies=MAX_COPIES) if impl != "torch-csr-cusparse"
                          else ((lambda: call(w_csr)), 1))
            row["rel_err"] = relative_error(fn(), ref)
            row["us_eager"] = time_eager_us(fn)
            if impl == "torch-csr-cusparse":    # reads back to the host: cannot be captured
                row["us"], row["graph"] = row["us_eager"], False
            else:
                row["us"], row["graph"] = time_graph_us(fn, calls=copies), True
            row["copies"] = copies
        except Exception as error:  # noqa: BLE001 - recorded in the results
            failed(row, error)
        point.append(row)
    print(f"{name:8s} M={m:5d} N={n:5d} K={k:5d} d={density:<5g} " + " ".join(
        f"{r['impl']}={r['us']:8.1f}" if r["us"] else f"{r['impl']}=   -    " for r in point), flush=True)
    return point


def speedups(result: dict, impl: str, dtype: str, over: str = "cublas", key: str = "us") -> dict:
    """``over``'s time / ``impl``'s time per (M, N, K, density)."""
    def point(r):
        return (r["M"], r["N"], r["K"], r["density"])
    rows = [r for r in result["rows"] if r["dtype"] == dtype and r.get(key)]
    base = {point(r): r[key] for r in rows if r["impl"] == over}
    return {point(r): base[point(r)] / r[key] for r in rows if r["impl"] == impl and point(r) in base}


#: sparsecc's CSR kernels, each timed at every point (the CUDA-core one up to its density limit)
CSR_KERNELS = ("sparsecc-csr", "sparsecc-csr-split", "sparsecc-csr-spmm")


def fastest(result: dict, dtype: str, over: str = "cublas") -> dict:
    """Per point, the speedup of the fastest sparsecc CSR kernel: what compile runs, since it
    times them on each weight (sparsecc.kernels.registry.pack_unstructured)."""
    each = [speedups(result, impl, dtype, over) for impl in CSR_KERNELS]
    return {p: max(s.get(p, 0.0) for s in each) for p in set().union(*each)}


def print_summary(result: dict) -> None:
    """Per sparsecc CSR kernel (and the fastest of them), dtype, M and density: the speedup
    over cuBLAS (all shapes and N, K >= 4096) and the smallest speedup over cuSPARSE."""
    for impl in (*CSR_KERNELS, "sparsecc-bitmap", "fastest"):
        for dtype in sorted({r["dtype"] for r in result["rows"]}):
            data, vs_cusparse = ((fastest(result, dtype), fastest(result, dtype, over="torch-csr-cusparse"))
                                 if impl == "fastest" else
                                 (speedups(result, impl, dtype), speedups(result, impl, dtype, over="torch-csr-cusparse")))
            for m, density in sorted({(p[0], p[3]) for p in data}):
                here = {p: s for p, s in data.items() if (p[0], p[3]) == (m, density)}
                big = [s for p, s in here.items() if min(p[1], p[2]) >= 4096]
                cus = [s for p, s in vs_cusparse.items() if (p[0], p[3]) == (m, density)]
                print(f"{impl:18s} {dtype:8s} M={m:<5d} d={density:<5g} over cuBLAS: geomean "
                      f"{geomean(here.values()):.2f} min {min(here.values()):.2f}; N,K>=4096: min "
                      f"{min(big, default=math.nan):.2f}; over cuSPARSE: min {min(cus, default=math.nan):.1f}")


def plot(result: dict, path) -> None:
    def draw(ax, dtype):
        for impl, style in (("sparsecc-csr-split", "-s"), ("sparsecc-csr-spmm", "-^"), ("sparsecc-csr", "-o"),
                            ("sparsecc-bitmap", "-D"), ("torch-csr-cusparse", ":x")):
            data = speedups(result, impl, dtype)
            for m in sorted({p[0] for p in data}):
                densities = sorted({p[3] for p in data if p[0] == m})
                means = [geomean(s for p, s in data.items() if (p[0], p[3]) == (m, d)) for d in densities]
                ax.plot(densities, means, style, label=f"{impl} M={m}", alpha=0.8)
    plot_per_dtype(result, path, draw, xlabel="density",
                   title="speedup over cuBLAS (graph replay, geomean over shapes)")


if __name__ == "__main__":
    main()
