"""The 2:4 GEMM and the wgmma BSR kernel of the current templates against those of an earlier
build, in one process (written for the non-finite guard, sparsecc.nonfinite_guard, against the
pass that read all of x after every product; used since for later changes of the same kernels),
each with NaN/Inf propagation on ("checked") and off ("unchecked"), against cuBLAS + ReLU;
graph replay, fp16, linear + bias + ReLU. The earlier build's libraries are DIR/<symbol>.so
(same entry points); a build without the guard ignores the words after the metadata. BSR
weights are packed with their empty block columns covered by blocks of zeros (as compile packs
them for the wgmma kernel); "current-listed" is the current kernel on the packing without them
(the pass then reads those columns of x on every call). Writes nonfinite_guard_ab.json to $OUT.

    OUT=/tmp python benchmarks/lab/nonfinite_guard_ab.py --previous DIR [--formats 2:4 bsr]
        [--points 4096x1024x1024 ...] [--schedules]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import environment, rel_err, time_graph_us, write_lab  # noqa: E402
from kernels import SHAPES, shape, two_four  # noqa: E402
from kernels_bsr import block_weight  # noqa: E402

from sparsecc import gpu, runtime  # noqa: E402
from sparsecc.bsr_kernel import BsrKernelWeight  # noqa: E402
from sparsecc.bsr_kernel import dispatch as bsr_dispatch  # noqa: E402
from sparsecc.codegen import Family, KernelSpec  # noqa: E402
from sparsecc.epilogue import ACTIVATION_CODES, UNCHECKED_NONFINITE  # noqa: E402

MS = [2048, 8192]
BSR_DENSITIES = [0.5, 0.1]
BLOCK = 64


def point(text: str) -> tuple[int, int, int]:
    """``"MxNxK"`` -> (M, N, K), for ``--points``: rows of x, then a weight shape as kernels.py's
    ``--shapes`` takes it."""
    m, _, weight = text.lower().partition("x")
    if not m.isdigit():
        raise argparse.ArgumentTypeError(f"a point is MxNxK (rows x out x in features), not {text!r}")
    return (int(m), *shape(weight))


def variants(launch, previous_dir, values, metadata, x, bias, y, n, k):
    """current/previous x checked/unchecked: calls of the launch's kernel writing y."""
    current = runtime.ensure([launch.spec], progress=False)[launch.spec]
    kernels = {"current": current}
    path = os.path.join(previous_dir, f"{launch.spec.symbol}.so")
    if os.path.isfile(path):
        kernels["previous"] = runtime.Kernel(launch.spec, path)
    m = x.shape[0]
    workspace = torch.empty(max(current.workspace_size(n, m, k, launch.swizzle, launch.splits), 1),
                            dtype=torch.uint8, device="cuda")
    calls = {}
    for build, kernel in kernels.items():
        for mode, flags in (("checked", 0), ("unchecked", UNCHECKED_NONFINITE)):
            def call(kernel=kernel, flags=flags):
                kernel.gemm(values.data_ptr(), metadata.data_ptr(), x.data_ptr(), bias.data_ptr(), y.data_ptr(), n, m,
                            k, ACTIVATION_CODES["relu"] | flags, torch.cuda.current_stream().cuda_stream,
                            swizzle=launch.swizzle, splits=launch.splits, workspace=workspace.data_ptr())
                return y
            calls[f"{build}-{mode}"] = call
    return calls


def measure(calls, ref, row):
    for name, fn in calls.items():
        row[name + "_err"] = rel_err(fn().clone(), ref)
        row[name] = time_graph_us(fn)
    row["speedups"] = {name: round(row["cublas"] / row[name], 3) for name in calls if name != "cublas"}
    print(row["format"], row["N"], row["K"], row["M"], row.get("density"), f"cublas {row['cublas']:.1f}",
          row["speedups"], flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--previous", metavar="DIR", required=True)
    parser.add_argument("--ms", nargs="*", type=int, default=MS)
    parser.add_argument("--formats", nargs="*", default=["2:4", "bsr"])
    parser.add_argument("--points", nargs="*", type=point, metavar="MxNxK",
                        help="2:4 only: these points instead of SHAPES x --ms (e.g. a model's shapes)")
    parser.add_argument("--schedules", action="store_true",
                        help="2:4: besides the dispatched launch, the 128x128x128 cooperative and pingpong ones")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    result = environment("nonfinite_guard_ab")
    result["rows"] = rows = []
    points = args.points or [(m, n, k) for n, k in SHAPES for m in args.ms]
    for n, k in dict.fromkeys((n, k) for _, n, k in points) if "2:4" in args.formats else []:
        w = two_four(n, k, torch.float16, gen)
        bias = torch.randn(n, generator=gen).half().cuda()
        packed = gpu.CutlassSparse24Weight.from_dense(w)
        for m in [mm for mm, nn, kk in points if (nn, kk) == (n, k)]:
            x = torch.randn(m, k, generator=gen).half().cuda()
            y = torch.empty(m, n, dtype=x.dtype, device="cuda")
            launch = gpu.launch_for(gpu.dispatch(Family.SM90_SPARSE24, torch.float16, n, k), m)
            launches = {"": launch}
            if args.schedules:
                launches.update({f"{name}-": gpu.Launch(KernelSpec(Family.SM90_SPARSE24, "float16", tile=(128, 128, 128),
                                                                   schedule=name)) for name in ("cooperative", "pingpong")})
            calls = {"cublas": lambda: torch.relu(F.linear(x, w, bias))}
            for prefix, each in launches.items():
                calls.update({prefix + name: call for name, call in
                              variants(each, args.previous, packed.values, packed.metadata, x, bias, y, n, k).items()})
            ref = torch.relu(x.float() @ w.float().t() + bias.float())
            rows.append(measure(calls, ref, {"format": "2:4", "N": n, "K": k, "M": m, "launch": launch.spec.symbol}))
    for n, k in SHAPES if "bsr" in args.formats else []:
        for density in BSR_DENSITIES:
            w = block_weight(n, k, BLOCK, density, torch.float16, gen)
            bias = torch.randn(n, generator=gen).half().cuda()
            packed = BsrKernelWeight.pack(w, (BLOCK, BLOCK))
            values, metadata = packed.values.cuda(), packed.metadata.cuda()
            listed = BsrKernelWeight.pack(w, (BLOCK, BLOCK), cover_columns=False)
            for m in args.ms:
                x = torch.randn(m, k, generator=gen).half().cuda()
                y = torch.empty(m, n, dtype=x.dtype, device="cuda")
                launch = gpu.launch_for(bsr_dispatch(torch.float16, (BLOCK, BLOCK)), m)
                calls = {"cublas": lambda: torch.relu(F.linear(x, w, bias))}
                calls.update(variants(launch, args.previous, values, metadata, x, bias, y, n, k))
                listed_calls = variants(launch, "", listed.values.cuda(), listed.metadata.cuda(), x, bias, y, n, k)
                calls["current-listed"] = listed_calls["current-checked"]
                ref = torch.relu(x.float() @ w.float().t() + bias.float())
                rows.append(measure(calls, ref, {"format": "bsr64", "N": n, "K": k, "M": m, "density": density,
                                                 "launch": launch.spec.symbol, "covering_blocks":
                                                 packed.values.shape[0] - listed.values.shape[0]}))
    write_lab(result, "nonfinite_guard_ab")


if __name__ == "__main__":
    main()
