"""Host time per call on a tiny problem (M=1, N=K=256, fp16), where the GPU work is
negligible, so the time is what the host spends to launch: cuBLAS ``F.linear`` + ReLU,
sparsecc's 2:4 op (``sparsecc::linear_kernel`` on its C++ launcher, as a compiled graph calls
it), the op's Python implementation called directly (the fallback where the launcher cannot be
built), the raw kernel call underneath (ctypes, output preallocated), and the op replayed from
a captured CUDA graph. For scale: torch's own cost of calling an op from Python
(``torch.ops.aten.relu.default``, one argument), and both linears called from C++ (a
TorchScript loop of 100 calls: the dispatcher, the op and the launch, without Python).
Then the same at M=2048, N=K=2048, where the GPU work is not negligible and the 2:4 op runs the
CUTLASS GEMM: the host time to issue a call (:func:`sparsecc.runtime.timing.host_us`: calls
back to back, nothing waits), what a prefill run op by op pays per site (``cublas-issue``,
``sparsecc-issue``). Extra key: ``us_host``. Run as a script it sets ``SPARSECC_TUNE=off`` and leaves this
machine's tuned launches out (common.fixed_dispatch): the 2:4 op runs the shipped tuning
table's launch, the same on every run.

    python benchmarks/host_overhead.py
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import bar_chart, environment, fixed_dispatch, write  # noqa: E402

if __name__ == "__main__":
    fixed_dispatch()        # SPARSECC_TUNE=off: the shipped table's launch (see the docstring)

from sparsecc.ir.epilogue import ACTIVATION_CODES  # noqa: E402
from sparsecc.ir.formats import NM_2_4  # noqa: E402
from sparsecc.kernels.sparse24_small import GEMM  # noqa: E402
from sparsecc.runtime import kernel_op  # noqa: E402
from sparsecc.runtime.kernel_op import cuda_implementation, kernel_for, linear_kernel  # noqa: E402
from sparsecc.runtime.timing import host_us  # noqa: E402


def per_call_us(fn, calls=3000, inner=1) -> float:
    """Host microseconds per call, the best of three loops (``fn`` makes ``inner`` calls)."""
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls / inner * 1e6)
    return best


@torch.jit.script
def _cublas_from_cpp(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, calls: int) -> torch.Tensor:
    y = x
    for _ in range(calls):
        y = torch.relu(torch.nn.functional.linear(x, w, bias))
    return y


@torch.jit.script
def _sparsecc_from_cpp(x: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor, n: int, k: int,
                       bias: torch.Tensor, kernels: str, calls: int) -> torch.Tensor:
    y = x
    for _ in range(calls):
        y = torch.ops.sparsecc.linear_kernel(x, values, metadata, n, k, bias, "relu", False, False, kernels)
    return y


def main(argv=None) -> dict:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    n = k = 256
    result = environment("host_overhead")
    result["launcher"] = None
    w = torch.randn(n, k // 4, 4)
    w = (w * torch.zeros_like(w).scatter_(-1, w.abs().topk(2, -1).indices, 1)).reshape(n, k).half().cuda()
    bias = torch.randn(n, dtype=torch.float16, device="cuda")
    x = torch.randn(1, k, dtype=torch.float16, device="cuda")
    packed = GEMM.pack(w, NM_2_4, None)       # the 2:4 CUTLASS GEMM, its dispatch table
    result["launcher"] = cuda_implementation()
    kernel, swizzle, splits, _ = kernel_for(packed.kernels, 1)
    y = torch.empty(1, n, dtype=torch.float16, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    relu = ACTIVATION_CODES["relu"]

    def op():
        return linear_kernel(x, packed.values, packed.metadata, n, k, bias, "relu", False, False, packed.kernels)

    def python_impl():
        return kernel_op._linear_kernel_python(x, packed.values, packed.metadata, n, k, bias, "relu", False, False,
                                               packed.kernels)

    def raw():
        kernel.gemm(packed.values.data_ptr(), packed.metadata.data_ptr(), x.data_ptr(), bias.data_ptr(), y.data_ptr(),
                    n, 1, k, relu, stream, swizzle=swizzle, splits=splits)

    graph = torch.cuda.CUDAGraph()
    op()
    with torch.cuda.graph(graph):
        for _ in range(10):
            op()
    from_cpp = 100
    expected = torch.relu(F.linear(x.float(), w.float(), bias.float()))
    for name, out in (("sparsecc", op()), ("sparsecc-from-c++", _sparsecc_from_cpp(
            x, packed.values, packed.metadata, n, k, bias, packed.kernels, 1))):
        torch.testing.assert_close(out.float(), expected, rtol=3e-3, atol=3e-3, msg=f"{name} differs from fp32")
    impls = {"cublas": (lambda: torch.relu(F.linear(x, w, bias)), 1),
             "torch-op-from-python": (lambda: torch.ops.aten.relu.default(x), 1),
             "sparsecc": (op, 1), "sparsecc-python-impl": (python_impl, 1), "sparsecc-raw-kernel": (raw, 1),
             "cublas-from-c++": (lambda: _cublas_from_cpp(x, w, bias, from_cpp), from_cpp),
             "sparsecc-from-c++": (lambda: _sparsecc_from_cpp(x, packed.values, packed.metadata, n, k, bias,
                                                              packed.kernels, from_cpp), from_cpp),
             "sparsecc-graph-replay": (graph.replay, 10)}
    measured = {impl: (1, n, per_call_us(fn, calls=max(300, 3000 // inner), inner=inner))
                for impl, (fn, inner) in impls.items()}
    big_m, big = 2048, 2048
    w = torch.randn(big, big // 4, 4)
    w = (w * torch.zeros_like(w).scatter_(-1, w.abs().topk(2, -1).indices, 1)).reshape(big, big).half().cuda()
    bias = torch.randn(big, dtype=torch.float16, device="cuda")
    x = torch.randn(big_m, big, dtype=torch.float16, device="cuda")
    packed = GEMM.pack(w, NM_2_4, big_m)
    measured["cublas-issue"] = (big_m, big, host_us(lambda: torch.relu(F.linear(x, w, bias))))
    measured["sparsecc-issue"] = (big_m, big, host_us(lambda: linear_kernel(
        x, packed.values, packed.metadata, big, big, bias, "relu", False, False, packed.kernels)))
    for impl, (m, size, us) in measured.items():
        result["rows"].append({"impl": impl, "format": "2:4" if impl.startswith("sparsecc") else "dense", "M": m,
                               "N": size, "K": size, "dtype": "float16", "epilogue": "bias+relu", "density": 0.5,
                               "block": None, "us": None, "us_eager": None, "rel_err": None, "us_host": round(us, 2)})
        print(f"{impl:24s} M={m:5d} {us:7.2f} us per call")
    path = write(result)
    bar_chart(result, path.with_suffix(".png"), "us_host", xlabel="host us per call (lower is faster)",
              title="linear + bias + ReLU, fp16: M=1, 256x256 (*-issue: M=2048, 2048x2048)")
    print("wrote", path)
    return result


if __name__ == "__main__":
    main()
