"""Two block rows per CTA for the wgmma BSR kernel at large batch (issue: BSR/CSR kernels).

Times the pairs kernel (``templates/bsr_sm90_pairs.cu.j2``: a CTA takes two block rows of W and
the union of their block columns, W as wgmma's A operand, 128 or 256 rows of x as its N) at
each of ``--tiles`` against cuBLAS + ReLU and the dispatched kernel (as sparsecc.bsr_kernel
chooses: the one-row ``bsr_sm90_wgmma`` when the results of 2026-11-26 were taken, from a
prototype of this template without the NaN/Inf guard; the pairs kernel itself since where it
runs), all unchecked (no NaN/Inf pass), graph replay, one process, fp16 unless ``--dtype``.
Also checks the pairs kernel on odd shapes (an odd number of block rows, M not a multiple of
the tile, empty block rows) against fp32. Writes bsr_pairs.json to $OUT.

    OUT=/tmp python benchmarks/lab/bsr_pairs.py [--ms 2048 8192] [--shapes NxK ...]
        [--densities D ...] [--tiles 128 256] [--blocks 64x64 64x32]
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
from sparsecc.bsr_kernel import BsrKernelWeight  # noqa: E402
from sparsecc.codegen import Family, KernelSpec  # noqa: E402
from sparsecc.epilogue import ACTIVATION_CODES, UNCHECKED_NONFINITE  # noqa: E402

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]
DENSITIES = [0.5, 0.25, 0.1, 0.05]


def pairs_call(kernel, packed, x, bias, activation="relu"):
    """The pairs kernel on ``packed`` (its metadata's pair section), unchecked."""
    m, n, k = x.shape[0], packed.out_features, packed.in_features
    values, meta, pairs_at = packed.values.cuda(), packed.metadata.cuda(), packed.pairs_at
    y = torch.empty(m, n, dtype=x.dtype, device="cuda")

    def run():
        kernel.gemm(values.data_ptr(), meta.data_ptr(), x.data_ptr(), bias.data_ptr(), y.data_ptr(), n, m, k,
                    ACTIVATION_CODES[activation] | UNCHECKED_NONFINITE, torch.cuda.current_stream().cuda_stream,
                    splits=pairs_at)
        return y
    return run


def dispatched_call(packed, x, bias, n, k, values, meta):
    """sparsecc's dispatched kernel for this weight and M, unchecked."""
    table = packed.launches()
    text = gpu.dispatch_string(table, UNCHECKED_NONFINITE)
    runtime.ensure([launch.spec for _, launch in table], progress=False)
    return lambda: gpu.linear_kernel(x, values, meta, n, k, bias, "relu", False, False, text)


def weight_with_empty_rows(n, k, block, density, dtype, gen):
    w = block_weight(n, k, block[0], density, dtype, gen)
    w[: block[0]] = 0                          # an empty block row (the first pair: one row only)
    w[3 * block[0]: 5 * block[0]] = 0          # a pair of empty rows (rows 3 and 4 straddle pairs 1, 2)
    return w


def check(kernels, dtype, gen):
    """Odd shapes against fp32: an odd number of block rows, M off the tile, empty rows."""
    errors = []
    for spec, kernel in kernels.items():
        block = spec.tile[:2]
        for n, k, m, activation in [(64 * 9, 512, 1000, "relu"), (64 * 8, 64 * 5, 7, "gelu"),
                                    (64 * 3, 1024, 333, "none")]:
            w = weight_with_empty_rows(n, k, block, 0.4, dtype, gen)
            x = torch.randn(m, k, generator=gen).to(dtype).cuda()
            bias = torch.randn(n, generator=gen).to(dtype).cuda()
            packed = BsrKernelWeight.pack(w, block)
            act = {"relu": torch.relu, "gelu": F.gelu, "none": lambda t: t}[activation]
            ref = act(x.float() @ w.float().t() + bias.float())
            y = pairs_call(kernel, packed, x, bias, activation)()
            torch.cuda.synchronize()
            errors.append({"kernel": spec.symbol, "N": n, "K": k, "M": m, "activation": activation,
                           "rel_err": rel_err(y, ref)})
            print("check", errors[-1], flush=True)
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", nargs="*", type=int, default=[2048, 8192])
    parser.add_argument("--shapes", nargs="*", default=None)
    parser.add_argument("--densities", nargs="*", type=float, default=DENSITIES)
    parser.add_argument("--tiles", nargs="*", type=int, default=[128, 256])
    parser.add_argument("--blocks", nargs="*", default=["64x64"])
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    blocks = [tuple(int(v) for v in b.split("x")) for b in args.blocks]
    specs = [KernelSpec(Family.BSR_SM90_PAIRS, args.dtype, tile=(*b, t)) for b in blocks for t in args.tiles]
    kernels = runtime.ensure(specs, progress=False)
    gen = torch.Generator().manual_seed(0)
    result = {"check": check(kernels, dtype, gen), "rows": []}
    for block in blocks:
        for n, k in shapes:
            for density in args.densities:
                w = block_weight(n, k, block[0], density, dtype, gen)
                packed = BsrKernelWeight.pack(w, block)
                values, meta = packed.values.cuda(), packed.metadata.cuda()
                for m in args.ms:
                    x = torch.randn(m, k, generator=gen).to(dtype).cuda()
                    bias = torch.randn(n, generator=gen).to(dtype).cuda()
                    ref = torch.relu(x.float() @ w.float().t() + bias.float())
                    calls = {"cublas": lambda: torch.relu(F.linear(x, w, bias)),
                             "dispatched": dispatched_call(packed, x, bias, n, k, values, meta)}
                    for spec, kernel in kernels.items():
                        if tuple(spec.tile[:2]) == block:
                            calls[f"pairs{spec.tile[2]}"] = pairs_call(kernel, packed, x, bias)
                    row = {"N": n, "K": k, "M": m, "density": density, "block": list(block)}
                    for name, fn in calls.items():
                        row[name + "_err"] = rel_err(fn(), ref)
                        row[name] = time_graph_us(fn)
                    row["speedups"] = {name: round(row["cublas"] / row[name], 2) for name in calls if name != "cublas"}
                    result["rows"].append(row)
                    print(block, n, k, density, m, f"cublas {row['cublas']:.1f}", row["speedups"],
                          {name: f"{row[name + '_err']:.1e}" for name in calls}, flush=True)
    write_lab(result, "bsr_pairs")


if __name__ == "__main__":
    main()
