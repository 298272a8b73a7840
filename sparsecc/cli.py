"""The ``sparsecc`` command line.

    sparsecc plan MODEL [--prune 2:4] [--formats 2:4 csr] [--json]
    sparsecc compile MODEL --out model.pt [--prune ...]
    sparsecc cache ls|verify|clear

MODEL is a built-in name (see ``sparsecc plan --help``) or ``file.py:function`` returning
``(model, example_inputs)``. Logging follows ``--log`` (or SPARSECC_LOG).
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys

import torch

from . import __version__
from .errors import SparseccError


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    from .models import BUILTIN
    parser.add_argument("model", help=f"one of {', '.join(BUILTIN)}, or file.py:function returning (model, inputs)")
    parser.add_argument("--batch", type=int, default=8, help="batch size of the example inputs (default 8)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length of the example inputs (default 128)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                        help="cast the model (default: float16 on CUDA, float32 on CPU)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--prune", metavar="PATTERN", help="prune first, e.g. 2:4, unstructured@0.1, block64x64@0.1")
    parser.add_argument("--formats", nargs="+", metavar="FORMAT", help="restrict the formats, e.g. 2:4 csr bsr")


def _prepared(args):
    from .models import load
    from .pruning import prune
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float16 if device.type == "cuda" else torch.float32)
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
    result = plan(model, inputs, formats=args.formats)
    print(result.to_json() if args.json else result.table())
    return 0


def _compile(args) -> int:
    from .compiler import compile as compile_model
    model, inputs = _prepared(args)
    compiled = compile_model(model, inputs, formats=args.formats)
    torch.save(compiled, args.out)
    plan = compiled.sparsecc_plan
    print(plan.to_json() if args.json else plan.table())
    print(f"saved to {args.out}", file=sys.stderr)
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
    comp.set_defaults(run=_compile)
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
