"""Harness of the small-batch BSR prototype (bsr_small_batch.cu, see README.md here): for 90%
block-sparse fp16 weights (blocks 64x64 and 32x64) and M in {1, 4, 16}, each tiling's
relative error against an fp32 reference, that one Inf in x poisons the output, and its
CUDA-graph replay time per call, every call on its own copy of the weight (no L2 reuse),
against cuBLAS F.linear + ReLU in the same process. Writes bsr_small_batch.json to $OUT.

    nvcc -std=c++17 -O3 -arch=sm_90a -shared -Xcompiler -fPIC -o benchmarks/lab/bsr_small_batch.so \
        benchmarks/lab/bsr_small_batch.cu
    OUT=/tmp python benchmarks/lab/bsr_small_batch.py
"""
import ctypes, json, math, os, statistics
import torch, torch.nn.functional as F
from sparsecc.bsr_kernel import BsrKernelWeight

lib = ctypes.CDLL(os.path.join(os.path.dirname(os.path.abspath(__file__)), "bsr_small_batch.so"))
OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
torch.manual_seed(0)


def graph_us(calls, reps=20, trials=5):
    for c in calls: c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls: c()
    g.replay(); torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps): g.replay()
        e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / reps / len(calls))
    return statistics.median(times)


def copy_gbps():
    a = torch.empty(1 << 29, dtype=torch.float16, device=dev); b = torch.empty_like(a)
    us = graph_us([lambda: b.copy_(a)], reps=10)
    return 2 * a.numel() * 2 / (us * 1e-6) / 1e9


def block_sparse(n, k, block, density, gen):
    h, w = block
    mask = torch.rand(n // h, k // w, generator=gen) < density
    mask[torch.arange(n // h), torch.randint(0, k // w, (n // h,), generator=gen)] = True    # no empty rows here
    full = mask.repeat_interleave(h, 0).repeat_interleave(w, 1)
    return (torch.randn(n, k, generator=gen) * 0.05 * full).half()


rows_out = []
bw_copy = copy_gbps()
print(f"copy bandwidth {bw_copy:.0f} GB/s", flush=True)
gen = torch.Generator().manual_seed(1)
shapes = [(11008, 4096), (4096, 11008), (4096, 4096)]
blocks = [(64, 64), (32, 64)]
variants = {1: [(8, 1), (4, 2), (8, 2), (4, 4), (2, 4)], 4: [(4, 1), (4, 2), (2, 4)], 16: [(4, 1), (2, 2), (2, 4)]}
for n, k in shapes:
    dense_w = (torch.randn(n, k, generator=gen) * 0.05).half().to(dev)
    dense_copies = [dense_w.clone() for _ in range(max(2, math.ceil(256e6 / dense_w.numel() / 2)))]
    for block in blocks:
        w = block_sparse(n, k, block, 0.1, gen)
        packed = BsrKernelWeight.pack(w, block)
        values, meta = packed.values.to(dev).contiguous(), packed.metadata.to(dev).contiguous()
        nbytes_w = values.numel() * 2 + meta.numel() * 4
        copies = max(2, min(64, math.ceil(256e6 / nbytes_w)))
        vcopies = [values.clone() for _ in range(copies)]
        mcopies = [meta.clone() for _ in range(copies)]
        bias = (torch.randn(n, generator=gen) * 0.1).half().to(dev)
        w_dev = w.to(dev)
        for m in (1, 4, 16):
            x = torch.randn(m, k, generator=gen).half().to(dev)
            ref = torch.relu(F.linear(x.float(), w_dev.float(), bias.float()))
            y = torch.empty(m, n, dtype=torch.half, device=dev)
            cublas = graph_us([lambda i=i: torch.relu(F.linear(x, dense_copies[i % len(dense_copies)], bias))
                               for i in range(len(dense_copies) * 4)])
            for u, p in variants[m]:
                name = f"bsr_gemv_{block[0]}x{block[1]}_m{m}_u{u}_s{p}"
                fn = getattr(lib, name)
                fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]

                def call(i, fn=fn, x=x):
                    status = fn(vcopies[i].data_ptr(), mcopies[i].data_ptr(), x.data_ptr(), bias.data_ptr(),
                                y.data_ptr(), n, k, torch.cuda.current_stream().cuda_stream)
                    assert status == 0, status
                y.fill_(float("nan"))
                call(0); torch.cuda.synchronize()
                err = float((y.float() - ref).norm() / ref.norm())
                nan_ok = None
                if True:                      # one Inf in x poisons (lab rule: the whole output)
                    xi = x.clone(); xi[0, k // 2] = float("inf")
                    fn(vcopies[0].data_ptr(), mcopies[0].data_ptr(), xi.data_ptr(), bias.data_ptr(), y.data_ptr(), n, k,
                       torch.cuda.current_stream().cuda_stream)
                    torch.cuda.synchronize(); nan_ok = bool(torch.isnan(y).all())
                us = graph_us([lambda i=i: call(i) for i in range(copies)])
                moved = nbytes_w + x.numel() * 2 + y.numel() * 2 + n * 2
                gbps = moved / (us * 1e-6) / 1e9
                row = {"N": n, "K": k, "block": list(block), "M": m, "U": u, "split": p, "us": round(us, 3),
                       "us_cublas": round(cublas, 3), "speedup": round(cublas / us, 3), "gbps": round(gbps, 1),
                       "of_copy": round(gbps / bw_copy, 3), "rel_err": err, "nan_ok": nan_ok,
                       "density": round(values.numel() / (n * k), 4)}
                rows_out.append(row)
                print(f"{n:5d}x{k:<5d} {block[0]}x{block[1]} M={m:2d} U={u} split={p}: {us:7.2f} us "
                      f"(cuBLAS {cublas:6.2f}) {cublas/us:5.2f}x {gbps:6.0f} GB/s {gbps/bw_copy:4.0%} err {err:.1e} nan {nan_ok}",
                      flush=True)
        vcopies = mcopies = None
    dense_copies = None
json.dump({"copy_gbps": bw_copy, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "rows": rows_out}, open(os.path.join(OUT, "bsr_small_batch.json"), "w"), indent=1)
