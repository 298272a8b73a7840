"""Llama-1B decode (batch 1, one token, 2:4 outside the embedding) under CUDA graphs, the
ways sparsecc offers them, against Inductor's, in one process: ``inductor-graphs``
(``torch.compile(model, mode="reduce-overhead")``), ``sparsecc-graphs``
(``torch.compile(sparsecc.compile(model, ids, formats=("2:4",)), mode="reduce-overhead")``), and the backend
with ``cudagraphs=True`` (``sparsecc-backend-graphs``, also with Inductor's graph partition
off). Each is called 5 times, then timed over 50 calls with a synchronize at the end
(``us_eager``: per call from Python, host overhead included). Extra key:
``non_static_inputs`` (inputs Inductor's CUDA graphs copy on every replay). Run as a script it
sets ``SPARSECC_TUNE=off`` and leaves this machine's tuned launches out (common.fixed_dispatch):
sparsecc's sites run the shipped tuning table's launches, the same on every run, and compiling
tunes nothing.

    python benchmarks/decode_graphs.py
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import bar_chart, environment, fixed_dispatch, write  # noqa: E402

if __name__ == "__main__":
    fixed_dispatch()        # SPARSECC_TUNE=off: the shipped table's launches (see the docstring)

import sparsecc  # noqa: E402
from sparsecc.backend import make_backend  # noqa: E402
from sparsecc.models import load  # noqa: E402


def per_call_us(fn, ids) -> float:
    with torch.no_grad():
        for _ in range(5):
            fn(ids)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            fn(ids)
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / 50 * 1e6


def main(argv=None) -> dict:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    result = environment("decode_graphs")
    model, ids = load("llama-1b", batch=1, seq=1)
    model = model.half().cuda().eval()
    ids = ids.cuda()
    sparsecc.prune(model, "2:4", exclude=["*embed*"])
    variants = {
        "sparsecc-backend-graphs": ({}, lambda: torch.compile(model, backend=make_backend(cudagraphs=True))),
        "sparsecc-backend-graphs-no-partition": ({"graph_partition": False},
                                                 lambda: torch.compile(model, backend=make_backend(cudagraphs=True))),
        "inductor-graphs": ({}, lambda: torch.compile(model, mode="reduce-overhead")),
        "sparsecc-graphs": ({}, lambda: torch.compile(sparsecc.compile(model, ids, formats=("2:4",)),
                                                          mode="reduce-overhead")),
    }
    for impl, (patch, make) in variants.items():
        torch._dynamo.reset()
        counters.clear()
        with inductor_config.patch(patch):
            us = per_call_us(make(), ids)
        result["rows"].append({"model": "llama-1b-decode", "impl": impl, "format": "dense" if impl.startswith("inductor") else "2:4",
                               "M": 1, "N": None, "K": None, "dtype": "float16", "epilogue": None, "density": None,
                               "block": None, "us": None, "us_eager": round(us, 1), "rel_err": None,
                               "non_static_inputs": counters["inductor"].get("cudagraph_recorded_non_static_inputs", 0)})
        print(impl, f"{us:.0f} us per token", flush=True)
    path = write(result)
    bar_chart(result, path.with_suffix(".png"), "us_eager", xlabel="us per token (lower is faster)",
              title="Llama-1B decode, CUDA graphs, fp16")
    return result


if __name__ == "__main__":
    main()
