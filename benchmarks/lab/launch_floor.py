"""How short a small-batch call can be on this GPU, against the time the small-batch bars allow.

The small-batch issue asks a BSR weight at density 0.1 (64x64 blocks) for 6x over cuBLAS at
M = 1..16 on the 2:4 issue's six shapes. This measures, in one process, under CUDA-graph replay
(one launch per copy of its bytes in a graph, cycling through copies as the kernel benchmarks
do: common.rotating, 128 MB in all, at most 32 copies; the small weights' copies may then come
from the L2 cache, which can only lower a floor):

- ``cublas``: ``F.linear`` + ReLU at M = 1 and 16 on each shape, fp16 (the bar's 6x budget
  is this divided by six);
- ``empty``: a kernel that does nothing (one CTA, and one CTA per SM), launched plainly and as a
  programmatic dependent launch (``pdl``: it lets the next kernel start at once and waits for
  the one before it, as sparsecc's small-batch kernels do);
- ``read``: a kernel that only reads a 90%-block-sparse weight's stored bytes (values, 10% of
  the dense bytes) with 16-byte loads, one CTA per 4 KB up to 8 per SM, and writes one word per
  CTA, plainly and as a dependent launch: no kernel that reads those bytes once can be faster.

Writes launch_floor.json to $OUT (each row: what, shape, M, bytes, pdl, us).

    OUT=/tmp python benchmarks/lab/launch_floor.py
"""
import ctypes
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import environment, rotating, time_graph_us, write_lab  # noqa: E402

SHAPES = [(11008, 4096), (4096, 11008), (4096, 4096), (3072, 768), (768, 3072), (1024, 4096)]
DENSITY = 0.1

SOURCE = r"""
#include <cstdint>
#include <cuda_runtime.h>

__device__ __forceinline__ void start(bool pdl) {
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void wait(bool pdl) {
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
}

__global__ void empty_kernel(bool pdl) {
  start(pdl);
  wait(pdl);
}

// every 16-byte word of src once (four loads in flight per thread), one word per CTA written
__global__ void read_kernel(const uint4* __restrict__ src, long long words, unsigned* out, bool pdl) {
  start(pdl);
  unsigned acc = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < words; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (i + u * stride < words) v[u] = __ldcs(src + i + u * stride); else v[u] = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  acc = __reduce_xor_sync(0xffffffffu, acc);
  wait(pdl);
  if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

template <class... Args>
static int launch(void (*kernel)(Args...), int blocks, int threads, bool pdl, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

extern "C" int launch_empty(int blocks, int pdl, void* stream) {
  return launch(empty_kernel, blocks, 32, pdl != 0, (cudaStream_t)stream, pdl != 0);
}

extern "C" int read_blocks(long long bytes, int sms) {
  const long long blocks = (bytes + 4095) / 4096;
  return (int)(blocks < 8LL * sms ? (blocks > 0 ? blocks : 1) : 8LL * sms);
}

extern "C" int launch_read(const void* src, long long bytes, void* out, int sms, int pdl, void* stream) {
  return launch(read_kernel, read_blocks(bytes, sms), 256, pdl != 0, (cudaStream_t)stream,
                (const uint4*)src, bytes / 16, (unsigned*)out, pdl != 0);
}
"""


def build() -> ctypes.CDLL:
    folder = tempfile.mkdtemp(prefix="launch_floor-")
    source, library = os.path.join(folder, "floor.cu"), os.path.join(folder, "floor.so")
    with open(source, "w") as handle:
        handle.write(SOURCE)
    subprocess.run(["nvcc", "-O3", "-std=c++17", "-shared", "-Xcompiler=-fPIC", "-gencode",
                    "arch=compute_90a,code=sm_90a", "-o", library, source], check=True)
    lib = ctypes.CDLL(library)
    for name in ("launch_empty", "launch_read", "read_blocks"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def main() -> None:
    lib = build()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)  # noqa: E731
    result = environment("launch_floor")
    rows = result["rows"]
    out = torch.empty(8 * sms, dtype=torch.int32, device="cuda")

    def check(status):
        if status != 0:
            raise RuntimeError(f"launch failed: CUDA error {status}")

    for blocks in (1, sms):
        for pdl in (0, 1):
            us = time_graph_us(lambda: check(lib.launch_empty(blocks, pdl, stream())), calls=20)
            rows.append(dict(what="empty", blocks=blocks, pdl=bool(pdl), us=us))
            print(rows[-1], flush=True)
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        stored = int(DENSITY * n * k) * 2 // 16 * 16
        src = torch.randint(-2**31, 2**31 - 1, (stored // 4,), dtype=torch.int32, generator=gen).cuda()
        for pdl in (0, 1):
            call, copies = rotating(lambda s: check(lib.launch_read(ctypes.c_void_p(s.data_ptr()), ctypes.c_longlong(stored),
                                                                      ctypes.c_void_p(out.data_ptr()), sms, pdl, stream())), src)
            us = time_graph_us(call, calls=copies)
            rows.append(dict(what="read", N=n, K=k, bytes=stored, blocks=lib.read_blocks(ctypes.c_longlong(stored), sms),
                             pdl=bool(pdl), us=us, gbps=stored / us / 1e3))
            print(rows[-1], flush=True)
        weight = (torch.randn(n, k, generator=gen) * 0.05).half().cuda()
        bias = torch.randn(n, generator=gen).half().cuda()
        for m in (1, 16):
            x = torch.randn(m, k, generator=gen).half().cuda()
            call, copies = rotating(lambda w: torch.relu(F.linear(x, w, bias)), weight)
            us = time_graph_us(call, calls=copies)
            rows.append(dict(what="cublas", N=n, K=k, M=m, us=us, budget_6x_us=us / 6))
            print(rows[-1], flush=True)
    write_lab(result, "launch_floor")


if __name__ == "__main__":
    main()
