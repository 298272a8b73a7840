"""Where an end-to-end model spends its GPU time, Inductor dense against the sparsecc backend:
the kernels of a few calls (torch.profiler), summed per call into categories (sparsecc's 2:4
GEMM, its NaN/Inf pass, its small-batch, BSR and CSR kernels, other GEMMs, attention,
Inductor's fused Triton kernels, copies) and the largest kernels by name. For the models of
benchmarks/e2e.py whose sparsecc time is behind what its kernels promise (BERT-large and
Llama-1B prefill at 2:4 ran at 0.91x and 0.75x of Inductor without CUDA graphs; decode, bound
by the host, at 0.37x): it tells lost fusions, extra copies, the NaN/Inf pass and host time
per op apart.

    OUT=/some/dir python benchmarks/lab/e2e_profile.py [--models bert-large llama-1b-prefill] [--calls 5] [--cpp-wrapper]

Writes e2e_profile.json to $OUT (default /tmp) and prints the table.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import environment, write_lab  # noqa: E402
from e2e import pruned_model  # noqa: E402

from sparsecc.backend import make_backend  # noqa: E402

#: the first pattern a kernel's name matches names its category
CATEGORIES = [
    ("sparsecc NaN/Inf pass", r"propagate_nonfinite"),
    ("sparsecc 2:4 GEMM", r"device_kernel.*[Ss]parse"),
    ("sparsecc small-batch 2:4", r"gemv_kernel"),
    ("sparsecc BSR", r"bsr_kernel"),
    ("sparsecc CSR", r"csr_kernel|csr_reduce"),
    ("dense GEMM (cuBLAS, CUTLASS)", r"nvjet|gemm|xmma|cutlass|cublas|device_kernel"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn|softmax"),
    ("Inductor's fused kernels", r"^triton"),
    ("copies", r"copy|Memcpy|Memset|elementwise_kernel"),
    ("other", r""),
]


def category(name: str) -> str:
    return next(label for label, pattern in CATEGORIES if re.search(pattern, name))


def profile(fn, inputs, calls: int) -> dict:
    """Per call: wall time (host and GPU together), GPU time in total, per category and for the
    15 largest kernels, kernel launches, and the host's self time of the 10 costliest ops."""
    import time

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    for _ in range(3):
        fn(inputs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(inputs)
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - start) / calls * 1e6
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(inputs)
        torch.cuda.synchronize()
    kernels = defaultdict(lambda: [0.0, 0])
    host = defaultdict(float)
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:                      # a kernel, a copy or a memset
            kernels[event.name][0] += event.time_range.elapsed_us() / calls
            kernels[event.name][1] += 1 / calls
        else:
            host[event.name] += event.self_cpu_time_total / calls
    by_category: dict[str, float] = defaultdict(float)
    for name, (us, _) in kernels.items():
        by_category[category(name)] += us
    top = sorted(kernels.items(), key=lambda item: -item[1][0])[:15]
    return {"us_wall": round(wall_us, 1), "us": round(sum(us for us, _ in kernels.values()), 1),
            "launches": round(sum(n for _, n in kernels.values()), 1),
            "categories": {k: round(v, 1) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
            "top": [{"kernel": name[:160], "us": round(us, 1), "launches": round(n, 1)} for name, (us, n) in top],
            "host_top": [{"op": name[:120], "self_us": round(us, 1)}
                         for name, us in sorted(host.items(), key=lambda item: -item[1])[:10]]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["bert-large", "llama-1b-prefill", "llama-1b-decode"])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--cpp-wrapper", action="store_true", help="also both with Inductor's C++ wrapper code")
    args = parser.parse_args(argv)
    result = environment("e2e_profile")
    for case in args.models:
        model, inputs, _ = pruned_model(case)
        with torch.no_grad():
            impls = {"inductor": lambda: torch.compile(model),
                     "sparsecc": lambda: torch.compile(model, backend="sparsecc")}
            if args.cpp_wrapper:       # the wrapper code in C++: ops called without Python
                impls["inductor-cpp-wrapper"] = lambda: torch.compile(model, options={"cpp_wrapper": True})
                impls["sparsecc-cpp-wrapper"] = lambda: torch.compile(model, backend=make_backend(cpp_wrapper=True))
            for impl, make in impls.items():
                torch._dynamo.reset()
                row = {"model": case, "impl": impl, **profile(make(), inputs, args.calls)}
                result["rows"].append(row)
                print(f"\n{case} {impl}: {row['us_wall']:.0f} us per call, {row['us']:.0f} us of it on the GPU "
                      f"in {row['launches']:.0f} launches")
                for label, us in row["categories"].items():
                    print(f"  {label:32s} {us:9.1f} us")
                for entry in row["top"][:8]:
                    print(f"    {entry['us']:9.1f} us  x{entry['launches']:<5} {entry['kernel'][:100]}")
                for entry in row["host_top"][:6]:
                    print(f"    host {entry['self_us']:9.1f} us  {entry['op'][:100]}")
        model = None
        torch.cuda.empty_cache()
        write_lab(result, "e2e_profile")      # after every model: a time limit loses nothing done
    return result


if __name__ == "__main__":
    main()
