"""What ``sparsecc.compile`` does with block-sparse layers at small batches, end to end: a
Llama-sized MLP block (4096 -> 11008 -> 4096, SiLU), pruned to 10% of its 64x64 blocks,
compiled with the default formats for 1, 4 and 16 rows of x. Prints each site's choice and
reason, and the compiled model's time against the dense model's (CUDA-graph replay; Python
and torch.compile not involved), with the relative error against the dense eager model.

    python benchmarks/lab/compile_bsr_small_batch.py
"""
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import rel_err, time_graph_us  # noqa: E402

import sparsecc  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 11008), nn.SiLU(), nn.Linear(11008, 4096)).half().cuda().eval()
    sparsecc.prune(model, "block64x64@0.1")
    for m in (1, 4, 16):
        x = torch.randn(m, 4096, dtype=torch.half, device="cuda")
        compiled = sparsecc.compile(model, x)
        for site in compiled.sparsecc_plan.sites:
            print(f"M={m} {site.name}: {site.choice} | {site.reason[:200]}")
        with torch.no_grad():
            error = rel_err(compiled(x), model(x))
            dense_us, sparse_us = time_graph_us(lambda: model(x)), time_graph_us(lambda: compiled(x))
        print(f"M={m}: dense {dense_us:.1f} us, compiled {sparse_us:.1f} us ({dense_us / sparse_us:.2f}x), "
              f"rel err {error:.1e}", flush=True)


if __name__ == "__main__":
    main()
