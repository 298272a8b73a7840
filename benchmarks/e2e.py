"""End to end on the GPU, in one process: eager dense, ``torch.compile`` dense (Inductor),
and sparsecc (``torch.compile(backend="sparsecc")``: sparse sites on sparsecc's kernels,
the rest of the graph on Inductor), on Hugging Face architectures built from configs:

- ``bert-large``: batch 8, sequence 512, every encoder linear pruned to 2:4;
- ``llama-1b-prefill``: Llama-3.2-1B shapes, one sequence of 2048 tokens, 2:4;
- ``llama-1b-decode``: the same model, one token (batch 1, no KV cache: the linear layers see
  M=1 exactly as in decoding; attention over a cache is left out), 2:4;
- ``llama-1b-decode-b16``: the same, 16 sequences decoding together (batched decode: M=16), 2:4;
- ``gpt2``: GPT-2 small (its linear layers are ``Conv1D``, weights stored [in, out]), batch 8,
  sequence 512, 2:4;
- ``vit-b16``: batch 256, 90% block sparsity with 64x64 blocks. ViT never masks attention, but
  under ``torch.compile`` some ``transformers`` versions (5.17) still build an all-visible mask,
  and with a mask SDPA runs its fp32 math path (half of Inductor's time on an H100). The
  benchmark gives ViT's SDPA an attention implementation name of its own
  (:func:`unmasked_attention`), for which ``transformers`` builds no mask: every impl, eager
  and compiled, then runs the same fused attention kernel. BERT-large keeps the mask (and the
  fp32 math path, 8.5 of Inductor's 14.2 ms on an H100) for every impl alike.

fp16, microseconds per call from Python (``us_eager``; ``us`` is left null): the wall time of
:data:`CALLS` calls issued back to back and then waited for, which is what a user's loop
sees whether the host or the GPU sets the pace. The implementations of a model are compiled
first, then timed in :data:`ROUNDS` interleaved rounds (:func:`interleaved_us`), each keeping its
median, so that a drift of the host's speed during the run reaches them all alike. Rows carry
``model``, ``impl``, ``rel_err`` against the eager output, ``compile_s`` (the first call),
``graphs_compiled`` (the graphs Dynamo compiled for it: 0 where it reuses the program of an impl
compiled before it, as ``torch.compile(sparsecc.compile(model))`` does where every site stays dense,
since the copy shares the model's code and weights), ``sparse_sites`` (sites that run a sparse format, of ``sites``), ``shared_calls``
(groups of sites that one call computes, sparsecc.ir.siblings) and
``graphs_raced``: per graph the backend raced (for sparsecc-graphs: the model ``sparsecc.compile``
raced), the microseconds per call with the sparse layers and dense on the example inputs and, for
the backend's graphs, whether the host set the dense one's pace and each one's rounds (the sparse
one was kept if faster by 2%, or by 5% where the host set the pace, or in every round where not).
``impl``: eager, inductor, sparsecc (as above, launched op by op), and with CUDA graphs:
inductor-graphs (``torch.compile(model, mode="reduce-overhead")``), sparsecc-backend-graphs
(``torch.compile(model, backend="sparsecc", mode="reduce-overhead")``) and sparsecc-graphs
(``torch.compile(sparsecc.compile(model, inputs), mode="reduce-overhead")``), where host
overhead is gone on all sides. Run as a script it sets ``SPARSECC_TUNE=off`` and leaves this
machine's tuned launches out (common.fixed_dispatch): sparsecc's sites run the shipped tuning
table's launches, the same on every run, and compiling tunes nothing.

    python benchmarks/e2e.py [--models bert-large llama-1b-prefill ...] [--impls sparsecc ...]
    python benchmarks/e2e.py --plot results/e2e-<gpu>-<date>.json     # redraw a results file's plot
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import RESULTS, environment, fixed_dispatch, relative_error, write  # noqa: E402

if __name__ == "__main__":
    fixed_dispatch()        # SPARSECC_TUNE=off: the shipped table's launches (see the docstring)

import sparsecc  # noqa: E402
from sparsecc.backend import COMPILED, register  # noqa: E402
from sparsecc.models import load  # noqa: E402

CASES = {
    "bert-large": ("bert-large", 8, 512, "2:4"),
    "llama-1b-prefill": ("llama-1b", 1, 2048, "2:4"),
    "llama-1b-decode": ("llama-1b", 1, 1, "2:4"),
    "llama-1b-decode-b16": ("llama-1b", 16, 1, "2:4"),
    "vit-b16": ("vit-b16", 256, 0, "block64x64@0.1"),
    "gpt2": ("gpt2", 8, 512, "2:4"),
}
#: what each model runs as (see the docstring)
IMPLS = ["eager", "inductor", "sparsecc", "inductor-graphs", "sparsecc-backend-graphs", "sparsecc-graphs"]
#: interleaved timing rounds per model, and calls per timing (see the docstring). Where two impls
#: run one program (a backend that kept every site dense), 9 rounds put their medians up to 1.5%
#: apart on an H200; 21 rounds add a few seconds per model
ROUNDS = 21
CALLS = 10


def interleaved_us(compiled: dict, inputs, rounds: int = ROUNDS, timer=None) -> dict[str, float]:
    """Each implementation's median of ``timer(fn, inputs)`` (default :func:`wall_us`) over ``rounds``
    rounds that call them all, the order rotated by one each round: no implementation always runs
    right after the same other one. In a fixed order on an H100, BERT-large's ``inductor-graphs``
    took 14.4 ms and ``sparsecc-graphs`` 15.6, where the same compiles on the CPU gave the latter no
    graph of its own (Dynamo's cache served it)."""
    timer = timer or wall_us
    names = list(compiled)
    times = {name: [] for name in names}
    for turn in range(rounds):
        shift = turn % max(1, len(names))
        for name in names[shift:] + names[:shift]:
            times[name].append(timer(compiled[name], inputs))
    return {name: statistics.median(found) for name, found in times.items()}


def wall_us(fn, inputs) -> float:
    """Microseconds per call of :data:`CALLS` calls of ``fn(inputs)`` and the wait for the GPU."""
    for _ in range(3):
        fn(inputs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn(inputs)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / CALLS


#: the attention implementation :func:`unmasked_attention` registers
UNMASKED_SDPA = "sdpa_unmasked"


def unmasked_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Run ``model``'s attention through SDPA registered under a name of its own: ``transformers``
    builds masks only for the attention implementations it knows, so the all-visible mask that
    some versions build under ``torch.compile`` (``is_tracing`` keeps them from skipping it)
    is never made. Only right for models that never mask (ViT: no padding, no causality)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    AttentionInterface.register(UNMASKED_SDPA, sdpa_attention_forward)
    model.config._attn_implementation = UNMASKED_SDPA      # the layers hold this same config
    return model


def pruned_model(case: str):
    """The model of ``case`` in fp16 on the GPU, pruned as :data:`CASES` says (embeddings and
    the LM head left dense), its inputs, and the pruning report."""
    name, batch, seq, pattern = CASES[case]
    torch.manual_seed(0)
    model, inputs = load(name, batch=batch, seq=max(seq, 1))
    if name == "vit-b16":
        model = unmasked_attention(model)
    model = model.half().cuda().eval()
    inputs = inputs.cuda().half() if inputs.is_floating_point() else inputs.cuda()
    return model, inputs, sparsecc.prune(model, pattern, exclude=["*embed*", "*lm_head*"])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(CASES))
    parser.add_argument("--impls", nargs="*", choices=IMPLS, default=IMPLS,
                        help="the implementations to run (inductor, the baseline, always runs); a results file of "
                             "the same day and GPU keeps the others' rows")
    parser.add_argument("--plot", metavar="JSON", help="only draw the plot of an existing results file")
    args = parser.parse_args(argv)
    if args.plot:
        result = json.loads(open(args.plot).read())
        plot(result, __import__("pathlib").Path(args.plot).with_suffix(".png"))
        return result
    register()                  # backend="sparsecc" (an installed sparsecc's entry point does it too)
    result = environment("e2e")
    # the models' attention depends on it: some versions build ViT's all-visible mask under
    # torch.compile (not eagerly), which sends SDPA to its fp32 math path (README)
    result["transformers"] = __import__("transformers").__version__
    chosen = {"inductor", *args.impls}
    earlier = RESULTS / f"e2e-{result['device'].replace(' ', '_')}-{result['date']}.json"
    if earlier.is_file():        # a run of some models keeps the others' rows of the same day and GPU
        result["rows"] = [r for r in json.loads(earlier.read_text())["rows"]
                          if r["model"] not in args.models or r["impl"] not in chosen]
    path = None
    for case in args.models:
        _, batch, seq, pattern = CASES[case]
        model, inputs, report = pruned_model(case)
        torch._dynamo.reset()                           # each model starts from scratch
        COMPILED.clear()
        with torch.no_grad():
            reference = model(inputs)[0]
            impls = {"eager": lambda: model, "inductor": lambda: torch.compile(model),
                     "sparsecc": lambda: torch.compile(model, backend="sparsecc"),
                     "inductor-graphs": lambda: torch.compile(model, mode="reduce-overhead"),
                     "sparsecc-backend-graphs": lambda: torch.compile(model, backend="sparsecc", mode="reduce-overhead"),
                     "sparsecc-graphs": lambda: torch.compile(sparsecc.compile(model, inputs), mode="reduce-overhead")}
            impls = {impl: make for impl, make in impls.items() if impl in chosen}
            compiled, rows = {}, {}
            for impl, make in impls.items():
                before, graphs_before = len(COMPILED), counters["stats"]["unique_graphs"]
                start = time.perf_counter()
                fn = make()
                fn(inputs)                              # CUDA graphs record on a later call
                compile_s = time.perf_counter() - start
                out = fn(inputs)[0].clone()
                plans = [g.plan for g in COMPILED[before:]] or [getattr(fn, "sparsecc_plan", None)]
                choices = [c for plan in plans if plan is not None for c in plan.choices().values()]
                compiled[impl] = fn
                rows[impl] = {"model": case, "impl": impl, "format": pattern if choices else "dense",
                              "M": batch * max(seq, 1), "N": None, "K": None, "dtype": "float16", "epilogue": None,
                              "density": round(report.density, 4), "block": 64 if "block" in pattern else None,
                              "us": None, "us_eager": None, "rel_err": relative_error(out, reference),
                              "compile_s": round(compile_s, 1),
                              "graphs_compiled": counters["stats"]["unique_graphs"] - graphs_before,
                              "sites": len(choices),
                              "sparse_sites": sum(c != "dense" for c in choices),
                              "shared_calls": sum(len({s.group for s in plan if s.group}) for plan in plans if plan),
                              "graphs_raced": [list(g.raced) for g in COMPILED[before:] if g.raced is not None]
                              or [p.checked for p in plans if p is not None and p.checked]}
            times = interleaved_us(compiled, inputs)
            for impl, row in rows.items():
                row["us_eager"] = times[impl]
                result["rows"].append(row)
                print(f"{case:20s} {impl:24s} {row['us_eager']:10.1f} us  rel_err {row['rel_err']:.2e}  "
                      f"sparse sites {row['sparse_sites']}/{row['sites']} ({row['shared_calls']} shared calls)  "
                      f"compile {row['compile_s']} s ({row['graphs_compiled']} graphs)  raced {row['graphs_raced']}", flush=True)
            path = write(result)                     # after every model: a time limit loses nothing done
            plot(result, path.with_suffix(".png"))
        model = impls = compiled = None     # free the GPU memory before the next model
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    print("wrote", path)
    for case in dict.fromkeys(r["model"] for r in result["rows"]):
        times = {r["impl"]: r["us_eager"] for r in result["rows"] if r["model"] == case}
        for ours, theirs in (("sparsecc", "inductor"), ("sparsecc-backend-graphs", "inductor-graphs"),
                             ("sparsecc-graphs", "inductor-graphs"), ("sparsecc-backend-graphs", "sparsecc-graphs")):
            if ours in times and theirs in times:
                print(f"{case:20s} {ours} over {theirs}: {times[theirs] / times[ours]:.2f}x")
    return result


def plot(result: dict, path) -> None:
    """Per model, each implementation's time relative to Inductor dense (higher is faster)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    impls = list(dict.fromkeys(r["impl"] for r in result["rows"]))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        speedups = []
        for model in models:
            times = {r["impl"]: r["us_eager"] for r in result["rows"] if r["model"] == model}
            speedups.append(times["inductor"] / times[impl] if impl in times and "inductor" in times else 0)
        ax.bar([m + i * width for m in range(len(models))], speedups, width, label=impl)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([m + 0.4 - width / 2 for m in range(len(models))], models)
    ax.set_ylabel("speedup over Inductor dense (per call)")
    ax.set_title(f"end to end, fp16, {result['device']}, torch {result['torch']}, CUDA {result['cuda']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
