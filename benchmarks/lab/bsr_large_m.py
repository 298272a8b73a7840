"""The wgmma BSR kernel at large batch (issue: BSR/CSR kernels): every rows-of-x tile it takes
(64, 128, 256), NaN/Inf pass off, against cuBLAS + the activation as a separate op, 64x64
blocks, fp16, graph replay in one process. By default density 0.5 / 0.25 / 0.1, M = 8192 and
ReLU; ``--m``, ``--shapes``, ``--densities``, ``--tiles`` and ``--activations`` choose others;
``--splits`` the tiles of x per CTA (default: as the dispatch chooses for each weight).
Each row also gives the bandwidth the kernel reaches on the bytes it cannot avoid (x read once,
y written once, the stored blocks), ``*_gbs``. ``--previous DIR`` also times an earlier build
of the kernel (DIR/tile<T>.so, same entry points) on the same data. Writes bsr_large_m.json to
$OUT. With ``--ncu`` it runs one launch of one configuration (for Nsight Compute) and nothing
else.

    OUT=/tmp python benchmarks/lab/bsr_large_m.py [--m M] [--shapes NxK ...] [--densities D ...]
        [--tiles T ...] [--activations A ...] [--previous DIR] [--ncu N K DENSITY TILE_M]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import rel_err, time_graph_us, write_lab  # noqa: E402
from kernels_bsr import block_weight  # noqa: E402

from sparsecc import gpu, runtime  # noqa: E402
from sparsecc.bsr_kernel import BsrKernelWeight, launch_splits  # noqa: E402
from sparsecc.codegen import Family, KernelSpec  # noqa: E402
from sparsecc.epilogue import ACTIVATION_CODES, UNCHECKED_NONFINITE  # noqa: E402

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (768, 3072), (3072, 768)]
DENSITIES = [0.5, 0.25, 0.1]
TILES = [64, 128, 256]
M = 8192
BLOCK = 64


def spec(tile_m):
    return KernelSpec(Family.BSR_SM90_WGMMA, "float16", tile=(BLOCK, BLOCK, tile_m))


def kernels(tile_ms):
    """The current kernel at each rows-of-x tile, built."""
    runtime.ensure([spec(t) for t in tile_ms], progress=False)
    return {t: spec(t) for t in tile_ms}


def table(kernel_spec, packed, splits):
    """A one-launch dispatch table (NaN/Inf pass off); splits "auto": as sparsecc.bsr_kernel.dispatch
    chooses for this weight (two tiles of x per CTA for short block rows)."""
    if splits == "auto":
        splits = launch_splits(kernel_spec, packed.chunks_per_row)
    return gpu.dispatch_string([(0, gpu.Launch(kernel_spec, splits=int(splits)))], UNCHECKED_NONFINITE)


def previous_kernels(folder):
    """The earlier build's kernels, loaded beside the current ones (each library keeps its own symbols)."""
    paths = {t: os.path.join(folder, f"tile{t}.so") for t in TILES}
    return {t: runtime.Kernel(spec(t), path) for t, path in paths.items() if os.path.isfile(path)}


#: the epilogue's activation against its torch reference
ACTIVATIONS = {"none": lambda t: t, "relu": torch.relu, "gelu": F.gelu,
               "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


def point(n, k, density, specs, gen, m=M, previous=None, activation="relu", splits="auto"):
    w = block_weight(n, k, BLOCK, density, torch.float16, gen)
    bias = torch.randn(n, generator=gen).half().cuda()
    x = torch.randn(m, k, generator=gen).half().cuda()
    packed = BsrKernelWeight.pack(w, (BLOCK, BLOCK))
    values, meta = packed.values.cuda(), packed.metadata.cuda()
    act = ACTIVATIONS[activation]
    ref = act(x.float() @ w.float().t() + bias.float())
    calls = {"cublas": lambda: act(F.linear(x, w, bias))}
    for t, kernel_spec in specs.items():
        calls[f"tile{t}"] = (lambda text=table(kernel_spec, packed, splits): gpu.linear_kernel(
            x, values, meta, n, k, bias, activation, False, False, text))
    y = torch.empty(m, n, dtype=x.dtype, device="cuda")
    for t, kernel in (previous or {}).items():
        tiles = launch_splits(spec(t), packed.chunks_per_row) if splits == "auto" else int(splits)

        def run(kernel=kernel, tiles=tiles):       # (a build from before two-tile CTAs ignores splits)
            kernel.gemm(values.data_ptr(), meta.data_ptr(), x.data_ptr(), bias.data_ptr(), y.data_ptr(), n, m, k,
                        ACTIVATION_CODES[activation] | UNCHECKED_NONFINITE, torch.cuda.current_stream().cuda_stream,
                        splits=tiles)
            return y
        calls[f"previous{t}"] = run
    return calls, ref


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=M, help="rows of x")
    parser.add_argument("--shapes", nargs="*", default=None, help="NxK (default: the five of SHAPES)")
    parser.add_argument("--densities", nargs="*", type=float, default=DENSITIES)
    parser.add_argument("--tiles", nargs="*", type=int, default=TILES)
    parser.add_argument("--activations", nargs="*", default=["relu"], choices=list(ACTIVATIONS),
                        help="the epilogue's activation (cuBLAS gets the same as a separate op)")
    parser.add_argument("--splits", default="auto", choices=["auto", "1", "2"],
                        help="tiles of x per CTA (auto: as the dispatch chooses for the weight)")
    parser.add_argument("--previous", metavar="DIR", help="also time DIR/tile<T>.so, an earlier build")
    parser.add_argument("--ncu", nargs=4, metavar=("N", "K", "DENSITY", "TILE_M"),
                        help="run one launch of this configuration and nothing else")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    if args.ncu:
        n, k, density, tile = int(args.ncu[0]), int(args.ncu[1]), float(args.ncu[2]), int(args.ncu[3])
        calls, _ = point(n, k, density, kernels([tile]), gen)
        calls[f"tile{tile}"]()
        torch.cuda.synchronize()
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    specs = kernels(args.tiles)
    previous = previous_kernels(args.previous) if args.previous else {}
    rows = []
    for n, k in shapes:
        for density, activation in [(d, a) for d in args.densities for a in args.activations]:
            calls, ref = point(n, k, density, specs, gen, m=args.m, previous=previous, activation=activation,
                               splits=args.splits)
            row = {"N": n, "K": k, "M": args.m, "density": density, "activation": activation}
            unavoidable = (args.m * (n + k) + density * n * k) * 2       # bytes: x, y, stored blocks
            for name, fn in calls.items():
                row[name + "_err"] = rel_err(fn(), ref)
                row[name] = time_graph_us(fn)
                row[name + "_gbs"] = round(unavoidable / row[name] / 1e3, 1)
            row["speedups"] = {name: round(row["cublas"] / row[name], 2) for name in calls if name != "cublas"}
            rows.append(row)
            print(n, k, density, activation, f"cublas {row['cublas']:.1f}", row["speedups"],
                  "GB/s", {name: row[name + "_gbs"] for name in calls},
                  "errors", {name: f"{row[name + '_err']:.1e}" for name in calls}, flush=True)
    write_lab(rows, "bsr_large_m")


if __name__ == "__main__":
    main()
