"""BERT-large (batch 8 x 512, every encoder linear at 2:4) with the unmasked attention that
benchmarks/e2e.py gives ViT (`e2e.unmasked_attention`; e2e.py's BERT rows keep the mask that
``transformers`` 5.17 builds under ``torch.compile``, which sends SDPA to its fp32 math path):
Inductor against the sparsecc backend with NaN/Inf propagation on (the default) and off
(SPARSECC_NONFINITE=unchecked), each timed eagerly, its GPU time per call from the profiler
(lab/e2e_profile.profile: in total, per category and the largest kernels), and the formats
the plans chose; then Inductor and sparsecc.compile each under CUDA graphs (mode="reduce-overhead"),
timed per call (the -graphs rows of e2e.py). Writes bert_unmasked.json to $OUT.

    OUT=/some/dir python benchmarks/lab/bert_unmasked.py [--graphs-only]
"""
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from common import environment, rel_err, time_eager_us, write_lab  # noqa: E402
from e2e import pruned_model, unmasked_attention  # noqa: E402
from e2e_profile import profile  # noqa: E402

import sparsecc  # noqa: E402
from sparsecc.backend import COMPILED  # noqa: E402


def main():
    graphs_only = "--graphs-only" in sys.argv[1:]       # only the CUDA-graph rows (a short call)
    model, x, _ = pruned_model("bert-large")
    model = unmasked_attention(model)
    result = environment("bert_unmasked")
    with torch.no_grad():
        reference = model(x)[0]
        for impl, nonfinite in () if graphs_only else (("inductor", None), ("sparsecc", "propagate"),
                                                       ("sparsecc-unchecked", "unchecked")):
            torch._dynamo.reset()
            COMPILED.clear()
            if nonfinite:
                os.environ["SPARSECC_NONFINITE"] = nonfinite      # read when the sites are packed
            fn = torch.compile(model) if nonfinite is None else torch.compile(model, backend="sparsecc")
            out = fn(x)[0]
            gpu_time = profile(fn, x, 3)
            row = {"model": "bert-large", "impl": impl, "M": x.numel(), "dtype": "float16", "us": None,
                   "us_eager": round(time_eager_us(lambda: fn(x), warmup_ms=50, rep_ms=300), 1),
                   "us_gpu": gpu_time["us"], "categories": gpu_time["categories"], "top": gpu_time["top"],
                   "rel_err": rel_err(out, reference),
                   "choices": dict(collections.Counter(c for g in COMPILED for c in g.plan.choices().values()))}
            result["rows"].append(row)
            print(row, flush=True)
        os.environ.pop("SPARSECC_NONFINITE", None)
        # under CUDA graphs on both sides (as e2e.py's -graphs rows): the wall time per call is the
        # GPU's, overlapped kernels counted once (the profiler's sums above count a dependent
        # launch's wait for the kernel before it as its own time)
        for impl, make in (("inductor-graphs", lambda: torch.compile(model, mode="reduce-overhead")),
                           ("sparsecc-graphs", lambda: torch.compile(sparsecc.compile(model, x), mode="reduce-overhead"))):
            torch._dynamo.reset()
            fn = make()
            fn(x)
            out = fn(x)[0].clone()
            row = {"model": "bert-large", "impl": impl, "M": x.numel(), "dtype": "float16", "us": None,
                   "us_eager": round(time_eager_us(lambda: fn(x), warmup_ms=50, rep_ms=300), 1),
                   "rel_err": rel_err(out, reference)}
            result["rows"].append(row)
            print(row, flush=True)
    write_lab(result, "bert_unmasked")


if __name__ == "__main__":
    main()
