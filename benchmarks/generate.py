"""Generation on the GPU: time to the first token (the prompt's prefill) and decode tokens per second
of ``model.generate`` (greedy, KV cache), the dense model against sparsecc's, in one process.

Models, built from configs (nothing is downloaded), fp16: ``llama-1b`` (LlamaForCausalLM with
Llama-3.2-1B's shapes: hidden 2048, MLP 8192, 16 layers, 32 heads, 8 KV heads; 32k vocabulary)
and ``gpt2`` (GPT2LMHeadModel, GPT-2 small: hidden 768, 12 layers). Each is pruned with
``sparsecc.prune`` (embeddings and the LM head left dense; by magnitude, or with ``--criterion wanda`` by
Wanda's scores on random-token calibration prompts) to a pattern: ``2:4``,
``block64x64@0.1`` (64x64 blocks, 10% kept) or ``unstructured@0.5``. The ``dense`` impl is the
pruned model as it is (cuBLAS); ``sparsecc`` is ``sparsecc.compile(model, prompts)``, planned for M
from the batch (a decode step) to batch x prompt length (the prefill).

Both impls run the same attention (``--attention``): by default ``sparsecc.use_grouped_attention``,
whose decode step reads each key/value head of the cache once; ``sdpa`` is Hugging Face's, which
under torch.compile first copies the cache once per query head.

Modes, the same for both impls:

- ``graphs`` (default): the static cache and ``model.forward = torch.compile(model.forward,
  mode="reduce-overhead", dynamic=False)``, Hugging Face's recipe for fast generation: prefill and
  decode each one CUDA-graph replay. Each model keeps one static cache across its calls (its
  tensors stay in place for the graphs); three untimed calls first (sparsecc.generation.GRAPH_WARMUP).
- ``eager``: the dynamic cache, no torch.compile (what ``generate`` does by default).

With ``--backend`` (graphs mode) a third impl, ``sparsecc-backend``, is the pruned model with
``model.forward = torch.compile(model.forward, backend="sparsecc", mode="reduce-overhead",
dynamic=False)`` (``--backend-only``: instead of ``sparsecc``, to save its compile): Dynamo captures
the prefill and the decode step as separate graphs, and the backend plans and packs each for its own batch size (in the decode graph of a Llama, q, k and v
share one call, as do gate and up); its rows' ``choices`` count both graphs' sites.

Loops, each timed on both impls: ``generate`` (``model.generate``, greedy) and ``greedy_loop``
(sparsecc.generation.greedy_loop: one forward per token on a static cache, the next token chosen on
the GPU, without ``generate``'s work between steps, which at batch 1 takes about as long as a
CUDA-graph forward; the row's ``loop`` says which).

Per case (model, pattern, batch, mode): the prompts are ``--prompt`` random tokens per sequence,
``--new-tokens`` tokens are generated (exactly: no early stop), and the timed calls of the two
impls alternate (sparsecc.generation.time_generate_each; medians of ``--repeats``). ``ttft_ms``:
from the call to the first new token on the host; ``tokens_per_s``: the tokens generated after the
first (every sequence counted) over the time they took. ``rel_err``: the largest relative error of
a step's logits against the dense model's, over the steps before the first token on which the two
differ (``steps_compared``; after it they continue different texts); ``same_tokens``: whether all
generated tokens agree (fp16 can flip a near-tie); ``choices``: sparsecc's sites per format, and
``dense_above_small_batches`` those among them that run their dense weight past the small-batch
kernels' rows (the prefill). Within a model and batch the dense model is
compiled once: each pattern's pruned weights are copied into it in place (CUDA graphs read them
where they are), so only sparsecc's graphs are compiled per pattern.

With ``--profile`` each row also has ``decode_kernels``: what one decode step runs on the GPU, from
torch.profiler (greedy_loop over the same static cache, ``PROFILED_STEPS`` steps, or fewer where
``--new-tokens`` is smaller, less the prompt's forward alone): kernel microseconds and launches per step, and the kernels taking the most time
(on the CPU, the ops' own time instead of kernels); ``prompt_us``, ``prompt_launches`` and
``prompt_top`` say the same of the prompt's forward with its first token.

With ``--quantize fp8`` both sides are the pruned model quantized (``sparsecc.quantize``, the same
layers left out) and compiled by sparsecc: ``dense`` with ``formats=("dense",)`` (its FP8 sites on
``torch._scaled_mm``), ``sparsecc`` with ``formats=("2:4",)`` (the FP8 2:4 GEMM on Hopper); rows
carry ``quantize``. Each pattern then compiles its own dense model.

sparsecc's kernels are tuned on each model's shapes as ``sparsecc.compile`` tunes them on a user's
machine, into a table of the run's own (common.private_tuning: the per-machine table is neither read
nor written); ``--fixed-dispatch`` runs the shipped table's launches instead, tuning nothing
(common.fixed_dispatch, as benchmarks/e2e.py). The default set -- Llama 2:4 and 64x64 blocks at
10% at batch 1 and 32, GPT-2 2:4 at batch 1, graphs mode -- took about 5-6 minutes on one H100
with ``--loops generate`` once sparsecc's kernels for these shapes were in the cache (the first run
also compiles them); ``greedy_loop`` adds its own CUDA graphs and timed calls.

    python benchmarks/generate.py                                   # the default set
    python benchmarks/generate.py --models llama-1b --patterns unstructured@0.5 --batches 8 --modes graphs eager
    python benchmarks/generate.py --build-only                      # compile every case's kernels, time nothing
    python benchmarks/generate.py --quantize fp8 --patterns 2:4 --batches 1 32 --prompt 2048   # FP8 2:4 / FP8 dense
    python benchmarks/generate.py --device cpu --tiny --modes eager --force-formats   # a smoke run, tiny configs
    python benchmarks/generate.py --plot results/generate-<gpu>-<date>.json
"""
from __future__ import annotations

import argparse
import collections
import copy
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import (RESULTS, environment, fixed_dispatch, plot_generation_speedups, private_tuning,  # noqa: E402
                    relative_error, write)

import sparsecc  # noqa: E402
from sparsecc.generation import (GRAPH_WARMUP, LOOPS, greedy, greedy_loop, static_cache,  # noqa: E402
                                 time_generate_each)
from sparsecc.grouped_attention import use_grouped_attention  # noqa: E402
from sparsecc.models import load  # noqa: E402

MODELS = {"llama-1b": "llama-1b-causal", "gpt2": "gpt2-causal"}
PATTERNS = ("2:4", "block64x64@0.1", "unstructured@0.5")
#: (model, pattern, batch) run when no --models, --patterns or --batches is given
DEFAULT_CASES = [("llama-1b", "2:4", 1), ("llama-1b", "block64x64@0.1", 1), ("llama-1b", "2:4", 32),
                 ("llama-1b", "block64x64@0.1", 32), ("gpt2", "2:4", 1)]
#: ... and the lists an unset one of them takes when another is given
DEFAULT_LISTS = {"models": ["llama-1b", "gpt2"], "patterns": ["2:4", "block64x64@0.1"], "batches": [1, 32]}
MODES = {"graphs": "static", "eager": None}          # mode -> generate's cache_implementation
#: the attention both sides run: ``grouped`` (sparsecc.grouped_attention: a decode step reads each
#: key/value head once) or Hugging Face's ``sdpa`` (a copy of the cache per query head under torch.compile)
ATTENTIONS = ("grouped", "sdpa")
#: layers sparsecc.prune leaves dense: token and position embeddings, the LM head (tied to them in GPT-2)
EXCLUDE = ["*embed*", "*lm_head*", "*wte*", "*wpe*"]


def build(name: str, *, tiny: bool, device: torch.device, dtype: torch.dtype, attention: str = "sdpa") -> torch.nn.Module:
    """The causal LM ``name`` on ``device`` in ``dtype``, eval mode, with ``attention`` (see ATTENTIONS);
    ``tiny``: a 2-layer model of the same family (hidden 128) for a smoke run."""
    torch.manual_seed(0)
    if not tiny:
        model, _ = load(MODELS[name], device=device)
    else:
        model = _tiny(name, device)
    if attention == "grouped":
        use_grouped_attention(model)
    return model.to(dtype).eval()


def _tiny(name: str, device: torch.device) -> torch.nn.Module:
    """A 2-layer model of ``name``'s family (hidden 128)."""
    import transformers as hf
    with torch.device(device):
        if name == "llama-1b":
            config = hf.LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
            model = hf.LlamaForCausalLM(config)
        else:
            model = hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=512, n_positions=256,
                                                     bos_token_id=1, eos_token_id=2))
    return model


#: calibration prompts --criterion wanda runs (random tokens: no dataset is read), and their length
CALIBRATION_PROMPTS, CALIBRATION_LENGTH = 4, 128


def prune(model, pattern: str, args):
    """``sparsecc.prune`` with EXCLUDE left dense, by ``--criterion``: magnitude, or Wanda with
    CALIBRATION_PROMPTS prompts of random tokens as its calibration batches."""
    if args.criterion == "magnitude":
        return sparsecc.prune(model, pattern, exclude=EXCLUDE)
    device = next(model.parameters()).device
    gen = torch.Generator(device).manual_seed(0)
    batches = [torch.randint(1, model.config.vocab_size, (1, CALIBRATION_LENGTH), device=device, generator=gen)
               for _ in range(CALIBRATION_PROMPTS)]
    return sparsecc.prune(model, pattern, exclude=EXCLUDE, criterion=args.criterion, calibration=batches)


def format_of(pattern: str) -> str:
    """The sparsecc format that stores ``pattern`` exactly (for --force-formats): n:m as is,
    ``block<h>x<w>@d`` as ``bsr<h>x<w>``, ``unstructured@d`` as ``csr``."""
    if pattern.startswith("block"):
        return "bsr" + pattern[len("block"):].split("@")[0]
    return "csr" if pattern.startswith("unstructured") else pattern.split("/")[0]


def cases(args) -> list[tuple[str, str, int]]:
    """The (model, pattern, batch) cases the arguments ask for (see DEFAULT_CASES, DEFAULT_LISTS)."""
    if args.models is None and args.patterns is None and args.batches is None:
        return list(DEFAULT_CASES)
    return list(itertools.product(args.models or DEFAULT_LISTS["models"], args.patterns or DEFAULT_LISTS["patterns"],
                                  args.batches or DEFAULT_LISTS["batches"]))


def compare_logits(dense, sparse) -> dict:
    """``rel_err`` and ``steps_compared`` over the steps before the first token the two generations
    differ on; ``same_tokens`` over all of them (see the module docstring)."""
    compared, worst = 0, 0.0
    for step, (want, have) in enumerate(zip(dense.logits, sparse.logits)):
        worst = max(worst, relative_error(have, want))
        compared = step + 1
        if not torch.equal(dense.sequences[:, : dense.sequences.shape[1] - len(dense.logits) + step + 1],
                           sparse.sequences[:, : sparse.sequences.shape[1] - len(sparse.logits) + step + 1]):
            break
    return {"rel_err": worst, "steps_compared": compared, "same_tokens": torch.equal(dense.sequences, sparse.sequences)}


#: decode steps --profile records (their kernels less those of the prompt's forward alone, per step)
PROFILED_STEPS = 8
#: kernels --profile lists per row, the longest first
PROFILED_TOP = 12


def decode_kernels(model, prompts, cache, steps: int = PROFILED_STEPS) -> dict:
    """What one decode step of ``model`` runs: kernel time (us) and launches per step over ``steps``
    steps, and the ``PROFILED_TOP`` kernels taking the most time, as ``[name, us, launches]`` per
    step (see the module docstring). ``cache``: the model's static cache, so CUDA graphs replay as
    when timed (it holds the prompts and ``steps + 1`` new tokens)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = prompts.is_cuda

    def per_kernel(new_tokens: int) -> dict:
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            greedy_loop(model, prompts, new_tokens=new_tokens, cache=cache)
            if cuda:
                torch.cuda.synchronize()
        totals = collections.defaultdict(lambda: [0.0, 0])
        for event in prof.key_averages():
            us = event.self_device_time_total if cuda else event.self_cpu_time_total
            if us > 0:
                totals[event.key][0] += us
                totals[event.key][1] += event.count
        return totals

    per_kernel(1 + steps)                                 # the profiler's own first-use costs
    prefill, run = per_kernel(1), per_kernel(1 + steps)
    step = {name: ((us - prefill.get(name, [0.0, 0])[0]) / steps,
                   (calls - prefill.get(name, [0.0, 0])[1]) / steps) for name, (us, calls) in run.items()}
    step = {name: value for name, value in step.items() if value[1] > 0}

    def longest(kernels: dict) -> list:
        top = sorted(kernels.items(), key=lambda item: -item[1][0])[:PROFILED_TOP]
        return [[name[:120], round(us, 2), round(calls, 2)] for name, (us, calls) in top]

    return {"us_per_step": round(sum(us for us, _ in step.values()), 1),
            "launches_per_step": round(sum(calls for _, calls in step.values()), 1),
            "top": longest(step),
            "prompt_us": round(sum(us for us, _ in prefill.values()), 1),
            "prompt_launches": sum(calls for _, calls in prefill.values()),
            "prompt_top": longest(prefill)}


def set_recompile_limit(limit: int = 64) -> None:
    """Every model compiled here shares the code of its class's forward: let Dynamo keep a graph for
    each model and shape (its default of 8 would silently run the rest eagerly)."""
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(limit, getattr(torch._dynamo.config, name)))


def time_loop(loop: str, models: dict, prompts, cache, args, mode: str) -> dict:
    """Each model's generation timing by ``loop`` (sparsecc.generation.LOOPS), the models' calls
    interleaved; ``greedy_loop`` fills a static cache in either mode (one per model if ``cache`` is
    not already one per model)."""
    if loop == "greedy_loop" and not isinstance(cache, dict):
        cache = "static"                # time_generate_each makes one per model
    return time_generate_each(models, prompts, new_tokens=args.new_tokens, cache=cache, repeats=args.repeats,
                              warmup=GRAPH_WARMUP if mode == "graphs" else 1, loop=loop)


def run_group(name: str, batch: int, patterns: list[str], mode: str, args, device, dtype) -> list[dict]:
    """All patterns of one model, batch and mode: the dense model compiled once, its weights replaced in
    place by each pattern's, and a sparsecc model compiled per pattern."""
    torch._dynamo.reset()
    dense = build(name, tiny=args.tiny, device=device, dtype=dtype, attention=args.attention)
    base = copy.deepcopy(dense)                           # the unpruned weights, never compiled
    if args.quantize:
        return [row for pattern in patterns for row in run_quantized(name, batch, pattern, mode, args, base, device)]
    prompts = torch.randint(1, dense.config.vocab_size, (batch, args.prompt), device=device,
                            generator=torch.Generator(device).manual_seed(batch))
    cache = MODES[mode]
    caches = {}                 # graphs mode: one static cache per model, kept across its calls
    if mode == "graphs":
        caches["dense"] = static_cache(dense, args.prompt + args.new_tokens)
        dense.forward = torch.compile(dense.forward, mode="reduce-overhead", dynamic=False)
        dense.generation_config.disable_compile = True    # generate would compile the call around it again
    rows = []
    for pattern in patterns:
        started = time.perf_counter()
        pruned = copy.deepcopy(base)
        report = prune(pruned, pattern, args)
        with torch.no_grad():
            dense.load_state_dict(pruned.state_dict())    # in place: the dense graphs read the new weights
        sparse = plan = None
        if not args.backend_only:
            sparse = sparsecc.compile(pruned, prompts, formats=(format_of(pattern),) if args.force_formats else None)
            plan = sparse.sparsecc_plan
            if args.show_plan:
                print(plan.table(), flush=True)
        if args.build_only:
            print(f"{name} {pattern} batch {batch}: compiled ({time.perf_counter() - started:.0f} s)", flush=True)
            continue
        models, plans = {"dense": dense}, {}
        if sparse is not None:
            if mode == "graphs":
                sparse.forward = torch.compile(sparse.forward, mode="reduce-overhead", dynamic=False)
                sparse.generation_config = copy.deepcopy(sparse.generation_config)
                sparse.generation_config.disable_compile = True
                caches["sparsecc"] = static_cache(sparse, args.prompt + args.new_tokens)
            models["sparsecc"], plans["sparsecc"] = sparse, [plan]
        if (args.backend or args.backend_only) and mode == "graphs":
            forced = (format_of(pattern),) if args.force_formats else None
            models["sparsecc-backend"], plans["sparsecc-backend"] = through_backend(pruned, forced)
            caches["sparsecc-backend"] = static_cache(models["sparsecc-backend"], args.prompt + args.new_tokens)
        timed = {loop: time_loop(loop, models, prompts, caches or cache, args, mode) for loop in args.loops}
        outputs = {impl: greedy(model, prompts, new_tokens=args.new_tokens, cache=caches.get(impl, cache),
                                output_logits=True, return_dict_in_generate=True) for impl, model in models.items()}
        quality = {impl: compare_logits(outputs["dense"], outputs[impl]) for impl in models if impl != "dense"}
        choices = {impl: {} for impl in plans}
        for impl, impl_plans in plans.items():
            for site in (site for one in impl_plans for site in one):
                choices[impl][site.choice] = choices[impl].get(site.choice, 0) + 1
        profiled = {}
        steps = min(PROFILED_STEPS, args.new_tokens - 1)      # a graphs-mode cache holds new_tokens
        if args.profile and steps > 0:
            for impl, model in models.items():
                cache_of = caches.get(impl) or static_cache(model, args.prompt + 1 + steps)
                profiled[impl] = decode_kernels(model, prompts, cache_of, steps)
        for loop, impl in itertools.product(args.loops, models):
            timing = timed[loop][impl]
            sites = [site for one in plans.get(impl, []) for site in one]
            row = {"impl": impl, "model": name, "format": "dense" if impl == "dense" else pattern, "pattern": pattern,
                   "mode": mode, "loop": loop, "batch": batch, "prompt": args.prompt, "new_tokens": args.new_tokens,
                   "M": batch * args.prompt, "dtype": str(dtype).replace("torch.", ""),
                   "density": round(report.density, 4), "block": 64 if pattern.startswith("block64") else None,
                   "criterion": args.criterion, "attention": args.attention,
                   "ttft_ms": round(timing.ttft_ms, 3),
                   "tokens_per_s": round(timing.tokens_per_s, 1) if timing.tokens_per_s else None,
                   "rel_err": None if impl == "dense" else quality[impl]["rel_err"],
                   "steps_compared": None if impl == "dense" else quality[impl]["steps_compared"],
                   "same_tokens": None if impl == "dense" else quality[impl]["same_tokens"],
                   "choices": None if impl == "dense" else choices[impl],
                   "shared_calls": None if impl == "dense" else len({s.group for s in sites if s.group}),
                   "dense_above_small_batches": None if impl == "dense" else sum(s.above == "dense" for s in sites),
                   "m_range": None if impl != "sparsecc" else (plan.sites[0].m_range if plan.sites else None),
                   "weight_bytes": {"dense": plan.bytes_before, "sparsecc": plan.bytes_after}.get(impl) if plan
                   else None}
            if impl in profiled:
                row["decode_kernels"] = profiled[impl]
            rows.append(row)
        case_rows = rows[-len(models) * len(args.loops):]
        for dense_row in (row for row in case_rows if row["impl"] == "dense"):
            for sparse_row in (row for row in case_rows if row["loop"] == dense_row["loop"] and row["impl"] != "dense"):
                print(f"{name:9s} {pattern:16s} b{batch:<3d} {mode:6s} {dense_row['loop']:11s} {sparse_row['impl']:16s} "
                      f"first token {dense_row['ttft_ms']:8.2f} -> {sparse_row['ttft_ms']:8.2f} ms   decode "
                      f"{dense_row['tokens_per_s'] or 0:9.1f} -> {sparse_row['tokens_per_s'] or 0:9.1f} tokens/s   "
                      f"rel_err {sparse_row['rel_err']:.2e} over {sparse_row['steps_compared']} steps, same tokens "
                      f"{sparse_row['same_tokens']} ({time.perf_counter() - started:.1f} s)", flush=True)
        for impl, kernels in profiled.items():
            print(f"  {impl} decode step: {kernels['us_per_step']:.0f} us of kernels, "
                  f"{kernels['launches_per_step']:.0f} launches; longest: "
                  + "; ".join(f"{name[:60]} {us:.1f} us x{calls:g}" for name, us, calls in kernels["top"][:4]),
                  flush=True)
            print(f"  {impl} prompt: {kernels['prompt_us']:.0f} us of kernels, {kernels['prompt_launches']:.0f} "
                  "launches; longest: " + "; ".join(f"{name[:60]} {us:.1f} us x{calls:g}"
                                                   for name, us, calls in kernels["prompt_top"][:6]), flush=True)
        sparse = pruned = outputs = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def through_backend(pruned, formats=None):
    """A copy of ``pruned`` whose forward runs through ``torch.compile(backend="sparsecc",
    mode="reduce-overhead")`` (see the module docstring; ``formats`` as ``make_backend``'s), and
    the plans of the graphs the backend compiles for it (read when iterated: the first calls
    compile them)."""
    from sparsecc.backend import COMPILED, make_backend
    model = copy.deepcopy(pruned)
    backend = make_backend(formats=formats) if formats else "sparsecc"
    model.forward = torch.compile(model.forward, backend=backend, mode="reduce-overhead", dynamic=False)
    model.generation_config = copy.deepcopy(model.generation_config)
    model.generation_config.disable_compile = True
    return model, _PlansSince(COMPILED, len(COMPILED))


class _PlansSince:
    """The plans of the graphs the backend compiled since ``start`` (read when iterated)."""

    def __init__(self, compiled: list, start: int):
        self.compiled, self.start = compiled, start

    def __iter__(self):
        return iter([graph.plan for graph in self.compiled[self.start:] if graph.plan is not None])


def run_quantized(name: str, batch: int, pattern: str, mode: str, args, base, device) -> list[dict]:
    """One pattern of ``--quantize``: the pruned, quantized model compiled dense and 2:4 (see the
    module docstring), timed and compared as :func:`run_group` does."""
    started = time.perf_counter()
    pruned = copy.deepcopy(base)
    report = prune(pruned, pattern, args)
    sparsecc.quantize(pruned, args.quantize, exclude=EXCLUDE)
    prompts = torch.randint(1, pruned.config.vocab_size, (batch, args.prompt), device=device,
                            generator=torch.Generator(device).manual_seed(batch))
    models = {"dense": sparsecc.compile(copy.deepcopy(pruned), prompts, formats=("dense",)),
              "sparsecc": sparsecc.compile(pruned, prompts, formats=(format_of(pattern),))}
    plan = models["sparsecc"].sparsecc_plan
    if args.show_plan:
        print(plan.table(), flush=True)
    if args.build_only:
        print(f"{name} {pattern} {args.quantize} batch {batch}: compiled ({time.perf_counter() - started:.0f} s)")
        return []
    caches = {}
    if mode == "graphs":
        for impl, model in models.items():
            model.forward = torch.compile(model.forward, mode="reduce-overhead", dynamic=False)
            model.generation_config = copy.deepcopy(model.generation_config)
            model.generation_config.disable_compile = True
            caches[impl] = static_cache(model, args.prompt + args.new_tokens)
    timed = {loop: time_loop(loop, models, prompts, caches or MODES[mode], args, mode) for loop in args.loops}
    outputs = {impl: greedy(model, prompts, new_tokens=args.new_tokens, cache=caches.get(impl, MODES[mode]),
                            output_logits=True, return_dict_in_generate=True) for impl, model in models.items()}
    quality = compare_logits(outputs["dense"], outputs["sparsecc"])
    choices = {}
    for site in plan:
        choices[site.choice] = choices.get(site.choice, 0) + 1
    rows = []
    for loop, impl in itertools.product(args.loops, models):
        timing = timed[loop][impl]
        sparse = impl == "sparsecc"
        rows.append({"impl": impl, "model": name, "format": f"{args.quantize}-{pattern}" if sparse else args.quantize,
                     "pattern": pattern, "quantize": args.quantize, "mode": mode, "loop": loop, "batch": batch,
                     "prompt": args.prompt, "new_tokens": args.new_tokens, "M": batch * args.prompt,
                     "dtype": str(next(base.parameters()).dtype).replace("torch.", ""),
                     "density": round(report.density, 4), "block": None, "attention": args.attention,
                     "ttft_ms": round(timing.ttft_ms, 3),
                     "tokens_per_s": round(timing.tokens_per_s, 1) if timing.tokens_per_s else None,
                     "rel_err": quality["rel_err"] if sparse else None,
                     "steps_compared": quality["steps_compared"] if sparse else None,
                     "same_tokens": quality["same_tokens"] if sparse else None, "choices": choices if sparse else None,
                     "weight_bytes": plan.bytes_after if sparse else plan.bytes_before})
        if sparse:
            dense_row = rows[-2]
            print(f"{name:9s} {pattern:16s} {args.quantize} b{batch:<3d} {mode:6s} {loop:11s} first token "
                  f"{dense_row['ttft_ms']:8.2f} -> {rows[-1]['ttft_ms']:8.2f} ms   decode "
                  f"{dense_row['tokens_per_s'] or 0:9.1f} -> {rows[-1]['tokens_per_s'] or 0:9.1f} tokens/s   rel_err "
                  f"{quality['rel_err']:.2e} ({time.perf_counter() - started:.1f} s)", flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=None)
    parser.add_argument("--patterns", nargs="+", default=None, help=f"pruning patterns, e.g. {' '.join(PATTERNS)}")
    parser.add_argument("--batches", nargs="+", type=int, default=None)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=["graphs"])
    parser.add_argument("--loops", nargs="+", choices=list(LOOPS), default=list(LOOPS),
                        help="what generates: model.generate, sparsecc.generation.greedy_loop (default both)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt length in tokens (default 512)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sequence (default 128)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per impl, the median kept (default 3)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="2-layer models of each family, for a smoke run")
    parser.add_argument("--force-formats", action="store_true",
                        help="run each pattern's format wherever it fits (default: the cost model chooses)")
    parser.add_argument("--build-only", action="store_true",
                        help="compile every case's sparsecc model (building its kernels into the cache), time nothing")
    parser.add_argument("--show-plan", action="store_true", help="print each sparsecc model's plan (its reasons)")
    parser.add_argument("--fixed-dispatch", action="store_true",
                        help="run the shipped tuning table's launches, tuning nothing (default: tune as compile does)")
    parser.add_argument("--quantize", choices=["fp8"], default=None,
                        help="quantize both sides (sparsecc.quantize) and compile them dense and n:m (see above)")
    parser.add_argument("--criterion", choices=["magnitude", "wanda"], default="magnitude",
                        help="how sparsecc.prune picks the weights it keeps (wanda: on random-token prompts)")
    parser.add_argument("--attention", choices=ATTENTIONS, default="grouped",
                        help="the attention of both sides (default grouped: a decode step reads each key/value head "
                             "once; sdpa: Hugging Face's)")
    parser.add_argument("--backend", action="store_true",
                        help="graphs mode: also time the model through torch.compile(backend=\"sparsecc\") (see above)")
    parser.add_argument("--backend-only", action="store_true",
                        help="graphs mode: time the backend impl (as --backend) and not sparsecc.compile's")
    parser.add_argument("--profile", action="store_true",
                        help="add each row's decode step kernels (torch.profiler; see above)")
    parser.add_argument("--stem", default="generate", help="the results file's name before the device")
    parser.add_argument("--plot", metavar="JSON", help="only draw the plot of an existing results file")
    args = parser.parse_args(argv)
    if args.plot:
        result = json.loads(Path(args.plot).read_text())
        plot(result, Path(args.plot).with_suffix(".png"))
        return result
    if args.backend_only and (args.build_only or args.quantize or args.modes != ["graphs"]):
        parser.error("--backend-only times the backend in graphs mode only; not with --build-only or --quantize")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (use --device cpu --tiny for a smoke run)")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    if args.fixed_dispatch:
        fixed_dispatch()
    else:
        private_tuning("generate")
    set_recompile_limit()
    result = environment("generate")
    result["transformers"] = __import__("transformers").__version__
    chosen = cases(args)
    keys = {(m, p, b, mode, args.criterion, args.attention) for m, p, b in chosen for mode in args.modes}
    earlier = RESULTS / f"{args.stem}-{result['device'].replace(' ', '_').replace('/', '_')}-{result['date']}.json"
    if earlier.is_file() and not args.build_only:      # a run of some cases keeps the others' rows of the day
        result["rows"] = [r for r in json.loads(earlier.read_text())["rows"]
                          if (r["model"], r["pattern"], r["batch"], r["mode"], r.get("criterion", "magnitude"),
                              r.get("attention", "sdpa")) not in keys]
    path = None
    for (name, batch), group in itertools.groupby(sorted(chosen, key=lambda c: (c[0], c[2])), key=lambda c: (c[0], c[2])):
        patterns = list(dict.fromkeys(p for _, p, _ in group))
        for mode in args.modes[:1] if args.build_only else args.modes:      # building needs one mode
            result["rows"] += run_group(name, batch, patterns, mode, args, device, dtype)
            if not args.build_only:
                path = write(result, stem=args.stem)      # after every group: a time limit loses nothing done
                plot(result, path.with_suffix(".png"))
    if path is not None:
        print("wrote", path)
    return result


def plot(result: dict, path) -> None:
    """Per case, sparsecc's speedup over dense: time to the first token and decode tokens per second."""
    plot_generation_speedups(
        result, path, lambda row: (row["model"], row["pattern"], row["batch"], row["mode"], row.get("loop", "generate"),
                                   row.get("attention", "sdpa")),
        lambda case: f"{case[0]} {case[1]}\nbatch {case[2]} {case[3]}\n{case[4]} {case[5]}",
        first_label="time to first token",
        title=f"generate, {result['device']}, torch {result['torch']}, transformers {result.get('transformers')}")

if __name__ == "__main__":
    main()
