"""sparsecc's small-batch BSR kernel (templates/bsr_sm90.cu.j2, the prototype of
bsr_small_batch.cu made a template) through its runtime: 90% block-sparse fp16 weights, blocks
64x64 and 32x64, at M=1 (the tile the dispatch uses) and M=4 (its 4-row tile), linear + bias +
ReLU against cuBLAS F.linear + ReLU, graph replay, every call on its own weight copy; relative
error against fp32. Writes bsr_small_batch_kernel.json to $OUT.

    OUT=/tmp python benchmarks/lab/bsr_small_batch_kernel.py
"""
import math, statistics, json, os
import torch, torch.nn.functional as F
from sparsecc import gpu, runtime
from sparsecc.bsr_kernel import BsrKernelWeight
from sparsecc.codegen import Family, KernelSpec
from sparsecc.epilogue import ACTIVATION_CODES
dev = "cuda"

def graph_us(calls, reps=20, trials=5):
    for c in calls: c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls: c()
    g.replay(); torch.cuda.synchronize()
    out = []
    for _ in range(trials):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps): g.replay()
        e.record(); torch.cuda.synchronize(); out.append(s.elapsed_time(e) * 1e3 / reps / len(calls))
    return statistics.median(out)

gen = torch.Generator().manual_seed(1)
specs = {(b, t): KernelSpec(Family.BSR_SM90, "float16", tile=(*b, t)) for b in ((64, 64), (32, 64)) for t in (1, 4)}
runtime.ensure(list(specs.values()), progress=False)
rows = []
for n, k in ((11008, 4096), (4096, 11008), (4096, 4096)):
    dense = (torch.randn(n, k, generator=gen) * 0.05).half().to(dev)
    dcopies = [dense.clone() for _ in range(3)]
    for block in ((64, 64), (32, 64)):
        h, w = block
        mask = torch.rand(n // h, k // w, generator=gen) < 0.1
        wt = (torch.randn(n, k, generator=gen) * 0.05 * mask.repeat_interleave(h, 0).repeat_interleave(w, 1)).half()
        packed = BsrKernelWeight.pack(wt, block)
        values, meta = packed.values.to(dev), packed.metadata.to(dev)
        copies = max(2, min(64, math.ceil(256e6 / (values.numel() * 2))))
        vc, mc = [values.clone() for _ in range(copies)], [meta.clone() for _ in range(copies)]
        bias = torch.randn(n, generator=gen).half().to(dev)
        for m, t in ((1, 1), (4, 4)):
            kernel = gpu.kernel_for(gpu.dispatch_string([(0, gpu.Launch(specs[(block, t)]))]), m)[0]
            x = torch.randn(m, k, generator=gen).half().to(dev)
            y = torch.empty(m, n, dtype=torch.half, device=dev)
            call = lambda i: kernel.gemm(vc[i].data_ptr(), mc[i].data_ptr(), x.data_ptr(), bias.data_ptr(), y.data_ptr(), n, m, k,
                                         ACTIVATION_CODES["relu"], torch.cuda.current_stream().cuda_stream)
            y.fill_(float("nan")); call(0); torch.cuda.synchronize()
            ref = torch.relu(F.linear(x.float(), wt.to(dev).float(), bias.float()))
            err = float((y.float() - ref).norm() / ref.norm())
            us = graph_us([lambda i=i: call(i) for i in range(copies)])
            cub = graph_us([lambda i=i: torch.relu(F.linear(x, dcopies[i % 3], bias)) for i in range(12)])
            row = dict(N=n, K=k, block=list(block), M=m, us=round(us, 2), us_cublas=round(cub, 2), speedup=round(cub / us, 2), rel_err=err)
            rows.append(row); print(row, flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "bsr_small_batch_kernel.json"), "w"), indent=1)
