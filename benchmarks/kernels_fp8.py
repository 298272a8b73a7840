"""FP8 linear + bias + ReLU on the GPU, side by side in one process:

- ``cublas``: torch ``F.linear`` (cuBLAS) then ``relu`` on the fp16/bf16 weight the FP8 weight
  stands for (``W_q * s_w``): what the layer cost before ``sparsecc.quantize``,
- ``sparsecc-fp8``: ``sparsecc::linear_fp8_scaled_mm``, what a compiled quantized site runs on
  the GPU: the input rounded to e4m3 per token, ``torch._scaled_mm`` with the bias, the ReLU,
- ``torch-scaled-mm``: ``torch._scaled_mm`` alone on an input already in e4m3 (bias fused, no
  ReLU): the GEMM without the input's quantization, what a fused quantize kernel could approach,
- ``sparsecc-fp8-24``: ``sparsecc::linear_fp8_kernel``, what a quantized site compiled with
  ``formats=("2:4",)`` runs on Hopper: the FP8 2:4 CUTLASS GEMM (x rounded to e4m3 by its own
  first kernel, the scales, bias and ReLU in its epilogue), on the same weight pruned 2:4 before
  quantizing (its ``rel_err`` against the reference op on that weight), tuned at each M as
  ``compile`` tunes it, in a table of the run's own,
- ``sparsecc-fp8-reference``: ``sparsecc::linear_fp8``, the reference op (fp32 product).

At M <= 64 every call reads its own copy of its weight (common.rotating), from memory as in a
model's decode step. Rows carry ``us`` (CUDA-graph replay), ``us_eager``, ``rel_err`` (the FP8
rows against the reference op's output, ``cublas`` against the fp32 product of its weight) and
``nbytes`` (the weight's bytes). Writes benchmarks/results/kernels_fp8-<gpu>-<date>.json and a
plot beside it.

    python benchmarks/kernels_fp8.py [--dtypes float16] [--ms 1 16 2048] [--shapes 4096x4096]
"""
from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import (environment, failed, plot_per_dtype, private_tuning, relative_error, rotating,  # noqa: E402
                    time_eager_us, time_graph_us, write)

from sparsecc.ir.formats import NM_2_4  # noqa: E402
from sparsecc.ir.quant import dequantize, quantize_input, quantize_weight  # noqa: E402
from sparsecc.kernels.sparse24_fp8 import SPARSE24_FP8  # noqa: E402
from sparsecc.pruning.masks import nm_mask  # noqa: E402
from sparsecc.runtime.kernel_op import linear_fp8_kernel  # noqa: E402
from sparsecc.runtime.torch_ops import linear_fp8, linear_fp8_scaled_mm, scaled_mm_refusal  # noqa: E402

SHAPES = [(11008, 4096), (4096, 11008), (4096, 4096), (3072, 768), (768, 3072), (1024, 4096)]
MS = [1, 16, 128, 2048, 8192]


def shape(text: str) -> tuple[int, int]:
    """``NxK`` as ``(N, K)``."""
    n, k = (int(v) for v in text.lower().split("x"))
    return n, k


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="*", default=["float16", "bfloat16"])
    parser.add_argument("--ms", nargs="*", type=int, default=MS)
    parser.add_argument("--shapes", nargs="*", type=shape, default=SHAPES, help="NxK, e.g. 4096x4096")
    parser.add_argument("--no-reference", action="store_true", help="leave the reference op out")
    args = parser.parse_args(argv)
    private_tuning("kernels_fp8")              # the FP8 2:4 GEMM tuned as compile tunes it, in a table of its own
    result = environment("kernels_fp8")
    gen = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for n, k in args.shapes:
            why_not = scaled_mm_refusal("cuda", (n, k), dtype)
            if why_not:
                print(f"{name} {n}x{k}: {why_not}; skipped")
                continue
            full = torch.randn(n, k, generator=gen) / k ** 0.5
            weight, weight_scale = quantize_weight(full)
            weight, weight_scale = weight.cuda(), weight_scale.cuda()
            dense = dequantize(weight, weight_scale).to(dtype)
            bias = (torch.randn(n, generator=gen) * 0.1).to(dtype).cuda()
            pruned = quantize_weight(full * nm_mask(full, 2, 4))         # the same weight, pruned 2:4
            for m in args.ms:
                result["rows"] += measure_point(weight, weight_scale, dense, bias, m, name, gen, not args.no_reference,
                                                tuple(t.cuda() for t in pruned))
        path = write(result)                 # after every dtype: a time limit loses nothing done
    plot(result, path.with_suffix(".png"))
    print("wrote", path)
    return result


def measure_point(weight, weight_scale, dense, bias, m, name, gen, reference, pruned) -> list[dict]:
    n, k = weight.shape
    dtype = dense.dtype
    x = torch.randn(m, k, generator=gen).to(dtype).cuda()
    x_q, x_scale = quantize_input(x, None)
    scale_b = weight_scale.reshape(1, n)
    fp8_ref = linear_fp8(x, weight, weight_scale, None, bias, "relu", False, False)
    impls = {
        "cublas": (lambda w: torch.relu(F.linear(x, w, bias)), (dense,),
                   torch.relu(x.float() @ dense.float().t() + bias.float())),
        "sparsecc-fp8": (lambda w, s: linear_fp8_scaled_mm(x, w, s, None, bias, "relu", False, False),
                         (weight, weight_scale), fp8_ref),
        "torch-scaled-mm": (lambda w, s: torch._scaled_mm(x_q, w.t(), scale_a=x_scale, scale_b=s.reshape(1, n),
                                                          bias=bias, out_dtype=dtype, use_fast_accum=False),
                            (weight, scale_b), None),
    }
    try:
        packed = SPARSE24_FP8.pack(pruned[0], NM_2_4, m, input_dtype=dtype, tune_range=(m, m))
        impls["sparsecc-fp8-24"] = (
            lambda values, metadata: linear_fp8_kernel(x, values, metadata, pruned[1], None, n, k, bias, "relu", False,
                                                       False, packed.kernels),
            (packed.values, packed.metadata), linear_fp8(x, *pruned, None, bias, "relu", False, False))
    except Exception as error:  # noqa: BLE001 - the other rows still run; this one says why not
        print(f"sparsecc-fp8-24 at {n}x{k}: {str(error).splitlines()[0]}")
    if reference:
        impls["sparsecc-fp8-reference"] = (lambda w, s: linear_fp8(x, w, s, None, bias, "relu", False, False),
                                           (weight, weight_scale), fp8_ref)
    point = []
    for impl, (call, tensors, ref) in impls.items():
        sparse = impl == "sparsecc-fp8-24"
        row = {"impl": impl, "format": "dense" if impl == "cublas" else ("fp8-2:4" if sparse else "fp8"), "M": m,
               "N": n, "K": k, "dtype": name, "epilogue": "bias" if impl == "torch-scaled-mm" else "bias+relu",
               "density": 0.5 if sparse else 1.0, "block": None,
               "nbytes": sum(t.numel() * t.element_size() for t in tensors[:2 if sparse else 1])}
        try:
            fn = rotating(call, *tensors)[0] if m <= 64 else (lambda: call(*tensors))
            row["rel_err"] = relative_error(fn(), ref) if ref is not None else None
            row["us"] = time_graph_us(fn)
            row["us_eager"] = time_eager_us(fn)
        except Exception as error:  # noqa: BLE001 - recorded in the results
            failed(row, error)
        point.append(row)
    print(f"{name:8s} M={m:5d} N={n:5d} K={k:5d} " + " ".join(
        f"{r['impl']}={r['us']:8.1f}" if r["us"] else f"{r['impl']}=   -    " for r in point), flush=True)
    return point


def plot(result: dict, path) -> None:
    def draw(ax, dtype):
        rows = [r for r in result["rows"] if r["dtype"] == dtype and r.get("us")]
        cublas = {(r["M"], r["N"], r["K"]): r["us"] for r in rows if r["impl"] == "cublas"}
        for impl, style in (("sparsecc-fp8", "-o"), ("torch-scaled-mm", ":x"), ("sparsecc-fp8-24", "-s")):
            speedup = {(r["M"], r["N"], r["K"]): cublas[(r["M"], r["N"], r["K"])] / r["us"]
                       for r in rows if r["impl"] == impl and (r["M"], r["N"], r["K"]) in cublas}
            ms = sorted({p[0] for p in speedup})
            means = [math.exp(sum(math.log(s) for p, s in speedup.items() if p[0] == m) /
                              sum(1 for p in speedup if p[0] == m)) for m in ms]
            ax.plot(ms, means, style, label=impl)
    plot_per_dtype(result, path, draw, xlabel="M (rows of x)",
                   title="speedup over cuBLAS fp16/bf16 (graph replay, geomean over shapes)")


if __name__ == "__main__":
    main()
