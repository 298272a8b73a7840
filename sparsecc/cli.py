"""The ``sparsecc`` command line.

    sparsecc plan MODEL [--prune 2:4] [--formats 2:4 csr] [--json]
    sparsecc compile MODEL --out model.pt [--prune ...] [--kernels DIR]
    sparsecc generate (MODEL | plan.json) --arch sm_90a [--arch sm_80] --out DIR
    sparsecc bench MODEL [--prune ...] [--json]
    sparsecc cache ls|verify|clear

MODEL is a built-in name (see ``sparsecc plan --help``) or ``file.py:function`` returning
``(model, example_inputs)``. Logging follows ``--log`` (or SPARSECC_LOG).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys

import torch

from . import __version__
from .errors import SparseccError


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    from .models import BUILTIN
    parser.add_argument("model", help=f"one of {', '.join(BUILTIN)}, or file.py:function returning (model, inputs)"
                                      " (generate also takes a plan.json)")
    parser.add_argument("--batch", type=int, default=8, help="batch size of the example inputs (default 8)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length of the example inputs (default 128)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                        help="cast the model (default: float16 on CUDA, float32 on CPU)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--prune", metavar="PATTERN", help="prune first, e.g. 2:4, unstructured@0.1, block64x64@0.1")
    parser.add_argument("--formats", nargs="+", metavar="FORMAT", help="restrict the formats, e.g. 2:4 csr bsr")
    parser.add_argument("--m-range", nargs=2, type=int, metavar=("LO", "HI"),
                        help="batch sizes the model will run at (default: the example inputs' M)")
    parser.add_argument("--objective", choices=("latency", "memory"), default="latency",
                        help="fastest format, or fewest bytes within 10%% of the fastest")


def _prepared(args, default_dtype=None):
    from .models import load
    from .pruning import prune
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    default_dtype = default_dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype
    model, inputs = load(args.model, batch=args.batch, seq=args.seq)
    model = model.to(device=device, dtype=dtype)
    if isinstance(inputs, torch.Tensor):
        inputs = inputs.to(device, dtype if inputs.is_floating_point() else inputs.dtype)
    if args.prune:
        print(prune(model, args.prune).table(), file=sys.stderr)
    return model, inputs


def _plan(args) -> int:
    from .compiler import plan
    model, inputs = _prepared(args)
    result = plan(model, inputs, formats=args.formats, m_range=args.m_range, objective=args.objective)
    print(result.to_json() if args.json else result.table())
    return 0


def _compile(args) -> int:
    from .compiler import compile as compile_model
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
    from . import kernel_dir
    from .compiler import plan as plan_model
    from .gpu import plan_kernels
    from .plan import Plan
    if args.model.endswith(".json"):
        the_plan = Plan.from_json(args.model)
    else:
        args.device = args.device or "cpu"
        model, inputs = _prepared(args, default_dtype=torch.float16)
        the_plan = plan_model(model, inputs, formats=args.formats or ("2:4",))
    specs = plan_kernels(the_plan, archs=tuple(args.arch))
    if not specs:
        print("sparsecc: no site of this plan runs on a generated kernel (no 2:4 site of a supported "
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
    from torch.utils.benchmark import Timer
    from .compiler import compile as compile_model
    from .tracing import normalize_inputs
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


def _cache(args) -> int:
    from .build import KernelCache, _sha256
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
            intact = manifest["sha256"] == _sha256(entry / "kernel.so")
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


def _calibrate(args) -> int:
    from . import calibration
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    result = calibration.calibrate(device, progress=not args.json)
    if args.json:
        print(result.to_json())
        return 0
    print(f"calibrated {result.device}: {len(result.measurements)} measurements, saved to "
          f"{calibration.cache_path(device)}")
    for name, fit in result.fits.items():
        cached = (f" ({fit.cache_bandwidth / 1e9:.1f} GB/s for the first {fit.cache_bytes / 2**20:.0f} MiB)"
                  if fit.cache_bytes else "")
        print(f"  {name:22s} overhead {fit.overhead_us:8.1f} us  {fit.rate / 1e12:8.3f} Tflop/s  "
              f"{fit.bandwidth / 1e9:8.1f} GB/s{cached}  p={fit.p:.1f}  median error {fit.median_error:.0%} "
              f"over {fit.points}")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="sparsecc", description="A compiler that makes sparse PyTorch models fast.")
    top.add_argument("--version", action="version", version=f"sparsecc {__version__}")
    top.add_argument("--log", default=None, help="log level: DEBUG, INFO, WARNING (default: SPARSECC_LOG)")
    commands = top.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="print what compile would do to a model, and why")
    _model_arguments(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(run=_plan)
    comp = commands.add_parser("compile", help="compile a model and save it (torch.save)")
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
    gen.add_argument("--arch", action="append", choices=("sm_90a", "sm_80"), required=True,
                     help="target architecture (repeat for several)")
    gen.add_argument("--out", required=True, help="the directory to write")
    gen.add_argument("--json", action="store_true", help="print the manifest as JSON")
    gen.set_defaults(run=_generate)
    bench = commands.add_parser("bench", help="time a model eagerly and compiled by sparsecc")
    _model_arguments(bench)
    bench.add_argument("--kernels", metavar="DIR", help="load kernels from a `sparsecc generate` directory")
    bench.add_argument("--seconds", type=float, default=1.0, help="measuring time per implementation")
    bench.add_argument("--json", action="store_true", help="print the timings as JSON")
    bench.set_defaults(run=_bench)
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
    from .config import configure_logging
    logger = configure_logging()
    if args.log:
        logger.setLevel(args.log.upper())
    try:
        return args.run(args)
    except SparseccError as error:
        print(f"sparsecc: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
