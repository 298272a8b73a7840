"""What bounds the 2:4 CUTLASS GEMM at large batch: the clock and power it runs at against
cuBLAS's on the same shape. For each shape, cuBLAS F.linear + ReLU, sparsecc's 2:4 GEMM as
dispatched (NaN/Inf pass on) and the same unchecked each replay a captured CUDA graph of 20
calls for SECONDS while ``nvidia-smi`` samples the SM clock, power draw and the active
throttle reasons every 50 ms; each row holds the per-call time and the median samples
(``sm_mhz``, ``watts``, ``throttle``) of its phase, and the useful TFLOP/s (2*M*N*K per call,
the dense count for the 2:4 GEMM too). fp16, linear + bias + ReLU. With ``--calls N`` it only
makes N eager calls of each (a short program for Nsight Compute). Writes
sparse24_gemm_bound.json to $OUT.

    OUT=/tmp python benchmarks/lab/sparse24_gemm_bound.py [--seconds 2] [--calls N]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import environment, time_graph_us, write_lab  # noqa: E402
from kernels import two_four  # noqa: E402

from sparsecc import gpu  # noqa: E402
from sparsecc.codegen import Family  # noqa: E402
from sparsecc.epilogue import UNCHECKED_NONFINITE  # noqa: E402
from sparsecc.timing import capture_graph  # noqa: E402

#: (M, N, K): the issue's largest square point, BERT-large's FFN and attention projections
SHAPES = [(8192, 4096, 4096), (4096, 4096, 1024), (4096, 1024, 4096), (4096, 1024, 1024), (2048, 8192, 2048)]
QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"


class Sampler:
    """nvidia-smi in the background; each sample is tagged with the phase running when it came."""

    def __init__(self):
        self.phase, self.samples = None, []
        self.process = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                         "-lms", "50"], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            if self.phase:
                self.samples.append((self.phase, line.strip()))

    def summary(self, phase) -> dict:
        rows = [line.split(", ") for p, line in self.samples if p == phase]
        rows = [r for r in rows if len(r) == 3]
        if not rows:
            return {"samples": 0}
        return {"samples": len(rows), "sm_mhz": statistics.median(float(r[0]) for r in rows),
                "watts": statistics.median(float(r[1]) for r in rows),
                "throttle": sorted({r[2] for r in rows})}

    def close(self):
        self.process.terminate()


def sustained(fn, seconds: float) -> None:
    """Replay a graph of 20 calls of ``fn`` for ``seconds``."""
    graph = capture_graph(fn, 20)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()


def impls(m, n, k, gen):
    w = two_four(n, k, torch.float16, gen)
    bias = torch.randn(n, generator=gen).half().cuda()
    x = torch.randn(m, k, generator=gen).half().cuda()
    packed = gpu.CutlassSparse24Weight.from_dense(w)
    table = gpu.dispatch(Family.SM90_SPARSE24, torch.float16, n, k)
    checked, unchecked = gpu.dispatch_string(table), gpu.dispatch_string(table, UNCHECKED_NONFINITE)
    launch = gpu.launch_for(table, m)
    return launch, {
        "cublas": lambda: torch.relu(F.linear(x, w, bias)),
        "sparsecc": lambda: gpu.linear_kernel(x, packed.values, packed.metadata, n, k, bias, "relu", False, False,
                                              checked),
        "sparsecc-unchecked": lambda: gpu.linear_kernel(x, packed.values, packed.metadata, n, k, bias, "relu",
                                                        False, False, unchecked),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--calls", type=int, help="only make this many eager calls of each (for ncu)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    if args.calls:
        for m, n, k in SHAPES:
            _, fns = impls(m, n, k, gen)
            for fn in fns.values():
                for _ in range(args.calls):
                    fn()
            torch.cuda.synchronize()
        return
    result = environment("sparse24_gemm_bound")
    sampler = Sampler()
    try:
        for m, n, k in SHAPES:
            launch, fns = impls(m, n, k, gen)
            for impl, fn in fns.items():
                us = time_graph_us(fn)
                sampler.phase = (m, n, k, impl)
                sustained(fn, args.seconds)
                sampler.phase = None
                row = {"impl": impl, "M": m, "N": n, "K": k, "dtype": "float16", "epilogue": "bias+relu", "us": us,
                       "tflops": round(2 * m * n * k / us / 1e6, 1), **sampler.summary((m, n, k, impl))}
                if impl != "cublas":
                    row["config"] = launch.label
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
                time.sleep(0.5)                      # the next phase starts from a cooler card
    finally:
        sampler.close()
    write_lab(result, "sparse24_gemm_bound")


if __name__ == "__main__":
    main()
