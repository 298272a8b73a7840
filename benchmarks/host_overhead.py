"""Host time per call on a tiny problem (M=1, N=K=256, fp16), where the GPU work is
negligible, so the time is what the host spends to launch: cuBLAS ``F.linear`` + ReLU,
sparsecc's 2:4 op (``sparsecc::linear_kernel`` on its C++ launcher, as a compiled graph calls
it), the op's Python implementation called directly (the fallback where the launcher cannot be
built), the raw kernel call underneath (ctypes, output preallocated), and the op replayed from
a captured CUDA graph. Extra key: ``us_host``.

    python benchmarks/host_overhead.py
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import environment, write  # noqa: E402

from sparsecc import gpu  # noqa: E402
from sparsecc.epilogue import ACTIVATION_CODES  # noqa: E402


def per_call_us(fn, calls=3000) -> float:
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> dict:
    n = k = 256
    result = environment("host_overhead")
    result["launcher"] = None
    w = torch.randn(n, k // 4, 4)
    w = (w * torch.zeros_like(w).scatter_(-1, w.abs().topk(2, -1).indices, 1)).reshape(n, k).half().cuda()
    bias = torch.randn(n, dtype=torch.float16, device="cuda")
    x = torch.randn(1, k, dtype=torch.float16, device="cuda")
    packed = gpu.CutlassSparse24Weight.from_dense(w)
    result["launcher"] = gpu.cuda_implementation()
    kernel, swizzle, splits, _ = gpu.kernel_for(packed.kernels, 1)
    y = torch.empty(1, n, dtype=torch.float16, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    relu = ACTIVATION_CODES["relu"]

    def op():
        return gpu.linear_kernel(x, packed.values, packed.metadata, n, k, bias, "relu", False, False, packed.kernels)

    def python_impl():
        return gpu._linear_kernel_python(x, packed.values, packed.metadata, n, k, bias, "relu", False, False,
                                         packed.kernels)

    def raw():
        kernel.gemm(packed.values.data_ptr(), packed.metadata.data_ptr(), x.data_ptr(), bias.data_ptr(), y.data_ptr(),
                    n, 1, k, relu, stream, swizzle=swizzle, splits=splits)

    graph = torch.cuda.CUDAGraph()
    op()
    with torch.cuda.graph(graph):
        for _ in range(10):
            op()
    impls = {"cublas": lambda: torch.relu(F.linear(x, w, bias)), "sparsecc": op,
             "sparsecc-python-impl": python_impl,
             "sparsecc-raw-kernel": raw, "sparsecc-graph-replay": None}
    for impl, fn in impls.items():
        us = per_call_us(graph.replay, calls=300) / 10 if fn is None else per_call_us(fn)
        result["rows"].append({"impl": impl, "format": "dense" if impl == "cublas" else "2:4", "M": 1, "N": n, "K": k,
                               "dtype": "float16", "epilogue": "bias+relu", "density": 0.5, "block": None,
                               "us": None, "us_eager": None, "rel_err": None, "us_host": round(us, 2)})
        print(f"{impl:24s} {us:7.2f} us per call")
    print("wrote", write(result))
    return result


if __name__ == "__main__":
    main()
