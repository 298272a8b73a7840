"""Harness of the tensor-core small-batch 2:4 prototype (sparse24_mma_small_batch.cu, see
README.md here): for random 2:4 weights on the six shapes of benchmarks/kernels.py and M in
{1, 2, 4, 8, 16, 32, 64}, every tiling's relative error against an fp32 reference (linear + bias
+ ReLU), NaN and Inf of x reaching y as in dense, and CUDA-graph replay time per call with every
call on its own copy of the weight (no L2 reuse), against cuBLAS F.linear + ReLU and sparsecc's
current path for that M (the small-batch kernel at M=1, else the 2:4 GEMM) in the same process.
Writes sparse24_mma_small_batch.json to $OUT.

    for p in 0 1 2 3 4 5 6; do nvcc -std=c++17 -O3 -arch=sm_90a -shared -Xcompiler -fPIC -DPART=$p \\
        -I $CUTLASS/include -o benchmarks/lab/sparse24_mma_small_batch_$p.so \\
        benchmarks/lab/sparse24_mma_small_batch.cu & done; wait
    OUT=/tmp python benchmarks/lab/sparse24_mma_small_batch.py [--quick]
"""
import ctypes
import glob
import itertools
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import environment, rel_err, time_graph_us  # noqa: E402
from kernels import SHAPES, two_four  # noqa: E402

from sparsecc import gpu  # noqa: E402
from sparsecc.timing import copies_for  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LIBS = [ctypes.CDLL(path) for path in sorted(glob.glob(os.path.join(HERE, "sparse24_mma_small_batch_*.so")))]
MS = [1, 2, 4, 8, 16, 32, 64]


def entry(name):
    for lib in LIBS:
        try:
            return getattr(lib, name)
        except AttributeError:
            continue
    return None


def mma_layout(weight: torch.Tensor) -> torch.Tensor:
    """The prototype's weight layout (see the .cu file) from a 2:4 [N, K] weight: the same units
    as sparsecc.gpu.Sparse24GemvWeight (which took this layout over), values and metadata of each
    unit side by side (N % 16 == 0, K % 64 == 0)."""
    packed = gpu.Sparse24GemvWeight.pack(weight)
    tiles, units = packed.values.shape[:2]
    return torch.cat([packed.values.view(torch.uint8).reshape(tiles, units, 1024),
                      packed.metadata.view(torch.uint8).reshape(tiles, units, 128)], dim=-1).contiguous()


def call(fn, w, x, bias, y, relu=1):
    n, k = y.shape[1], x.shape[1]
    rc = fn(ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(bias.data_ptr()),
            ctypes.c_void_p(y.data_ptr()), n, x.shape[0], k, relu, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    if rc:
        raise RuntimeError(f"rc {rc}")
    return y


def nonfinite_ok(fn, w, w_mma, bias, k, dtype):
    """One NaN and one +Inf in x: y's NaN and Inf positions and finite values as dense gives them."""
    x = torch.randn(3, k, dtype=dtype, device="cuda")
    x[0, 5] = float("nan")
    x[2, k - 3] = float("inf")
    ref = torch.relu(F.linear(x.float(), w.float(), bias.float()))
    got = call(fn, w_mma, x, bias, torch.empty(3, w.shape[0], dtype=dtype, device="cuda")).float()
    same_nan = torch.equal(got.isnan(), ref.isnan())
    same_inf = torch.equal(got.isinf(), ref.isinf())
    finite = ref.isfinite()
    close = rel_err(got[finite], ref[finite]) < 1e-2
    return bool(same_nan and same_inf and close)


def main():
    quick = "--quick" in sys.argv
    out = os.environ.get("OUT", "/tmp")
    result = environment("sparse24_mma_small_batch")
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    result["copy_gbps"] = round(2 * src.numel() * 2 / time_graph_us(lambda: dst.copy_(src), calls=2) / 1e3, 1)
    src = dst = None      # 2 GiB back before the weights
    print("copy bandwidth", result["copy_gbps"], "GB/s", flush=True)
    gen = torch.Generator().manual_seed(0)
    plans = [("float16", "f16", SHAPES, MS)] + [("bfloat16", "bf16", SHAPES, [1, 4, 16])]
    start = time.time()
    for name, tag, shapes, ms in plans:
        dtype = getattr(torch, name)
        for n, k in (shapes[:2] + shapes[3:4] if quick else shapes):
            w = two_four(n, k, dtype, gen)
            bias = torch.randn(n, generator=gen).to(dtype).cuda()
            w_mma = mma_layout(w)
            gemm = gpu.CutlassSparse24Weight.from_dense(w)
            small = gpu.Sparse24GemvWeight.from_dense(w)
            copies = copies_for(w.numel() * w.element_size())
            dense_w = [w] + [w.clone() for _ in range(copies - 1)]
            mma_w = [w_mma] + [w_mma.clone() for _ in range(copies - 1)]
            gemm_w = [(gemm.values, gemm.metadata)] + [(gemm.values.clone(), gemm.metadata.clone()) for _ in range(copies - 1)]
            small_w = [(small.values, small.metadata)] + [(small.values.clone(), small.metadata.clone())
                                                          for _ in range(copies - 1)]
            turn = itertools.count()
            for m in ms:
                x = torch.randn(m, k, generator=gen).to(dtype).cuda()
                ref = torch.relu(x.float() @ w.float().t() + bias.float())
                y = torch.empty(m, n, dtype=dtype, device="cuda")
                base = {"M": m, "N": n, "K": k, "dtype": name, "copies": copies}

                def row(impl, fn, **extra):
                    got = fn()
                    r = {"impl": impl, **base, "rel_err": rel_err(got, ref), "us": time_graph_us(fn, calls=max(10, copies)),
                         **extra}
                    result["rows"].append(r)
                    return r
                cublas = row("cublas", lambda: torch.relu(F.linear(x, dense_w[next(turn) % copies], bias)))
                if m == 1:
                    current = row("sparsecc-small-batch", lambda: gpu.linear_kernel(
                        x, *small_w[next(turn) % copies], n, k, bias, "relu", False, False, small.kernels))
                else:
                    current = row("sparsecc-gemm", lambda: gpu.linear_kernel(
                        x, *gemm_w[next(turn) % copies], n, k, bias, "relu", False, False, gemm.kernels))
                mt = max(1, 1 << math.ceil(math.log2(max(1, math.ceil(m / 8)))))
                best = None
                labels = [f"mma24_{tag}_w{warps}_c{cluster}_mt{mt}_u{u}"
                          for warps, cluster, u in itertools.product((4, 8), (2, 4, 8, 16), (2, 4))]
                if m <= 8:      # v2: x loaded by each lane, no staging
                    labels += [f"mma24d_{tag}_w{warps}_c{cluster}_r{r}_u{u}" for warps in (4, 8)
                               for cluster, r, u in ((1, 1, 4), (2, 1, 4), (4, 1, 4), (1, 2, 4), (2, 2, 4), (4, 2, 4), (1, 1, 2))]
                for label in labels:
                    fn = entry(label)
                    if fn is None:
                        continue
                    try:
                        r = row("sparsecc-mma", lambda: call(fn, mma_w[next(turn) % copies], x, bias, y), config=label)
                    except RuntimeError as error:
                        result["rows"].append({"impl": "sparsecc-mma", **base, "config": label, "error": str(error)})
                        continue
                    r["gbps"] = round((w_mma.numel() + x.numel() * 2 + y.numel() * 2) / r["us"] / 1e3, 1)
                    if r["rel_err"] < (3e-3 if name == "float16" else 1e-2) and (best is None or r["us"] < best["us"]):
                        best = r
                if best is None:
                    print(f"{name} M={m:2d} {n:5d}x{k:5d}: no correct tiling", flush=True)
                    continue
                best["best"] = True
                best["nonfinite_ok"] = nonfinite_ok(entry(best["config"]), w, w_mma, bias, k, dtype)
                print(f"{name} M={m:2d} {n:5d}x{k:5d}: cublas {cublas['us']:6.1f}  current {current['us']:6.1f}  "
                      f"mma {best['us']:6.1f} ({best['config']}, {best['gbps']:.0f} GB/s = "
                      f"{best['gbps'] / result['copy_gbps']:.0%} of copy, err {best['rel_err']:.1e}, "
                      f"nonfinite {'ok' if best['nonfinite_ok'] else 'WRONG'}): {cublas['us'] / best['us']:.2f}x cuBLAS, "
                      f"{current['us'] / best['us']:.2f}x current  [{time.time() - start:.0f} s]", flush=True)
                for variant in ("mma24_", "mma24d_"):
                    ok = [r for r in result["rows"] if r.get("config", "").startswith(variant) and r["M"] == m
                          and r["N"] == n and r["K"] == k and r["dtype"] == name and "us" in r]
                    if ok:
                        v = min(ok, key=lambda r: r["us"])
                        print(f"    best {variant:7s} {v['us']:6.1f} us {v['config']} err {v['rel_err']:.1e}", flush=True)
            with open(os.path.join(out, "sparse24_mma_small_batch.json"), "w") as handle:
                json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
