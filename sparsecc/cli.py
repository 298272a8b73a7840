"""The ``sparsecc`` command line.

    sparsecc plan MODEL [--prune 2:4] [--formats 2:4 csr] [--json]
    sparsecc compile MODEL --out model.pt [--prune ...] [--kernels DIR]
    sparsecc generate (MODEL | plan.json) --arch sm_90a --out DIR [--tuning]
    sparsecc bench MODEL [--prune ...] [--json]
    sparsecc bench CAUSAL_LM --generate [--new-tokens N] [--cache static [--loop greedy_loop]] [--prune ...]
    sparsecc tune MODEL [--prune ...] [--m-range LO HI] [--all]
    sparsecc tune --shapes NxK ... --ms M ... [--dtype float16]
    sparsecc calibrate
    sparsecc cache ls|verify|clear

MODEL is a built-in name (see ``sparsecc plan --help``) or ``file.py:function`` returning
``(model, example_inputs)``. Logging follows ``--log`` (or SPARSECC_LOG).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

import torch
from torch.utils.benchmark import Timer

from ._version import __version__
from .compiler import compile as compile_model
from .compiler import generates
from .compiler import plan as plan_model
from .config import configure_logging
from .errors import InputError, SparseccError
from .frontend.tracing import normalize_inputs
from .generation import GRAPH_WARMUP, time_generate_each
from .grouped_attention import use_grouped_attention
from .ir.plan import Plan
from .kernels import registry, tune
from .kernels.base import kernels_unavailable
from .kernels.sparse24_small import choose
from .models import BUILTIN, CAUSAL, load
from .planner import calibrate as calibration
from .planner.fit import cache_path
from .pruning import prune
from .runtime import kernel_dir
from .runtime.build import KernelCache, file_sha256


def _model_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument("model", nargs=None if required else "?", help=f"one of {', '.join(BUILTIN)}, or file.py:function returning (model, inputs)"
                                      " (generate also takes a plan.json)")
    parser.add_argument("--batch", type=int, default=8, help="batch size of the example inputs (default 8)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length of the example inputs (default 128)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                        help="cast the model (default: float16 on CUDA, float32 on CPU)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--prune", metavar="PATTERN", help="prune first, e.g. 2:4, unstructured@0.1, block64x64@0.1")
    parser.add_argument("--exclude", nargs="+", metavar="GLOB",
                        help="module names --prune leaves dense, e.g. '*lm_head*' '*embed*'")
    parser.add_argument("--formats", nargs="+", metavar="FORMAT", help="restrict the formats, e.g. 2:4 csr bsr")
    parser.add_argument("--m-range", nargs=2, type=int, metavar=("LO", "HI"),
                        help="batch sizes the model will run at (default: the example inputs' M; for a "
                             "causal LM, 1 to it)")
    parser.add_argument("--objective", choices=("latency", "memory"), default="latency",
                        help="fastest format, or fewest bytes within 10%% of the fastest")


def _prepared(args, default_dtype=None):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    default_dtype = default_dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype
    model, inputs = load(args.model, batch=args.batch, seq=args.seq, device=device)
    model = model.to(device=device, dtype=dtype)
    if isinstance(inputs, torch.Tensor):
        inputs = inputs.to(device, dtype if inputs.is_floating_point() else inputs.dtype)
    if args.prune:
        print(prune(model, args.prune, exclude=args.exclude).table(), file=sys.stderr)
    return model, inputs


def _plan(args) -> int:
    model, inputs = _prepared(args)
    result = plan_model(model, inputs, formats=args.formats, m_range=args.m_range, objective=args.objective)
    print(result.to_json() if args.json else result.table())
    return 0


def _compile(args) -> int:
    model, inputs = _prepared(args)
    compiled = compile_model(model, inputs, formats=args.formats, kernels=args.kernels, m_range=args.m_range,
                             objective=args.objective)
    torch.save(compiled, args.out)
    plan = compiled.sparsecc_plan
    print(plan.to_json() if args.json else plan.table())
    print(f"saved to {args.out}", file=sys.stderr)
    return 0


def _generate(args) -> int:
    """Kernels for a plan file, or for a model's 2:4 sites (planned here, on any machine)."""
    if args.model.endswith(".json"):
        the_plan = Plan.from_json(args.model)
    else:
        args.device = args.device or "cpu"
        model, inputs = _prepared(args, default_dtype=torch.float16)
        the_plan = plan_model(model, inputs, formats=args.formats or ("2:4",))
    specs = registry.plan_kernels(the_plan)
    if specs and args.tuning:
        specs = list(dict.fromkeys(specs + registry.tuning_kernels(the_plan)))
    if not specs:
        print("sparsecc: no site of this plan runs on a generated kernel (no sparse site of a supported "
              "shape and dtype): nothing to generate", file=sys.stderr)
        return 1
    out = kernel_dir.write(specs, args.out, progress=not args.json)
    if args.json:
        print((out / kernel_dir.MANIFEST).read_text())
    else:
        print(f"wrote {len(specs)} kernels for {', '.join(args.arch)} to {out}")
        for spec in specs:
            print(f"  {spec.symbol}")
    return 0


def _bench(args) -> int:
    """Time the eager model and the compiled one on the example inputs."""
    if args.generate:
        return _bench_generate(args)
    model, inputs = _prepared(args)
    compiled = compile_model(model, inputs, formats=args.formats, kernels=args.kernels, m_range=args.m_range,
                             objective=args.objective)
    args_, kwargs = normalize_inputs(inputs)
    call = lambda module: module(*args_, **kwargs)  # noqa: E731
    rows = []
    with torch.no_grad():
        for name, module in (("eager", model), ("sparsecc", compiled)):
            timer = Timer("call(module)", globals={"call": call, "module": module})
            rows.append({"impl": name, "ms": timer.blocked_autorange(min_run_time=args.seconds).median * 1e3})
    plan = compiled.sparsecc_plan
    summary = {"model": args.model, "device": str(next(model.parameters()).device), "batch": args.batch,
               "seq": args.seq, "rows": rows, "speedup": rows[0]["ms"] / rows[1]["ms"],
               "weight_bytes_before": plan.bytes_before, "weight_bytes_after": plan.bytes_after}
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        for row in rows:
            print(f"{row['impl']:>9}: {row['ms']:9.3f} ms")
        print(f"  speedup: {summary['speedup']:.2f}x   weights: {plan.bytes_before / 2**20:.1f} MiB -> "
              f"{plan.bytes_after / 2**20:.1f} MiB")
    return 0


def _bench_generate(args) -> int:
    """Time greedy generation (sparsecc.generation) by the eager model and the compiled one, from
    prompts of --batch x --seq tokens: time to the first token and decode tokens per second."""
    if args.model in BUILTIN and args.model not in CAUSAL:
        raise InputError(f"{args.model} has no language-model head and cannot generate: --generate takes a causal LM, "
                         f"{' or '.join(CAUSAL)}, or file.py:function returning one")
    if args.new_tokens < 1:
        raise InputError(f"--new-tokens must be at least 1, got {args.new_tokens}")
    if args.loop == "greedy_loop" and args.cache != "static":
        raise InputError("--loop greedy_loop fills a static cache: add --cache static")
    model, inputs = _prepared(args)
    if not generates(model):
        raise InputError(f"{args.model} cannot generate: --generate takes a causal LM with a generate method "
                         "(e.g. a Hugging Face *ForCausalLM)")
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2 or inputs.is_floating_point():
        raise InputError(f"{args.model}: --generate needs example inputs that are token ids [batch, prompt length]")
    if args.grouped_attention:
        use_grouped_attention(model)                     # before compile: both models run it
    compiled = compile_model(model, inputs, formats=args.formats, kernels=args.kernels, m_range=args.m_range,
                             objective=args.objective)
    warmup = GRAPH_WARMUP if args.cache == "static" and inputs.device.type == "cuda" else 1
    timings = time_generate_each({"eager": model, "sparsecc": compiled}, inputs, new_tokens=args.new_tokens,
                                 cache=args.cache, repeats=args.repeats, warmup=warmup, loop=args.loop)
    rows = [{"impl": name, "ttft_ms": t.ttft_ms, "tokens_per_s": t.tokens_per_s, "sequences": t.sequences}
            for name, t in timings.items()]
    same = torch.equal(rows[0].pop("sequences"), rows[1].pop("sequences"))
    plan = compiled.sparsecc_plan
    decode = (rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]) if rows[0]["tokens_per_s"] else None
    summary = {"model": args.model, "device": str(inputs.device), "batch": inputs.shape[0], "prompt": inputs.shape[1],
               "new_tokens": args.new_tokens, "cache": args.cache or "dynamic", "loop": args.loop,
               "attention": getattr(getattr(compiled, "config", None), "_attn_implementation", None), "rows": rows,
               "ttft_speedup": rows[0]["ttft_ms"] / rows[1]["ttft_ms"], "decode_speedup": decode,
               "same_tokens": same, "m_range": plan.sites[0].m_range if plan.sites else None,
               "weight_bytes_before": plan.bytes_before, "weight_bytes_after": plan.bytes_after}
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    for row in rows:
        rate = f"{row['tokens_per_s']:10.1f} tokens/s" if row["tokens_per_s"] else "         - (one token)"
        print(f"{row['impl']:>9}: first token {row['ttft_ms']:9.2f} ms   decode {rate}")
    print(f"  speedup: first token {summary['ttft_speedup']:.2f}x" + (f", decode {decode:.2f}x" if decode else "")
          + f"   same tokens: {'yes' if same else 'NO'}   weights: {plan.bytes_before / 2**20:.1f} MiB -> "
            f"{plan.bytes_after / 2**20:.1f} MiB")
    return 0


def _cache(args) -> int:
    cache = KernelCache()
    entries = sorted((cache.root / "kernels").iterdir()) if (cache.root / "kernels").is_dir() else []
    if args.action == "clear":
        for entry in entries:
            shutil.rmtree(entry, ignore_errors=True)
        print(f"removed {len(entries)} kernels from {cache.root}")
        return 0
    rows, damaged = [], 0
    for entry in entries:
        try:
            manifest = json.loads((entry / "manifest.json").read_text())
            intact = manifest["sha256"] == file_sha256(entry / "kernel.so")
        except (OSError, ValueError, KeyError):
            manifest, intact = {"symbol": "?"}, False
        damaged += not intact
        rows.append({"key": entry.name[:16], "symbol": manifest.get("symbol"), "intact": intact,
                     "bytes": (entry / "kernel.so").stat().st_size if (entry / "kernel.so").exists() else 0})
    if args.json:
        print(json.dumps({"root": str(cache.root), "kernels": rows}, indent=1))
    else:
        print(f"{cache.root}: {len(rows)} kernels")
        for row in rows:
            print(f"  {row['key']}  {'ok     ' if row['intact'] else 'DAMAGED'}  {row['bytes'] / 2**20:6.2f} MiB  {row['symbol']}")
    return 1 if args.action == "verify" and damaged else 0


def _tune(args) -> int:
    """Time the launch candidates of the kernel families a model (or the given shapes) needs on
    this GPU, and cache the winners (sparsecc.kernels.tune)."""
    if args.all:
        os.environ["SPARSECC_TUNE"] = "all"
    elif os.environ.get("SPARSECC_TUNE", "new") == "off":
        os.environ["SPARSECC_TUNE"] = "new"
    why_not = kernels_unavailable("cuda")
    if why_not:
        raise InputError(f"tuning times sparsecc's kernels on a Hopper GPU: {why_not}")
    start = len(tune.LOG)
    if args.shapes:
        if args.model:
            raise InputError("tune takes a MODEL or --shapes, not both")
        dtype = getattr(torch, args.dtype or "float16")
        for shape in args.shapes:
            for m in args.ms:
                family = choose(dtype, shape, m, tune_first=True, progress=True)
                family.dispatch(dtype, shape, (m, m), progress=True)
    elif args.model:
        model, inputs = _prepared(args)
        compile_model(model, inputs, formats=args.formats, m_range=args.m_range, objective=args.objective)
    else:
        raise InputError("tune needs a MODEL or --shapes NxK ... (with --ms)")
    tuned = tune.log_since(start)
    if args.json:
        print(json.dumps({"table": str(tune.table().path), "tuned": tuned}, indent=1))
        return 0
    seconds = sum(t["seconds"] for t in tuned)
    print(f"tuned {len(tuned)} launch choice(s) in {seconds:.1f} s; this GPU's table: {tune.table().path}")
    for t in tuned:
        print(f"  {t['family']:14s} {t['n']}x{t['k']} {t['dtype']} M={t['m']:<5d} {t['us']:9.2f} us  "
              f"{t['launch']}  ({t['candidates']} candidates, {t['seconds']:.1f} s)")
    return 0


def _shape(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a weight shape NxK (out x in features), e.g. 4096x11008")
    return int(match[1]), int(match[2])


def _calibrate(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    result = calibration.calibrate(device, progress=not args.json)
    if args.json:
        print(result.to_json())
        return 0
    print(f"calibrated {result.device}: {len(result.measurements)} measurements, saved to "
          f"{cache_path(device)}")
    for name, fit in result.fits.items():
        cached = (f" ({_rate(fit.cache_bandwidth, 1e9, 'GB/s', BANDWIDTH_LIMIT)} for the first "
                  f"{fit.cache_bytes / 2**20:.0f} MiB)" if fit.cache_bytes else "")
        print(f"  {name:22s} overhead {fit.overhead_us:8.1f} us  {_rate(fit.rate, 1e12, 'Tflop/s', RATE_LIMIT)}  "
              f"{_rate(fit.bandwidth, 1e9, 'GB/s', BANDWIDTH_LIMIT)}{cached}  p={fit.p:.1f}  "
              f"median error {fit.median_error:.0%} over {fit.points}")
    print("  (n/a: the probes' times did not depend on it, so the fit left it unbounded)")
    return 0


#: above these a fitted rate or bandwidth is no machine's: the probes did not constrain it
RATE_LIMIT, BANDWIDTH_LIMIT = 1e17, 1e14


def _rate(value: float, scale: float, unit: str, limit: float) -> str:
    return f"{value / scale:8.1f} {unit}" if value <= limit else f"{'n/a':>8s} {unit}"


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="sparsecc", description="A compiler that makes sparse PyTorch models fast.")
    top.add_argument("--version", action="version", version=f"sparsecc {__version__}")
    top.add_argument("--log", default=None, type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                     help="log level (default: SPARSECC_LOG, else WARNING)")
    commands = top.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="print what compile would do to a model, and why")
    _model_arguments(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(run=_plan)
    comp = commands.add_parser("compile", help="compile a model and save it (torch.save)",
                               description="Compile a model and save the module with torch.save. Load it back "
                                           "with torch.load(path, weights_only=False) after import sparsecc "
                                           "(it is a module, not a state dict), on the same kind of device.")
    _model_arguments(comp)
    comp.add_argument("--out", required=True, help="where to save the compiled module")
    comp.add_argument("--json", action="store_true", help="print the plan as JSON")
    comp.add_argument("--kernels", metavar="DIR", help="load kernels from a `sparsecc generate` directory")
    comp.set_defaults(run=_compile)
    gen = commands.add_parser("generate", help="build a plan's kernels ahead of time into a directory",
                              description="Render, compile and collect the kernels a model (or a saved plan) "
                                          "needs, with build.ninja and a manifest of hashes; load them later "
                                          "with `sparsecc.compile(..., kernels=DIR)` or SPARSECC_KERNELS=DIR, "
                                          "with no compiler on that machine.")
    _model_arguments(gen)
    gen.add_argument("--arch", action="append", choices=("sm_90a",), required=True,
                     help="target architecture (Hopper: sm_90a)")
    gen.add_argument("--out", required=True, help="the directory to write")
    gen.add_argument("--json", action="store_true", help="print the manifest as JSON")
    gen.add_argument("--tuning", action="store_true",
                     help="also build every launch candidate tuning times for these shapes, so that a machine "
                          "without a CUDA compiler tunes them on its own GPU (several times the kernels)")
    gen.set_defaults(run=_generate)
    bench = commands.add_parser("bench", help="time a model eagerly and compiled by sparsecc",
                                description="Time a model on its example inputs eagerly and compiled by sparsecc; "
                                            "with --generate, time greedy generation by a causal LM from prompts of "
                                            "--batch x --seq tokens: the time to the first token and decode tokens "
                                            "per second (sparsecc plans the layers from one token to the prompts).")
    _model_arguments(bench)
    bench.add_argument("--kernels", metavar="DIR", help="load kernels from a `sparsecc generate` directory")
    bench.add_argument("--seconds", type=float, default=1.0, help="measuring time per implementation")
    bench.add_argument("--json", action="store_true", help="print the timings as JSON")
    bench.add_argument("--generate", action="store_true",
                       help=f"time model.generate instead (a causal LM: {', '.join(CAUSAL)} or file.py:function)")
    bench.add_argument("--new-tokens", type=int, default=32, help="with --generate: tokens to generate (default 32)")
    bench.add_argument("--cache", choices=("static",), default=None,
                       help="with --generate: the static KV cache (default: the dynamic one); on the GPU, "
                            "generate then compiles each decode step with CUDA graphs, for both models")
    bench.add_argument("--loop", choices=("generate", "greedy_loop"), default="generate",
                       help="with --generate: model.generate (default), or sparsecc.generation.greedy_loop "
                            "(greedy decoding without generate's work between steps; needs --cache static)")
    bench.add_argument("--grouped-attention", action="store_true",
                       help="with --generate: both models run sparsecc.grouped_attention (a decode step reads each "
                            "key/value head once instead of a copy per query head)")
    bench.add_argument("--repeats", type=int, default=3, help="with --generate: timed calls, the median kept")
    bench.set_defaults(run=_bench)
    tun = commands.add_parser("tune", help="time the kernels' launches on this GPU for a model's (or given) shapes",
                              description="Time every launch candidate of the kernel families a model needs "
                                          "(or, with --shapes, 2:4 weights of those shapes at the --ms batch "
                                          "sizes) on this GPU, and cache the fastest per shape, dtype and batch "
                                          "bucket for this GPU and these torch/sparsecc versions. Compile does "
                                          "the same for what it needs unless SPARSECC_TUNE=off.")
    _model_arguments(tun, required=False)
    tun.add_argument("--shapes", nargs="+", type=_shape, metavar="NxK", help="weight shapes (out x in features)")
    tun.add_argument("--ms", nargs="+", type=int, default=[1, 16, 64], metavar="M",
                     help="batch sizes to tune the --shapes for (default 1 16 64)")
    tun.add_argument("--all", action="store_true", help="time again what was tuned before")
    tun.add_argument("--json", action="store_true", help="print what was tuned as JSON")
    tun.set_defaults(run=_tune)
    cal = commands.add_parser("calibrate", help="measure this machine for the cost model (cached per machine)",
                              description="Time every implementation the cost model chooses between on a small "
                                          "grid of shapes, fit its numbers and cache them for this GPU (or CPU) "
                                          "and these torch/CUDA/sparsecc versions. Plans made afterwards use them.")
    cal.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    cal.add_argument("--json", action="store_true", help="print the calibration as JSON")
    cal.set_defaults(run=_calibrate)
    cache = commands.add_parser("cache", help="list, verify or clear the compiled-kernel cache")
    cache.add_argument("action", choices=("ls", "verify", "clear"))
    cache.add_argument("--json", action="store_true")
    cache.set_defaults(run=_cache)
    return top


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logger = configure_logging()
    if args.log:
        logger.setLevel(args.log)
    try:
        return args.run(args)
    except SparseccError as error:
        print(f"sparsecc: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
